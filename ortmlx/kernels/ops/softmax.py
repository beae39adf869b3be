"""Softmax, LogSoftmax, Hardmax and Dropout (inference).

Before opset 13 the softmax family coerces the input to 2-D at ``axis`` (default 1)
and normalizes each row; from 13 it normalizes along the single ``axis`` (default -1).
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from .. import fastmath
from ..registry import register

FLOATS = dt.FLOATS
#: MLX computes exp/log of float64 at float32 precision (seen on 0.32.4 CPU): refuse float64
#: (Hardmax too: ORT's CPU EP has no float64 Hardmax to verify against)
HALF_SINGLE = frozenset({dt.FLOAT, dt.FLOAT16, dt.BFLOAT16})


def _axis(axis, ndim):
    if not -ndim <= axis < max(ndim, 1):
        raise ValueError(f"axis {axis} out of range for rank {ndim}")
    return axis % max(ndim, 1)


def _softmax(x, axis):
    """Numerically stable softmax along one axis, float32 arithmetic for half types: e^(x - max) / sum, the
    exponential through ``fastmath.exp`` where the build takes its polynomial (MLX's CPU backend: its own exp
    is scalar code), else MLX's softmax."""
    xf = x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x
    if fastmath.polynomial(xf) and xf.shape[axis]:
        e = fastmath.exp(xf - mx.max(xf, axis=axis, keepdims=True))
        return (e / mx.sum(e, axis=axis, keepdims=True)).astype(x.dtype)
    return mx.softmax(xf, axis=axis, precise=True).astype(x.dtype)


def _log_softmax(x, axis):
    """Stable log-softmax along one axis (its exp as ``_softmax``'s); an empty tensor stays empty (MLX cannot
    max-reduce size 0)."""
    if x.size == 0:
        return x
    xf = x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x
    s = xf - mx.stop_gradient(mx.max(xf, axis=axis, keepdims=True))
    return (s - mx.log(mx.sum(fastmath.exp(s), axis=axis, keepdims=True))).astype(x.dtype)


def _hardmax(x, axis):
    """One-hot of the first maximum along ``axis``."""
    if x.shape[axis] == 0 or x.size == 0:
        return mx.zeros(x.shape, x.dtype)
    idx = mx.expand_dims(mx.argmax(x, axis=axis), axis)
    pos = mx.arange(x.shape[axis]).reshape([-1 if i == axis else 1 for i in range(x.ndim)])
    return (pos == idx).astype(x.dtype)


def _coerced(fn, x, axis):
    """Apply ``fn`` to rows of ``x`` flattened to 2-D at ``axis`` (opset < 13)."""
    a = _axis(axis, x.ndim) if x.ndim else 0
    if x.ndim == 0:
        return fn(x.reshape(1, 1), 1).reshape(())
    rows = math.prod(x.shape[:a])
    return fn(x.reshape(rows, math.prod(x.shape[a:])), 1).reshape(x.shape)


def _single(fn, x, axis):
    if x.ndim == 0:
        return fn(x.reshape(1), 0).reshape(())
    return fn(x, _axis(axis, x.ndim))


def _softmax_check(view):
    """float16: MLX's float32 exp differs from ORT's by an ulp, which flips the float16 rounding of
    ~1e-4 of the outputs (measured 5 of 46,848 against ORT's CPU kernel): refuse it."""
    if view.dtype(0) == dt.FLOAT16:
        return "float16 Softmax/LogSoftmax: MLX's exp flips float16 rounding vs ORT in ~1e-4 of outputs"
    return _axis_check(view)


def _axis_check(view):
    r = view.rank(0)
    if r is None:
        return None
    a = view.attrs.get("axis")
    if not -max(r, 1) <= a < max(r, 1):
        return f"axis {a} out of range for rank {r}"
    return None


@register("Softmax", 1, dtypes=HALF_SINGLE, check=_softmax_check)
def softmax_1(input, *, axis=1):
    """Softmax of the input coerced to 2-D at ``axis``."""
    return _coerced(_softmax, input, axis)


@register("Softmax", 13, dtypes=HALF_SINGLE, check=_softmax_check)
def softmax_13(input, *, axis=-1):
    """Softmax along ``axis``."""
    return _single(_softmax, input, axis)


@register("LogSoftmax", 1, dtypes=HALF_SINGLE, check=_softmax_check)
def log_softmax_1(input, *, axis=1):
    return _coerced(_log_softmax, input, axis)


@register("LogSoftmax", 13, dtypes=HALF_SINGLE, check=_softmax_check)
def log_softmax_13(input, *, axis=-1):
    return _single(_log_softmax, input, axis)


@register("Hardmax", 1, dtypes=HALF_SINGLE, check=_axis_check)
def hardmax_1(input, *, axis=1):
    return _coerced(_hardmax, input, axis)


@register("Hardmax", 13, dtypes=HALF_SINGLE, check=_axis_check)
def hardmax_13(input, *, axis=-1):
    return _single(_hardmax, input, axis)


# ---------------------------------------------------------------------------------- Dropout
def _dropout_7_check(view):
    if len(view.node.outputs) > 1 and view.node.outputs[1]:
        return "the mask output of Dropout before opset 12 is unspecified in inference (ORT returns zeros)"
    return None


@register("Dropout", 7, dtypes=FLOATS, check=_dropout_7_check)
def dropout_7(data, *, ratio=0.5):
    """Inference Dropout: the identity."""
    return data


def _dropout_check(view):
    if view.has(2):
        ratio = view.const(1) if view.has(1) else np.float32(0.5)
        if ratio is not None and float(np.asarray(ratio).reshape(-1)[0]) == 0.0:
            return None              # a constant ratio of 0: deterministic even in training mode
        tm = view.const(2)
        if tm is None:
            return "training_mode is not a constant and ratio is not a constant 0: refusing a possibly random Dropout"
        tm = np.asarray(tm).reshape(-1)
        if tm.size and bool(tm[0]):
            return "training_mode=True with a nonzero or non-constant ratio is random"
    return None


@register("Dropout", 12, dtypes=FLOATS, check=_dropout_check)
def dropout_12(data, ratio=None, training_mode=None, *, seed=None, ctx):
    """Dropout in inference (or with ratio 0): identity and an all-true mask."""
    if ctx.n_outputs > 1:
        return data, mx.ones(data.shape, mx.bool_)
    return data
