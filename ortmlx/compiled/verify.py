"""Compare a compiled closure's outputs with eager ones (verify-then-trust).

Floats match when each element is within ``atol + rtol * |eager|`` or within ``srtol`` of the output's scale (the
RMS of its nonzero eager values): compiled code may sum in another order (fused kernels, a padded product's other
BLAS blocking), which moves elements that cancel to near zero by more than their own size, but never by a fraction
of the output's scale the way a wrong closure (a wrong row, a baked shape, a stale value) does. Zeros do not count
towards the scale: a prompt fills 100 rows of a 4,104-row KV buffer, and the empty rows would shrink its RMS 6x.
float16's ``srtol`` is 1e-2: MLX's eager float16 ops round each intermediate where a fused kernel does not; on a
2-layer build a trustworthy prefill closure moved the logits by 4.9e-3 of their RMS (the eager ones differ from
ORT's CPU EP's by 3.6e-2 of it).
"""
from __future__ import annotations

import numpy as np

#: (rtol, atol, srtol: of the output's scale) per host dtype; integers and bools must match exactly
_TOL = {np.dtype(np.float64): (1e-9, 1e-12, 1e-9), np.dtype(np.float32): (1e-4, 1e-5, 1e-4),
        np.dtype(np.float16): (4e-3, 1e-3, 1e-2)}
_BF16_TOL = (2e-2, 1e-2, 2e-2)


def mismatch(got: list, want: list, bf16: frozenset[int] = frozenset()) -> str | None:
    """Why ``got`` differs from ``want`` (None: equal within the dtype's tolerance).

    Both are host arrays (numpy; bfloat16 as uint16 bits, listed in ``bf16`` by position).
    """
    if len(got) != len(want):
        return f"{len(got)} outputs, eager has {len(want)}"
    for j, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
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
    if not ok.all():
        fin = np.isfinite(w) & (w != 0)
        scale = float(np.sqrt(np.mean(np.square(w[fin], dtype=np.float64)))) if fin.any() else 0.0
        with np.errstate(invalid="ignore"):
            ok |= np.abs(g.astype(np.float64) - w) <= srtol * scale
    if ok.all():
        return None
    k = int(np.argmin(ok.reshape(-1)))
    return (f"{int((~ok).sum())} of {ok.size} elements differ beyond rtol {rtol} atol {atol} of the value and "
            f"{srtol} of the output's nonzero RMS {scale:.3g} "
            f"(first at flat {k}: {g.reshape(-1)[k]!r} vs {w.reshape(-1)[k]!r})")


def _bf16_to_f32(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32)
