"""SkipLayerNormalization, SkipSimplifiedLayerNormalization, SimplifiedLayerNormalization vs ORT's CPU EP."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from ortmlx.testing import check_against_cpu, make_model, session, unclaimed_ops

MS = {"com.microsoft": 1}
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
NP = {F32: np.float32, F16: np.float16, TensorProto.DOUBLE: np.float64}
TOL = {F32: dict(rtol=1e-4, atol=1e-5), F16: dict(rtol=2e-3, atol=2e-3), TensorProto.DOUBLE: dict(rtol=1e-10, atol=1e-12)}
OUTS = ["output", "mean", "inv_std_var", "input_skip_bias_sum"]


def skip_model(op, t, shape, skip_shape, *, beta=False, bias=False, outputs=(0,), **attrs):
    h = shape[-1]
    r = np.random.default_rng(1)
    inits = {"gamma": r.standard_normal(h).astype(NP[t])}
    ins = ["input", "skip", "gamma"]
    if op == "SkipLayerNormalization":
        ins.append("beta" if beta else "")
        if beta:
            inits["beta"] = r.standard_normal(h).astype(NP[t])
    if bias:
        ins.append("bias")
        inits["bias"] = r.standard_normal(h).astype(NP[t])
    outs = [OUTS[i] if i in outputs else "" for i in range(max(outputs) + 1)]
    node = helper.make_node(op, ins, outs, domain="com.microsoft", **attrs)
    otypes = {0: t, 1: F32, 2: F32, 3: t}
    return make_model([node], [("input", t, shape), ("skip", t, skip_shape)],
                      [(OUTS[i], otypes[i], None) for i in outputs], inits, extra_opsets=MS)


# (id, op, dtype, input shape, skip shape, kwargs)
SKIP_CASES = [
    ("sln_3d", "SkipLayerNormalization", F32, [2, 3, 16], [2, 3, 16], dict(beta=True)),
    ("sln_bias_sum", "SkipLayerNormalization", F32, [2, 3, 16], [2, 3, 16], dict(beta=True, bias=True, outputs=(0, 3))),
    ("sln_skip_2d", "SkipLayerNormalization", F32, [2, 3, 16], [3, 16], dict(epsilon=1e-5)),
    ("sln_skip_b1", "SkipLayerNormalization", F32, [2, 3, 16], [1, 3, 16], dict(bias=True)),
    ("sln_stats", "SkipLayerNormalization", F32, [2, 3, 16], [2, 3, 16], dict(beta=True, outputs=(0, 1, 2, 3))),
    ("sln_inv_std_only", "SkipLayerNormalization", F32, [2, 3, 16], [2, 3, 16], dict(outputs=(0, 2))),
    ("sln_2d", "SkipLayerNormalization", F32, [4, 32], [4, 32], dict(beta=True)),
    ("sln_fp16", "SkipLayerNormalization", F16, [2, 3, 64], [2, 3, 64], dict(beta=True, bias=True, outputs=(0, 3))),
    ("ssln_3d", "SkipSimplifiedLayerNormalization", F32, [2, 3, 16], [2, 3, 16], dict(epsilon=1e-6)),
    ("ssln_sum", "SkipSimplifiedLayerNormalization", F32, [1, 5, 32], [1, 5, 32], dict(outputs=(0, 3))),
    ("ssln_bias_sum", "SkipSimplifiedLayerNormalization", F32, [2, 3, 16], [2, 3, 16], dict(bias=True, outputs=(0, 3))),
    ("ssln_stats", "SkipSimplifiedLayerNormalization", F32, [2, 3, 16], [2, 3, 16], dict(outputs=(0, 1, 2, 3))),
    ("ssln_fp16", "SkipSimplifiedLayerNormalization", F16, [2, 3, 64], [2, 3, 64], dict(outputs=(0, 3))),
]


@pytest.mark.parametrize("case", SKIP_CASES, ids=[c[0] for c in SKIP_CASES])
def test_skip_norm(case):
    _, op, t, shape, skip_shape, kw = case
    model = skip_model(op, t, shape, skip_shape, **kw)
    r = np.random.default_rng(0)
    feeds = [{"input": (r.standard_normal(shape) * 3 + 1).astype(NP[t]),
              "skip": r.standard_normal(skip_shape).astype(NP[t])} for _ in range(2)]
    check_against_cpu(model, feeds, **TOL[t])


def simplified_model(t, st, shape, scale_shape, outputs=1, **attrs):
    r = np.random.default_rng(2)
    node = helper.make_node("SimplifiedLayerNormalization", ["X", "scale"], ["Y", "inv_std_var"][:outputs], **attrs)
    outs = [("Y", st, None), ("inv_std_var", F32, None)][:outputs]
    return make_model([node], [("X", t, shape)], outs,
                      {"scale": r.standard_normal(scale_shape).astype(NP[st])}, opset=17)


# (id, X dtype, scale dtype, X shape, scale shape, n outputs, attrs)
SIMPLIFIED_CASES = [
    ("last_axis", F32, F32, [2, 3, 16], [16], 1, dict(epsilon=1e-6)),
    ("inv_std", F32, F32, [2, 3, 16], [16], 2, {}),
    ("axis_1", F32, F32, [2, 3, 8], [3, 8], 2, dict(axis=1)),
    ("axis_neg2", F32, F32, [2, 3, 8], [3, 8], 1, dict(axis=-2)),
    ("fp16", F16, F16, [2, 5, 64], [64], 2, {}),
]


@pytest.mark.parametrize("case", SIMPLIFIED_CASES, ids=[c[0] for c in SIMPLIFIED_CASES])
def test_simplified_layer_norm(case):
    _, t, st, shape, scale_shape, n_out, attrs = case
    model = simplified_model(t, st, shape, scale_shape, n_out, **attrs)
    r = np.random.default_rng(0)
    feeds = [{"X": (r.standard_normal(shape) * 2 + 0.5).astype(NP[t])} for _ in range(2)]
    check_against_cpu(model, feeds, **TOL[t])


def test_simplified_mixed_types_refused():
    """float32 X with float16 scale is refused: stays on CPU, answer still right."""
    model = simplified_model(F32, F16, [2, 3, 16], [16])
    s = session(model)
    assert unclaimed_ops(s) == {"SimplifiedLayerNormalization": 1}
    check_against_cpu(model, [{"X": np.ones((2, 3, 16), np.float32)}], all_on_mlx=False)


def test_skip_norm_bad_skip_shape_is_clear_error():
    model = skip_model("SkipSimplifiedLayerNormalization", F32, [2, 3, 16], ["a", "b", 16])
    f = {"input": np.ones((2, 3, 16), np.float32), "skip": np.ones((2, 2, 16), np.float32)}
    with pytest.raises(Exception, match="skip shape"):
        session(model).run(None, f)


# (id, dtype, shape, axis, with bias, n outputs)
LN1_CASES = [
    ("last_axis", F32, [2, 3, 16], -1, True, 1),
    ("stats", F32, [2, 3, 16], -1, True, 3),
    ("axis1_no_bias", F32, [2, 3, 8], 1, False, 1),
    ("fp16", F16, [2, 4, 32], -1, True, 1),
    ("fp64", TensorProto.DOUBLE, [2, 4, 32], -1, True, 1),
]


@pytest.mark.parametrize("case", LN1_CASES, ids=[c[0] for c in LN1_CASES])
def test_layer_norm_opset1(case):
    """ORT's ai.onnx LayerNormalization-1 (used by models exported below opset 17)."""
    _, t, shape, axis, bias, n_out = case
    r = np.random.default_rng(4)
    pshape = shape[axis % len(shape):]
    inits = {"scale": r.standard_normal(pshape).astype(NP[t])}
    ins = ["X", "scale"]
    if bias:
        inits["B"] = r.standard_normal(pshape).astype(NP[t])
        ins.append("B")
    outs = ["Y", "Mean", "InvStdDev"][:n_out]
    node = helper.make_node("LayerNormalization", ins, outs, axis=axis, epsilon=1e-5)
    model = make_model([node], [("X", t, shape)], [(o, t if o == "Y" else F32, None) for o in outs], inits, opset=16)
    x = (r.standard_normal(shape) * 2 + 1).astype(NP[t])
    check_against_cpu(model, [{"X": x}], **TOL[t])


