"""Reductions, ArgMax/ArgMin and CumSum against ORT's CPU EP."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T

from _ewutil import NP, check, node_model, rand, refusal
from ortmlx.testing import session, unclaimed_ops

rng = np.random.default_rng(4)
FD = (T.FLOAT, T.FLOAT16, T.DOUBLE)
RED = FD + (T.INT32, T.INT64)
MAXMIN = FD + (T.INT8, T.UINT8, T.INT32, T.INT64, T.BOOL)
# op, dtypes, opset where axes became an input, value range (float64 LogSumExp: refused, test_float64.py)
OPS = [("ReduceSum", RED, 13, (-3, 3)), ("ReduceMean", RED, 18, (-9, 9)), ("ReduceMax", MAXMIN, 18, (-9, 9)),
       ("ReduceMin", MAXMIN, 18, (-9, 9)), ("ReduceProd", RED, 18, (-2, 2)), ("ReduceL1", RED, 18, (-3, 3)),
       ("ReduceL2", RED, 18, (-3, 3)), ("ReduceLogSum", RED, 18, (0.5, 3)), ("ReduceLogSumExp", tuple(t for t in RED if t != T.DOUBLE), 18, (-3, 3)),
       ("ReduceSumSquare", RED, 18, (-3, 3))]
AXES = [None, [], [0], [-1], [0, 2], [1, -1], [0, 1, 2]]


@pytest.mark.parametrize("op,t,new,vr", [(o, t, n, v) for o, ts, n, v in OPS for t in ts], ids=str)
def test_reduce_dtypes(op, t, new, vr):
    x = rand(t, (2, 3, 4), rng, lo=vr[0], hi=vr[1])
    m = node_model(op, [t, T.INT64], [t], {"keepdims": 0}, max(new, 20) if t == T.BOOL else new)
    feeds = [{"x0": x, "x1": np.array([1], np.int64)}, {"x0": x, "x1": np.array([0, -1], np.int64)}]
    if op == "ReduceLogSumExp" and t in (T.INT32, T.INT64):
        _check_int_logsumexp(m, feeds)
    else:
        check(m, feeds, t)


def _check_int_logsumexp(m, feeds):
    """Integer ReduceLogSumExp against NumPy's float64 log-sum-exp truncated to the type (ONNX's reference), not
    ORT's CPU EP, which sums e^(x - max) in the integer type, so every term below 1 is dropped: it answers
    trunc(max + log(#maxima)) (-2 for [-3, -3, -2], where log(e^-3 + e^-3 + e^-2) = -1.449)."""
    s = session(m)
    assert not unclaimed_ops(s), unclaimed_ops(s)
    for f in feeds:
        x = f["x0"]
        axes = tuple(int(a) % x.ndim for a in f["x1"])
        want = np.log(np.exp(x.astype(np.float64)).sum(axis=axes)).astype(x.dtype)
        np.testing.assert_array_equal(s.run(None, f)[0], want)


def test_int_logsumexp_is_the_reference_not_the_cpu_eps():
    x = np.array([[[-3], [-3], [-2]], [[-1], [-3], [-3]]], np.int32)     # (2, 3, 1), over axis 1
    m = node_model("ReduceLogSumExp", [T.INT32, T.INT64], [T.INT32], {"keepdims": 0}, 18)
    feeds = {"x0": x, "x1": np.array([1], np.int64)}
    assert session(m).run(None, feeds)[0].ravel().tolist() == [-1, 0]          # -1.449, -0.761 truncated
    cpu = session(m, "CPUExecutionProvider", record=False).run(None, feeds)[0]
    assert cpu.ravel().tolist() == [-2, -1]                                     # ORT's integer sum (above)
    _check_int_logsumexp(m, [feeds])


@pytest.mark.parametrize("op,new,vr", [(o, n, v) for o, ts, n, v in OPS], ids=str)
def test_reduce_axes_forms(op, new, vr):
    t = T.FLOAT
    x = rand(t, (2, 3, 4), rng, lo=vr[0], hi=vr[1])
    for keepdims in (0, 1):
        for axes in AXES:
            for noop in ((0, 1) if axes == [] or axes is None else (0,)):
                attrs = {"keepdims": keepdims, "noop_with_empty_axes": noop}
                if axes is None:
                    m = node_model(op, [t], [t], attrs, new)
                    feeds = {"x0": x}
                else:
                    m = node_model(op, [t, T.INT64], [t], attrs, new)
                    feeds = {"x0": x, "x1": np.array(axes, np.int64)}
                check(m, feeds, t)


@pytest.mark.parametrize("op,t", [(o, t) for o, ts, n, v in OPS for t in ts if t != T.BOOL][::3], ids=str)
def test_reduce_axes_attr(op, t):
    x = rand(t, (2, 3, 4), rng, lo=0.5, hi=3)
    for attrs in ({}, {"axes": [1]}, {"axes": [0, -1], "keepdims": 0}, {"keepdims": 0}):
        for opset in ((11, 1) if op == "ReduceSum" else (12, 13)):
            check(node_model(op, [t], [t], attrs, opset), {"x0": x}, t)


@pytest.mark.parametrize("op,t", [(o, t) for o, ts, n, v in OPS for t in ts if t in (T.FLOAT, T.INT32)], ids=str)
def test_reduce_empty_set(op, t):
    m = node_model(op, [t, T.INT64], [t], {"keepdims": 1}, 18)
    m0 = node_model(op, [t, T.INT64], [t], {"keepdims": 0}, 18)
    x = np.zeros((0, 3), NP[t])
    feeds = [{"x0": x, "x1": np.array([0], np.int64)}, {"x0": x, "x1": np.array([1], np.int64)},
             {"x0": x, "x1": np.array([], np.int64)}]
    check(m, feeds)
    check(m0, feeds)


@pytest.mark.parametrize("op", [o for o, *_ in OPS])
def test_reduce_empty_last_axis_is_axis_zero(op):
    """A float32[0] reduced over axes=[-1] is reduced over its one axis, as with axes=[0]: the same answer (shape ()
    or (1,), the op's identity). ORT's CPU EP answers shape (0,) for -1 (``fuzz.KNOWN_BUGS``), so the reference is
    its answer for axes=[0]."""
    x = np.zeros((0,), np.float32)
    for keepdims in (0, 1):
        m = node_model(op, [T.FLOAT, T.INT64], [T.FLOAT], {"keepdims": keepdims}, 18)
        s = session(m)
        assert not unclaimed_ops(s), unclaimed_ops(s)
        want = session(m, "CPUExecutionProvider", record=False).run(None, {"x0": x, "x1": np.array([0], np.int64)})[0]
        assert want.shape == ((1,) if keepdims else ())
        for axis in (0, -1):
            got = s.run(None, {"x0": x, "x1": np.array([axis], np.int64)})[0]
            np.testing.assert_array_equal(got, want)
            assert got.shape == want.shape and got.dtype == want.dtype


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceLogSumExp", "ReduceL2"])
def test_reduce_nan_inf(op):
    x = rand(T.FLOAT, (4, 6), rng, special=True)
    check(node_model(op, [T.FLOAT, T.INT64], [T.FLOAT], {}, 18), {"x0": x, "x1": np.array([1], np.int64)})


def test_reduce_max_nan_propagates():
    """ORT's CPU NaN handling here depends on position/vectorisation; we follow the ONNX reference (numpy)."""
    from ortmlx.testing import session
    x = np.arange(24, dtype=np.float32).reshape(3, 8)
    x[0, 3] = np.nan
    for op, ref in (("ReduceMax", np.max), ("ReduceMin", np.min)):
        m = node_model(op, [T.FLOAT, T.INT64], [T.FLOAT], {"keepdims": 0}, 18)
        got = session(m).run(None, {"x0": x, "x1": np.array([1], np.int64)})[0]
        np.testing.assert_array_equal(got, ref(x, axis=1))


def test_reduce_logsumexp_non_finite_is_numpys():
    """log(sum(exp(x))) of rows holding NaN and +-inf equals NumPy's in float64 (ORT's CPU EP's answer for a row
    holding NaN and inf depends on where the NaN sits: ``fuzz.KNOWN_BUGS``)."""
    x = np.array([[np.inf, np.nan, 2], [2, np.inf, np.nan], [np.inf, 1, 2], [-np.inf] * 3, [np.inf, -np.inf, 0],
                  [1, 2, 3]], np.float32)
    m = node_model("ReduceLogSumExp", [T.FLOAT, T.INT64], [T.FLOAT], {"keepdims": 0}, 18)
    s = session(m)
    assert not unclaimed_ops(s), unclaimed_ops(s)
    got = s.run(None, {"x0": x, "x1": np.array([1], np.int64)})[0]
    with np.errstate(all="ignore"):
        want = np.log(np.exp(x.astype(np.float64)).sum(axis=1)).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got[np.isinf(got)], want[np.isinf(want)])


def test_reduce_sum_large_fp16():
    x = rand(T.FLOAT16, (4, 2048), rng, lo=0, hi=1)
    check(node_model("ReduceSum", [T.FLOAT16, T.INT64], [T.FLOAT16], {}, 13), {"x0": x, "x1": np.array([1], np.int64)},
          T.FLOAT16, rtol=5e-3)


ARG = FD + (T.INT8, T.UINT8, T.INT32, T.INT64)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("t", ARG, ids=str)
def test_arg(op, t):
    x = rand(t, (3, 5, 4), rng, lo=-3, hi=3)          # small range: plenty of ties
    for attrs in ({}, {"axis": 1}, {"axis": -1, "keepdims": 0}, {"axis": 1, "select_last_index": 1},
                  {"axis": 2, "keepdims": 0, "select_last_index": 1}):
        check(node_model(op, [t], [T.INT64], attrs, 13), {"x0": x})
    check(node_model(op, [t], [T.INT64], {"axis": 1}, 11), {"x0": x})


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg_nan(op):
    x = np.array([[np.nan, 1, np.nan, 3], [2, np.nan, 5, 5], [1, 1, 1, 1], [np.nan] * 4,
                  [-np.inf, np.nan, -np.inf, 0], [np.inf, np.nan, -np.inf, np.inf]], np.float32)
    for last in (0, 1):
        check(node_model(op, [T.FLOAT], [T.INT64], {"axis": 1, "select_last_index": last}, 13), {"x0": x})
    big = rand(T.FLOAT, (4, 37), rng, special=True)
    check(node_model(op, [T.FLOAT], [T.INT64], {"axis": 1}, 13), {"x0": big})


def test_arg_empty_axis_refused():
    m = node_model("ArgMax", [T.FLOAT], [T.INT64], {"axis": 0}, 13, in_shapes=[(0, 3)])
    assert "empty axis" in refusal(m, "ArgMax")


CUMSUM = (T.FLOAT, T.FLOAT16, T.DOUBLE, T.INT32, T.INT64)


@pytest.mark.parametrize("t", CUMSUM, ids=str)
@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum(t, exclusive, reverse):
    x = rand(t, (3, 4, 5), rng, lo=-5, hi=5)
    for axis in (0, 1, -1):
        m = node_model("CumSum", [t, T.INT64], [t], {"exclusive": exclusive, "reverse": reverse}, 14,
                       initializers={"x1": np.array(axis, np.int64)})
        check(m, {"x0": x}, t)
    m = node_model("CumSum", [t, T.INT32], [t], {"exclusive": exclusive, "reverse": reverse}, 14)
    check(m, [{"x0": x, "x1": np.array(1, np.int32)}, {"x0": np.zeros((0, 3), NP[t]), "x1": np.array(1, np.int32)}], t)


BF16 = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
        "ReduceLogSumExp", "ReduceSumSquare"]


