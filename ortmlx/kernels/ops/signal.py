"""Signal ops: DFT (opset 17 and 20), STFT and the windows HannWindow, HammingWindow, BlackmanWindow.

DFT runs mx.fft on complex64 (float32 only: MLX has no complex128); dft_length and (20+) axis
are host values. onesided keeps the first n // 2 + 1 bins; inverse divides by n.
inverse with onesided (a real inverse from half a spectrum) is refused.

Windows: 
``size`` is a host scalar; the window is a generalized cosine sum evaluated on the host in
float64 and rounded once to float32/float16. float64 outputs are refused (ORT's CPU EP
computes them from float32 coefficients: ~1e-8 off the float64 value, we cannot match
bit for bit), and so are integer outputs (truncation near an integer could differ).
STFT frames the signal (frame_step, frame_length host values), applies the window and runs
the DFT of each frame.

MelWeightMatrix is built on the host with the arithmetic of ORT's CPU kernel (facts of its
source): range checks in float32, mel edges in float64 through libm log10/pow (Python's math,
the same libm), bin edges floored, weights as integer ratios divided in the output type. An edge
whose floor depends on whether ORT's build fuses ``low + step * i`` into one FMA raises.
"""
from __future__ import annotations

import math
from fractions import Fraction

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


# ------------------------------------------------------------------ DFT
def _dft_check(view):
    if view.attrs.get("inverse", 0) and view.attrs.get("onesided", 0):
        return "inverse with onesided (real inverse of half a spectrum) is not implemented"
    s = view.shape(0)
    if s is not None and (len(s) < 2 or s[-1] not in (1, 2)):
        return f"input shape {tuple(s)} does not end in a real (1) or complex (2) dimension"
    if s is not None and view.attrs.get("onesided", 0) and s[-1] != 1:
        return "onesided DFT of a complex input"
    return None


