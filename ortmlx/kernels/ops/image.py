"""Resize / Upsample, GridSample, AffineGrid.

Resize is separable: for every resized axis the host computes (from the constant
scales/sizes/roi and the static input shape) the source indices and weights of each
output position, in float32 with ORT's CPU formulas; MLX then gathers and sums the
taps one axis at a time. Nearest mode is a pure gather (exact for every type).
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ..registry import register

F32 = np.float32
RESIZE_FLOATS = frozenset({dt.FLOAT, dt.FLOAT16, dt.BFLOAT16})
RESIZE_TYPES = RESIZE_FLOATS | {dt.INT8, dt.UINT8, dt.INT32}
MODES = ("nearest", "linear", "cubic")
CTMS = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
        "tf_half_pixel_for_nn", "tf_crop_and_resize")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
POLICIES = ("stretch", "not_larger", "not_smaller")


def _s(v):
    return v.decode() if isinstance(v, bytes) else v


# ------------------------------------------------------------------ coordinates (host, float32)
def original_coords(out_len, in_len, scale, ctm, roi_start=0.0, roi_end=1.0):
    """Source coordinate of every output position (ORT's float32 formulas)."""
    x = np.arange(out_len, dtype=F32)
    scale, lr, lo = F32(scale), F32(out_len), F32(in_len)
    half, one = F32(0.5), F32(1)
    if ctm == "half_pixel":
        return (x + half) / scale - half
    if ctm == "half_pixel_symmetric":
        adjustment = lr / (scale * lo)
        offset = (lo / F32(2)) * (one - adjustment)
        return offset + (x + half) / scale - half
    if ctm == "pytorch_half_pixel":
        return (x + half) / scale - half if out_len > 1 else np.zeros(out_len, F32)
    if ctm == "align_corners":
        return np.zeros(out_len, F32) if out_len == 1 else x * (lo - one) / (lr - one)
    if ctm == "asymmetric":
        return x / scale
    if ctm == "tf_half_pixel_for_nn":
        return (x + half) / scale
    if ctm == "tf_crop_and_resize":
        rs, re = F32(roi_start), F32(roi_end)
        if out_len > 1:
            return rs * (lo - one) + (x * (re - rs) * (lo - one)) / (lr - one)
        return np.full(out_len, F32(0.5) * (rs + re) * (lo - one), F32)
    raise ValueError(f"coordinate_transformation_mode {ctm!r}")


def _nearest(xo, nearest_mode, scale, simple):
    if simple:                                   # opset 10 / Upsample: truncate up, ceil down
        return np.ceil(xo).astype(np.int64) if scale < 1 else np.trunc(xo).astype(np.int64)
    if nearest_mode == "round_prefer_floor":
        half = xo == np.trunc(xo).astype(F32) + F32(0.5)
        return np.where(half, np.floor(xo), np.sign(xo) * np.floor(np.abs(xo) + 0.5)).astype(np.int64)
    if nearest_mode == "round_prefer_ceil":
        return (np.sign(xo) * np.floor(np.abs(xo) + 0.5)).astype(np.int64)
    if nearest_mode == "floor":
        return np.floor(xo).astype(np.int64)
    if nearest_mode == "ceil":
        return np.ceil(xo).astype(np.int64)
    raise ValueError(f"nearest_mode {nearest_mode!r}")


def cubic_coeffs(s, a):
    """The four cubic convolution weights of taps -1, 0, 1, 2 at fractional offset ``s``."""
    a = F32(a)
    s = np.abs(s).astype(F32)
    s1, t, t1 = s + F32(1), F32(1) - s, F32(2) - s
    return np.stack([((a * s1 - F32(5) * a) * s1 + F32(8) * a) * s1 - F32(4) * a,
                     ((a + F32(2)) * s - (a + F32(3))) * s * s + F32(1),
                     ((a + F32(2)) * t - (a + F32(3))) * t * t + F32(1),
                     ((a * t1 - F32(5) * a) * t1 + F32(8) * a) * t1 - F32(4) * a], axis=-1)


def _aa_taps(xo, in_len, scale, mode, a, exclude_outside):
    """Antialiased taps: the filter widened by 1/scale, edge-clamped, normalized over all taps."""
    support = 1.0 if mode == "linear" else 2.0
    ss = min(float(scale), 1.0)
    k = int(math.ceil(support / ss)) + 1
    x = xo.astype(np.float64)
    taps = np.floor(x).astype(np.int64)[:, None] + np.arange(-k, k + 1)[None, :]
    d = np.abs((taps - x[:, None]) * ss)
    if mode == "linear":
        w = np.clip(1.0 - d, 0.0, 1.0)
    else:
        a = float(a)
        w = np.where(d <= 1, (a + 2) * d ** 3 - (a + 3) * d ** 2 + 1,
                     np.where(d < 2, a * d ** 3 - 5 * a * d ** 2 + 8 * a * d - 4 * a, 0.0))
    if exclude_outside:
        w = np.where((taps >= 0) & (taps < in_len), w, 0.0)
    tot = w.sum(1, keepdims=True)
    w = w / np.where(tot == 0, 1.0, tot)
    return np.clip(taps, 0, in_len - 1), w.astype(F32)


def axis_taps(in_len, out_len, scale, *, mode, ctm, nearest_mode, cubic_coeff_a, exclude_outside,
              roi_start, roi_end, extrapolate, antialias, simple):
    """(indices (out, taps), weights (out, taps) or None for nearest, out-of-range mask or None)."""
    xo = original_coords(out_len, in_len, scale, ctm, roi_start, roi_end)
    outside = ((xo < 0) | (xo > F32(in_len - 1))) if extrapolate else None
    if outside is not None and not outside.any():
        outside = None
    if mode == "nearest":
        idx = np.clip(_nearest(xo, nearest_mode, scale, simple), 0, in_len - 1)
        return idx[:, None], None, outside
    if antialias and scale < 1:
        idx, w = _aa_taps(xo, in_len, scale, mode, cubic_coeff_a, exclude_outside)
        return idx, w, outside
    if mode == "linear":
        x = np.clip(xo, F32(0), F32(in_len - 1))
        x1 = np.minimum(x.astype(np.int64), in_len - 1)
        x2 = np.minimum(x1 + 1, in_len - 1)
        d1 = np.abs(x - x1.astype(F32))
        d2 = np.abs(x - x2.astype(F32))
        same = x1 == x2
        d1 = np.where(same, F32(0.5), d1)
        d2 = np.where(same, F32(0.5), d2)
        return np.stack([x1, x2], 1), np.stack([d2, d1], 1).astype(F32), outside
    # cubic
    xi = np.floor(xo).astype(np.int64)
    coeffs = cubic_coeffs(xo - xi.astype(F32), cubic_coeff_a)
    taps = xi[:, None] + np.arange(-1, 3)[None, :]
    if exclude_outside:
        inside = (taps >= 0) & (taps < in_len)
        coeffs = np.where(inside, coeffs, F32(0))
        tot = coeffs.sum(1, keepdims=True, dtype=F32)
        coeffs = (coeffs / np.where(tot == 0, F32(1), tot)).astype(F32)
    return np.clip(taps, 0, in_len - 1), coeffs.astype(F32), outside


def _repeats(idx) -> int:
    """r when the nearest taps ``idx`` (out, 1) repeat each input position r times in order (an integer
    upsampling), else 0."""
    n = idx.shape[0]
    r = n // max(int(idx[-1, 0]) + 1, 1)
    return r if r > 1 and n % r == 0 and np.array_equal(idx[:, 0], np.arange(n) // r) else 0


def _apply_axis(x, axis, idx, w):
    out, taps = idx.shape
    r = _repeats(idx) if w is None else 0
    if r and x.shape[axis] * r == out:
        # each input row r times: a broadcast and one copy, not a gather (MLX's CPU take is ~10x slower)
        shape = list(x.shape)
        y = mx.broadcast_to(mx.expand_dims(x, axis + 1), shape[:axis + 1] + [r] + shape[axis + 1:])
        return y.reshape(shape[:axis] + [out] + shape[axis + 1:])
    if w is None:
        return mx.take(x, mx.array(idx.reshape(-1).astype(np.int32)), axis=axis)
    # a gather and a product per tap, added in tap order: elementwise work where a sum over a taps axis between
    # two others is a strided reduction (MLX's CUDA reduction took 1.26 ms for a UNet's 2x linear upsample)
    wshape = [1] * x.ndim
    wshape[axis] = out
    y = None
    for k in range(taps):
        g = mx.take(x, mx.array(idx[:, k].astype(np.int32)), axis=axis)
        t = g * mx.array(w[:, k]).reshape(wshape).astype(g.dtype)
        y = t if y is None else y + t
    return y


def resize_core(X, scales, out_sizes, *, mode, ctm, nearest_mode="round_prefer_floor", cubic_coeff_a=-0.75,
                exclude_outside=0, roi=None, extrapolation_value=0.0, antialias=0, simple=False):
    """Resize X to ``out_sizes`` using per-axis ``scales`` (coordinate math as ORT's CPU kernel)."""
    rank = X.ndim
    if mode != "nearest":
        reason = layout_reason(mode, scales, simple, antialias)
        if reason:
            raise ValueError(reason)
    float_out = X.dtype in (mx.float16, mx.bfloat16, mx.float32)
    x = X.astype(mx.float32) if mode != "nearest" and X.dtype != mx.float32 else X
    extrapolate = ctm == "tf_crop_and_resize"
    outside_any = None
    for ax in range(rank):
        n, o, sc = X.shape[ax], out_sizes[ax], scales[ax]
        if o == n and sc == 1.0:
            continue                                 # ORT leaves scale-1 axes untouched (even a crop roi)
        rs = float(roi[ax]) if roi is not None else 0.0
        re = float(roi[ax + rank]) if roi is not None else 1.0
        if n == 0 or o == 0:
            shape = list(x.shape)
            shape[ax] = o
            x = mx.zeros(shape, x.dtype)
            continue
        idx, w, outside = axis_taps(n, o, sc, mode=mode, ctm=ctm, nearest_mode=nearest_mode,
                                    cubic_coeff_a=cubic_coeff_a, exclude_outside=exclude_outside,
                                    roi_start=rs, roi_end=re, extrapolate=extrapolate, antialias=antialias,
                                    simple=simple)
        x = _apply_axis(x, ax, idx, w)
        if outside is not None:
            m = mx.array(outside).reshape([-1 if i == ax else 1 for i in range(rank)])
            outside_any = m if outside_any is None else mx.logical_or(outside_any, m)
    if outside_any is not None:
        x = mx.where(outside_any, mx.array(extrapolation_value, x.dtype), x)
    if not float_out or x.dtype != X.dtype:
        x = x.astype(X.dtype)
    return x


def _vec(a):
    return None if a is None or np.asarray(a).size == 0 else np.asarray(a).reshape(-1)


def resize_plan(in_shape, scales, sizes, axes=None, policy="stretch"):
    """(float32 scale per axis, output size per axis) from the scales or sizes input."""
    rank = len(in_shape)
    axes = list(range(rank)) if axes is None else [int(a) % rank for a in axes]
    sc = [1.0] * rank
    out = list(in_shape)
    if scales is not None:
        if len(scales) != len(axes):
            raise ValueError(f"{len(scales)} scales for {len(axes)} axes")
        for a, s in zip(axes, scales.astype(F32)):
            if not s > 0:
                raise ValueError(f"scale {s} must be positive")
            sc[a] = F32(s)
            out[a] = int(F32(in_shape[a]) * F32(s))
        return sc, out
    if sizes is None:
        raise ValueError("one of scales and sizes must be given")
    if len(sizes) != len(axes):
        raise ValueError(f"{len(sizes)} sizes for {len(axes)} axes")
    sizes = [int(v) for v in sizes]
    if policy == "stretch":
        for a, o in zip(axes, sizes):
            out[a] = o
            sc[a] = F32(o) / F32(in_shape[a]) if in_shape[a] else F32(1)
        return sc, out
    ratios = [F32(o) / F32(in_shape[a]) for a, o in zip(axes, sizes)]
    r = min(ratios) if policy == "not_larger" else max(ratios)
    for a in axes:
        sc[a] = F32(r)
        out[a] = int(np.floor(F32(r) * F32(in_shape[a]) + F32(0.5)))
    return sc, out


# ------------------------------------------------------------------ Resize
def _resize_check(view, simple=False):
    mode = _s(view.attrs.get("mode", "nearest"))
    if mode not in MODES or (simple and mode not in ("nearest", "linear")):
        return f"mode {mode!r}"
    t = view.dtype(0)
    if t not in RESIZE_TYPES:
        return f"input dtype {dt.name(t)}"
    if mode != "nearest" and t not in RESIZE_FLOATS:
        return f"{mode} resize of {dt.name(t)} (ORT rounds integer interpolation its own way)"
    ctm = _s(view.attrs.get("coordinate_transformation_mode", "half_pixel"))
    if ctm not in CTMS:
        return f"coordinate_transformation_mode {ctm!r}"
    nm = _s(view.attrs.get("nearest_mode", "round_prefer_floor"))
    if nm not in NEAREST_MODES:
        return f"nearest_mode {nm!r}"
    if mode == "nearest" and ctm == "half_pixel_symmetric":
        # ORT's float rounding of this coordinate differs from the spec formula's by 1 ulp at ties,
        # which flips the chosen pixel: nothing exact to reproduce
        return "nearest with half_pixel_symmetric (ORT's coordinate rounding at ties is not reproducible)"
    pol = _s(view.attrs.get("keep_aspect_ratio_policy", "stretch"))
    if pol not in POLICIES:
        return f"keep_aspect_ratio_policy {pol!r}"
    if mode != "nearest":
        return _ort_interp_layout(view, mode, simple)
    return None


def _const_scales(view, simple):
    """Per-axis scales known at claim time (constant scales, or constant sizes and a static shape)."""
    shape = view.shape(0)
    if shape is None:
        return None
    rank = len(shape)
    axes = view.attrs.get("axes")
    axes = list(range(rank)) if axes is None else [int(a) % rank for a in axes]
    sc = view.const(1) if simple else view.const(2)
    if "scales" in view.attrs:                               # Upsample-7: an attribute
        sc = np.asarray(view.attrs["scales"], F32)
    if sc is not None and sc.size:
        full = [1.0] * rank
        for a, v in zip(axes, sc.reshape(-1)):
            full[a] = float(v)
        return full
    sz = None if simple else view.const(3)
    if sz is None or not all(isinstance(d, int) and d > 0 for d in shape):
        return None
    pol = _s(view.attrs.get("keep_aspect_ratio_policy", "stretch"))
    return [float(v) for v in resize_plan(shape, None, sz.reshape(-1), axes, pol)[0]]


def _ort_interp_layout(view, mode, simple):
    """ORT's CPU kernel runs linear/cubic only on some layouts; refuse the rest (nothing to verify against)."""
    s = _const_scales(view, simple)
    if s is None:
        return None                  # scales arrive at run time: resize_core checks the layout then
    return layout_reason(mode, s, simple, view.attrs.get("antialias", 0))


def layout_reason(mode, s, simple, antialias):
    """Why ORT's CPU kernel rejects a linear/cubic resize with per-axis scales ``s`` (None: it runs it)."""
    r = len(s)
    if (mode == "linear" and r in (2, 3)) or (mode == "cubic" and r == 2):
        return None
    ok = False
    if r == 4:
        outer = s[0] == 1 and s[1] == 1
        outer_inner = s[0] == 1 and s[3] == 1
        if mode == "linear":
            ok = outer or (outer_inner and not simple)
        else:
            ok = outer or (outer_inner and (antialias or all(v >= 1 for v in s)))
    elif r == 5 and mode == "linear" and not simple:
        ok = s[0] == 1 and s[1] == 1
    if not ok:
        return f"{mode} resize with scales {[float(v) for v in s]}: a layout ORT's CPU kernel rejects"
    return None


@register("Resize", 10, dtypes=RESIZE_TYPES, const=(1,), check=lambda v: _resize_check(v, simple=True))
def resize_10(X, scales, *, mode="nearest"):
    """Opset 10: asymmetric coordinates; nearest truncates when upsampling, ceils when downsampling."""
    sc, out = resize_plan(X.shape, _vec(scales), None)
    return resize_core(X, sc, out, mode=_s(mode), ctm="asymmetric", simple=True)


@register("Resize", 11, dtypes=RESIZE_TYPES, const=(1, 2, 3), check=_resize_check)
def resize_11(X, roi=None, scales=None, sizes=None, *, coordinate_transformation_mode="half_pixel",
              cubic_coeff_a=-0.75, exclude_outside=0, extrapolation_value=0.0, mode="nearest",
              nearest_mode="round_prefer_floor"):
    """Resize with scales or sizes; roi is read for tf_crop_and_resize only."""
    sc, out = resize_plan(X.shape, _vec(scales), _vec(sizes))
    return resize_core(X, sc, out, mode=_s(mode), ctm=_s(coordinate_transformation_mode),
                       nearest_mode=_s(nearest_mode), cubic_coeff_a=cubic_coeff_a, exclude_outside=exclude_outside,
                       roi=_vec(roi), extrapolation_value=extrapolation_value)


@register("Resize", 18, dtypes=RESIZE_TYPES, const=(1, 2, 3), check=_resize_check)
def resize_18(X, roi=None, scales=None, sizes=None, *, antialias=0, axes=None,
              coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75, exclude_outside=0,
              extrapolation_value=0.0, keep_aspect_ratio_policy="stretch", mode="nearest",
              nearest_mode="round_prefer_floor"):
    """Opset 18+: antialias, axes, keep_aspect_ratio_policy (19 adds half_pixel_symmetric)."""
    rank = X.ndim
    sc, out = resize_plan(X.shape, _vec(scales), _vec(sizes), axes, _s(keep_aspect_ratio_policy))
    r = _vec(roi)
    if r is not None and axes is not None:
        full = np.array([0.0] * rank + [1.0] * rank, F32)
        ax = [int(a) % rank for a in axes]
        for k, a in enumerate(ax):
            full[a], full[a + rank] = r[k], r[k + len(ax)]
        r = full
    return resize_core(X, sc, out, mode=_s(mode), ctm=_s(coordinate_transformation_mode),
                       nearest_mode=_s(nearest_mode), cubic_coeff_a=cubic_coeff_a, exclude_outside=exclude_outside,
                       roi=r, extrapolation_value=extrapolation_value, antialias=antialias)


# ------------------------------------------------------------------ Upsample (deprecated)
@register("Upsample", 7, dtypes=RESIZE_TYPES, check=lambda v: _resize_check(v, simple=True))
def upsample_7(X, *, scales, mode="nearest"):
    sc, out = resize_plan(X.shape, np.asarray(scales, F32), None)
    return resize_core(X, sc, out, mode=_s(mode), ctm="asymmetric", simple=True)


@register("Upsample", 9, dtypes=RESIZE_TYPES, const=(1,), check=lambda v: _resize_check(v, simple=True))
def upsample_9(X, scales, *, mode="nearest"):
    sc, out = resize_plan(X.shape, _vec(scales), None)
    return resize_core(X, sc, out, mode=_s(mode), ctm="asymmetric", simple=True)


# ------------------------------------------------------------------ GridSample
GS_TYPES = frozenset({dt.FLOAT, dt.FLOAT16, dt.BFLOAT16, dt.DOUBLE})
GS_MODES = {"bilinear": "linear", "linear": "linear", "nearest": "nearest", "bicubic": "cubic", "cubic": "cubic"}
GS_PADS = ("zeros", "border", "reflection")


def _gs_check(view, opset16=False):
    mode = _s(view.attrs.get("mode", "bilinear" if opset16 else "linear"))
    if mode not in GS_MODES or (opset16 and mode not in ("bilinear", "nearest", "bicubic")) or \
            (not opset16 and mode not in ("linear", "nearest", "cubic")):
        return f"mode {mode!r}"
    pad = _s(view.attrs.get("padding_mode", "zeros"))
    if pad not in GS_PADS:
        return f"padding_mode {pad!r}"
    r = view.rank(0)
    if r is None or r not in ((4,) if opset16 else (4, 5)):
        return f"input rank {r}"
    if GS_MODES[mode] == "cubic" and r != 4:
        return "cubic GridSample of a 5-D input (ORT's CPU kernel runs cubic 4-D only)"
    if view.dtype(1) != view.dtype(0):
        return f"grid is {dt.name(view.dtype(1))}, X is {dt.name(view.dtype(0))}"
    return None


def _gs_reflect(x, lo, hi):
    """Reflect coordinates into [lo, hi] (ORT's GsReflect, elementwise)."""
    rng = hi - lo
    if rng == 0:
        return mx.zeros_like(x) + lo
    below = x < lo
    dx = mx.where(below, lo - x, x - hi)
    n = mx.floor(dx / rng)
    r = dx - n * rng
    even = mx.remainder(n, 2) == 0
    lo_a, hi_a = mx.array(lo, x.dtype), mx.array(hi, x.dtype)
    refl = mx.where(below, mx.where(even, lo_a + r, hi_a - r), mx.where(even, hi_a - r, lo_a + r))
    return mx.where((x < lo) | (x > hi), refl, x)


def _gs_cubic_coeffs(t, a=-0.75):
    """Cubic convolution weights of taps -1, 0, 1, 2 at fractional offset t (elementwise)."""
    x1 = t + 1
    x2 = 1 - t
    x3 = 2 - t
    w0 = ((a * x1 - 5 * a) * x1 + 8 * a) * x1 - 4 * a
    w1 = ((a + 2) * t - (a + 3)) * t * t + 1
    w2 = ((a + 2) * x2 - (a + 3)) * x2 * x2 + 1
    w3 = ((a * x3 - 5 * a) * x3 + 8 * a) * x3 - 4 * a
    return [w0, w1, w2, w3]


def grid_sample_core(X, grid, *, mode, padding_mode, align_corners):
    """Sample X (N, C, *S) at grid (N, *O, k) (last axis x, y[, z]: innermost spatial axis first)."""
    n, c = X.shape[:2]
    sizes = X.shape[2:]
    k = len(sizes)
    if grid.shape[0] != n or grid.shape[-1] != k or grid.ndim != k + 2:
        raise ValueError(f"grid shape {grid.shape} does not fit input {X.shape}")
    out_sp = grid.shape[1:-1]
    npts = math.prod(out_sp)
    if n == 0 or c == 0 or npts == 0 or math.prod(sizes) == 0:
        return mx.zeros((n, c, *out_sp), X.dtype)
    ct = mx.float64 if X.dtype == mx.float64 else mx.float32
    g = grid.astype(ct).reshape(n, npts, k)
    xf = X.astype(ct).reshape(n, c, math.prod(sizes))
    coords, bounds = [], []
    for i, L in enumerate(sizes):                  # i over spatial axes (outermost first)
        gi = g[:, :, k - 1 - i]
        if align_corners:
            x = (gi + 1) / 2 * (L - 1)
            bounds.append((0.0, float(L - 1)))
        else:
            x = ((gi + 1) * L - 1) / 2
            bounds.append((-0.5, L - 0.5))
        if mode != "cubic":
            if padding_mode == "border":
                x = mx.clip(x, 0, L - 1)
            elif padding_mode == "reflection":
                x = _gs_reflect(x, *bounds[-1])
        coords.append(x)

    def tap_index(ints):
        """Flat index of integer coordinates (one per axis) and a validity mask (zeros padding)."""
        flat, valid = None, None
        for i, (p, L) in enumerate(zip(ints, sizes)):
            if padding_mode == "zeros":
                ok = (p >= 0) & (p <= L - 1)
                valid = ok if valid is None else valid & ok
                p = mx.clip(p, 0, L - 1)
            elif padding_mode == "border":
                p = mx.clip(p, 0, L - 1)
            else:
                p = mx.clip(_gs_reflect(p.astype(ct), *bounds[i]).astype(mx.int32), 0, L - 1)
            stride = math.prod(sizes[i + 1:])
            term = p.astype(mx.int32) * stride
            flat = term if flat is None else flat + term
        return flat, valid

    def gather(flat, valid):
        idx = mx.broadcast_to(flat[:, None, :], (n, c, npts))
        v = mx.take_along_axis(xf, idx, axis=2)
        if valid is not None:
            v = mx.where(valid[:, None, :], v, mx.zeros_like(v))
        return v

    if mode == "nearest":
        ints = [mx.round(x).astype(mx.int32) for x in coords]     # round half to even (nearbyint)
        y = gather(*tap_index(ints))
    elif mode == "linear":
        lows = [mx.floor(x) for x in coords]
        fr = [x - lo for x, lo in zip(coords, lows)]
        y = None
        for corner in range(2 ** k):
            ints, w = [], None
            for i in range(k):
                bit = (corner >> (k - 1 - i)) & 1
                ints.append(lows[i].astype(mx.int32) + bit)
                wi = fr[i] if bit else 1 - fr[i]
                w = wi if w is None else w * wi
            term = gather(*tap_index(ints)) * w[:, None, :]
            y = term if y is None else y + term
    else:
        lows = [mx.floor(x) for x in coords]
        ws = [_gs_cubic_coeffs(x - lo) for x, lo in zip(coords, lows)]
        y = None
        for a in range(4):
            row = None
            for b in range(4):
                ints = [lows[0].astype(mx.int32) + (a - 1), lows[1].astype(mx.int32) + (b - 1)]
                term = gather(*tap_index(ints)) * ws[1][b][:, None, :]
                row = term if row is None else row + term
            term = row * ws[0][a][:, None, :]
            y = term if y is None else y + term
    return y.reshape(n, c, *out_sp).astype(X.dtype)


@register("GridSample", 16, dtypes=GS_TYPES, check=lambda v: _gs_check(v, opset16=True))
def grid_sample_16(X, grid, *, align_corners=0, mode="bilinear", padding_mode="zeros"):
    """Opset 16: 4-D input; modes bilinear / nearest / bicubic."""
    return grid_sample_core(X, grid, mode=GS_MODES[_s(mode)], padding_mode=_s(padding_mode),
                            align_corners=align_corners)


@register("GridSample", 20, dtypes=GS_TYPES, check=_gs_check)
def grid_sample_20(X, grid, *, align_corners=0, mode="linear", padding_mode="zeros"):
    """Opset 20+: N-D (4-D / 5-D) input; modes linear / nearest / cubic."""
    return grid_sample_core(X, grid, mode=GS_MODES[_s(mode)], padding_mode=_s(padding_mode),
                            align_corners=align_corners)


# ------------------------------------------------------------------ AffineGrid
def _affine_check(view):
    if view.dtype(0) not in (dt.FLOAT, dt.FLOAT16, dt.BFLOAT16, dt.DOUBLE):
        return f"theta is {dt.name(view.dtype(0))}"
    return None


@register("AffineGrid", 20, dtypes=GS_TYPES, const=(1,), check=_affine_check)
def affine_grid(theta, size, *, align_corners=0):
    """Sampling grid (N, *spatial, k) of the affine maps theta (N, k, k+1) over ``size``."""
    size = [int(v) for v in np.asarray(size).reshape(-1)]
    k = len(size) - 2
    if k not in (2, 3) or theta.shape[1:] != (k, k + 1) or theta.shape[0] != size[0]:
        raise ValueError(f"theta shape {theta.shape} does not fit size {size}")
    ct = mx.float64 if theta.dtype == mx.float64 else mx.float32
    axes = []
    for L in size[2:]:
        if align_corners:
            base = np.linspace(-1.0, 1.0, L) if L > 1 else np.ones(1)   # L == 1: +1, as ORT does
        else:
            base = (np.arange(L, dtype=np.float64) * 2 + 1) / L - 1
        axes.append(base)
    mesh = np.meshgrid(*axes, indexing="ij")                  # outermost spatial axis first
    pts = np.stack([m.reshape(-1) for m in reversed(mesh)] + [np.ones(mesh[0].size)], axis=1)   # x, y[, z], 1
    p = mx.array(pts.astype(np.float64 if ct == mx.float64 else np.float32), dtype=ct)
    out = mx.matmul(p[None], theta.astype(ct).swapaxes(1, 2))   # (N, P, k)
    return out.reshape(size[0], *size[2:], k).astype(theta.dtype)