@pytest.mark.parametrize("op", BF16)
def test_bf16_reduce(op):
    """bf16 reductions (accumulated in float32) vs the CPU EP's float32 result rounded to bf16."""
    from _ewutil import check_bf16
    x = rand(T.FLOAT, (3, 4, 5), rng, lo=0.2 if op == "ReduceLogSum" else -2, hi=2)
    check_bf16(op, {"x0": x}, {"keepdims": 0}, opset=18, inits={"axes": np.array([0, 2], np.int64)},
               exact=op in ("ReduceMax", "ReduceMin"))


@pytest.mark.parametrize("op,attrs", [("ArgMax", {"axis": 1}), ("ArgMin", {"axis": 0, "select_last_index": 1}),
                                      ("CumSum", {"reverse": 1})], ids=str)
def test_bf16_arg_cumsum(op, attrs):
    from _ewutil import check_bf16, bf16_models, session, unclaimed_ops
    x = rand(T.FLOAT, (4, 6), rng, lo=-2, hi=2).round(1)
    if op == "CumSum":
        check_bf16(op, {"x0": x}, attrs, opset=14, inits={"axis": np.array(1, np.int64)})
        return
    test, ref = bf16_models(op, 1, attrs, opset=13, out_bool=True)
    # the output is int64, not bool: rebuild the output types
    for mdl in (test, ref):
        mdl.graph.output[0].type.tensor_type.elem_type = T.INT64
    s = session(test)
    assert not unclaimed_ops(s)
    np.testing.assert_array_equal(s.run(None, {"x0": x})[0],
                                  session(ref, "CPUExecutionProvider", record=False).run(None, {"x0": x})[0])


