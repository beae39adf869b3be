"""Conv and ConvTranspose (1-D/2-D/3-D, groups, dilations, strides, pads, auto_pad).

MLX convolutions are channels-last: inputs are transposed NC... -> N...C and weights
M C/g k... -> M k... C/g, and the result is transposed back. ConvTranspose is a
convolution of the stride-dilated input with the flipped kernel.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from .. import build
from ..registry import register

CONV_TYPES = frozenset({dt.FLOAT, dt.FLOAT16, dt.BFLOAT16})
AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def window_attrs_reason(view, names=("strides", "dilations")) -> str | None:
    """Conv/pool window attributes: ``names`` must be >= 1, pads >= 0 (None: fine)."""
    for name in names:
        v = view.attrs.get(name)
        if v is not None and any(int(a) < 1 for a in v):
            return f"{name} {list(v)} must be >= 1"
    pads = view.attrs.get("pads")
    if pads is not None and any(int(p) < 0 for p in pads):
        return f"negative pads {list(pads)}"
    return None


def _s(v):
    return v.decode() if isinstance(v, bytes) else v


def to_channels_last(x):
    return x.transpose(0, *range(2, x.ndim), 1)


def to_channels_first(x):
    return x.transpose(0, x.ndim - 1, *range(1, x.ndim - 1))


def weights(graph) -> frozenset:
    """Constants that are the weight of an ai.onnx Conv: ``interpreter.Program`` keeps each (M, C/g, k...) as a
    view of a row-major (M, k..., C/g) copy, whose ``to_channels_last`` is then row-contiguous: MLX's convolution
    takes it as it lies, where it copies any other layout on every call."""
    return frozenset(n.inputs[1] for n in graph.nodes
                     if n.op_type == "Conv" and n.domain in ("", "ai.onnx") and len(n.inputs) > 1
                     and n.inputs[1] in graph.constants and np.ndim(graph.constants[n.inputs[1]]) >= 3)


def same_pads(in_sizes, kernel, strides, dilations, auto_pad):
    """(begin, end) pads of SAME_UPPER / SAME_LOWER: output = ceil(input / stride)."""
    lo, hi = [], []
    for n, k, s, d in zip(in_sizes, kernel, strides, dilations):
        out = -(-n // s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - n)
        small = total // 2
        lo.append(small if auto_pad == "SAME_UPPER" else total - small)
        hi.append(total - lo[-1])
    return lo, hi


def _conv_check(view, transpose=False):
    for i in range(view.n_inputs):
        t = view.dtype(i)
        if view.has(i) and t is not None and t not in CONV_TYPES:
            return f"input {i} is {dt.name(t)} (MLX convolutions are float-only; ORT CPU has no float64 Conv)"
    r = view.rank(1) or view.rank(0)
    if r is not None and not 3 <= r <= 5:
        return f"{r - 2}-D convolution (only 1-D, 2-D, 3-D)"
    ap = _s(view.attrs.get("auto_pad", "NOTSET"))
    if ap not in AUTO_PADS:
        return f"auto_pad {ap!r}"
    ws = view.shape(1)
    ks = view.attrs.get("kernel_shape")
    if ks is not None and ws is not None and all(isinstance(d, int) for d in ws[2:]) and list(ks) != list(ws[2:]):
        return f"kernel_shape {list(ks)} differs from the weight's {list(ws[2:])}"
    reason = window_attrs_reason(view)
    if reason:
        return reason
    dil = view.attrs.get("dilations")
    if not transpose and ap.startswith("SAME") and dil is not None and any(int(d) != 1 for d in dil):
        return f"dilations {list(dil)} with auto_pad {ap} (ORT's CPU EP rejects it: nothing to verify against)"
    return None


def _conv_general(x, w, groups, **kw):
    """mx.conv_general; groups of a 3-D convolution (MLX: 1-D/2-D only) run one by one."""
    if groups == 1 or x.ndim <= 4:
        return mx.conv_general(x, w, groups=groups, **kw)
    cin, cout = x.shape[-1] // groups, w.shape[0] // groups
    return mx.concatenate([mx.conv_general(x[..., g * cin:(g + 1) * cin], w[g * cout:(g + 1) * cout], **kw)
                           for g in range(groups)], axis=-1)


#: the forms ``_gemm_conv`` takes: a 1x1 kernel (one product), depthwise (per-channel products), shifted (a product
#: per kernel tap, summed: stride 1, one group; ``_shifted_conv``), im2col (one product over the concatenated views)
GEMM_FORMS = frozenset({"pointwise", "depthwise", "shifted", "im2col"})
#: most elements of the shifted views one im2col product materializes; a larger batch goes in parts
GEMM_MAX_COLUMNS = 1 << 26
#: least output positions (batch x height x width) of a shifted convolution: with fewer, MLX's CPU convolution was
#: faster (docs/performance.md, "What the defaults do": conv_gemm)
SHIFTED_MIN_POSITIONS = 4096


def _gemm_form(x, w, groups, lo, hi, strides=(1, 1), out_sp=None) -> tuple[str | None, str | None]:
    """(form, None), or (None, why) a channels-last 2-D convolution (x (N, H, W, C), w (M, kh, kw, C/g)) does not
    run as products; a "shifted" one (``_shifted_conv``) may also run as "im2col" (``_gemm_conv``). ``out_sp``:
    the output's (H, W) (None: unknown, never shifted)."""
    if x.ndim != 4:
        return None, f"{x.ndim - 2}-D"
    if build.shapeless():
        return None, "a shapeless trace (static slices)"
    if min(*lo, *hi) < 0:
        return None, "negative pads"
    if groups == 1:
        if w.shape[1] == w.shape[2] == 1:
            return "pointwise", None
        big = out_sp is not None and x.shape[0] * out_sp[0] * out_sp[1] >= SHIFTED_MIN_POSITIONS
        return ("shifted" if big and tuple(strides) == (1, 1) else "im2col"), None
    if groups == x.shape[-1] == w.shape[0]:
        return "depthwise", None
    return None, f"group {groups}: neither 1 nor depthwise"


