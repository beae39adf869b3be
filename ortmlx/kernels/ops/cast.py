"""Cast and CastLike between the element types MLX holds.

Float -> integer truncates toward zero. Targets MLX has no type for (string, float8,
int4, float4 ...) are refused by the generic dtype rule, so ``saturate`` and
``round_mode`` (which only concern float8/float4) never change a result here.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ..registry import register


def _cast_check(view) -> str | None:
    src, to = view.dtype(0), view.out_dtype(0)
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


@register("Cast", 6, check=_cast_check, host=_cast_host)
def cast(input, *, to, saturate=1, round_mode="up"):
    """input converted to element type ``to``."""
    return _to_mx(input, to)


def _castlike_host(input, target_type, *, saturate=1, round_mode="up"):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(input).astype(np.asarray(target_type).dtype)


@register("CastLike", 15, check=_cast_check, host=_castlike_host)
def cast_like(input, target_type, *, saturate=1, round_mode="up"):
    """input converted to the element type of ``target_type``."""
    return input if input.dtype == target_type.dtype else input.astype(target_type.dtype)
