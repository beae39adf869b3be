"""Losses: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Targets are host values (``const=``): they are range-checked on the host (ORT's CPU EP
errors on a target outside [0, C) that is not ``ignore_index``, so do we) and gathered
with MLX. ``mean`` divides by the summed weights of the targets not ignored.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ..registry import register
from .softmax import _log_softmax

REDUCTIONS = ("none", "sum", "mean")
#: NLL only gathers and sums: float64 is exact in MLX; SCE needs exp/log (float32-accurate in float64)
NLL_TYPES = frozenset({dt.FLOAT, dt.DOUBLE})
SCE_TYPES = frozenset({dt.FLOAT})


def _check(view):
    red = view.attrs.get("reduction", "mean")
    red = red.decode() if isinstance(red, bytes) else red
    if red not in REDUCTIONS:
        return f"reduction {red!r} is not one of {REDUCTIONS}"
    r = view.rank(0)
    if r is not None and r < 2:
        return f"input rank {r} < 2"
    if view.dtype(2) not in (None, view.dtype(0)):
        return f"weight dtype {dt.name(view.dtype(2))} differs from input {dt.name(view.dtype(0))}"
    return None


def _targets(target, shape, ignore_index):
    """(safe int32 class ids, keep mask) for input ``shape`` (N, C, d...); ValueError on a bad target."""
    t = np.asarray(target).astype(np.int64)
    want = (shape[0],) + tuple(shape[2:])
    if t.shape != want:
        raise ValueError(f"target shape {t.shape} does not match input shape {tuple(shape)} (want {want})")
    keep = np.ones(t.shape, bool) if ignore_index is None else t != ignore_index
    c = shape[1]
    bad = keep & ((t < 0) | (t >= c))
    if bad.any():
        raise ValueError(f"target {int(t[bad].reshape(-1)[0])} out of range [0, {c - 1}]")
    return mx.array(np.where(keep, t, 0).astype(np.int32)), mx.array(keep)


def _nll(logp, target, weight, reduction, ignore_index):
    """Weighted negative log-likelihood of ``logp`` (N, C, d...) at the target classes."""
    red = reduction.decode() if isinstance(reduction, bytes) else reduction
    if red not in REDUCTIONS:
        raise ValueError(f"reduction {red!r} is not one of {REDUCTIONS}")
    idx, keep = _targets(target, logp.shape, ignore_index)
    moved = mx.moveaxis(logp, 1, -1)
    picked = mx.take_along_axis(moved, mx.expand_dims(idx, -1), axis=-1).squeeze(-1)
    w = keep.astype(logp.dtype)
    if weight is not None:
        w = w * mx.take(weight, idx)
    loss = -picked * w
    if red == "none":
        return loss
    total = mx.sum(loss)
    return total if red == "sum" else total / mx.sum(w)


@register("NegativeLogLikelihoodLoss", 12, const=(1,), dtypes=NLL_TYPES, check=_check)
def nll_loss(input, target, weight=None, *, reduction="mean", ignore_index=None):
    """loss = -input[n, target[n, d...], d...] * weight[target]."""
    return _nll(input, target, weight, reduction, ignore_index)


@register("SoftmaxCrossEntropyLoss", 12, const=(1,), dtypes=SCE_TYPES, check=_check)
def softmax_cross_entropy_loss(scores, labels, weights=None, *, reduction="mean", ignore_index=None, ctx):
    """NLL of log_softmax(scores, axis=1); optional second output log_prob."""
    logp = _log_softmax(scores, 1)
    loss = _nll(logp, labels, weights, reduction, ignore_index)
    return (loss, logp) if ctx.n_outputs > 1 else loss
