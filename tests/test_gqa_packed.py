"""``gqa_core(packed=True)`` (query and key heads rotated together, one gather and one fused kernel)
computes what the split form does, bit for bit: the same operations on every element."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ortmlx.kernels.ops.contrib_attention import gqa_core

N, KVN, H, P = 6, 2, 32, 10


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("rotary", ["none", "half", "full", "interleaved"])
@pytest.mark.parametrize("s,first", [(1, False), (3, False), (4, True)])
def test_packed_equals_split(dtype, rotary, s, first):
    rng = np.random.default_rng(0)
    qkv = mx.array(rng.standard_normal((1, s, (N + 2 * KVN) * H)).astype(np.float32)).astype(dtype)
    past = [mx.array(rng.standard_normal((1, KVN, P, H)).astype(np.float32)).astype(dtype) for _ in range(2)]
    seqlens = mx.array([s - 1 if first else 5], mx.int32)
    kw = dict(total_sequence_length=s if first else P, num_heads=N, kv_num_heads=KVN, first_prompt=first)
    if rotary != "none":
        half = H // 4 if rotary == "half" else H // 2
        ang = np.outer(np.arange(16), 1.0 / 10000 ** (np.arange(half) / half))
        kw.update(cos_cache=mx.array(np.cos(ang).astype(np.float32)).astype(dtype),
                  sin_cache=mx.array(np.sin(ang).astype(np.float32)).astype(dtype),
                  rotary_interleaved=rotary == "interleaved")
    x = qkv.reshape(1, s, N + 2 * KVN, H)
    q = x[:, :, :N].reshape(1, s, N * H)
    k = x[:, :, N:N + KVN].reshape(1, s, KVN * H)
    v = x[:, :, N + KVN:].reshape(1, s, KVN * H)
    want = gqa_core(q, k, v, past[0], past[1], seqlens, **kw)
    got = gqa_core(x, None, None, past[0], past[1], seqlens, packed=True, **kw)
    flat = gqa_core(qkv, None, None, past[0], past[1], seqlens, packed=True, **kw)     # the (B,S,(N+2Nkv)*H) form
    assert len(got) == len(want) == len(flat) == 3
    for g, f, w, name in zip(got, flat, want, ("output", "present_key", "present_value")):
        assert g.shape == w.shape == f.shape and g.dtype == w.dtype == f.dtype, name
        assert np.array(g).tobytes() == np.array(w).tobytes() == np.array(f).tobytes(), name    # bits (-0.0 too)
