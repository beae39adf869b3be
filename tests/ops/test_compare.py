"""Comparisons, logical, bitwise, Where, IsNaN/IsInf against ORT's CPU EP."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper

from _ewutil import FLOATS, INTS, NP, check, check_refused, make_model, node_model, rand, refusal

rng = np.random.default_rng(2)
NUM = FLOATS + INTS

CMP = [("Equal", 11, NUM + (T.BOOL,)), ("Equal", 19, (T.FLOAT, T.INT64)), ("Less", 13, NUM),
       ("Greater", 13, NUM), ("LessOrEqual", 16, NUM), ("GreaterOrEqual", 16, NUM)]


@pytest.mark.parametrize("op,opset,t", [(o, s, t) for o, s, ts in CMP for t in ts], ids=str)
def test_compare(op, opset, t):
    m = node_model(op, [t, t], [T.BOOL], {}, opset)
    feeds = [{"x0": rand(t, (3, 4), rng, lo=-3, hi=3, special=True), "x1": rand(t, (4,), rng, lo=-3, hi=3)},
             {"x0": rand(t, (3, 4), rng, lo=-2, hi=2), "x1": rand(t, (3, 4), rng, lo=-2, hi=2)},
             {"x0": rand(t, (0, 4), rng), "x1": rand(t, (1, 4), rng)}]
    check(m, feeds)


def test_compare_nan_pairs():
    a = np.array([np.nan, np.nan, 1, np.inf, -np.inf, 0.0], np.float32)
    b = np.array([np.nan, 1, np.nan, np.inf, np.inf, -0.0], np.float32)
    for op in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"):
        check(node_model(op, [T.FLOAT, T.FLOAT], [T.BOOL], {}, 16), {"x0": a, "x1": b})


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logical(op):
    m = node_model(op, [T.BOOL, T.BOOL], [T.BOOL], {}, 7)
    check(m, [{"x0": rand(T.BOOL, (2, 3, 4), rng), "x1": rand(T.BOOL, (3, 1), rng)}])


def test_not():
    check(node_model("Not", [T.BOOL], [T.BOOL], {}, 1), {"x0": rand(T.BOOL, (5, 3), rng)})


@pytest.mark.parametrize("op", ["BitwiseAnd", "BitwiseOr", "BitwiseXor"])
@pytest.mark.parametrize("t", INTS, ids=str)
def test_bitwise(op, t):
    m = node_model(op, [t, t], [t], {}, 18)
    check(m, {"x0": rand(t, (3, 4), rng, lo=-1000, hi=1000), "x1": rand(t, (4,), rng, lo=-1000, hi=1000)})


@pytest.mark.parametrize("t", INTS, ids=str)
def test_bitwise_not(t):
    check(node_model("BitwiseNot", [t], [t], {}, 18), {"x0": rand(t, (3, 4), rng, lo=-1000, hi=1000)})


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
@pytest.mark.parametrize("t,width", [(T.UINT8, 8), (T.UINT32, 32), (T.UINT64, 64)], ids=str)
def test_bitshift(direction, t, width):
    y = np.arange(width, dtype=NP[t])[: 12 if width > 8 else 8]
    y[-1] = width - 1
    m = node_model("BitShift", [t, t], [t], {"direction": direction}, 11, initializers={"x1": y})
    x = rand(t, (3, y.size), rng, lo=0, hi=255)
    x[0] = np.iinfo(NP[t]).max
    check(m, {"x0": x})


def test_bitshift_refused():
    t = T.UINT32
    m = node_model("BitShift", [t, t], [t], {"direction": "LEFT"}, 11)
    assert "not a constant" in refusal(m, "BitShift")
    m = node_model("BitShift", [t, t], [t], {"direction": "LEFT"}, 11,
                   initializers={"x1": np.array([1, 32], np.uint32)})
    assert "bit width" in refusal(m, "BitShift")
    check_refused(m, {"x0": np.array([3, 5], np.uint32)}, "BitShift")


WHERE = (T.FLOAT, T.FLOAT16, T.DOUBLE, T.INT8, T.UINT8, T.INT32, T.UINT32, T.INT64)


@pytest.mark.parametrize("t", WHERE, ids=str)
def test_where(t):
    m = node_model("Where", [T.BOOL, t, t], [t], {}, 16)
    check(m, [{"x0": rand(T.BOOL, (3, 1, 4), rng), "x1": rand(t, (2, 4), rng, special=True),
               "x2": rand(t, (3, 2, 1), rng)},
              {"x0": rand(T.BOOL, (0, 4), rng), "x1": rand(t, (1, 4), rng), "x2": rand(t, (4,), rng)}])


@pytest.mark.parametrize("t", FLOATS, ids=str)
@pytest.mark.parametrize("attrs", [{}, {"detect_negative": 0}, {"detect_positive": 0},
                                   {"detect_negative": 0, "detect_positive": 0}], ids=str)
def test_isinf(t, attrs):
    check(node_model("IsInf", [t], [T.BOOL], attrs, 20), {"x0": rand(t, (4, 5), rng, special=True)})


@pytest.mark.parametrize("t", FLOATS, ids=str)
def test_isnan(t):
    check(node_model("IsNaN", [t], [T.BOOL], {}, 20), {"x0": rand(t, (4, 5), rng, special=True)})


@pytest.mark.parametrize("op,attrs", [("IsNaN", {}), ("IsInf", {}), ("IsInf", {"detect_positive": 0})], ids=str)
def test_bf16_via_cast(op, attrs):
    """bf16 inputs built in-graph (numpy has no bfloat16): Cast -> op, all on MLX."""
    nodes = [helper.make_node("Cast", ["x"], ["b"], to=T.BFLOAT16), helper.make_node(op, ["b"], ["y"], **attrs)]
    m = make_model(nodes, [("x", T.FLOAT, None)], [("y", T.BOOL, None)], opset=20)
    check(m, {"x": rand(T.FLOAT, (4, 5), rng, special=True)})


@pytest.mark.parametrize("op", ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"])
def test_bf16_compare(op):
    """bf16 comparisons vs the CPU EP on the same values in float32."""
    from _ewutil import check_bf16
    a = rand(T.FLOAT, (3, 4), rng, lo=-2, hi=2, special=True).round(1)
    check_bf16(op, {"x0": a, "x1": a[::-1].copy()}, out_bool=True)


def test_bf16_where():
    """ORT's CPU EP has no bf16 Where: reference = float32 Where on the bf16-rounded values."""
    from _ewutil import session, unclaimed_ops
    C = helper.make_node
    nodes = [C("Cast", ["a"], ["ab"], to=T.BFLOAT16), C("Cast", ["b"], ["bb"], to=T.BFLOAT16),
             C("Where", ["c", "ab", "bb"], ["yb"]), C("Cast", ["yb"], ["y"], to=T.FLOAT)]
    ref = [C("Cast", ["a"], ["ab"], to=T.BFLOAT16), C("Cast", ["b"], ["bb"], to=T.BFLOAT16),
           C("Cast", ["ab"], ["af"], to=T.FLOAT), C("Cast", ["bb"], ["bf"], to=T.FLOAT),
           C("Where", ["c", "af", "bf"], ["y"])]
    io = ([("c", T.BOOL, None), ("a", T.FLOAT, None), ("b", T.FLOAT, None)], [("y", T.FLOAT, None)])
    s = session(make_model(nodes, *io, opset=22))
    assert not unclaimed_ops(s)
    feeds = {"c": rand(T.BOOL, (3, 4), rng), "a": rand(T.FLOAT, (3, 4), rng, special=True),
             "b": rand(T.FLOAT, (4,), rng)}
    want = session(make_model(ref, *io, opset=22), "CPUExecutionProvider", record=False).run(None, feeds)[0]
    np.testing.assert_array_equal(s.run(None, feeds)[0], want)
