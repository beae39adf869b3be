"""com.microsoft GroupQueryAttention / MultiHeadAttention / RotaryEmbedding vs ORT's CPU EP."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from ortmlx.testing import assert_close, check_against_cpu, make_model, session, unclaimed_ops

MS = {"com.microsoft": 1}
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
NP = {F32: np.float32, F16: np.float16}
TOL = {F32: dict(rtol=1e-4, atol=1e-5), F16: dict(rtol=1e-3, atol=1e-3)}   # fp16: float32 math, one rounding


def _rng(seed=0):
    return np.random.default_rng(seed)


def _cos_sin(max_pos, rd, base=10000.0):
    inv = 1.0 / base ** (np.arange(0, rd, 2) / rd)
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# ------------------------------------------------------------------------------ GQA
def gqa_model(t, n, kvn, h, *, packed=False, past=True, rotary_dim=0, max_pos=64, extra_inputs=(), **attrs):
    """A GroupQueryAttention graph as onnxruntime-genai's model builder emits it."""
    ins = ["query", "" if packed else "key", "" if packed else "value",
           "past_key" if past else "", "past_value" if past else "", "seqlens_k", "total_sequence_length"]
    inputs = [("query", t, ["B", "S", (n + 2 * kvn) * h if packed else n * h])]
    if not packed:
        inputs += [("key", t, ["B", "S", kvn * h]), ("value", t, ["B", "S", kvn * h])]
    if past:
        inputs += [("past_key", t, ["B", kvn, "P", h]), ("past_value", t, ["B", kvn, "P", h])]
    inputs += [("seqlens_k", TensorProto.INT32, ["B"]), ("total_sequence_length", TensorProto.INT32, [])]
    inits = {}
    if rotary_dim:
        ins += ["cos_cache", "sin_cache"]
        c, s = _cos_sin(max_pos, rotary_dim)
        inits = {"cos_cache": c.astype(NP[t]), "sin_cache": s.astype(NP[t])}
        attrs.setdefault("do_rotary", 1)
    for name, typ, shape in extra_inputs:
        while len(ins) < {"position_ids": 9, "attention_bias": 10, "head_sink": 11}[name]:
            ins.append("")
        ins.append(name)
        inputs.append((name, typ, shape))
    node = helper.make_node("GroupQueryAttention", ins, ["output", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=n, kv_num_heads=kvn, **attrs)
    outputs = [("output", t, None), ("present_key", t, None), ("present_value", t, None)]
    return make_model([node], inputs, outputs, inits, extra_opsets=MS)


def gqa_feeds(t, n, kvn, h, b, s, past_cap, seqlens, total, *, packed=False, seed=0, sink=False):
    r = _rng(seed)
    f = {}
    if packed:
        f["query"] = r.standard_normal((b, s, (n + 2 * kvn) * h)).astype(NP[t])
    else:
        f["query"] = r.standard_normal((b, s, n * h)).astype(NP[t])
        f["key"] = r.standard_normal((b, s, kvn * h)).astype(NP[t])
        f["value"] = r.standard_normal((b, s, kvn * h)).astype(NP[t])
    if past_cap is not None:
        f["past_key"] = r.standard_normal((b, kvn, past_cap, h)).astype(NP[t])
        f["past_value"] = r.standard_normal((b, kvn, past_cap, h)).astype(NP[t])
    f["seqlens_k"] = np.asarray(seqlens, np.int32)
    f["total_sequence_length"] = np.asarray(total, np.int32)
    if sink:
        f["head_sink"] = r.standard_normal((n,)).astype(NP[t])
    return f


def compare_gqa(model, feeds_list, tol, first_prompt_valid=None):
    """Every node on MLX; all outputs equal to CPU. ``first_prompt_valid``: per feed, per batch row,
    the number of valid (unpadded) query rows of a first prompt; ORT leaves padded rows undefined."""
    ms = session(model)
    cs = session(model, "CPUExecutionProvider", record=False)
    assert not unclaimed_ops(ms), dict(unclaimed_ops(ms))
    for k, f in enumerate(feeds_list):
        got, want = ms.run(None, f), cs.run(None, f)
        if first_prompt_valid is not None:
            for bi, valid in enumerate(first_prompt_valid[k]):
                assert_close(got[0][bi, :valid], want[0][bi, :valid], **tol, what=f"feed {k} output row {bi}")
            got, want = got[1:], want[1:]
        for name, g, w in zip(["output", "present_key", "present_value"][-len(got):], got, want):
            assert_close(g, w, **tol, what=f"feed {k} {name}")


# (id, dtype, n, kvn, h, attrs, model kwargs, [(b, s, past_cap, seqlens, total)])
GQA_CASES = [
    ("prefill_growing", F32, 4, 2, 16, {}, {}, [(1, 5, 0, [4], 5)]),
    ("decode_growing", F32, 4, 2, 16, {}, {}, [(2, 1, 6, [6, 6], 7)]),
    ("decode_shared_pad", F32, 4, 1, 16, {}, {}, [(3, 1, 12, [3, 7, 11], 12)]),
    ("prefill_shared_buffer", F32, 4, 2, 16, {}, {}, [(2, 5, 10, [4, 4], 5)]),
    ("chunked_prefill", F32, 2, 2, 8, {}, {}, [(1, 3, 10, [6], 7)]),
    ("rotary", F32, 4, 2, 16, {}, dict(rotary_dim=16), [(1, 6, 0, [5], 6), (2, 1, 8, [6, 3], 7)]),
    ("rotary_partial", F32, 4, 2, 32, {}, dict(rotary_dim=16), [(1, 6, 0, [5], 6), (2, 1, 8, [6, 3], 7)]),
    ("rotary_interleaved", F32, 4, 2, 16, dict(rotary_interleaved=1), dict(rotary_dim=16),
     [(1, 4, 0, [3], 4), (2, 1, 8, [5, 2], 6)]),
    ("packed_rotary", F32, 4, 2, 16, {}, dict(packed=True, rotary_dim=16), [(1, 4, 0, [3], 4), (2, 1, 8, [5, 7], 8)]),
    ("local_window", F32, 2, 1, 8, dict(local_window_size=3), {}, [(1, 8, 0, [7], 8), (2, 1, 10, [8, 4], 9)]),
    ("local_window_rotary_softcap", F32, 4, 2, 16, dict(local_window_size=2, softcap=1.5), dict(rotary_dim=16),
     [(2, 5, 0, [4, 4], 5), (2, 1, 8, [7, 5], 8)]),
    ("softcap", F32, 2, 1, 8, dict(softcap=2.0, scale=0.5), {}, [(1, 6, 0, [5], 6), (1, 1, 6, [6], 7)]),
    ("smooth_softmax", F32, 2, 1, 8, dict(smooth_softmax=1), {}, [(1, 6, 0, [5], 6), (1, 1, 6, [6], 7)]),
    ("fp16_rotary", F16, 4, 2, 16, {}, dict(rotary_dim=16), [(1, 6, 0, [5], 6), (2, 1, 8, [6, 3], 7)]),
    ("fp16_decode_pad", F16, 4, 2, 16, {}, {}, [(3, 1, 12, [3, 7, 11], 12)]),
]


@pytest.mark.parametrize("case", GQA_CASES, ids=[c[0] for c in GQA_CASES])
def test_gqa(case):
    _, t, n, kvn, h, attrs, mk, runs = case
    past = any(r[2] for r in runs)
    model = gqa_model(t, n, kvn, h, past=past, **mk, **attrs)
    feeds = [gqa_feeds(t, n, kvn, h, b, s, cap if past else None, sl, tot, packed=mk.get("packed", False), seed=i)
             for i, (b, s, cap, sl, tot) in enumerate(runs)]
    compare_gqa(model, feeds, TOL[t])


@pytest.mark.parametrize("past_cap", [None, 0, 10], ids=["no_past", "growing", "shared_buffer"])
def test_gqa_prefill_padded_batch(past_cap):
    """batch > 1 first prompt with right padding: seqlens_k differs per row."""
    model = gqa_model(F32, 4, 2, 16, past=past_cap is not None, rotary_dim=16)
    feeds = [gqa_feeds(F32, 4, 2, 16, 3, 6, past_cap, [5, 2, 3], 6)]
    compare_gqa(model, feeds, TOL[F32], first_prompt_valid=[[6, 3, 4]])


def test_gqa_chunked_prefill_batch2_is_clear_error():
    """ORT: batch_size must be 1 when sequence_length > 1 and past context is given."""
    model = gqa_model(F32, 2, 1, 16, past=True)
    f = gqa_feeds(F32, 2, 1, 16, 2, 3, 10, [6, 8], 9)
    with pytest.raises(Exception, match="batch_size must be 1"):
        session(model).run(None, f)


def test_gqa_bad_seqlens_is_clear_error():
    model = gqa_model(F32, 2, 1, 8, past=True)
    f = gqa_feeds(F32, 2, 1, 8, 1, 1, 4, [9], 5)
    with pytest.raises(Exception, match="seqlens_k"):
        session(model).run(None, f)


# (id, extra input, [(b, s, past_cap, seqlens, total, value)])
GQA_OPTIONAL_CASES = [
    ("head_sink", ("head_sink", F32, [4]), [(1, 5, None, [4], 5, "sink"), (2, 1, 8, [5, 7], 8, "sink")]),
    ("attention_bias_prefill", ("attention_bias", F32, ["a", "b", "c", "d"]),
     [(2, 5, None, [4, 4], 5, (2, 4, 5, 5)), (1, 5, None, [4], 5, (1, 1, 5, 5))]),
    ("attention_bias_decode", ("attention_bias", F32, ["a", "b", "c", "d"]),
     [(2, 1, 8, [5, 7], 8, (2, 1, 1, 8)), (2, 1, 8, [5, 6], 7, (1, 4, 1, 7))]),
    ("position_ids", ("position_ids", TensorProto.INT64, ["B", "S"]),
     [(2, 4, None, [3, 3], 4, [[0, 1, 2, 3], [5, 6, 7, 8]]), (2, 1, 8, [5, 6], 7, [[9], [2]]),
      (1, 3, 8, [6], 7, [[1, 7, 3]])]),
]


@pytest.mark.parametrize("case", GQA_OPTIONAL_CASES, ids=[c[0] for c in GQA_OPTIONAL_CASES])
def test_gqa_optional_inputs(case):
    """position_ids (first prompt: ORT reads only the first id), attention_bias, head_sink."""
    _, extra, runs = case
    past = any(r[2] for r in runs)
    model = gqa_model(F32, 4, 2, 16, past=past, rotary_dim=16, extra_inputs=[extra])
    r = _rng(7)
    feeds = []
    for i, (b, s, cap, sl, tot, val) in enumerate(runs):
        f = gqa_feeds(F32, 4, 2, 16, b, s, (cap or 0) if past else None, sl, tot, seed=i)
        if val == "sink":
            f["head_sink"] = r.standard_normal(4).astype(np.float32)
        elif extra[0] == "attention_bias":
            f["attention_bias"] = r.standard_normal(val).astype(np.float32)
        else:
            f["position_ids"] = np.asarray(val, np.int64)
        feeds.append(f)
    compare_gqa(model, feeds, TOL[F32])


def test_gqa_position_beyond_cos_cache_is_clear_error():
    model = gqa_model(F32, 2, 1, 16, past=True, rotary_dim=16, max_pos=8)
    f = gqa_feeds(F32, 2, 1, 16, 1, 1, 10, [9], 10)
    with pytest.raises(Exception, match="rotary cache"):
        session(model).run(None, f)


# ------------------------------------------------------------------------------ RotaryEmbedding
def rope_model(t, in_shape, rd_cache, max_pos=32, pos_shape=("B", "S"), **attrs):
    c, s = _cos_sin(max_pos, rd_cache)
    node = helper.make_node("RotaryEmbedding", ["input", "position_ids", "cos_cache", "sin_cache"], ["output"],
                            domain="com.microsoft", **attrs)
    return make_model([node], [("input", t, in_shape), ("position_ids", TensorProto.INT64, list(pos_shape))],
                      [("output", t, None)], {"cos_cache": c.astype(NP[t]), "sin_cache": s.astype(NP[t])},
                      extra_opsets=MS)


# (id, dtype, input shape, cos columns*2, position_ids, attrs)
ROPE_CASES = [
    ("bsd_full", F32, [2, 3, 32], 16, np.array([[0, 1, 2], [5, 6, 7]]), dict(num_heads=2)),
    ("bsd_offset_scalar", F32, [2, 3, 32], 16, np.array([4]), dict(num_heads=2)),
    ("bsd_no_num_heads", F32, [1, 4, 48], 16, np.array([[3, 1, 0, 9]]), {}),
    ("bsd_partial", F32, [2, 3, 64], 16, np.array([[0, 1, 2], [5, 6, 7]]), dict(num_heads=2, rotary_embedding_dim=16)),
    ("bsd_interleaved", F32, [2, 3, 32], 16, np.array([[0, 1, 2], [5, 6, 7]]), dict(num_heads=2, interleaved=1)),
    ("bnsh", F32, [2, 3, 5, 16], 16, np.array([[0, 1, 2, 3, 4], [9, 8, 7, 6, 5]]), {}),
    ("bnsh_partial_interleaved", F32, [1, 2, 4, 32], 16, np.array([2]),
     dict(num_heads=2, rotary_embedding_dim=16, interleaved=1)),
    ("fp16", F16, [2, 3, 32], 16, np.array([[0, 1, 2], [5, 6, 7]]), dict(num_heads=2)),
]


@pytest.mark.parametrize("case", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
def test_rotary_embedding(case):
    _, t, shape, rd, pos, attrs = case
    model = rope_model(t, shape, rd, pos_shape=[f"p{i}" for i in range(pos.ndim)], **attrs)
    x = _rng(0).standard_normal(shape).astype(NP[t])
    check_against_cpu(model, [{"input": x, "position_ids": pos.astype(np.int64)}], **TOL[t])


def test_rotary_embedding_position_out_of_cache_is_clear_error():
    model = rope_model(F32, [1, 2, 16], 16, max_pos=8, pos_shape=["a"])
    with pytest.raises(Exception, match="rotary cache"):
        session(model).run(None, {"input": np.ones((1, 2, 16), np.float32), "position_ids": np.array([7])})


# ------------------------------------------------------------------------------ MultiHeadAttention
def mha_model(t, n, h, *, past=False, mask=False, bias=False, hv=None, **attrs):
    """MultiHeadAttention as the model builder emits it for fp16/CPU (rotary done before, mask as bias)."""
    hv = hv or h
    ins = ["query", "key", "value", "bias" if bias else "", "", "attention_bias" if mask else ""]
    inputs = [("query", t, ["B", "S", n * h]), ("key", t, ["B", "L", n * h]), ("value", t, ["B", "L", n * hv])]
    inits = {}
    if bias:
        inits["bias"] = _rng(5).standard_normal(2 * n * h + n * hv).astype(NP[t])
    if mask:
        inputs.append(("attention_bias", t, ["a", "b", "S", "T"]))
    outs = ["output"]
    if past:
        ins += ["past_key", "past_value"]
        inputs += [("past_key", t, ["B", n, "P", h]), ("past_value", t, ["B", n, "P", hv])]
        outs += ["present_key", "present_value"]
    node = helper.make_node("MultiHeadAttention", ins, outs, domain="com.microsoft", num_heads=n, **attrs)
    return make_model([node], inputs, [(o, t, None) for o in outs], inits, extra_opsets=MS)


def mha_feeds(t, n, h, b, s, l, p=None, mask=None, hv=None, seed=0):
    hv = hv or h
    r = _rng(seed)
    f = {"query": r.standard_normal((b, s, n * h)), "key": r.standard_normal((b, l, n * h)),
         "value": r.standard_normal((b, l, n * hv))}
    if p is not None:
        f["past_key"] = r.standard_normal((b, n, p, h))
        f["past_value"] = r.standard_normal((b, n, p, hv))
    if mask is not None:
        f["attention_bias"] = np.where(r.random(mask) < 0.3, np.finfo(np.float32).min if t == F32 else -65504.0, 0.0)
    return {k: v.astype(NP[t]) for k, v in f.items()}


# (id, dtype, n, h, model kwargs, [(b, s, l, past, mask shape)])
MHA_CASES = [
    ("plain", F32, 2, 8, {}, [(2, 4, 6, None, None)]),
    ("scale_mask", F32, 2, 8, dict(mask=True, scale=0.3), [(2, 4, 4, None, (2, 1, 4, 4)), (1, 3, 3, None, (1, 2, 3, 3))]),
    ("past_mask", F32, 4, 8, dict(past=True, mask=True), [(2, 3, 3, 0, (2, 1, 3, 3)), (2, 1, 1, 5, (2, 1, 1, 6))]),
    ("unidirectional_past", F32, 2, 8, dict(past=True, unidirectional=1), [(1, 4, 4, 3, None)]),
    ("bias_vdim", F32, 2, 8, dict(bias=True, hv=4), [(2, 3, 5, None, None)]),
    ("fp16_past_mask", F16, 4, 16, dict(past=True, mask=True), [(2, 5, 5, 0, (2, 1, 5, 5)), (2, 1, 1, 5, (2, 1, 1, 6))]),
]


@pytest.mark.parametrize("case", MHA_CASES, ids=[c[0] for c in MHA_CASES])
def test_mha(case):
    _, t, n, h, mk, runs = case
    model = mha_model(t, n, h, **mk)
    feeds = [mha_feeds(t, n, h, b, s, l, p, m, hv=mk.get("hv"), seed=i) for i, (b, s, l, p, m) in enumerate(runs)]
    check_against_cpu(model, feeds, **TOL[t])


# (id, attrs) refused at claim time; ORT's CPU EP runs them
GQA_REFUSED = [
    ("local_window_0", dict(local_window_size=0)),
    ("non_causal", dict(causal=0)),
]


@pytest.mark.parametrize("case", GQA_REFUSED, ids=[c[0] for c in GQA_REFUSED])
def test_gqa_refused_stays_on_cpu(case):
    _, attrs = case
    model = gqa_model(F32, 2, 1, 16, past=False, **attrs)
    assert unclaimed_ops(session(model)) == {"GroupQueryAttention": 1}
    check_against_cpu(model, [gqa_feeds(F32, 2, 1, 16, 1, 4, None, [3], 4)], all_on_mlx=False)


# ------------------------------------------------------------------------------ ONNX RotaryEmbedding-23
# (id, input shape, rotary dim, with position_ids, attrs)
ROPE23_CASES = [
    ("bnsh_pos", [2, 3, 4, 16], 16, True, {}),
    ("bsd_pos_partial", [2, 4, 32], 8, True, dict(num_heads=2, rotary_embedding_dim=8)),
    ("bsd_interleaved", [2, 4, 32], 16, True, dict(num_heads=2, interleaved=1)),
    ("bnsh_no_pos", [2, 2, 3, 16], 16, False, {}),
]


@pytest.mark.parametrize("case", ROPE23_CASES, ids=[c[0] for c in ROPE23_CASES])
def test_rotary_embedding_23(case):
    _, shape, rd, with_pos, attrs = case
    b, s = shape[0], shape[-2] if len(shape) == 4 else shape[1]
    c, sn = _cos_sin(16, rd)
    pos = np.array([[(3 * i + j) % 16 for j in range(s)] for i in range(b)], np.int64)
    ins = ["X", "cos", "sin"] + (["pos"] if with_pos else [])
    inputs = [("X", F32, shape)] + ([("pos", TensorProto.INT64, [b, s])] if with_pos else [])
    if with_pos:
        inits = {"cos": c, "sin": sn}
    else:
        inits = {"cos": c[pos], "sin": sn[pos]}
    node = helper.make_node("RotaryEmbedding", ins, ["Y"], **attrs)
    model = make_model([node], inputs, [("Y", F32, None)], inits, opset=23)
    f = {"X": _rng(0).standard_normal(shape).astype(np.float32)}
    if with_pos:
        f["pos"] = pos
    check_against_cpu(model, [f])


# ------------------------------------------------------------------------------ bfloat16
# ORT's CPU EP has no bf16 kernels for these: bf16 on MLX vs float32 on CPU, same bf16-rounded values.
# Stated tolerance: the bf16 rounding of RoPE'd Q/K, of present and of the output (2^-8 relative each).
BF16_TOL = dict(rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("case", [c for c in GQA_CASES if c[0] in ("rotary", "packed_rotary", "decode_shared_pad",
                                                                   "local_window_rotary_softcap")],
                         ids=lambda c: c[0])
def test_gqa_bf16(case):
    from _contrib_bf16 import check_bf16_vs_fp32
    _, _, n, kvn, h, attrs, mk, runs = case
    past = any(r[2] for r in runs)
    model = gqa_model(F32, n, kvn, h, past=past, **mk, **attrs)
    feeds = [gqa_feeds(F32, n, kvn, h, b, s, cap if past else None, sl, tot, packed=mk.get("packed", False), seed=i)
             for i, (b, s, cap, sl, tot) in enumerate(runs)]
    check_bf16_vs_fp32(model, feeds, **BF16_TOL)


@pytest.mark.parametrize("case", [c for c in MHA_CASES if c[0] in ("past_mask", "bias_vdim")], ids=lambda c: c[0])
def test_mha_bf16(case):
    from _contrib_bf16 import check_bf16_vs_fp32
    _, _, n, h, mk, runs = case
    model = mha_model(F32, n, h, **mk)
    feeds = [mha_feeds(F32, n, h, b, s, l, p, m, hv=mk.get("hv"), seed=i) for i, (b, s, l, p, m) in enumerate(runs)]
    check_bf16_vs_fp32(model, feeds, **BF16_TOL)


@pytest.mark.parametrize("case", [c for c in ROPE_CASES if c[0] in ("bsd_full", "bnsh_partial_interleaved")],
                         ids=lambda c: c[0])
def test_rotary_embedding_bf16(case):
    from _contrib_bf16 import check_bf16_vs_fp32
    _, _, shape, rd, pos, attrs = case
    model = rope_model(F32, shape, rd, pos_shape=[f"p{i}" for i in range(pos.ndim)], **attrs)
    x = _rng(0).standard_normal(shape).astype(np.float32)
    check_bf16_vs_fp32(model, [{"input": x, "position_ids": pos.astype(np.int64)}], rtol=1e-2, atol=1e-2)


def test_rotary_embedding_23_bf16():
    from _contrib_bf16 import check_bf16_vs_fp32
    c, sn = _cos_sin(16, 16)
    node = helper.make_node("RotaryEmbedding", ["X", "cos", "sin", "pos"], ["Y"], interleaved=1)
    model = make_model([node], [("X", F32, [2, 3, 4, 16]), ("pos", TensorProto.INT64, [2, 4])], [("Y", F32, None)],
                       {"cos": c, "sin": sn}, opset=23)
    f = {"X": _rng(0).standard_normal((2, 3, 4, 16)).astype(np.float32),
         "pos": np.array([[0, 1, 2, 3], [7, 5, 3, 1]], np.int64)}
    check_bf16_vs_fp32(model, [f], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("shapeless", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("h, rd", [(16, 16), (16, 8), (32, 24)])
def test_rotary_partner_and_tables_by_copies(interleaved, h, rd, shapeless):
    """The rotation's partner features and cos/sin tables, made by slices and copies (no gather kernel for a new
    host to build; a shapeless trace's build keeps the gathers), are exactly the gathers they replace:
    ``x[..., perm]`` and the cache rows' columns."""
    import contextlib

    from ortmlx.kernels import build
    ctx = build.active(build.BuildContext(shapeless=True, guards=[])) if shapeless else contextlib.nullcontext()
    with ctx:
        assert build.shapeless() == shapeless
        _check_rotary_by_copies(interleaved, h, rd)


def _check_rotary_by_copies(interleaved: bool, h: int, rd: int) -> None:
    import mlx.core as mx

    from ortmlx.kernels.ops.contrib_attention import _partner, _rotary_perm, rotary_tables
    rng = np.random.default_rng(h + rd)
    x = rng.standard_normal((2, 3, 5, h)).astype(np.float16)
    got = np.array(_partner(mx.array(x), rd, interleaved))
    np.testing.assert_array_equal(got, np.take(x, _rotary_perm(h, rd, interleaved), axis=-1))
    cos = rng.standard_normal((9, rd // 2)).astype(np.float16)
    sin = rng.standard_normal((9, rd // 2)).astype(np.float16)
    pos = np.array([[0, 4, 8], [3, 3, 1]], np.int64)
    c, s = rotary_tables(mx.array(cos), mx.array(sin), mx.array(pos), h, interleaved)
    i = np.arange(h)
    col = np.where(i < rd, (i // 2) if interleaved else (i % (rd // 2)), 0)
    sign = np.where(i % 2 == 0, -1.0, 1.0) if interleaved else np.where(i < rd // 2, -1.0, 1.0)
    np.testing.assert_array_equal(np.array(c), cos[pos][..., col].astype(np.float32))
    np.testing.assert_array_equal(np.array(s), (sin[pos][..., col].astype(np.float32) * sign).astype(np.float32))
