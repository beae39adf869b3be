"""com.microsoft Gelu, BiasGelu, FastGelu, QuickGelu vs ORT's CPU EP."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from ortmlx.testing import check_against_cpu, make_model, session, unclaimed_ops

MS = {"com.microsoft": 1}
F32, F16, F64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE
NP = {F32: np.float32, F16: np.float16, F64: np.float64}
TOL = {F32: dict(rtol=1e-4, atol=1e-5), F16: dict(rtol=1e-3, atol=1e-3)}


def act_model(op, t, shape, bias=False, **attrs):
    ins, inits = ["X"], {}
    if bias:
        ins.append("bias")
        inits["bias"] = np.random.default_rng(3).standard_normal(shape[-1]).astype(NP[t])
    node = helper.make_node(op, ins, ["Y"], domain="com.microsoft", **attrs)
    return make_model([node], [("X", t, shape)], [("Y", t, None)], inits, extra_opsets=MS)


# (id, op, dtype, shape, bias, attrs)
CASES = [
    ("gelu", "Gelu", F32, [2, 3, 16], False, {}),
    ("bias_gelu", "BiasGelu", F32, [2, 3, 16], True, {}),
    ("fast_gelu", "FastGelu", F32, [2, 3, 16], False, {}),
    ("fast_gelu_bias", "FastGelu", F32, [4, 16], True, {}),
    ("quick_gelu", "QuickGelu", F32, [2, 3, 16], False, {}),
    ("quick_gelu_alpha", "QuickGelu", F32, [2, 16], False, dict(alpha=1.5)),
    ("fast_gelu_fp16", "FastGelu", F16, [2, 3, 16], True, {}),
    ("gelu_fp16", "Gelu", F16, [2, 3, 16], False, {}),
    ("quick_gelu_fp16", "QuickGelu", F16, [2, 3, 16], False, {}),
    ("bias_gelu_fp16", "BiasGelu", F16, [2, 3, 16], True, {}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_contrib_activation(case):
    _, op, t, shape, bias, attrs = case
    model = act_model(op, t, shape, bias, **attrs)
    r = np.random.default_rng(0)
    x = (r.standard_normal(shape) * 3).astype(NP[t])
    x.reshape(-1)[:4] = [0.0, -10.0, 10.0, -0.5]
    check_against_cpu(model, [{"X": x}], **TOL[t])
