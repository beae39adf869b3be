"""BitCast (opset 26): reinterpret the bytes of a tensor as another element type of the same width.

``mx.view`` keeps the bit pattern exactly (NaN payloads, -0.0); MLX and ORT are both little
endian here. Handled types are the ones MLX holds (float64 only on the CPU device, by the
generic dtype rule). bool is refused: ORT's CPU EP has no BitCast kernel for it (nothing to
verify against), and a non-bool byte viewed as bool need not be 0/1.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..registry import register

#: element types BitCast handles, listed explicitly (carrier types added elsewhere are not claimed)
BITCAST_TYPES = frozenset({dt.FLOAT, dt.UINT8, dt.INT8, dt.UINT16, dt.INT16, dt.INT32, dt.INT64,
                           dt.FLOAT16, dt.DOUBLE, dt.UINT32, dt.UINT64, dt.BFLOAT16})


def _width(t: int) -> int:
    return np.dtype(dt.NUMPY[t]).itemsize


def _bitcast_check(view) -> str | None:
    src, to = view.dtype(0), view.attrs["to"]
    if dt.BOOL in (src, to):
        return "BitCast of bool has no ORT CPU kernel to verify against"
    if src not in BITCAST_TYPES:
        return f"BitCast from {dt.name(src)} is not handled"
    if to not in BITCAST_TYPES:
        return f"BitCast to {dt.name(to)} is not handled"
    if view.out_dtype(0) not in (None, to):
        return f"output is declared {dt.name(view.out_dtype(0))}, 'to' is {dt.name(to)}"
    if _width(src) != _width(to):
        return f"BitCast {dt.name(src)} -> {dt.name(to)} changes the bit width (invalid)"
    return None


@register("BitCast", 26, check=_bitcast_check)
def bitcast(input, *, to):
    """The same bytes viewed as element type ``to`` (same width: the shape is unchanged)."""
    return input.view(dt.MLX[to])
