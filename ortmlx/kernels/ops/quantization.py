"""Linear quantization: QuantizeLinear, DequantizeLinear (per-tensor, per-axis, blocked),
DynamicQuantizeLinear, MatMulInteger, QLinearMatMul.

Integer types: int8/uint8/int16/uint16 (int32 for DequantizeLinear), and from opset 21 on
int4/uint4 for DequantizeLinear (carrier types: unpacked one per int8/uint8 at the EP boundary;
QuantizeLinear to them is refused: ORT's 4-bit kernels treat inf/NaN/huge inputs differently per
code path), and float8 from
opset 21 on without a zero point (or a constant all-zero one): dequantize is decode(x) * scale
(float32 output only),
quantize encodes x / scale with Cast's float8 conversion (``saturate``). 2-bit types are refused. Arithmetic
follows ORT's CPU kernels: dequantize is float(int32(x) - int32(zp)) * scale; quantize is
round-half-even(x / scale) + zp, saturated; half types are computed in float32.
MLX has no integer matmul: 8-bit products are summed in float64 on the CPU (exact for any K
that does not wrap ORT's int32 accumulator) or float32 elsewhere (exact while K * 255^2 < 2^24);
deeper products are refused at claim time. ConvInteger and QLinearConv run the same way
through the float Conv translator (zero points subtracted first, so padding adds zeros).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ..registry import register
from .cast import _f8_decode, _f8_encode
from .conv import _conv_check, conv

Q_TYPES = {dt.UINT8: (0, 255), dt.INT8: (-128, 127), dt.UINT16: (0, 65535), dt.INT16: (-32768, 32767)}
#: 4-bit quantized types (carriers; only the opset-21+ registrations, which opt in, see them)
SUB_Q_TYPES = {dt.INT4: (-8, 7), dt.UINT4: (0, 15)}
ALL_Q_TYPES = {**Q_TYPES, **SUB_Q_TYPES}
DQ_INPUTS = frozenset(ALL_Q_TYPES) | {dt.INT32}
#: bfloat16 scales are refused: ORT's CPU EP has no bf16 Q/DQ kernel to verify against
SCALES = frozenset({dt.FLOAT, dt.FLOAT16})


def _param_layout(scale_shape, x_shape, axis: int, block_size: int):
    """'tensor' | 'axis' | 'block' for a scale of ``scale_shape``; ValueError naming a bad shape."""
    r = len(x_shape)
    per_tensor = len(scale_shape) == 0 or (len(scale_shape) == 1 and scale_shape[0] == 1)
    if per_tensor and not block_size:
        return "tensor"
    if not -r <= axis < r:
        raise ValueError(f"axis {axis} out of range for rank {r}")
    if block_size:
        if len(scale_shape) != r:
            raise ValueError(f"blocked scale rank {len(scale_shape)} != input rank {r}")
        a = axis % r
        want = tuple(-(-d // block_size) if k == a else d for k, d in enumerate(x_shape))
        if tuple(scale_shape) != want:
            raise ValueError(f"blocked scale shape {tuple(scale_shape)} != {want} (block_size {block_size})")
        return "block"
    if len(scale_shape) == 1 and scale_shape[0] == x_shape[axis % r]:
        return "axis"
    raise ValueError(f"scale shape {tuple(scale_shape)} fits neither per-tensor nor axis {axis} of {tuple(x_shape)}")


def _broadcast(p, x_shape, axis: int, block_size: int):
    """A scale / zero point laid out to broadcast against the input."""
    kind = _param_layout(p.shape, x_shape, axis, block_size)
    r = len(x_shape)
    if kind == "tensor":
        return p.reshape(())
    a = axis % r
    if kind == "axis":
        return p.reshape([-1 if k == a else 1 for k in range(r)])
    return mx.repeat(p, block_size, axis=a)[tuple(slice(0, d) for d in x_shape)]


def _check(quantize: bool):
    def check(view):
        a = view.attrs
        axis, bs = a.get("axis", 1), a.get("block_size", 0)
        if bs < 0:
            return f"block_size {bs} < 0"
        if a.get("precision", 0) not in (0, dt.FLOAT):
            return f"precision {dt.name(a['precision'])} (only float32 division is implemented)"
        sc = view.dtype(1)
        if sc not in SCALES:
            return f"scale dtype {dt.name(sc)} is not float32/float16"
        if quantize:
            if view.dtype(0) not in SCALES:
                return f"input dtype {dt.name(view.dtype(0))} is not a float"
            out = view.out_dtype(0)
            if out in dt.FLOAT8 and a.get("saturate", 1) not in (0, 1):
                return f"saturate={a.get('saturate')!r}"
            if out in SUB_Q_TYPES:
                # ORT's 4-bit kernels send inf / NaN / |x/scale| >= 2^31 to the minimum or the maximum
                # depending on the layout and zero point (vectorised vs scalar paths): not reproduced
                return f"QuantizeLinear to {dt.name(out)} (ORT's out-of-range handling varies by kernel path)"
            if out not in Q_TYPES and out not in dt.FLOAT8:
                return f"output dtype {dt.name(out)} is not int8/uint8/int16/uint16/float8"
        else:
            if view.dtype(0) not in DQ_INPUTS and view.dtype(0) not in dt.FLOAT8:
                return f"input dtype {dt.name(view.dtype(0))} is not a 4/8/16/32-bit integer"
            if view.dtype(0) == dt.INT32 and view.has(2):
                zp = view.const(2)
                if zp is None or np.any(zp != 0):
                    return "int32 input with a zero point that is not a constant 0"
            if view.out_dtype(0) not in SCALES:
                return f"output dtype {dt.name(view.out_dtype(0))} is not a float"
            if view.dtype(0) in dt.FLOAT8 and view.out_dtype(0) != dt.FLOAT:
                # ORT's CPU EP rounds some float8 * float16-scale products differently (not reproduced)
                return f"float8 input dequantized to {dt.name(view.out_dtype(0))} (only float32 is exact)"
        q_t = view.dtype(0) if not quantize else view.out_dtype(0)
        if q_t in dt.FLOAT8 and view.has(2):
            zp = view.const(2)
            if zp is None or np.any(zp != 0):
                return "float8 zero point that is not a constant 0"
        if view.has(2) and view.dtype(2) != q_t:
            return f"zero point dtype {dt.name(view.dtype(2))} does not match the quantized type"
        ss, xs = view.shape(1), view.shape(0)
        if ss is not None and xs is not None and all(isinstance(d, int) for d in (*ss, *xs)):
            try:
                _param_layout(ss, xs, axis, bs)
            except ValueError as e:
                return str(e)
        return None
    return check


def _dequantize(x, scale, zp, axis, block_size, out_t, src_t=None):
    s = _broadcast(scale, x.shape, axis, block_size).astype(mx.float32)
    if src_t in dt.FLOAT8:          # zero point: absent or a constant 0 (checked)
        return (_f8_decode(x, src_t, dt.FLOAT) * s).astype(out_t)
    q = x.astype(mx.int32)
    if zp is not None:
        q = q - _broadcast(zp, x.shape, axis, block_size).astype(mx.int32)
    return (q.astype(mx.float32) * s).astype(out_t)


def _quantize(x, scale, zp, axis, block_size, out_t: int, saturate: int = 1):
    s = _broadcast(scale, x.shape, axis, block_size).astype(mx.float32)
    if out_t in dt.FLOAT8:          # zero point: absent or a constant 0 (checked)
        return _f8_encode(x.astype(mx.float32) / s, out_t, saturate)
    lo, hi = ALL_Q_TYPES[out_t]
    q = mx.round(x.astype(mx.float32) / s)
    # ORT's CPU kernels: NaN quantizes to the type's minimum; from float16, so does every x / scale
    # outside int32 (inf included: the float -> int32 conversion gives INT_MIN before clamping)
    lowest = mx.isnan(q) if x.dtype != mx.float16 else mx.isnan(q) | (mx.abs(q) >= 2.0 ** 31)
    if zp is not None:
        q = q + _broadcast(zp, x.shape, axis, block_size).astype(mx.float32)
    q = mx.where(lowest, lo, mx.clip(q, lo, hi))
    return q.astype(dt.MLX[out_t] if out_t in dt.MLX else dt.CARRIER_MLX[out_t])


# ------------------------------------------------------------------ DequantizeLinear
@register("DequantizeLinear", 10, check=_check(False))
def dequantize_linear_10(x, x_scale, x_zero_point=None, *, ctx):
    """y = (x - zp) * scale, per tensor."""
    return _dequantize(x, x_scale, x_zero_point, 1, 0, dt.MLX[ctx.out_dtypes[0]])


@register("DequantizeLinear", 13, check=_check(False))
def dequantize_linear_13(x, x_scale, x_zero_point=None, *, axis=1, ctx):
    """Per tensor or per ``axis``."""
    return _dequantize(x, x_scale, x_zero_point, axis, 0, dt.MLX[ctx.out_dtypes[0]])


@register("DequantizeLinear", 21, check=_check(False), carriers=True)
def dequantize_linear_21(x, x_scale, x_zero_point=None, *, axis=1, block_size=0, ctx):
    """Per tensor, per axis, or blocks of ``block_size`` along ``axis``."""
    return _dequantize(x, x_scale, x_zero_point, axis, block_size, dt.MLX[ctx.out_dtypes[0]], ctx.in_dtypes[0])


@register("DequantizeLinear", 23, check=_check(False), carriers=True)
def dequantize_linear_23(x, x_scale, x_zero_point=None, *, axis=1, block_size=0, output_dtype=0, ctx):
    """output_dtype (0: the scale's type) is what the graph declares for y."""
    return _dequantize(x, x_scale, x_zero_point, axis, block_size, dt.MLX[ctx.out_dtypes[0]], ctx.in_dtypes[0])


# ------------------------------------------------------------------ QuantizeLinear
@register("QuantizeLinear", 10, check=_check(True))
def quantize_linear_10(x, y_scale, y_zero_point=None, *, ctx):
    """y = saturate(round_half_even(x / scale) + zp), per tensor."""
    return _quantize(x, y_scale, y_zero_point, 1, 0, ctx.out_dtypes[0])


@register("QuantizeLinear", 13, check=_check(True))
def quantize_linear_13(x, y_scale, y_zero_point=None, *, axis=1, ctx):
    return _quantize(x, y_scale, y_zero_point, axis, 0, ctx.out_dtypes[0])


@register("QuantizeLinear", 19, check=_check(True))
def quantize_linear_19(x, y_scale, y_zero_point=None, *, axis=1, saturate=1, ctx):
    """``saturate`` only concerns float8 outputs (refused): integer outputs always saturate."""
    return _quantize(x, y_scale, y_zero_point, axis, 0, ctx.out_dtypes[0])


@register("QuantizeLinear", 21, check=_check(True), carriers=True)
def quantize_linear_21(x, y_scale, y_zero_point=None, *, axis=1, block_size=0, output_dtype=0, saturate=1, ctx):
    return _quantize(x, y_scale, y_zero_point, axis, block_size, ctx.out_dtypes[0], saturate)


@register("QuantizeLinear", 23, check=_check(True), carriers=True)
def quantize_linear_23(x, y_scale, y_zero_point=None, *, axis=1, block_size=0, output_dtype=0, precision=0,
                       saturate=1, ctx):
    """``precision`` 0 or float32: the division runs in float32 (as ORT's CPU EP does)."""
    return _quantize(x, y_scale, y_zero_point, axis, block_size, ctx.out_dtypes[0], saturate)


# ------------------------------------------------------------------ DynamicQuantizeLinear
@register("DynamicQuantizeLinear", 11, dtypes={dt.FLOAT})
def dynamic_quantize_linear(x):
    """uint8 y, scale = (max(x, 0) - min(x, 0)) / 255, zp = saturate(round(-min / scale))."""
    lo = mx.minimum(mx.min(x), 0) if x.size else mx.array(0, mx.float32)
    hi = mx.maximum(mx.max(x), 0) if x.size else mx.array(0, mx.float32)
    scale = mx.where(hi == lo, mx.array(1.0, mx.float32), (hi - lo) / 255)
    zp = mx.clip(mx.round(mx.clip(-lo / scale, 0, 255)), 0, 255)
    y = mx.clip(mx.round(x / scale) + zp, 0, 255).astype(mx.uint8)
    return y, scale, zp.astype(mx.uint8)


# ------------------------------------------------------------------ integer matmul
#: |a - a_zp| and |b - b_zp| are at most 255 for 8-bit operands
_MAX_PRODUCT = 255 * 255
#: ORT accumulates in int32: beyond this depth a sum could wrap there and not here
_MAX_K_INT32 = (2**31 - 1) // _MAX_PRODUCT
#: float32 adds integers exactly while every partial sum stays below 2^24
_MAX_K_F32 = 2**24 // _MAX_PRODUCT
EIGHT_BIT = frozenset({dt.UINT8, dt.INT8})


def _scalar_or_vector(view, i, n_cols, what):
    """None if input ``i`` is absent, a scalar, or (when ``n_cols``) a (n_cols,) vector; else a reason."""
    s = view.shape(i)
    if not view.has(i) or s is None:
        return None if not view.has(i) else f"{what} has an unknown shape"
    if len(s) == 0 or tuple(s) == (1,):
        return None
    if n_cols is not None and len(s) == 1 and s[0] == n_cols:
        return None
    return f"{what} of shape {tuple(s)} is neither a scalar nor per column"


def _imm_check(a, b, azp, bzp, scales=()):
    """Check builder for MatMulInteger / QLinearMatMul: 8-bit operands, ranks >= 2, exact depth."""
    def check(view):
        for i, what in ((a, "A"), (b, "B")):
            if view.dtype(i) not in EIGHT_BIT:
                return f"{what} dtype {dt.name(view.dtype(i))} is not int8/uint8"
            r = view.rank(i)
            if r is None or r < 2:
                return f"{what} rank {r} (only rank >= 2 is implemented)"
        k = view.shape(a)[-1]
        if not isinstance(k, int):
            return "the inner dimension K is not known at claim time (exactness cannot be proven)"
        if k > _MAX_K_INT32:
            return f"K = {k} > {_MAX_K_INT32}: the integer sum could wrap ORT's int32 accumulator"
        n = view.shape(b)[-1]
        reason = (_scalar_or_vector(view, azp, None, "A's zero point")
                  or _scalar_or_vector(view, bzp, n if isinstance(n, int) else None, "B's zero point"))
        if reason:
            return reason
        for i, what, per_col in scales:
            if view.dtype(i) not in (dt.FLOAT, dt.FLOAT16):
                return f"{what} dtype {dt.name(view.dtype(i))} is not float32/float16"
            reason = _scalar_or_vector(view, i, n if per_col and isinstance(n, int) else None, what)
            if reason:
                return reason
        return None
    return check


def _exact_float(k: int, device: str):
    """float32 while a depth-``k`` sum of 8-bit products is exact in it, else float64 (CPU only)."""
    if k <= _MAX_K_F32:
        return mx.float32
    if device != "cpu":
        raise ValueError(f"depth {k} > {_MAX_K_F32} is exact only in float64, which {device} lacks")
    return mx.float64


def _int_product(A, B, a_zero_point, b_zero_point):
    """(A - a_zp) @ (B - b_zp) as exact int32: float32 products over depths of at most ``_MAX_K_F32`` (exact
    there), their sums in int32 as ORT accumulates. A deeper K is cut into such chunks (zero-padded), one
    batched product over the chunks, then an int32 sum (no float64: MLX's GPU backends have none)."""
    f, k = mx.float32, A.shape[-1]
    a = A.astype(f) if a_zero_point is None else A.astype(f) - a_zero_point.astype(f).reshape(())
    b = B.astype(f) if b_zero_point is None else B.astype(f) - b_zero_point.astype(f).reshape(-1)
    if k <= _MAX_K_F32:
        return (a @ b).astype(mx.int32)
    c = -(-k // _MAX_K_F32)
    pad = c * _MAX_K_F32 - k
    nb = max(a.ndim, b.ndim) - 2
    a = a.reshape((1,) * (nb + 2 - a.ndim) + a.shape)
    b = b.reshape((1,) * (nb + 2 - b.ndim) + b.shape)
    a = mx.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    b = mx.pad(b, [(0, 0)] * (b.ndim - 2) + [(0, pad), (0, 0)])
    a = mx.moveaxis(a.reshape(a.shape[:-1] + (c, _MAX_K_F32)), -2, 0)          # [c, ..., M, chunk]
    b = mx.moveaxis(b.reshape(b.shape[:-2] + (c, _MAX_K_F32, b.shape[-1])), -3, 0)   # [c, ..., chunk, N]
    return mx.sum((a @ b).astype(mx.int32), axis=0)


@register("MatMulInteger", 10, check=_imm_check(0, 1, 2, 3))
def matmul_integer(A, B, a_zero_point=None, b_zero_point=None):
    """int32 (A - a_zp) @ (B - b_zp); b_zp scalar or per column."""
    return _int_product(A, B, a_zero_point, b_zero_point)


@register("QLinearMatMul", 10, check=_imm_check(0, 3, 2, 5, ((1, "a_scale", False), (4, "b_scale", True),
                                                            (6, "y_scale", False))))
def qlinear_matmul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point, *, ctx):
    """y = saturate(round_half_even(float32(int32 product) * (a_scale * b_scale / y_scale)) + y_zp)."""
    acc = _int_product(a, b, a_zero_point, b_zero_point)
    f = mx.float32
    scale = (a_scale.astype(f).reshape(()) * b_scale.astype(f).reshape(-1)) / y_scale.astype(f).reshape(())
    q = mx.round(acc.astype(f) * scale) + y_zero_point.astype(f).reshape(())
    lo, hi = Q_TYPES[ctx.out_dtypes[0]]
    return mx.clip(q, lo, hi).astype(dt.MLX[ctx.out_dtypes[0]])


# ------------------------------------------------------------------ integer convolution
def _qconv_check(x, w, xzp, wzp, scales=(), bias=None):
    """ConvInteger / QLinearConv: 8-bit operands, Conv's attribute rules, provably exact depth."""
    def check(view):
        for i, what in ((x, "x"), (w, "w")):
            if view.dtype(i) not in EIGHT_BIT:
                return f"{what} dtype {dt.name(view.dtype(i))} is not int8/uint8"
        ws = view.shape(w)
        if ws is None or not all(isinstance(d, int) for d in ws[1:]) or not 3 <= len(ws) <= 5:
            return f"weight shape {ws} is not a known 1-D/2-D/3-D kernel"
        reason = _conv_check(_FloatView(view, x, w))
        if reason:
            return reason
        k = int(np.prod(ws[1:]))
        limit = _MAX_K_INT32 if view.device == "cpu" else _MAX_K_F32
        if k > limit:
            return f"C/group x kernel = {k} > {limit}: the integer sum is not provably exact (or would wrap in int32)"
        dil = view.attrs.get("dilations")
        if k > _MAX_K_F32 and dil is not None and any(int(d) != 1 for d in dil):
            return f"depth {k} needs float64, and MLX has no dilated float64 convolution (dilations {list(dil)})"
        m = ws[0]
        reason = (_scalar_or_vector(view, xzp, None, "x's zero point")
                  or _scalar_or_vector(view, wzp, m if scales else None, "w's zero point"))
        if reason:
            return reason
        for i, what, per_ch in scales:
            if view.dtype(i) not in (dt.FLOAT, dt.FLOAT16):
                return f"{what} dtype {dt.name(view.dtype(i))} is not float32/float16"
            reason = _scalar_or_vector(view, i, m if per_ch else None, what)
            if reason:
                return reason
        if bias is not None and view.has(bias):
            b = view.const(bias)
            if b is None or view.device != "cpu":
                return "bias must be a constant (and the device the CPU) to prove the int32 sum exact"
            if int(np.abs(b.astype(np.int64)).max(initial=0)) + k * _MAX_PRODUCT >= 2**31:
                return "bias + products could wrap ORT's int32 accumulator"
        return None
    return check


class _FloatView:
    """A NodeView whose tensors read as float32, to reuse Conv's attribute checks."""

    def __init__(self, view, x: int, w: int):
        self._v, self._idx = view, (x, w)
        self.attrs = view.attrs
        self.n_inputs = 2

    def dtype(self, i):
        return dt.FLOAT

    def has(self, i):
        return i < 2

    def rank(self, i):
        return self._v.rank(self._idx[i])

    def shape(self, i):
        return self._v.shape(self._idx[i])


def _int_conv(x, w, x_zero_point, w_zero_point, device, attrs):
    """int32 convolution of (x - x_zp) with (w - w_zp), exact in float32 (proven depth) / float64 (CPU)."""
    ft = _exact_float(int(np.prod(w.shape[1:])), device)
    xf = x.astype(ft) if x_zero_point is None else x.astype(ft) - x_zero_point.astype(ft).reshape(())
    wf = w.astype(ft)
    if w_zero_point is not None:
        wf = wf - w_zero_point.astype(ft).reshape((-1,) + (1,) * (w.ndim - 1))
    g = attrs["group"]
    if g == 1 or ft != mx.float64:
        return conv(xf, wf, None, **attrs)
    if x.shape[1] % g or w.shape[0] % g:                       # MLX has no grouped float64 convolution
        raise ValueError(f"channels {x.shape[1]} / filters {w.shape[0]} do not split into group {g}")
    ci, co = x.shape[1] // g, w.shape[0] // g
    one = dict(attrs, group=1)
    return mx.concatenate([conv(xf[:, k * ci:(k + 1) * ci], wf[k * co:(k + 1) * co], None, **one)
                           for k in range(g)], axis=1)


@register("ConvInteger", 10, check=_qconv_check(0, 1, 2, 3))
def conv_integer(x, w, x_zero_point=None, w_zero_point=None, *, auto_pad="NOTSET", dilations=None, group=1,
                 kernel_shape=None, pads=None, strides=None, ctx):
    """int32 Conv of (x - x_zp) and (w - w_zp)."""
    attrs = dict(auto_pad=auto_pad, dilations=dilations, group=group, kernel_shape=kernel_shape, pads=pads,
                 strides=strides)
    return _int_conv(x, w, x_zero_point, w_zero_point, ctx.device, attrs).astype(mx.int32)


@register("QLinearConv", 10, check=_qconv_check(0, 3, 2, 5, ((1, "x_scale", False), (4, "w_scale", True),
                                                            (6, "y_scale", False)), bias=8))
def qlinear_conv(x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, B=None, *,
                 auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None, ctx):
    """y = saturate(round_half_even(float32(int32 conv + B) * (x_scale * w_scale / y_scale)) + y_zp)."""
    attrs = dict(auto_pad=auto_pad, dilations=dilations, group=group, kernel_shape=kernel_shape, pads=pads,
                 strides=strides)
    acc = _int_conv(x, w, x_zero_point, w_zero_point, ctx.device, attrs)
    if B is not None:
        acc = acc + B.astype(acc.dtype).reshape((-1,) + (1,) * (x.ndim - 2))
    acc = acc.astype(mx.int32)
    f = mx.float32
    scale = (x_scale.astype(f).reshape(()) * w_scale.astype(f).reshape(-1)) / y_scale.astype(f).reshape(())
    scale = scale.reshape((-1,) + (1,) * (x.ndim - 2))
    q = mx.round(acc.astype(f) * scale) + y_zero_point.astype(f).reshape(())
    lo, hi = Q_TYPES[ctx.out_dtypes[0]]
    return mx.clip(q, lo, hi).astype(dt.MLX[ctx.out_dtypes[0]])
