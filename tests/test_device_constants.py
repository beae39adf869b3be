"""Constants copied into device memory once (``dtypes.device_copies``): bit for bit the originals."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ortmlx.kernels import dtypes as dt

RNG = np.random.default_rng(0)


def _bits(a: mx.array) -> bytes:
    if a.dtype in (mx.bool_, mx.bfloat16):
        a = a.view(mx.uint8 if a.dtype == mx.bool_ else mx.uint16)
    return np.array(a).tobytes()


CASES = {
    "float16": lambda: mx.array(RNG.standard_normal((300, 300)).astype(np.float16)),
    "bool": lambda: mx.array(RNG.random(80000) < 0.5),
    "nan payloads and -0.0": lambda: mx.array(
        (np.array([np.nan, -0.0, 1.0] * 30000, np.float32).view(np.uint32) | 0x1234).view(np.float32)),
    "bfloat16 bits": lambda: mx.array(np.arange(70000, dtype=np.uint16)).view(mx.bfloat16),
    "int64": lambda: mx.array(RNG.integers(-2**62, 2**62, 20000)),
    "int8": lambda: mx.array(RNG.integers(-128, 128, 70000).astype(np.int8)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_copies_are_bit_exact(case):
    a = CASES[case]()
    mx.eval(a)
    want = _bits(a)
    got = dt.device_copies({"x": a})["x"]
    assert got is not a                       # large: copied
    assert got.dtype == a.dtype and got.shape == a.shape and _bits(got) == want


def test_small_arrays_are_left_alone():
    small = {"s": mx.array(np.float32(-0.0)), "v": mx.arange(10)}
    out = dt.device_copies(small)
    assert all(out[k] is small[k] for k in small)
