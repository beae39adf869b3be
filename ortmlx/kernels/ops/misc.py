"""Odds and ends: NonMaxSuppression, Det, TfIdfVectorizer (integer pools), RoiAlign.

RoiAlign is host-computed (its sampling grid depends on the ROI values): float32 numpy with
ORT's sample positions and bilinear weights; ``max`` is ORT's (the largest weighted corner
value over the samples).

Det is host-computed: numpy's LU in float64, rounded once to float32 (ORT's CPU EP works in
float32, so the two agree to float32 round-off times the matrix's condition).

NonMaxSuppression is host-computed (its output size depends on the data): a greedy pass per
(batch, class) over the candidates above ``score_threshold`` by descending score (ties: lower
box index first), a candidate kept unless its IoU with an already kept box exceeds
``iou_threshold``. The IoU is evaluated in float32 with the same operations, in the same
order, as ORT's CPU kernel, so boxes at the threshold resolve the same way.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..registry import register

F32 = np.float32


def _scalar(x, default, kind):
    if x is None:
        return default
    a = dt.host(x).reshape(-1)
    if a.size != 1:
        raise ValueError(f"{kind} must hold one value, got shape {dt.host(x).shape}")
    return a[0]


def _corners(boxes, center_point_box: int):
    """(x_min, y_min, x_max, y_max) float32 columns, as ORT derives them."""
    b = boxes.astype(F32)
    if center_point_box == 0:
        y_a, x_a, y_b, x_b = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
        return np.minimum(x_a, x_b), np.minimum(y_a, y_b), np.maximum(x_a, x_b), np.maximum(y_a, y_b)
    w, h = b[:, 2] / F32(2), b[:, 3] / F32(2)
    return b[:, 0] - w, b[:, 1] - h, b[:, 0] + w, b[:, 1] + h


def _suppressed(c, kept, j, thr):
    """Whether box ``j`` overlaps any of the ``kept`` boxes by IoU > thr (float32, ORT's operation order)."""
    x0, y0, x1, y1 = (v[kept] for v in c)
    a0, b0, a1, b1 = (v[j] for v in c)
    zero = F32(0)
    inter = (np.maximum(np.minimum(x1, a1) - np.maximum(x0, a0), zero) *
             np.maximum(np.minimum(y1, b1) - np.maximum(y0, b0), zero))
    area_k = (x1 - x0) * (y1 - y0)
    area_j = (a1 - a0) * (b1 - b0)
    union = area_k + area_j - inter
    ok = (inter > zero) & (area_k > zero) & (area_j > zero) & (union > zero)
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = inter / np.where(ok, union, F32(1))
    return bool(np.any(ok & (iou > thr)))


def nms(boxes, scores, max_out: int, iou: float, score_thr, center_point_box: int) -> np.ndarray:
    """Selected (batch, class, box) triples, int64 (n, 3)."""
    if boxes.ndim != 3 or scores.ndim != 3 or boxes.shape[2] != 4:
        raise ValueError(f"boxes {boxes.shape} must be (B, N, 4) and scores {scores.shape} (B, C, N)")
    if boxes.shape[0] != scores.shape[0] or boxes.shape[1] != scores.shape[2]:
        raise ValueError(f"boxes {boxes.shape} and scores {scores.shape} disagree on batches or boxes")
    if not 0 <= iou <= 1:
        raise ValueError(f"iou_threshold {iou} outside [0, 1]")
    if np.isnan(scores).any():
        raise ValueError("NaN score: ORT's candidate order is undefined for it")
    out = []
    if max_out <= 0:
        return np.zeros((0, 3), np.int64)
    thr = F32(iou)
    for b in range(boxes.shape[0]):
        c = _corners(boxes[b], center_point_box)
        for k in range(scores.shape[1]):
            s = scores[b, k].astype(F32)
            cand = np.arange(s.size) if score_thr is None else np.nonzero(s > F32(score_thr))[0]
            cand = cand[np.lexsort((cand, -s[cand]))]          # score descending, then lower index
            kept: list[int] = []
            for j in cand:
                if kept and _suppressed(c, np.array(kept), j, thr):
                    continue
                kept.append(int(j))
                out.append((b, k, int(j)))
                if len(kept) >= max_out:
                    break
    return np.array(out, np.int64).reshape(-1, 3)


def _nms_check(view):
    cpb = view.attrs.get("center_point_box", 0)
    if cpb not in (0, 1):
        return f"center_point_box {cpb} is not 0 or 1"
    if view.dtype(1) != dt.FLOAT:
        return f"scores dtype {dt.name(view.dtype(1))} is not float32"
    return None


@register("NonMaxSuppression", 10, dtypes={dt.FLOAT}, host_computed=True, check=_nms_check)
def non_max_suppression(boxes, scores, max_output_boxes_per_class=None, iou_threshold=None,
                        score_threshold=None, *, center_point_box=0):
    """Greedy per-class NMS; selected_indices (n, 3) int64 in selection order."""
    max_out = int(_scalar(max_output_boxes_per_class, 0, "max_output_boxes_per_class"))
    iou = float(_scalar(iou_threshold, 0.0, "iou_threshold"))
    st = None if score_threshold is None else float(_scalar(score_threshold, 0.0, "score_threshold"))
    return nms(dt.host(boxes), dt.host(scores), max_out, iou, st, center_point_box)


# ------------------------------------------------------------------ Det
def _det_check(view):
    s = view.shape(0)
    if s is not None and (len(s) < 2 or (isinstance(s[-1], int) and isinstance(s[-2], int) and s[-1] != s[-2])):
        return f"input shape {tuple(s)} is not a (batch of) square matrices"
    return None


@register("Det", 11, dtypes={dt.FLOAT}, host_computed=True, check=_det_check)
def det(X):
    """Determinant of the trailing square matrices, float64 LU on the host, float32 out."""
    x = dt.host(X)
    if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"input shape {x.shape} is not a (batch of) square matrices")
    return np.linalg.det(x.astype(np.float64)).astype(np.float32)


