"""Elementwise arithmetic and math against ORT's CPU EP."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T

from _ewutil import FLOATS, INTS, check, check_refused, node_model, rand, refusal
from ortmlx.testing import check_against_cpu, session, unclaimed_ops

rng = np.random.default_rng(0)
ARITH = FLOATS + INTS
SIGNED = (T.INT8, T.INT16, T.INT32, T.INT64)

# (op, attrs, dtypes, opset, input shapes, value options)
BINARY = [
    ("Add", {}, ARITH, 14, [(3, 4), (4,)], {}),
    ("Sub", {}, ARITH, 14, [(2, 1, 4), (3, 1)], {}),
    ("Mul", {}, ARITH, 14, [(3, 4), ()], {}),
    ("Div", {}, FLOATS, 14, [(3, 4), (3, 4)], {"special": True}),
    ("Div", {}, INTS, 14, [(4, 5), (4, 5)], {"lo": -100, "hi": 100, "nonzero": True}),
    ("Mod", {}, INTS, 13, [(4, 5), (5,)], {"lo": -100, "hi": 100, "nonzero": True}),
    ("Mod", {"fmod": 1}, INTS, 13, [(4, 5), (4, 5)], {"lo": -100, "hi": 100, "nonzero": True}),
    ("Mod", {"fmod": 1}, FLOATS, 13, [(4, 5), (4, 5)], {"nonzero": True}),
    ("Pow", {}, (T.FLOAT, T.DOUBLE), 15, [(3, 4), (4,)], {"lo": 0.1, "hi": 3}),
    ("Add", {}, (T.FLOAT,), 14, [(0, 4), (1, 4)], {}),
    ("Mul", {}, (T.FLOAT,), 14, [(3, 4), (3, 4)], {"special": True}),
    ("Add", {}, (T.INT32,), 7, [(3, 4), (4,)], {}),
]


@pytest.mark.parametrize("op,attrs,t,opset,shapes,vals",
                         [(o, a, t, s, sh, v) for o, a, ts, s, sh, v in BINARY for t in ts],
                         ids=lambda v: str(v))
def test_binary(op, attrs, t, opset, shapes, vals):
    if op in ("Div", "Mod") and t in INTS:          # integer divisors must be constant (see the refusal test)
        b = rand(t, shapes[1], rng, **vals)
        b.reshape(-1)[:1] = 1 if t in (T.UINT8, T.UINT16, T.UINT32, T.UINT64) else -1
        m = node_model(op, [t, t], [t], attrs, opset, initializers={"x1": b})
        feeds = [{"x0": rand(t, shapes[0], rng, **vals)} for _ in range(2)]
    else:
        m = node_model(op, [t, t], [t], attrs, opset)
        feeds = [{f"x{i}": rand(t, s, rng, **vals) for i, s in enumerate(shapes)} for _ in range(2)]
    check(m, feeds, t)


def test_int_div_mod_signs():
    a = np.array([7, -7, 7, -7, 0, 1, -1, 100], np.int32)
    b = np.array([2, 2, -2, -2, 3, -3, 3, -7], np.int32)
    for op, attrs in [("Div", {}), ("Mod", {}), ("Mod", {"fmod": 1})]:
        check(node_model(op, [T.INT32, T.INT32], [T.INT32], attrs, 13, initializers={"x1": b}), {"x0": a})


def test_int64_extremes():
    a = np.array([np.iinfo(np.int64).max, np.iinfo(np.int64).min, -5], np.int64)
    b = np.array([3, 7, 2], np.int64)
    for op in ("Add", "Sub", "Mul"):
        check(node_model(op, [T.INT64, T.INT64], [T.INT64], {}, 14), {"x0": a, "x1": b})
    for op in ("Div", "Mod"):
        check(node_model(op, [T.INT64, T.INT64], [T.INT64], {}, 13, initializers={"x1": b}), {"x0": a})


def test_int64_through_double():
    """ORT computes int64 Pow and Mod(fmod=1) with doubles: results beyond 2**53 are rounded."""
    a = np.array([2**60 + 1, -(2**60 + 1), 3**39, 7, 2**53 + 1], np.int64)
    b = np.array([3, 3, 1, 2, 2], np.int64)
    for t in (T.INT64, T.UINT64):
        m = node_model("Mod", [t, t], [t], {"fmod": 1}, 13, initializers={"x1": b.astype(NP_(t))})
        check(m, {"x0": np.abs(a).astype(NP_(t)) if t == T.UINT64 else a})
    m = node_model("Pow", [T.INT64, T.INT64], [T.INT64], {}, 15)
    check(m, {"x0": np.array([3, 3, 2, -3, 0, 10, 2], np.int64), "x1": np.array([39, 38, 62, 39, -1, 30, -2], np.int64)})


@pytest.mark.parametrize("t", SIGNED, ids=str)
def test_int_min_by_minus_one(t):
    """INT_MIN / -1 traps (SIGFPE) in ORT's CPU kernel and in C; we wrap like Neg and never crash."""
    from ortmlx.testing import session
    info = np.iinfo(NP_(t))
    a = np.array([info.min, info.max, -7, 0], NP_(t))
    for op, attrs, want in [("Div", {}, np.array([info.min, -info.max, 7, 0], NP_(t))),  # noqa: E501
                            ("Mod", {}, np.zeros(4, NP_(t))), ("Mod", {"fmod": 1}, np.zeros(4, NP_(t)))]:
        m = node_model(op, [t, t], [t], attrs, 14 if op == "Div" else 13,
                       initializers={"x1": np.array([-1], NP_(t))})
        s = session(m)
        np.testing.assert_array_equal(s.run(None, {"x0": a})[0], want)


