"""Tensor generators: Constant, ConstantOfShape, Range, EyeLike, OneHot, Trilu."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ..registry import register
from .shape import ints, norm_axis


def _out(host: np.ndarray, t: int | None, xp):
    """A host result as a value of the declared element type (numpy twin or MLX)."""
    if xp is np:
        return host
    return dt.to_mx(host, t if t is not None else dt.FROM_NUMPY[host.dtype])


# ---------------------------------------------------------------- Constant
_CONST_ATTRS = ("value", "value_float", "value_floats", "value_int", "value_ints")


def _constant_value(value=None, value_float=None, value_floats=None, value_int=None, value_ints=None):
    given = [(k, v) for k, v in zip(_CONST_ATTRS, (value, value_float, value_floats, value_int, value_ints))
             if v is not None]
    if len(given) != 1:
        raise ValueError(f"Constant needs exactly one value attribute, got {[k for k, _ in given]}")
    k, v = given[0]
    if k == "value":
        return np.asarray(v)
    if k in ("value_float", "value_floats"):
        return np.asarray(v, dtype=np.float32)
    return np.asarray(v, dtype=np.int64)


def _constant_check(view):
    """Refuses a value attribute that did not arrive as a tensor (e.g. sparse)."""
    v = view.attrs.get("value")
    if v is not None and not isinstance(v, np.ndarray):
        return f"value attribute of type {type(v).__name__}"
    return None


def _constant_host(value=None, value_float=None, value_floats=None, value_int=None, value_ints=None):
    return _constant_value(value, value_float, value_floats, value_int, value_ints)


@register("Constant", 1, host=_constant_host, check=_constant_check)
def constant(*, value=None, value_float=None, value_floats=None, value_int=None, value_ints=None, ctx):
    """The attribute's value (value_* scalar/list forms from opset 12; strings are not MLX types)."""
    return _out(_constant_value(value, value_float, value_floats, value_int, value_ints), ctx.out_dtypes[0], mx)


# ---------------------------------------------------------------- ConstantOfShape
def _cos_shape(input) -> list[int]:
    shape = ints(input)
    if min(shape, default=0) < 0:
        raise ValueError(f"shape {shape} has a negative entry")
    return shape


def _cos_value(value):
    v = np.zeros(1, np.float32) if value is None else np.asarray(value)
    if v.size != 1:
        raise ValueError(f"value must hold one element, got shape {v.shape}")
    return v.reshape(())


def _cos_host(input, value=None):
    v = _cos_value(value)
    return np.full(_cos_shape(input), v, dtype=v.dtype)


def _cos_check(view):
    """Refuses a value attribute that is not a one-element tensor."""
    v = view.attrs.get("value")
    if v is not None and (not isinstance(v, np.ndarray) or v.size != 1):
        return "value attribute is not a one-element tensor"
    return None


@register("ConstantOfShape", 9, const=(0,), host=_cos_host, check=_cos_check)
def constant_of_shape(input, *, value=None, ctx):
    """A tensor of ``shape`` filled with ``value`` (float32 0 by default)."""
    v = _cos_value(value)
    t = ctx.out_dtypes[0] if ctx.out_dtypes[0] is not None else dt.FROM_NUMPY[v.dtype]
    return mx.full(_cos_shape(input), dt.to_mx(v, t))


# ---------------------------------------------------------------- Range
def _range(xp, start, limit, delta, t=None):
    s, lim, d = (np.asarray(a).reshape(()) for a in (start, limit, delta))
    if s.dtype != lim.dtype or s.dtype != d.dtype:
        raise ValueError(f"start/limit/delta dtypes differ: {s.dtype}, {lim.dtype}, {d.dtype}")
    if d == 0:
        raise ValueError("delta is 0")
    # ORT: n = ceil((double(limit) - double(start)) / double(delta)); values accumulate in T
    n = max(int(np.ceil((float(lim) - float(s)) / float(d))), 0)
    out = np.cumsum(np.concatenate([s.reshape(1), np.full(max(n - 1, 0), d, s.dtype)]), dtype=s.dtype)[:n]
    return _out(np.asarray(out, dtype=s.dtype), t, xp)


@register("Range", 11, const=(0, 1, 2), host=lambda start, limit, delta: _range(np, start, limit, delta))
def range_(start, limit, delta, *, ctx):
    """start, start+delta, ... up to ``limit`` (exclusive); computed on the host."""
    return _range(mx, start, limit, delta, ctx.out_dtypes[0])


# ---------------------------------------------------------------- EyeLike
@register("EyeLike", 9)
def eye_like(input, *, dtype=None, k=0, ctx):
    """Ones on the k-th diagonal of an input-shaped matrix."""
    if input.ndim != 2:
        raise ValueError(f"input rank {input.ndim}, EyeLike needs rank 2")
    n, m = input.shape
    t = ctx.out_dtypes[0]
    return mx.eye(n, m, k=int(k), dtype=dt.MLX[t]) if n and m else mx.zeros((n, m), dt.MLX[t])


# ---------------------------------------------------------------- OneHot
def _onehot(indices, depth, values, axis, wrap_negative: bool):
    d = np.asarray(depth).reshape(-1)
    if d.size != 1:
        raise ValueError(f"depth must hold one value, got shape {np.asarray(depth).shape}")
    n = int(d[0])
    if n < 1:
        raise ValueError(f"depth {n} must be positive")
    if values.size != 2:
        raise ValueError(f"values must hold [off, on], got shape {tuple(values.shape)}")
    r = indices.ndim + 1
    a = norm_axis(axis, r)
    idx = indices.astype(mx.int64) if indices.dtype != mx.int64 else indices
    if wrap_negative:
        idx = mx.where(idx < 0, idx + n, idx)
    idx = mx.expand_dims(idx, a)
    ar = mx.arange(n, dtype=mx.int64).reshape([n if k == a else 1 for k in range(r)])
    v = mx.reshape(values, (-1,))
    return mx.where(idx == ar, v[1], v[0])


def _onehot_check(view):
    """Refuses float indices (ORT's truncation rules are not reproduced)."""
    t = view.dtype(0)
    if t in dt.FLOATS:
        return f"float indices ({dt.name(t)})"
    return None


@register("OneHot", 9, const=(1,), check=_onehot_check)
def one_hot(indices, depth, values, *, axis=-1):
    """One-hot along ``axis``; negative indices count from the end; out of range gives all-off."""
    return _onehot(indices, depth, values, axis, True)


# ---------------------------------------------------------------- Trilu
@register("Trilu", 14)
def trilu(input, k=None, *, upper=1):
    """Keep the upper (j - i >= k) or lower (j - i <= k) triangle of the last two dims; k is read on the device."""
    x = input
    if x.ndim < 2:
        raise ValueError(f"input rank {x.ndim} < 2")
    n, m = x.shape[-2:]
    diff = mx.arange(m, dtype=mx.int64)[None, :] - mx.arange(n, dtype=mx.int64)[:, None]
    if k is None:
        kk = mx.array(0, mx.int64)
    elif k.size != 1:
        raise ValueError(f"k must hold one value, got shape {tuple(k.shape)}")
    else:
        kk = mx.reshape(k, ()).astype(mx.int64)
    mask = diff >= kk if upper else diff <= kk
    return mx.where(mask, x, mx.zeros((), x.dtype))
