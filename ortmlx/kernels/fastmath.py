"""Transcendentals in MLX ops, for MLX's CPU backend, whose own ``exp`` is scalar code.

``exp(x)`` for float32: x = k ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts, so r is exact to float32), e^r
by its degree-7 Taylor polynomial (truncation 5e-9 relative), 2^k made in the exponent bits in two halves, so a
result below float32's normal range rounds once and one above it is inf: within 1 ulp of float64's exp, where
MLX 0.32.4's CPU exp flushes subnormal results and overflows early. Compiled into one fused kernel, it is
faster than ``mx.exp`` from about a thousand elements (measured: docs/performance.md, ``poly_exp``).

Building that kernel (g++) takes seconds on a fresh machine, so an eager build asking for it before it is built
(``build.build_behind``) computes the same polynomial as separate MLX ops (bit for bit the same results, ~2x
the kernel's time) while ``kernels/background.py`` builds it; a trace inlines it into its own closure.
"""
from __future__ import annotations

import mlx.core as mx

from . import background, build

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125           # ln 2's leading 16 bits: k * _LN2_HI is exact for |k| <= 150
_LN2_LO = 1.4286068203094173e-06
_TAYLOR = [1.0 / f for f in (1, 1, 2, 6, 24, 120, 720, 5040)]


def _exp_body(x):
    nan = mx.isnan(x)
    # exp underflows to 0 below and overflows to inf above; NaN goes through as 0 (the shifts stay in range)
    y = mx.where(nan, 0.0, mx.clip(x, -104.0, 89.0))
    k = mx.round(y * _LOG2E)
    r = (y - k * _LN2_HI) - k * _LN2_LO
    p = mx.array(_TAYLOR[-1], mx.float32)
    for c in reversed(_TAYLOR[:-1]):
        p = p * r + c
    ki = k.astype(mx.int32)                      # in [-150, 128]: each half a normal float's exponent
    k1 = mx.floor_divide(ki, 2)
    s1 = mx.left_shift(k1 + 127, 23).view(mx.float32)
    s2 = mx.left_shift(ki - k1 + 127, 23).view(mx.float32)
    return mx.where(nan, x, (p * s1) * s2)


#: compiled per shape: a shapeless trace cannot infer ``view``'s shapes (there ``mx.exp`` stays)
_exp_compiled = mx.compile(_exp_body)


#: fewer elements than this keep ``mx.exp``: a compiled call costs ~20 us more than one op (CPU backend)
POLY_MIN = 1024


def polynomial(x: mx.array) -> bool:
    """Whether ``exp`` of ``x`` takes the polynomial in this build (float32, ``POLY_MIN`` elements or more,
    ``build.poly_exp``, not a shapeless trace)."""
    return x.dtype == mx.float32 and x.size >= POLY_MIN and build.poly_exp() and not build.shapeless()


_KERNEL = "fastmath.exp"


def _build_kernel() -> None:
    mx.eval(_exp_compiled(mx.zeros((POLY_MIN,), mx.float32)))


def _poly_exp(x: mx.array) -> mx.array:
    """The fused kernel once built (always inside a trace), else the same ops unfused with its build queued."""
    if build.tracing() or not build.build_behind() or background.done(_KERNEL):
        return _exp_compiled(x)
    background.submit(_KERNEL, _build_kernel)
    return _exp_body(x)


def exp(x: mx.array) -> mx.array:
    """e^x: float32 through the polynomial when the build asks for it (``build.poly_exp``), else ``mx.exp``."""
    return _poly_exp(x) if polynomial(x) else mx.exp(x)


def sigmoid(x: mx.array) -> mx.array:
    """1 / (1 + e^-x), with ``exp``'s e^-x."""
    return 1.0 / (1.0 + _poly_exp(-x)) if polynomial(x) else mx.sigmoid(x)
