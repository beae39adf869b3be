"""An LSTM / GRU layer's recurrence as one custom CUDA kernel (``cuda_recurrent.recurrence``).

Its contract is written out here in float64 NumPy. Everywhere (CI) the translators run with the contract standing in
for the kernel: which layers reach it (LSTM without peepholes or input_forget, GRU, the default activations,
float32) and with what (the input's product, the folded biases, initial states, lengths,
directions, layouts), against the ops' unrolled steps. On MLX's CUDA backend the kernel itself is checked against the
contract, alone and inside a compiled function; ``tests/ops/test_recurrent.py`` checks the translators against ORT's
CPU EP there too (its eligible cases then take the kernel)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ortmlx.kernels import build, cuda_kernels, cuda_recurrent
from ortmlx.kernels.ops import recurrent as rc

CUDA = cuda_kernels.cuda_backend()
gpu_only = pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")
RNG = np.random.default_rng(11)


def reference_recurrence(cell, xw, r, h0, c0, rbh, lens, *, reverse_first=False, clip=None):
    """``recurrence``'s contract in float64: (Y [T, D, B, H], Y_h, Y_c or None)."""
    xw, r, h0 = (np.asarray(a, np.float64) for a in (xw, r, h0))
    t_len, dirs, batch, _ = xw.shape
    h = r.shape[-1]
    c0 = np.zeros_like(h0) if c0 is None or cell != "lstm" else np.asarray(c0, np.float64)
    lens = np.full(batch, t_len) if lens is None else np.asarray(lens)
    cl = (lambda v: v) if clip is None else (lambda v: np.clip(v, -clip, clip))

    def sig(v):
        return 1.0 / (1.0 + np.exp(-v))
    y = np.zeros((t_len, dirs, batch, h))
    yh, yc = np.zeros((dirs, batch, h)), np.zeros((dirs, batch, h))
    for d in range(dirs):
        hs, cs = h0[d].copy(), c0[d].copy()
        for k in range(t_len):
            t = t_len - 1 - k if (d == 1 or reverse_first) else k
            x, hr = xw[t, d], hs @ r[d].T
            if cell == "rnn":
                hn, cn = np.tanh(cl(x + hr)), cs
            elif cell == "lstm":
                g = x + hr
                gi, go, gf, gc = (g[:, q * h:(q + 1) * h] for q in range(4))
                cn = sig(cl(gf)) * cs + sig(cl(gi)) * np.tanh(cl(gc))
                hn = sig(cl(go)) * np.tanh(cn)
            else:
                z = sig(cl(x[:, :h] + hr[:, :h]))
                rr = sig(cl(x[:, h:2 * h] + hr[:, h:2 * h]))
                if cell == "gru":
                    hh = np.tanh(cl(x[:, 2 * h:] + rr * (hr[:, 2 * h:] + np.asarray(rbh, np.float64)[d])))
                else:
                    hh = np.tanh(cl(x[:, 2 * h:] + (rr * hs) @ r[d, 2 * h:].T))
                hn, cn = (1 - z) * hh + z * hs, cs
            live = (t < lens)[:, None]
            y[t, d] = np.where(live, hn, 0.0)
            hs, cs = np.where(live, hn, hs), np.where(live, cn, cs)
        yh[d], yc[d] = hs, cs
    return y, yh, (yc if cell == "lstm" else None)


def _contract(cell, xw, r, h0, c0, rbh, lens, *, reverse_first=False, clip=None):
    """The contract as the kernel's stand-in: float32 MLX arrays."""
    outs = reference_recurrence(cell, xw, r, h0, c0, rbh, lens, reverse_first=reverse_first, clip=clip)
    return tuple(None if o is None else mx.array(o.astype(np.float32)) for o in outs)


def _f32(*shape, scale=0.5):
    return mx.array((RNG.standard_normal(shape) * scale).astype(np.float32))


