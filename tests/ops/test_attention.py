"""ai.onnx Attention (23/24) against ORT's CPU EP (fp32 rtol 1e-4 atol 1e-5; fp16 rtol/atol 1e-2)."""
import numpy as np
import pytest
from onnx import TensorProto as T, helper

from _nnutil import check, check_bf16, rand
from ortmlx.testing import make_model

B, SQ, SKV, D = 2, 3, 4, 8

CASES = [  # (id, q heads, kv heads, 3-D inputs, past length, mask kind, attrs, n outputs)
    ("mha", 2, 2, False, 0, None, {}, 1),
    ("gqa", 4, 2, False, 0, None, {}, 1),
    ("mqa", 4, 1, False, 0, None, {}, 1),
    ("causal", 2, 2, False, 0, None, {"is_causal": 1}, 1),
    ("causal_past", 2, 2, False, 2, None, {"is_causal": 1}, 3),
    ("past_gqa", 4, 2, False, 3, None, {}, 3),
    ("bool_mask", 2, 2, False, 0, "bool", {}, 1),
    ("float_mask", 2, 2, False, 0, "float", {}, 1),
    ("float_mask_2d", 2, 2, False, 0, "float2d", {}, 1),
    ("bool_mask_causal_past", 2, 2, False, 2, "bool", {"is_causal": 1}, 3),
    ("scale", 2, 2, False, 0, None, {"scale": 0.3}, 1),
    ("softcap", 2, 2, False, 0, "float", {"softcap": 2.0}, 1),
    ("3d", 2, 2, True, 0, None, {}, 1),
    ("3d_gqa_causal", 4, 2, True, 0, None, {"is_causal": 1}, 1),
    ("3d_past", 2, 1, True, 2, "float", {}, 3),
    ("qk0", 2, 2, False, 0, "float", {"qk_matmul_output_mode": 0}, 4),
    ("qk1", 2, 2, False, 0, "float", {"qk_matmul_output_mode": 1, "softcap": 3.0}, 4),
    ("qk2", 2, 2, False, 0, "float", {"qk_matmul_output_mode": 2, "softcap": 3.0}, 4),
    ("qk3", 2, 2, False, 0, "float", {"qk_matmul_output_mode": 3}, 4),
    ("qk3_past", 2, 2, False, 1, "float", {"qk_matmul_output_mode": 3}, 4),
    ("softmax_precision", 2, 2, False, 0, None, {"softmax_precision": T.FLOAT}, 1),
]


def attention_model(t, hq, hkv, three_d, past, mask, attrs, n_out, opset=23, b=B):
    if three_d:
        attrs = {**attrs, "q_num_heads": hq, "kv_num_heads": hkv}
        shapes = {"q": (b, SQ, hq * D), "k": (b, SKV, hkv * D), "v": (b, SKV, hkv * D)}
    else:
        shapes = {"q": (b, hq, SQ, D), "k": (b, hkv, SKV, D), "v": (b, hkv, SKV, D)}
    total = past + SKV
    ins = [("q", t, shapes["q"]), ("k", t, shapes["k"]), ("v", t, shapes["v"])]
    names = ["q", "k", "v"]
    if mask is not None:
        ms = (SQ, total) if mask == "float2d" else (b, 1, SQ, total)
        ins.append(("m", T.BOOL if mask == "bool" else t, ms))
        names.append("m")
    if past:
        names += ["" if mask is None else None, "pk", "pv"]
        names = [n for n in names if n is not None]
        ins += [("pk", t, (b, hkv, past, D)), ("pv", t, (b, hkv, past, D))]
    outs = ["y", "present_k", "present_v", "qk"][:n_out]
    if n_out == 4 and not past:
        outs[1] = outs[2] = ""
    node = helper.make_node("Attention", names, outs, **attrs)
    return make_model([node], ins, [(o, t, None) for o in outs if o], opset=opset), ins


def feeds_for(ins, t, seed=0):
    feeds = {}
    for k, (n, tt, s) in enumerate(ins):
        if tt == T.BOOL:
            m = np.random.default_rng(seed + 7).random(s) > 0.3
            m[..., 0] = True                      # no fully masked rows (covered separately)
            feeds[n] = m
        else:
            feeds[n] = rand(s, t, seed + k, -2, 2)
    return feeds


@pytest.mark.parametrize("t", [T.FLOAT, T.FLOAT16])
@pytest.mark.parametrize("cid,hq,hkv,three_d,past,mask,attrs,n_out", CASES, ids=[c[0] for c in CASES])
def test_attention(cid, hq, hkv, three_d, past, mask, attrs, n_out, t):
    m, ins = attention_model(t, hq, hkv, three_d, past, mask, attrs, n_out)
    check(m, feeds_for(ins, t), t)


