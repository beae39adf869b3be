"""Values made once and reused: integer ranges and casts of a group's constants (work shared by the
nodes of one graph build: ``build.memo``).

``mx.compile`` does no constant folding: an ``mx.arange`` or an ``astype`` of a constant inside
a traced closure runs again on every call, one kernel each, and work over fresh ranges is never
merged between layers. These helpers hand back evaluated arrays instead. Inside a trace they are
captured constants, so the same work over them in several layers (the rotary rows, the attention
mask) is merged by compile's common-subexpression pass; eagerly they save the kernels too.
"""
from __future__ import annotations

import functools
import threading
import weakref

import mlx.core as mx

from . import build

#: casts of constants up to this many elements are kept (larger ones are recast each call)
CAST_MAX_ELEMS = 1 << 20
#: MLX's CUDA allocator serves arrays of this many bytes or less from a pool of managed memory that every kernel
#: reading one reads across the bus (~10 us of GPU time a kernel: docs/performance.md); ``roomy`` keeps constants
#: out of it
POOLED_BYTES = 8
#: the bytes a ``roomy`` array's buffer holds at least
ROOM_BYTES = 16


def _room(a: mx.array) -> mx.array:
    """``a`` (lazy) as a view into the front of ``ROOM_BYTES`` a kernel writes, the rest zeros."""
    room = -(-ROOM_BYTES // a.dtype.size)
    return mx.concatenate([a.reshape(-1), mx.zeros((room - a.size,), a.dtype)])[:a.size].reshape(a.shape)


def roomy(a: mx.array) -> mx.array:
    """``a``, evaluated; one of ``POOLED_BYTES`` or less as a view into a buffer of ``ROOM_BYTES`` that a kernel
    wrote (on MLX's CUDA backend: device memory, not the pool). The same values, shape and type."""
    if 0 < a.nbytes <= POOLED_BYTES:
        a = _room(a)
    mx.eval(a)
    return a


def roomy_all(arrays: dict) -> int:
    """``roomy`` for every array of ``arrays`` (name -> array) in place, in one evaluation (a graph's scalar
    constants: every fused kernel reading one would read MLX's pool). Returns how many were replaced."""
    small = {k: _room(a) for k, a in arrays.items() if 0 < a.nbytes <= POOLED_BYTES}
    mx.eval(*small.values())
    arrays.update(small)
    return len(small)


def unpooled(fn, a: mx.array) -> mx.array:
    """``fn(a)`` for an elementwise ``fn`` (lazy: inside a trace too), made where the build asks for it
    (``build.unpooled``) and ``a`` has ``POOLED_BYTES`` or less over ``a`` added to ``ROOM_BYTES`` or more of zeros
    (a broadcast of ``a`` alone would keep its size: MLX allocates an elementwise result over broadcast inputs at
    their data size), seen through a slice of its first row (a view: an index would gather into a new small array).
    For a length every layer's kernel reads. A shapeless trace keeps ``fn(a)`` (MLX cannot trace a slice
    shapeless)."""
    if not 0 < a.nbytes <= POOLED_BYTES or build.shapeless() or not build.unpooled():
        return fn(a)
    rows = -(-ROOM_BYTES // a.nbytes)
    wide = a.reshape(1, -1) + zeros((rows, a.size), a.dtype)
    return fn(wide)[:1].reshape(a.shape)


@functools.lru_cache(maxsize=512)
def arange(n: int, dtype=mx.int32, start: int = 0) -> mx.array:
    """``mx.arange(start, start + n, dtype=dtype)``, evaluated once (never write into it)."""
    if n < 0:
        raise ValueError(f"arange length {n} is negative")
    return roomy(mx.arange(start, start + n, dtype=dtype))


@functools.lru_cache(maxsize=256)
def zeros(shape: tuple, dtype=mx.float32) -> mx.array:
    """``mx.zeros(shape, dtype)``, evaluated once (never write into it): inside a trace a captured
    constant, where ``mx.zeros`` would be a fill kernel every call."""
    return roomy(mx.zeros(tuple(shape), dtype))


@functools.lru_cache(maxsize=256)
def scalar(value, dtype) -> mx.array:
    """A 0-d ``value`` of ``dtype``, evaluated once (``roomy``): an operand for a kernel over a large array, where a
    Python number would be MLX's pooled scalar."""
    return roomy(mx.array(value, dtype))


#: re-entrant: a registered constant dying while ``register`` holds the lock (a collection run by its own
#: allocations) calls ``_forget`` on the same thread
_lock = threading.RLock()
#: id(constant) -> (weak reference to it, {dtype: evaluated cast})
_CONSTS: dict[int, tuple[weakref.ref, dict]] = {}


def register(arrays) -> None:
    """Mark evaluated ``arrays`` (a group's constants) as castable once by ``cast``."""
    with _lock:
        for a in arrays:
            if isinstance(a, mx.array) and a.size <= CAST_MAX_ELEMS and id(a) not in _CONSTS:
                key = id(a)
                _CONSTS[key] = (weakref.ref(a, lambda _r, k=key: _forget(k, _r)), {})


def _forget(key: int, ref) -> None:
    with _lock:
        e = _CONSTS.get(key)
        if e is not None and e[0] is ref:
            del _CONSTS[key]


def cast(x, dtype):
    """``x.astype(dtype)``; for a registered constant the cast is made once and kept."""
    if x is None or x.dtype == dtype:
        return x
    e = _CONSTS.get(id(x))
    if e is None or e[0]() is not x:
        return x.astype(dtype)
    got = e[1].get(dtype)
    if got is None:
        got = e[1][dtype] = roomy(x.astype(dtype))
    return got