def _dft(x, n, axis: int, inverse: int, onesided: int):
    """DFT of x (..., 1 | 2) along ``axis`` (which may not be the last, complex, dimension)."""
    r = x.ndim
    if not -r <= axis < r - 1 or axis == -1:
        raise ValueError(f"axis {axis} out of range for input rank {r} (the last dimension holds real/imag)")
    a = axis % r
    c = x[..., 0].astype(mx.complex64)
    if x.shape[-1] == 2:
        c = c + 1j * x[..., 1].astype(mx.complex64)
    length = c.shape[a] if n is None else int(np.asarray(n).reshape(-1)[0])
    if length < 1:
        raise ValueError(f"dft_length {length} < 1")
    y = mx.fft.ifft(c, n=length, axis=a) if inverse else mx.fft.fft(c, n=length, axis=a)
    if onesided:
        y = y[tuple(slice(0, length // 2 + 1) if k == a else slice(None) for k in range(y.ndim))]
    return mx.stack([mx.real(y), mx.imag(y)], axis=-1).astype(x.dtype)


@register("DFT", 17, const=(1,), dtypes=frozenset({dt.FLOAT}), check=_dft_check)
def dft_17(input, dft_length=None, *, axis=1, inverse=0, onesided=0):
    """Complex DFT along ``axis`` (attribute)."""
    return _dft(input, dft_length, axis, inverse, onesided)


@register("DFT", 20, const=(1, 2), dtypes=frozenset({dt.FLOAT}), check=_dft_check)
def dft_20(input, dft_length=None, axis=None, *, inverse=0, onesided=0):
    """Complex DFT along ``axis`` (input, default -2)."""
    a = -2 if axis is None else int(np.asarray(axis).reshape(-1)[0])
    return _dft(input, dft_length, a, inverse, onesided)


# ------------------------------------------------------------------ STFT
def _stft_check(view):
    s = view.shape(0)
    if s is not None and (len(s) != 3 or s[-1] not in (1, 2)):
        return f"signal shape {tuple(s)} is not (batch, length, 1 | 2)"
    if s is not None and view.attrs.get("onesided", 1) and s[-1] != 1:
        return "onesided STFT of a complex signal"
    if view.has(2) and view.dtype(2) != dt.FLOAT:
        return f"window dtype {dt.name(view.dtype(2))} is not float32"
    return None


@register("STFT", 17, const=(1, 3), dtypes=frozenset({dt.FLOAT}), check=_stft_check)
def stft(signal, frame_step, window=None, frame_length=None, *, onesided=1):
    """(batch, frames, bins, 2): DFT of each windowed frame of length frame_length (or the window's)."""
    step = int(np.asarray(frame_step).reshape(-1)[0])
    if frame_length is not None:
        n = int(np.asarray(frame_length).reshape(-1)[0])
        if window is not None and window.shape[0] != n:
            raise ValueError(f"window length {window.shape[0]} != frame_length {n}")
    elif window is not None:
        n = window.shape[0]
    else:
        raise ValueError("STFT needs a window or a frame_length")
    length = signal.shape[1]
    if step < 1 or n < 1 or n > length:
        raise ValueError(f"frame_step {step} / frame length {n} invalid for a signal of length {length}")
    frames = 1 + (length - n) // step
    idx = (np.arange(frames)[:, None] * step + np.arange(n)[None, :]).astype(np.int32)
    x = mx.take(signal, mx.array(idx.reshape(-1)), axis=1).reshape(signal.shape[0], frames, n, signal.shape[2])
    if window is not None:
        x = x * window.reshape(1, 1, n, 1)
    return _dft(x, None, 2, 0, onesided)


# ---------------------------------------------------------------- MelWeightMatrix
#: ORT's CPU kernel output types (MLX holds all; float64 only on the CPU device, by the generic rule)
MEL_OUT = frozenset({dt.FLOAT, dt.DOUBLE, dt.INT8, dt.INT16, dt.INT32, dt.INT64, dt.UINT8, dt.UINT16, dt.UINT32,
                     dt.UINT64})


def _mel_check(view):
    t = view.attrs.get("output_datatype", dt.FLOAT)
    if t not in MEL_OUT:
        return f"output_datatype {dt.name(t)} has no ORT CPU kernel to verify against"
    if view.dtype(3) != dt.FLOAT or view.dtype(4) != dt.FLOAT:
        return "lower/upper_edge_hertz must be float32 (ORT's CPU kernel)"
    return None


def _scalar(v, what: str):
    a = np.asarray(v).reshape(-1)
    if a.size != 1:
        raise ValueError(f"MelWeightMatrix {what} must be a scalar, got shape {np.asarray(v).shape}")
    return a[0]


def _hz(mel: float) -> float:
    return 700 * (math.pow(10, mel / 2595) - 1)


def mel_bin_edges(n: int, dft: int, sr: int, lo: float, hi: float) -> list[int]:
    """The n + 2 FFT-bin edges of the mel triangles, floored like ORT's kernel."""
    low = 2595 * math.log10(1 + lo / 700)
    high = 2595 * math.log10(1 + hi / 700)
    step = (high - low) / float(np.float32(n + 2))
    edges = []
    for i in range(n + 2):
        seen = set()
        for mel in (low + step * i, float(Fraction(low) + Fraction(step) * i)):     # unfused, fused
            seen.add(math.floor(((dft + 1) * _hz(mel)) / sr))
        if len(seen) != 1:
            raise ValueError(f"MelWeightMatrix edge {i} lies on a rounding boundary: ORT's answer depends on "
                             "whether its build fuses the multiply-add")
        edges.append(seen.pop())
    return edges


@register("MelWeightMatrix", 17, const=(0, 1, 2, 3, 4), check=_mel_check)
def mel_weight_matrix(num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz, *,
                      output_datatype=1):
    """[dft_length // 2 + 1, num_mel_bins] triangular filters of peak 1 (ORT's CPU arithmetic)."""
    n, dft, sr = (int(_scalar(v, w)) for v, w in ((num_mel_bins, "num_mel_bins"), (dft_length, "dft_length"),
                                                   (sample_rate, "sample_rate")))
    lo32, hi32 = (np.float32(_scalar(v, w)) for v, w in ((lower_edge_hertz, "lower_edge_hertz"),
                                                         (upper_edge_hertz, "upper_edge_hertz")))
    if n < 0 or dft < 0 or sr <= 0:
        raise ValueError(f"MelWeightMatrix needs num_mel_bins >= 0, dft_length >= 0, sample_rate > 0 "
                         f"(got {n}, {dft}, {sr})")
    n_spec = dft // 2 + 1
    with np.errstate(all="ignore"):                # the range checks, in float32 like the kernel
        for name, e in (("lower", lo32), ("upper", hi32)):
            idx = np.floor(np.float32(dft + 1) * e / np.float32(sr))
            if not (idx >= 0 and idx < np.float32(n_spec)):
                raise ValueError(f"{name}_edge_hertz produces a mel triangle filter bank that is out of range "
                                 "given the dft_length and the sample_rate")
    edges = mel_bin_edges(n, dft, sr, float(lo32), float(hi32))
    if any(b < 0 or b >= n_spec for b in edges) or any(b > c for b, c in zip(edges, edges[1:])):
        raise ValueError(f"MelWeightMatrix bin edges {edges} are not increasing within [0, {n_spec})")
    npt = dt.NUMPY[output_datatype]
    out = np.zeros((n_spec, n), npt)
    flt = np.dtype(npt).kind == "f"
    for i in range(n):
        a, c, b = edges[i], edges[i + 1], edges[i + 2]
        if c == a:
            out[c, i] = 1
        else:
            j = np.arange(a, c + 1)
            out[a:c + 1, i] = ((j - a).astype(npt) / npt(c - a)) if flt else (j - a) // (c - a)
        if b > c:
            j = np.arange(c, b)
            out[c:b, i] = ((b - j).astype(npt) / npt(b - c)) if flt else (b - j) // (b - c)
    return dt.to_mx(out, output_datatype)