# ORT's CPU EP has no bf16 kernels: bf16 on MLX vs float32 on CPU, same bf16-rounded values.
# Stated tolerance: one bf16 rounding of the output and of the sum (2^-8 relative) -> 1e-2.
@pytest.mark.parametrize("case", [c for c in SKIP_CASES if c[0] in ("sln_bias_sum", "ssln_bias_sum", "ssln_3d")],
                         ids=lambda c: c[0])
def test_skip_norm_bf16(case):
    from _contrib_bf16 import check_bf16_vs_fp32
    _, op, _, shape, skip_shape, kw = case
    model = skip_model(op, F32, shape, skip_shape, **kw)
    r = np.random.default_rng(0)
    f = {"input": (r.standard_normal(shape) * 3 + 1).astype(np.float32),
         "skip": r.standard_normal(skip_shape).astype(np.float32)}
    check_bf16_vs_fp32(model, [f], rtol=1e-2, atol=1e-2)


def test_simplified_layer_norm_bf16():
    from _contrib_bf16 import check_bf16_vs_fp32
    model = simplified_model(F32, F32, [2, 5, 64], [64])
    x = (np.random.default_rng(0).standard_normal((2, 5, 64)) * 2).astype(np.float32)
    check_bf16_vs_fp32(model, [{"X": x}], rtol=1e-2, atol=1e-2)
