"""Shape keys: which closure of a runner a call's inputs select.

A key part per input: its element type and its shape, or, for a shapeless closure, its rank (every dim free)
or its shape with the free dims as -1 (the dims named free: a KV cache's total length). ``Keys.since`` works a
call's key out again only for the inputs that changed since the previous call (Compute's gather knows them).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..kernels import dtypes as dt


class Keys:
    """The keys of one runner's calls (``CompiledSubgraph``)."""

    def __init__(self, n_inputs: int, shapeless: bool, free_dims: frozenset | None):
        self.n_inputs = n_inputs
        self.shapeless = shapeless
        #: (input, axis) dims a shapeless key leaves free (None: every dim, the key is ranks only)
        self.free_dims = None if free_dims is None else frozenset(free_dims)
        self.free_axes: dict[int, frozenset] = {}          # input -> its free axes
        for i, ax in self.free_dims or ():
            self.free_axes[i] = self.free_axes.get(i, frozenset()) | {ax}
        #: ``since``'s memo: (the gather it was made for, the call's shapes, its key, its empty inputs)
        self.memo: tuple = (-1, (), (), frozenset())

    def free_inputs(self) -> frozenset[int]:
        """Inputs with a dim a shapeless key leaves free (all of them when every dim is free)."""
        if self.free_dims is None:
            return frozenset(range(self.n_inputs))
        return frozenset(i for i, _ in self.free_dims)

    def key(self, inputs: list, shapes: tuple | None = None) -> tuple:
        """The shape key of ``inputs`` (``shapes``: theirs, when the caller has them already)."""
        if len(inputs) != self.n_inputs:
            raise ValueError(f"expected {self.n_inputs} inputs, got {len(inputs)}")
        if shapes is None:
            shapes = shapes_of(inputs)
        part = self.part
        return tuple(part(i, a, sh) for i, (a, sh) in enumerate(zip(inputs, shapes)))

    def part(self, i: int, a, shape: tuple | None):
        """Input ``i``'s part of the key (``shape``: its shape): its type, and its shape, or its rank when the
        closure is shapeless with no dims named free, or its shape with the free dims as -1."""
        if a is None:
            return None
        if self.shapeless:
            if self.free_dims is None:
                return (dstr(a), len(shape))
            fa = self.free_axes.get(i)
            if fa:
                shape = tuple(-1 if ax in fa else d for ax, d in enumerate(shape))
        return (dstr(a), shape)

    def since(self, inputs: list, since: tuple) -> tuple[tuple, tuple, bool]:
        """(the call's shapes, its ``key``, whether an input is empty), from the previous call's shapes and key
        where ``since`` says that call's gather came just before this one's (only the inputs it names are worked
        out again; the key is the same object while none of their parts changes)."""
        prev, token, redo = since
        at, sig, k1, empty = self.memo
        if at != prev or len(inputs) != len(sig):
            sig = shapes_of(inputs)
            k1 = self.key(inputs, sig)
            empty = frozenset(i for i, a in enumerate(inputs) if is_empty(a))
        elif redo:
            sig, parts, new_empty, changed = list(sig), None, set(empty), False
            for i in redo:
                a = inputs[i]
                sig[i] = sh = None if a is None else a.shape if type(a) in _SHAPED else np.shape(a)
                part = self.part(i, a, sh)
                if part != k1[i]:
                    if parts is None:
                        parts = list(k1)
                    parts[i] = part
                if is_empty(a):
                    changed |= i not in new_empty
                    new_empty.add(i)
                elif i in new_empty:
                    new_empty.discard(i)
                    changed = True
            sig = tuple(sig)
            if parts is not None:
                k1 = tuple(parts)
            if changed:
                empty = frozenset(new_empty)
        self.memo = (token, sig, k1, empty)
        return sig, k1, bool(empty)


#: element type (NumPy dtype or MLX Dtype) -> its key string (``dstr``)
_DSTR: dict = {}


def dstr(a) -> str:
    """The element type of an input for keys (an MLX mirror keys like the host buffer it mirrors)."""
    d = getattr(a, "dtype", None)
    s = _DSTR.get(d)
    if s is not None:
        return s
    if isinstance(a, np.ndarray):
        s = a.dtype.str
    elif isinstance(a, mx.array):
        s = np.dtype(dt.NUMPY[dt.FROM_MLX[a.dtype]]).str
    else:
        return np.asarray(a).dtype.str
    _DSTR[d] = s
    return s


def is_empty(a) -> bool:
    """An input with no elements (MLX's CUDA compiled kernels crash on them; None: omitted, not empty)."""
    return a is not None and getattr(a, "size", 1) == 0


def shapes_of(inputs: list) -> tuple:
    """Each input's shape as a tuple (None for an omitted one)."""
    return tuple(None if a is None else a.shape if type(a) in _SHAPED else np.shape(a) for a in inputs)


#: types whose ``.shape`` is already a tuple of ints (``np.shape`` of anything else)
_SHAPED = frozenset({np.ndarray, mx.array})


