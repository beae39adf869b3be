"""Normalization layers: BatchNormalization (inference), InstanceNormalization,
LayerNormalization, GroupNormalization, RMSNormalization, LpNormalization, LRN,
MeanVarianceNormalization.

Statistics are computed in float32 for half types (as ORT's CPU EP does, which
upcasts them); float64 stays float64 (only sqrt/rsqrt/divide, exact in MLX).
"""
from __future__ import annotations

import math

import mlx.core as mx

from .. import dtypes as dt
from ..registry import register

FLOATS = dt.FLOATS
HALF = (mx.float16, mx.bfloat16)
#: MLX evaluates float64 pow/exp at float32 precision, and ORT's CPU EP has no float64 kernel of some
#: ops (nothing to verify against): those refuse float64
NO_F64 = frozenset({dt.FLOAT, dt.FLOAT16, dt.BFLOAT16})


def _up(x):
    """float32 for half types, else unchanged."""
    return x.astype(mx.float32) if x.dtype in HALF else x


def _chan(p, ndim):
    """A per-channel (C,) parameter shaped to broadcast over (N, C, ...)."""
    return p.reshape((1, -1) + (1,) * (ndim - 2))


# ------------------------------------------------------------------ BatchNormalization
def _bn_check(view):
    if len([o for o in view.node.outputs if o]) > 1 and not view.attrs.get("training_mode", 0):
        return "running/saved statistics outputs outside training_mode (opset < 14 training) are not implemented"
    if view.attrs.get("spatial", 1) != 1:
        return "spatial=0 is not implemented"
    r = view.rank(0)
    if r is not None and r < 2:
        return f"input rank {r} < 2"
    for i in range(1, 5):
        if view.dtype(i) not in (None, dt.FLOAT, dt.FLOAT16, dt.BFLOAT16, dt.DOUBLE):
            return f"input {i} is {dt.name(view.dtype(i))}"
    return None


def _bn(X, scale, B, mean, var, epsilon):
    x = _up(X)
    nd = x.ndim
    s = _up(scale) * mx.rsqrt(_up(var) + epsilon)
    y = x * _chan(s, nd) + _chan(_up(B) - _up(mean) * s, nd)
    return y.astype(X.dtype)


@register("BatchNormalization", 7, dtypes=FLOATS, check=_bn_check)
def batch_norm_7(X, scale, B, mean, var, *, epsilon=1e-5, momentum=0.9, spatial=1):
    """Inference BatchNormalization with running statistics."""
    return _bn(X, scale, B, mean, var, epsilon)


@register("BatchNormalization", 9, dtypes=FLOATS, check=_bn_check)
def batch_norm_9(X, scale, B, input_mean, input_var, *, epsilon=1e-5, momentum=0.9):
    return _bn(X, scale, B, input_mean, input_var, epsilon)


@register("BatchNormalization", 14, dtypes=FLOATS, check=_bn_check)
def batch_norm_14(X, scale, B, input_mean, input_var, *, epsilon=1e-5, momentum=0.9, training_mode=0, ctx):
    """Opset 14+: training_mode=1 normalizes with the batch statistics and returns the running ones."""
    if not training_mode:
        return _bn(X, scale, B, input_mean, input_var, epsilon)
    x = _up(X)
    axes = (0,) + tuple(range(2, x.ndim))
    mean = mx.mean(x, axis=axes)
    var = mx.mean(mx.square(x - _chan(mean, x.ndim)), axis=axes)       # population variance
    y = _bn(X, scale, B, mean, var, epsilon)
    if ctx.n_outputs == 1:
        return y
    mom = mx.array(momentum, mx.float32).astype(x.dtype)
    one = mx.array(1, x.dtype)
    run_mean = (_up(input_mean) * mom + mean * (one - mom)).astype(input_mean.dtype)
    run_var = (_up(input_var) * mom + var * (one - mom)).astype(input_var.dtype)
    return y, run_mean, run_var


# ------------------------------------------------------------------ InstanceNormalization
def _min_rank(n):
    def check(view):
        r = view.rank(0)
        if r is not None and r < n:
            return f"input rank {r} < {n}"
        return None
    return check


