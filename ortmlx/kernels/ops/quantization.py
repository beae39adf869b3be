"""Linear quantization: QuantizeLinear, DequantizeLinear (per-tensor, per-axis, blocked),
DynamicQuantizeLinear, MatMulInteger.

Integer types only (int8/uint8/int16/uint16, int32 for DequantizeLinear): float8 and
4-bit types do not exist in MLX and are refused by the generic dtype rule. Arithmetic
follows ORT's CPU kernels: dequantize is float(int32(x) - int32(zp)) * scale; quantize is
round-half-even(x / scale) + zp, saturated; half types are computed in float32.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ..registry import register

Q_TYPES = {dt.UINT8: (0, 255), dt.INT8: (-128, 127), dt.UINT16: (0, 65535), dt.INT16: (-32768, 32767)}
DQ_INPUTS = frozenset(Q_TYPES) | {dt.INT32}
SCALES = frozenset({dt.FLOAT, dt.FLOAT16, dt.BFLOAT16})


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
        r = view.rank(0)
        axis, bs = a.get("axis", 1), a.get("block_size", 0)
        if bs < 0:
            return f"block_size {bs} < 0"
        if a.get("precision", 0) not in (0, dt.FLOAT):
            return f"precision {dt.name(a['precision'])} (only float32 division is implemented)"
        sc = view.dtype(1)
        if sc not in SCALES:
            return f"scale dtype {dt.name(sc)} is not float32/float16/bfloat16"
        if quantize:
            if view.dtype(0) not in SCALES:
                return f"input dtype {dt.name(view.dtype(0))} is not a float"
            out = view.out_dtype(0)
            if out not in Q_TYPES:
                return f"output dtype {dt.name(out)} is not int8/uint8/int16/uint16"
        else:
            if view.dtype(0) not in DQ_INPUTS:
                return f"input dtype {dt.name(view.dtype(0))} is not an 8/16/32-bit integer"
            if view.dtype(0) == dt.INT32 and view.has(2):
                zp = view.const(2)
                if zp is None or np.any(zp != 0):
                    return "int32 input with a zero point that is not a constant 0"
            if view.out_dtype(0) not in SCALES:
                return f"output dtype {dt.name(view.out_dtype(0))} is not a float"
        if view.has(2) and view.dtype(2) != (view.dtype(0) if not quantize else view.out_dtype(0)):
            return f"zero point dtype {dt.name(view.dtype(2))} does not match the quantized type"
        ss, xs = view.shape(1), view.shape(0)
        if ss is not None and xs is not None and all(isinstance(d, int) for d in (*ss, *xs)):
            try:
                _param_layout(ss, xs, axis, bs)
            except ValueError as e:
                return str(e)
        return None
    return check


def _dequantize(x, scale, zp, axis, block_size, out_t):
    s = _broadcast(scale, x.shape, axis, block_size).astype(mx.float32)
    q = x.astype(mx.int32)
    if zp is not None:
        q = q - _broadcast(zp, x.shape, axis, block_size).astype(mx.int32)
    return (q.astype(mx.float32) * s).astype(out_t)


def _quantize(x, scale, zp, axis, block_size, out_t: int):
    lo, hi = Q_TYPES[out_t]
    s = _broadcast(scale, x.shape, axis, block_size).astype(mx.float32)
    q = mx.round(x.astype(mx.float32) / s)
    if zp is not None:
        q = q + _broadcast(zp, x.shape, axis, block_size).astype(mx.float32)
    return mx.clip(q, lo, hi).astype(dt.MLX[out_t])


# ------------------------------------------------------------------ DequantizeLinear
@register("DequantizeLinear", 10, check=_check(False))
def dequantize_linear_10(x, x_scale, x_zero_point=None, *, ctx):
    """y = (x - zp) * scale, per tensor."""
    return _dequantize(x, x_scale, x_zero_point, 1, 0, dt.MLX[ctx.out_dtypes[0]])


@register("DequantizeLinear", 13, check=_check(False))
def dequantize_linear_13(x, x_scale, x_zero_point=None, *, axis=1, ctx):
    """Per tensor or per ``axis``."""
    return _dequantize(x, x_scale, x_zero_point, axis, 0, dt.MLX[ctx.out_dtypes[0]])


@register("DequantizeLinear", 21, check=_check(False))
def dequantize_linear_21(x, x_scale, x_zero_point=None, *, axis=1, block_size=0, ctx):
    """Per tensor, per axis, or blocks of ``block_size`` along ``axis``."""
    return _dequantize(x, x_scale, x_zero_point, axis, block_size, dt.MLX[ctx.out_dtypes[0]])


@register("DequantizeLinear", 23, check=_check(False))
def dequantize_linear_23(x, x_scale, x_zero_point=None, *, axis=1, block_size=0, output_dtype=0, ctx):
    """output_dtype (0: the scale's type) is what the graph declares for y."""
    return _dequantize(x, x_scale, x_zero_point, axis, block_size, dt.MLX[ctx.out_dtypes[0]])


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


@register("QuantizeLinear", 21, check=_check(True))
def quantize_linear_21(x, y_scale, y_zero_point=None, *, axis=1, block_size=0, output_dtype=0, saturate=1, ctx):
    return _quantize(x, y_scale, y_zero_point, axis, block_size, ctx.out_dtypes[0])


@register("QuantizeLinear", 23, check=_check(True))
def quantize_linear_23(x, y_scale, y_zero_point=None, *, axis=1, block_size=0, output_dtype=0, precision=0,
                       saturate=1, ctx):
    """``precision`` 0 or float32: the division runs in float32 (as ORT's CPU EP does)."""
    return _quantize(x, y_scale, y_zero_point, axis, block_size, ctx.out_dtypes[0])


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
