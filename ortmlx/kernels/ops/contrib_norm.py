"""Fused normalizations of onnxruntime's model builders: SkipLayerNormalization,
SkipSimplifiedLayerNormalization (com.microsoft) and SimplifiedLayerNormalization
(ORT registers it in the ai.onnx domain, opset 1).

As ORT's CPU kernels do, half inputs are upcast and every statistic is float32;
the variance is E[x^2] - E[x]^2 and the result is x / sqrt(var + eps).
"""
from __future__ import annotations

import mlx.core as mx

from .. import consts, cuda_kernels
from .. import dtypes as dt
from ..registry import MS, register
from .normalization import _ln_check, layer_norm

#: ORT's CPU kernels have float and float16; bfloat16 is tested against them in float32
_SKIP_TYPES = {dt.FLOAT, dt.FLOAT16, dt.BFLOAT16}


def _f32(x):
    return consts.cast(x, mx.float32)


def _rms_norm(x, gamma, epsilon: float):
    """x / sqrt(mean(x^2, last axis) + eps) * gamma in float32 (one fused kernel where MLX has one)."""
    return mx.fast.rms_norm(x, _f32(gamma), epsilon)


def _wants_stats(ctx) -> bool:
    """Whether the node uses its mean/inv_std_var outputs (1 and 2)."""
    return any(o for o in ctx.node.outputs[1:3])


def _skip_check(v, n_params: int) -> str | None:
    """Shapes: input rank 2/3, skip broadcastable to it, gamma/beta/bias (hidden,)."""
    r = v.rank(0)
    if r is not None and r not in (2, 3):
        return f"input rank {r} (2D or 3D only)"
    for i in range(1, 2 + n_params):
        if v.has(i) and v.dtype(i) != v.dtype(0):
            return f"input {i} is {dt.name(v.dtype(i))}, input 0 {dt.name(v.dtype(0))}"
    return None


def _skip_sum(input, skip, bias):
    """input + skip (+ bias) in float32, as (x, shape-checked)."""
    h = input.shape[-1]
    ok = skip.shape == input.shape or (input.ndim == 3 and skip.shape in ((1,) + input.shape[1:], input.shape[1:]))
    if not ok:
        raise ValueError(f"skip shape {skip.shape} does not fit input shape {input.shape}")
    x = _f32(input) + _f32(skip)
    if bias is not None:
        if bias.shape != (h,):
            raise ValueError(f"bias shape {bias.shape}, expected ({h},)")
        x = x + _f32(bias)
    return x


def _check_param(p, h: int, what: str):
    if p is not None and p.shape != (h,):
        raise ValueError(f"{what} shape {p.shape}, expected ({h},)")


def _skip_outputs(input, x, y, mean, inv_std, n_outputs: int):
    outs = [y.astype(input.dtype)]
    if n_outputs > 1:
        outs += [mean, inv_std, x.astype(input.dtype)][:n_outputs - 1]
    return tuple(outs)


@register("SkipLayerNormalization", 1, domain=MS, dtypes=_SKIP_TYPES, check=lambda v: _skip_check(v, 3))
def skip_layer_norm(input, skip, gamma, beta=None, bias=None, *, epsilon=1e-12, ctx):
    """LayerNorm(input + skip + bias) * gamma + beta; optional mean, inv_std_var, sum outputs."""
    h = input.shape[-1]
    _check_param(gamma, h, "gamma")
    _check_param(beta, h, "beta")
    x = _skip_sum(input, skip, bias)
    mean = mx.mean(x, axis=-1, keepdims=True)
    var = mx.mean(x * x, axis=-1, keepdims=True) - mean * mean
    inv_std = 1.0 / mx.sqrt(var + epsilon)
    y = (x - mean) * inv_std * _f32(gamma)
    if beta is not None:
        y = y + _f32(beta)
    return _skip_outputs(input, x, y, mean, inv_std, ctx.n_outputs)


@register("SkipSimplifiedLayerNormalization", 1, domain=MS, dtypes=_SKIP_TYPES,
          check=lambda v: _skip_check(v, 2))
