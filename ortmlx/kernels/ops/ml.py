"""ai.onnx.ml basics: Binarizer, Scaler, Normalizer, Imputer, ArrayFeatureExtractor,
LabelEncoder (numeric keys and values; host-computed lookup in sorted keys), OneHotEncoder
(integer categories, zeros=1), FeatureVectorizer.

Numeric tensors only (string variants need tensors MLX does not have). Outputs follow
ORT's CPU kernels: Scaler and Normalizer produce float32 from any numeric input.
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ..registry import ML, register

F32_ONLY = frozenset({dt.FLOAT})
NUMERIC_IN = frozenset({dt.FLOAT, dt.DOUBLE, dt.INT64, dt.INT32})


def _s(v):
    return v.decode() if isinstance(v, bytes) else v


# ------------------------------------------------------------------ Binarizer
@register("Binarizer", 1, domain=ML, dtypes=F32_ONLY)
def binarizer(X, *, threshold=0.0):
    """1 where X > threshold, else 0 (same type)."""
    return (X > mx.array(threshold, X.dtype)).astype(X.dtype)


# ------------------------------------------------------------------ Scaler
def _scaler_check(view):
    off, sc = view.attrs.get("offset"), view.attrs.get("scale")
    if not off or not sc:
        return "offset and scale must both be given (ORT's CPU EP rejects an empty one)"
    if len(off) != len(sc):
        return f"offset length {len(off)} != scale length {len(sc)} (ORT's CPU EP rejects it)"
    shape = view.shape(0)
    c = shape[-1] if shape else None
    for name, v in (("offset", off), ("scale", sc)):
        if v is not None and len(v) != 1 and (not isinstance(c, int) or len(v) != c):
            return f"{name} of length {len(v)} fits neither 1 nor the {c} features"
    r = view.rank(0)
    if r is not None and r not in (1, 2):
        return f"input rank {r} (ORT's Scaler takes 1-D or 2-D)"
    return None


@register("Scaler", 1, domain=ML, dtypes=NUMERIC_IN, check=_scaler_check)
def scaler(X, *, offset=None, scale=None):
    """Y = (X - offset) * scale in float32, offset/scale per feature or broadcast."""
    x = X.astype(mx.float32)
    if offset is not None:
        x = x - mx.array(np.asarray(offset, np.float32))
    if scale is not None:
        x = x * mx.array(np.asarray(scale, np.float32))
    return x


# ------------------------------------------------------------------ Normalizer
NORMS = ("MAX", "L1", "L2")


def _norm_check(view):
    n = _s(view.attrs.get("norm", "MAX"))
    if n not in NORMS:
        return f"norm {n!r} is not one of {NORMS}"
    r = view.rank(0)
    if r is not None and r not in (1, 2):
        return f"input rank {r} (ORT's Normalizer takes 1-D or 2-D)"
    return None


@register("Normalizer", 1, domain=ML, dtypes=NUMERIC_IN, check=_norm_check)
def normalizer(X, *, norm="MAX"):
    """Each row divided by its max, L1 or L2 norm (float32)."""
    x = X.astype(mx.float32)
    n = _s(norm)
    if n == "MAX":
        d = mx.max(x, axis=-1, keepdims=True)
    elif n == "L1":
        d = mx.sum(mx.abs(x), axis=-1, keepdims=True)
    elif n == "L2":
        d = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
    else:
        raise ValueError(f"norm {n!r} is not one of {NORMS}")
    return x / d


# ------------------------------------------------------------------ Imputer
def _imputer_check(view):
    a = view.attrs
    t = view.dtype(0)
    vals = a.get("imputed_value_floats") if t == dt.FLOAT else a.get("imputed_value_int64s")
    if t not in (dt.FLOAT, dt.INT64):
        return f"input dtype {dt.name(t)} is not float32/int64"
    if not vals:
        return "no imputed values of the input's type"
    c = (view.shape(0) or [None])[-1]
    if len(vals) != 1 and (not isinstance(c, int) or len(vals) != c):
        return f"{len(vals)} imputed values fit neither 1 nor the {c} features"
    return None


@register("Imputer", 1, domain=ML, check=_imputer_check)
def imputer(X, *, imputed_value_floats=None, imputed_value_int64s=None, replaced_value_float=0.0,
            replaced_value_int64=0):
    """Replace ``replaced_value`` (NaN matches NaN) by the per-feature imputed value."""
    if X.dtype == mx.float32:
        fill = mx.array(np.asarray(imputed_value_floats, np.float32))
        hit = mx.isnan(X) if math.isnan(replaced_value_float) else X == replaced_value_float
    else:
        fill = mx.array(np.asarray(imputed_value_int64s, np.int64))
        hit = X == mx.array(replaced_value_int64, X.dtype)
    return mx.where(hit, fill, X)


# ------------------------------------------------------------------ ArrayFeatureExtractor
@register("ArrayFeatureExtractor", 1, domain=ML, const=(1,), dtypes=NUMERIC_IN)
def array_feature_extractor(X, Y):
    """X[..., Y] with Y flattened; a 1-D X gives (1, len(Y))."""
    idx = np.asarray(Y).astype(np.int64).reshape(-1)
    n = X.shape[-1]
    bad = (idx < 0) | (idx >= n)
    if bad.any():
        raise ValueError(f"index {int(idx[bad][0])} out of range [0, {n - 1}]")
    if idx.size == 0:
        raise ValueError("no indices")
    y = mx.take(X, mx.array(idx.astype(np.int32)), axis=-1)
    return y.reshape(1, -1) if X.ndim == 1 else y


# ------------------------------------------------------------------ LabelEncoder
def _le_arrays(a: dict):
    """(keys, values, default) numpy arrays of a LabelEncoder's numeric attributes; ValueError otherwise."""
    if a.get("keys_strings") or a.get("values_strings"):
        raise ValueError("string keys or values")
    if a.get("keys_tensor") is not None:
        keys, vals = np.asarray(a["keys_tensor"]), np.asarray(a.get("values_tensor"))
        default = a.get("default_tensor")
        if keys.dtype.kind not in "if" or vals.dtype.kind not in "if":
            raise ValueError(f"key/value tensors of dtype {keys.dtype}/{vals.dtype} are not numeric")
        default = np.zeros((), vals.dtype) if default is None else np.asarray(default).astype(vals.dtype)
        return keys.reshape(-1), vals.reshape(-1), default.reshape(-1)[0] if default.size else vals.dtype.type(0)
    if a.get("keys_int64s"):
        keys = np.asarray(a["keys_int64s"], np.int64)
    elif a.get("keys_floats"):
        keys = np.asarray(a["keys_floats"], np.float32)
    else:
        raise ValueError("no numeric keys")
    if a.get("values_int64s"):
        vals, default = np.asarray(a["values_int64s"], np.int64), np.int64(a.get("default_int64", -1))
    elif a.get("values_floats"):
        vals, default = np.asarray(a["values_floats"], np.float32), np.float32(a.get("default_float", -0.0))
    else:
        raise ValueError("no numeric values")
    return keys, vals, default