@pytest.mark.parametrize("op", ["Div", "Mod"])
def test_int_divisor_refusals(op):
    """ORT raises on an integer zero divisor at run time: a divisor computed on the device inside the
    group (checking it would need a sync) and a constant divisor containing 0 are refused."""
    from onnx import helper
    from _ewutil import make_model
    t = T.INT32
    nodes = [helper.make_node("ReduceMax", ["x1", "ax"], ["d"], keepdims=1), helper.make_node(op, ["x0", "d"], ["y"])]
    m = make_model(nodes, [("x0", t, None), ("x1", t, None)], [("y", t, None)], {"ax": np.array([0], np.int64)},
                   opset=18)
    assert "computed on the device" in refusal(m, op)
    check_refused(m, {"x0": np.array([7, -7, 9], np.int32), "x1": np.array([[2, -3, 5], [1, -9, 4]], np.int32)}, op)
    m = node_model(op, [t, t], [t], {}, 13, initializers={"x1": np.array([2, 0], np.int32)})
    assert "contains 0" in refusal(m, op)


# (op, attrs): integer divisors that arrive from ORT (group inputs) are read on the host and
# checked for zeros; (80, 70) is past the host-twin size limit, so the MLX kernel runs.
HOST_DIVISOR = [("Div", {}), ("Mod", {}), ("Mod", {"fmod": 1})]


@pytest.mark.parametrize("op,attrs,t", [(o, a, t) for o, a in HOST_DIVISOR for t in INTS], ids=str)
def test_int_divisor_group_input(op, attrs, t, host_calls):
    m = node_model(op, [t, t], [t], attrs, 14)
    lo = 0 if t in (T.UINT8, T.UINT16, T.UINT32, T.UINT64) else -100
    feeds = []
    for sa, sb in [((80, 70), (80, 70)), ((80, 70), (70,)), ((3, 4), (3, 4))]:
        b = rand(t, sb, rng, lo=lo, hi=100, nonzero=True)
        b.reshape(-1)[:2] = (1, 7) if lo == 0 else (-1, -7)
        feeds.append({"x0": rand(t, sa, rng, lo=lo, hi=100), "x1": b})
    s = check(m, feeds)
    assert op in host_calls                     # the (3, 4) feed ran on the numpy twin ...
    calls = len(host_calls)
    z = feeds[0]["x1"].copy()
    z[5, 5] = 0
    with pytest.raises(Exception, match="by zero"):
        session(m, "CPUExecutionProvider", record=False).run(None, {"x0": feeds[0]["x0"], "x1": z})
    with pytest.raises(Exception, match=f"{op} .*integer division by zero"):
        s.run(None, {"x0": feeds[0]["x0"], "x1": z})
    assert len(host_calls) == calls             # ... the (80, 70) ones on the MLX kernel


