"""Values made once and reused: integer ranges, casts of a group's constants, and work shared by
the nodes of one graph build (``memo``).

``mx.compile`` does no constant folding: an ``mx.arange`` or an ``astype`` of a constant inside
a traced closure runs again on every call, one kernel each, and work over fresh ranges is never
merged between layers. These helpers hand back evaluated arrays instead. Inside a trace they are
captured constants, so the same work over them in several layers (the rotary rows, the attention
mask) is merged by compile's common-subexpression pass; eagerly they save the kernels too.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import mlx.core as mx

#: casts of constants up to this many elements are kept (larger ones are recast each call)
CAST_MAX_ELEMS = 1 << 20


@functools.lru_cache(maxsize=512)
def arange(n: int, dtype=mx.int32, start: int = 0) -> mx.array:
    """``mx.arange(start, start + n, dtype=dtype)``, evaluated once (never write into it)."""
    if n < 0:
        raise ValueError(f"arange length {n} is negative")
    a = mx.arange(start, start + n, dtype=dtype)
    mx.eval(a)
    return a


@functools.lru_cache(maxsize=256)
def zeros(shape: tuple, dtype=mx.float32) -> mx.array:
    """``mx.zeros(shape, dtype)``, evaluated once (never write into it): inside a trace a captured
    constant, where ``mx.zeros`` would be a fill kernel every call."""
    a = mx.zeros(tuple(shape), dtype)
    mx.eval(a)
    return a


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
        got = x.astype(dtype)
        mx.eval(got)
        e[1][dtype] = got
    return got


_SCOPE = threading.local()


@contextlib.contextmanager
def build_scope(**flags):
    """One graph build (an eager run or a trace): ``memo`` keeps its values until the build ends;
    ``flags`` (``build_flag``) say how the build's translators may compute (e.g. ``cuda_kernels``)."""
    outer, outer_flags = getattr(_SCOPE, "memo", None), getattr(_SCOPE, "flags", None)
    _SCOPE.memo, _SCOPE.flags = {}, flags
    try:
        yield
    finally:
        _SCOPE.memo, _SCOPE.flags = outer, outer_flags


def build_flag(name: str) -> bool:
    """A flag of the build in progress on this thread (False outside a build)."""
    return bool((getattr(_SCOPE, "flags", None) or {}).get(name, False))


def memo(key: tuple, make):
    """``make()`` once per build for ``key`` (outside a build: every time).

    Work that several nodes repeat on the same values (every attention layer's rotary rows and
    mask from the same ``seqlens_k``): eager builds have no common-subexpression pass. Object ids in
    ``key`` must be of values the build keeps alive to its end (group inputs, constants, the
    build's device copies), so an id cannot be reused within the scope.
    """
    m = getattr(_SCOPE, "memo", None)
    if m is None:
        return make()
    got = m.get(key)
    if got is None:
        got = m[key] = make()
    return got
