"""Activation functions.

Dtype sets are those ORT's CPU EP has kernels for, plus bfloat16 (tested against the CPU
EP's float32 result rounded to bfloat16). Half-precision inputs compute in
float32 and round back (ORT's CPU EP runs them in float32 too).
"""
from __future__ import annotations

import math

import mlx.core as mx

from .. import dtypes as dt
from .. import fastmath
from ..registry import register

F32 = frozenset({dt.FLOAT, dt.BFLOAT16})
F = frozenset({dt.FLOAT, dt.FLOAT16, dt.BFLOAT16})
FD = frozenset({dt.FLOAT, dt.FLOAT16, dt.DOUBLE, dt.BFLOAT16})
HALF = (mx.float16, mx.bfloat16)


def _f32(fn):
    """Decorator: half-precision inputs run in float32 and round back."""
    def run(X, *args, **kw):
        if X.dtype in HALF:
            return fn(X.astype(mx.float32), *args, **kw).astype(X.dtype)
        return fn(X, *args, **kw)
    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    run.__signature__ = __import__("inspect").signature(fn)
    return run


def _s(v, x):
    return mx.array(v, x.dtype)


@register("Relu", 6, dtypes=FD | frozenset({dt.INT8, dt.INT32}))
def relu(X):
    """max(X, 0); -0 stays -0 and NaN stays NaN, as ORT's CPU EP gives them."""
    return mx.where(X < 0, _s(0, X), X)


@register("LeakyRelu", 6, dtypes=FD)
@_f32
def leaky_relu(X, *, alpha=0.01):
    """X if X >= 0 else alpha * X."""
    return mx.where(X >= 0, X, X * _s(alpha, X))


def _prelu_check(view) -> str | None:
    if view.dtype(1) != view.dtype(0):
        return f"slope is {dt.name(view.dtype(1))}, X is {dt.name(view.dtype(0))}"
    return None


@register("PRelu", 7, dtypes=FD | frozenset({dt.INT32, dt.UINT32, dt.INT64}), check=_prelu_check)
def prelu(X, slope):
    """X if X >= 0 else slope * X (slope broadcasts to X)."""
    return mx.where(X < 0, X * slope, X)


@register("Elu", 6, dtypes=F)
@_f32
def elu(X, *, alpha=1.0):
    """X if X >= 0 else alpha * (exp(X) - 1)."""
    return mx.where(X >= 0, X, _s(alpha, X) * (mx.exp(X) - 1))


@register("Selu", 6, dtypes=F)
@_f32
def selu(X, *, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875):
    """gamma * (X if X > 0 else alpha * exp(X) - alpha)."""
    return _s(gamma, X) * mx.where(X > 0, X, _s(alpha, X) * mx.exp(X) - _s(alpha, X))


@register("Celu", 12, dtypes=F32)
@_f32
def celu(X, *, alpha=1.0):
    """max(0, X) + min(0, alpha * (exp(X / alpha) - 1))."""
    a = _s(alpha, X)
    return mx.maximum(X, _s(0, X)) + mx.minimum(_s(0, X), a * (mx.exp(X / a) - 1))


@register("Sigmoid", 6, dtypes=F)   # float64 sigmoid in MLX is float32-accurate (rel. error 4e-7)
@_f32
def sigmoid(X):
    """1 / (1 + exp(-X))."""
    return fastmath.sigmoid(X)


@register("HardSigmoid", 6, dtypes=F)
@_f32
def hard_sigmoid(X, *, alpha=0.2, beta=0.5):
    """clip(alpha * X + beta, 0, 1)."""
    return mx.clip(_s(alpha, X) * X + _s(beta, X), 0, 1)


@register("HardSwish", 14, dtypes=F)
@_f32
def hard_swish(X):
    """X * clip(X / 6 + 0.5, 0, 1)."""
    return X * mx.clip(X * _s(1 / 6, X) + _s(0.5, X), 0, 1)


@register("Softplus", 1, dtypes=F32)
@_f32
def softplus(X):
    """log(1 + exp(X)), computed without overflow."""
    return mx.logaddexp(X, _s(0, X))


@register("Softsign", 1, dtypes=F32)
@_f32
def softsign(X):
    """X / (1 + |X|)."""
    return X / (1 + mx.abs(X))


@register("ThresholdedRelu", 10, dtypes=F)
@_f32
def thresholded_relu(X, *, alpha=1.0):
    """X if X > alpha else 0."""
    return mx.where(X > _s(alpha, X), X, _s(0, X))


def _gelu_check(view) -> str | None:
    a = view.attrs.get("approximate", "none")
    if a not in ("none", "tanh"):
        return f"Gelu approximate={a!r} is not 'none' or 'tanh'"
    return None


@register("Gelu", 20, dtypes=F, check=_gelu_check)
@_f32
def gelu(X, *, approximate="none"):
    """0.5 X (1 + erf(X / sqrt 2)), or its tanh approximation."""
    if approximate == "tanh":
        inner = _s(math.sqrt(2 / math.pi), X) * (X + _s(0.044715, X) * X * X * X)
        return _s(0.5, X) * X * (1 + mx.tanh(inner))
    return _s(0.5, X) * X * (1 + mx.erf(X * _s(1 / math.sqrt(2), X)))


@register("Mish", 18, dtypes=FD)
@_f32
def mish(X):
    """X * tanh(softplus(X))."""
    return X * mx.tanh(mx.logaddexp(X, _s(0, X)))


SHRINK = FD | frozenset({dt.INT8, dt.UINT8, dt.INT16, dt.UINT16, dt.INT32, dt.UINT32, dt.INT64, dt.UINT64})


@register("Shrink", 9, dtypes=SHRINK - {dt.DOUBLE})   # float64 loses precision through MLX (2.9e-8)
def shrink(input, *, bias=0.0, lambd=0.5):
    """X + bias if X < -lambd, X - bias if X > lambd, else 0 (integers compute in float, like ORT)."""
    X = input
    if mx.issubdtype(X.dtype, mx.integer) or X.dtype in HALF:
        return shrink(X.astype(mx.float32), bias=bias, lambd=lambd).astype(X.dtype)
    return mx.where(X < -lambd, X + _s(bias, X), mx.where(X > lambd, X - _s(bias, X), _s(0, X)))


@register("Swish", 24, dtypes=FD)
@_f32
def swish(X, *, alpha=1.0):
    """X * sigmoid(alpha * X)."""
    return X * mx.sigmoid(_s(alpha, X) * X)
