"""Generators vs the CPU EP: Range, ConstantOfShape, EyeLike, OneHot, Trilu, Constant."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper, numpy_helper

from ortmlx.kernels.interpreter import Program
from ortmlx.ir import Graph, Node, ValueInfo
from ortmlx.testing import check_against_cpu, make_model, session

from _movutil import DTYPES, force_path, NP_OF, check, check_error, data, i64, one_node


def sc(v, dtype):
    return np.array(v, dtype=dtype)


# Range: (start, limit, delta) per case, each a scalar of the case dtype
RANGE = {
    "up": (0, 10, 3), "down": (10, 4, -2), "empty": (5, 1, 1), "neg": (-7, 3, 2), "one": (1, 2, 5),
    "frac": (0.1, 7.3, 0.7), "long": (0.1, 300.3, 0.1),
}
RANGE_TYPES = [T.FLOAT, T.DOUBLE, T.INT16, T.INT32, T.INT64]


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("t", RANGE_TYPES, ids=lambda t: T.DataType.Name(t).lower())
@pytest.mark.parametrize("case", list(RANGE))
def test_range(case, t, path, monkeypatch):
    force_path(monkeypatch, path)
    if case in ("frac", "long") and t not in (T.FLOAT, T.DOUBLE):
        pytest.skip("fractional range: float types only")
    s, lim, d = (sc(v, NP_OF[t]) for v in RANGE[case])
    model, feeds = one_node("Range", [s, lim, d], {}, 13)
    check(model, feeds, tol=dict(rtol=0, atol=0))


def test_range_zero_delta_errors():
    model, feeds = one_node("Range", [sc(0, np.int64), sc(4, np.int64), sc(0, np.int64)], {}, 13)
    check_error(model, feeds, "Range_0")


# ConstantOfShape: (shape, value tensor or None)
COS = {
    "default": (i64(2, 3), None),
    "float": (i64(4), numpy_helper.from_array(np.array([1.5], np.float32), "v")),
    "fp16": (i64(2, 2), numpy_helper.from_array(np.array([-2.5], np.float16), "v")),
    "int64": (i64(3, 1, 2), numpy_helper.from_array(np.array([7], np.int64), "v")),
    "int32": (i64(2), numpy_helper.from_array(np.array([-3], np.int32), "v")),
    "bool": (i64(2, 2), numpy_helper.from_array(np.array([True]), "v")),
    "zero_dim": (i64(0, 3), numpy_helper.from_array(np.array([1.0], np.float32), "v")),
    "scalar": (np.zeros(0, np.int64), numpy_helper.from_array(np.array([4], np.int64), "v")),
}


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("case", list(COS))
def test_constant_of_shape(case, path, monkeypatch):
    force_path(monkeypatch, path)
    """The shape is a graph input (an initializer would be constant-folded by ORT before we see it)."""
    shape, value = COS[case]
    out_t = value.data_type if value is not None else T.FLOAT
    model, feeds = one_node("ConstantOfShape", [shape], {"value": value} if value is not None else {}, 21,
                            [out_t])
    check(model, feeds)


# EyeLike: (shape, attrs)
EYE = {"square": ((3, 3), {}), "wide_k": ((2, 5), {"k": 2}), "tall_neg_k": ((5, 3), {"k": -1}),
       "k_off": ((2, 3), {"k": 7}), "dtype": ((3, 4), {"dtype": T.INT64}), "empty": ((0, 3), {})}


@pytest.mark.parametrize("t", [T.FLOAT, T.INT64, T.INT32, T.DOUBLE, T.BOOL], ids=lambda t: T.DataType.Name(t).lower())
@pytest.mark.parametrize("case", list(EYE))
def test_eye_like(case, t):
    shape, attrs = EYE[case]
    out_t = attrs.get("dtype", t)
    model, feeds = one_node("EyeLike", [data(t, shape)], attrs, 13, [out_t])
    check(model, feeds)


# OneHot: (indices, depth, values, attrs)
ONEHOT = {
    "basic": (i64(0, 2, 1), i64(3), np.array([0, 1], np.float32), {}),
    "negative_and_oob": (np.array([[-1, 5], [-4, 2]], np.int64), i64(4), np.array([-1, 7], np.float32), {}),
    "axis0": (i64(1, 3), i64(4), np.array([2, 5], np.int64), {"axis": 0}),
    "axis_neg": (np.array([[0, 1], [2, 0]], np.int32), np.array([3], np.float32), np.array([0, 1], np.float32),
                 {"axis": -2}),
    "int_values": (i64(2, -3, 0), np.array(3, np.int32), np.array([0, 9], np.float32), {}),
}


@pytest.mark.parametrize("opset", [9, 11])
@pytest.mark.parametrize("const", [False, True], ids=["dynamic", "const_depth"])
@pytest.mark.parametrize("case", list(ONEHOT))
def test_one_hot(case, const, opset):
    idx, depth, values, attrs = ONEHOT[case]
    model, feeds = one_node("OneHot", [idx, depth, values], attrs, opset, [{np.float32: T.FLOAT,
                            np.int64: T.INT64}[values.dtype.type]], consts=(1,) if const else ())
    check(model, feeds)


def test_one_hot_float_indices_refused():
    from _movutil import refusal_reason
    model, _ = one_node("OneHot", [np.array([0.0, 1.7], np.float32), i64(3), np.array([0, 1], np.float32)], {},
                        11, [T.FLOAT])
    assert "float indices" in refusal_reason(model, "OneHot")


# Trilu: (shape, attrs, k or None)
TRILU = {"upper": ((4, 5), {}, None), "lower": ((4, 5), {"upper": 0}, None), "upper_k": ((3, 4), {}, i64(1)),
         "lower_negk": ((2, 4, 3), {"upper": 0}, i64(-1)), "big_k": ((3, 3), {}, i64(9)),
         "very_neg_k": ((3, 3), {"upper": 0}, i64(-2**40)), "empty": ((0, 3), {}, None)}


@pytest.mark.parametrize("t", DTYPES, ids=lambda t: T.DataType.Name(t).lower())
@pytest.mark.parametrize("case", list(TRILU))
def test_trilu(case, t):
    shape, attrs, k = TRILU[case]
    ins = [data(t, shape)] + ([k] if k is not None else [])
    model, feeds = one_node("Trilu", ins, attrs, 14)
    check(model, feeds)


# Constant: ORT turns Constant nodes into initializers before any EP sees them, so the translator
# is run through the interpreter directly and compared with what ORT's CPU EP produces.
CONST = {
    "value": {"value": numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "v")},
    "value_int": {"value_int": 5},
    "value_ints": {"value_ints": [1, -2, 3]},
    "value_float": {"value_float": 2.5},
    "value_floats": {"value_floats": [0.5, -1.25]},
    "value_fp16": {"value": numpy_helper.from_array(np.array([1.5, -2], np.float16), "v")},
}


@pytest.mark.parametrize("case", list(CONST))
def test_constant(case):
    attrs = CONST[case]
    cpu_model = make_model([helper.make_node("Constant", [], ["y"], **attrs)], [], [("y", _const_type(attrs), None)])
    want = session(cpu_model, "CPUExecutionProvider", record=False).run(None, {})[0]
    ir_attrs = {k: numpy_helper.to_array(v) if hasattr(v, "data_type") else v for k, v in attrs.items()}
    node = Node("c", "Constant", "", 13, [], ["y"], ir_attrs)
    g = Graph([node], [], ["y"], {"y": ValueInfo("y", _const_type(attrs), want.shape)}, {}, "g")
    got = np.asarray(Program(g).run([])[0])
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def _const_type(attrs):
    (k, v), = attrs.items()
    if k == "value":
        return v.data_type
    return T.FLOAT if "float" in k else T.INT64


def test_generators_feed_shape_chain():
    """Shape -> ConstantOfShape and Range(0, Size) run as host shape math inside one MLX group."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("ConstantOfShape", ["s"], ["ones"], value=numpy_helper.from_array(
                 np.array([1], np.int64), "v")),
             helper.make_node("Size", ["x"], ["n"]),
             helper.make_node("Range", ["zero", "n", "one"], ["r"]),
             helper.make_node("Reshape", ["r", "s"], ["rr"]),
             helper.make_node("Add", ["rr", "ones"], ["y"])]
    model = make_model(nodes, [("x", T.FLOAT, ["a", "b"])], [("y", T.INT64, None)],
                       {"zero": np.array(0, np.int64), "one": np.array(1, np.int64)})
    check_against_cpu(model, [{"x": data(T.FLOAT, (2, 3))}, {"x": data(T.FLOAT, (0, 4))}])


