"""com.microsoft activations: Gelu, BiasGelu, FastGelu, QuickGelu.

Half inputs compute in float32 and round once at the end.
"""
from __future__ import annotations

import math

import mlx.core as mx

from .. import dtypes as dt
from ..registry import MS, register

_TYPES = {dt.FLOAT, dt.FLOAT16}


def _f32(x):
    return None if x is None else x.astype(mx.float32)


def _erf_gelu(x):
    return 0.5 * x * (1.0 + mx.erf(x * (1.0 / math.sqrt(2.0))))


def _bias_check(v) -> str | None:
    if v.has(1) and v.dtype(1) != v.dtype(0):
        return f"bias is {dt.name(v.dtype(1))}, input {dt.name(v.dtype(0))}"
    s = v.shape(1)
    if s is not None and len(s) != 1:
        return f"bias rank {len(s)} (1D bias over the last axis only)"
    return None


def _add_bias(x, bias):
    if bias is None:
        return _f32(x)
    if bias.ndim != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias shape {bias.shape} does not match the last axis of input shape {x.shape}")
    return _f32(x) + _f32(bias)


@register("Gelu", 1, domain=MS, dtypes=_TYPES)
def gelu(X):
    """0.5 x (1 + erf(x / sqrt 2))."""
    return _erf_gelu(_f32(X)).astype(X.dtype)


@register("BiasGelu", 1, domain=MS, dtypes=_TYPES, check=_bias_check)
def bias_gelu(A, B):
    """Gelu(A + B), B a bias over the last axis."""
    return _erf_gelu(_add_bias(A, B)).astype(A.dtype)


@register("FastGelu", 1, domain=MS, dtypes=_TYPES, check=_bias_check)
def fast_gelu(X, bias=None):
    """Tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), x = X + bias."""
    x = _add_bias(X, bias)
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
    return (0.5 * x * (1.0 + mx.tanh(inner))).astype(X.dtype)


@register("QuickGelu", 1, domain=MS, dtypes=_TYPES)
def quick_gelu(X, *, alpha=1.702):
    """x * sigmoid(alpha x)."""
    x = _f32(X)
    return (x * mx.sigmoid(alpha * x)).astype(X.dtype)