def _le_check(view):
    try:
        keys, vals, _ = _le_arrays(view.attrs)
    except ValueError as e:
        return str(e)
    if keys.shape != vals.shape:
        return f"{keys.size} keys for {vals.size} values"
    if keys.dtype.kind == "f" and np.isnan(keys).any():
        return "NaN key (ORT's NaN matching is not reproduced)"
    if np.unique(keys).size != keys.size:
        return "duplicate keys"
    kind = {dt.INT64: "i", dt.FLOAT: "f"}.get(view.dtype(0))
    if kind is None or keys.dtype.kind != kind:
        return f"input dtype {dt.name(view.dtype(0))} does not match keys of dtype {keys.dtype}"
    return None


def _label_encode(X, attrs):
    keys, vals, default = _le_arrays(attrs)
    x = dt.host(X)
    order = np.argsort(keys, kind="stable")
    sk, sv = keys[order], vals[order]
    pos = np.clip(np.searchsorted(sk, x), 0, max(sk.size - 1, 0))
    hit = sk[pos] == x if sk.size else np.zeros(x.shape, bool)
    return np.where(hit, sv[pos] if sv.size else default, default).astype(vals.dtype)


@register("LabelEncoder", 2, domain=ML, host_computed=True, check=_le_check)
def label_encoder_2(X, *, default_float=-0.0, default_int64=-1, default_string="_Unused", keys_floats=None,
                    keys_int64s=None, keys_strings=None, values_floats=None, values_int64s=None, values_strings=None):
    """Map each key to its value, anything else to the default (numeric keys and values)."""
    return _label_encode(X, dict(default_float=default_float, default_int64=default_int64, keys_floats=keys_floats,
                                 keys_int64s=keys_int64s, keys_strings=keys_strings, values_floats=values_floats,
                                 values_int64s=values_int64s, values_strings=values_strings))