def test_constant_of_shape_bf16():
    """A bf16 value attribute (it arrives as uint16 bits) fills a bf16 tensor, cast back to float."""
    from _movutil import assignment
    from ortmlx.testing import EP_NAME
    v = helper.make_tensor("v", T.BFLOAT16, [1], [-2.75])
    nodes = [helper.make_node("ConstantOfShape", ["s"], ["c"], value=v), helper.make_node("Cast", ["c"], ["y"], to=T.FLOAT)]
    model = make_model(nodes, [("s", T.INT64, ["n"])], [("y", T.FLOAT, None)])
    s = check_against_cpu(model, [{"s": i64(2, 3)}, {"s": i64(0)}], all_on_mlx=False)
    assert "ConstantOfShape" in assignment(s).get(EP_NAME, {})


def test_trilu_k_computed_on_device():
    """k is read on the device: a k produced by an MLX op keeps Trilu claimed."""
    nodes = [helper.make_node("Abs", ["kin"], ["k"]), helper.make_node("Trilu", ["x", "k"], ["y"], upper=0)]
    model = make_model(nodes, [("x", T.FLOAT, ["a", "b", "c"]), ("kin", T.INT64, [])], [("y", T.FLOAT, None)],
                       opset=14)
    check_against_cpu(model, [{"x": data(T.FLOAT, (2, 3, 5)), "kin": np.array(-1, np.int64)},
                              {"x": data(T.FLOAT, (1, 4, 2)), "kin": np.array(2**40, np.int64)}])
