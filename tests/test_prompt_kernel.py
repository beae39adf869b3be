"""A first prompt's attention as one custom CUDA kernel (``cuda_kernels.prompt_attention``).

Its contract is written out here in float64 NumPy. Everywhere (CI) the translators run with the contract standing
in for the kernel: which prompts reach it (not those MLX's fused kernel takes, not with an attention bias, not
with the knob off) and with what (heads, lengths, window, sink, softcap), against the float32 ops it replaces. On
MLX's CUDA backend the kernel itself is checked against the contract, on the strided views the packed QKV gives."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ortmlx.kernels import build, cuda_kernels
from ortmlx.kernels.ops import contrib_attention as ca
from test_cuda_kernels import reference_decode_attention

CUDA = cuda_kernels.cuda_backend()
gpu_only = pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")
RNG = np.random.default_rng(5)


def reference_prompt_attention(q, k, v, total_len, *, alpha, softcap=0.0, local_window_size=-1, sink=None,
                               drop_past=False):
    """``cuda_kernels.prompt_attention``'s contract in float64: each query row s is the decode kernel's contract at
    past length s over the prompt's keys (``drop_past``: zero at s >= total_len[b]); (B, S, N * H) in q's type."""
    b, n, s, h = q.shape
    rows = [reference_decode_attention(q[:, :, r:r + 1], k, v, mx.full((b,), r, mx.int32), total_len, num_heads=n,
                                       kv_num_heads=k.shape[1], alpha=alpha, softcap=softcap,
                                       local_window_size=local_window_size, sink=sink) for r in range(s)]
    out = mx.stack(rows, axis=1)
    if drop_past:
        out = mx.where(mx.arange(s).reshape(1, s, 1, 1) < total_len.reshape(b, 1, 1, 1), out, mx.zeros((), q.dtype))
    return out.reshape(b, s, n * h)


def _packed(b, s, n, kvn, h, dtype):
    """q, k, v as the packed QKV's translator makes them: q and k slices of one rotated array, v a transposed view
    of the QKV rows (none of them copied to a contiguous array)."""
    qkv = mx.array((RNG.standard_normal((b, s, n + 2 * kvn, h))).astype(np.float32)).astype(dtype)
    x = qkv.transpose(0, 2, 1, 3)
    qk = x[:, :n + kvn] * 1.0            # the rotation's output: a new array
    return qk[:, :n], qk[:, n:], x[:, n + kvn:]


CASES = {
    # (B, S, N, Nkv, H, total lengths, window, softcap, sink)
    "qwen-shaped": (1, 37, 14, 2, 64, [37], -1, 0.0, False),
    "padded-rows": (2, 16, 4, 2, 32, [16, 11], -1, 0.0, False),
    "window": (1, 40, 4, 1, 16, [40], 7, 0.0, False),
    "sink-softcap": (2, 9, 6, 3, 80, [9, 5], -1, 30.0, True),
    "mha-128": (1, 64, 2, 2, 128, [64], -1, 0.0, False),
    "one-token": (1, 1, 4, 2, 16, [1], -1, 0.0, False),
}


def _case(name, dtype):
    b, s, n, kvn, h, total, window, cap, sink = CASES[name]
    q, k, v = _packed(b, s, n, kvn, h, dtype)
    sk = mx.array(RNG.standard_normal(n).astype(np.float32)) if sink else None
    kw = dict(alpha=h ** -0.5, softcap=cap, local_window_size=window, sink=sk)
    return q, k, v, mx.array(np.asarray(total, np.int32)), kw


def _tolerance(dtype):
    return {mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}[dtype]


def _ops(q, k, v, total, kw, bias=None):
    """``contrib_attention.prompt_attention``'s float32 ops (no kernel, no fused attention)."""
    return _translate(q, k, v, total, kw, knob=False, bias=bias)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_contract_is_the_ops(name):
    q, k, v, total, kw = _case(name, mx.float32)
    got = np.array(reference_prompt_attention(q, k, v, total, **kw))
    np.testing.assert_allclose(got, np.array(_ops(q, k, v, total, kw)), atol=1e-5, rtol=1e-5)


def _translate(q, k, v, total, kw, *, fused_min=1 << 20, knob=True, bias=None, causal=False):
    with build.active(build.BuildContext(cuda_kernels=True, fused_attention=True, fused_attention_min=fused_min,
                                         prompt_kernel=knob)):
        return ca.prompt_attention(q, k, v, q.astype(mx.float32), total - 1, mx.zeros(total.shape, mx.int32), total,
                                   attention_bias=bias, causal=causal, **kw)


