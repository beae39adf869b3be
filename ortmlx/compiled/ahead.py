"""The next call's closure call, made while the device still runs this one.

A steady decode call of a compiled closure takes the previous call's KV results as its device inputs
(the mirrors: the same MLX arrays), the new token ids as a host array, and the hoisted lengths (one more
than last call's). So once this call's eval is started, the next call's closure call (MLX's graph
replay, a large share of a token's host time: docs/performance.md) can already be made, on:

- the results this call will give, where the last two calls showed an input is a result of the one
  before (``learn``);
- fresh device arrays ("slots") for the inputs uploaded from the host: their bytes are written at the
  next call, before its eval;
- the hoisted values extrapolated by their last step (``predict``).

The next call takes that graph (``take``) only if every one of its device inputs is the very array the
graph was built on, every uploaded input has the slot's shape and type, and every hoisted value is equal
to the prediction; the closure is a pure function of its inputs (MLX arrays are immutable), so the graph
gives what calling the closure then would. Anything else drops the graph and the call runs as before.

A slot is written through NumPy's view of a fresh array that only the graph and ``Ahead`` reference,
before anything reads it (MLX may reuse an input's buffer for an output only during the eval).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..kernels import dtypes as dt

#: per device input, what the next call will pass (``learn``): an index >= 0 is that result of this call
SAME, SLOT = -1, -2
#: calls in a row whose made-ahead graph did not fit before a closure pauses making them (two generators
#: stepped in turn), and the calls the pause lasts
MAX_MISSES = 3
PAUSE = 64
#: a host input larger than this is not given a slot (it is uploaded at its call as before)
SLOT_MAX_BYTES = 1 << 20


class Ahead:
    """A closure call made for the next call: its inputs and lazy outputs."""

    __slots__ = ("c", "fn", "dev", "views", "hoisted", "outs")

    def __init__(self, c, fn, dev: list, views: dict, hoisted: list, outs: list):
        self.c, self.fn = c, fn
        self.dev = dev              # the device inputs the closure was called on, then the hoisted values
        self.views = views          # slot input k -> NumPy view of its (fresh) MLX array
        self.hoisted = hoisted      # the predicted hoisted values (NumPy)
        self.outs = outs


def due(c) -> bool:
    """Whether closure ``c`` makes the next call's closure call now (counts the calls of a pause)."""
    if c.ahead_misses < MAX_MISSES:
        return True
    c.ahead_misses += 1
    if c.ahead_misses >= MAX_MISSES + PAUSE:
        c.ahead_misses, c.ahead_kinds = 0, None         # learnt again from the next calls
    return False


def learn(host: list, prev_outs: list) -> tuple[int, ...] | None:
    """Per device input of this call (``host``: MLX arrays and host arrays as the closure gets them): the
    index of the previous call's result it is, ``SAME`` (another device array: predicted unchanged) or
    ``SLOT`` (a host array); None when no input is a previous result (nothing chains between calls)."""
    where = {id(o): j for j, o in enumerate(prev_outs)}
    kinds = []
    for a in host:
        if isinstance(a, mx.array):
            kinds.append(where.get(id(a), SAME))
        else:
            kinds.append(SLOT)
    return tuple(kinds) if any(k >= 0 for k in kinds) else None


def predict(cur: list, prev: list | None) -> list | None:
    """The next call's hoisted values: integer values moved by their last step (``prev`` -> ``cur``: the last
    call's and this one's), the others unchanged; None when a value is not a host array or there is no last
    call's."""
    if not cur:
        return []
    if prev is None or len(prev) != len(cur) or not all(type(v) is np.ndarray for v in cur):
        return None
    out = []
    for v, p in zip(cur, prev):
        if type(p) is np.ndarray and v.dtype == p.dtype and v.shape == p.shape and v.dtype.kind in "iu":
            with np.errstate(over="ignore"):
                out.append(v + (v - p))
        else:
            out.append(v)
    return out


def _slot(a, t: int | None):
    """(a fresh MLX array shaped and typed as host array ``a`` would be uploaded, a writable NumPy view of its
    bytes), or None when the upload is not a plain copy of ``a``'s bytes."""
    a = np.asarray(a)
    if a.nbytes > SLOT_MAX_BYTES or a.dtype.kind not in "biuf" or a.dtype.hasobject:
        return None
    try:
        s = dt.to_mx(np.array(a, copy=True), t if t is not None else dt.onnx_type_of(a))
        v = np.asarray(s)
    except Exception:  # noqa: BLE001 - e.g. bfloat16, which NumPy cannot view: uploaded at its call as before
        return None
    if v.dtype != a.dtype or v.shape != a.shape or not v.flags.writeable or not v.flags.c_contiguous:
        return None
    return s, v


def prepare(kinds: tuple, host: list, dev: list, outs: list, types: list) -> tuple[list, dict] | None:
    """The next call's device inputs, from this call's results (``outs``, lazy: their eval started) and slots for
    the host inputs, with the slots' NumPy views; None when one cannot be made with this call's shape and type
    (``dev``: this call's device inputs: the closure must replay, never retrace)."""
    if len(kinds) != len(host):
        return None
    nxt, views = [], {}
    for k, (kind, a, d) in enumerate(zip(kinds, host, dev)):
        if kind >= 0:
            if kind >= len(outs):
                return None
            nxt.append(outs[kind])
        elif kind == SAME:
            if not isinstance(a, mx.array):
                return None
            nxt.append(a)
        else:
            if isinstance(a, mx.array):
                return None
            made = _slot(a, types[k])
            if made is None:
                return None
            nxt.append(made[0])
            views[k] = made[1]
    if any(n.shape != d.shape or n.dtype != d.dtype for n, d in zip(nxt, dev)):
        return None
    return nxt, views


def take(a: Ahead, c, host: list, hoisted: list) -> list | None:
    """The made-ahead outputs if they are what ``c`` called on this call's inputs (``host``: as the closure
    gets them, host arrays not yet uploaded; ``hoisted``: this call's host values) would give, with the
    slots' bytes written; else None."""
    if a.c is not c or a.fn is not c.fn or len(hoisted) != len(a.hoisted) or \
            len(host) + len(hoisted) != len(a.dev):
        return None
    views = a.views
    for k, (x, want) in enumerate(zip(host, a.dev)):
        if k in views:
            v = views[k]
            if type(x) is not np.ndarray or x.shape != v.shape or x.dtype != v.dtype:
                return None
        elif x is not want:
            return None
    for h, p in zip(hoisted, a.hoisted):
        if type(h) is not np.ndarray or h.dtype != p.dtype or h.shape != p.shape or not np.array_equal(h, p):
            return None
    try:
        for k, v in views.items():
            np.copyto(v, host[k])
    except Exception:  # noqa: BLE001 - not expected (checked when made); the graph is dropped, the call runs as before
        return None
    return a.outs