def test_int_divisor_from_another_ep():
    """A divisor computed by a node left to the CPU EP arrives as a host array: Div is claimed."""
    from onnx import helper
    from _ewutil import make_model
    t = T.INT64
    nodes = [helper.make_node("Abs", ["x1"], ["d"]), helper.make_node("Div", ["x0", "d"], ["y"])]
    m = make_model(nodes, [("x0", t, None), ("x1", t, None)], [("y", t, None)], opset=14)
    a, b = rand(t, (90, 60), rng, lo=-1000, hi=1000), rand(t, (90, 60), rng, lo=-9, hi=9, nonzero=True)
    s = check_against_cpu(m, [{"x0": a, "x1": b}], all_on_mlx=False, options={"disable_ops": "Abs"})
    assert dict(unclaimed_ops(s)) == {"Abs": 1}


def test_mod_float_fmod0_refused():
    m = node_model("Mod", [T.FLOAT, T.FLOAT], [T.FLOAT], {}, 13)
    assert "fmod=0" in refusal(m, "Mod")


POW_MIXED = [(T.FLOAT, T.INT64), (T.FLOAT, T.INT32), (T.DOUBLE, T.FLOAT), (T.INT32, T.INT32),
             (T.INT64, T.INT64), (T.INT64, T.INT32), (T.FLOAT16, T.FLOAT)]


@pytest.mark.parametrize("tb,te", POW_MIXED, ids=str)
def test_pow_mixed(tb, te):
    m = node_model("Pow", [tb, te], [tb], {}, 15)
    base = rand(tb, (3, 4), rng, lo=-3, hi=3)
    if tb in INTS:
        base = np.concatenate([base, np.array([[0, 0, 0, 0], [50000, -50000, 1 << 20, 7]], base.dtype)])
    ex = np.array([-1, 2, 3, -2], NP_(te)) if te in INTS else rand(te, (4,), rng, lo=0, hi=3)
    if te in INTS:
        base = base if tb in INTS else base.round(1)
    else:
        base = np.abs(base)
    check(m, {"x0": base, "x1": ex}, tb)


@pytest.mark.parametrize("tb,te", [(T.INT32, T.FLOAT), (T.INT64, T.FLOAT), (T.INT32, T.DOUBLE), (T.INT64, T.DOUBLE)],
                         ids=str)
def test_pow_int_base_float_exp(tb, te):
    """Integer base, float exponent: std::pow on doubles, truncated (out of range: the type's minimum)."""
    m = node_model("Pow", [tb, te], [tb], {}, 15)
    x = np.array([2, 3, -3, 0, 10, 7, 5, 2, 4], NP_(tb))
    y = np.array([0.5, 2.0, 3.0, -1.0, 2.5, 1 / 3, 40.0, -0.5, 0.5], NP_(te))
    check(m, {"x0": x, "x1": y})


