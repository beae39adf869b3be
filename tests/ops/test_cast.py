"""Cast / CastLike against ORT's CPU EP."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper

from _ewutil import FLOATS, INTS, NP, check, make_model, node_model, rand, refusal

rng = np.random.default_rng(3)
ALL = FLOATS + INTS + (T.BOOL,)


def _values(t):
    """In-range values of ``t`` plus its extremes."""
    if t == T.BOOL:
        return rand(t, (24,), rng)
    if t in FLOATS:
        return np.concatenate([rand(t, (16,), rng, lo=-100, hi=100),
                               np.array([0.0, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5, 65504], NP[t])])
    info = np.iinfo(NP[t])
    return np.concatenate([rand(t, (20,), rng, lo=-100, hi=100),
                           np.array([info.min, info.max, 0, 1], NP[t])])


def _fits(v, src, dst):
    """Values representable in ``dst`` (float -> int out of range is undefined in C++)."""
    if src in FLOATS and dst in INTS:
        info = np.iinfo(NP[dst])
        v = v[np.isfinite(v)]
        return v[(np.trunc(v.astype(np.float64)) >= info.min) & (np.trunc(v.astype(np.float64)) <= info.max)]
    return v


@pytest.mark.parametrize("src", ALL, ids=str)
@pytest.mark.parametrize("dst", ALL, ids=str)
def test_cast(src, dst):
    v = _fits(_values(src), src, dst)
    check(node_model("Cast", [src], [dst], {"to": dst}, 13), {"x0": v})


@pytest.mark.parametrize("src,dst", [(T.FLOAT, T.INT64), (T.FLOAT, T.BOOL), (T.FLOAT16, T.FLOAT)], ids=str)
def test_castlike(src, dst):
    m = node_model("CastLike", [src, dst], [dst], {}, 19)
    check(m, {"x0": _fits(_values(src), src, dst), "x1": np.zeros(1, NP[dst])})


def test_cast_special_floats():
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 7e4, -7e4], np.float32)
    for dst in (T.FLOAT16, T.DOUBLE, T.BOOL):
        check(node_model("Cast", [T.FLOAT], [dst], {"to": dst}, 13), {"x0": x})


def test_cast_opset19_plain():
    check(node_model("Cast", [T.FLOAT], [T.INT32], {"to": T.INT32}, 19), {"x0": rand(T.FLOAT, (5,), rng, lo=-9, hi=9)})


@pytest.mark.parametrize("src", FLOATS, ids=str)
@pytest.mark.parametrize("dst", INTS + (T.BOOL,), ids=str)
def test_cast_float_to_int_out_of_range(src, dst):
    """NaN/Inf/overflow -> int is undefined in C++; ORT's x86 result is matched (observed, not guaranteed)."""
    x = np.array([np.nan, np.inf, -np.inf, 3e9, -3e9, 1e20, -1e20, 300, -1, -129, 70000, -70000], np.float32)
    check(node_model("Cast", [src], [dst], {"to": dst}, 13), {"x0": x.astype(NP[src])})


@pytest.mark.parametrize("src", [T.FLOAT, T.FLOAT16, T.DOUBLE, T.INT64, T.INT32, T.UINT8, T.BOOL], ids=str)
def test_cast_bf16_roundtrip(src):
    """numpy has no bfloat16: go through it in-graph (src -> bf16 -> float32)."""
    nodes = [helper.make_node("Cast", ["x"], ["b"], to=T.BFLOAT16),
             helper.make_node("Cast", ["b"], ["y"], to=T.FLOAT)]
    m = make_model(nodes, [("x", src, None)], [("y", T.FLOAT, None)], opset=21)
    v = _values(src)
    if src in FLOATS:
        v = np.concatenate([v, np.array([np.nan, np.inf, -np.inf, 1.00390625, 1.01171875, 3.0e38 if src != T.FLOAT16 else 1], NP[src])])
    check(m, {"x": v}, rtol=0, atol=0)


def test_cast_float8_to_int_refused():
    """float8 <-> float32/float16 is claimed (tests/ops/test_carriers.py); float8 -> integers is not."""
    m = node_model("Cast", [T.FLOAT8E4M3FN], [T.INT32], {"to": T.INT32}, 19)
    assert "not implemented for carrier types" in refusal(m, "Cast")


@pytest.mark.parametrize("dst", [t for t in ALL if t not in (T.INT8, T.UINT8)], ids=str)
def test_cast_from_bf16(dst):
    """float32 -> bf16 -> every type, both Casts on MLX, against the same graph on the CPU EP.

    The CPU session runs unoptimised: ORT's optimiser folds the Cast pair into one float32 -> dst
    Cast, which skips the bf16 rounding (e.g. 69.7 -> 69 instead of 70).
    """
    import onnxruntime as ort
    from ortmlx.testing import assert_close, session, unclaimed_ops
    nodes = [helper.make_node("Cast", ["x"], ["b"], to=T.BFLOAT16), helper.make_node("Cast", ["b"], ["y"], to=dst)]
    m = make_model(nodes, [("x", T.FLOAT, None)], [("y", dst, None)], opset=21)
    v = _values(T.FLOAT)
    if dst in INTS:
        v = _fits(v, T.FLOAT, dst)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = session(m)
    assert not unclaimed_ops(s)
    want = session(m, "CPUExecutionProvider", record=False, sess_options=so).run(None, {"x": v})[0]
    assert_close(s.run(None, {"x": v})[0], want, rtol=0, atol=0, what=f"bf16 -> {dst}")


@pytest.mark.parametrize("dst", [T.INT8, T.UINT8], ids=str)
def test_cast_bf16_to_int8_refused(dst):
    """ORT's CPU EP gives 69 for float 69.9 -> bf16 (70.0) -> int8: we leave that Cast to it."""
    nodes = [helper.make_node("Cast", ["x"], ["b"], to=T.BFLOAT16), helper.make_node("Cast", ["b"], ["y"], to=dst)]
    m = make_model(nodes, [("x", T.FLOAT, None)], [("y", dst, None)], opset=21)
    assert "bfloat16" in refusal(m, "Cast")
