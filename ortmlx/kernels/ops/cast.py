"""Cast and CastLike between the element types MLX holds, and to/from the carrier types.

Float -> integer truncates toward zero. Carrier types (``dtypes.CARRIERS``) are claimed for:

- float32/float16 <-> float8 (E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ), ``saturate`` 0 or 1. float8 values
  are uint8 bit patterns: decoding is a 256-entry table (``mx.take``); encoding follows ORT's CPU
  conversion (round to nearest even on the float32 bits, ORT's saturate/NaN/zero rules per format)
  in MLX integer ops. float16 inputs are widened to float32 first (exact).
- float32/float16/integers <-> int4/uint4/int2/uint2 (unpacked, one int8/uint8 per element).
  To them: ORT rounds floats half away from zero, then keeps the low bits (wraps); integers wrap.

Every other carrier case (float8 <-> integers/double/bfloat16, carrier -> carrier, float4, e8m0)
is refused. ``round_mode`` only concerns float8e8m0/float4, never claimed here.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ..registry import register


_F16_32 = (dt.FLOAT, dt.FLOAT16)
_INTS_F = dt.INTS | set(_F16_32)


def _carrier_reason(src: int | None, to: int | None) -> str | None:
    if src not in dt.CARRIERS and to not in dt.CARRIERS:
        return None
    if src == to:
        return None
    if src in dt.FLOAT8 and to in _F16_32 or to in dt.FLOAT8 and src in _F16_32:
        return None
    if src in dt.SUBBYTE and to in _INTS_F or to in dt.SUBBYTE and src in _INTS_F:
        return None
    return f"Cast {dt.name(src)} -> {dt.name(to)} is not implemented for carrier types"


def _cast_check(view) -> str | None:
    src, to = view.dtype(0), view.out_dtype(0)
    reason = _carrier_reason(src, to)
    if reason:
        return reason
    if to in dt.FLOAT8 and view.attrs.get("saturate", 1) not in (0, 1):
        return f"saturate={view.attrs.get('saturate')!r}"
    if src == dt.BFLOAT16 and to in (dt.INT8, dt.UINT8):
        # ORT's CPU EP answers 69 for bf16(69.9) == 70.0 -> int8 (it does not use the bf16 value)
        return f"bfloat16 -> {dt.name(to)} Cast differs in ORT's CPU EP (it skips the bf16 rounding)"
    return None


def _to_mx(x, to: int):
    want = dt.MLX.get(to)
    if want is None:
        raise ValueError(f"Cast target {dt.name(to)!r} has no MLX type")
    return x if x.dtype == want else x.astype(want)


def _cast_host(input, *, to, saturate=1, round_mode="up"):
    want = dt.NUMPY.get(to)
    if want is None or to == dt.BFLOAT16:
        raise ValueError(f"Cast target {dt.name(to)!r} cannot be computed on the host")
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(input).astype(want)


# ----------------------------------------------------------------------------- float8
#: format -> (mantissa bits, exponent bias, float32 biased exponent of its smallest normal,
#:            largest exponent field, largest finite magnitude code, FNUZ: no -0, one NaN 0x80)
_F8 = {dt.FLOAT8E4M3FN: (3, 7, 121, 15, 0x7E, False),
       dt.FLOAT8E4M3FNUZ: (3, 8, 120, 15, 0x7F, True),
       dt.FLOAT8E5M2: (2, 15, 113, 30, 0x7B, False),
       dt.FLOAT8E5M2FNUZ: (2, 16, 112, 31, 0x7F, True)}


def _f8_table(t: int) -> np.ndarray:
    """float32 bit pattern of each of the 256 codes of float8 format ``t`` (ORT's decoding)."""
    mb, bias, _, _, _, fnuz = _F8[t]
    c = np.arange(256)
    e, m = (c >> mb) & ((1 << (7 - mb)) - 1), c & ((1 << mb) - 1)
    mag = np.where(e == 0, m * 2.0 ** (1 - bias - mb), (1 + m / 2.0 ** mb) * 2.0 ** (e - bias))
    bits = np.where(c & 0x80, -mag, mag).astype(np.float32).view(np.uint32).copy()
    if fnuz:
        bits[0x80] = 0xFFC00000
    elif t == dt.FLOAT8E4M3FN:
        bits[0x7F], bits[0xFF] = 0x7FC00000, 0xFFC00000
    else:           # E5M2: 0x7C/0xFC are +-inf, the codes above them NaN
        bits[0x7C], bits[0xFC] = 0x7F800000, 0xFF800000
        bits[0x7D:0x80], bits[0xFD:] = 0x7FC00000, 0xFFC00000
    return bits


_TABLES: dict = {}


def _f8_decode(x: mx.array, t: int, to: int) -> mx.array:
    key = (t, to)
    tab = _TABLES.get(key)
    if tab is None:
        b32 = _f8_table(t)
        tab = mx.array(b32) if to == dt.FLOAT else mx.array(b32.view(np.float32).astype(np.float16).view(np.uint16))
        _TABLES[key] = tab
    out = mx.take(tab, x.astype(mx.int32))
    return out.view(mx.float32 if to == dt.FLOAT else mx.float16)


def _f8_encode(x: mx.array, t: int, saturate: int) -> mx.array:
    """float32/float16 -> float8 format ``t`` codes (uint8), as ORT's CPU conversion rounds them."""
    mb, _, e_norm, e_top, top, fnuz = _F8[t]
    i32 = mx.int32
    b = x.astype(mx.float32).view(i32)
    s = (b >> 24) & 0x80
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    sig = m | 0x800000                                      # with the implicit bit
    sub = e < e_norm
    shift = mx.minimum(mx.where(sub, (23 - mb) + e_norm - e, 23 - mb), 24)
    v = mx.where(sub, 0, (e - e_norm) << mb) + (sig >> shift)   # truncated magnitude code
    rb = (sig >> (shift - 1)) & 1
    sticky = (sig & ((mx.array(1, i32) << (shift - 1)) - 1)) != 0
    up = (rb == 1) & (sticky | ((v & 1) == 1))
    if t == dt.FLOAT8E4M3FN:
        v = mx.where(v == 0x7F, 0x7E, v)                    # ORT drops the NaN code before rounding
    over_r = up & (v >= top)                                # rounding past the largest finite code
    mag = mx.where(up & (v < top), v + 1, v)
    v = mx.where(mag == 0, 0, s | mag) if fnuz else s | mag  # FNUZ: no negative zero
    nan_code = mx.array(0x80, i32) if fnuz else s | 0x7F
    if saturate:
        big = s | top
    else:
        big = mx.array(0x80, i32) if fnuz else s | (0x7C if t == dt.FLOAT8E5M2 else 0x7F)
        v = mx.where(over_r, nan_code, v)
    under = e < e_norm - mb - 1
    v = mx.where(under, 0 if fnuz else s, v)
    v = mx.where(e >= e_norm + e_top, big, v)               # overflow and inf
    v = mx.where((e == 0xFF) & (m != 0), nan_code, v)
    return v.astype(mx.uint8)


# ----------------------------------------------------------------------------- int4 / int2
def _to_subbyte(x: mx.array, t: int) -> mx.array:
    """-> int4/uint4/int2/uint2 carrier: floats round half away from zero, then all wrap to the low bits."""
    bits, signed = dt.SUBBYTE[t]
    if mx.issubdtype(x.dtype, mx.floating):
        x = x.astype(mx.float32)
        r = mx.trunc(x) if hasattr(mx, "trunc") else mx.where(x < 0, mx.ceil(x), mx.floor(x))
        r = mx.where(mx.abs(x - r) >= 0.5, r + mx.where(x < 0, -1.0, 1.0), r)
        # beyond 2**27 every float is a multiple of 16 (low bits 0), as are NaN/inf in ORT's answer
        x = mx.where(mx.abs(r) < 2.0 ** 27, r, 0.0).astype(mx.int32)
    v = (x & ((1 << bits) - 1)).astype(mx.uint8)
    if signed:
        return (v << (8 - bits)).view(mx.int8) >> (8 - bits)
    return v


def _carrier_cast(x: mx.array, src: int, to: int, saturate: int) -> mx.array:
    if src == to:
        return x
    if src in dt.FLOAT8:
        return _f8_decode(x, src, to)
    if to in dt.FLOAT8:
        return _f8_encode(x, to, saturate)
    if to in dt.SUBBYTE:
        return _to_subbyte(x, to)
    return x.astype(dt.MLX[to])         # sub-byte carrier (int8/uint8 values) -> float/integer


@register("Cast", 6, check=_cast_check, host=_cast_host, carriers=True)
def cast(input, *, to, saturate=1, round_mode="up", ctx):
    """input converted to element type ``to``."""
    src, out = ctx.in_dtypes[0], ctx.out_dtypes[0]
    if src in dt.CARRIERS or out in dt.CARRIERS:
        return _carrier_cast(input, src, out, saturate)
    return _to_mx(input, to)


def _castlike_host(input, target_type, *, saturate=1, round_mode="up"):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(input).astype(np.asarray(target_type).dtype)


@register("CastLike", 15, check=_cast_check, host=_castlike_host, carriers=True)
def cast_like(input, target_type, *, saturate=1, round_mode="up", ctx):
    """input converted to the element type of ``target_type``."""
    src, out = ctx.in_dtypes[0], ctx.out_dtypes[0]
    if src in dt.CARRIERS or out in dt.CARRIERS:
        return _carrier_cast(input, src, out, saturate)
    return input if input.dtype == target_type.dtype else input.astype(target_type.dtype)
