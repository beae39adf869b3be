"""The custom CUDA kernels (``ortmlx/kernels/cuda_kernels.py``).

Decode attention: its contract is written out here in NumPy (float64). On MLX's CUDA backend the
kernel is checked against that and, inside ``gqa_core``, against ``gqa_core``'s own float32 path
evaluated on the CPU; everywhere (CI), ``gqa_core`` with the NumPy contract standing in for the
kernel is checked against its own path (the wiring: which heads, lengths, window, sink). The byte
gather against ``concatenate``, and a GroupQueryAttention decode through the EP against ORT's CPU
EP with the kernel seen in use, run only where MLX has a CUDA GPU (the benchmark host)."""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

from ortmlx.kernels import consts, cuda_kernels
from ortmlx.kernels.ops.contrib_attention import gqa_core, softmax_sink
from ortmlx.testing import assert_close, make_model, session

CUDA = cuda_kernels.cuda_backend()
gpu_only = pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")


def reference_decode_attention(q, k, v, past_len, total_len, *, num_heads, kv_num_heads, alpha, softcap=0.0,
                               local_window_size=-1, sink=None):
    """``cuda_kernels.decode_attention``'s contract in float64 NumPy: (B, num_heads, H) in q's type."""
    qn = np.array(q.astype(mx.float32), np.float64)[:, :num_heads, 0]          # (B, N, H)
    kn, vn = (np.array(a.astype(mx.float32), np.float64) for a in (k, v))        # (B, Nkv, T, H)
    pl, tl = np.array(past_len), np.array(total_len)
    b, n, h = qn.shape
    group = num_heads // kv_num_heads
    out = np.zeros((b, n, h))
    t = np.arange(kn.shape[2])
    sk = None if sink is None else np.array(sink.astype(mx.float32), np.float64)
    for i in range(b):
        vis = (t <= pl[i]) & (t < tl[i])
        if local_window_size > 0:
            vis &= t > pl[i] - local_window_size
        for j in range(n):
            sc = kn[i, j // group] @ qn[i, j] * alpha
            if softcap > 0:
                sc = softcap * np.tanh(sc / softcap)
            sc = np.where(vis, sc, -np.inf)
            top = sc.max() if sk is None else max(sc.max(), sk[j])
            e = np.exp(sc - top)
            den = e.sum() + (0.0 if sk is None else math.exp(sk[j] - top))
            out[i, j] = (e / den) @ vn[i, j // group]
    return mx.array(out.astype(np.float32)).astype(q.dtype)


# name: (B, N, Nkv, H, P, seqlens, dtype, extra gqa_core keywords)
CASES = {
    "fp16 qwen 0.5b shape": (1, 14, 2, 64, 160, [37], mx.float16, {}),
    "fp16 qwen 1.5b shape": (1, 12, 2, 128, 300, [299], mx.float16, {}),
    "bf16 two rows": (2, 8, 2, 64, 50, [3, 41], mx.bfloat16, {}),
    "fp32 head 80": (2, 6, 3, 80, 33, [0, 32], mx.float32, {}),
    "fp32 one key": (1, 4, 4, 32, 1, [0], mx.float32, {}),
    "fp16 window": (2, 8, 4, 64, 90, [70, 5], mx.float16, {"local_window_size": 16}),
    "fp32 softcap": (1, 8, 2, 64, 40, [20], mx.float32, {"softcap": 5.0}),
    "fp16 smooth softmax": (1, 8, 2, 64, 40, [30], mx.float16, {"smooth_softmax": 1}),
    "fp32 head sink": (1, 8, 2, 64, 40, [12], mx.float32, {"head_sink": True}),
    "fp16 scale": (1, 8, 2, 64, 64, [63], mx.float16, {"scale": 0.3}),
    "fp16 head 256": (1, 4, 1, 256, 70, [50], mx.float16, {}),
}


def _gqa(case: str, packed: bool, rotary: bool, first: bool, fused: bool):
    b, n, kvn, h, p, seqlens, dtype, extra = CASES[case]
    rng = np.random.default_rng(len(case))
    extra = dict(extra)
    sink = None
    if extra.pop("head_sink", False):
        sink = mx.array(rng.standard_normal(n).astype(np.float32))
    sink = softmax_sink(sink, extra.pop("smooth_softmax", -1), n)

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    qkv = arr(b, 1, n + 2 * kvn, h)
    past = [arr(b, kvn, p, h), arr(b, kvn, p, h)]
    sl = mx.array([0] * b if first else seqlens, mx.int32)
    kw = dict(total_sequence_length=1 if first else p, num_heads=n, kv_num_heads=kvn, first_prompt=first,
              sink=sink, in_place=not first, **extra)
    if rotary:
        half = h // 2
        ang = np.outer(np.arange(max(p, 2)), 1.0 / 10000 ** (np.arange(half) / half))
        kw.update(cos_cache=mx.array(np.cos(ang).astype(np.float32)).astype(dtype),
                  sin_cache=mx.array(np.sin(ang).astype(np.float32)).astype(dtype))
    if packed:
        args = (qkv, None, None)
    else:
        args = (qkv[:, :, :n].reshape(b, 1, n * h), qkv[:, :, n:n + kvn].reshape(b, 1, kvn * h),
                qkv[:, :, n + kvn:].reshape(b, 1, kvn * h))
    dev = mx.gpu if fused and CUDA else mx.cpu
    with mx.stream(dev), consts.build_scope(cuda_kernels=fused):
        out = gqa_core(*args, past[0], past[1], sl, packed=packed, **kw)
        mx.eval(*out)
    return [np.array(o.astype(mx.float32)) if o.dtype == mx.bfloat16 else np.array(o) for o in out]


VARIANTS = pytest.mark.parametrize("packed,rotary,first", [(True, True, False), (False, False, False),
                                                            (True, False, True)],
                                   ids=["packed-rotary", "split", "first-prompt"])


def _check_output(case: str, got, want) -> None:
    """float32 math in both, summed in another order; one rounding to the output type."""
    dtype = CASES[case][6]
    tol = {mx.float32: 2e-5, mx.float16: 2 ** -10, mx.bfloat16: 2 ** -7}[dtype]
    err = np.abs(got.astype(np.float64) - want) / (np.abs(want) + 0.05)
    assert err.max() <= 1.01 * tol, f"{case}: attention output off by {err.max():.3g} (relative)"


@pytest.mark.parametrize("case", sorted(CASES))
@VARIANTS
def test_gqa_core_wiring_with_the_contract(case, packed, rotary, first, monkeypatch):
    """Everywhere: ``gqa_core`` handing its decode row to the kernel's contract (NumPy) gives its own answer."""
    calls = []
    monkeypatch.setattr(cuda_kernels, "cuda_backend", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(cuda_kernels, "decode_attention",
                        lambda *a, **k: calls.append(1) or reference_decode_attention(*a, **k))
    with mx.stream(mx.cpu):
        got = _gqa(case, packed, rotary, first, fused=True)
    assert calls == [1], "the decode row did not go to the kernel"
    monkeypatch.undo()
    want = _gqa(case, packed, rotary, first, fused=False)
    for j, (g, w) in enumerate(zip(got, want)):
        if j > 0:
            np.testing.assert_array_equal(g, w, err_msg=f"{case}: output {j}")
    _check_output(case, got[0], want[0])


@gpu_only
@pytest.mark.parametrize("case", sorted(CASES))
@VARIANTS
def test_decode_attention_matches_mlx_ops(case, packed, rotary, first, monkeypatch):
    calls = []
    real = cuda_kernels.decode_attention

    def spy(*a, **k):
        calls.append(1)
        got = real(*a, **k)
        _check_output(case, np.array(got.astype(mx.float32)), np.array(reference_decode_attention(*a, **k)
                                                                       .astype(mx.float32)))
        return got
    monkeypatch.setattr(cuda_kernels, "decode_attention", spy)
    got = _gqa(case, packed, rotary, first, fused=True)
    assert calls, "the fused kernel was not used"
    want = _gqa(case, packed, rotary, first, fused=False)
    for j, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (j, g.shape, w.shape)
        if j > 0:                       # presents and new rows: the same ops on both devices
            np.testing.assert_array_equal(g, w, err_msg=f"{case}: output {j}")
    _check_output(case, got[0], want[0])


@gpu_only
@pytest.mark.parametrize("sizes", [[48], [2, 4, 6, 1], [128] * 48 + [4]])
def test_gather_bytes_equals_concatenate(sizes):
    rng = np.random.default_rng(len(sizes))
    dtypes = [mx.float16, mx.int32, mx.bfloat16, mx.float32, mx.uint8]
    parts = [mx.array(rng.integers(0, 255, n).astype(np.uint8)).view(mx.uint8) if i % 5 == 4 else
             mx.array(rng.standard_normal(n).astype(np.float32)).astype(dtypes[i % 5]) for i, n in enumerate(sizes)]
    with mx.stream(mx.gpu):
        got = cuda_kernels.gather_bytes(parts)
        want = mx.concatenate([p.reshape(-1).view(mx.uint8) for p in parts])
        mx.eval(got, want)
    assert got.dtype == mx.uint8 and got.shape == want.shape
    assert np.array(got).tobytes() == np.array(want).tobytes()


def _decode_model(t, n=8, kvn=2, h=64, p=24):
    nodes = [helper.make_node("GroupQueryAttention", ["qkv", "", "", "past_key", "past_value", "seqlens_k",
                                                      "total_sequence_length", "cos", "sin"],
                              ["out", "present_key", "present_value"], domain="com.microsoft",
                              num_heads=n, kv_num_heads=kvn, do_rotary=1)]
    ang = np.outer(np.arange(p), 1.0 / 10000 ** (np.arange(h // 2) / (h // 2)))
    npt = {T.FLOAT16: np.float16, T.FLOAT: np.float32}[t]
    inits = {"cos": np.cos(ang).astype(npt), "sin": np.sin(ang).astype(npt)}
    ins = [("qkv", t, ["batch_size", "sequence_length", (n + 2 * kvn) * h]),
           ("past_key", t, ["batch_size", kvn, "past_sequence_length", h]),
           ("past_value", t, ["batch_size", kvn, "past_sequence_length", h]),
           ("seqlens_k", T.INT32, ["batch_size"]), ("total_sequence_length", T.INT32, [])]
    outs = [("out", t, None), ("present_key", t, None), ("present_value", t, None)]
    return make_model(nodes, ins, outs, initializers=inits, extra_opsets={"com.microsoft": 1}), npt, n, kvn, h, p


@gpu_only
@pytest.mark.parametrize("t", [T.FLOAT16, T.FLOAT], ids=["fp16", "fp32"])
def test_ep_decode_matches_cpu_ep(t, monkeypatch):
    """Decode steps (S == 1 into a fixed-length buffer, as genai's shared buffer) through the EP on the
    GPU, compiled and eager, against the CPU EP: the fused kernel runs and the answers agree."""
    calls = []
    real = cuda_kernels.decode_attention
    monkeypatch.setattr(cuda_kernels, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    m, npt, n, kvn, h, p = _decode_model(t)
    rng = np.random.default_rng(7)
    mlx = session(m, options={"device": "gpu"})
    eager = session(m, options={"device": "gpu", "no_compile": "1"})
    cpu = session(m, "CPUExecutionProvider", record=False)
    for pos in range(3, 12):
        past = rng.standard_normal((2, 1, kvn, p, h)).astype(npt)
        past[:, :, :, pos:] = 0
        feeds = {"qkv": rng.standard_normal((1, 1, (n + 2 * kvn) * h)).astype(npt), "past_key": past[0],
                 "past_value": past[1], "seqlens_k": np.array([pos], np.int32),
                 "total_sequence_length": np.array(pos + 1, np.int32)}
        want = cpu.run(None, feeds)
        for name, sess in (("compiled", mlx), ("eager", eager)):
            got = sess.run(None, feeds)
            tol = dict(rtol=2e-2, atol=2e-3) if t == T.FLOAT16 else dict(rtol=1e-4, atol=1e-5)
            assert_close(got[0], want[0], what=f"{name} pos {pos} output", **tol)
            for j in (1, 2):        # the new key row is rotated: GPU and CPU round it apart by an ulp at most
                assert_close(got[j][:, :, :pos + 1], want[j][:, :, :pos + 1], what=f"{name} pos {pos} present {j}",
                             **(dict(rtol=1e-3, atol=0) if t == T.FLOAT16 else dict(rtol=3e-7, atol=1e-7)))
    assert len(calls) >= 9, f"fused kernel used {len(calls)} times"
