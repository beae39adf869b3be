"""MaxRoiPool: max over each bin of each region of interest, as ORT's CPU kernel computes it.

The ROIs are read on the host: every bin's bounds are host integers, so one gather per group of
ROIs collects each bin's elements in ORT's loop order, and MLX reduces them with ORT's fold
``y = max(x, y)`` (``(x < y) ? y : x`` from ``lowest()``: a NaN is passed over by the next element,
ties keep the later element, -inf becomes ``lowest()``; an empty bin is 0).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ..registry import register

F32 = np.float32
LOWEST = float(np.finfo(F32).min)
#: rounded ROI coordinates beyond this could overflow ORT's int arithmetic (undefined there): refused
COORD_LIMIT = 1 << 29


def _round_away(v: np.ndarray) -> np.ndarray:
    """std::round of float32 values (halves away from zero), exact in float64."""
    d = v.astype(np.float64)
    return np.sign(d) * np.floor(np.abs(d) + 0.5)


def roi_geometry(rois: np.ndarray, batch: int, height: int, width: int, pooled_h: int, pooled_w: int,
                 spatial_scale: float):
    """Per ROI: batch index, bin row bounds (R, ph) x2 and column bounds (R, pw) x2, clipped to the map."""
    r = np.asarray(rois, F32)
    if r.ndim != 2 or r.shape[1] != 5:
        raise ValueError(f"rois shape {r.shape} is not (num_rois, 5)")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rois hold a non-finite value ({r[~np.isfinite(r)][0]!r})")
    b = np.trunc(r[:, 0].astype(np.float64))
    bad = (b < 0) | (b >= batch)
    if bad.any():
        raise ValueError(f"roi batch index {r[bad, 0][0]!r} out of range [0, {batch})")
    coords = _round_away(r[:, 1:] * F32(spatial_scale))      # float32 product, then std::round
    if np.abs(coords).max(initial=0) > COORD_LIMIT:
        raise ValueError(f"roi coordinate {coords.flat[np.argmax(np.abs(coords))]!r} (scaled, rounded) "
                         f"is beyond +-{COORD_LIMIT}")
    c = coords.astype(np.int64)
    x0, y0, x1, y1 = c[:, 0], c[:, 1], c[:, 2], c[:, 3]

    def bounds(start, end, pooled, size):
        n = np.maximum(end - start + 1, 1).astype(F32)                   # malformed ROIs become 1 wide
        bin_size = n / F32(pooled)
        p = np.arange(pooled, dtype=F32)
        lo = np.floor(p[None, :] * bin_size[:, None]).astype(np.int64)
        hi = np.ceil((p[None, :] + F32(1)) * bin_size[:, None]).astype(np.int64)
        return (np.clip(lo + start[:, None], 0, size), np.clip(hi + start[:, None], 0, size))

    hs, he = bounds(y0, y1, pooled_h, height)
    ws, we = bounds(x0, x1, pooled_w, width)
    return b.astype(np.int64), hs, he, ws, we


def _bin_indices(b, hs, he, ws, we, height: int, width: int, k: int, sentinel: int) -> np.ndarray:
    """(R, ph*pw, k) flat row indices of every bin's elements in ORT's loop order (rows, then
    columns), padded in front with ``sentinel`` (a row of -inf, which the fold passes over)."""
    bh = (he - hs)[:, :, None]                                            # (R, ph, 1)
    bw = (we - ws)[:, None, :]                                            # (R, 1, pw)
    n = np.maximum(bh, 0) * np.maximum(bw, 0)                             # (R, ph, pw)
    t = np.arange(k)[None, None, None, :] - (k - n)[..., None]           # position inside the bin
    ok = t >= 0
    safe_bw = np.maximum(bw, 1)[..., None]
    h = hs[:, :, None, None] + t // safe_bw
    w = ws[:, None, :, None] + t % safe_bw
    flat = (b[:, None, None, None] * height + h) * width + w
    idx = np.where(ok, flat, sentinel)
    return idx.reshape(len(b), -1, k)


def _fold_max(g: mx.array) -> mx.array:
    """ORT's ``y = max(x, y)`` from ``lowest()`` over axis 2 of (R, bins, k, C)."""
    k = g.shape[2]
    pos = mx.arange(k, dtype=mx.int32).reshape(1, 1, k, 1)
    none = mx.array(-1, mx.int32)
    last_nan = mx.max(mx.where(mx.isnan(g), pos, none), axis=2, keepdims=True)
    valid = pos > last_nan                                                 # after the last NaN
    vals = mx.where(valid, g, mx.array(-np.inf, g.dtype))
    m = mx.max(vals, axis=2, keepdims=True)
    last = mx.max(mx.where(valid & (vals == m), pos, none), axis=2, keepdims=True)
    pick = mx.take_along_axis(g, mx.where(last < 0, mx.array(k - 1, mx.int32), last), axis=2)
    pick = mx.squeeze(pick, 2)
    from_lowest = mx.squeeze(last_nan, 2) < 0                             # no NaN: the fold starts at lowest()
    return mx.where(from_lowest & (pick < LOWEST), mx.array(LOWEST, g.dtype), pick)


