"""com.microsoft MoE / QMoE vs ORT's CPU EP (float32 within 1e-4; float16 within one fp16 rounding of the
output's magnitude: ORT's half GEMM rounds differently from a float32 product rounded once).

QMoE: 4-bit experts at accuracy_level 0 equal the CPU EP. 8-bit block-wise experts have no float kernel on
the CPU EP (it quantizes activations to int8 at every level): those are compared exactly with the CPU EP's
float MoE on the dequantized weights, and the distance to the CPU EP's own QMoE is bounded."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from ortmlx.testing import assert_close, check_against_cpu, make_model, session, unclaimed_ops

MS = {"com.microsoft": 1}
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
NP = {F32: np.float32, F16: np.float16}
TOL = {F32: dict(rtol=1e-4, atol=1e-5), F16: dict(rtol=2e-3, atol=4e-3)}
GPT_OSS = dict(activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)


def moe_model(t, e, h, inter, k, act, *, norm=1, bias=True, three_d=False, **attrs):
    fc1 = 2 * inter if act == "swiglu" else inter
    r = np.random.default_rng(1)
    inits = {"w1": (r.standard_normal((e, fc1, h)) * 0.3).astype(NP[t]),
             "w2": (r.standard_normal((e, h, inter)) * 0.3).astype(NP[t])}
    if bias:
        inits["b1"] = (r.standard_normal((e, fc1)) * 0.1).astype(NP[t])
        inits["b2"] = (r.standard_normal((e, h)) * 0.1).astype(NP[t])
    if act == "swiglu":
        attrs.setdefault("swiglu_fusion", 1)
    node = helper.make_node("MoE", ["x", "r", "w1", "b1" if bias else "", "w2", "b2" if bias else ""], ["y"],
                            domain="com.microsoft", k=k, activation_type=act, normalize_routing_weights=norm, **attrs)
    x_shape = ["B", "S", h] if three_d else ["T", h]
    return make_model([node], [("x", t, x_shape), ("r", t, ["T", e])], [("y", t, None)], inits, extra_opsets=MS)


def feeds(t, n_tok, h, e, seed=0, three_d=False):
    r = np.random.default_rng(seed)
    x = r.standard_normal((2, n_tok // 2, h) if three_d else (n_tok, h)).astype(NP[t])
    return {"x": x, "r": r.standard_normal((n_tok, e)).astype(NP[t])}


# (id, dtype, experts, hidden, inter, k, activation, kwargs)
MOE_CASES = [
    ("swiglu_gpt_oss", F32, 4, 16, 8, 2, "swiglu", GPT_OSS),
    ("swiglu_lfm2", F32, 4, 16, 8, 2, "swiglu", dict(activation_alpha=1.0, activation_beta=0.0)),
    ("relu", F32, 4, 16, 8, 2, "relu", {}),
    ("gelu_tanh", F32, 4, 16, 8, 2, "gelu", {}),
    ("silu_top3_no_bias_no_norm", F32, 8, 32, 16, 3, "silu", dict(norm=0, bias=False)),
    ("identity_top1", F32, 6, 16, 8, 1, "identity", {}),
    ("three_d_input", F32, 4, 16, 8, 2, "swiglu", dict(three_d=True, **GPT_OSS)),
    ("fp16_swiglu", F16, 4, 16, 8, 2, "swiglu", GPT_OSS),
    ("fp16_silu_top3", F16, 8, 32, 16, 3, "silu", {}),
]


@pytest.mark.parametrize("case", MOE_CASES, ids=[c[0] for c in MOE_CASES])
def test_moe(case):
    _, t, e, h, inter, k, act, kw = case
    model = moe_model(t, e, h, inter, k, act, **kw)
    check_against_cpu(model, [feeds(t, 6, h, e, seed=i, three_d=kw.get("three_d", False)) for i in range(2)], **TOL[t])


def test_moe_routing_ties_go_to_the_higher_expert():
    """Equal router probabilities: ORT's partial_sort on (prob, index) pairs keeps the higher index."""
    model = moe_model(F32, 4, 16, 8, 2, "relu", norm=0)
    r = np.array([[0.5, 0.5, 0.5, 0.1], [0.0, 1.0, 1.0, 1.0], [2.0, 2.0, 0.0, 0.0]], np.float32)
    f = {"x": np.random.default_rng(3).standard_normal((3, 16)).astype(np.float32), "r": r}
    check_against_cpu(model, [f])