# ------------------------------------------------------------------ TfIdfVectorizer
MODES = ("TF", "IDF", "TFIDF")


def _tfidf_check(view):
    a = view.attrs
    mode = a.get("mode")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in MODES:
        return f"mode {mode!r} is not one of {MODES}"
    if not a.get("pool_int64s") or a.get("pool_strings"):
        return "only integer pools (pool_int64s) are implemented"
    if view.dtype(0) not in (dt.INT32, dt.INT64):
        return f"input dtype {dt.name(view.dtype(0))} is not int32/int64"
    r = view.rank(0)
    if r is not None and r not in (1, 2):
        return f"input rank {r} is not 1 or 2"
    lo, hi = a.get("min_gram_length"), a.get("max_gram_length")
    counts = list(a.get("ngram_counts") or [])
    if not 1 <= lo <= hi or hi > len(counts):
        return f"gram lengths [{lo}, {hi}] do not fit {len(counts)} ngram_counts"
    if a.get("max_skip_count", 0) < 0:
        return f"max_skip_count {a['max_skip_count']} < 0"
    return None


def _pool_table(pool, counts, indexes) -> dict:
    """(n-gram tuple) -> output column, from the pool laid out by ngram_counts."""
    table, k = {}, 0
    bounds = list(counts) + [len(pool)]
    for length, (start, end) in enumerate(zip(bounds, bounds[1:]), 1):
        if (end - start) % length:
            raise ValueError(f"pool slice [{start}, {end}) of {length}-grams is not a whole number of n-grams")
        for j in range(start, end, length):
            if k >= len(indexes):
                raise ValueError(f"ngram_indexes has {len(indexes)} entries, the pool more n-grams")
            table[tuple(pool[j:j + length])] = int(indexes[k])
            k += 1
    return table


