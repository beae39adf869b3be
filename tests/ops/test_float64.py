"""float64: every single-input op MLX claims in float64 matches the CPU EP to double precision.

MLX's CPU backend computes some float64 transcendentals at float32 accuracy; those ops must
refuse float64. This table is generated from the registry, so a new op is covered by itself.
"""
import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

import ortmlx.kernels as k
from ortmlx.testing import make_model, session, unclaimed_ops

OPS = sorted({o.op_type for o in k.REGISTRY if o.domain == ""})
X = np.concatenate([np.linspace(-6, 6, 97), np.linspace(0.01, 0.99, 32)])


def _model(op):
    return make_model([helper.make_node(op, ["X"], ["Y"])], [("X", T.DOUBLE, [X.size])], [("Y", T.DOUBLE, [X.size])])


@pytest.mark.parametrize("op", OPS)
def test_float64_claims_are_double_accurate(op):
    try:
        cpu = session(_model(op), "CPUExecutionProvider", record=False)
        want = cpu.run(None, {"X": X})[0]
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"not a 1-input float64 op the CPU EP runs: {type(e).__name__}")
    s = session(_model(op))
    if unclaimed_ops(s):
        return                                   # refused: stays on the CPU EP (the CPU answer is used)
    got = s.run(None, {"X": X})[0]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-300, equal_nan=True)


@pytest.mark.parametrize("op", ["Exp", "Sin", "Cos", "Sigmoid", "ReduceLogSumExp"])
def test_imprecise_float64_ops_are_refused(op):
    assert unclaimed_ops(session(_model(op)))[op] == 1
