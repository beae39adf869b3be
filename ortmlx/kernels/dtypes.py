"""ONNX element types <-> numpy <-> MLX.

bfloat16 has no numpy dtype: it crosses the host boundary as uint16 bits and is
viewed as ``mx.bfloat16`` on the MLX side. float64 exists in MLX on the CPU
device only.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

FLOAT, UINT8, INT8, UINT16, INT16, INT32, INT64, STRING, BOOL = 1, 2, 3, 4, 5, 6, 7, 8, 9
FLOAT16, DOUBLE, UINT32, UINT64, COMPLEX64, COMPLEX128, BFLOAT16 = 10, 11, 12, 13, 14, 15, 16

NAMES = {FLOAT: "float32", UINT8: "uint8", INT8: "int8", UINT16: "uint16", INT16: "int16",
         INT32: "int32", INT64: "int64", STRING: "string", BOOL: "bool", FLOAT16: "float16",
         DOUBLE: "float64", UINT32: "uint32", UINT64: "uint64", COMPLEX64: "complex64",
         COMPLEX128: "complex128", BFLOAT16: "bfloat16"}

#: host (numpy) dtype of each element type we move; bf16 moves as its uint16 bits
NUMPY = {FLOAT: np.float32, UINT8: np.uint8, INT8: np.int8, UINT16: np.uint16, INT16: np.int16,
         INT32: np.int32, INT64: np.int64, BOOL: np.bool_, FLOAT16: np.float16, DOUBLE: np.float64,
         UINT32: np.uint32, UINT64: np.uint64, BFLOAT16: np.uint16}

MLX = {FLOAT: mx.float32, UINT8: mx.uint8, INT8: mx.int8, UINT16: mx.uint16, INT16: mx.int16,
       INT32: mx.int32, INT64: mx.int64, BOOL: mx.bool_, FLOAT16: mx.float16, DOUBLE: mx.float64,
       UINT32: mx.uint32, UINT64: mx.uint64, BFLOAT16: mx.bfloat16}

FROM_MLX = {v: k for k, v in MLX.items()}
FROM_NUMPY = {np.dtype(v): k for k, v in NUMPY.items() if k != BFLOAT16}

FLOATS = frozenset({FLOAT, FLOAT16, BFLOAT16, DOUBLE})
INTS = frozenset({UINT8, INT8, UINT16, INT16, INT32, INT64, UINT32, UINT64})
SIGNED = frozenset({INT8, INT16, INT32, INT64})
NUMERIC = FLOATS | INTS


def name(t: int | None) -> str:
    return NAMES.get(t, f"type{t}") if t is not None else "unknown"


def supported_on(t: int | None, device: str) -> bool:
    """Whether MLX can hold element type ``t`` on ``device`` ('cpu' or 'gpu')."""
    if t == DOUBLE:
        return device == "cpu"
    return t in MLX


def to_mx(a: np.ndarray, t: int) -> mx.array:
    """Copy a host array of element type ``t`` into MLX (bf16 arrives as uint16 bits)."""
    if t == BFLOAT16:
        return mx.array(a.view(np.uint16), dtype=mx.uint16).view(mx.bfloat16)
    return mx.array(a, dtype=MLX[t])


def to_numpy(a: mx.array) -> np.ndarray:
    """Zero-copy host view of an evaluated MLX array (bf16 as uint16 bits). Never write into it."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


def onnx_type_of(a) -> int:
    """Element type of an MLX or numpy array."""
    if isinstance(a, mx.array):
        return FROM_MLX[a.dtype]
    return FROM_NUMPY[np.asarray(a).dtype]
