"""Pooling: MaxPool (with Indices), AveragePool, LpPool and the Global* variants.

A window reduction is built from one strided slice of the padded input per kernel
offset (kernel sizes are small), reduced elementwise: no per-element Python loops.
"""
from __future__ import annotations

import itertools
import math

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ..registry import register
from .conv import window_attrs_reason

#: ORT's CPU EP has float64 MaxPool only: the other pools refuse float64 (nothing to verify against)
POOL_FLOATS = frozenset({dt.FLOAT, dt.FLOAT16, dt.BFLOAT16})
MAXPOOL_TYPES = POOL_FLOATS | {dt.DOUBLE, dt.INT8, dt.UINT8}
AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def _s(v):
    return v.decode() if isinstance(v, bytes) else v


def pool_geometry(in_sizes, kernel, strides, dilations, pads, auto_pad, ceil_mode):
    """(pads_begin, pads_end, output sizes) as ORT's CPU pooling kernels compute them."""
    nsp = len(in_sizes)
    lo, hi, out = [], [], []
    for i, n in enumerate(in_sizes):
        k, s, d = kernel[i], strides[i], dilations[i]
        span = (k - 1) * d + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-n // s)
            total = max(0, (o - 1) * s + span - n)
            b = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            lo.append(b)
            hi.append(total - b)
            out.append(o)
            continue
        if auto_pad == "VALID":
            b = e = 0
        else:
            b, e = pads[i], pads[i + nsp]
        num = n + b + e - span
        if ceil_mode:
            o = -(-num // s) + 1
            if (o - 1) * s >= n + b:          # the last window must start inside the input or the begin pad
                o -= 1
        else:
            o = num // s + 1
        lo.append(b)
        hi.append(e)
        out.append(max(o, 0))
    return lo, hi, out


def _pool_check(view, global_=False):
    r = view.rank(0)
    if r is not None and r < 3:
        return f"input rank {r} < 3"
    if global_:
        return None
    ap = _s(view.attrs.get("auto_pad", "NOTSET"))
    if ap not in AUTO_PADS:
        return f"auto_pad {ap!r}"
    k = view.attrs.get("kernel_shape")
    if r is not None and k is not None and len(k) != r - 2:
        return f"kernel_shape {list(k)} does not fit rank {r}"
    reason = window_attrs_reason(view, ("kernel_shape", "strides", "dilations"))
    if reason:
        return reason
    pads = view.attrs.get("pads")
    if pads is not None and k is not None and any(int(p) >= int(kk) for p, kk in zip(pads, list(k) * 2)):
        return f"pads {list(pads)} not smaller than kernel_shape {list(k)}"
    dil = view.attrs.get("dilations")
    if ap in ("SAME_UPPER", "SAME_LOWER") and dil is not None and any(int(d) != 1 for d in dil):
        # ORT's CPU EP pads for the undilated kernel there, so its outputs are shorter than the spec's
        return f"auto_pad {ap} with dilations {list(dil)} (ORT's CPU EP sizes these windows otherwise than the spec)"
    return None


def _setup(X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode):
    nsp = X.ndim - 2
    kernel = list(kernel_shape)
    strides = list(strides) if strides is not None else [1] * nsp
    dilations = list(dilations) if dilations is not None else [1] * nsp
    pads = list(pads) if pads is not None else [0] * (2 * nsp)
    if not (len(kernel) == len(strides) == len(dilations) == nsp and len(pads) == 2 * nsp):
        raise ValueError(f"kernel_shape {kernel} / strides / dilations / pads {pads} do not fit {nsp} spatial dims")
    lo, hi, out = pool_geometry(X.shape[2:], kernel, strides, dilations, pads, _s(auto_pad), ceil_mode)
    return kernel, strides, dilations, lo, hi, out


def _padded(X, lo, out, kernel, strides, dilations, value):
    """X padded with ``value``: ``lo`` before, and after as far as the last window reaches."""
    widths = [(0, 0), (0, 0)]
    for i, n in enumerate(X.shape[2:]):
        need = (out[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 if out[i] > 0 else 0
        widths.append((lo[i], max(0, need - lo[i] - n)))
    if all(w == (0, 0) for w in widths):
        return X
    return mx.pad(X, widths, constant_values=value)


def _windows(xp, kernel, strides, dilations, out):
    """(kernel offset, strided slice of xp) for every offset in the kernel, row-major."""
    for off in itertools.product(*[range(k) for k in kernel]):
        idx = [slice(None), slice(None)]
        for i, o in enumerate(off):
            start = o * dilations[i]
            idx.append(slice(start, start + (out[i] - 1) * strides[i] + 1, strides[i]))
        yield off, xp[tuple(idx)]


_FLOAT_TYPES = (mx.float16, mx.bfloat16, mx.float32, mx.float64)


def _lowest(dtype):
    if dtype in _FLOAT_TYPES:
        return -float("inf")
    return int(np.iinfo(np.dtype(str(dtype).split(".")[-1])).min)


def _start(dtype) -> mx.array:
    """Where ORT's max pooling starts a window (``numeric_limits<T>::lowest()``, finite): a window holding nothing
    above it (only padding, -inf or NaN, which its ``>`` never takes) gives it. Half types: float32's, rounded to
    the type (-inf): ORT pools them in float32 between the casts it inserts."""
    if dtype == mx.float64:
        return mx.array(float(np.finfo(np.float64).min), dtype)
    if dtype in _FLOAT_TYPES:
        return mx.array(float(mx.finfo(mx.float32).min), mx.float32).astype(dtype)
    return mx.array(_lowest(dtype), dtype)


# ------------------------------------------------------------------ MaxPool
def _maxpool_check(view):
    reason = _pool_check(view)
    if reason:
        return reason
    so = view.attrs.get("storage_order", 0)
    if so not in (0, 1):
        return f"storage_order {so}"
    wants_idx = len(view.node.outputs) > 1 and bool(view.node.outputs[1])
    if so == 1 and wants_idx and view.rank(0) != 4:
        return "storage_order=1 Indices outside 2-D pooling (ORT's CPU EP applies it only to 2-D)"
    return None


@register("MaxPool", 1, dtypes=MAXPOOL_TYPES, check=_maxpool_check)
def max_pool(X, *, kernel_shape, auto_pad="NOTSET", ceil_mode=0, dilations=None, pads=None, storage_order=0,
             strides=None, ctx):
    """Max over each window; optional Indices (flat NC... offsets, first maximum wins)."""
    kernel, strides, dilations, lo, hi, out = _setup(X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    shape = (X.shape[0], X.shape[1], *out)
    if math.prod(shape) == 0:
        y = mx.zeros(shape, X.dtype)
        return (y, mx.zeros(shape, mx.int64)) if ctx.n_outputs > 1 else y
    xp = _padded(X, lo, out, kernel, strides, dilations, _lowest(X.dtype))
    if ctx.n_outputs < 2 and all(d == 1 for d in dilations):
        # the plain maximum of each window: ORT's MLAS pooling (float32), and its loop's answer where no window lies
        # wholly in the padding, as none can without dilations
        y = None
        for _, w in _windows(xp, kernel, strides, dilations, out):
            y = w if y is None else mx.maximum(y, w)
        return y
    start = _start(X.dtype)
    sizes = X.shape[2:]
    # coordinates of every output window's first element, per spatial dim (in input coordinates)
    base = [mx.arange(o, dtype=mx.int64) * s - b for o, s, b in zip(out, strides, lo)]
    nc = mx.arange(X.shape[0] * X.shape[1], dtype=mx.int64).reshape(X.shape[0], X.shape[1], *[1] * len(out))
    plane = math.prod(sizes)
    if storage_order == 0:
        mult = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    else:
        mult = [math.prod(sizes[:i]) for i in range(len(sizes))]
    # ORT's own loop (Indices or dilations): from its start value, an element replaces the maximum only when greater
    # (the first maximum wins, NaN never does); a window nothing replaces (one wholly in the padding) keeps the start
    # and an index of -1 in every coordinate
    y = mx.broadcast_to(start, shape)
    if ctx.n_outputs < 2:
        for _, w in _windows(xp, kernel, strides, dilations, out):
            y = mx.where(w > y, w, y)
        return y
    idx = mx.broadcast_to(nc * plane - sum(mult), shape)
    for off, w in _windows(xp, kernel, strides, dilations, out):
        flat = nc * plane
        for i, o in enumerate(off):
            coord = (base[i] + o * dilations[i]) * mult[i]
            flat = flat + coord.reshape([-1 if j == i else 1 for j in range(len(out))])
        better = w > y
        y = mx.where(better, w, y)
        idx = mx.where(better, flat, idx)
    return y, idx


# ------------------------------------------------------------------ AveragePool
def _avg_check(view):
    return _pool_check(view)


@register("AveragePool", 1, dtypes=POOL_FLOATS, check=_avg_check)
def average_pool(X, *, kernel_shape, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None,
                 pads=None, strides=None):
    """Mean over each window; the divisor counts pads only with count_include_pad (never ceil overflow)."""
    kernel, strides, dilations, lo, hi, out = _setup(X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    shape = (X.shape[0], X.shape[1], *out)
    if math.prod(shape) == 0:
        return mx.zeros(shape, X.dtype)
    acc_t = mx.float32 if X.dtype in (mx.float16, mx.bfloat16) else X.dtype
    xp = _padded(X.astype(acc_t), lo, out, kernel, strides, dilations, 0.0)
    # the divisor: a ones mask over the input (or input + pads) pooled the same way
    if count_include_pad:
        ones = mx.ones((1, 1, *[n + a + b for n, a, b in zip(X.shape[2:], lo, hi)]), acc_t)
        mask_lo = [0] * len(lo)
    else:
        ones = mx.ones((1, 1, *X.shape[2:]), acc_t)
        mask_lo = lo
    mp = _padded(ones, mask_lo, out, kernel, strides, dilations, 0.0)
    total = count = None
    for (_, w), (_, m) in zip(_windows(xp, kernel, strides, dilations, out),
                              _windows(mp, kernel, strides, dilations, out)):
        total = w if total is None else total + w
        count = m if count is None else count + m
    # a window wholly in the padding counts nothing: 0, as ORT's CPU EP (not 0 / 0)
    return (total / mx.maximum(count, 1)).astype(X.dtype)


# ------------------------------------------------------------------ LpPool
def _lp_reduce(windows, p):
    acc = None
    for _, w in windows:
        v = mx.square(w) if p == 2 else (mx.abs(w) if p == 1 else mx.power(mx.abs(w), p))
        acc = v if acc is None else acc + v
    if p == 2:
        return mx.sqrt(acc)
    return acc if p == 1 else mx.power(acc, 1.0 / p)


def _lp_check(view, global_=False):
    reason = _pool_check(view, global_)
    if reason:
        return reason
    p = view.attrs.get("p", 2)
    if p <= 0:
        return f"p={p} must be positive"
    if view.dtype(0) == dt.DOUBLE and p not in (1, 2):
        return f"float64 with p={p}: MLX computes float64 pow at float32 precision"
    return None


@register("LpPool", 1, dtypes=POOL_FLOATS, check=_lp_check)
def lp_pool(X, *, kernel_shape, auto_pad="NOTSET", ceil_mode=0, dilations=None, p=2, pads=None, strides=None):
    """(sum over each window of |x|^p)^(1/p), zero padding."""
    kernel, strides, dilations, lo, hi, out = _setup(X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    shape = (X.shape[0], X.shape[1], *out)
    if math.prod(shape) == 0:
        return mx.zeros(shape, X.dtype)
    acc_t = mx.float32 if X.dtype in (mx.float16, mx.bfloat16) else X.dtype
    xp = _padded(X.astype(acc_t), lo, out, kernel, strides, dilations, 0.0)
    return _lp_reduce(_windows(xp, kernel, strides, dilations, out), p).astype(X.dtype)


# ------------------------------------------------------------------ Global pools
def _global_check(view):
    return _pool_check(view, global_=True)


def _spatial(X):
    return tuple(range(2, X.ndim))


@register("GlobalAveragePool", 1, dtypes=POOL_FLOATS, check=_global_check)
def global_average_pool(X):
    acc_t = mx.float32 if X.dtype in (mx.float16, mx.bfloat16) else X.dtype
    return mx.mean(X.astype(acc_t), axis=_spatial(X), keepdims=True).astype(X.dtype)


@register("GlobalMaxPool", 1, dtypes=POOL_FLOATS, check=_global_check)
def global_max_pool(X):
    """The maximum over the spatial axes, never below ``_start``: a channel of -inf gives ORT's CPU EP's answer (a NaN
    is each of its paths' own: kept here)."""
    return mx.maximum(mx.max(X, axis=_spatial(X), keepdims=True), _start(X.dtype))


@register("GlobalLpPool", 2, dtypes=POOL_FLOATS, check=lambda v: _lp_check(v, global_=True))
def global_lp_pool(X, *, p=2):
    acc_t = mx.float32 if X.dtype in (mx.float16, mx.bfloat16) else X.dtype
    x = X.astype(acc_t)
    ax = _spatial(X)
    if p == 2:
        y = mx.sqrt(mx.sum(mx.square(x), axis=ax, keepdims=True))
    elif p == 1:
        y = mx.sum(mx.abs(x), axis=ax, keepdims=True)
    else:
        y = mx.power(mx.sum(mx.power(mx.abs(x), p), axis=ax, keepdims=True), 1.0 / p)
    return y.astype(X.dtype)


# ------------------------------------------------------------------ MaxUnpool
def _unpool_check(view):
    if view.dtype(0) != dt.FLOAT:
        return f"X is {dt.name(view.dtype(0))} (ORT's CPU kernel: float only, nothing to verify others against)"
    r = view.rank(0)
    if r is not None and r < 3:
        return f"input rank {r} < 3"
    return None


@register("MaxUnpool", 9, dtypes=frozenset({dt.FLOAT}), const=(1, 2), check=_unpool_check)
def max_unpool(X, I, output_shape=None, *, kernel_shape, pads=None, strides=None):
    """Scatter X into zeros at the flat indices I (host values, range-checked; the last write wins)."""
    nsp = X.ndim - 2
    strides = list(strides) if strides is not None else [1] * nsp
    pads = list(pads) if pads is not None else [0] * (2 * nsp)
    if output_shape is not None and np.asarray(output_shape).size:
        shape = [int(v) for v in np.asarray(output_shape).reshape(-1)]
        if len(shape) != X.ndim:
            raise ValueError(f"output_shape {shape} does not have rank {X.ndim}")
    else:
        shape = list(X.shape[:2]) + [(n - 1) * s + k - a - b for n, s, k, a, b in
                                     zip(X.shape[2:], strides, kernel_shape, pads[:nsp], pads[nsp:])]
    idx = np.asarray(I).reshape(-1).astype(np.int64)
    if idx.size != X.size:
        raise ValueError(f"indices shape {np.asarray(I).shape} != X shape {X.shape}")
    total = math.prod(shape)
    if idx.size and (idx.min() < 0 or idx.max() >= total):
        raise ValueError(f"index {int(idx.min() if idx.min() < 0 else idx.max())} out of range for output {shape}")
    src = np.full(total, -1, np.int64)
    if idx.size:
        uniq, first_rev = np.unique(idx[::-1], return_index=True)
        src[uniq] = idx.size - 1 - first_rev                 # the last write to a slot wins, as in ORT's loop
    found = mx.array(src >= 0)
    vals = mx.take(X.reshape(-1), mx.array(np.maximum(src, 0).astype(np.int32))) if X.size else \
        mx.zeros((total,), X.dtype)
    return mx.where(found, vals, mx.zeros_like(vals)).reshape(shape)
