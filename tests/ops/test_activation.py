"""Activation functions against ORT's CPU EP."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T

from _ewutil import INTS, check, node_model, rand

rng = np.random.default_rng(1)
FD = (T.FLOAT, T.FLOAT16, T.DOUBLE)
F = (T.FLOAT, T.FLOAT16)

# (op, opset, dtypes, attrs); float64 Sigmoid/Shrink are refused (tests/ops/test_float64.py)
CASES = [
    ("Relu", 14, FD + (T.INT8, T.INT32), {}), ("Relu", 6, (T.FLOAT,), {}),
    ("LeakyRelu", 16, FD, {}), ("LeakyRelu", 6, (T.FLOAT,), {"alpha": 0.3}),
    ("Elu", 6, F, {}), ("Elu", 6, (T.FLOAT,), {"alpha": 0.5}),
    ("Selu", 6, F, {}), ("Selu", 6, (T.FLOAT,), {"alpha": 2.0, "gamma": 0.5}),
    ("Celu", 12, (T.FLOAT,), {}), ("Celu", 12, (T.FLOAT,), {"alpha": 2.0}),
    ("Sigmoid", 13, F, {}), ("HardSigmoid", 6, F, {}), ("HardSigmoid", 6, (T.FLOAT,), {"alpha": 0.3, "beta": 0.4}),
    ("HardSwish", 14, F, {}), ("Softplus", 1, (T.FLOAT,), {}), ("Softsign", 1, (T.FLOAT,), {}),
    ("ThresholdedRelu", 10, F, {}), ("ThresholdedRelu", 10, (T.FLOAT,), {"alpha": -0.5}),
    ("Gelu", 20, F, {}), ("Gelu", 20, F, {"approximate": "tanh"}),
    ("Mish", 18, FD, {}), ("Swish", 24, FD, {}), ("Swish", 24, (T.FLOAT,), {"alpha": 0.7}),
    ("Shrink", 9, F, {}), ("Shrink", 9, (T.FLOAT,), {"bias": 1.5, "lambd": 1.0}),
    ("Shrink", 9, INTS, {"bias": 1.0, "lambd": 1.5}),
]


@pytest.mark.parametrize("op,opset,t,attrs", [(o, s, t, a) for o, s, ts, a in CASES for t in ts], ids=str)
def test_activation(op, opset, t, attrs):
    m = node_model(op, [t], [t], attrs, opset)
    feeds = [{"x0": rand(t, (3, 7), rng, lo=-6, hi=6, special=t not in INTS)},
             {"x0": rand(t, (2, 0, 3), rng)}]
    check(m, feeds, t)


@pytest.mark.parametrize("t", FD + (T.INT32, T.UINT32, T.INT64), ids=str)
@pytest.mark.parametrize("slope_shape", [(1,), (5,), (3, 1, 5), ()], ids=str)
def test_prelu(t, slope_shape):
    m = node_model("PRelu", [t, t], [t], {}, 16)
    check(m, {"x0": rand(t, (2, 3, 4, 5), rng, lo=-9, hi=9), "x1": rand(t, slope_shape, rng, lo=0, hi=3)}, t)


def test_gelu_bad_approximate_refused():
    from _ewutil import refusal
    m = node_model("Gelu", [T.FLOAT], [T.FLOAT], {"approximate": "erf"}, 20)
    assert "approximate" in refusal(m, "Gelu")


BF16 = [("Relu", {}), ("LeakyRelu", {"alpha": 0.1}), ("Elu", {}), ("Selu", {}), ("Sigmoid", {}),
        ("HardSigmoid", {}), ("HardSwish", {}), ("Softplus", {}), ("Softsign", {}), ("ThresholdedRelu", {}),
        ("Gelu", {}), ("Gelu", {"approximate": "tanh"}), ("Mish", {}), ("Swish", {})]      # Celu, Shrink: no bf16 in the ONNX schema


@pytest.mark.parametrize("op,attrs", BF16, ids=str)
def test_bf16(op, attrs):
    """bf16 activation vs the CPU EP's float32 result rounded to bf16."""
    from _ewutil import check_bf16
    check_bf16(op, {"x0": rand(T.FLOAT, (4, 9), rng, lo=-6, hi=6, special=True)}, attrs, opset=24)


def test_bf16_prelu():
    from _ewutil import check_bf16
    check_bf16("PRelu", {"x0": rand(T.FLOAT, (2, 3, 4), rng), "x1": rand(T.FLOAT, (3, 1), rng, lo=0, hi=1)},
               opset=22)