# (op, attrs, inputs given: B, lens, h0, c0, P; routed to the kernel)
LAYERS = [
    ("LSTM", {}, "", True),
    ("LSTM", {"direction": "bidirectional"}, "B,lens,h0,c0", True),
    ("LSTM", {"direction": "reverse", "clip": 0.6}, "B,h0", True),
    ("LSTM", {"layout": 1, "direction": "bidirectional"}, "B,lens,c0", True),
    ("LSTM", {}, "B,P", False),
    ("LSTM", {"input_forget": 1}, "B", False),
    ("LSTM", {"activations": ["Sigmoid", "Tanh", "Relu"]}, "B", False),
    ("GRU", {"linear_before_reset": 1}, "B,h0", True),
    ("GRU", {"linear_before_reset": 1, "direction": "bidirectional", "clip": 0.5}, "B,lens", True),
    ("GRU", {"linear_before_reset": 1, "layout": 1, "direction": "reverse"}, "lens,h0", True),
    ("GRU", {}, "B", True),
    ("GRU", {"direction": "bidirectional", "clip": 0.7}, "B,lens,h0", True),
    ("GRU", {"activations": ["Sigmoid", "Relu"]}, "B", False),
    ("RNN", {}, "B,h0", True),
    ("RNN", {"direction": "bidirectional", "layout": 1, "clip": 0.4}, "B,lens", True),
    ("RNN", {"activations": ["Relu"]}, "B", False),
]
SEQ, BATCH, IN, H = 7, 3, 5, 12


def _layer(op, attrs, given, seq=SEQ, batch=BATCH, hidden=H):
    d = 2 if attrs.get("direction") == "bidirectional" else 1
    g = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    lay = attrs.get("layout", 0)
    given = set(given.split(",")) - {""}
    x = _f32(*((batch, seq, IN) if lay else (seq, batch, IN)), scale=1.0)
    st = (batch, d, hidden) if lay else (d, batch, hidden)
    args = [x, _f32(d, g * hidden, IN), _f32(d, g * hidden, hidden), _f32(d, 2 * g * hidden) if "B" in given else None,
            np.array(([seq, 2, 5] * batch)[:batch], np.int32) if "lens" in given else None,
            _f32(*st) if "h0" in given else None]
    if op == "LSTM":
        args += [_f32(*st) if "c0" in given else None, _f32(d, 3 * hidden) if "P" in given else None]
    kw = {k: v for k, v in attrs.items()}
    return {"LSTM": rc.lstm_14, "GRU": rc.gru_14, "RNN": rc.rnn_14}[op], args, dict(hidden_size=hidden, **kw)


def _run(fn, args, kw, *, kernels):
    with build.active(build.BuildContext(cuda_kernels=kernels)):
        outs = fn(*args, **kw)
    return [np.array(o) for o in outs]


@pytest.mark.parametrize("op,attrs,given,routed", LAYERS)
def test_the_kernel_route_matches_the_unrolled_steps(monkeypatch, op, attrs, given, routed):
    calls = []

    def stand_in(*a, **k):
        calls.append(a[0])
        return _contract(*a, **k)
    monkeypatch.setattr(cuda_recurrent, "recurrence", stand_in)
    fn, args, kw = _layer(op, attrs, given)
    want = _run(fn, args, kw, kernels=False)
    assert calls == []
    monkeypatch.setattr(cuda_kernels, "enabled", lambda: True)
    got = _run(fn, args, kw, kernels=True)
    cell = "gru_early" if op == "GRU" and not attrs.get("linear_before_reset") else op.lower()
    assert calls == ([cell] if routed else [])
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_no_route_in_a_shapeless_trace(monkeypatch):
    monkeypatch.setattr(cuda_kernels, "enabled", lambda: True)
    monkeypatch.setattr(cuda_recurrent, "recurrence", lambda *a, **k: pytest.fail("kernel called"))
    fn, args, kw = _layer("GRU", {"linear_before_reset": 1}, "B")
    with build.active(build.BuildContext(cuda_kernels=True, shapeless=True)):
        assert len(fn(*args, **kw)) == 2


def test_no_route_in_a_build_without_the_kernels(monkeypatch):
    monkeypatch.setattr(cuda_recurrent, "recurrence", lambda *a, **k: pytest.fail("kernel called"))
    fn, args, kw = _layer("LSTM", {"direction": "bidirectional"}, "B")
    assert len(_run(fn, args, kw, kernels=False)) == 3


@pytest.mark.parametrize("hidden,expect", [(256, (32, 8)), (12, (1, 12)), (20, (2, 10)), (1000, (32, 32)),
                                           (8, (1, 8)), (100, (12, 9))])
def test_blocks_cover_every_unit(hidden, expect):
    nb, units = cuda_recurrent.blocks(hidden)
    assert (nb, units) == expect
    assert nb * units >= hidden > (nb - 1) * units


