"""Signal windows against ORT's CPU EP."""
import numpy as np
import pytest
from onnx import TensorProto as T, helper

from _nnutil import check, stays_on_cpu
from ortmlx.testing import make_model

CASES = [  # (op, size, periodic, output_datatype)
    ("HannWindow", 10, 1, T.FLOAT), ("HannWindow", 10, 0, T.FLOAT), ("HannWindow", 1, 1, T.FLOAT),
    ("HannWindow", 0, 1, T.FLOAT), ("HannWindow", 7, 0, T.FLOAT16),
    ("HammingWindow", 10, 1, T.FLOAT), ("HammingWindow", 9, 0, T.FLOAT), ("HammingWindow", 16, 1, T.FLOAT16),
    ("BlackmanWindow", 10, 1, T.FLOAT), ("BlackmanWindow", 11, 0, T.FLOAT), ("BlackmanWindow", 32, 1, T.FLOAT16),
]


def _model(op, periodic, t, size_as_input=True):
    node = helper.make_node(op, ["n"], ["w"], periodic=periodic, output_datatype=t)
    return make_model([node], [("n", T.INT64, ())], [("w", t, None)], opset=17)


@pytest.mark.parametrize("op,size,periodic,t", CASES)
def test_window(op, size, periodic, t):
    check(_model(op, periodic, t), {"n": np.array(size, np.int64)}, t)


@pytest.mark.parametrize("t", [T.INT32, T.DOUBLE])
def test_output_type_refused(t):
    # integer: truncation near integers; float64: ORT computes it from float32 coefficients
    stays_on_cpu(_model("HammingWindow", 0, t), {"n": np.array(9, np.int64)}, "HammingWindow")
