"""Comparisons, logical and bitwise ops, Where, IsNaN/IsInf.

Dtype sets are those ORT's CPU EP has kernels for, plus bfloat16 (tested against the CPU
EP's float32 result). Comparisons with NaN are false
(Equal) or false (ordering), as in IEEE; numpy twins serve host shape math.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ..registry import register, same_input_types

NUM = frozenset({dt.FLOAT, dt.FLOAT16, dt.DOUBLE, dt.BFLOAT16}) | dt.INTS
BOOL = frozenset({dt.BOOL})
BITS = dt.INTS




# ---------------------------------------------------------------- comparisons
@register("Equal", 7, dtypes=NUM | BOOL, check=same_input_types, host=np.equal)
def equal(A, B):
    """A == B."""
    return mx.equal(A, B)


@register("Less", 7, dtypes=NUM, check=same_input_types, host=np.less)
def less(A, B):
    """A < B."""
    return mx.less(A, B)


@register("Greater", 7, dtypes=NUM, check=same_input_types, host=np.greater)
def greater(A, B):
    """A > B."""
    return mx.greater(A, B)


@register("LessOrEqual", 12, dtypes=NUM, check=same_input_types, host=np.less_equal)
def less_or_equal(A, B):
    """A <= B."""
    return mx.less_equal(A, B)


@register("GreaterOrEqual", 12, dtypes=NUM, check=same_input_types, host=np.greater_equal)
def greater_or_equal(A, B):
    """A >= B."""
    return mx.greater_equal(A, B)


# ---------------------------------------------------------------- logical
@register("And", 7, dtypes=BOOL, host=np.logical_and)
def and_(A, B):
    """A and B."""
    return mx.logical_and(A, B)


@register("Or", 7, dtypes=BOOL, host=np.logical_or)
def or_(A, B):
    """A or B."""
    return mx.logical_or(A, B)


@register("Xor", 7, dtypes=BOOL, host=np.logical_xor)
def xor(A, B):
    """A xor B."""
    return mx.not_equal(A, B)


@register("Not", 1, dtypes=BOOL, host=np.logical_not)
def not_(X):
    """not X."""
    return mx.logical_not(X)


# ---------------------------------------------------------------- bitwise
@register("BitwiseAnd", 18, dtypes=BITS, check=same_input_types)
def bitwise_and(A, B):
    """A & B."""
    return mx.bitwise_and(A, B)


@register("BitwiseOr", 18, dtypes=BITS, check=same_input_types)
def bitwise_or(A, B):
    """A | B."""
    return mx.bitwise_or(A, B)


@register("BitwiseXor", 18, dtypes=BITS, check=same_input_types)
def bitwise_xor(A, B):
    """A ^ B."""
    return mx.bitwise_xor(A, B)


@register("BitwiseNot", 18, dtypes=BITS)
def bitwise_not(X):
    """~X."""
    return mx.bitwise_invert(X)


SHIFT = frozenset({dt.UINT8, dt.UINT32, dt.UINT64})
_WIDTH = {dt.UINT8: 8, dt.UINT32: 32, dt.UINT64: 64}


def _bitshift_check(view) -> str | None:
    r = same_input_types(view)
    if r:
        return r
    if view.attrs.get("direction") not in ("LEFT", "RIGHT"):
        return f"BitShift direction={view.attrs.get('direction')!r} is not 'LEFT' or 'RIGHT'"
    y = view.const(1)
    if y is None:
        return "BitShift amounts are not a constant (shifts by >= the bit width differ across kernels)"
    w = _WIDTH[view.dtype(0)]
    if y.size and int(y.max()) >= w:
        return f"BitShift by {int(y.max())} >= bit width {w} (undefined in ORT's C++ kernel)"
    return None


@register("BitShift", 11, dtypes=SHIFT, check=_bitshift_check)
def bitshift(X, Y, *, direction):
    """X << Y or X >> Y (unsigned; amounts below the bit width)."""
    if direction == "LEFT":
        return mx.left_shift(X, Y)
    return mx.right_shift(X, Y)


# ---------------------------------------------------------------- Where, IsNaN, IsInf
WHERE = frozenset({dt.FLOAT, dt.FLOAT16, dt.DOUBLE, dt.BFLOAT16, dt.INT8, dt.UINT8, dt.INT32, dt.UINT32, dt.INT64})


def _where_check(view) -> str | None:
    if view.dtype(0) != dt.BOOL:
        return f"Where condition is {dt.name(view.dtype(0))}, not bool"
    if view.dtype(1) != view.dtype(2):
        return f"Where X is {dt.name(view.dtype(1))}, Y is {dt.name(view.dtype(2))}"
    if view.dtype(1) not in WHERE:
        return f"Where on {dt.name(view.dtype(1))} has no ORT CPU kernel to verify against"
    return None


def _where_host(condition, X, Y):
    return np.where(condition, X, Y)


@register("Where", 9, check=_where_check, host=_where_host)
def where(condition, X, Y):
    """X where condition else Y (all three broadcast)."""
    return mx.where(condition, X, Y)


@register("IsNaN", 9, dtypes=frozenset({dt.FLOAT, dt.FLOAT16, dt.DOUBLE, dt.BFLOAT16}))
def isnan(X):
    """X is NaN."""
    return mx.isnan(X)


@register("IsInf", 10, dtypes=frozenset({dt.FLOAT, dt.FLOAT16, dt.DOUBLE, dt.BFLOAT16}))
def isinf(X, *, detect_negative=1, detect_positive=1):
    """X is +inf (detect_positive) or -inf (detect_negative)."""
    if detect_negative and detect_positive:
        return mx.isinf(X)
    if detect_negative:
        return mx.isneginf(X)
    if detect_positive:
        return mx.isposinf(X)
    return mx.zeros(X.shape, mx.bool_)
