"""Recurrent layers: RNN, GRU, LSTM (opset 7 and 14+ with ``layout``).

The input projection of every time step is one matmul; the recurrence is unrolled
step by step into the lazy MLX graph, one product of the state with R a step (a GRU's gates
share it; a bidirectional layer whose directions have the same activations runs both in one
batched step: forward time k and reverse time T-1-k). ``sequence_lens`` is a host value: lengths are
checked on the host (1..seq_length, as ORT's CPU EP requires) and become per-step masks
(state carried unchanged and Y zero past a sequence's end). float32 only (ORT's CPU EP
runs these in float32; MLX's float64 exp/tanh is only float32-accurate). On MLX's CUDA backend a layer
with the default activations (an LSTM without peepholes or input_forget) runs every step in one custom
kernel instead (``cuda_recurrent``): a step's launches cost more than its arithmetic.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import build, consts
from .. import cuda_kernels as ck
from .. import cuda_recurrent
from .. import dtypes as dt
from ..registry import register

TYPES = frozenset({dt.FLOAT})
DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}

#: activation -> (number of alpha/beta parameters it reads, fn(x, alpha, beta))
ACTS = {
    "Relu": (0, lambda x, a, b: mx.maximum(x, 0)),
    "Tanh": (0, lambda x, a, b: mx.tanh(x)),
    "Sigmoid": (0, lambda x, a, b: mx.sigmoid(x)),
    "Softsign": (0, lambda x, a, b: x / (1 + mx.abs(x))),
    "Softplus": (0, lambda x, a, b: mx.logaddexp(x, mx.zeros_like(x))),
    "LeakyRelu": (1, lambda x, a, b: mx.where(x >= 0, x, a * x)),
    "ThresholdedRelu": (1, lambda x, a, b: mx.where(x > a, x, 0)),
    "Elu": (1, lambda x, a, b: mx.where(x >= 0, x, a * (mx.exp(x) - 1))),
    "Affine": (2, lambda x, a, b: a * x + b),
    "ScaledTanh": (2, lambda x, a, b: a * mx.tanh(b * x)),
    "HardSigmoid": (2, lambda x, a, b: mx.clip(a * x + b, 0, 1)),
}
DEFAULT_ACTS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}
#: a direction's activations as ``_activations`` describes them, for the cells ``cuda_recurrent`` computes
_DEFAULT_SIGS = {"gru": (("Sigmoid", 0.0, 0.0), ("Tanh", 0.0, 0.0)),
                 "gru_early": (("Sigmoid", 0.0, 0.0), ("Tanh", 0.0, 0.0)),
                 "lstm": (("Sigmoid", 0.0, 0.0), ("Tanh", 0.0, 0.0), ("Tanh", 0.0, 0.0)),
                 "rnn": (("Tanh", 0.0, 0.0),)}


def _s(v):
    return v.decode() if isinstance(v, bytes) else v


def _names(op, activations, n_dirs):
    """Activation names; RNN's schema default ['Tanh', 'Tanh'] on one direction means one Tanh (as ORT reads it)."""
    names = [_s(a) for a in activations] if activations else DEFAULT_ACTS[op] * n_dirs
    if op == "RNN" and n_dirs == 1 and names == ["Tanh", "Tanh"]:
        names = ["Tanh"]
    return names


def _activations(op, activations, alpha, beta, n_dirs):
    """(Per direction, a list of f(x) closures; per direction, their (name, alpha, beta)s); alphas/betas are
    consumed in order by the functions needing them."""
    names = _names(op, activations, n_dirs)
    per = len(DEFAULT_ACTS[op])
    if len(names) != per * n_dirs:
        raise ValueError(f"{op}: {len(names)} activations given, {per * n_dirs} expected")
    alphas, betas = list(alpha or []), list(beta or [])
    fns, sigs = [], []
    for n in names:
        if n not in ACTS:
            raise ValueError(f"{op}: activation {n!r} is not supported")
        k, f = ACTS[n]
        a = alphas.pop(0) if k >= 1 else 0.0
        b = betas.pop(0) if k >= 2 else 0.0
        fns.append(lambda x, f=f, a=a, b=b: f(x, a, b))
        sigs.append((n, float(a), float(b)))
    return ([fns[d * per:(d + 1) * per] for d in range(n_dirs)],
            [tuple(sigs[d * per:(d + 1) * per]) for d in range(n_dirs)])


