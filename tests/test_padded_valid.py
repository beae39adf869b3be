"""A padded prompt's valid length is its own ``seqlens_k`` input's: two GroupQueryAttention nodes over different
``seqlens_k`` each zero their presents past their own length, and the tail gather (``gather_padded_tail``), which
cannot tell which length is the prompt's, refuses to trace (the group then runs eager) instead of guessing."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ortmlx.compiled import decode_ops as D
from ortmlx.kernels import build

S, P, N, KVN, H = 8, 8, 2, 1, 4          # a bucket of 8 rows, a shared buffer of 8


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((1, S, N * H)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, S, KVN * H)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, S, KVN * H)).astype(np.float32))
    past = mx.zeros((1, KVN, P, H), mx.float32)
    return q, k, v, past


def _gqa(inputs, seqlens_k):
    q, k, v, past = inputs
    gqa = D.gqa_traced(False, padded=True)
    return gqa(q, k, v, past, past, seqlens_k, mx.array([S], mx.int32), num_heads=N, kv_num_heads=KVN)


def _ctx():
    return build.BuildContext(guards=[], hints=[])


def test_each_node_keeps_its_own_valid_length():
    a, b = _inputs(0), _inputs(1)
    sk_a, sk_b = mx.array([2], mx.int32), mx.array([5], mx.int32)      # valid lengths 3 and 6
    with build.active(_ctx()):
        _, pk_a, _ = _gqa(a, sk_a)
        _, pk_b, pv_b = _gqa(b, sk_b)
        mx.eval(pk_a, pk_b, pv_b)
    with build.active(_ctx()):                          # node b alone in its build
        _, alone_k, alone_v = _gqa(b, sk_b)
        mx.eval(alone_k, alone_v)
    rows = np.abs(np.asarray(pk_b)).sum(axis=(0, 1, 3))
    assert (rows[:6] > 0).all() and (rows[6:] == 0).all(), rows
    np.testing.assert_array_equal(np.asarray(pk_b), np.asarray(alone_k))
    np.testing.assert_array_equal(np.asarray(pv_b), np.asarray(alone_v))
    rows_a = np.abs(np.asarray(pk_a)).sum(axis=(0, 1, 3))
    assert (rows_a[:3] > 0).all() and (rows_a[3:] == 0).all(), rows_a


def test_tail_gather_refuses_two_lengths_and_reads_one():
    hidden = mx.array(np.arange(S * 3, dtype=np.float32).reshape(1, S, 3))
    tail = D.gather_padded_tail(-1)
    sks = mx.array([2], mx.int32), mx.array([5], mx.int32)     # alive to the build's end, as group inputs are
    with build.active(_ctx()):
        _gqa(_inputs(0), sks[0])
        _gqa(_inputs(1), sks[1])
        with pytest.raises(D.Untraceable, match="different seqlens_k"):
            tail(hidden, mx.array(-1), axis=1)
    sk = mx.array([4], mx.int32)                        # two layers over one seqlens_k: one length, row 4
    with build.active(_ctx()):
        _gqa(_inputs(0), sk)
        _gqa(_inputs(1), sk)
        got = tail(hidden, mx.array(-1), axis=1)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(hidden)[:, 4])


def test_tail_gather_of_one_row_is_a_take(monkeypatch):
    """Batch 1 (genai's prompt): the tail row through ``take_rows`` along the sequence axis (its contract standing
    in; on a GPU MLX's gather would be a JIT kernel built alone on a new host), where the build may use it."""
    from ortmlx.kernels import cuda_kernels
    calls = []
    monkeypatch.setattr(cuda_kernels, "cuda_backend", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(cuda_kernels, "take_rows", lambda d, i, a=0: calls.append((d.shape, i.shape, a))
                        or mx.take(d, mx.clip(i, 0, d.shape[a] - 1), axis=a))
    hidden = mx.array(np.arange(S * 3, dtype=np.float16).reshape(1, S, 3))
    for on in (True, False):
        calls.clear()
        with mx.stream(mx.cpu), build.active(build.BuildContext(guards=[], hints=[], cuda_kernels=True, take_rows=on)):
            D._note_padded_valid(mx.array([5], mx.int32))     # as the padded GroupQueryAttention records it
            got = D.gather_padded_tail(-1)(hidden, mx.array(-1), axis=1)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(hidden)[:, 4])
        assert calls == ([((1, S, 3), (1,), 1)] if on else []), calls
