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

from ortmlx.kernels import build, cuda_kernels
from ortmlx.kernels import dtypes as dt
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


def _rope_rows(x, c, s, rot_dim: int, interleaved: bool):
    """x (B, heads, H) rotated as ``apply_rotary``: float32 products and sum, one rounding to x's type."""
    if rot_dim == 0:
        return x
    xf = np.array(x.astype(mx.float32))
    i = np.arange(xf.shape[-1])
    half = rot_dim // 2
    perm = np.where(i < rot_dim, (i ^ 1) if interleaved else np.where(i < half, i + half, i - half), i)
    cf, sf = (np.array(a, np.float32)[:, None, :] for a in (c, s))
    rot = mx.array(xf * cf + xf[..., perm] * sf).astype(x.dtype)           # float32 numpy: no FMA
    return mx.where(mx.array(i < rot_dim), rot, x)


def reference_decode_rope_attention(q, k, v, cos, sin, past_k, past_v, past_len, total_len, *, num_heads,
                                    kv_num_heads, rot_dim, interleaved, alpha, softcap=0.0, local_window_size=-1,
                                    sink=None, qkv_bias=None):
    """``cuda_kernels.decode_rope_attention``'s contract: bias, rotation, presents, then ``decode_attention``'s."""
    b, kvn, t, h = past_k.shape
    if qkv_bias is not None:
        assert k is None, "qkv_bias with split q/k/v"
        q = q + qkv_bias.reshape(q.shape[2:])
    if k is None:
        heads = q.reshape(b, num_heads + 2 * kvn, h)
        qh, kh, vh = heads[:, :num_heads], heads[:, num_heads:num_heads + kvn], heads[:, num_heads + kvn:]
    else:
        qh, kh, vh = q.reshape(b, num_heads, h), k.reshape(b, kvn, h), v.reshape(b, kvn, h)
    qh = _rope_rows(qh, cos, sin, rot_dim, interleaved)
    k_new = _rope_rows(kh, cos, sin, rot_dim, interleaved).reshape(b, kvn, 1, h)
    v_new = vh.reshape(b, kvn, 1, h)
    at = mx.arange(t).reshape(1, 1, t, 1) == past_len.reshape(b, 1, 1, 1)
    pk, pv = mx.where(at, k_new, past_k), mx.where(at, v_new, past_v)
    out = reference_decode_attention(qh.reshape(b, num_heads, 1, h), pk, pv, past_len, total_len,
                                     num_heads=num_heads, kv_num_heads=kv_num_heads, alpha=alpha, softcap=softcap,
                                     local_window_size=local_window_size, sink=sink)
    return out.reshape(b, 1, num_heads * h), pk, pv, k_new, v_new


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


def _gqa(case: str, packed: bool, rotary: bool, first: bool, fused: bool, bias: bool = False):
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
    if bias:
        kw["qkv_bias"] = arr((n + 2 * kvn) * h)
    if packed:
        args = (qkv.reshape(b, 1, (n + 2 * kvn) * h), None, None)        # as the translators hand it over
    else:
        args = (qkv[:, :, :n].reshape(b, 1, n * h), qkv[:, :, n:n + kvn].reshape(b, 1, kvn * h),
                qkv[:, :, n + kvn:].reshape(b, 1, kvn * h))
    dev = mx.gpu if fused and CUDA else mx.cpu
    with mx.stream(dev), build.active(build.BuildContext(cuda_kernels=fused, unpooled=fused)):
        out = gqa_core(*args, past[0], past[1], sl, packed=packed, **kw)
        mx.eval(*out)
    return [np.array(o.astype(mx.float32)) if o.dtype == mx.bfloat16 else np.array(o) for o in out]


VARIANTS = pytest.mark.parametrize(
    "packed,rotary,first,bias",
    [(True, True, False, False), (False, False, False, False), (True, False, True, False), (True, True, False, True),
     (True, False, True, True)],
    ids=["packed-rotary", "split", "first-prompt", "packed-rotary-bias", "first-prompt-bias"])


def _check_output(case: str, got, want) -> None:
    """float32 math in both, summed in another order; one rounding to the output type."""
    dtype = CASES[case][6]
    tol = {mx.float32: 2e-5, mx.float16: 2 ** -10, mx.bfloat16: 2 ** -7}[dtype]
    err = np.abs(got.astype(np.float64) - want) / (np.abs(want) + 0.05)
    assert err.max() <= 1.01 * tol, f"{case}: attention output off by {err.max():.3g} (relative)"


@pytest.mark.parametrize("head,itemsize", [(64, 2), (128, 2), (80, 4), (36, 2), (256, 4), (32, 4), (300, 2)])
def test_fused_copy_blocks_give_each_thread_one_piece(head, itemsize):
    """The presents' copy blocks take as many rows as give each thread at most one piece (16 bytes when a row
    is a whole number of them, else one element), and never fewer than one row."""
    threads = 32 * cuda_kernels.ATTN_WARPS
    rows = cuda_kernels.fused_rows_per_block(head, itemsize, threads)
    piece = 16 // itemsize if head * itemsize % 16 == 0 else 1
    pieces = head // piece
    assert rows >= 1
    assert rows == 1 or rows * pieces <= threads < (rows + 1) * pieces


@pytest.mark.parametrize("head,dtype,covered", [(64, mx.float16, True), (80, mx.bfloat16, True),
                                                (36, mx.float32, True), (36, mx.float16, False),
                                                (20, mx.bfloat16, False)])
def test_fused_kernel_takes_rows_of_whole_16_byte_pieces(head, dtype, covered):
    """Heads whose rows are not a whole number of 16-byte pieces keep the MLX path (the kernel's
    element-wise copy has not run on a GPU with such rows)."""
    past = mx.zeros((1, 2, 8, head), dtype)
    q = mx.zeros((1, 1, (4 + 4) * head), dtype)
    why = cuda_kernels.decode_rope_attention_reason(q, None, None, past, past, 4, 2, head)
    assert (why is None) == covered, why
    if not covered:
        assert f"head size {head}" in why