def _check(op):
    per = len(DEFAULT_ACTS[op])

    def check(view):
        a = view.attrs
        direction = _s(a.get("direction", "forward"))
        if direction not in DIRECTIONS:
            return f"direction {direction!r} is not one of {sorted(DIRECTIONS)}"
        n_dirs = DIRECTIONS[direction]
        names = _names(op, a.get("activations"), n_dirs)
        if len(names) != per * n_dirs:
            return f"{len(names)} activations given, {per * n_dirs} expected"
        bad = [n for n in names if n not in ACTS]
        if bad:
            return f"activation {bad[0]!r} is not supported"
        need_a = sum(ACTS[n][0] >= 1 for n in names)
        need_b = sum(ACTS[n][0] >= 2 for n in names)
        got_a, got_b = len(a.get("activation_alpha") or []), len(a.get("activation_beta") or [])
        if (got_a, got_b) != (need_a, need_b):
            return (f"activation_alpha/beta give {got_a}/{got_b} values, the activations read {need_a}/{need_b} "
                    "(per-function defaults are not implemented)")
        if view.attrs.get("layout", 0) not in (0, 1):
            return f"layout {view.attrs.get('layout')} is not 0 or 1"
        for i in range(1, view.n_inputs):
            if i != 4 and view.has(i) and view.dtype(i) not in (None, dt.FLOAT):
                return f"input {i} is {dt.name(view.dtype(i))}, not float32"
        return None
    return check


def _lengths(sequence_lens, seq, batch):
    """Per-batch lengths as an MLX int32 vector; ValueError unless 1 <= len <= seq."""
    if sequence_lens is None:
        return None
    lens = np.asarray(sequence_lens).astype(np.int64).reshape(-1)
    if lens.shape != (batch,):
        raise ValueError(f"sequence_lens shape {lens.shape} != (batch,) = ({batch},)")
    bad = (lens < 1) | (lens > seq)
    if bad.any():
        raise ValueError(f"sequence_lens value {int(lens[bad][0])} outside [1, {seq}]")
    return None if (lens == seq).all() else mx.array(lens.astype(np.int32))


def _run(step, x_proj, states, live, reverse=False):
    """Unroll ``step(x_t, states) -> (h, states)`` over time; returns (Y list in time order, final states).
    ``live``: None, or per step (in time order) a bool mask broadcasting against the states: where it is false
    the state is carried unchanged and Y is zero."""
    seq = x_proj.shape[0]
    ys = [None] * seq
    order = range(seq - 1, -1, -1) if reverse else range(seq)
    for t in order:
        new = step(x_proj[t], states)
        if live is not None:
            new = tuple(mx.where(live[t], n, s) for n, s in zip(new, states))
            ys[t] = mx.where(live[t], new[0], 0)
        else:
            ys[t] = new[0]
        states = new
    return ys, states


def _clip(x, clip):
    return x if clip is None else mx.clip(x, -clip, clip)