def _tf_row(row, table, lo, hi, max_skip, width):
    """n-gram counts of one row (unigrams counted once, whatever the skip)."""
    out = np.zeros(width, np.float32)
    n = len(row)
    for length in range(lo, hi + 1):
        for skip in range(0, (max_skip if length > 1 else 0) + 1):
            step = skip + 1
            for i in range(n - (length - 1) * step):
                col = table.get(tuple(row[i:i + (length - 1) * step + 1:step]))
                if col is not None:
                    out[col] += 1
    return out


@register("TfIdfVectorizer", 9, host_computed=True, check=_tfidf_check)
def tfidf_vectorizer(X, *, max_gram_length, max_skip_count, min_gram_length, mode, ngram_counts, ngram_indexes,
                     pool_int64s=None, pool_strings=None, weights=None):
    """Counts of the pool's n-grams (skip-grams up to max_skip_count), as TF, IDF (0/1) or TFIDF."""
    x = dt.host(X).astype(np.int64)
    mode = mode.decode() if isinstance(mode, bytes) else mode
    width = int(max(ngram_indexes)) + 1
    table = _pool_table([int(v) for v in pool_int64s], [int(c) for c in ngram_counts], list(ngram_indexes))
    if x.ndim == 2 and x.shape[0] == 0:
        raise ValueError(f"input shape {x.shape}: a batch of 0 rows (ORT's CPU EP rejects it too)")
    rows = x.reshape(1, -1) if x.ndim == 1 else x
    tf = np.stack([_tf_row(tuple(int(v) for v in r), table, min_gram_length, max_gram_length, max_skip_count,
                           width) for r in rows])
    w = np.ones(width, np.float32)
    if weights:                                   # weights[k] belongs to the pool's k-th n-gram
        if len(weights) != len(ngram_indexes):
            raise ValueError(f"{len(weights)} weights for {len(ngram_indexes)} n-grams")
        w[np.asarray(ngram_indexes, np.int64)] = np.asarray(weights, np.float32)
    if mode == "TF":
        y = tf
    elif mode == "IDF":
        y = (tf > 0).astype(np.float32) * w
    else:
        y = tf * w
    return y.reshape(-1) if x.ndim == 1 else y


# ------------------------------------------------------------------ RoiAlign
def _roi_check(view):
    mode = view.attrs.get("mode", "avg")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in ("avg", "max"):
        return f"mode {mode!r} is not avg or max"
    ctm = view.attrs.get("coordinate_transformation_mode", "half_pixel")
    ctm = ctm.decode() if isinstance(ctm, bytes) else ctm
    if ctm not in ("half_pixel", "output_half_pixel"):
        return f"coordinate_transformation_mode {ctm!r}"
    if view.rank(0) not in (None, 4):
        return f"input rank {view.rank(0)} is not 4"
    if view.dtype(1) != dt.FLOAT:
        return f"rois dtype {dt.name(view.dtype(1))} is not float32"
    if view.attrs.get("sampling_ratio", 0) < 0:
        return f"sampling_ratio {view.attrs['sampling_ratio']} < 0"
    return None


def _axis_samples(start, bin_size, pooled: int, grid: int, size: int):
    """Per (bin, sample): low index, high index, low weight, high weight, in-range flag (float32 as ORT)."""
    p = np.arange(pooled, dtype=F32)[:, None]
    i = (np.arange(grid, dtype=F32) + F32(0.5))[None, :]
    c = (start + p * bin_size) + i * bin_size / F32(grid)
    ok = ~((c < F32(-1.0)) | (c > F32(size)))
    c = np.maximum(c, F32(0))
    low = np.floor(c).astype(np.int64)          # c >= 0: truncation
    top = low >= size - 1
    low = np.where(top, size - 1, low)
    high = np.where(top, size - 1, low + 1)
    c = np.where(top, low.astype(F32), c)
    lw = c - low.astype(F32)
    return low, high, F32(1) - lw, lw, ok


