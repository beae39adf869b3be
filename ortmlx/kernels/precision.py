"""Numerical-precision probes of the MLX device, run once per process and device.

MLX may run float32 matrix products at reduced (TF32) precision on some GPUs
(``MLX_ENABLE_TF32``, on by default in MLX; ``import ortmlx`` turns it off unless the
user set it). Every float32 MatMul/Gemm/Conv/attention the EP claims must match ORT's
CPU EP, so the EP measures instead of trusting the flag.
"""
from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

#: float32 products accumulate to ~1e-6 relative; TF32 (10-bit mantissa) to ~1e-3
FP32_TOLERANCE = 1e-5


@functools.lru_cache(maxsize=None)
def fp32_matmul_error(device: str) -> float:
    """Max relative error of a 256x256x256 float32 matmul on ``device`` against float64 numpy."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 256)).astype(np.float32)
    b = rng.standard_normal((256, 256)).astype(np.float32)
    with mx.stream(mx.gpu if device == "gpu" else mx.cpu):
        got = np.array(mx.matmul(mx.array(a), mx.array(b)))
    want = a.astype(np.float64) @ b.astype(np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def fp32_matmul_exact(device: str) -> bool:
    return fp32_matmul_error(device) <= FP32_TOLERANCE
