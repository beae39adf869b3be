"""Compare a compiled closure's outputs with eager ones (verify-then-trust).

Floats match when each element is within ``atol + rtol * |eager|`` or within ``srtol`` of the output's scale (the
RMS of its nonzero eager values): compiled code may sum in another order (fused kernels, a padded product's other
BLAS blocking), which moves elements that cancel to near zero by more than their own size, but never by a fraction
of the output's scale the way a wrong closure (a wrong row, a baked shape, a stale value) does. Zeros do not count
towards the scale: a prompt fills 100 rows of a 4,104-row KV buffer, and the empty rows would shrink its RMS 6x.
float16's ``srtol`` is 1e-2: MLX's eager float16 ops round each intermediate where a fused kernel does not; on a
2-layer build a trustworthy prefill closure moved the logits by 4.9e-3 of their RMS (the eager ones differ from
ORT's CPU EP's by 3.6e-2 of it). Deep half-precision graphs drift further (a 24-layer 0.5B prompt closure:
2 to 557 of 525,312 elements of a late layer's KV output beyond 1e-2 of their RMS, the furthest 2.3e-2 of it, the
differences' RMS 4.9e-3 of it, scattered over the rows), so a half output also passes when its furthest element is
within ``_HALF_FAR`` of the scale, no row (along the last axis) differs by more than ``2 * srtol`` of it in RMS, and
the least-squares factor from eager's values to it is within ``srtol / 4`` of 1: a wrong, stale or rescaled row, a
filled empty row, a shifted column or a baked divisor fails one of the three.

Large outputs are compared where they live, with MLX on their device (a few reductions, a handful of scalars read
back): a 2,048-token prompt's float16 logits are 311M elements, 10-29 s through NumPy on two cores.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..kernels import dtypes as dt

#: (rtol, atol, srtol: of the output's scale) per host dtype; integers and bools must match exactly
_TOL = {np.dtype(np.float64): (1e-9, 1e-12, 1e-9), np.dtype(np.float32): (1e-4, 1e-5, 1e-4),
        np.dtype(np.float16): (4e-3, 1e-3, 1e-2)}
_BF16_TOL = (2e-2, 1e-2, 2e-2)
#: how far (of the scale) any element of a half output passing as a whole may be (``_half_close``)
_HALF_FAR = {np.dtype(np.float16): 5e-2, None: 1e-1}          # (None: bfloat16)
#: MLX outputs of at least this many elements are compared on their device (smaller ones: on the host)
DEVICE_MIN = 1 << 16
#: elements per step of the device comparison (its float32 temporaries)
CHUNK = 1 << 24
#: the float types compared on the device, and the host type whose tolerances they take (float64: no GPU kernels)
_DEVICE_FLOATS = {mx.float16: np.dtype(np.float16), mx.float32: np.dtype(np.float32), mx.bfloat16: None}


def mismatch(got: list, want: list, bf16: frozenset[int] = frozenset(), device: "mx.Device | None" = None,
             device_min: int = DEVICE_MIN) -> str | None:
    """Why ``got`` differs from ``want`` (None: equal within the dtype's tolerance).

    Each is an MLX or a host array (numpy; bfloat16 as uint16 bits, listed in ``bf16`` by position). With a
    ``device``, a pair of MLX arrays of ``device_min`` elements or more is compared there.
    """
    if len(got) != len(want):
        return f"{len(got)} outputs, eager has {len(want)}"
    for j, (g, w) in enumerate(zip(got, want)):
        if device is not None and _on_device(g, w, device_min):
            if tuple(g.shape) != tuple(w.shape):
                return f"output {j}: shape {tuple(g.shape)} != eager {tuple(w.shape)}"
            with mx.stream(device):
                why = _device_differ(g, w)
            if why:
                return f"output {j}: {why}"
            continue
        g, w = dt.host(g), dt.host(w)
        if g.shape != w.shape:
            return f"output {j}: shape {g.shape} != eager {w.shape}"
        if g.dtype != w.dtype:
            return f"output {j}: dtype {g.dtype} != eager {w.dtype}"
        why = _values_differ(g, w, j in bf16)
        if why:
            return f"output {j}: {why}"
    return None


def _values_differ(g: np.ndarray, w: np.ndarray, bf16: bool) -> str | None:
    if bf16:
        g, w = _bf16_to_f32(g), _bf16_to_f32(w)
        rtol, atol, srtol = _BF16_TOL
    elif g.dtype.kind == "f":
        rtol, atol, srtol = _TOL.get(g.dtype, _TOL[np.dtype(np.float32)])
    else:
        if np.array_equal(g, w):
            return None
        k = int(np.argmax((g != w).reshape(-1)))
        return f"{int((g != w).sum())} elements differ (first at flat {k}: {g.reshape(-1)[k]!r} vs {w.reshape(-1)[k]!r})"
    gn, wn = np.isnan(g), np.isnan(w)
    if not np.array_equal(gn, wn):
        return "NaN positions differ"
    ok = np.isclose(g, w, rtol=rtol, atol=atol) | gn
    if ok.all():
        return None
    fin = np.isfinite(w) & (w != 0)
    scale = float(np.sqrt(np.mean(np.square(w[fin], dtype=np.float64)))) if fin.any() else 0.0
    with np.errstate(invalid="ignore"):
        d = np.abs(g.astype(np.float64) - w)
        ok |= d <= srtol * scale
    if ok.all():
        return None
    worst = float(np.max(d[~ok]))
    rows = np.square(np.where(np.isfinite(d), d, 0.0)).reshape(-1, w.shape[-1] if w.ndim else 1)
    dev = float(np.sqrt(np.max(np.mean(rows, axis=-1)))) if rows.size else 0.0
    wf = np.where(fin, w, 0).astype(np.float64)
    gf = np.where(fin, g, 0).astype(np.float64)
    factor = float(np.sum(gf * wf) / np.sum(wf * wf)) if fin.any() else 1.0
    far = _HALF_FAR.get(None if bf16 else g.dtype)
    if far is not None and _half_close(worst, dev, factor, far, srtol, scale):
        return None
    k = int(np.argmin(ok.reshape(-1)))
    return (f"{int((~ok).sum())} of {ok.size} elements differ beyond rtol {rtol} atol {atol} of the value and "
            f"{srtol} of the output's nonzero RMS {scale:.3g}, the furthest by {worst / (scale or 1):.2g} of it, "
            f"a row's differences' RMS {dev / (scale or 1):.2g} of it at most, the least-squares factor {factor:.4g} "
            f"(first at flat {k}: {g.reshape(-1)[k]!r} vs {w.reshape(-1)[k]!r})")


def _on_device(g, w, lim: int) -> bool:
    return (isinstance(g, mx.array) and isinstance(w, mx.array) and g.dtype == w.dtype and w.size >= lim
            and (w.dtype in _DEVICE_FLOATS or not mx.issubdtype(w.dtype, mx.inexact)))


def _device_differ(g: mx.array, w: mx.array) -> str | None:
    """``_values_differ`` on the device: the same tests in float32 (float16's own arithmetic rounds more), over
    chunks of ``CHUNK`` elements so float32 temporaries stay small, a few scalars read back per pass."""
    row = w.shape[-1] if w.ndim else 1
    g, w = g.reshape(-1), w.reshape(-1)
    step = max(row, CHUNK // max(row, 1) * row)             # (whole rows to a chunk)
    parts = [(g[i:i + step], w[i:i + step]) for i in range(0, w.size, step)]
    if w.dtype not in _DEVICE_FLOATS:                       # integers and bools: exactly
        n = _total(mx.sum(gc != wc) for gc, wc in parts)
        return None if n == 0 else f"{n} elements differ (first at {_first(g != w, g, w)})"
    npt = _DEVICE_FLOATS[w.dtype]
    rtol, atol, srtol = _BF16_TOL if npt is None else _TOL[npt]

    def f32(gc, wc):
        return gc.astype(mx.float32), wc.astype(mx.float32)

    def close(gc, wc):
        g32, w32 = f32(gc, wc)
        near = mx.abs(g32 - w32) <= atol + rtol * mx.abs(w32)
        return mx.where(mx.isinf(g32) | mx.isinf(w32), g32 == w32, near) | mx.isnan(g32)

    if _total(mx.sum(mx.isnan(gc) != mx.isnan(wc)) for gc, wc in parts):
        return "NaN positions differ"
    if _total(mx.sum(~close(gc, wc)) for gc, wc in parts) == 0:
        return None
    # the scale: RMS of the finite nonzero eager values, each divided by their largest first (float32 squares of
    # large values overflow)
    fins = [(wc.astype(mx.float32), mx.isfinite(wc) & (wc != 0)) for _, wc in parts]
    top = max(_total([mx.max(mx.where(m, mx.abs(w32), 0.0))]) for w32, m in fins)
    unit = top if top > 0 else 1.0
    sq = sum(_sum64(mx.where(m, mx.square(w32 / unit), 0.0)) for w32, m in fins)
    n = _total(mx.sum(m) for _, m in fins)
    rms = top * float(np.sqrt(sq / max(n, 1)))

    def absdiff(gc, wc):
        g32, w32 = f32(gc, wc)
        return mx.abs(g32 - w32)

    def bad(gc, wc):
        return ~(close(gc, wc) | (absdiff(gc, wc) <= srtol * rms))

    nb = _total(mx.sum(bad(gc, wc)) for gc, wc in parts)
    if nb == 0:
        return None

    def finite_diff(gc, wc):
        d = absdiff(gc, wc)
        return mx.where(mx.isfinite(d), d, 0.0)

    worst = max(_total([mx.max(mx.where(bad(gc, wc), absdiff(gc, wc), 0.0))]) for gc, wc in parts)
    dev = unit * float(np.sqrt(max(
        _total([mx.max(mx.mean(mx.square(finite_diff(gc, wc) / unit).reshape(-1, row), axis=-1))])
        for gc, wc in parts)))

    def cross(gc, m, w32):
        return _sum64(mx.where(m, gc.astype(mx.float32) / unit * (w32 / unit), 0.0))
    factor = sum(cross(gc, m, w32) for (gc, _), (w32, m) in zip(parts, fins)) / sq if sq > 0 else 1.0
    far = _HALF_FAR.get(npt)
    if far is not None and _half_close(worst, dev, factor, far, srtol, rms):
        return None
    first = next(i * step + _first(bad(gc, wc), gc, wc, at_only=True) for i, (gc, wc) in enumerate(parts)
                 if mx.any(bad(gc, wc)).item())
    return (f"{nb} of {w.size} elements differ beyond rtol {rtol} atol {atol} of the value and "
            f"{srtol} of the output's nonzero RMS {rms:.3g}, the furthest by {worst / (rms or 1):.2g} of it, "
            f"a row's differences' RMS {dev / (rms or 1):.2g} of it at most, the least-squares factor {factor:.4g} "
            f"(first at flat {first}: {_scalar(g, first)!r} vs {_scalar(w, first)!r})")


def _half_close(worst: float, dev: float, factor: float, far: float, srtol: float, scale: float) -> bool:
    """Whether a half output is close to eager's as a whole: its furthest element within ``far`` of the scale, every
    row's differences' RMS (``dev``: the largest) within ``2 * srtol`` of it, and the least-squares factor from
    eager's to it within ``srtol / 4`` of 1."""
    return worst <= far * scale and dev <= 2 * srtol * scale and abs(factor - 1.0) <= srtol / 4


def _total(sums) -> float:
    """The sum of lazily made MLX scalars, evaluated together, as a Python number."""
    sums = list(sums)
    mx.eval(*sums)
    return sum(s.item() for s in sums)


def _sum64(x: mx.array) -> float:
    """A float32 array's sum with float32 rounding over 4,096 elements at most (a long float32 running sum drifts:
    1.6% over 311M squares on MLX's CPU backend), the partial sums added in float64."""
    n = x.size // 4096 * 4096
    parts = [mx.sum(x[:n].reshape(-1, 4096), axis=-1)] if n else []
    if n < x.size:
        parts.append(mx.sum(x[n:], keepdims=True))
    mx.eval(*parts)
    return float(sum(np.asarray(p, np.float64).sum() for p in parts))


def _first(flags: mx.array, g: mx.array, w: mx.array, at_only: bool = False):
    """The first flagged flat index (``at_only``), or ``"flat K: g vs w"``."""
    k = mx.argmax(flags).item()
    return k if at_only else f"flat {k}: {_scalar(g, k)!r} vs {_scalar(w, k)!r}"


def _scalar(a: mx.array, k: int):
    v = a[k]
    return np.float16(v.item()) if a.dtype == mx.float16 else (np.float32(v.item()) if a.dtype == mx.float32
                                                              else v.item())


def _bf16_to_f32(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32)