def _fused(kernel, X, W, R, B, lens, inits, sigs, clip, direction, n_dirs, G, H):
    """The layer through ``cuda_recurrent.recurrence`` (one kernel for every step), or None where it does not
    apply: ``kernel`` None (a cell form it lacks), a build without the custom kernels, other activations."""
    # (a shapeless trace would keep this call's sequence length in the kernel's output shapes)
    if kernel is None or not ck.enabled() or build.shapeless() or any(s != _DEFAULT_SIGS[kernel] for s in sigs):
        return None
    seq, batch, _ = X.shape
    if seq == 0 or cuda_recurrent.reason(kernel, X, R, batch, clip) is not None:
        return None
    # every bias the gates add directly goes into the input's product (a GRU's h-gate recurrent bias stays apart)
    xw = X[:, None] @ mx.swapaxes(W, -1, -2)                                     # (T, D, batch, G)
    rbh = None
    if B is not None:
        direct = 2 * H if kernel == "gru" else G
        bias = B[:, :G] + mx.concatenate([B[:, G:G + direct], consts.zeros((n_dirs, G - direct), B.dtype)], axis=1)
        xw = xw + bias[:, None, :]
        rbh = B[:, G + 2 * H:] if kernel == "gru" else None
    if kernel == "gru" and rbh is None:
        rbh = consts.zeros((n_dirs, H), mx.float32)
    zero = consts.zeros((n_dirs, batch, H), X.dtype)
    h0 = zero if inits[0] is None else inits[0]
    c0 = None if kernel != "lstm" else zero if inits[1] is None else inits[1]
    y, yh, yc = cuda_recurrent.recurrence(kernel, xw, R, h0, c0, rbh, lens, reverse_first=direction == "reverse",
                                          clip=clip)
    return (y, yh, yc) if kernel == "lstm" else (y, yh)


def _recurrent(op, cell, X, W, R, B, sequence_lens, inits, *, activations, activation_alpha, activation_beta,
               clip, direction, hidden_size, layout, n_gates, extra=None, kernel=None):
    """Shared driver: layouts, directions, bias split, outputs (Y, Y_h[, Y_c]). ``kernel``: the cell's form in
    ``cuda_recurrent`` ("lstm", "gru", "gru_early", "rnn"), used where the build may (``_fused``)."""
    direction = _s(direction)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction {direction!r} is not one of {sorted(DIRECTIONS)}")
    n_dirs = DIRECTIONS[direction]
    if layout == 1:
        X = mx.swapaxes(X, 0, 1)
        inits = [None if s is None else mx.swapaxes(s, 0, 1) for s in inits]
    seq, batch, _ = X.shape
    H = R.shape[-1]
    if hidden_size is not None and hidden_size != H:
        raise ValueError(f"hidden_size {hidden_size} != R's last dimension {H}")
    if W.shape[0] != n_dirs or W.shape[1] != n_gates * H:
        raise ValueError(f"W shape {tuple(W.shape)} does not fit {n_dirs} direction(s) x {n_gates} gates x {H}")
    lens = _lengths(sequence_lens, seq, batch)
    acts, sigs = _activations(op, activations, activation_alpha, activation_beta, n_dirs)
    G = n_gates * H
    fused = _fused(kernel, X, W, R, B, lens, inits, sigs, clip, direction, n_dirs, G, H)
    if fused is not None:
        Y, *outs = fused
        if layout == 1:
            Y = mx.transpose(Y, (2, 0, 1, 3))
            outs = [mx.swapaxes(o, 0, 1) for o in outs]
        return (Y, *outs)
    x_proj = [X @ W[d].T + (B[d, :G] if B is not None else 0) for d in range(n_dirs)]
    if n_dirs == 2 and sigs[0] == sigs[1] and seq:
        # both directions in one batched step k: forward time k, reverse time T-1-k (states (2, batch, H))
        xw = mx.stack([x_proj[0], x_proj[1][::-1]], axis=1)                          # (T, 2, batch, G)
        states = tuple(mx.zeros((2, batch, H), X.dtype) if s is None else s for s in inits)
        live = None
        if lens is not None:
            t = np.arange(seq)[:, None]
            n = np.asarray(lens)[None, :]
            live = mx.array(np.stack([t < n, t[::-1] < n], axis=1)[..., None])       # (T, 2, batch, 1)
        step = cell(R, None if B is None else B[:, None, G:], acts[0], clip, H,
                    None if extra is None else extra[:, None, :])
        y, st = _run(step, xw, states, live)
        yk = mx.stack(y)                                                              # step order
        Y = mx.concatenate([yk[:, :1], yk[::-1, 1:]], axis=1)                         # (seq, dirs, batch, H)
        outs = list(st)
    else:
        ys, finals = [], []
        for d in range(n_dirs):
            reverse = direction == "reverse" or d == 1
            states = tuple(mx.zeros((batch, H), X.dtype) if s is None else s[d] for s in inits)
            step = cell(R[d], None if B is None else B[d, G:], acts[d], clip, H, None if extra is None else extra[d])
            live = None if lens is None else [mx.expand_dims(t < lens, -1) for t in range(seq)]
            y, st = _run(step, x_proj[d], states, live, reverse)
            ys.append(mx.stack(y) if seq else mx.zeros((0, batch, H), X.dtype))
            finals.append(st)
        Y = mx.stack(ys, axis=1)                                   # (seq, dirs, batch, H)
        outs = [mx.stack([f[k] for f in finals]) for k in range(len(inits))]    # (dirs, batch, H)
    if layout == 1:
        Y = mx.transpose(Y, (2, 0, 1, 3))
        outs = [mx.swapaxes(o, 0, 1) for o in outs]
    return (Y, *outs)