#: elements gathered at once (bounds the memory of one gather and its fold)
CHUNK_ELEMS = 1 << 23


def _bucket(k: int) -> int:
    """Bin sizes grouped as 1, 2, 3, 4, 6, 8, 12, 16, 24 ...: few gathers, at most 1.5x padding."""
    k = max(int(k), 1)
    p = 1 << (k - 1).bit_length()                 # the power of two >= k
    return p * 3 // 4 if p >= 4 and k <= p * 3 // 4 else p


def _max_roi_pool(X: mx.array, rois: np.ndarray, pooled_shape, spatial_scale: float) -> mx.array:
    if X.ndim != 4:
        raise ValueError(f"X has rank {X.ndim}, MaxRoiPool needs (N, C, H, W)")
    ph, pw = (int(v) for v in pooled_shape)
    N, C, H, W = X.shape
    b, hs, he, ws, we = roi_geometry(rois, N, H, W, ph, pw, spatial_scale)
    R = len(b)
    if N * H * W >= 2**31 - 1:
        raise ValueError(f"X {X.shape} has too many positions for int32 gather indices")
    if R == 0 or C == 0:
        return mx.zeros((R, C, ph, pw), X.dtype)
    sizes = np.maximum(he - hs, 0)[:, :, None] * np.maximum(we - ws, 0)[:, None, :]   # (R, ph, pw)
    empty = mx.array((sizes == 0).reshape(R, ph * pw, 1))
    rows = mx.concatenate([mx.transpose(X, (0, 2, 3, 1)).reshape(N * H * W, C),
                           mx.full((1, C), -np.inf, X.dtype)])
    keys = np.array([_bucket(k) for k in sizes.reshape(R, -1).max(axis=1)])
    parts, order = [], []
    for k in np.unique(keys):
        k = int(k)
        every = np.nonzero(keys == k)[0]
        step = max(1, CHUNK_ELEMS // (ph * pw * k * C))
        for sel in np.array_split(every, -(-len(every) // step)):
            idx = _bin_indices(b[sel], hs[sel], he[sel], ws[sel], we[sel], H, W, k, N * H * W)
            g = mx.take(rows, mx.array(idx.reshape(-1).astype(np.int32)), axis=0).reshape(len(sel), ph * pw, k, C)
            parts.append(_fold_max(g))
            order.append(sel)
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    if len(parts) > 1:
        inv = np.empty(R, np.int64)
        inv[np.concatenate(order)] = np.arange(R)
        y = mx.take(y, mx.array(inv.astype(np.int32)), axis=0)
    y = mx.where(empty, mx.zeros((), X.dtype), y)                         # an empty bin is 0
    return mx.transpose(y, (0, 2, 1)).reshape(R, C, ph, pw)


def _check(view) -> str | None:
    """Opset 1-21 (ORT has no MaxRoiPool-22), float32 (its only type), rank 4, two positive pooled sizes,
    ROIs on the host (a constant, a graph input or a value from another EP)."""
    if view.since_version >= 22:
        return (f"since_version {view.since_version}: ORT's CPU EP has no MaxRoiPool-22 kernel to verify "
                "against")
    if view.rank(0) not in (None, 4):
        return f"X rank {view.rank(0)} is not 4"
    if view.dtype(1) != dt.FLOAT:
        return f"rois dtype {dt.name(view.dtype(1))} is not float32"
    ps = list(view.attrs.get("pooled_shape", []))
    if len(ps) != 2 or any(int(v) <= 0 for v in ps):
        return f"pooled_shape {ps} is not two positive sizes"
    if view.const(1) is None and not view.arrives_on_host(1):
        return "rois are computed on the device inside the group (they are read on the host: a sync)"
    return None


@register("MaxRoiPool", 1, dtypes={dt.FLOAT}, const=(1,), check=_check)
def max_roi_pool(X, rois, *, pooled_shape, spatial_scale=1.0):
    """(num_rois, C, ph, pw): the max of each ROI bin (ROI corners rounded after spatial_scale)."""
    return _max_roi_pool(X, np.asarray(rois), pooled_shape, spatial_scale)