def _gemm_conv(x, w, groups, strides, lo, hi, dilations, out_sp):
    """A 2-D cross-correlation as products over the kernel's kh x kw shifted (strided, dilated) views v_ij of the
    padded x: y = [v_00 .. v_ij ..] @ W^T (one group: im2col), or sum_ij v_ij * w_ij (depthwise: per channel).
    None where one sample's im2col columns alone exceed ``GEMM_MAX_COLUMNS``."""
    n, c = x.shape[0], x.shape[-1]
    kh, kw = w.shape[1], w.shape[2]
    (sh, sw), (dh, dw), (ho, wo) = strides, dilations, out_sp
    per = ho * wo * kh * kw * c                     # one sample's im2col elements
    if groups == 1 and kh * kw > 1 and per > GEMM_MAX_COLUMNS:
        return None
    if any(lo) or any(hi):
        x = mx.pad(x, [(0, 0), (lo[0], hi[0]), (lo[1], hi[1]), (0, 0)])
    views = [x[:, i * dh:i * dh + sh * (ho - 1) + 1:sh, j * dw:j * dw + sw * (wo - 1) + 1:sw, :]
             for i in range(kh) for j in range(kw)]
    if groups == 1:
        m = w.shape[0]
        wt = w.reshape(m, kh * kw * c).T
        if len(views) == 1:
            return (views[0].reshape(n * ho * wo, c) @ wt).reshape(n, ho, wo, m)
        step = max(1, GEMM_MAX_COLUMNS // per)       # samples per product
        parts = []
        for s in range(0, n, step):
            cols = mx.concatenate([v[s:s + step] for v in views], axis=-1)
            b = cols.shape[0]
            parts.append((cols.reshape(b * ho * wo, kh * kw * c) @ wt).reshape(b, ho, wo, m))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    taps = w.reshape(c, kh * kw)
    y = views[0] * taps[:, 0]
    for t in range(1, kh * kw):
        y = y + views[t] * taps[:, t]
    return y


def _shifted_conv(x, w, lo, hi, dilations):
    """A stride-1 2-D cross-correlation as sum_ij P[o_ij : o_ij + L] @ w_ij^T: P is the padded x flattened to
    (positions, C), with one more zero row under each sample so that every tap's rows stay inside it, and
    o_ij = i dh Wp + j dw. Each tap's rows are a contiguous slice (no im2col copy); the products also fill the
    rows of the padding's columns, which are cropped (Wp / Wo more work)."""
    n, c = x.shape[0], x.shape[-1]
    m, kh, kw = w.shape[0], w.shape[1], w.shape[2]
    dh, dw = dilations
    hp, wp = x.shape[1] + lo[0] + hi[0], x.shape[2] + lo[1] + hi[1]
    ho, wo = hp - (kh - 1) * dh, wp - (kw - 1) * dw
    rows = (hp + 1) * wp                            # one sample's rows, the extra one included
    flat = mx.pad(x, [(0, 0), (lo[0], hi[0] + 1), (lo[1], hi[1]), (0, 0)]).reshape(n * rows, c)
    taps = mx.contiguous(w.transpose(1, 2, 3, 0))   # (kh, kw, C, M), one copy: each tap's w^T a row-major (C, M)
    span = (n - 1) * rows + ho * wp                 # from the first output row to the last sample's last
    y = None
    for i in range(kh):
        for j in range(kw):
            o = i * dh * wp + j * dw
            y = flat[o:o + span] @ taps[i, j] if y is None else mx.addmm(y, flat[o:o + span], taps[i, j])
    y = mx.pad(y, [(0, n * rows - span), (0, 0)]).reshape(n, hp + 1, wp, m)
    return y[:, :ho, :wo, :]


def _no_products(shape: tuple, B, dtype):
    """A convolution's output where it sums over nothing (no input channels) or is empty: the bias broadcast
    over each output channel, else zeros (MLX's own convolution divides by zero on no channels: SIGFPE)."""
    if B is None or 0 in shape:
        return mx.zeros(shape, dtype)
    return mx.broadcast_to(B.astype(dtype).reshape(shape[1], *[1] * (len(shape) - 2)), shape)


def _attrs(nsp, strides, dilations, pads):
    strides = list(strides) if strides is not None else [1] * nsp
    dilations = list(dilations) if dilations is not None else [1] * nsp
    pads = list(pads) if pads is not None else [0] * (2 * nsp)
    if len(strides) != nsp or len(dilations) != nsp or len(pads) != 2 * nsp:
        raise ValueError(f"strides {strides} / dilations {dilations} / pads {pads} do not fit {nsp} spatial dims")
    return strides, dilations, pads[:nsp], pads[nsp:]


def _crop(y, lo_neg, hi_neg):
    """Remove the (positive) amounts ``lo_neg``/``hi_neg`` from each spatial dim of a channels-last y."""
    if not any(lo_neg) and not any(hi_neg):
        return y
    idx = [slice(None)] + [slice(a, y.shape[i + 1] - b) for i, (a, b) in enumerate(zip(lo_neg, hi_neg))] + [slice(None)]
    return y[tuple(idx)]


@register("Conv", 1, dtypes=CONV_TYPES, check=_conv_check)
def conv(X, W, B=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    """N-D cross-correlation of X (N, C, ...) with W (M, C/group, k...), plus bias B (M,)."""
    nsp = X.ndim - 2
    if W.ndim != X.ndim:
        raise ValueError(f"weight rank {W.ndim} != input rank {X.ndim}")
    if X.shape[1] != W.shape[1] * group or W.shape[0] % group:
        raise ValueError(f"input channels {X.shape[1]} / weight {W.shape} do not fit group {group}")
    strides, dilations, lo, hi = _attrs(nsp, strides, dilations, pads)
    ap = _s(auto_pad)
    kernel = W.shape[2:]
    if ap in ("SAME_UPPER", "SAME_LOWER"):
        lo, hi = same_pads(X.shape[2:], kernel, strides, dilations, ap)
    elif ap == "VALID":
        lo, hi = [0] * nsp, [0] * nsp
    half = X.dtype in (mx.float16, mx.bfloat16)           # float32 math, one rounding (as ORT's CPU EP)
    x = to_channels_last(X.astype(mx.float32) if half else X)
    w = to_channels_last(W.astype(mx.float32) if half else W)
    out_sp = [(n + a + b - ((k - 1) * d + 1)) // s + 1 for n, a, b, k, d, s in
              zip(X.shape[2:], lo, hi, kernel, dilations, strides)]
    if X.shape[0] == 0 or any(o <= 0 for o in out_sp) or W.shape[0] == 0 or X.shape[1] == 0:
        if any(o < 0 for o in out_sp):
            raise ValueError(f"kernel {list(kernel)} larger than padded input {list(X.shape[2:])}")
        return _no_products((X.shape[0], W.shape[0], *out_sp), B, X.dtype)
    forms = build.conv_gemm(X.shape[0])
    y = None
    form = _gemm_form(x, w, group, lo, hi, strides, out_sp)[0] if forms else None
    if form == "shifted" and form not in forms:
        form = "im2col"                             # it takes every one-group convolution
    if form == "shifted":
        y = _shifted_conv(x, w, lo, hi, dilations)
    elif form in forms:
        y = _gemm_conv(x, w, group, strides, lo, hi, dilations, out_sp)
    if y is None:
        y = _conv_general(x, w, group, stride=strides, padding=(lo, hi), kernel_dilation=dilations)
    if B is not None:
        y = y + B.astype(y.dtype)
    return to_channels_first(y).astype(X.dtype)


def _convt_check(view):
    reason = _conv_check(view, transpose=True)
    if reason:
        return reason
    op = view.attrs.get("output_padding")
    st = view.attrs.get("strides")
    dl = view.attrs.get("dilations")
    if op is not None:
        n = len(op)
        st = list(st) if st is not None else [1] * n
        dl = list(dl) if dl is not None else [1] * n
        if any(o < 0 or (o >= s and o >= d) for o, s, d in zip(op, st, dl)):
            return f"output_padding {list(op)} must be smaller than strides or dilations"
    return None


def convt_pads(in_sizes, kernel, strides, dilations, out_pad, pads, output_shape, auto_pad):
    """(begin, end) pads and output sizes of ConvTranspose, following ORT's CPU kernel."""
    nsp = len(in_sizes)
    full = [s * (n - 1) + o + (k - 1) * d + 1 for n, k, s, d, o in zip(in_sizes, kernel, strides, dilations, out_pad)]
    if output_shape is not None:
        target = list(output_shape)[-nsp:]
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = [n * s for n, s in zip(in_sizes, strides)]
    else:
        lo, hi = pads[:nsp], pads[nsp:]
        return lo, hi, [f - a - b for f, a, b in zip(full, lo, hi)]
    lo, hi = [], []
    for f, t in zip(full, target):
        total = f - t
        if auto_pad == "SAME_UPPER":
            lo.append(total // 2)
        else:
            lo.append(total - total // 2)
        hi.append(total - lo[-1])
    return lo, hi, target


def _tiled_convt(X, W, B, kernel):
    """ConvTranspose whose kernel tiles the output (strides == kernel, no dilation, pads, output padding or groups):
    every output element is one product over the input channels, so the whole op is one matmul
    (N*H*W, C) @ (C, M*kh*kw) with the kernel taps laid into the output: the sums ORT's CPU kernel makes (its
    GEMM, then a col2im that adds nothing up when the taps do not overlap). MLX's CPU backend runs the general
    form (a convolution of the stride-dilated input) outside its GEMM path: a UNet's 2x2 up-convolution, 64 -> 32
    channels on 64x64, took 202 ms there against 8 ms as this matmul."""
    n, c, *sp = X.shape
    nsp = len(sp)
    m = W.shape[1]
    half = X.dtype in (mx.float16, mx.bfloat16)
    x = to_channels_last(X.astype(mx.float32) if half else X).reshape(-1, c)
    w = (W.astype(mx.float32) if half else W).reshape(c, -1)
    y = (x @ w).reshape(n, *sp, m, *kernel)
    # (n, s1.., m, k1..) -> (n, m, s1, k1, s2, k2, ..) -> (n, m, s1*k1, ..)
    y = y.transpose(0, 1 + nsp, *[a for i in range(nsp) for a in (1 + i, 2 + nsp + i)])
    y = y.reshape(n, m, *[s * k for s, k in zip(sp, kernel)])
    if B is not None:
        y = y + B.astype(y.dtype).reshape(m, *[1] * nsp)
    return y.astype(X.dtype)


@register("ConvTranspose", 1, dtypes=CONV_TYPES, check=_convt_check)
def conv_transpose(X, W, B=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                   output_padding=None, output_shape=None, pads=None, strides=None, ctx=None):
    """Transposed convolution of X (N, C, ...) with W (C, M/group, k...), plus bias B (M,).

    On MLX's CPU backend a kernel that tiles the output is one matmul (``_tiled_convt``); not in a shapeless
    trace (its reshapes name the batch size)."""
    nsp = X.ndim - 2
    if W.ndim != X.ndim:
        raise ValueError(f"weight rank {W.ndim} != input rank {X.ndim}")
    C = X.shape[1]
    if W.shape[0] != C or C % group:
        raise ValueError(f"input channels {C} / weight {W.shape} do not fit group {group}")
    strides, dilations, _, _ = _attrs(nsp, strides, dilations, pads)
    pads = list(pads) if pads is not None else [0] * (2 * nsp)
    out_pad = list(output_padding) if output_padding is not None else [0] * nsp
    kernel = W.shape[2:]
    lo, hi, out_sp = convt_pads(X.shape[2:], kernel, strides, dilations, out_pad,
                                pads if _s(auto_pad) != "VALID" else [0] * (2 * nsp), output_shape, _s(auto_pad))
    M = W.shape[1] * group
    if X.shape[0] == 0 or M == 0 or any(o <= 0 for o in out_sp) or C == 0:
        if any(o < 0 for o in out_sp):
            raise ValueError(f"negative output size {out_sp}")
        return _no_products((X.shape[0], M, *out_sp), B, X.dtype)
    if (ctx is not None and ctx.device == "cpu" and group == 1 and list(strides) == list(kernel)
            and not any(d != 1 for d in dilations) and not any(lo) and not any(hi) and not any(out_pad)
            and list(out_sp) == [i * s for i, s in zip(X.shape[2:], strides)] and not build.shapeless()):
        return _tiled_convt(X, W, B, kernel)
    # weight (C, M/g, k...) -> (g, C/g, M/g, k...) -> (M, k..., C/g); half types in float32
    half = X.dtype in (mx.float16, mx.bfloat16)
    Xc, W = (X.astype(mx.float32), W.astype(mx.float32)) if half else (X, W)
    w = W.reshape(group, C // group, W.shape[1], *kernel)
    w = w.transpose(0, 2, *range(3, 3 + nsp), 1).reshape(M, *kernel, C // group)
    clo = [d * (k - 1) - a for k, d, a in zip(kernel, dilations, lo)]
    chi = [d * (k - 1) - b + o for k, d, b, o in zip(kernel, dilations, hi, out_pad)]
    # output sizes can exceed the full conv (output_shape larger): extra zeros come from more padding
    x = to_channels_last(Xc)
    y = _conv_general(x, w, group, stride=1, padding=([max(0, a) for a in clo], [max(0, b) for b in chi]),
                      kernel_dilation=dilations, input_dilation=strides, flip=True)
    y = _crop(y, [max(0, -a) for a in clo], [max(0, -b) for b in chi])
    if B is not None:
        y = y + B.astype(y.dtype)
    return to_channels_first(y).astype(X.dtype)


# ------------------------------------------------------------------ DeformConv
def _deform_check(view):
    for i in range(view.n_inputs):
        t = view.dtype(i)
        if view.has(i) and t is not None and t not in (dt.FLOAT, dt.FLOAT16, dt.BFLOAT16):
            return f"input {i} is {dt.name(t)}"
    r = view.rank(0)
    if r != 4:
        return f"input rank {r} (2-D DeformConv only)"
    return window_attrs_reason(view)


def _bilinear_zero(xg, py, px, H, W):
    """Bilinear samples of xg (N, G, Cg, H*W) at pixel coordinates py/px (N, G, M); zero outside."""
    n, g, cg, _ = xg.shape
    y0, x0 = mx.floor(py), mx.floor(px)
    fy, fx = py - y0, px - x0
    y0i, x0i = y0.astype(mx.int32), x0.astype(mx.int32)
    out = None
    for dy, dx, w in ((0, 0, (1 - fy) * (1 - fx)), (0, 1, (1 - fy) * fx), (1, 0, fy * (1 - fx)), (1, 1, fy * fx)):
        yy, xx = y0i + dy, x0i + dx
        ok = (yy >= 0) & (yy < H) & (xx >= 0) & (xx < W)
        flat = mx.clip(yy, 0, H - 1) * W + mx.clip(xx, 0, W - 1)
        v = mx.take_along_axis(xg, mx.broadcast_to(flat[:, :, None, :], (n, g, cg, flat.shape[-1])), axis=3)
        term = v * mx.where(ok, w, mx.zeros_like(w))[:, :, None, :]
        out = term if out is None else out + term
    return out


@register("DeformConv", 19, dtypes=frozenset({dt.FLOAT, dt.FLOAT16, dt.BFLOAT16}), check=_deform_check)
def deform_conv(X, W, offset, B=None, mask=None, *, dilations=None, group=1, kernel_shape=None, offset_group=1,
                pads=None, strides=None):
    """2-D deformable convolution: bilinear samples at offset kernel taps (zero outside), times mask."""
    n, c, H, Wd = X.shape
    oc, cpg, kh, kw = W.shape
    if c != cpg * group or oc % group or c % offset_group:
        raise ValueError(f"channels {c} / weight {W.shape} do not fit group {group} / offset_group {offset_group}")
    strides, dilations, lo, hi = _attrs(2, strides, dilations, pads)
    oh = (H + lo[0] + hi[0] - ((kh - 1) * dilations[0] + 1)) // strides[0] + 1
    ow = (Wd + lo[1] + hi[1] - ((kw - 1) * dilations[1] + 1)) // strides[1] + 1
    K, P = kh * kw, oh * ow
    if offset.shape != (n, offset_group * K * 2, oh, ow):
        raise ValueError(f"offset shape {offset.shape} != {(n, offset_group * K * 2, oh, ow)}")
    if mask is not None and mask.shape != (n, offset_group * K, oh, ow):
        raise ValueError(f"mask shape {mask.shape} != {(n, offset_group * K, oh, ow)}")
    if n == 0 or P <= 0:
        return mx.zeros((n, oc, max(oh, 0), max(ow, 0)), X.dtype)
    ct = mx.float32
    off = offset.astype(ct).reshape(n, offset_group, K, 2, P)
    # tap + output-position grid of each sampling point (static shapes: host math)
    ty, tx = np.meshgrid(np.arange(kh) * dilations[0], np.arange(kw) * dilations[1], indexing="ij")
    gy, gx = np.meshgrid(np.arange(oh) * strides[0] - lo[0], np.arange(ow) * strides[1] - lo[1], indexing="ij")
    base_y = mx.array((ty.reshape(K, 1) + gy.reshape(1, P)).astype(np.float32))
    base_x = mx.array((tx.reshape(K, 1) + gx.reshape(1, P)).astype(np.float32))
    py = (base_y[None, None] + off[:, :, :, 0]).reshape(n, offset_group, K * P)
    px = (base_x[None, None] + off[:, :, :, 1]).reshape(n, offset_group, K * P)
    xg = X.astype(ct).reshape(n, offset_group, c // offset_group, H * Wd)
    cols = _bilinear_zero(xg, py, px, H, Wd)                     # (N, og, C/og, K*P)
    if mask is not None:
        cols = cols * mask.astype(ct).reshape(n, offset_group, 1, K * P)
    cols = cols.reshape(n, group, cpg * K, P)                     # channel-major, then tap
    w = W.astype(ct).reshape(group, oc // group, cpg * K)
    y = mx.matmul(w[None], cols).reshape(n, oc, oh, ow)           # (N, g, oc/g, P)
    if B is not None:
        y = y + B.astype(ct).reshape(1, oc, 1, 1)
    return y.astype(X.dtype)