# ---------------------------------------------------------------- RNN
def _rnn_cell(R, rb, acts, clip, H, extra):
    f = acts[0]
    Rt = mx.swapaxes(R, -1, -2)

    def step(xw, states):
        g = xw + states[0] @ Rt
        if rb is not None:
            g = g + rb
        return (f(_clip(g, clip)),)
    return step


def _rnn(X, W, R, B, sequence_lens, initial_h, layout=0, **kw):
    return _recurrent("RNN", _rnn_cell, X, W, R, B, sequence_lens, [initial_h], n_gates=1, layout=layout,
                      kernel="rnn", **kw)


@register("RNN", 7, const=(4,), dtypes=TYPES, check=_check("RNN"))
def rnn_7(X, W, R, B=None, sequence_lens=None, initial_h=None, *, activation_alpha=None, activation_beta=None,
          activations=None, clip=None, direction="forward", hidden_size=None):
    """Ht = f(Xt W^T + Ht-1 R^T + Wb + Rb)."""
    return _rnn(X, W, R, B, sequence_lens, initial_h, activation_alpha=activation_alpha,
                activation_beta=activation_beta, activations=activations, clip=clip, direction=direction,
                hidden_size=hidden_size)


@register("RNN", 14, const=(4,), dtypes=TYPES, check=_check("RNN"))
def rnn_14(X, W, R, B=None, sequence_lens=None, initial_h=None, *, activation_alpha=None, activation_beta=None,
           activations=None, clip=None, direction="forward", hidden_size=None, layout=0):
    return _rnn(X, W, R, B, sequence_lens, initial_h, layout, activation_alpha=activation_alpha,
                activation_beta=activation_beta, activations=activations, clip=clip, direction=direction,
                hidden_size=hidden_size)


# ---------------------------------------------------------------- GRU
def _gru_cell(linear_before_reset):
    def cell(R, rb, acts, clip, H, extra):
        f, g = acts
        Rt = mx.swapaxes(R, -1, -2)                  # (..., H, 3H): z, r, h columns
        Rzr, Rh = (Rt, None) if linear_before_reset else (Rt[..., :2 * H], Rt[..., 2 * H:])
        rbz, rbr, rbh = (None, None, None) if rb is None else (rb[..., :H], rb[..., H:2 * H], rb[..., 2 * H:])

        def add(a, b):
            return a if b is None else a + b

        def step(xw, states):
            h = states[0]
            xz, xr, xh = xw[..., :H], xw[..., H:2 * H], xw[..., 2 * H:]
            hr = h @ Rzr                             # one product for the gates that read h
            z = f(_clip(add(xz + hr[..., :H], rbz), clip))
            r = f(_clip(add(xr + hr[..., H:2 * H], rbr), clip))
            if linear_before_reset:
                hh = g(_clip(xh + r * add(hr[..., 2 * H:], rbh), clip))
            else:
                hh = g(_clip(add(xh + (r * h) @ Rh, rbh), clip))
            return ((1 - z) * hh + z * h,)
        return step
    return cell