def skip_simplified_layer_norm(input, skip, gamma, bias=None, *, epsilon=1e-12, ctx):
    """RMSNorm(input + skip + bias) * gamma; optional mean, inv_std_var, sum outputs."""
    h = input.shape[-1]
    _check_param(gamma, h, "gamma")
    if not _wants_stats(ctx) and cuda_kernels.enabled() and \
            cuda_kernels.rms_norm_reason(input, skip, gamma, bias) is None:
        y, total = cuda_kernels.rms_norm(input, gamma, epsilon, skip=skip, bias=bias)
        return (y, None, None, total)[:ctx.n_outputs]
    x = _skip_sum(input, skip, bias)
    y = _rms_norm(x, gamma, epsilon)
    inv_std = None
    if _wants_stats(ctx):
        inv_std = 1.0 / mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True) + epsilon)
    return _skip_outputs(input, x, y, None if inv_std is None else mx.zeros_like(inv_std), inv_std,
                         ctx.n_outputs)


def _simplified_check(v) -> str | None:
    if v.attrs.get("stash_type", 1) != 1:
        return f"stash_type {v.attrs['stash_type']} (float32 statistics only)"
    t, s = v.dtype(0), v.dtype(1)
    if t not in _SKIP_TYPES or s != t:
        return f"X {dt.name(t)} with scale {dt.name(s)} (same float32/float16/bfloat16 type only)"
    r = v.rank(0)
    a = v.attrs.get("axis", -1)
    if r is not None and not -r <= a < r:
        return f"axis {a} out of range for rank {r}"
    return None


@register("SimplifiedLayerNormalization", 1, check=_simplified_check)
def simplified_layer_norm(X, scale, *, axis=-1, epsilon=1e-5, stash_type=1, ctx):
    """RMS normalization over axes [axis, rank): Y = X / sqrt(mean(X^2) + eps) * scale."""
    a = axis % X.ndim
    axes = tuple(range(a, X.ndim))
    if tuple(scale.shape) != tuple(X.shape[a:]) and scale.size != 1:
        if tuple(scale.shape) != tuple(X.shape[X.ndim - scale.ndim:]):
            raise ValueError(f"scale shape {scale.shape} does not fit X shape {X.shape} at axis {axis}")
    if ctx.n_outputs == 1 and a == X.ndim - 1 and scale.shape == (X.shape[-1],):      # the last axis, one output
        if cuda_kernels.enabled() and cuda_kernels.rms_norm_reason(X, None, scale, None) is None:
            return cuda_kernels.rms_norm(X, scale, epsilon)[0]
        return _rms_norm(X.astype(mx.float32), scale, epsilon).astype(X.dtype)
    x = X.astype(mx.float32)
    inv_std = 1.0 / mx.sqrt(mx.mean(x * x, axis=axes, keepdims=True) + epsilon)
    y = (x * inv_std * _f32(scale)).astype(X.dtype)
    return (y, inv_std) if ctx.n_outputs > 1 else y


# ORT's own LayerNormalization (ai.onnx domain, opset 1; the ONNX op arrived in opset 17 with the
# same attributes and outputs): models exported with opset < 17 use it.
def _ln1_check(v) -> str | None:
    for i in (1, 2):
        if v.has(i) and v.dtype(i) != v.dtype(0):
            return f"input {i} is {dt.name(v.dtype(i))}, X {dt.name(v.dtype(0))} (mixed types not handled)"
    return _ln_check(v)


@register("LayerNormalization", 1, dtypes=dt.FLOATS - {dt.BFLOAT16}, check=_ln1_check)
def layer_norm_1(X, Scale, B=None, *, axis=-1, epsilon=1e-5, stash_type=1, ctx):
    """ORT's pre-opset-17 LayerNormalization: the opset-17 translator."""
    return layer_norm(X, Scale, B, axis=axis, epsilon=epsilon, stash_type=stash_type, ctx=ctx)
