"""A first prompt's attention (``contrib_attention.prompt_attention``): MLX's fused kernel only from
``fused_attention_min`` tokens (shorter new lengths cost cuDNN a graph build each on a GPU), its plain causal form
only where no kept query row lies past its row's length, and every form equal to a float64 reference of ORT's
semantics. The fused kernel runs on MLX's CPU backend too (as MLX's own fallback), so this runs anywhere."""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

import ortmlx.compiled as C
from ortmlx.kernels import build
from ortmlx.kernels.ops import contrib_attention as ca
from ortmlx.kernels.passes import FUSED_ATTENTION_MIN, BuildConfig
from ortmlx.testing import make_model, session
from ortmlx.tuning import Tuning, TuningError

RNG = np.random.default_rng(11)
N, KVN, H = 4, 2, 16


def reference(q, k, v, total, alpha, window=-1):
    """float64 attention of (B,N,S,H) q over (B,Nkv,S,H) k, v: query s sees keys t <= s, t < total[b] (and
    t > s - window); the result (B,S,N*H)."""
    b, n, s, h = q.shape
    g = n // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    sc = np.einsum("bnsh,bnth->bnst", q, kk) * alpha
    pos = np.arange(s)
    m = (pos[None, :] <= pos[:, None])[None, None] & (pos.reshape(1, 1, 1, s) < total.reshape(b, 1, 1, 1))
    if window > 0:
        m = m & (pos[None, :] > pos[:, None] - window)
    sc = np.where(m, sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnst,bnth->bnsh", p, vv).transpose(0, 2, 1, 3).reshape(b, s, n * h)


@pytest.fixture
def masks(monkeypatch):
    """The mask argument of every call of MLX's fused attention: "causal" or "array"."""
    seen, real = [], mx.fast.scaled_dot_product_attention

    def spy(q, k, v, *, scale, mask=None, sinks=None):
        seen.append(mask if isinstance(mask, str) else "array")
        return real(q, k, v, scale=scale, mask=mask, sinks=sinks)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    return seen


def inputs(b, s):
    q = RNG.standard_normal((b, N, s, H)).astype(np.float16)
    k = RNG.standard_normal((b, KVN, s, H)).astype(np.float16)
    v = RNG.standard_normal((b, KVN, s, H)).astype(np.float16)
    return q, k, v


def attend(q, k, v, total, *, fused=True, minimum=1, causal=False, window=-1, sink=None):
    mq, mk, mv = mx.array(q), mx.array(k), mx.array(v)
    tl = mx.array(np.asarray(total, np.int32))
    with build.active(build.BuildContext(fused_attention=fused, fused_attention_min=minimum)):
        out = ca.prompt_attention(mq, mk, mv, mq.astype(mx.float32), tl - 1, mx.zeros(tl.shape, mx.int32), tl,
                                  alpha=H ** -0.5, softcap=0.0, local_window_size=window, sink=sink,
                                  attention_bias=None, causal=causal)
    return np.array(out.astype(mx.float32))


def close(got, want, rows=None):
    """fp16 inputs, float32 (ops) or float32-softmax (fused) arithmetic: within a few fp16 roundings."""
    if rows is not None:
        got, want = got[:, :rows], want[:, :rows]
    np.testing.assert_allclose(got, want, atol=4e-3, rtol=4e-3)


def test_the_fused_kernel_only_from_the_least_bucket(masks):
    q, k, v = inputs(1, 12)
    want = reference(*(x.astype(np.float64) for x in (q, k, v)), np.array([12]), H ** -0.5)
    close(attend(q, k, v, [12], minimum=32, causal=True), want)
    assert masks == []
    close(attend(q, k, v, [12], minimum=16, causal=True), want)       # 12 rounds up to 16
    assert masks == ["causal"]
    close(attend(q, k, v, [12], fused=False, causal=True), want)
    assert masks == ["causal"]
    with build.active(build.BuildContext(fused_attention=True, fused_attention_min=256)):
        assert build.fused_attention(129) and build.fused_attention(256) and not build.fused_attention(128)
    assert not build.fused_attention(10 ** 6)       # outside a build


@pytest.mark.parametrize("knob", ["32", "200", "256", "1000", "4096"])
def test_a_prompt_and_its_bucket_take_the_same_form(knob):
    """A bucket's closure is verified against the eager answer at the prompt's own length: both must take the same
    attention form, or fp16 cuDNN arithmetic is compared with float32 ops (on an H100 that poisoned the 256 bucket
    for a 151-token prompt when the rule compared lengths as they are)."""
    from ortmlx.compiled.attention import bucket_for
    ctx = BuildConfig.for_device("gpu", Tuning.parse(f"fused_attention_min={knob}")).context()
    assert ctx.fused_attention_min >= int(knob)
    with build.active(ctx):
        for cap in (4104, 1 << 20):
            for length in range(2, 4105):
                b = bucket_for(length, cap)
                assert build.fused_attention(length) == build.fused_attention(b), (knob, cap, length, b)
        assert build.fused_attention(4096) and not build.fused_attention(16)


def test_the_least_bucket_stays_under_the_fused_form(monkeypatch):
    """``least_bucket``: 256 where our prompt kernel serves short prompts on MLX's CUDA backend, 16 elsewhere (a GPU
    of another backend too), a ``bucket_min`` as asked, and never a bucket of the fused form for a prompt shorter
    than it, whose eager answer (at its own length) takes the unfused one, nor one past the prompt kernel's lengths."""
    from ortmlx.compiled.attention import least_bucket
    from ortmlx.kernels import cuda_kernels
    cpu = BuildConfig.for_device("cpu", Tuning())
    gpu = BuildConfig.for_device("gpu", Tuning())
    monkeypatch.setattr(cuda_kernels, "cuda_backend", lambda: False)
    assert least_bucket(gpu, Tuning()) == 16                    # (Metal)
    monkeypatch.setattr(cuda_kernels, "cuda_backend", lambda: True)
    cuda = dataclasses.replace(gpu, cuda_kernels=True, prompt_kernel=True, fused_attention=True,
                               fused_attention_min=512)
    assert least_bucket(cpu, Tuning()) == 16
    assert least_bucket(cuda, Tuning()) == 256
    assert least_bucket(dataclasses.replace(cuda, prompt_kernel=False), Tuning()) == 16
    assert least_bucket(cpu, Tuning.parse("bucket_min=64")) == 64
    assert least_bucket(cpu, Tuning.parse("bucket_min=100")) == 128
    unfused = dataclasses.replace(cuda, fused_attention=False)
    assert least_bucket(unfused, Tuning.parse("bucket_min=4096")) == cuda_kernels.PROMPT_MAX
    for fmin in (32, 64, 256, 512):
        c = dataclasses.replace(cuda, fused_attention_min=fmin)
        for want in ("16", "256", "4096"):
            least = least_bucket(c, Tuning.parse(f"bucket_min={want}"))
            assert least >= 16 and (least < fmin or least == 16), (fmin, want, least)


@pytest.mark.parametrize("causal,window,form", [(False, -1, "array"), (True, -1, "causal"), (True, 5, "array"),
                                                (True, 12, "causal")])
def test_each_form_is_ort_s_on_the_rows_kept(masks, causal, window, form):
    """Row 1 is 9 of 12 tokens long: with ``causal`` its rows 9-11 are the caller's to drop, so only rows
    below each row's length are compared there; without it every row is ORT's (keys t < 9 for rows 9-11)."""
    q, k, v = inputs(2, 12)
    total = np.array([12, 9])
    want = reference(*(x.astype(np.float64) for x in (q, k, v)), total, H ** -0.5, window)
    got = attend(q, k, v, total, causal=causal, window=window)
    assert masks == [form]
    close(got[:1], want[:1])
    close(got[1:], want[1:], rows=9 if causal else None)
    close(attend(q, k, v, total, fused=False, window=window), want)


def test_an_eager_causal_prompt_runs_at_its_buckets_length(monkeypatch):
    """MLX builds a cuDNN graph per shape: an eager prompt's causal fused attention runs padded to the power of two
    its bucket traces (its own rows the same as unpadded), a trace at its own length."""
    seen, real = [], mx.fast.scaled_dot_product_attention

    def spy(q, k, v, *, scale, mask=None, sinks=None):
        seen.append((q.shape[2], k.shape[2], mask if isinstance(mask, str) else "array"))
        return real(q, k, v, scale=scale, mask=mask, sinks=sinks)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    for s, p in ((40, 64), (64, 64), (2, 2)):
        q, k, v = inputs(2, s)
        total = np.array([s, s])
        want = reference(*(x.astype(np.float64) for x in (q, k, v)), total, H ** -0.5)
        seen.clear()
        close(attend(q, k, v, total, causal=True), want)
        assert seen == [(p, p, "causal")], (s, seen)
    mq, mk, mv = (mx.array(x) for x in inputs(1, 40))
    tl = mx.array(np.array([40], np.int32))
    seen.clear()
    with build.active(build.BuildContext(fused_attention=True, fused_attention_min=1, tracing=True)):
        ca.prompt_attention(mq, mk, mv, mq.astype(mx.float32), tl - 1, mx.zeros((1,), mx.int32), tl,
                            alpha=H ** -0.5, softcap=0.0, local_window_size=-1, sink=None, attention_bias=None,
                            causal=True)
    assert seen == [(40, 40, "causal")]


def test_sinks_keep_the_mask_array(masks):
    """With a sink the fused kernel is given the mask array even where the rows are full (the form GPUs ran)."""
    q, k, v = inputs(1, 12)
    sink = mx.array(RNG.standard_normal(N).astype(np.float32))
    fused = attend(q, k, v, [12], causal=True, sink=sink)
    assert masks == ["array"]
    close(fused, attend(q, k, v, [12], fused=False, causal=True, sink=sink))


def gqa(q, k, v, total, minimum=1):
    """The eager GroupQueryAttention translator over a first prompt, fused from ``minimum`` tokens."""
    b, s = q.shape[:2]
    with build.active(build.BuildContext(fused_attention=True, fused_attention_min=minimum)):
        out = ca.group_query_attention(mx.array(q), mx.array(k), mx.array(v), None, None,
                                       mx.array(np.asarray(total, np.int32) - 1), np.array(s, np.int32),
                                       num_heads=N, kv_num_heads=KVN)
    return np.array(out[0].astype(mx.float32))


def test_the_eager_translator_takes_the_causal_form_only_when_every_row_is_full(masks):
    b, s = 2, 10
    q = RNG.standard_normal((b, s, N * H)).astype(np.float16)
    k = RNG.standard_normal((b, s, KVN * H)).astype(np.float16)
    v = RNG.standard_normal((b, s, KVN * H)).astype(np.float16)

    def ref(total):
        heads = [x.reshape(b, s, -1, H).transpose(0, 2, 1, 3).astype(np.float64) for x in (q, k, v)]
        return reference(*heads, np.asarray(total), H ** -0.5)
    close(gqa(q, k, v, [s, s]), ref([s, s]))
    close(gqa(q, k, v, [s, 7]), ref([s, 7]))        # every row, rows 7-9 of the short one included
    close(gqa(q, k, v, [s, s], minimum=32), ref([s, s]))            # 10 rounds up to 16
    assert masks == ["causal", "array"]


def test_the_least_length_by_device_and_tuning(monkeypatch):
    from ortmlx.kernels import cuda_kernels
    from ortmlx.kernels.passes import CUDA_FUSED_ATTENTION_MIN
    assert FUSED_ATTENTION_MIN == 256 and CUDA_FUSED_ATTENTION_MIN == 512
    for cuda, want in ((False, FUSED_ATTENTION_MIN), (True, CUDA_FUSED_ATTENTION_MIN)):
        monkeypatch.setattr(cuda_kernels, "cuda_backend", lambda cuda=cuda: cuda)
        assert BuildConfig.for_device("gpu").fused_attention
        assert BuildConfig.for_device("gpu").context().fused_attention_min == want
        # without our kernel (or the custom kernels) the shorter buckets would take MLX ops: cuDNN from 256
        for knob in ("prompt_kernel=0", "cuda_kernels=0"):
            assert BuildConfig.for_device("gpu", Tuning.parse(knob)).context().fused_attention_min == \
                FUSED_ATTENTION_MIN
    monkeypatch.undo()
    assert not BuildConfig.for_device("cpu").fused_attention
    for knob, got in (("64", 64), ("100", 128), ("1", 32)):
        t = Tuning.parse(f"fused_attention_min={knob}")
        assert BuildConfig.for_device("gpu", t).context().fused_attention_min == got
    with pytest.raises(TuningError, match="fused_attention_min"):
        Tuning.parse("fused_attention_min=0")


def prompt_model(s, p=32):
    """One GroupQueryAttention over a first prompt of ``s`` tokens into a ``p``-row KV buffer (fp16, genai's
    shared-buffer layout): the exact-length prefill."""
    f = T.FLOAT16
    node = helper.make_node("GroupQueryAttention", ["query", "key", "value", "past_key", "past_value", "seqlens_k",
                                                    "total_sequence_length"],
                            ["output", "present_key", "present_value"], domain="com.microsoft",
                            num_heads=N, kv_num_heads=KVN)
    ins = [("query", f, [1, s, N * H]), ("key", f, [1, s, KVN * H]), ("value", f, [1, s, KVN * H]),
           ("past_key", f, [1, KVN, p, H]), ("past_value", f, [1, KVN, p, H]),
           ("seqlens_k", T.INT32, [1]), ("total_sequence_length", T.INT32, [])]
    outs = [("output", f, None), ("present_key", f, None), ("present_value", f, None)]
    return make_model([node], ins, outs, extra_opsets={"com.microsoft": 1})


def test_a_traced_lone_prompt_is_causal_only_while_its_row_is_full(masks):
    """A batch-1 prompt's trace takes the causal form under a guard that its row is full: a call at the same
    shape whose row is shorter answers eagerly (rows past its length as ORT: keys t < length), not from the
    causal trace (which lets those rows see later keys)."""
    s = 20
    m = prompt_model(s)
    opts = {"tuning": "fused_attention=1,fused_attention_min=32,build_behind=0"}
    with C.capture() as rs:
        sess = session(m, options=opts)
    q = RNG.standard_normal((1, s, N * H)).astype(np.float16)
    k = RNG.standard_normal((1, s, KVN * H)).astype(np.float16)
    v = RNG.standard_normal((1, s, KVN * H)).astype(np.float16)
    heads = [x.reshape(1, s, -1, H).transpose(0, 2, 1, 3).astype(np.float64) for x in (q, k, v)]

    def run(length):
        past = np.zeros((1, KVN, 32, H), np.float16)
        return sess.run(None, {"query": q, "key": k, "value": v, "past_key": past, "past_value": past,
                               "seqlens_k": np.array([length - 1], np.int32),
                               "total_sequence_length": np.array(s, np.int32)})[0].astype(np.float32)
    for _ in range(3):          # eager, then traced and verified, then replayed
        close(run(s), reference(*heads, np.array([s]), H ** -0.5))
    parts = [p for r in rs for p in (r.parts() if hasattr(r, "parts") else [r])]
    (p,) = [p for p in parts if p.trace_counts()]
    assert p.counters["compiled_calls"] >= 1 and "causal" in masks, (p.counters, masks)
    close(run(15), reference(*heads, np.array([15]), H ** -0.5))
    assert p.counters["guard_fails"] == 1 and p.counters["poisoned_closures"] == 0, p.counters
