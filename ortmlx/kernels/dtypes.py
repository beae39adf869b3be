"""ONNX element types <-> numpy <-> MLX.

bfloat16 has no numpy dtype: it crosses the host boundary as uint16 bits and is
viewed as ``mx.bfloat16`` on the MLX side. float64 exists in MLX on the CPU
device only.
"""
from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import numpy as np

FLOAT, UINT8, INT8, UINT16, INT16, INT32, INT64, STRING, BOOL = 1, 2, 3, 4, 5, 6, 7, 8, 9
FLOAT16, DOUBLE, UINT32, UINT64, COMPLEX64, COMPLEX128, BFLOAT16 = 10, 11, 12, 13, 14, 15, 16
FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ, UINT4, INT4 = 17, 18, 19, 20, 21, 22
#: ORT's C enum (what the EP reads from the graph) numbers the 2-bit types 24/25; ONNX's TensorProto
#: numbers them 25/26 (it has FLOAT8E8M0 at 24). A Cast's ``to`` attribute uses ONNX's numbers.
UINT2, INT2 = 24, 25

NAMES = {FLOAT: "float32", UINT8: "uint8", INT8: "int8", UINT16: "uint16", INT16: "int16",
         INT32: "int32", INT64: "int64", STRING: "string", BOOL: "bool", FLOAT16: "float16",
         DOUBLE: "float64", UINT32: "uint32", UINT64: "uint64", COMPLEX64: "complex64",
         COMPLEX128: "complex128", BFLOAT16: "bfloat16", FLOAT8E4M3FN: "float8e4m3fn",
         FLOAT8E4M3FNUZ: "float8e4m3fnuz", FLOAT8E5M2: "float8e5m2", FLOAT8E5M2FNUZ: "float8e5m2fnuz",
         UINT4: "uint4", INT4: "int4", UINT2: "uint2", INT2: "int2"}

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

# Carrier types: element types MLX lacks, held one element per byte. float8 travels as its uint8 bit
# pattern; 4- and 2-bit integers (packed by ORT, low bits first) are unpacked at the EP boundary into
# one int8/uint8 value each and packed again on the way out. They are in none of the sets above, so
# the generic dtype rule refuses them; only translators registered with ``carriers=True`` see them
# (and must handle their meaning themselves: a float8 carrier is bits, not a number).
FLOAT8 = frozenset({FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ})
#: sub-byte integer type -> (bits, signed)
SUBBYTE = {UINT4: (4, False), INT4: (4, True), UINT2: (2, False), INT2: (2, True)}
#: carrier type -> numpy dtype of its one-per-byte carrier
CARRIERS = {**{t: np.dtype(np.uint8) for t in FLOAT8},
            **{t: np.dtype(np.int8 if sg else np.uint8) for t, (_, sg) in SUBBYTE.items()}}
CARRIER_MLX = {t: (mx.int8 if c == np.int8 else mx.uint8) for t, c in CARRIERS.items()}


def carrier_bits(t: int) -> int:
    return SUBBYTE[t][0] if t in SUBBYTE else 8


def carrier_nbytes(t: int, n: int) -> int:
    """Bytes ORT stores ``n`` elements of carrier type ``t`` in."""
    return (n * carrier_bits(t) + 7) // 8


def unpack_carrier(raw, t: int, n: int) -> np.ndarray:
    """ORT's storage of ``n`` elements of carrier type ``t`` (a buffer) -> flat one-per-byte carrier.

    float8: a zero-copy uint8 view. Sub-byte: element i sits in byte i // k at bit (i % k) * bits.
    """
    b = np.frombuffer(raw, np.uint8, count=carrier_nbytes(t, n))
    if t not in SUBBYTE:
        return b
    bits, signed = SUBBYTE[t]
    v = ((b[:, None] >> np.arange(0, 8, bits, dtype=np.uint8)) & np.uint8((1 << bits) - 1)).reshape(-1)[:n]
    if signed:      # sign-extend: move the field to the top of an int8 and shift it back arithmetically
        v = (v << np.uint8(8 - bits)).view(np.int8) >> np.int8(8 - bits)
    return np.ascontiguousarray(v)


def pack_carrier(a: np.ndarray, t: int) -> np.ndarray:
    """A one-per-byte carrier array -> ORT's flat uint8 storage (inverse of ``unpack_carrier``)."""
    a = np.ascontiguousarray(a).reshape(-1)
    if a.dtype != CARRIERS[t]:
        raise ValueError(f"{name(t)} output arrived as {a.dtype}, not its carrier {CARRIERS[t]}")
    u = a.view(np.uint8)
    if t not in SUBBYTE:
        return u
    bits = SUBBYTE[t][0]
    k = 8 // bits
    u = u & np.uint8((1 << bits) - 1)
    pad = (-u.size) % k
    if pad:
        u = np.concatenate([u, np.zeros(pad, np.uint8)])
    u = u.reshape(-1, k)
    out = u[:, 0].copy()
    for j in range(1, k):
        out |= u[:, j] << np.uint8(j * bits)
    return out