UNARY = [   # float64 Exp/Sin/Cos are refused (test_float64.py)
    ("Neg", FLOATS + SIGNED, {}), ("Abs", ARITH, {}), ("Sign", ARITH, {"special": True}),
    ("Reciprocal", FLOATS, {"nonzero": True}), ("Sqrt", FLOATS, {"lo": 0, "hi": 9}),
    ("Exp", (T.FLOAT, T.FLOAT16), {"special": True}), ("Log", FLOATS, {"lo": 0.01, "hi": 9}),
    ("Floor", FLOATS, {"special": True}), ("Ceil", FLOATS, {"special": True}),
    ("Round", FLOATS, {"special": True}), ("Erf", (T.FLOAT, T.FLOAT16), {}),
    ("Sin", (T.FLOAT, T.FLOAT16), {}), ("Cos", (T.FLOAT, T.FLOAT16), {}), ("Tan", (T.FLOAT, T.FLOAT16), {"lo": -1.2, "hi": 1.2}),
    ("Asin", (T.FLOAT, T.FLOAT16), {"lo": -1, "hi": 1}), ("Acos", (T.FLOAT, T.FLOAT16), {"lo": -1, "hi": 1}),
    ("Atan", (T.FLOAT, T.FLOAT16), {}), ("Sinh", (T.FLOAT, T.FLOAT16), {}),
    ("Cosh", (T.FLOAT, T.FLOAT16), {}), ("Tanh", FLOATS, {"special": True}),
    ("Asinh", (T.FLOAT, T.FLOAT16), {}), ("Acosh", (T.FLOAT, T.FLOAT16), {"lo": 1, "hi": 9}),
    ("Atanh", (T.FLOAT, T.FLOAT16), {"lo": -0.99, "hi": 0.99}),
]


@pytest.mark.parametrize("op,t,vals", [(o, t, v) for o, ts, v in UNARY for t in ts], ids=str)
def test_unary(op, t, vals):
    m = node_model(op, [t], [t], {}, 13 if op not in ("Round",) else 11)
    check(m, [{"x0": rand(t, (4, 6), rng, **vals)}, {"x0": rand(t, (0, 3), rng)}], t)


def test_round_half_even():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.4999, 1e8 + 0.5], np.float32)
    check(node_model("Round", [T.FLOAT], [T.FLOAT], {}, 11), {"x0": x})


def test_int_abs_neg_extremes():
    x = np.array([np.iinfo(np.int32).min, -1, 0, np.iinfo(np.int32).max], np.int32)
    for op in ("Abs", "Neg", "Sign"):
        check(node_model(op, [T.INT32], [T.INT32], {}, 13), {"x0": x})


VARIADIC = [("Max", (T.FLOAT, T.FLOAT16, T.DOUBLE, T.INT8, T.UINT8, T.INT32, T.UINT32, T.INT64, T.UINT64)),
            ("Min", (T.FLOAT, T.FLOAT16, T.DOUBLE, T.INT8, T.UINT8, T.INT32, T.UINT32, T.INT64, T.UINT64)),
            ("Sum", FLOATS), ("Mean", (T.FLOAT, T.FLOAT16))]


@pytest.mark.parametrize("op,t", [(o, t) for o, ts in VARIADIC for t in ts], ids=str)
@pytest.mark.parametrize("n", [1, 3])
def test_variadic(op, t, n):
    shapes = [(2, 3, 4), (3, 1), (4,)][:n]
    m = node_model(op, [t] * n, [t], {}, 13)
    check(m, [{f"x{i}": rand(t, s, rng, special=True) for i, s in enumerate(shapes)}], t)


def test_max_min_nan_both_sides():
    a = np.array([np.nan, 1, np.nan, 2], np.float32)
    b = np.array([1, np.nan, np.nan, 3], np.float32)
    for op in ("Max", "Min"):
        check(node_model(op, [T.FLOAT, T.FLOAT], [T.FLOAT], {}, 13), {"x0": a, "x1": b})


CLIP_TYPES = FLOATS + (T.INT8, T.UINT8, T.INT32, T.UINT32, T.INT64, T.UINT64)  # ORT has no int16 Clip