def _gru(X, W, R, B, sequence_lens, initial_h, linear_before_reset, layout=0, **kw):
    return _recurrent("GRU", _gru_cell(linear_before_reset), X, W, R, B, sequence_lens, [initial_h], n_gates=3,
                      layout=layout, kernel="gru" if linear_before_reset else "gru_early", **kw)


@register("GRU", 7, const=(4,), dtypes=TYPES, check=_check("GRU"))
def gru_7(X, W, R, B=None, sequence_lens=None, initial_h=None, *, activation_alpha=None, activation_beta=None,
          activations=None, clip=None, direction="forward", hidden_size=None, linear_before_reset=0):
    """Gates z, r, h; Ht = (1 - z) * h~ + z * Ht-1."""
    return _gru(X, W, R, B, sequence_lens, initial_h, linear_before_reset, activation_alpha=activation_alpha,
                activation_beta=activation_beta, activations=activations, clip=clip, direction=direction,
                hidden_size=hidden_size)


@register("GRU", 14, const=(4,), dtypes=TYPES, check=_check("GRU"))
def gru_14(X, W, R, B=None, sequence_lens=None, initial_h=None, *, activation_alpha=None, activation_beta=None,
           activations=None, clip=None, direction="forward", hidden_size=None, layout=0, linear_before_reset=0):
    return _gru(X, W, R, B, sequence_lens, initial_h, linear_before_reset, layout,
                activation_alpha=activation_alpha, activation_beta=activation_beta, activations=activations,
                clip=clip, direction=direction, hidden_size=hidden_size)


# ---------------------------------------------------------------- LSTM
def _lstm_cell(input_forget):
    def cell(R, rb, acts, clip, H, P):
        f, g, h_act = acts
        Rt = mx.swapaxes(R, -1, -2)

        def step(xw, states):
            h, c = states
            gates = xw + h @ Rt
            if rb is not None:
                gates = gates + rb
            gi, go, gf, gc = (gates[..., k * H:(k + 1) * H] for k in range(4))
            if P is not None:
                gi, gf = gi + P[..., :H] * c, gf + P[..., 2 * H:] * c
            i = f(_clip(gi, clip))
            fg = 1 - i if input_forget else f(_clip(gf, clip))
            c_new = fg * c + i * g(_clip(gc, clip))
            if P is not None:
                go = go + P[..., H:2 * H] * c_new
            o = f(_clip(go, clip))
            return o * h_act(c_new), c_new
        return step
    return cell


def _lstm(X, W, R, B, sequence_lens, initial_h, initial_c, P, input_forget, layout=0, **kw):
    return _recurrent("LSTM", _lstm_cell(input_forget), X, W, R, B, sequence_lens, [initial_h, initial_c],
                      n_gates=4, layout=layout, extra=P, kernel="lstm" if P is None and not input_forget else None,
                      **kw)


@register("LSTM", 7, const=(4,), dtypes=TYPES, check=_check("LSTM"))
def lstm_7(X, W, R, B=None, sequence_lens=None, initial_h=None, initial_c=None, P=None, *, activation_alpha=None,
           activation_beta=None, activations=None, clip=None, direction="forward", hidden_size=None,
           input_forget=0):
    """Gates i, o, f, c with optional peepholes P (i, o, f); outputs Y, Y_h, Y_c."""
    return _lstm(X, W, R, B, sequence_lens, initial_h, initial_c, P, input_forget,
                 activation_alpha=activation_alpha, activation_beta=activation_beta, activations=activations,
                 clip=clip, direction=direction, hidden_size=hidden_size)


@register("LSTM", 14, const=(4,), dtypes=TYPES, check=_check("LSTM"))
def lstm_14(X, W, R, B=None, sequence_lens=None, initial_h=None, initial_c=None, P=None, *, activation_alpha=None,
            activation_beta=None, activations=None, clip=None, direction="forward", hidden_size=None,
            input_forget=0, layout=0):
    return _lstm(X, W, R, B, sequence_lens, initial_h, initial_c, P, input_forget, layout,
                 activation_alpha=activation_alpha, activation_beta=activation_beta, activations=activations,
                 clip=clip, direction=direction, hidden_size=hidden_size)