def name(t: int | None) -> str:
    return NAMES.get(t, f"type{t}") if t is not None else "unknown"


def supported_on(t: int | None, device: str) -> bool:
    """Whether MLX can hold element type ``t`` on ``device`` ('cpu' or 'gpu')."""
    if t == DOUBLE:
        return device == "cpu"
    return t in MLX


class Upload(Protocol):
    """How a host array of element type ``t`` becomes an MLX array (``to_mx``, or the runtime's staged copy)."""

    def __call__(self, a: np.ndarray, t: int) -> mx.array: ...


def to_mx(a: np.ndarray, t: int) -> mx.array:
    """Copy a host array of element type ``t`` into MLX (bf16 arrives as uint16 bits; carriers as carriers)."""
    if isinstance(a, np.ndarray) and a.size == 0:
        # an empty value holds nothing; MLX 0.32.4's CPU sum over an empty array copied from NumPy leaves its
        # result unwritten (garbage), over a fresh empty one it gives 0 (as the interpreter's empty step outputs)
        return mx.zeros(a.shape, CARRIER_MLX.get(t) or MLX[t])
    if isinstance(a, np.ndarray) and a.ndim and min(a.strides) < 0:
        # MLX takes no negative strides (a host Slice with a negative step; NumPy calls a one-element one contiguous)
        a = a.copy()
    if t in CARRIER_MLX:
        a = np.asarray(a)
        if a.dtype != CARRIERS[t]:
            raise ValueError(f"{name(t)} value arrived as {a.dtype}, not its carrier {CARRIERS[t]}")
        return mx.array(a, dtype=CARRIER_MLX[t])
    if t == BFLOAT16:
        return mx.array(a.view(np.uint16), dtype=mx.uint16).view(mx.bfloat16)
    return mx.array(a, dtype=MLX[t])


#: constants at least this large get a device-memory copy on a CUDA GPU (``device_copies``)
DEVICE_COPY_BYTES = 1 << 16
#: ``device_copies`` evaluates its copies this many bytes at a time
DEVICE_COPY_CHUNK = 256 << 20

_UINTS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def device_copies(arrays: dict, col_major: frozenset = frozenset()) -> list[str]:
    """Replace, in ``arrays`` (name -> evaluated mx.array), each large array by a copy made by a kernel:
    the same values bit for bit; 2-D arrays named in ``col_major`` (and [1, K, N] ones: their last two axes) in column-major
    layout (a transposed view of a row-major copy). Returns the names made column-major.

    On MLX's CUDA backend ``mx.array(numpy)`` allocates managed (unified) memory, while a kernel's
    output lives in device memory: weights uploaded once are moved there. A MatMul whose [K, N]
    weight is column-major is a transposed-B product, which MLX runs with its own gemv kernel for a
    single row (decode) instead of a captured cuBLASLt call. Copies are made ``DEVICE_COPY_CHUNK``
    bytes at a time; each chunk's originals are dropped (when ``arrays`` held the only reference) and
    MLX's cache cleared before the next, so memory peaks one chunk above the arrays and a freed
    managed buffer is never reused for a copy.
    """
    pending, size, made = [], 0, []

    def flush():
        mx.eval(*(c for _, c in pending))
        for k, c in pending:
            arrays[k] = c
        pending.clear()
        mx.clear_cache()

    for k in list(arrays):                      # keys only: a list of the arrays would keep every original alive
        a = arrays[k]
        if a.nbytes < DEVICE_COPY_BYTES or a.dtype.size not in _UINTS:
            continue
        if k in col_major and (a.ndim == 2 or (a.ndim == 3 and a.shape[0] == 1)):   # [K, N] or [1, K, N]
            c = mx.contiguous(a.swapaxes(-1, -2)).swapaxes(-1, -2)
            made.append(k)
        else:
            u = a.view(_UINTS[a.dtype.size]) if a.dtype != _UINTS[a.dtype.size] else a
            c = mx.bitwise_or(u, mx.array(0, u.dtype))
            c = c.view(a.dtype) if c.dtype != a.dtype else c
        pending.append((k, c))
        size += a.nbytes
        del a, c
        if size >= DEVICE_COPY_CHUNK:
            flush()
            size = 0
    if pending:
        flush()
    return made


def to_numpy(a: mx.array) -> np.ndarray:
    """Zero-copy host view of an evaluated MLX array (bf16 as uint16 bits). Never write into it."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


def host(v) -> np.ndarray:
    """A host (numpy) array of an MLX or host value: ``to_numpy`` for MLX (evaluates it), else ``np.asarray``."""
    return to_numpy(v) if isinstance(v, mx.array) else np.asarray(v)


def onnx_type_of(a) -> int:
    """Element type of an MLX or numpy array."""
    if isinstance(a, mx.array):
        return FROM_MLX[a.dtype]
    return FROM_NUMPY[np.asarray(a).dtype]