@pytest.mark.parametrize("t", CLIP_TYPES, ids=str)
def test_clip13(t):
    x = rand(t, (3, 5), rng, lo=-20, hi=20)
    lo, hi = np.array(-3, NP_(t)) if t not in (T.UINT8, T.UINT16, T.UINT32, T.UINT64) else np.array(2, NP_(t)), \
        np.array(5, NP_(t))
    check(node_model("Clip", [t, t, t], [t], {}, 13), {"x0": x, "x1": lo, "x2": hi}, t)
    check(node_model("Clip", [t, None, t], [t], {}, 13), {"x0": x, "x2": hi}, t)
    check(node_model("Clip", [t, t], [t], {}, 13), {"x0": x, "x1": lo}, t)
    check(node_model("Clip", [t], [t], {}, 13), {"x0": x}, t)


def NP_(t):
    from _ewutil import NP
    return NP[t]


def test_clip_min_gt_max_and_nan():
    x = rand(T.FLOAT, (4, 5), rng, special=True)
    m = node_model("Clip", [T.FLOAT, T.FLOAT, T.FLOAT], [T.FLOAT], {}, 13)
    check(m, [{"x0": x, "x1": np.array(2, np.float32), "x2": np.array(-1, np.float32)},
              {"x0": x, "x1": np.array(-1, np.float32), "x2": np.array(1, np.float32)}])


def test_clip6_attrs():
    x = rand(T.FLOAT, (4, 5), rng, special=True)
    check(node_model("Clip", [T.FLOAT], [T.FLOAT], {"min": -1.0, "max": 0.5}, 6), {"x0": x})
    check(node_model("Clip", [T.FLOAT], [T.FLOAT], {"max": 0.5}, 6), {"x0": x})


# ---------------------------------------------------------------- host twins (shape math)
@pytest.fixture
def host_calls(monkeypatch):
    """Count calls of every registered numpy twin (patched for the test only)."""
    import dataclasses
    from ortmlx.kernels.registry import REGISTRY
    calls = []
    for key, lst in REGISTRY._ops.items():
        new = []
        for od in lst:
            if od.host is not None and not od.shape_only:
                def wrap(*a, _f=od.host, _op=od.op_type, **k):
                    calls.append(_op)
                    return _f(*a, **k)
                od = dataclasses.replace(od, host=wrap)
            new.append(od)
        monkeypatch.setitem(REGISTRY._ops, key, new)
    return calls


def _shape_model(nodes, outs):
    """Inputs x, z (any rank 3); s = Shape(x), t = Shape(z), u = -t; then ``nodes``."""
    from onnx import helper
    from _ewutil import make_model
    pre = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Shape", ["z"], ["t"]),
           helper.make_node("Neg", ["t"], ["u"])]
    return make_model(pre + nodes, [("x", T.FLOAT, None), ("z", T.FLOAT, None)], outs, opset=19)


HOST = [("Add", ["s", "u"], T.INT64, {}), ("Sub", ["s", "t"], T.INT64, {}), ("Mul", ["s", "u"], T.INT64, {}),
        ("Div", ["s", "u"], T.INT64, {}), ("Div", ["u", "s"], T.INT64, {}), ("Mod", ["s", "u"], T.INT64, {}),
        ("Mod", ["u", "s"], T.INT64, {"fmod": 1}), ("Mod", ["u", "t"], T.INT64, {}),
        ("Max", ["s", "t", "u"], T.INT64, {}), ("Min", ["s", "t"], T.INT64, {}), ("Abs", ["u"], T.INT64, {}),
        ("Sign", ["u"], T.INT64, {}), ("Equal", ["s", "t"], T.BOOL, {}), ("Less", ["s", "t"], T.BOOL, {}),
        ("Greater", ["s", "t"], T.BOOL, {}), ("Cast", ["u"], T.INT32, {"to": T.INT32}),
        ("Cast", ["s"], T.BOOL, {"to": T.BOOL})]
SHAPES = [((5, 3, 7), (2, 3, 4)), ((0, 1, 9), (7, 1, 2)), ((6, 6, 6), (6, 4, 5))]