def test_blocks_are_capped_by_the_resident_limit():
    assert cuda_recurrent.blocks(256, most=3) == (3, 86)
    assert cuda_recurrent.blocks(256, most=1) == (1, 256)
    if not CUDA:                            # no driver: the conservative count
        assert cuda_recurrent.multiprocessors() == cuda_recurrent.RESIDENT_UNKNOWN
    else:
        assert cuda_recurrent.multiprocessors() >= 1


def test_reasons():
    x, r = _f32(3, 2, 4), _f32(1, 16, 4)
    assert cuda_recurrent.reason("lstm", x, r, 2, None) is None
    assert "state values" in cuda_recurrent.reason("lstm", x, _f32(1, 16, 4096), 4, None)
    assert "dtypes" in cuda_recurrent.reason("gru", x.astype(mx.float16), r, 2, None)
    assert "cell" in cuda_recurrent.reason("lstm_peepholes", x, r, 2, None)


# ---------------------------------------------------------------- the kernel itself (MLX's CUDA backend)
KERNEL_CASES = {
    # cell, T, D, B, H, lens, reverse_first, clip
    "lstm-speech": ("lstm", 200, 2, 1, 256, None, False, None),
    "lstm-batch-lens": ("lstm", 33, 2, 5, 64, [33, 1, 20, 7, 33], False, None),
    "lstm-reverse-clip": ("lstm", 17, 1, 2, 20, None, True, 0.4),
    "gru-speech": ("gru", 100, 2, 8, 128, None, False, None),
    "gru-odd": ("gru", 9, 1, 3, 13, [9, 4, 1], False, 0.3),
    "gru-reverse": ("gru", 50, 1, 1, 256, [40], True, None),
    "gru-early": ("gru_early", 64, 2, 4, 96, [64, 3, 30, 64], False, None),
    "gru-early-clip": ("gru_early", 12, 1, 2, 256, None, True, 0.5),
    "rnn": ("rnn", 40, 2, 3, 64, [40, 17, 1], False, None),
    # more rows than a warp's batch tile (BATCH_TILE): a second, partial tile
    "lstm-batch-tiles": ("lstm", 25, 1, 19, 64, None, False, None),
    "gru-early-batch-tiles": ("gru_early", 20, 2, 11, 40, [20, 3, 20, 9, 1, 20, 20, 14, 20, 2, 20], False, None),
}


def _kernel_case(name):
    cell, t, d, b, h, lens, rev, clip = KERNEL_CASES[name]
    g = cuda_recurrent.GATES[cell]
    args = (cell, _f32(t, d, b, g * h, scale=1.0), _f32(d, g * h, h, scale=h ** -0.5), _f32(d, b, h),
            _f32(d, b, h) if cell == "lstm" else None, _f32(d, h) if cell == "gru" else None,
            None if lens is None else mx.array(np.asarray(lens, np.int32)))
    return args, dict(reverse_first=rev, clip=clip)


@gpu_only
@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
def test_the_kernel_keeps_its_contract(name):
    args, kw = _kernel_case(name)
    with mx.stream(mx.gpu):
        got = cuda_recurrent.recurrence(*args, **kw)
        mx.eval([g for g in got if g is not None])
    want = reference_recurrence(*[np.array(a) if isinstance(a, mx.array) else a for a in args], **kw)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            np.testing.assert_allclose(np.array(g), w, rtol=1e-4, atol=2e-5)


@gpu_only
def test_the_kernel_in_a_compiled_function():
    args, kw = _kernel_case("lstm-batch-lens")
    cell, rest = args[0], args[1:]

    def f(xw, r, h0, c0, lens):
        y, yh, yc = cuda_recurrent.recurrence(cell, xw, r, h0, c0, None, lens, **kw)
        return y * 2.0, yh, yc

    with mx.stream(mx.gpu):
        compiled = mx.compile(f)
        outs = [compiled(rest[0], rest[1], rest[2], rest[3], rest[5]) for _ in range(3)]
        mx.eval(outs)
    want = reference_recurrence(cell, *(np.array(a) if a is not None else None for a in rest), **kw)
    for got in outs:
        np.testing.assert_allclose(np.array(got[0]), 2 * want[0], rtol=1e-4, atol=4e-5)
        np.testing.assert_allclose(np.array(got[2]), want[2], rtol=1e-4, atol=2e-5)