@pytest.mark.parametrize("case", sorted(CASES))
@VARIANTS
def test_gqa_core_wiring_with_the_contract(case, packed, rotary, first, bias, monkeypatch):
    """Everywhere: ``gqa_core`` handing its decode row to the kernel's contract (NumPy) gives its own answer."""
    calls = []
    monkeypatch.setattr(cuda_kernels, "cuda_backend", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(cuda_kernels, "decode_attention",
                        lambda *a, **k: calls.append("attention") or reference_decode_attention(*a, **k))
    monkeypatch.setattr(cuda_kernels, "decode_rope_attention",
                        lambda *a, **k: calls.append("rope") or reference_decode_rope_attention(*a, **k))
    with mx.stream(mx.cpu):
        got = _gqa(case, packed, rotary, first, fused=True, bias=bias)
    # a shared buffer (in place) takes the whole row in one kernel; the first prompt the attention kernel
    assert calls == ["attention" if first else "rope"], calls
    monkeypatch.undo()
    want = _gqa(case, packed, rotary, first, fused=False, bias=bias)
    for j, (g, w) in enumerate(zip(got, want)):
        if j > 0:
            np.testing.assert_array_equal(g, w, err_msg=f"{case}: output {j}")
    _check_output(case, got[0], want[0])


@gpu_only
@pytest.mark.parametrize("case", sorted(CASES))
@VARIANTS
def test_decode_attention_matches_mlx_ops(case, packed, rotary, first, bias, monkeypatch):
    calls = []
    real, real_rope = cuda_kernels.decode_attention, cuda_kernels.decode_rope_attention

    def spy(*a, **k):
        calls.append(1)
        got = real(*a, **k)
        _check_output(case, np.array(got.astype(mx.float32)), np.array(reference_decode_attention(*a, **k)
                                                                       .astype(mx.float32)))
        return got

    def spy_rope(*a, **k):
        calls.append(1)
        got = real_rope(*a, **k)
        want = reference_decode_rope_attention(*a, **k)
        mx.eval(*got, *want)
        _check_output(case, np.array(got[0].astype(mx.float32)), np.array(want[0].astype(mx.float32)))
        for j in range(1, 5):               # presents and new rows: exact (the rotation is IEEE float32 in both)
            assert got[j].shape == want[j].shape and got[j].dtype == want[j].dtype, (j, got[j].shape)
            np.testing.assert_array_equal(np.array(got[j].astype(mx.float32)), np.array(want[j].astype(mx.float32)),
                                          err_msg=f"{case}: fused output {j}")
        return got
    monkeypatch.setattr(cuda_kernels, "decode_attention", spy)
    monkeypatch.setattr(cuda_kernels, "decode_rope_attention", spy_rope)
    got = _gqa(case, packed, rotary, first, fused=True, bias=bias)
    assert calls == [1], calls
    want = _gqa(case, packed, rotary, first, fused=False, bias=bias)
    for j, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (j, g.shape, w.shape)
        if j > 0:                       # presents and new rows: the same ops on both devices
            np.testing.assert_array_equal(g, w, err_msg=f"{case}: output {j}")
    _check_output(case, got[0], want[0])


@gpu_only
@pytest.mark.parametrize("sizes", [[48], [2, 4, 6, 1], [128] * 48 + [4], [1 << 19, 37, 3 << 16, 5]])
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
    with mx.stream(mx.gpu):             # a larger size: the bytes after the arrays' are the kernel's to leave
        padded = cuda_kernels.gather_bytes(parts, size=want.size + 70000)
        mx.eval(padded)
    assert padded.shape == (want.size + 70000,)
    assert np.array(padded)[:want.size].tobytes() == np.array(want).tobytes()
    made = cuda_kernels._gather_kernel.cache_info().currsize
    other = [p[: max(1, p.size // 2)] for p in parts]                # other sizes, as many parts: no new kernel
    with mx.stream(mx.gpu):
        got = cuda_kernels.gather_bytes(other)
        want = mx.concatenate([p.reshape(-1).view(mx.uint8) for p in other])
        mx.eval(got, want)
    assert np.array(got).tobytes() == np.array(want).tobytes()
    assert cuda_kernels._gather_kernel.cache_info().currsize == made


def test_gather_table_gives_each_part_its_bytes_and_offset():
    assert np.array(cuda_kernels._gather_table((5, 7, 9))).tolist() == [5, 0, 7, 5, 9, 12]
    assert "5" not in cuda_kernels._gather_source(2) and "case 1:" in cuda_kernels._gather_source(2)


def _decode_model(t, n=8, kvn=2, h=64, p=24, bias=False):
    nodes = [helper.make_node("GroupQueryAttention", ["qkvb" if bias else "qkv", "", "", "past_key", "past_value",
                                                      "seqlens_k", "total_sequence_length", "cos", "sin"],
                              ["out", "present_key", "present_value"], domain="com.microsoft",
                              num_heads=n, kv_num_heads=kvn, do_rotary=1)]
    ang = np.outer(np.arange(p), 1.0 / 10000 ** (np.arange(h // 2) / (h // 2)))
    npt = {T.FLOAT16: np.float16, T.FLOAT: np.float32}[t]
    inits = {"cos": np.cos(ang).astype(npt), "sin": np.sin(ang).astype(npt)}
    if bias:                        # genai's builder: the QKV projection's bias Add right before the attention
        nodes.insert(0, helper.make_node("Add", ["qkv", "b"], ["qkvb"]))
        inits["b"] = np.random.default_rng(5).standard_normal((n + 2 * kvn) * h).astype(npt)
    ins = [("qkv", t, ["batch_size", "sequence_length", (n + 2 * kvn) * h]),
           ("past_key", t, ["batch_size", kvn, "past_sequence_length", h]),
           ("past_value", t, ["batch_size", kvn, "past_sequence_length", h]),
           ("seqlens_k", T.INT32, ["batch_size"]), ("total_sequence_length", T.INT32, [])]
    outs = [("out", t, None), ("present_key", t, None), ("present_value", t, None)]
    return make_model(nodes, ins, outs, initializers=inits, extra_opsets={"com.microsoft": 1}), npt, n, kvn, h, p


@gpu_only
@pytest.mark.parametrize("t", [T.FLOAT16, T.FLOAT], ids=["fp16", "fp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias-add"])
def test_ep_decode_matches_cpu_ep(t, bias, monkeypatch):
    """Decode steps (S == 1 into a fixed-length buffer, as genai's shared buffer) through the EP on the
    GPU, compiled and eager, against the CPU EP: the fused kernel runs and the answers agree."""
    calls = []
    for fn in ("decode_attention", "decode_rope_attention"):
        real = getattr(cuda_kernels, fn)
        monkeypatch.setattr(cuda_kernels, fn, lambda *a, _real=real, _fn=fn, **k: calls.append(_fn) or _real(*a, **k))
    m, npt, n, kvn, h, p = _decode_model(t, bias=bias)
    rng = np.random.default_rng(7)
    import ortmlx.compiled as C
    with C.capture() as rs:
        mlx = session(m, options={"device": "gpu"})
    gqa = [st for r in rs for st in r.program.steps if st.node.op_type == "GroupQueryAttention"]
    assert len(gqa) == 1 and (len(gqa[0].inputs) == 17) == bias, "the bias Add was not folded" if bias else gqa
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
    assert len(calls) >= 9 and "decode_rope_attention" in calls, f"fused kernels used: {calls}"


# ---------------------------------------------------------------------------- prompt_rope
def reference_prompt_rope(qkv, cos, sin, valid, rows, *, num_heads, kv_num_heads, rot_dim, interleaved,
                          qkv_bias=None):
    """``cuda_kernels.prompt_rope``'s contract: bias, rotation (``_rope_rows``), the queries (B, N, S, H), the
    presents (B, Nkv, rows, H) with the prompt's rows below ``valid`` and zeros elsewhere, their first S rows."""
    b, s = qkv.shape[:2]
    kvn = kv_num_heads
    heads = num_heads + 2 * kvn
    x = qkv.reshape(b, s, heads, -1)
    h = x.shape[-1]
    if qkv_bias is not None:
        x = x + qkv_bias.reshape(heads, h)
    flat = x.reshape(b * s, heads, h)
    c, sn = (None, None) if rot_dim == 0 else (np.array(a).reshape(b * s, h) for a in (cos, sin))
    rot = _rope_rows(flat[:, :num_heads + kvn], c, sn, rot_dim, interleaved)
    q = rot[:, :num_heads].reshape(b, s, num_heads, h).transpose(0, 2, 1, 3)
    k = rot[:, num_heads:].reshape(b, s, kvn, h).transpose(0, 2, 1, 3)
    v = flat[:, num_heads + kvn:].reshape(b, s, kvn, h).transpose(0, 2, 1, 3)
    lens = mx.array([s] * b, mx.int32) if valid is None else valid
    keep = mx.arange(s).reshape(1, 1, s, 1) < lens.reshape(b, 1, 1, 1)
    zero = mx.zeros((), x.dtype)
    pad = [(0, 0), (0, 0), (0, rows - s), (0, 0)]
    k, v = mx.where(keep, k, zero), mx.where(keep, v, zero)
    return q, mx.pad(k, pad), mx.pad(v, pad), k, v


# name: (B, N, Nkv, H, present rows, prompt rows, valid rows (None: all), rotary, interleaved, bias, dtype)
PROMPTS = {
    "fp16 qwen 0.5b shape, padded": (1, 14, 2, 64, 300, 128, [97], True, False, True, mx.float16),
    "fp16 two rows": (2, 8, 2, 64, 40, 24, [24, 9], True, False, False, mx.float16),
    "bf16 interleaved": (1, 8, 4, 64, 33, 33, None, True, True, False, mx.bfloat16),
    "fp32 head 80 no rotary": (2, 6, 3, 80, 50, 17, [17, 3], False, False, True, mx.float32),
    "fp32 no buffer": (1, 4, 2, 32, 12, 12, None, True, False, False, mx.float32),
}


def _prompt(case: str, rope: bool, kernel=None):
    """``gqa_core`` on a first prompt of packed QKV into a buffer (the contract or, ``kernel``, the kernel for
    ``prompt_rope``; else MLX ops), its new rows too; the attention always as MLX's float32 ops. Returns its
    outputs and the calls."""
    b, n, kvn, h, rows, s, valid, rotary, inter, bias, dtype = PROMPTS[case]
    rng = np.random.default_rng(len(case))

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    qkv = arr(b, s, (n + 2 * kvn) * h)
    past = None if rows == s else [arr(b, kvn, rows, h), arr(b, kvn, rows, h)]
    lens = valid or [s] * b
    kw = dict(total_sequence_length=s, num_heads=n, kv_num_heads=kvn, first_prompt=True, packed=True,
              causal_prompt=True, prompt_valid=None if valid is None else mx.array(valid, mx.int32))
    if rotary:
        half = h // 2 - (4 if h == 80 else 0)                # a partial rotation where the head allows it
        ang = np.outer(np.arange(rows), 1.0 / 10000 ** (np.arange(half) / half))
        kw.update(cos_cache=mx.array(np.cos(ang).astype(np.float32)).astype(dtype),
                  sin_cache=mx.array(np.sin(ang).astype(np.float32)).astype(dtype), rotary_interleaved=inter)
    if bias:
        kw["qkv_bias"] = arr((n + 2 * kvn) * h)
    calls = []

    def spy(*a, **k):
        calls.append(k["rot_dim"])
        return (kernel or reference_prompt_rope)(*a, **k)
    real = cuda_kernels.prompt_rope
    cuda_kernels.prompt_rope = spy
    try:
        dev = mx.gpu if kernel is not None else mx.cpu
        ctx = build.BuildContext(cuda_kernels=rope, prompt_rope=rope, prompt_kernel=False, unpooled=rope)
        with mx.stream(dev), build.active(ctx):
            out = gqa_core(qkv, None, None, *(past or [None, None]), mx.array([x - 1 for x in lens], mx.int32),
                           new_rows=True, **kw)
            mx.eval(*out)
    finally:
        cuda_kernels.prompt_rope = real
    return [np.array(o.astype(mx.float32)) for o in out], calls


@pytest.mark.parametrize("case", sorted(PROMPTS))
def test_prompt_rope_wiring_with_the_contract(case, monkeypatch):
    """Everywhere: a first prompt's queries and presents through ``prompt_rope``'s contract give ``gqa_core``'s own
    answer: the presents and new rows bit for bit, the attention to float32 rounding (the same values reach it in
    another layout, and OpenBLAS, which ``import ortmlx`` puts under MLX's CPU products, sums a transposed operand
    in another order)."""
    monkeypatch.setattr(cuda_kernels, "cuda_backend", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    got, calls = _prompt(case, rope=True)
    b, n, kvn, h, rows, s, valid, rotary, *_ = PROMPTS[case]
    assert calls == [(2 * (h // 2 - (4 if h == 80 else 0))) if rotary else 0], calls
    want, none = _prompt(case, rope=False)
    assert none == []
    assert got[1].shape == (b, kvn, rows, h) and got[3].shape == (b, kvn, s, h)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5, err_msg=f"{case}: attention output")
    for j, what in enumerate(("present key", "present value", "key rows", "value rows"), 1):
        np.testing.assert_array_equal(got[j], want[j], err_msg=f"{case}: {what}")
    np.testing.assert_array_equal(got[3], got[1][:, :, :s])


def test_prompt_rope_knob_reaches_the_build():
    """On by default on a GPU; it asks for the custom kernels too."""
    from ortmlx.kernels.passes import BuildConfig
    from ortmlx.tuning import Tuning
    assert BuildConfig.for_device("gpu").context().prompt_rope
    assert not BuildConfig.for_device("gpu", Tuning.parse("prompt_rope=0")).context().prompt_rope
    assert not BuildConfig.for_device("gpu", Tuning.parse("prompt_rope=1,cuda_kernels=0")).context().prompt_rope
    assert not BuildConfig.for_device("cpu", Tuning.parse("prompt_rope=1")).context().prompt_rope


def test_new_rows_are_for_first_prompts():
    past = mx.zeros((1, 2, 8, 16), mx.float32)
    with pytest.raises(ValueError, match="first prompts"):
        gqa_core(mx.zeros((1, 1, 8 * 16)), None, None, past, past, mx.array([3], mx.int32), total_sequence_length=8,
                 num_heads=4, kv_num_heads=2, first_prompt=False, packed=True, new_rows=True)


def test_prompt_rope_reason():
    q = mx.zeros((1, 8, (4 + 2 * 2) * 64), mx.float16)
    assert cuda_kernels.prompt_rope_reason(q, 4, 2, 64, 100) is None
    assert cuda_kernels.prompt_rope_reason(q.reshape(1, 8, 8, 64), 4, 2, 64, 8) is None
    assert "rows" in cuda_kernels.prompt_rope_reason(q, 4, 2, 64, 7)
    assert "rotary dim 66" in cuda_kernels.prompt_rope_reason(q, 4, 2, 66, 100)
    assert "heads 5+2*2" in cuda_kernels.prompt_rope_reason(q, 5, 2, 64, 100)
    assert "int32" in cuda_kernels.prompt_rope_reason(q.astype(mx.int32), 4, 2, 64, 100)


@gpu_only
@pytest.mark.parametrize("case", sorted(PROMPTS))
def test_prompt_rope_kernel(case):
    """The kernel against its contract bit for bit (the rotation is IEEE float32 in both), and inside ``gqa_core``
    against MLX's ops on the GPU."""
    seen = []
    kernel = cuda_kernels.prompt_rope         # (``_prompt`` puts its spy in the module's place while it runs)

    def check(*a, **k):
        got = kernel(*a, **k)
        want = reference_prompt_rope(*a, **k)
        mx.eval(*got, *want)
        for j, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and g.dtype == w.dtype, (j, g.shape, w.shape)
            np.testing.assert_array_equal(np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32)),
                                          err_msg=f"{case}: output {j}")
        seen.append(1)
        return got
    got, calls = _prompt(case, rope=True, kernel=check)
    assert seen == [1] and len(calls) == 1
    want, none = _prompt(case, rope=False)
    assert none == []
    for j, what in enumerate(("attention output", "present key", "present value", "key rows", "value rows")):
        if j:
            np.testing.assert_array_equal(got[j], want[j], err_msg=f"{case}: {what}")
    tol = {mx.float32: 2e-5, mx.float16: 2 ** -10, mx.bfloat16: 2 ** -7}[PROMPTS[case][-1]]
    err = np.abs(got[0].astype(np.float64) - want[0]) / (np.abs(want[0]) + 0.05)
    assert err.max() <= 1.01 * tol, f"{case}: attention output off by {err.max():.3g} (relative)"


@gpu_only
@pytest.mark.parametrize("t", [T.FLOAT16, T.FLOAT], ids=["fp16", "fp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias-add"])
def test_ep_prompt_matches_cpu_ep(t, bias, monkeypatch):
    """First prompts (S > 1 into a fixed-length buffer, as genai's shared buffer) through the EP on the GPU,
    compiled and eager, against the CPU EP: the prompt's kernel runs and the answers agree."""
    calls = []
    real = cuda_kernels.prompt_rope
    monkeypatch.setattr(cuda_kernels, "prompt_rope", lambda *a, **k: calls.append(1) or real(*a, **k))
    m, npt, n, kvn, h, p = _decode_model(t, bias=bias)
    rng = np.random.default_rng(11)
    mlx = session(m, options={"device": "gpu"})
    eager = session(m, options={"device": "gpu", "no_compile": "1"})
    cpu = session(m, "CPUExecutionProvider", record=False)
    for s in (5, 17, 9, 17):
        feeds = {"qkv": rng.standard_normal((1, s, (n + 2 * kvn) * h)).astype(npt),
                 "past_key": np.zeros((1, kvn, p, h), npt), "past_value": np.zeros((1, kvn, p, h), npt),
                 "seqlens_k": np.array([s - 1], np.int32), "total_sequence_length": np.array(s, np.int32)}
        want = cpu.run(None, feeds)
        for name, sess in (("compiled", mlx), ("eager", eager)):
            got = sess.run(None, feeds)
            tol = dict(rtol=2e-2, atol=2e-3) if t == T.FLOAT16 else dict(rtol=1e-4, atol=1e-5)
            assert_close(got[0], want[0], what=f"{name} {s} tokens: output", **tol)
            for j in (1, 2):
                assert_close(got[j][:, :, :s], want[j][:, :, :s], what=f"{name} {s} tokens: present {j}",
                             **(dict(rtol=1e-3, atol=0) if t == T.FLOAT16 else dict(rtol=3e-7, atol=1e-7)))
                assert not got[j][:, :, s:].any(), f"{name} {s} tokens: present {j} rows past the prompt"
    assert calls, "the prompt's kernel did not run"


# ---------------------------------------------------------------------------- rms_norm
def reference_rms_norm(x, gamma, epsilon, skip=None, bias=None):
    """``cuda_kernels.rms_norm``'s contract in float64 NumPy: (y, sum) in x's type."""
    f = [None if a is None else np.array(a.astype(mx.float32), np.float64) for a in (x, skip, bias, gamma)]
    s = f[0] + (0 if skip is None else f[1]) + (0 if bias is None else f[2])
    y = f[3] * (s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + epsilon))
    back = [mx.array(a.astype(np.float32)).astype(x.dtype) for a in (y, s)]
    return back[0], (back[1] if skip is not None else None)


# name: (input shape, dtype, skip, bias, epsilon)
NORM_CASES = {
    "fp16 decode row, skip": ((1, 1, 896), mx.float16, True, False, 1e-6),
    "fp16 prefill rows, skip+bias": ((2, 5, 1536), mx.float16, True, True, 1e-6),
    "bf16 plain": ((3, 1000), mx.bfloat16, False, False, 1e-5),
    "fp32 plain, small": ((1, 1, 40), mx.float32, False, False, 1e-5),
    "fp32 skip, wide": ((1, 1, 8192), mx.float32, True, False, 1e-6),
}


def _norm_inputs(case: str):
    shape, dtype, has_skip, has_bias, eps = NORM_CASES[case]
    rng = np.random.default_rng(len(case))

    def arr(*sh):
        return mx.array(rng.standard_normal(sh).astype(np.float32)).astype(dtype)
    h = shape[-1]
    return arr(*shape), arr(h), eps, (arr(*shape) if has_skip else None), (arr(h) if has_bias else None)


def _norm_translators(case: str, fused: bool):
    """The ONNX translators (SkipSimplifiedLayerNormalization with a skip, else SimplifiedLayerNormalization)."""
    from types import SimpleNamespace

    from ortmlx.kernels.ops.contrib_norm import simplified_layer_norm, skip_simplified_layer_norm
    x, gamma, eps, skip, bias = _norm_inputs(case)
    dev = mx.gpu if fused and CUDA else mx.cpu
    with mx.stream(dev), build.active(build.BuildContext(cuda_kernels=fused)):
        if skip is not None:
            ctx = SimpleNamespace(n_outputs=4, node=SimpleNamespace(outputs=["y", "", "", "sum"]))
            out = skip_simplified_layer_norm(x, skip, gamma, bias, epsilon=eps, ctx=ctx)
            out = [out[0], out[3]]
        else:
            out = [simplified_layer_norm(x, gamma, epsilon=eps, ctx=SimpleNamespace(n_outputs=1))]
        mx.eval(*out)
    return [np.array(o.astype(mx.float32)) for o in out]


def _check_norm(case: str, got, want) -> None:
    tol = {mx.float32: 3e-6, mx.float16: 2 ** -10, mx.bfloat16: 2 ** -7}[NORM_CASES[case][1]]
    for j, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (case, j, g.shape, w.shape)
        err = np.abs(g.astype(np.float64) - w) / (np.abs(w) + 0.05)
        assert err.max() <= 1.01 * tol, f"{case}: output {j} off by {err.max():.3g} (relative)"


@pytest.mark.parametrize("case", sorted(NORM_CASES))
def test_norm_wiring_with_the_contract(case, monkeypatch):
    """Everywhere: the translators handing their rows to the kernel's contract (NumPy) give their own answer."""
    calls = []
    monkeypatch.setattr(cuda_kernels, "cuda_backend", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(cuda_kernels, "rms_norm", lambda *a, **k: calls.append(1) or reference_rms_norm(*a, **k))
    with mx.stream(mx.cpu):
        got = _norm_translators(case, fused=True)
    assert calls == [1], "the rows did not go to the kernel"
    monkeypatch.undo()
    _check_norm(case, got, _norm_translators(case, fused=False))


@gpu_only
@pytest.mark.parametrize("case", sorted(NORM_CASES))
def test_rms_norm_kernel(case, monkeypatch):
    x, gamma, eps, skip, bias = _norm_inputs(case)
    with mx.stream(mx.gpu):
        got = [a for a in cuda_kernels.rms_norm(x, gamma, eps, skip=skip, bias=bias) if a is not None]
        mx.eval(*got)
    want = [a for a in reference_rms_norm(x, gamma, eps, skip=skip, bias=bias) if a is not None]
    _check_norm(case, [np.array(a.astype(mx.float32)) for a in got], [np.array(a.astype(mx.float32)) for a in want])
    calls = []
    real = cuda_kernels.rms_norm
    monkeypatch.setattr(cuda_kernels, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = _norm_translators(case, fused=True)
    assert calls == [1], "the translator did not use the kernel"
    _check_norm(case, fused, _norm_translators(case, fused=False))


@gpu_only
@pytest.mark.parametrize("t", [T.FLOAT16, T.FLOAT], ids=["fp16", "fp32"])
def test_ep_norms_match_cpu_ep(t, monkeypatch):
    """SimplifiedLayerNormalization then SkipSimplifiedLayerNormalization (sum output used), as the genai
    builder chains them, through the EP on the GPU against the CPU EP, with the kernel in use."""
    calls = []
    real = cuda_kernels.rms_norm
    monkeypatch.setattr(cuda_kernels, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    h = 896
    npt = {T.FLOAT16: np.float16, T.FLOAT: np.float32}[t]
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("SimplifiedLayerNormalization", ["x", "g1"], ["n1"], epsilon=1e-6),
             helper.make_node("SkipSimplifiedLayerNormalization", ["n1", "r", "g2"], ["y", "", "", "s"],
                              domain="com.microsoft", epsilon=1e-6)]
    m = make_model(nodes, [("x", t, ["b", "s", h]), ("r", t, ["b", "s", h])], [("y", t, None), ("s", t, None)],
                   initializers={"g1": rng.standard_normal(h).astype(npt), "g2": rng.standard_normal(h).astype(npt)},
                   extra_opsets={"com.microsoft": 1})
    cpu = session(m, "CPUExecutionProvider", record=False)
    for name, opts in (("compiled", {"device": "gpu"}), ("eager", {"device": "gpu", "no_compile": "1"})):
        sess = session(m, options=opts)
        for shape in ((1, 1, h), (1, 1, h), (2, 7, h)):
            feeds = {"x": rng.standard_normal(shape).astype(npt), "r": rng.standard_normal(shape).astype(npt)}
            got, want = sess.run(None, feeds), cpu.run(None, feeds)
            tol = dict(rtol=2e-2, atol=2e-2) if t == T.FLOAT16 else dict(rtol=1e-4, atol=1e-4)
            assert_close(got[0], want[0], what=f"{name} {shape} y", **tol)
            assert_close(got[1], want[1], what=f"{name} {shape} sum", **tol)
    assert len(calls) >= 6, f"kernel used {len(calls)} times"


def test_hint_arrays_one_kernel_wiring(monkeypatch):
    """Everywhere: the row hints handed to ``gather_bytes`` as they are (no reshapes or views) give the bytes
    the per-piece concatenate gives (the kernel's contract: each array's row-major bytes in turn)."""
    from ortmlx.compiled import core, trace
    sizes = []

    def fake(arrays, size=None):        # the contract, padded with 0xEE bytes nobody may read
        flat = mx.concatenate([a.reshape(-1).view(mx.uint8) for a in arrays])
        sizes.append(size)
        return mx.concatenate([flat, mx.full((size - flat.size,), 0xEE, mx.uint8)]) if size else flat
    monkeypatch.setattr(cuda_kernels, "gather_bytes", fake)
    rng = np.random.default_rng(4)
    starts = [mx.array([3, 5], mx.int32), mx.array([7, 1], mx.int64)]
    hints = []
    for i in range(5):
        rows = mx.array(rng.standard_normal((2, 2, 1, 8)).astype(np.float32)).astype(mx.float16)
        hints.append((None, None, starts[i % 2], rows))
    meta = [(i, i, (2, 2, 1, 8), 2) if i != 2 else None for i in range(5)]     # hint 2 not kept
    got, gi = trace._hint_arrays(hints, meta, one_kernel=True)
    want, wi = trace._hint_arrays(hints, meta, one_kernel=False)
    # the kernel's buffer is padded to a size of its own (trace.HINT_ROOM); the used bytes are the same
    assert sizes == [trace._hint_room(want.size)] and got.size == sizes[0] > want.size + trace.HINT_ROOM - (1 << 14)
    assert np.array(got)[:want.size].tobytes() == np.array(want).tobytes() and list(gi) == list(wi)
    from ortmlx.runtime.mirror import hint_bytes
    kept = [m for m in meta if m is not None]
    flat, st = hint_bytes(core.RowHints(kept, got, gi))          # reads past the rows and starts: nothing
    wflat, wst = hint_bytes(core.RowHints(kept, want, wi))
    assert flat.tobytes() == wflat.tobytes() and st.tolist() == wst.tolist() == [3, 5, 7, 1, 7, 1, 3, 5]


def test_hint_arrays_to_host_wiring(monkeypatch):
    """Everywhere: with a sink the gather gets the sink's address array and its one-byte output is the
    hints' output; a sink that declines (no driver) leaves the padded device buffer."""
    from ortmlx.compiled import trace
    seen = []

    def fake(arrays, size=None, to_host=None):
        seen.append((len(arrays), size, to_host))
        return mx.zeros((1,), mx.uint8) if to_host is not None else mx.zeros((size,), mx.uint8)
    monkeypatch.setattr(cuda_kernels, "gather_bytes", fake)
    rows = [mx.zeros((1, 2, 1, 8), mx.float16) for _ in range(3)]
    hints = [(None, None, mx.array([4], mx.int32), r) for r in rows]
    meta = [(i, i, (1, 2, 1, 8), 2) for i in range(3)]
    used = 3 * 32 + 3 * 4
    asked, address = [], mx.array([0xABC000], mx.uint64)
    out, _ = trace._hint_arrays(hints, meta, one_kernel=True, sink=lambda n: asked.append(n) or address)
    assert asked == [used] and out.shape == (1,) and seen[-1] == (6, None, address)
    out, _ = trace._hint_arrays(hints, meta, one_kernel=True, sink=lambda n: None)   # no driver
    assert out.shape == (trace._hint_room(used),) and seen[-1] == (6, trace._hint_room(used), None)


def test_sink_made_once_and_never_outgrown(monkeypatch):
    """Everywhere: a closure's host buffer is made at its trace (page-rounded) for the offset and bytes
    asked, later asks within it reuse it, one past it is refused; no driver: no buffer."""
    from ortmlx.compiled import core, trace
    from ortmlx.compiled.decode_ops import Untraceable
    from ortmlx.kernels import cuda_driver
    made = []

    class Buf:
        def __init__(self, drv, n):
            made.append(n)
            self.nbytes, self.device_address = n, 0x7F0000001000
    monkeypatch.setattr(cuda_driver, "HostBuffer", Buf)
    monkeypatch.setattr(cuda_driver, "driver", lambda: None)
    c = core._Closure((), {})
    assert trace._sink_address(c, 0, 100) is None and c.sink is None
    monkeypatch.setattr(cuda_driver, "driver", lambda: object())
    a = trace._sink_address(c, 512, 5000)
    assert made == [8192] and a.dtype == mx.uint64 and a.tolist() == [0x7F0000001000 + 512]
    assert trace._sink_address(c, 0, 8192).tolist() == [0x7F0000001000] and made == [8192]
    with pytest.raises(Untraceable, match="outgrew"):
        trace._sink_address(c, 4096, 4097)


def test_host_outputs_picked():
    """Everywhere: which outputs a closure sends to host memory: not hinted presents, nothing shaped like a
    traced input (a buffer kept as a device mirror), no bfloat16, nothing of one element, a byte cap."""
    from ortmlx.compiled import trace
    logits, present, other_present = mx.zeros((1, 1, 50)), mx.zeros((1, 2, 8, 4)), mx.zeros((1, 2, 9, 4))
    bf, one, past = mx.zeros((1, 1, 50), mx.bfloat16), mx.zeros((1,)), mx.zeros((1, 2, 9, 4))
    hints = [(present, None, None, None)]
    assert trace._host_outputs([logits, present, other_present, bf, one], hints, [past, None]) == [0]
    big = mx.zeros((trace.HOST_OUT_MAX // 4,))
    assert trace._host_outputs([big, logits], [], []) == [0]          # the second would pass the cap


@gpu_only
@pytest.mark.parametrize("sizes", [[48], [2, 4, 6, 1], [128] * 48 + [4]])
def test_gather_bytes_to_host_memory(sizes):
    """On the GPU: the gather writes the arrays' bytes into page-locked host memory, readable after the
    eval of its one-byte output, and nothing past them."""
    from ortmlx.kernels import cuda_driver
    rng = np.random.default_rng(len(sizes) + 10)
    parts = [mx.array(rng.standard_normal(n).astype(np.float32)).astype((mx.float16, mx.int32, mx.float32)[i % 3])
             for i, n in enumerate(sizes)]
    hb = cuda_driver.HostBuffer(cuda_driver.driver(), 1 << 16)
    hb.array[:] = 0xEE
    with mx.stream(mx.gpu):
        want = mx.concatenate([p.reshape(-1).view(mx.uint8) for p in parts])
        for _ in range(3):              # again and again: the same buffer rewritten
            parts = [p + 1 if p.dtype != mx.int32 else p * 3 for p in parts]
            want = mx.concatenate([p.reshape(-1).view(mx.uint8) for p in parts])
            done = cuda_kernels.gather_bytes(parts, to_host=mx.array([hb.device_address], mx.uint64))
            mx.eval(done, want)
            assert done.shape == (1,) and done.dtype == mx.uint8
            assert hb.array[:want.size].tobytes() == np.array(want).tobytes()
            assert (hb.array[want.size:] == 0xEE).all()
    with pytest.raises(ValueError, match="one uint64 address"):
        cuda_kernels.gather_bytes(parts, to_host=mx.array([1, 2], mx.uint64))


@gpu_only
@pytest.mark.parametrize("n,dtype,offset", [(151936, mx.float16, 0), (37, mx.float32, 256), (5, mx.uint8, 4096),
                                            (1 << 20, mx.float32, 512)])
def test_copy_to_host(n, dtype, offset):
    """On the GPU: an array's bytes land in page-locked host memory (16-byte stores, and a tail; a
    misaligned source takes the byte loop), nothing outside them is touched."""
    from ortmlx.kernels import cuda_driver
    hb = cuda_driver.HostBuffer(cuda_driver.driver(), offset + n * 4 + 4096)
    hb.array[:] = 0xEE
    rng = np.random.default_rng(n)
    a = mx.array(rng.standard_normal(n + 3).astype(np.float32)).astype(dtype)
    for src in (a[:n], a[3:]):          # aligned, then a view 3 elements in
        with mx.stream(mx.gpu):
            done = cuda_kernels.copy_to_host(src * 2, mx.array([hb.device_address + offset], mx.uint64))
            want = src * 2
            mx.eval(done, want)
        w = np.array(want.view(mx.uint8) if dtype != mx.uint8 else want).tobytes()
        assert hb.array[offset:offset + len(w)].tobytes() == w
        assert (hb.array[:offset] == 0xEE).all() and (hb.array[offset + len(w):] == 0xEE).all()
        hb.array[:] = 0xEE


@gpu_only
@pytest.mark.parametrize("as_bytes", [False, True], ids=["typed", "byte_copies"])
@pytest.mark.parametrize("n", [1, 5, 4096, 1 << 20, (3 << 20) + 7])
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32, mx.uint8])
def test_copy_to_address_and_direct_writes(n, dtype, as_bytes, monkeypatch):
    """On the GPU: ``copy_to_address`` (one kernel for every size) writes an array's bytes into page-locked
    memory, and ``DriverReader.write_result`` into plain host memory (``ORT's buffer``) through its staging
    buffer and threaded copy, at any offset; nothing outside the bytes is touched."""
    from ortmlx.kernels import cuda_driver
    from ortmlx.runtime import devread
    monkeypatch.setattr(cuda_kernels, "byte_copies", lambda: as_bytes)
    rng = np.random.default_rng(n)
    a = mx.array(rng.standard_normal(n + 3).astype(np.float32)).astype(dtype)
    reader = devread.reader("gpu")
    assert reader.driver, "no driver reader on the GPU"
    for src in (a[:n], a[3:]):
        with mx.stream(mx.gpu):
            want = src * 2
            mx.eval(want)
        w = np.array(want.view(mx.uint8) if dtype != mx.uint8 else want).tobytes()
        hb = cuda_driver.HostBuffer(cuda_driver.driver(), len(w) + 64)
        hb.array[:] = 0xEE
        with mx.stream(mx.gpu):
            mx.eval(cuda_kernels.copy_to_address(want, mx.array([hb.device_address + 8, len(w)], mx.uint64)))
        assert hb.array[8:8 + len(w)].tobytes() == w
        assert (hb.array[:8] == 0xEE).all() and (hb.array[8 + len(w):] == 0xEE).all()
        raw = np.full(len(w) + 11, 0xEE, np.uint8)
        with mx.stream(mx.gpu):
            assert reader._write(raw.ctypes.data + 5, want, len(w))
        assert raw[5:5 + len(w)].tobytes() == w
        assert (raw[:5] == 0xEE).all() and (raw[5 + len(w):] == 0xEE).all()


def reference_swiglu(y, n: int, gate_first: bool = True) -> np.ndarray:
    """``cuda_kernels.swiglu``'s contract in NumPy: each ONNX node's rounding to y's type (as float32 here)."""
    t = y.dtype
    f = np.array(y.astype(mx.float32), np.float32)
    g, u = (f[..., :n], f[..., n:]) if gate_first else (f[..., n:], f[..., :n])

    def rnd(a):
        return np.array(mx.array(a.astype(np.float32)).astype(t).astype(mx.float32), np.float32)
    e = 1.0 / (1.0 + np.exp(np.abs(g).astype(np.float64)))
    s = rnd(np.where(g < 0, e, 1.0 - e))
    return rnd(rnd(g * s) * u)


def test_swiglu_wiring_with_the_contract(monkeypatch):
    """Everywhere: the folded MLP step hands a decode row's merged product, its width and the gate's side to
    the kernel (here its NumPy contract), which answers what the folded nodes' translators do; a prompt's
    rows too (the kernel reads the row count at run time)."""
    from ortmlx.kernels import merge
    seen = []

    def fake(y, n, gate_first=True):
        seen.append((tuple(y.shape), n, gate_first))
        return mx.array(reference_swiglu(y, n, gate_first)).astype(y.dtype)
    monkeypatch.setattr(cuda_kernels, "swiglu", fake)
    rng = np.random.default_rng(8)
    W = mx.array(rng.standard_normal((40, 2 * 24)).astype(np.float32)).astype(mx.float16)
    for lead in ((1, 1), (2, 3)):
        A = mx.array(rng.standard_normal(lead + (40,)).astype(np.float32)).astype(mx.float16)
        for gate_first in (True, False):
            monkeypatch.setattr(cuda_kernels, "enabled", lambda: True)
            got = merge.merged_swiglu(A, W, width=24, gate_first=gate_first)
            monkeypatch.setattr(cuda_kernels, "enabled", lambda: False)
            want = merge.merged_swiglu(A, W, width=24, gate_first=gate_first)
            assert got.shape == want.shape == lead + (24,) and got.dtype == mx.float16
            err = np.abs(np.array(got, np.float32) - np.array(want, np.float32)).max()
            assert err <= 2 ** -10 * max(1.0, float(np.abs(np.array(want, np.float32)).max())), err
    assert seen == [((1, 1, 48), 24, True), ((1, 1, 48), 24, False), ((2, 3, 48), 24, True), ((2, 3, 48), 24, False)]
    # an empty product (a batch or prompt of 0 rows) is not the kernel's: a grid of no threads fails its launch
    seen.clear()
    monkeypatch.setattr(cuda_kernels, "enabled", lambda: True)
    empty = merge.merged_swiglu(mx.zeros((0, 1, 40), mx.float16), W, width=24, gate_first=True)
    assert seen == [] and empty.shape == (0, 1, 24)
    assert cuda_kernels.swiglu_reason(mx.zeros((0, 48), mx.float16), 24) is not None


@gpu_only
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("shape,n,gate_first", [((1, 1), 4864, True), ((3, 5), 40, False), ((7,), 8960, True),
                                                ((1, 300), 4864, False)])
def test_swiglu_kernel(dtype, shape, n, gate_first):
    """On the GPU: the kernel against its contract (each node's rounding) and against the folded nodes'
    translators run by MLX (at most one unit in the last place of the type apart)."""
    from ortmlx.kernels import merge
    rng = np.random.default_rng(n)
    y = mx.array((rng.standard_normal(shape + (2 * n,)) * 4).astype(np.float32)).astype(dtype)
    with mx.stream(mx.gpu):
        got = cuda_kernels.swiglu(y, n, gate_first)
        first, second = merge.merged_matmul_slices(y, (n, n))
        from ortmlx.kernels.ops.activation import sigmoid
        g, u = (first, second) if gate_first else (second, first)
        mlx_path = mx.multiply(mx.multiply(g, sigmoid(g)), u)
        mx.eval(got, mlx_path)
    assert got.shape == shape + (n,) and got.dtype == dtype
    ulp = {mx.float16: 2 ** -10, mx.bfloat16: 2 ** -7, mx.float32: 2 ** -22}[dtype]
    g32 = np.array(got.astype(mx.float32), np.float32)
    for what, want in (("contract", reference_swiglu(y, n, gate_first)),
                       ("MLX path", np.array(mlx_path.astype(mx.float32), np.float32))):
        err = np.abs(g32 - want) / np.maximum(np.abs(want), 2 ** -14)
        assert (err <= 2 * ulp).all(), (what, float(err.max()))


def _merge_attention_graph():
    from test_merge import _attention_graph
    return _attention_graph(False)


def test_failing_kernel_turns_the_kernels_off(monkeypatch):
    """Everywhere: a run whose kernel fails is run again without the kernels and answers as they would not
    have been there; the kernels are then off for the process (a RuntimeWarning says why). A failure that
    happens without them too is raised, and leaves them on."""
    from ortmlx.kernels.interpreter import KernelError, Program
    g, feeds = _merge_attention_graph()
    want = [dt.host(v) for v in Program(g, fold_qkv_bias=True).run(feeds)]
    monkeypatch.setattr(cuda_kernels, "_DISABLED", [])
    monkeypatch.setattr(cuda_kernels, "cuda_backend", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)

    def boom(*a, **k):
        raise RuntimeError("Failed to compile kernel: boom")
    monkeypatch.setattr(cuda_kernels, "decode_rope_attention", boom)
    monkeypatch.setattr(cuda_kernels, "decode_attention", boom)
    prog = Program(g, fold_qkv_bias=True)
    prog.cuda_kernels = True                       # as on a GPU
    bad = list(feeds)
    bad[3] = np.array([99], np.int32)              # seqlens beyond the buffer: an input error, with or without
    with pytest.raises(KernelError, match="seqlens"):
        prog.run(bad)
    assert cuda_kernels.usable(), "an input error turned the kernels off"
    with pytest.warns(RuntimeWarning, match="boom"):
        got = [dt.host(v) for v in prog.run(feeds)]
    assert "boom" in (cuda_kernels.disabled_reason() or "") and not cuda_kernels.usable()
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def reference_take_rows(data, idx, axis=0):
    """``cuda_kernels.take_rows``'s contract: ``mx.take`` along ``axis``, indices in [-N, 0) counted from the end,
    then clamped into [0, N)."""
    n = data.shape[axis]
    idx = mx.where(idx < 0, idx + n, idx)
    return mx.take(data, mx.clip(idx, 0, n - 1), axis=axis)


def test_take_wiring_with_the_contract(monkeypatch):
    """Everywhere: the eager Gather and the traced one hand their data to ``take_rows`` (its contract standing in),
    along any axis, when the build asks for it (tuning ``take_rows``, on by default on a GPU) and may use the
    kernels, and only then; gathers of other types keep ``mx.take``."""
    from ortmlx.compiled.decode_ops import gather_traced
    from ortmlx.kernels.ops.indexing import gather
    calls = []
    monkeypatch.setattr(cuda_kernels, "cuda_backend", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(cuda_kernels, "take_rows",
                        lambda d, i, a=0: calls.append((i.shape, a)) or reference_take_rows(d, i, a))
    rng = np.random.default_rng(4)
    table = mx.array(rng.standard_normal((50, 6)).astype(np.float16))
    cube = mx.array(rng.standard_normal((2, 50, 3)).astype(np.float32))
    ids = np.array([[3, -1, 7], [0, 49, 3]], np.int64)
    flags = mx.array(rng.integers(0, 2, 50).astype(bool))
    with mx.stream(mx.cpu):
        for on, kernels in ((True, True), (False, True), (True, False)):
            calls.clear()
            with build.active(build.BuildContext(cuda_kernels=kernels, take_rows=on, guards=[])):
                got = [gather(table, ids), gather_traced(table, mx.array(ids)), gather(table, ids % 6, axis=1),
                       gather(cube, ids, axis=1), gather_traced(cube, mx.array(ids), axis=1)]
                other = gather(flags, ids)
            want = [((2, 3), 0), ((2, 3), 0), ((2, 3), 1), ((2, 3), 1), ((2, 3), 1)]
            assert calls == (want if on and kernels else []), (on, kernels, calls)
            tn, cn = np.array(table), np.array(cube)
            for g, w in zip(got, [np.take(tn, ids, 0), np.take(tn, ids, 0), np.take(tn, ids % 6, 1),
                                  np.take(cn, ids, 1), np.take(cn, ids, 1)]):
                np.testing.assert_array_equal(np.array(g), w)
            np.testing.assert_array_equal(np.array(other), np.take(np.array(flags), ids))
    assert cuda_kernels.take_reason(table, mx.zeros((2,), mx.int16), 0).startswith("indices")
    assert cuda_kernels.take_reason(table, mx.zeros((2,), mx.int64), 0) is None
    assert cuda_kernels.take_reason(table, mx.zeros((2,), mx.int32), 2).startswith("data")
    assert cuda_kernels.take_reason(flags, mx.zeros((2,), mx.int32), 0).startswith("data")
    assert cuda_kernels.take_reason(table, mx.zeros((2,), mx.int32), 1) is None
    from ortmlx.kernels.passes import BuildConfig
    from ortmlx.tuning import Tuning
    # both on by default, on a GPU with the kernels only
    assert BuildConfig.for_device("gpu").context().take_rows and Tuning().byte_copies
    assert not BuildConfig.for_device("gpu", Tuning.parse("take_rows=0")).context().take_rows
    assert not BuildConfig.for_device("gpu", Tuning.parse("cuda_kernels=0")).context().take_rows


def test_traced_gather_hands_raw_indices_to_take_rows_for_a_replayed_step(monkeypatch):
    """With ``row_products`` (tuning replay) the traced Gather's indices reach ``take_rows`` as they came (int64,
    negative ones too: no MLX op between, so the step is our kernels only), with the same guard and answer."""
    from ortmlx.compiled.decode_ops import gather_traced
    seen = []
    monkeypatch.setattr(cuda_kernels, "cuda_backend", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(cuda_kernels, "take_rows", lambda d, i, a=0: seen.append(i) or reference_take_rows(d, i, a))
    table = mx.array(np.arange(40, dtype=np.float32).reshape(10, 4))
    ids = mx.array(np.array([[3, -1], [9, -10]], np.int64))
    with mx.stream(mx.cpu):
        for rows in (False, True):
            seen.clear()
            ctx = build.BuildContext(cuda_kernels=True, take_rows=True, row_products=rows, guards=[])
            with build.active(ctx):
                got = gather_traced(table, ids)
                const = gather_traced(table, np.array(-2, np.int64))
            assert (seen[0] is ids) == rows and seen[0].dtype == (mx.int64 if rows else mx.int32)
            np.testing.assert_array_equal(np.array(got), np.take(np.array(table), np.array(ids), 0))
            np.testing.assert_array_equal(np.array(const), np.array(table)[-2])
            assert len(ctx.guards) == 2 and all(bool(g.all().item()) for g in ctx.guards)


def test_quantized_embedding_takes_rows_with_the_contract(monkeypatch):
    """Everywhere: GatherBlockQuantized's rows (the packed bytes, the scales, the zero points) go to ``take_rows`` (its
    contract standing in) where the build asks for it, with the same dequantized rows as ``mx.take`` gives."""
    from ortmlx.kernels.ops.contrib_quant import dequantize_gathered
    calls = []
    monkeypatch.setattr(cuda_kernels, "cuda_backend", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(cuda_kernels, "take_rows",
                        lambda d, i, a=0: calls.append(d.dtype) or reference_take_rows(d, i, a))
    rng = np.random.default_rng(7)
    data = mx.array(rng.integers(0, 256, (40, 16)).astype(np.uint8))          # 32 4-bit columns a row
    scales = mx.array(rng.standard_normal((40, 2)).astype(np.float16))         # blocks of 16
    zps = mx.array(rng.integers(0, 256, (40, 1)).astype(np.uint8))
    flat = mx.array(np.array([3, 39, 0, 3], np.int32))
    with mx.stream(mx.cpu):
        for on in (True, False):
            calls.clear()
            with build.active(build.BuildContext(cuda_kernels=True, take_rows=on, guards=[])):
                got = dequantize_gathered(data, scales, zps, flat, 0, 32, 2, 16, 4)
            assert calls == ([mx.uint8, mx.float16, mx.uint8] if on else []), calls
            if on:
                first = np.array(got)
            else:
                np.testing.assert_array_equal(np.array(got), first)
    assert cuda_kernels.take_reason(data, flat, 0) is None
    assert cuda_kernels.take_reason(data.astype(mx.bool_), flat, 0).startswith("data")


def reference_take_dequant_rows(data, scales, zero_points, idx, block_size, bits):
    """``cuda_kernels.take_dequant_rows``' contract: ``dequantize_gathered`` over the rows, indices in [-N, 0) counted
    from the end, then clamped into [0, N)."""
    from ortmlx.kernels.ops.contrib_quant import dequantize_gathered
    n, cols = data.shape[0], data.shape[1] * 8 // bits
    flat = idx.reshape(-1).astype(mx.int64)
    flat = mx.clip(mx.where(flat < 0, flat + n, flat), 0, n - 1).astype(mx.int32)
    return dequantize_gathered(data, scales, zero_points, flat, 0, cols, -(-cols // block_size), block_size, bits)


# (bits, block size, scales' type, zero points): GatherBlockQuantized's embeddings as genai's builder makes them
GBQ_CASES = [(4, 16, mx.float16, True), (4, 32, mx.float32, False), (8, 16, mx.float16, True),
             (8, 16, mx.float32, False)]
GBQ_IDS = [f"{b}-bit block {k} {str(t).split('.')[-1]} zero points {z}" for b, k, t, z in GBQ_CASES]


def _gbq(bits: int, block: int, stype, zp: bool, n: int = 40, cols: int = 64):
    """Packed data [n, cols * bits / 8], scales [n, cols / block] and packed zero points (or None), random."""
    rng = np.random.default_rng(bits * block)
    kb = cols // block
    data = mx.array(rng.integers(0, 256, (n, cols * bits // 8)).astype(np.uint8))
    scales = mx.array((rng.standard_normal((n, kb)) * 0.1).astype(np.float32)).astype(stype)
    zps = mx.array(rng.integers(0, 256, (n, -(-kb * bits // 8))).astype(np.uint8)) if zp else None
    return data, scales, zps, cols


@pytest.mark.parametrize("bits,block,stype,zp", GBQ_CASES, ids=GBQ_IDS)
def test_traced_quantized_embedding_is_one_kernel_for_a_replayed_step(monkeypatch, bits, block, stype, zp):
    """With ``row_products`` (tuning replay) a traced GatherBlockQuantized is ``take_dequant_rows`` (its contract
    standing in) on the indices as they came, with the eager translator's rows and the same guard."""
    from ortmlx.compiled.decode_ops import gather_block_quantized_traced
    from ortmlx.kernels.ops.contrib_quant import gather_block_quantized
    seen = []
    monkeypatch.setattr(cuda_kernels, "cuda_backend", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(cuda_kernels, "take_dequant_rows",
                        lambda *a: seen.append(a[3]) or reference_take_dequant_rows(*a))
    data, scales, zps, cols = _gbq(bits, block, stype, zp)
    ids = mx.array(np.array([[3, -1, 39], [0, -40, 7]], np.int64))
    want = gather_block_quantized(data, np.array(ids), scales, zps, bits=bits, block_size=block)
    assert want.shape == (2, 3, cols) and want.dtype == stype
    with mx.stream(mx.cpu):
        for rows in (False, True):
            seen.clear()
            ctx = build.BuildContext(cuda_kernels=True, row_products=rows, guards=[])
            with build.active(ctx):
                got = gather_block_quantized_traced(data, ids, scales, zps, bits=bits, block_size=block)
            assert (len(seen) == 1 and seen[0] is ids) == rows, seen
            np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))
            assert got.dtype == stype and len(ctx.guards) == 1 and bool(ctx.guards[0].all().item())
            with build.active(ctx):
                gather_block_quantized_traced(data, mx.array(np.array([40], np.int64)), scales, zps, bits=bits,
                                              block_size=block)
            assert not bool(ctx.guards[1].all().item())     # past the table: the guard fails the call


def test_take_dequant_reason_names_what_it_does_not_take():
    data, scales, zps, _ = _gbq(4, 16, mx.float16, True)
    idx = mx.array(np.array([1], np.int64))
    r = cuda_kernels.take_dequant_reason
    assert r(data, scales, zps, idx, 16, 4) is None and r(data, scales, None, idx, 16, 4) is None
    assert r(data.astype(mx.int8), scales, zps, idx, 16, 4).startswith("data")
    assert r(data, scales, zps, idx, 16, 2).startswith("data")
    assert r(data, scales.astype(mx.bfloat16), zps, idx, 16, 4).startswith("scales")
    assert r(data, scales, zps, idx, 32, 4).startswith("scales")          # a block size the scales do not have
    assert r(data, scales, zps[:, :1], idx, 16, 4).startswith("zero_points")
    assert r(data, scales, zps, idx.astype(mx.int16), 16, 4).startswith("indices")


@gpu_only
@pytest.mark.parametrize("bits,block,stype,zp", GBQ_CASES, ids=GBQ_IDS)
def test_take_dequant_rows_kernel(bits, block, stype, zp):
    """On the GPU: GatherBlockQuantized's rows in one kernel, bit for bit ``dequantize_gathered``'s over the same rows
    (MLX's half product); a negative index counts from the end, one past either end reads the nearest row."""
    data, scales, zps, cols = _gbq(bits, block, stype, zp)
    for idx in (np.array([0, 39, 5], np.int32), np.array([[-1, 3], [-40, 60]], np.int64)):
        with mx.stream(mx.gpu):
            got = cuda_kernels.take_dequant_rows(data, scales, zps, mx.array(idx), block, bits)
            want = reference_take_dequant_rows(data, scales, zps, mx.array(idx), block, bits)
            mx.eval(got, want)
        assert got.shape == (idx.size, cols) and got.dtype == stype
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


@gpu_only
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32, mx.uint8, mx.int32])
def test_take_rows_kernel(dtype):
    """On the GPU: rows of a table (row-major, transposed, a slice) at 1-D and 2-D int32 / int64 indices, bit for bit
    the table's rows; a negative index counts from the end; one past either end reads the nearest row (a traced guard
    rejects that call), never past the table."""
    rng = np.random.default_rng(5)
    base = mx.array(rng.standard_normal((300, 40)).astype(np.float32)).astype(dtype)
    ids = rng.integers(0, 37, (3, 9)).astype(np.int32)
    with mx.stream(mx.gpu):
        for table in (base[:37], base[:40].T[:, :37].T, base[5:42, 3:30]):
            tn = np.array(table.astype(mx.float32))
            for idx in (ids, ids[0], np.array([0, 36, -4, 90, -37, -60], np.int32), ids.astype(np.int64),
                        np.array([-1, 2, -80], np.int64)):
                got = cuda_kernels.take_rows(table, mx.array(idx))
                mx.eval(got)
                n = tn.shape[0]
                want = tn[np.clip(np.where(idx < 0, idx + n, idx), 0, n - 1)]
                assert got.shape == idx.shape + (tn.shape[1],) and got.dtype == dtype
                np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want)


@gpu_only
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32, mx.uint8])
def test_take_rows_kernel_any_axis(dtype):
    """On the GPU: ``take_rows`` along every axis of 1-D to 4-D data (row-major, transposed, sliced), bit for bit
    ``np.take`` of the clamped indices, one index and several."""
    rng = np.random.default_rng(9)
    base = mx.array(rng.standard_normal((6, 7, 5, 4)).astype(np.float32)).astype(dtype)
    cases = [base, base.transpose(2, 0, 3, 1), base[1:5, ::2, 1:], base[2, :, 3], base[:, 4], base.reshape(-1)]
    with mx.stream(mx.gpu):
        for data in cases:
            dn = np.array(data.astype(mx.float32))
            for a in range(data.ndim):
                n = data.shape[a]
                for idx in (np.array([n - 1], np.int32), rng.integers(-2, n + 2, (2, 3)).astype(np.int32)):
                    got = cuda_kernels.take_rows(data, mx.array(idx), a)
                    mx.eval(got)
                    want = np.take(dn, np.clip(np.where(idx < 0, idx + n, idx), 0, n - 1), axis=a)
                    assert got.shape == want.shape and got.dtype == dtype, (data.shape, a, idx.shape)
                    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want,
                                                  err_msg=f"{data.shape} axis {a}")


@gpu_only
def test_ep_embedding_gather_matches_cpu_ep(monkeypatch):
    """An embedding Gather (int64 ids, negative ones too) through the EP on the GPU, eager and compiled, equal to the
    CPU EP with ``take_rows`` in use."""
    calls = []
    real = cuda_kernels.take_rows
    monkeypatch.setattr(cuda_kernels, "take_rows", lambda d, i, a=0: calls.append(1) or real(d, i, a))
    rng = np.random.default_rng(6)
    table = rng.standard_normal((1000, 64)).astype(np.float16)
    m = make_model([helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)], [("ids", T.INT64, ["b", "s"])],
                   [("y", T.FLOAT16, None)], initializers={"table": table})
    cpu = session(m, "CPUExecutionProvider", record=False)
    for opts in ({"device": "gpu", "tuning": "take_rows=1"},
                 {"device": "gpu", "no_compile": "1", "tuning": "take_rows=1"}):
        sess = session(m, options=opts)
        for shape in ((1, 7), (1, 7), (2, 5), (1, 1), (1, 1)):
            ids = rng.integers(-1000, 1000, shape).astype(np.int64)
            np.testing.assert_array_equal(sess.run(None, {"ids": ids})[0], cpu.run(None, {"ids": ids})[0])
    assert len(calls) >= 4, f"kernel used {len(calls)} times"


# (head, rotary half, interleaved, cache type, position ids): a 0.5B row, a partial rotation, interleaved, float32
SETUP_CASES = [(64, 32, False, mx.float16, None), (128, 32, False, mx.float16, mx.int64),
               (64, 32, True, mx.float32, mx.int32), (96, 48, False, mx.bfloat16, None)]


@gpu_only
@pytest.mark.parametrize("head,half,interleaved,ctype,pid", SETUP_CASES,
                         ids=[f"H{c[0]} half{c[1]}{' inter' if c[2] else ''} {c[3]} {c[4]}" for c in SETUP_CASES])
def test_decode_setup_equals_the_lengths_and_rotary_tables(head, half, interleaved, ctype, pid):
    from ortmlx.kernels.ops.contrib_attention import rotary_tables
    rng = np.random.default_rng(head + half)
    rows, b = 50, 3
    cos = mx.array(rng.standard_normal((rows, half)).astype(np.float32)).astype(ctype)
    sin = mx.array(rng.standard_normal((rows, half)).astype(np.float32)).astype(ctype)
    seqlens = mx.array(np.array([0, 17, 60], np.int32))            # 60: past the cache, clamped as take_rows does
    pids = None if pid is None else mx.array(np.array([[5], [-3], [-70]]), pid)   # -3: row 47; -70: row 0
    assert cuda_kernels.decode_setup_reason(seqlens, pids, cos, sin, b, head) is None
    past, total, c, s = cuda_kernels.decode_setup(seqlens, pids, cos, sin, head, interleaved)
    pos = (seqlens if pids is None else pids.reshape(-1)).reshape(b, 1)
    with build.active(build.BuildContext(cuda_kernels=True, take_rows=True)):
        want_c, want_s = rotary_tables(cos, sin, mx.clip(mx.where(pos < 0, pos + rows, pos), 0, rows - 1), head,
                                       interleaved)
    np.testing.assert_array_equal(np.array(past), [0, 17, 60])
    np.testing.assert_array_equal(np.array(total), [1, 18, 61])
    np.testing.assert_array_equal(np.array(c), np.array(want_c).reshape(b, head))
    np.testing.assert_array_equal(np.array(s), np.array(want_s).reshape(b, head))


@gpu_only
def test_decode_setup_without_a_cache_makes_the_lengths():
    seqlens = mx.array(np.array([4, 9], np.int32))
    past, total, c, s = cuda_kernels.decode_setup(seqlens, None, None, None, 64, False)
    assert c is None and s is None
    np.testing.assert_array_equal(np.array(past), [4, 9])
    np.testing.assert_array_equal(np.array(total), [5, 10])


def test_decode_setup_reason_names_what_it_does_not_take():
    s32 = mx.zeros((2,), mx.int32)
    cache = mx.zeros((8, 32), mx.float16)
    assert "seqlens_k" in cuda_kernels.decode_setup_reason(s32.astype(mx.int64), None, cache, cache, 2, 64)
    assert "position_ids" in cuda_kernels.decode_setup_reason(s32, mx.zeros((2, 1), mx.float32), cache, cache, 2, 64)
    assert "cos_cache" in cuda_kernels.decode_setup_reason(s32, None, cache, cache, 2, 32)
    assert cuda_kernels.decode_setup_reason(s32, None, cache, cache, 2, 64) is None