@pytest.mark.parametrize("op,ins,out_t,attrs", HOST, ids=str)
def test_host_twins(op, ins, out_t, attrs, host_calls):
    from onnx import helper
    m = _shape_model([helper.make_node(op, ins, ["y"], **attrs)], [("y", out_t, None)])
    shapes = [sh for sh in SHAPES if not (op in ("Div", "Mod") and 0 in sh[0])]  # ORT raises on x // 0
    check(m, [{"x": np.zeros(a, np.float32), "z": np.zeros(b, np.float32)} for a, b in shapes])
    assert op in host_calls, f"{op} did not run on its numpy twin"


@pytest.mark.parametrize("op", ["Div", "Mod"])
def test_host_int_division_by_zero_errors(op, host_calls):
    """Like ORT's CPU EP, a zero integer divisor is an error naming the node, not a value."""
    from onnx import helper
    from ortmlx.testing import session
    m = _shape_model([helper.make_node(op, ["u", "s"], ["y"], name="div0")], [("y", T.INT64, None)])
    feeds = {"x": np.zeros((0, 1, 9), np.float32), "z": np.zeros((2, 3, 4), np.float32)}
    with pytest.raises(Exception, match="by zero"):
        session(m, "CPUExecutionProvider", record=False).run(None, feeds)
    with pytest.raises(Exception, match="div0.*division by zero"):
        session(m).run(None, feeds)


def test_host_twins_logical_where(host_calls):
    """Shape math through Greater -> Not -> Equal -> And -> Or -> Where, all on the host."""
    from onnx import helper
    nodes = [helper.make_node("Greater", ["s", "t"], ["g"]), helper.make_node("Not", ["g"], ["n"]),
             helper.make_node("Equal", ["s", "t"], ["e"]), helper.make_node("And", ["n", "e"], ["a"]),
             helper.make_node("Or", ["a", "g"], ["o"]), helper.make_node("Where", ["o", "s", "u"], ["y"])]
    m = _shape_model(nodes, [("y", T.INT64, None), ("a", T.BOOL, None)])
    check(m, [{"x": np.zeros(a, np.float32), "z": np.zeros(b, np.float32)} for a, b in SHAPES])
    assert {"Greater", "Not", "Equal", "And", "Or", "Where", "Neg"} <= set(host_calls)


# ---------------------------------------------------------------- bfloat16 (vs float32 on the CPU EP, rounded)
BF16 = [("Add", 2, True, {}), ("Sub", 2, True, {}), ("Mul", 2, True, {}), ("Div", 2, True, {}),
        ("Max", 3, True, {}), ("Min", 2, True, {}), ("Sum", 3, False, {}), ("Mean", 2, False, {}),
        ("Pow", 2, False, {"lo": 0.1}), ("Mod", 2, False, {"fmod": 1}), ("Neg", 1, True, {}), ("Abs", 1, True, {}),
        ("Sqrt", 1, False, {"lo": 0}), ("Reciprocal", 1, False, {}), ("Exp", 1, False, {}),
        ("Log", 1, False, {"lo": 0.01}), ("Floor", 1, True, {}), ("Ceil", 1, True, {}), ("Round", 1, True, {}),
        ("Erf", 1, False, {}), ("Sin", 1, False, {}), ("Cos", 1, False, {}), ("Tanh", 1, False, {}),
        ("Sign", 1, True, {}), ("Clip", 3, True, {})]


@pytest.mark.parametrize("op,n,exact,vals", BF16, ids=str)
def test_bf16(op, n, exact, vals):
    from _ewutil import check_bf16
    attrs = {k: v for k, v in vals.items() if k == "fmod"}
    lo = vals.get("lo", -4)
    shapes = [(3, 5), (5,), (3, 1)][:n]
    feeds = {f"x{i}": rand(T.FLOAT, s, rng, lo=lo, hi=4, special=op not in ("Mod", "Pow")) for i, s in enumerate(shapes)}
    if op == "Clip":
        feeds = {"x0": feeds["x0"], "x1": np.array(-1.5, np.float32), "x2": np.array(2.0, np.float32)}
    check_bf16(op, feeds, attrs, exact=exact)