@pytest.mark.parametrize("t", [F32, F16])
def test_moe_decode_token(t):
    """One token (a decode step)."""
    model = moe_model(t, 8, 32, 16, 2, "swiglu", **GPT_OSS)
    check_against_cpu(model, [feeds(t, 1, 32, 8, seed=7)], **TOL[t])


def test_moe_bf16():
    from _contrib_bf16 import check_bf16_vs_fp32
    model = moe_model(F32, 4, 16, 8, 2, "swiglu", **GPT_OSS)
    # bf16 rounding of fc1, the activation and fc2 (2^-8 relative each) on outputs of magnitude ~2
    check_bf16_vs_fp32(model, [feeds(F32, 6, 16, 4)], rtol=3e-2, atol=6e-2)


# (id, attrs, model kwargs) refused at claim time; ORT's CPU EP runs them
def _sparse_mixer():
    m = moe_model(F32, 4, 16, 8, 2, "relu")
    n = m.graph.node[0]
    n.attribute.extend([helper.make_attribute("use_sparse_mixer", 1)])
    return m


@pytest.mark.parametrize("make,reason", [
    (lambda: moe_model(F16, 4, 16, 8, 2, "silu", norm=0), "normalize_routing_weights=0"),
    (_sparse_mixer, "use_sparse_mixer"),
])
def test_moe_refused(make, reason):
    import ortmlx
    model = make()
    try:
        s = session(model)
    except Exception:  # noqa: BLE001 - the CPU EP may reject what it was left (sparse mixer: top-2 only)
        s = None
    rep = ortmlx.partition_reports()[-1]
    assert [u.op for u in rep.unclaimed] == ["com.microsoft.MoE"] and reason in rep.unclaimed[0].reason, rep.format()
    if s is not None:
        assert unclaimed_ops(s) == {"MoE": 1}


def test_moe_fp16_no_normalize_is_wrong_on_cpu_ep():
    """Why float16 without normalize_routing_weights is refused: ORT's float16 kernel is far from its
    float32 kernel on the same (float16-representable) values; MLX's float16 is within fp16 rounding."""
    import copy

    import onnx
    m16 = moe_model(F16, 4, 16, 8, 2, "silu", norm=0)
    m32 = copy.deepcopy(m16)
    for i, init in enumerate(m32.graph.initializer):
        a = onnx.numpy_helper.to_array(init).astype(np.float32)
        m32.graph.initializer[i].CopyFrom(onnx.numpy_helper.from_array(a, init.name))
    for vi in list(m32.graph.input) + list(m32.graph.output):
        vi.type.tensor_type.elem_type = F32
    f = feeds(F16, 5, 16, 4, seed=2)
    c16 = session(m16, "CPUExecutionProvider", record=False).run(None, f)[0].astype(np.float32)
    c32 = session(m32, "CPUExecutionProvider", record=False).run(None, {k: v.astype(np.float32) for k, v in f.items()})[0]
    assert np.abs(c16 - c32).max() > 0.1 * np.abs(c32).max()
    from ortmlx.kernels.ops.contrib_moe import moe
    import mlx.core as mx
    ini = {i.name: onnx.numpy_helper.to_array(i) for i in m16.graph.initializer}
    got = moe(mx.array(f["x"]), mx.array(f["r"]), mx.array(ini["w1"]), mx.array(ini["b1"]), mx.array(ini["w2"]),
              mx.array(ini["b2"]), k=2, activation_type="silu", normalize_routing_weights=0)
    assert_close(np.array(got).astype(np.float32), c32, rtol=2e-3, atol=4e-3)