# ---------------------------------------------------------------- CumProd (opset 26)
CUMPROD = (T.FLOAT, T.FLOAT16, T.DOUBLE, T.INT32, T.INT64, T.UINT32, T.UINT64)


def _cumprod_x(t, shape):
    """Floats near 1 with NaN/+-Inf/+-0 (products stay finite along 40 steps); integers that overflow."""
    if t in (T.FLOAT, T.FLOAT16, T.DOUBLE):
        x = rand(t, shape, rng, lo=0.8, hi=1.25, special=True)
        x.reshape(-1)[-3:] = -1.5                     # a few sign flips
        return x
    lo = 0 if t in (T.UINT32, T.UINT64) else -9
    return rand(t, shape, rng, lo=lo, hi=9)


@pytest.mark.parametrize("t,exclusive,reverse", [(t, e, r) for t in CUMPROD for e in (0, 1) for r in (0, 1)], ids=str)
def test_cumprod(t, exclusive, reverse):
    """Exact: ORT multiplies in order along the axis (float16 in float32, rounded once); integers wrap."""
    attrs = {"exclusive": exclusive, "reverse": reverse}
    x = _cumprod_x(t, (3, 40, 5))
    for axis in (0, 1, -1):
        m = node_model("CumProd", [t, T.INT64], [t], attrs, 26, initializers={"x1": np.array(axis, np.int64)})
        check(m, {"x0": x}, t, rtol=0, atol=0)
    m = node_model("CumProd", [t, T.INT32], [t], attrs, 26)
    check(m, [{"x0": x, "x1": np.array(1, np.int32)}, {"x0": x, "x1": np.array([-2], np.int32)},
              {"x0": np.zeros((0, 3), NP[t]), "x1": np.array(1, np.int32)}], t, rtol=0, atol=0)


