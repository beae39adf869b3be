"""What a translator may ask about the trace it is built in (the compiled layer sets it: ``compiled/core.py``).

A shapeless ``mx.compile`` trace replays its graph for other shapes: a translator choosing between two
equivalent forms picks one that MLX replays correctly at any shape there (``shapeless``).
"""
from __future__ import annotations

import threading

_STATE = threading.local()


def set_shapeless(flag: bool) -> bool:
    """Mark this thread's trace as shapeless (or not); returns the previous mark."""
    old = getattr(_STATE, "shapeless", False)
    _STATE.shapeless = flag
    return old


def shapeless() -> bool:
    """Whether this thread is building a shapeless trace (False in eager builds and shape-keyed traces): static
    slices, ``split`` and ``mx.fast.rope`` fail there (shape-keyed traces may use them)."""
    return getattr(_STATE, "shapeless", False)
