"""Signal windows: HannWindow, HammingWindow, BlackmanWindow (opset 17).

``size`` is a host scalar; the window is a generalized cosine sum evaluated on the host in
float64 and rounded once to float32/float16. float64 outputs are refused (ORT's CPU EP
computes them from float32 coefficients: ~1e-8 off the float64 value, we cannot match
bit for bit), and so are integer outputs (truncation near an integer could differ).
DFT, STFT and MelWeightMatrix are not implemented (they stay on the CPU EP).
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ..registry import register

OUT_TYPES = frozenset({dt.FLOAT, dt.FLOAT16})


def _check(view):
    t = view.attrs.get("output_datatype", dt.FLOAT)
    if t not in OUT_TYPES:
        return f"output_datatype {dt.name(t)} is not float32/float16"
    return None


def cosine_window(size, coeffs, periodic: int) -> np.ndarray:
    """sum_k (-1)^k a_k cos(2 pi k n / D), D = size (periodic) or size - 1 (symmetric), in float64."""
    n = int(np.asarray(size).reshape(-1)[0])
    if n < 0:
        raise ValueError(f"window size {n} < 0")
    d = n if periodic else n - 1
    if n and d <= 0:
        raise ValueError(f"symmetric window of size {n} divides by zero")
    i = np.arange(n, dtype=np.float64)
    w = np.zeros(n)
    for k, a in enumerate(coeffs):
        w += (-1) ** k * a * np.cos(2 * math.pi * k * i / d)
    return w


def _window(size, coeffs, periodic, output_datatype):
    w = cosine_window(size, coeffs, periodic).astype(dt.NUMPY[output_datatype])
    return mx.array(w, dtype=dt.MLX[output_datatype])


@register("HannWindow", 17, const=(0,), check=_check)
def hann_window(size, *, output_datatype=1, periodic=1):
    """0.5 - 0.5 cos(2 pi n / D)."""
    return _window(size, (0.5, 0.5), periodic, output_datatype)


@register("HammingWindow", 17, const=(0,), check=_check)
def hamming_window(size, *, output_datatype=1, periodic=1):
    """25/46 - 21/46 cos(2 pi n / D)."""
    return _window(size, (25 / 46, 21 / 46), periodic, output_datatype)


@register("BlackmanWindow", 17, const=(0,), check=_check)
def blackman_window(size, *, output_datatype=1, periodic=1):
    """0.42 - 0.5 cos(2 pi n / D) + 0.08 cos(4 pi n / D)."""
    return _window(size, (0.42, 0.5, 0.08), periodic, output_datatype)