def _roi_one(fmap, roi, ph: int, pw: int, ratio: int, scale, half: bool, mode: str):
    """(C, ph, pw) pooled features of one ROI."""
    off = F32(0.5) if half else F32(0)
    x0, y0, x1, y1 = (F32(v) * F32(scale) - off for v in roi)
    rw, rh = x1 - x0, y1 - y0
    if not half:
        rw, rh = max(rw, F32(1)), max(rh, F32(1))
    bh, bw = rh / F32(ph), rw / F32(pw)
    gh = ratio if ratio > 0 else int(np.ceil(rh / F32(ph)))
    gw = ratio if ratio > 0 else int(np.ceil(rw / F32(pw)))
    _, H, W = fmap.shape
    if gh <= 0 or gw <= 0:
        return np.zeros((fmap.shape[0], ph, pw), F32)
    yl, yh, hy, ly, oky = _axis_samples(y0, bh, ph, gh, H)
    xl, xh, hx, lx, okx = _axis_samples(x0, bw, pw, gw, W)
    ok = oky[:, :, None, None] & okx[None, None, :, :]                       # (ph, gh, pw, gw)
    w = [np.where(ok, a[:, :, None, None] * b[None, None, :, :], F32(0))
         for a, b in ((hy, hx), (hy, lx), (ly, hx), (ly, lx))]
    iy = [yl, yl, yh, yh]
    ix = [xl, xh, xl, xh]
    terms = [wk * fmap[:, np.where(ok, a[:, :, None, None], 0), np.where(ok, b[None, None, :, :], 0)]
             for wk, a, b in zip(w, iy, ix)]                                  # each (C, ph, gh, pw, gw)
    if mode == "avg":
        v = ((terms[0] + terms[1]) + terms[2]) + terms[3]
        return (v.sum(axis=(2, 4), dtype=F32) / F32(max(gh * gw, 1))).astype(F32)
    v = np.maximum(np.maximum(np.maximum(terms[0], terms[1]), terms[2]), terms[3])
    return v.max(axis=(2, 4)).astype(F32)


def _roi_align(X, rois, batch_indices, mode, output_height, output_width, sampling_ratio, spatial_scale, half):
    x, r, b = dt.host(X).astype(F32), dt.host(rois).astype(F32), dt.host(batch_indices).astype(np.int64)
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if r.ndim != 2 or r.shape[1] != 4 or b.shape != (r.shape[0],):
        raise ValueError(f"rois {r.shape} must be (n, 4) and batch_indices {b.shape} (n,)")
    bad = (b < 0) | (b >= x.shape[0])
    if bad.any():
        raise ValueError(f"batch index {int(b[bad][0])} out of range [0, {x.shape[0] - 1}]")
    out = np.zeros((r.shape[0], x.shape[1], output_height, output_width), F32)
    for k in range(r.shape[0]):
        out[k] = _roi_one(x[b[k]], r[k], output_height, output_width, sampling_ratio, spatial_scale, half, mode)
    return out


@register("RoiAlign", 10, dtypes={dt.FLOAT}, host_computed=True, check=_roi_check)
def roi_align_10(X, rois, batch_indices, *, mode="avg", output_height=1, output_width=1, sampling_ratio=0,
                 spatial_scale=1.0):
    """Opset 10: output_half_pixel coordinates (no half-pixel shift, ROI sides at least 1)."""
    return _roi_align(X, rois, batch_indices, mode, output_height, output_width, sampling_ratio, spatial_scale,
                      False)


@register("RoiAlign", 16, dtypes={dt.FLOAT}, host_computed=True, check=_roi_check)
def roi_align_16(X, rois, batch_indices, *, coordinate_transformation_mode="half_pixel", mode="avg",
                 output_height=1, output_width=1, sampling_ratio=0, spatial_scale=1.0):
    """Average (or ORT's max) of bilinear samples per output bin."""
    ctm = coordinate_transformation_mode
    ctm = ctm.decode() if isinstance(ctm, bytes) else ctm
    return _roi_align(X, rois, batch_indices, mode, output_height, output_width, sampling_ratio, spatial_scale,
                      ctm == "half_pixel")
