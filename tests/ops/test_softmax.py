"""Softmax / LogSoftmax / Hardmax (opset <13 coerce-to-2D vs 13+ single axis) and Dropout."""
import numpy as np
import pytest
from onnx import TensorProto as T, helper

from _nnutil import check, check_bf16, one_node, rand, stays_on_cpu
from ortmlx.testing import make_model

SOFTMAX = [  # (shape, axis or None for default, opset)
    ((3, 4), None, 11),
    ((2, 3, 4), None, 11),        # coerce at axis 1: rows of 12
    ((2, 3, 4), 2, 11),
    ((2, 3, 4), -2, 11),
    ((2, 3, 4), 0, 11),
    ((2, 3, 4), 1, 7),
    ((2, 3, 4), None, 13),
    ((2, 3, 4), 1, 13),
    ((2, 3, 4), 0, 13),
    ((5,), None, 13),
    ((0, 3), None, 13),
    ((0, 3, 4), 1, 11),
]


@pytest.mark.parametrize("t", [T.FLOAT, T.FLOAT16])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("shape,axis,opset", SOFTMAX)
def test_softmax_family(op, shape, axis, opset, t):
    attrs = {} if axis is None else {"axis": axis}
    m = one_node(op, [("x", t, shape)], [("y", t, None)], attrs, opset=opset)
    if t == T.FLOAT16 and op != "Hardmax":
        # refused: MLX's exp flips float16 rounding vs ORT in ~1e-4 of outputs (conformance found it)
        stays_on_cpu(m, {"x": rand(shape, t, lo=-4, hi=4)}, op, rtol=1e-3, atol=1e-3)
        return
    check(m, {"x": rand(shape, t, lo=-4, hi=4)}, t)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
def test_softmax_ties_and_large(op):
    x = np.array([[1, 3, 3, 0], [1e4, -1e4, 0, 1e4], [-np.inf, 0, 1, 1]], np.float32)
    check(one_node(op, [("x", T.FLOAT, x.shape)], [("y", T.FLOAT, None)], opset=13), {"x": x})


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_float64_refused(op):
    # MLX evaluates exp/log of float64 at float32 precision: these stay on the CPU EP
    x = rand((2, 3), T.DOUBLE, lo=-3, hi=3)
    stays_on_cpu(one_node(op, [("x", T.DOUBLE, x.shape)], [("y", T.DOUBLE, None)], opset=13), {"x": x}, op,
                 rtol=1e-12, atol=1e-14)


def test_softmax_bf16():
    check_bf16("Softmax", [("x", (2, 3, 4))], opset=13, feeds={"x": rand((2, 3, 4), lo=-3, hi=3)})


DROPOUT = [  # (opset, with mask, extra inputs)
    (7, False, {}), (10, False, {}), (12, True, {}), (13, False, {}),
    (13, True, {"ratio": np.float32(0.3)}),
    (13, True, {"ratio": np.float32(0.3), "tm": np.bool_(False)}),
    (13, True, {"ratio": np.float32(0.0), "tm": np.bool_(True)}),
]


@pytest.mark.parametrize("opset,mask,inits", DROPOUT)
def test_dropout(opset, mask, inits):
    names = ["x"] + [n for n in ("ratio", "tm") if n in inits]
    if "tm" in inits and "ratio" not in inits:
        names = ["x", "", "tm"]
    outs = ["y"] + (["mask"] if mask else [])
    mask_t = T.FLOAT if opset < 10 else T.BOOL
    node = helper.make_node("Dropout", names, outs)
    m = make_model([node], [("x", T.FLOAT, (2, 3))],
                   [("y", T.FLOAT, None)] + ([("mask", mask_t, None)] if mask else []),
                   {k: np.asarray(v) for k, v in inits.items()}, opset=opset)
    check(m, {"x": rand((2, 3))})


@pytest.mark.parametrize("opset", [7, 10])
def test_dropout_old_mask_refused(opset):
    node = helper.make_node("Dropout", ["x"], ["y", "mask"])
    m = make_model([node], [("x", T.FLOAT, (2, 3))],
                   [("y", T.FLOAT, None), ("mask", T.FLOAT if opset < 10 else T.BOOL, None)], opset=opset)
    stays_on_cpu(m, {"x": rand((2, 3))}, "Dropout")


def test_dropout_training_refused():
    node = helper.make_node("Dropout", ["x", "ratio", "tm"], ["y", "mask"], seed=3)
    m = make_model([node], [("x", T.FLOAT, (2, 3)), ("tm", T.BOOL, ())], [("y", T.FLOAT, None), ("mask", T.BOOL, None)],
                   {"ratio": np.asarray(np.float32(0.5))}, opset=13)
    # training_mode False at run time: the CPU EP is deterministic too, so both answers agree
    stays_on_cpu(m, {"x": rand((2, 3)), "tm": np.asarray(False)}, "Dropout")


@pytest.mark.parametrize("ratio_t", [T.FLOAT, T.FLOAT16, T.DOUBLE])
def test_dropout_zero_ratio_any_training_mode(ratio_t):
    """A constant ratio of 0 is deterministic whatever training_mode is: identity and an all-true mask."""
    node = helper.make_node("Dropout", ["x", "ratio", "tm"], ["y", "mask"], seed=0)
    ratio = np.asarray(0.0, {T.FLOAT: np.float32, T.FLOAT16: np.float16, T.DOUBLE: np.float64}[ratio_t])
    m = make_model([node], [("x", T.FLOAT, (3, 4)), ("tm", T.BOOL, ())], [("y", T.FLOAT, None), ("mask", T.BOOL, None)],
                   {"ratio": ratio}, opset=13)
    for tm in (True, False):
        check(m, {"x": rand((3, 4)), "tm": np.asarray(tm)}, rtol=1e-7, atol=1e-30)


def test_dropout_ratio_input_refused():
    """A ratio that arrives at run time may be nonzero (random in training mode): refused, even when it is 0."""
    node = helper.make_node("Dropout", ["x", "ratio", "tm"], ["y", "mask"], seed=0)
    m = make_model([node], [("x", T.FLOAT, (3, 4)), ("ratio", T.FLOAT, ()), ("tm", T.BOOL, ())],
                   [("y", T.FLOAT, None), ("mask", T.BOOL, None)], opset=13)
    stays_on_cpu(m, {"x": rand((3, 4)), "ratio": np.asarray(0.0, np.float32), "tm": np.asarray(True)}, "Dropout")