@pytest.mark.parametrize("cid,hq,hkv,three_d,past,mask,attrs,n_out",
                         [c for c in CASES if c[0] in ("gqa", "causal_past", "3d", "qk3")], ids=lambda c: str(c))
def test_attention_24(cid, hq, hkv, three_d, past, mask, attrs, n_out):
    m, ins = attention_model(T.FLOAT, hq, hkv, three_d, past, mask, attrs, n_out, opset=24)
    check(m, feeds_for(ins, T.FLOAT))


@pytest.mark.parametrize("causal", [0, 1])
def test_attention_nonpad_kv_seqlen(causal):
    q, k, v = (B, 2, SQ, D), (B, 2, SKV, D), (B, 2, SKV, D)
    node = helper.make_node("Attention", ["q", "k", "v", "", "", "", "n"], ["y"], is_causal=causal)
    m = make_model([node], [("q", T.FLOAT, q), ("k", T.FLOAT, k), ("v", T.FLOAT, v), ("n", T.INT64, (B,))],
                   [("y", T.FLOAT, None)], opset=24)
    check(m, {"q": rand(q), "k": rand(k, seed=1), "v": rand(v, seed=2), "n": np.array([SKV, SQ], np.int64)})


def test_attention_zero_batch():
    # ORT's CPU kernel rejects batch 0; so do we, with a message naming the node
    from ortmlx.testing import session
    m, ins = attention_model(T.FLOAT, 2, 2, False, 0, None, {}, 1, b=0)
    with pytest.raises(Exception, match="Attention.*batch size 0"):
        session(m).run(None, feeds_for(ins, T.FLOAT))


def test_attention_bool_mask_fully_masked_row():
    m, ins = attention_model(T.FLOAT, 2, 2, False, 0, "bool", {}, 1)
    f = feeds_for(ins, T.FLOAT)
    f["m"][0, 0, 1, :] = False
    check(m, f)


def test_attention_short_mask_refused():
    # a mask shorter than the total sequence (spec: -inf padding) is refused; ORT's CPU kernel rejects it
    from ortmlx import partition_reports
    from ortmlx.testing import session
    q, k = (1, 2, SQ, D), (1, 2, SKV, D)
    node = helper.make_node("Attention", ["q", "k", "v", "m"], ["y"])
    m = make_model([node], [("q", T.FLOAT, q), ("k", T.FLOAT, k), ("v", T.FLOAT, k), ("m", T.FLOAT, (SQ, SKV - 1))],
                   [("y", T.FLOAT, None)], opset=24)
    with pytest.raises(Exception, match="inconsistent total_sequence_length"):
        session(m).run(None, {"q": rand(q), "k": rand(k, seed=1), "v": rand(k, seed=2), "m": rand((SQ, SKV - 1))})
    assert any(u.op == "Attention" for u in partition_reports()[-1].unclaimed)


@pytest.mark.parametrize("attrs", [{}, {"is_causal": 1}, {"softcap": 2.0, "scale": 0.5}])
def test_attention_bf16(attrs):
    q, k = (1, 4, SQ, D), (1, 2, SKV, D)
    check_bf16("Attention", [("q", q), ("k", k), ("v", k)], attrs=attrs, opset=23,
               feeds={"q": rand(q, lo=-2, hi=2), "k": rand(k, seed=1, lo=-2, hi=2), "v": rand(k, seed=2)})


@pytest.mark.parametrize("past", [0, 2])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1)])
def test_attention_self_causal(past, hq, hkv):
    # q and kv lengths equal: the fused MLX kernel's lower-right causal mask is ONNX's offset-aware one
    q, kv = (B, hq, SQ, D), (B, hkv, SQ, D)
    names, ins = ["q", "k", "v"], [("q", T.FLOAT, q), ("k", T.FLOAT, kv), ("v", T.FLOAT, kv)]
    outs = ["y"]
    if past:
        names += ["", "pk", "pv"]
        ins += [("pk", T.FLOAT, (B, hkv, past, D)), ("pv", T.FLOAT, (B, hkv, past, D))]
        outs += ["present_k", "present_v"]
    m = make_model([helper.make_node("Attention", names, outs, is_causal=1)], ins,
                   [(o, T.FLOAT, None) for o in outs], opset=23)
    check(m, feeds_for(ins, T.FLOAT))