@pytest.fixture
def stand_in(monkeypatch):
    """The kernel's contract in its place (with the kernels on): the calls' arguments."""
    calls = []

    def contract(q, k, v, total_len, **kw):
        calls.append((q.shape, k.shape, v.shape, np.array(total_len).tolist(), kw))
        return reference_prompt_attention(q, k, v, total_len, **kw)
    monkeypatch.setattr(cuda_kernels, "enabled", lambda: True)
    monkeypatch.setattr(cuda_kernels, "prompt_attention", contract)
    return calls


@pytest.mark.parametrize("causal", [False, True], ids=["", "causal"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_short_prompts_take_the_kernel(stand_in, name, causal):
    """A causal prompt (its caller drops the rows past its length) lets the kernel skip those rows."""
    q, k, v, total, kw = _case(name, mx.float16)
    got = _translate(q, k, v, total, kw, causal=causal)
    assert len(stand_in) == 1
    assert stand_in[0][:4] == (q.shape, k.shape, v.shape, np.array(total).tolist())
    assert stand_in[0][4] == {**kw, "drop_past": causal}
    s = q.shape[2]
    rows = CASES[name][5]
    want = np.array(_ops(q, k, v, total, kw).astype(mx.float32))
    got = np.array(got.astype(mx.float32))
    for i, n in enumerate(rows):             # rows past a row's length are the caller's to drop
        np.testing.assert_allclose(got[i, :n], want[i, :n], atol=4e-3, rtol=4e-3)
    assert got.shape == (q.shape[0], s, q.shape[1] * q.shape[3])


def test_what_does_not_take_the_kernel(stand_in):
    q, k, v, total, kw = _case("qwen-shaped", mx.float16)
    _translate(q, k, v, total, kw, knob=False)                    # tuning prompt_kernel=0
    _translate(q, k, v, total, kw, fused_min=32)                 # MLX's fused kernel's bucket
    bias = mx.zeros((1, 1, 37, 37), mx.float16)
    _translate(q, k, v, total, kw, bias=bias)                     # an attention bias: the ops
    assert stand_in == []
    assert cuda_kernels.prompt_attention_reason(q, k, v, 14, 2, bias) == "attention_bias"
    long = mx.zeros((1, 2, cuda_kernels.PROMPT_MAX + 1, 16), mx.float16)
    assert "tokens" in cuda_kernels.prompt_attention_reason(long, long, long, 2, 2)
    assert "heads" in cuda_kernels.prompt_attention_reason(q, k, v, 7, 2)
    _translate(q, k, v, total, kw)
    assert len(stand_in) == 1


def test_the_knob_reaches_the_build():
    from ortmlx.kernels.passes import BuildConfig
    from ortmlx.tuning import Tuning
    assert BuildConfig.for_device("gpu").context().prompt_kernel
    assert not BuildConfig.for_device("gpu", Tuning.parse("prompt_kernel=0")).context().prompt_kernel


@gpu_only
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kernel_keeps_its_contract(name, dtype):
    q, k, v, total, kw = _case(name, dtype)
    got = cuda_kernels.prompt_attention(q, k, v, total, **kw)
    want = reference_prompt_attention(q, k, v, total, **kw)
    assert got.shape == want.shape and got.dtype == dtype
    g, w = (np.array(a.astype(mx.float32)) for a in (got, want))
    tol = _tolerance(dtype)
    for i, n in enumerate(CASES[name][5]):
        np.testing.assert_allclose(g[i, :n], w[i, :n], atol=tol, rtol=tol, err_msg=f"{name} row {i}")
    # inside a compiled function, as a prompt's closure runs it
    fn = mx.compile(lambda q, k, v, t: cuda_kernels.prompt_attention(q, k, v, t, **kw))
    np.testing.assert_array_equal(np.array(fn(q, k, v, total).astype(mx.float32)), g)
    # rows past a row's length dropped: zeros there, the same rows below it
    dropped = np.array(cuda_kernels.prompt_attention(q, k, v, total, drop_past=True, **kw).astype(mx.float32))
    for i, n in enumerate(CASES[name][5]):
        np.testing.assert_array_equal(dropped[i, :n], g[i, :n], err_msg=f"{name} row {i}")
        assert not dropped[i, n:].any(), f"{name} row {i}: rows past {n} not zero"