@register("InstanceNormalization", 6, dtypes=NO_F64, check=_min_rank(3))
def instance_norm(input, scale, B, *, epsilon=1e-5):
    """Per (sample, channel) normalization over the spatial axes."""
    x = _up(input)
    axes = tuple(range(2, x.ndim))
    mean = mx.mean(x, axis=axes, keepdims=True)
    var = mx.mean(mx.square(x - mean), axis=axes, keepdims=True)
    y = (x - mean) * mx.rsqrt(var + epsilon) * _chan(_up(scale), x.ndim) + _chan(_up(B), x.ndim)
    return y.astype(input.dtype)


# ------------------------------------------------------------------ LayerNormalization
def _stash_check(view):
    st = view.attrs.get("stash_type", 1)
    if st != 1:
        return f"stash_type {st} (only float32 statistics are implemented)"
    return None


def _ln_check(view):
    reason = _stash_check(view)
    if reason:
        return reason
    r = view.rank(0)
    a = view.attrs.get("axis", -1)
    if r is not None and not -r <= a < r:
        return f"axis {a} out of range for rank {r}"
    return None


@register("LayerNormalization", 17, dtypes=FLOATS, check=_ln_check)
def layer_norm(X, Scale, B=None, *, axis=-1, epsilon=1e-5, stash_type=1, ctx):
    """Normalize over axes [axis, rank); optional Mean and InvStdDev outputs (float32 stash)."""
    a = axis % X.ndim
    want_stats = ctx.n_outputs > 1
    if (not want_stats and a == X.ndim - 1 and X.dtype == mx.float32 and Scale.shape == X.shape[-1:]
            and (B is None or B.shape == X.shape[-1:]) and X.size):
        return mx.fast.layer_norm(X, Scale, B, epsilon)
    stat_t = mx.float64 if X.dtype == mx.float64 else mx.float32
    x = X.astype(stat_t)
    axes = tuple(range(a, X.ndim))
    mean = mx.mean(x, axis=axes, keepdims=True)
    d = x - mean
    inv = mx.rsqrt(mx.mean(mx.square(d), axis=axes, keepdims=True) + epsilon)
    y = d * inv * Scale.astype(stat_t)
    if B is not None:
        y = y + B.astype(stat_t)
    y = y.astype(X.dtype)
    if not want_stats:
        return y
    return y, mean, inv


# ------------------------------------------------------------------ GroupNormalization
def _gn_check(view):
    reason = _stash_check(view)
    if reason:
        return reason
    r = view.rank(0)
    if r is not None and r < 3:
        return f"input rank {r} < 3"
    shape = view.shape(0)
    g = view.attrs.get("num_groups")
    if shape is not None and isinstance(shape[1], int) and (g <= 0 or shape[1] % g):
        return f"channels {shape[1]} not divisible by num_groups {g}"
    return None