# ------------------------------------------------------------------------------ QMoE
def _quantize(w, bits, bs):
    e, n, kdim = w.shape
    bs = bs or kdim
    b = w.reshape(e, n, kdim // bs, bs)
    half = 1 << (bits - 1)
    sc = (np.abs(b).max(-1) / (half - 1) + 1e-6).astype(np.float32)
    q = np.clip(np.round(b / sc[..., None]) + half, 0, (1 << bits) - 1).astype(np.uint8).reshape(e, n, kdim)
    deq = ((q.astype(np.float32).reshape(e, n, kdim // bs, bs) - half) * sc[..., None]).reshape(e, n, kdim)
    if bits == 4:
        q = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return q, sc, deq


def qmoe_models(e, h, inter, k, act, bits, bs, **attrs):
    """(QMoE, the float MoE on its dequantized weights)."""
    fc1 = 2 * inter if act == "swiglu" else inter
    r = np.random.default_rng(2)
    q1, s1, d1 = _quantize((r.standard_normal((e, fc1, h)) * 0.3).astype(np.float32), bits, bs)
    q2, s2, d2 = _quantize((r.standard_normal((e, h, inter)) * 0.3).astype(np.float32), bits, bs)
    b1 = (r.standard_normal((e, fc1)) * 0.1).astype(np.float32)
    b2 = (r.standard_normal((e, h)) * 0.1).astype(np.float32)
    if act == "swiglu":
        attrs["swiglu_fusion"] = 1
    common = dict(k=k, activation_type=act, normalize_routing_weights=1, **attrs)
    q_attrs = dict(common, expert_weight_bits=bits, **({"block_size": bs} if bs else {}))
    io = ([("x", F32, ["T", h]), ("r", F32, ["T", e])], [("y", F32, None)])
    qn = helper.make_node("QMoE", ["x", "r", "q1", "s1", "b1", "q2", "s2", "b2"], ["y"], domain="com.microsoft",
                          **q_attrs)
    qm = make_model([qn], *io, {"q1": q1, "s1": s1 if bs else s1[..., 0], "b1": b1, "q2": q2,
                                "s2": s2 if bs else s2[..., 0], "b2": b2}, extra_opsets=MS)
    dn = helper.make_node("MoE", ["x", "r", "w1", "b1", "w2", "b2"], ["y"], domain="com.microsoft", **common)
    dm = make_model([dn], *io, {"w1": d1, "b1": b1, "w2": d2, "b2": b2}, extra_opsets=MS)
    return qm, dm


QMOE_CASES = [("int4_block32_swiglu", 4, 32, "swiglu", GPT_OSS), ("int4_block16_silu", 4, 16, "silu", {}),
              ("int4_per_row", 4, 0, "relu", {}), ("int8_block32", 8, 32, "swiglu", GPT_OSS),
              ("int8_per_row", 8, 0, "silu", {})]


@pytest.mark.parametrize("case", QMOE_CASES, ids=[c[0] for c in QMOE_CASES])
def test_qmoe(case):
    _, bits, bs, act, kw = case
    qm, dm = qmoe_models(4, 64, 32, 2, act, bits, bs, **kw)
    ms = session(qm)
    assert not unclaimed_ops(ms), dict(unclaimed_ops(ms))
    cpu_q = session(qm, "CPUExecutionProvider", record=False)
    cpu_float = session(dm, "CPUExecutionProvider", record=False)
    for i, n_tok in enumerate((5, 1)):
        f = feeds(F32, n_tok, 64, 4, seed=i)
        got, want_q, want_f = ms.run(None, f)[0], cpu_q.run(None, f)[0], cpu_float.run(None, f)[0]
        assert_close(got, want_f, rtol=1e-4, atol=2e-5, what="vs the float MoE on the dequantized weights")
        if bits == 4 or not bs:
            assert_close(got, want_q, rtol=1e-4, atol=2e-5, what="vs the CPU EP's QMoE")
        else:     # int8 activations on the CPU EP: within 3% of the output's magnitude
            assert np.abs(got - want_q).max() <= 3e-2 * np.abs(want_q).max()


def test_qmoe_refused_quant_type():
    import ortmlx
    qm, _ = qmoe_models(4, 64, 32, 2, "silu", 4, 32)
    qm.graph.node[0].attribute.extend([helper.make_attribute("weights_prepacked", 1)])
    try:
        session(qm)
    except Exception:  # noqa: BLE001 - the CPU EP may reject a prepacked layout it was not given
        pass
    rep = ortmlx.partition_reports()[-1]
    assert [u.op for u in rep.unclaimed] == ["com.microsoft.QMoE"] and "weights_prepacked" in rep.unclaimed[0].reason