def test_cumprod_bf16_refused():
    """ORT's CPU EP has no bfloat16 CumProd to verify against."""
    m = node_model("CumProd", [T.BFLOAT16, T.INT64], [T.BFLOAT16], {}, 26)
    assert "bfloat16" in refusal(m, "CumProd")


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("axes,keepdims,noop", [(None, 1, 0), ([1], 1, 0), ([-1], 0, 0), ([0, 2], 0, 0),
                                                ([], 1, 1), ([], 0, 0)])
def test_reduce_sum_ints_host_equals_cpu_ep(dtype, axes, keepdims, noop):
    """The NumPy integer ReduceSum the compiled paths use for hoisted work (genai's mask length) is
    the CPU EP's ReduceSum on sums in range, and the MLX translator's (what eager runs) on any."""
    import onnxruntime as ort
    from onnx import helper
    from ortmlx.kernels.ops.reduction import reduce_sum_ints_host
    t = T.INT32 if dtype == np.int32 else T.INT64
    x = np.random.default_rng(0).integers(-10**6, 10**6, (3, 4, 5)).astype(dtype)
    ins = [helper.make_tensor_value_info("x", t, list(x.shape)), helper.make_tensor_value_info("a", T.INT64, None)]
    node = helper.make_node("ReduceSum", ["x", "a"], ["y"], keepdims=keepdims, noop_with_empty_axes=noop)
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("y", t, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    a = np.array([] if axes is None else axes, np.int64)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x, "a": a})[0]
    got = reduce_sum_ints_host(x, None if axes is None else a, keepdims=keepdims, noop_with_empty_axes=noop)
    assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_reduce_sum_ints_host_wraps_as_mlx(dtype):
    """Past the type's range the host form wraps exactly as MLX's integer sum does (eager's answer;
    ORT's CPU EP saturates there, and its int64 sums lose bits past 2**53: see the note in reduction.py)."""
    import mlx.core as mx
    from ortmlx.kernels.ops.reduction import reduce_sum_ints_host
    x = np.random.default_rng(1).integers(np.iinfo(dtype).max // 4, np.iinfo(dtype).max, (3, 4, 5)).astype(dtype)
    for axes in (None, np.array([1]), np.array([-1, 0])):
        got = reduce_sum_ints_host(x, axes, keepdims=0)
        want = np.array(mx.sum(mx.array(x), axis=None if axes is None else [int(a) for a in axes]))
        assert got.dtype == want.dtype and np.array_equal(got, want)