def _group_norm(X, num_groups, epsilon, stat_t):
    n, c = X.shape[:2]
    if num_groups <= 0 or c % num_groups:
        raise ValueError(f"channels {c} not divisible by num_groups {num_groups}")
    x = X.astype(stat_t).reshape(n, num_groups, math.prod(X.shape[1:]) // num_groups)
    mean = mx.mean(x, axis=-1, keepdims=True)
    d = x - mean
    inv = mx.rsqrt(mx.mean(mx.square(d), axis=-1, keepdims=True) + epsilon)
    return (d * inv).reshape(X.shape)


@register("GroupNormalization", 18, dtypes=FLOATS, check=_gn_check)
def group_norm_18(X, scale, bias, *, num_groups, epsilon=1e-5):
    """Opset 18: scale and bias have one value per group."""
    y = _group_norm(X, num_groups, epsilon, mx.float64 if X.dtype == mx.float64 else mx.float32)
    rep = X.shape[1] // num_groups
    s = mx.repeat(_up(scale), rep)
    b = mx.repeat(_up(bias), rep)
    return (y * _chan(s, X.ndim) + _chan(b, X.ndim)).astype(X.dtype)


@register("GroupNormalization", 21, dtypes=FLOATS, check=_gn_check)
def group_norm_21(X, scale, bias, *, num_groups, epsilon=1e-5, stash_type=1):
    """Opset 21: per-channel scale and bias; statistics in float32 (stash_type 1) even for float64,
    the normalized value cast back to X's type before the affine step (the spec's function body)."""
    y = _group_norm(X, num_groups, epsilon, mx.float32).astype(X.dtype)
    return y * _chan(scale, X.ndim) + _chan(bias, X.ndim)


# ------------------------------------------------------------------ RMSNormalization
@register("RMSNormalization", 23, dtypes=FLOATS, check=_ln_check)
def rms_norm(X, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    """X / sqrt(mean(X^2 over [axis, rank)) + epsilon) * scale."""
    a = axis % X.ndim
    if a == X.ndim - 1 and X.dtype == mx.float32 and scale.shape == X.shape[-1:] and X.size:
        return mx.fast.rms_norm(X, scale, epsilon)
    stat_t = mx.float64 if X.dtype == mx.float64 else mx.float32
    x = X.astype(stat_t)
    axes = tuple(range(a, X.ndim))
    inv = mx.rsqrt(mx.mean(mx.square(x), axis=axes, keepdims=True) + epsilon)
    return (x * inv * scale.astype(stat_t)).astype(X.dtype)


# ------------------------------------------------------------------ LpNormalization
def _lp_check(view):
    p = view.attrs.get("p", 2)
    if p not in (1, 2):
        return f"p={p} (ONNX allows only 1 or 2)"
    r = view.rank(0)
    a = view.attrs.get("axis", -1)
    if r is not None and not -max(r, 1) <= a < max(r, 1):
        return f"axis {a} out of range for rank {r}"
    return None


@register("LpNormalization", 1, dtypes=FLOATS, check=_lp_check)
def lp_norm(input, *, axis=-1, p=2):
    """input / ||input||_p along ``axis`` (0 where the norm is 0)."""
    x = _up(input)
    if p == 1:
        n = mx.sum(mx.abs(x), axis=axis, keepdims=True)
    else:
        n = mx.sqrt(mx.sum(mx.square(x), axis=axis, keepdims=True))
    safe = mx.where(n == 0, mx.ones_like(n), n)
    return mx.where(n == 0, mx.zeros_like(x), x / safe).astype(input.dtype)


# ------------------------------------------------------------------ LRN
def _lrn_check(view):
    size = view.attrs.get("size")
    if size is None or size < 1:
        return f"size {size!r} must be >= 1"
    if size % 2 == 0:
        return f"even size {size}: ORT's CPU EP has no kernel to verify the asymmetric window against"
    r = view.rank(0)
    if r != 4:
        return f"input rank {r}: only 4-D LRN is verified against ORT's CPU EP"
    return None


@register("LRN", 1, dtypes=NO_F64, check=_lrn_check)
def lrn(X, *, size, alpha=1e-4, beta=0.75, bias=1.0):
    """X / (bias + alpha/size * sum of squares over a channel window) ** beta."""
    x = _up(X)
    c = x.shape[1]
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = mx.square(x)
    widths = [(0, 0), (lo, hi)] + [(0, 0)] * (x.ndim - 2)
    padded = mx.pad(sq, widths)
    win = padded[:, 0:c]
    for k in range(1, size):             # the window is a handful of channels: sum shifted slices
        win = win + padded[:, k:k + c]
    y = x / mx.power(bias + (alpha / size) * win, beta)
    return y.astype(X.dtype)


# ------------------------------------------------------------------ MeanVarianceNormalization
@register("MeanVarianceNormalization", 9, dtypes=NO_F64)
def mvn(X, *, axes=(0, 2, 3)):
    """(X - mean) / (std + 1e-9) over ``axes`` (std from the two-pass variance). As ORT's CPU kernel, axes outside
    the input's rank are dropped (the default [0, 2, 3] of a 3-D input is [0, 2]) and repeats count once."""
    x = _up(X)
    r = x.ndim
    ax = tuple(sorted({int(a) % r for a in axes if -r <= int(a) < r}))
    if not ax:
        raise ValueError(f"axes {list(axes)}: none within the input's rank {r}")
    mean = mx.mean(x, axis=ax, keepdims=True)
    var = mx.mean(mx.square(x - mean), axis=ax, keepdims=True)      # two-pass: no cancellation
    return ((x - mean) / (mx.sqrt(var) + 1e-9)).astype(X.dtype)