# ---------------------------------------------------------------- regressions found by the fuzzer
from onnx import helper as _helper  # noqa: E402

from ortmlx.testing import check_against_cpu, make_model  # noqa: E402


@pytest.mark.parametrize("bounds", [["X", "lo"], ["X", "", "hi"], ["X"]], ids=["no_max", "no_min", "none"])
@pytest.mark.parametrize("t,npt", [(T.FLOAT, np.float32), (T.FLOAT16, np.float16)])
def test_clip_omitted_bound_is_the_finite_limit(bounds, t, npt):
    """ORT clamps +-inf to the type's finite max/lowest when a bound is omitted."""
    m = make_model([_helper.make_node("Clip", bounds, ["Y"])], [("X", t, [5])], [("Y", t, [5])],
                   {k: np.array(v, npt) for k, v in (("lo", -1), ("hi", 2)) if k in bounds})
    check_against_cpu(m, [{"X": np.array([np.inf, -np.inf, np.nan, 3, -5], npt)}])


@pytest.mark.parametrize("op", ["LogSoftmax", "Softmax"])
def test_softmax_over_an_empty_axis(op):
    m = make_model([_helper.make_node(op, ["X"], ["Y"], axis=1)], [("X", T.FLOAT, [2, 0])],
                   [("Y", T.FLOAT, [2, 0])])
    check_against_cpu(m, [{"X": np.zeros((2, 0), np.float32)}])


SIGNED_ZERO_OPS = ["Reciprocal", "Sqrt", "Exp", "Log", "Floor", "Ceil", "Round", "Erf", "Sin", "Cos", "Tan", "Asin",
                   "Acos", "Atan", "Sinh", "Cosh", "Tanh", "Asinh", "Acosh", "Atanh", "Neg", "Abs", "Relu", "Sign"]


@pytest.mark.parametrize("t", (T.FLOAT, T.FLOAT16))
@pytest.mark.parametrize("op", SIGNED_ZERO_OPS)
def test_signed_zero(op, t):
    """-0 and +0 in, the sign of every zero out as ORT's CPU EP gives it (MLX 0.32.4: Sin(-0) +0 on its CPU backend,
    Erf(+0) -0, Relu(-0) +0)."""
    nt = np.float32 if t == T.FLOAT else np.float16
    x = np.array([-0.0, 0.0, -1e-3, 1e-3], nt)
    m = node_model(op, [t], [t], opset=13)
    got, = session(m).run(None, {"x0": x})
    want, = session(m, "CPUExecutionProvider", record=False).run(None, {"x0": x})
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want), err_msg=f"{op}: {got} vs {want}")
    np.testing.assert_allclose(got, want, rtol=2e-3 if t == T.FLOAT16 else 1e-4, atol=0)


@pytest.mark.parametrize("t", (T.FLOAT, T.FLOAT16))
def test_where_keeps_the_sign_of_zero(t):
    """Where's zeros keep their sign from either branch, as NumPy's where (ORT's CPU EP gives +0 for a -0 taken
    from X: ``fuzz.KNOWN_BUGS``)."""
    nt = np.float32 if t == T.FLOAT else np.float16
    x, y = np.array([-0.0, 0.0, -0.0, 2], nt), np.array([0.0, -0.0, -0.0, -0.0], nt)
    m = node_model("Where", [T.BOOL, t, t], [t], opset=16)
    s = session(m)
    assert not unclaimed_ops(s)
    for c in (np.array(True), np.array(False), np.array([True, False, True, False])):
        got, = s.run(None, {"x0": c, "x1": x, "x2": y})
        want = np.where(c, x, y)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