@register("LabelEncoder", 4, domain=ML, host_computed=True, check=_le_check)
def label_encoder_4(X, *, default_float=-0.0, default_int64=-1, default_string="_Unused", default_tensor=None,
                    keys_floats=None, keys_int64s=None, keys_strings=None, keys_tensor=None, values_floats=None,
                    values_int64s=None, values_strings=None, values_tensor=None):
    """Opset 4 adds keys_tensor / values_tensor / default_tensor."""
    return _label_encode(X, dict(default_float=default_float, default_int64=default_int64, default_tensor=default_tensor,
                                 keys_floats=keys_floats, keys_int64s=keys_int64s, keys_strings=keys_strings,
                                 keys_tensor=keys_tensor, values_floats=values_floats, values_int64s=values_int64s,
                                 values_strings=values_strings, values_tensor=values_tensor))


# ------------------------------------------------------------------ OneHotEncoder
def _ohe_check(view):
    if not view.attrs.get("cats_int64s") or view.attrs.get("cats_strings"):
        return "only integer categories (cats_int64s) are implemented"
    if not view.attrs.get("zeros", 1):
        return "zeros=0 (an error on unknown categories needs a host read) is not implemented"
    if view.dtype(0) != dt.INT64:
        return f"input dtype {dt.name(view.dtype(0))} is not int64"
    return None


@register("OneHotEncoder", 1, domain=ML, check=_ohe_check)
def one_hot_encoder(X, *, cats_int64s=None, cats_strings=None, zeros=1):
    """float32 (..., n_cats): 1 where X equals the category, all zeros for unknown values."""
    cats = mx.array(np.asarray(cats_int64s, np.int64))
    return (mx.expand_dims(X, -1) == cats).astype(mx.float32)


# ------------------------------------------------------------------ FeatureVectorizer
def _fv_check(view):
    dims = list(view.attrs.get("inputdimensions") or [])
    if len(dims) != view.n_inputs:
        return f"{len(dims)} inputdimensions for {view.n_inputs} inputs"
    for i in range(view.n_inputs):
        if view.dtype(i) not in NUMERIC_IN:
            return f"input {i} dtype {dt.name(view.dtype(i))} is not float32/float64/int64/int32"
        r = view.rank(i)
        if r is not None and r != 2:
            return f"input {i} rank {r} (only 2-D (batch, features) inputs are implemented)"
    return None


@register("FeatureVectorizer", 1, domain=ML, check=_fv_check)
def feature_vectorizer(*inputs, inputdimensions=None):
    """Concatenate the inputs' features as float32, each cut or zero-padded to its inputdimensions entry."""
    parts = []
    for x, d in zip(inputs, inputdimensions):
        x = x.astype(mx.float32)
        c = x.shape[-1]
        if c >= d:
            parts.append(x[..., :d])
        else:
            parts.append(mx.concatenate([x, mx.zeros((*x.shape[:-1], d - c), mx.float32)], axis=-1))
    return mx.concatenate(parts, axis=-1)
