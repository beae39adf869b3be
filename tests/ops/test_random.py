"""Seeded random generators: bit-exact against ORT's CPU EP over consecutive runs of one session.

ORT's CPU kernels keep one libstdc++ minstd_rand0 engine per node for the life of the session, so
every run continues the stream; each run is compared byte for byte.
"""
import sys

import numpy as np
import pytest
from onnx import AttributeProto, TensorProto as T, helper

from ortmlx import EP_NAME, partition_reports
from ortmlx.testing import assignment, make_model, session

RUNS = 4


def _model(op, attrs, inputs=(), out_type=None, opset=21, extra_nodes=(), outputs=None):
    plain = {k: v for k, v in attrs.items() if not (k == "shape" and len(v) == 0)}
    node = helper.make_node(op, [i[0] for i in inputs], ["y"], **plain)
    if len(plain) < len(attrs):                       # shape=[]: a scalar (make_node cannot type an empty list)
        node.attribute.append(helper.make_attribute("shape", [], attr_type=AttributeProto.INTS))
    t = out_type if out_type is not None else attrs.get("dtype", T.FLOAT)
    return make_model([node, *extra_nodes], list(inputs), outputs or [("y", t, None)], opset=opset)


def check_exact(model, feeds=None, runs=RUNS, claimed=None, varies=True):
    """Every node on MLX (or the ops in ``claimed``); ``runs`` consecutive runs equal ORT's CPU EP bit for bit."""
    feeds = feeds or {}
    s = session(model)
    on_mlx = assignment(s).get(EP_NAME, {})
    left = {k: v for k, v in assignment(s).items() if k != EP_NAME}
    if claimed is None:
        assert not left, f"nodes left off MLX: {left}\n{partition_reports()[-1].format()}"
    else:
        assert all(op in on_mlx for op in claimed), f"{claimed} not all on MLX: {assignment(s)}"
    cpu = session(model, "CPUExecutionProvider", record=False)
    outs = []
    for r in range(runs):
        got, want = s.run(None, feeds), cpu.run(None, feeds)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, f"run {r}: {g.dtype}{g.shape} != {w.dtype}{w.shape}"
            assert g.tobytes() == w.tobytes(), f"run {r}: {np.count_nonzero(g != w)} of {g.size} values differ"
        outs.append(got[0])
    if varies and runs > 1 and outs[0].size > 1:
        assert not np.array_equal(outs[0], outs[1]), "the stream did not continue across runs"
    return s


def refused(model, op, why):
    """``op`` is not claimed, with a reason containing ``why``."""
    try:
        s = session(model)
    except Exception:  # noqa: BLE001 - ORT itself may have no kernel for the refused node
        s = None
    if s is not None:
        assert op not in assignment(s).get(EP_NAME, {}), f"{op} was claimed"
    reasons = [u.reason for u in partition_reports()[-1].unclaimed if u.op == op]
    assert reasons and why in reasons[0], reasons


SEEDS = [0.0, 1.0, 2.7, 12345.0, 2147483647.0, 4294967040.0]
SHAPES = [[], [0], [7], [3, 5], [2, 3, 4], [10001]]
TYPES = [T.FLOAT, T.DOUBLE]


@pytest.mark.parametrize("t", TYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_uniform(seed, shape, t):
    check_exact(_model("RandomUniform", {"shape": shape, "seed": seed, "dtype": t, "low": -1.5, "high": 7.25}),
                runs=RUNS if shape != [0] else 2)


@pytest.mark.parametrize("t", TYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_normal(seed, shape, t):
    check_exact(_model("RandomNormal", {"shape": shape, "seed": seed, "dtype": t, "mean": -3.0, "scale": 0.125}),
                runs=RUNS if shape != [0] else 2)


@pytest.mark.parametrize("op,attrs", [("RandomUniform", {}), ("RandomNormal", {}),
                                      ("RandomUniform", {"low": 2.0, "high": 2.0}),
                                      ("RandomUniform", {"low": -3e38, "high": 3e38}),      # high - low overflows to inf
                                      ("RandomUniform", {"low": -1e38, "high": 1e38}),
                                      ("RandomNormal", {"mean": 1e3, "scale": 1e-30}),
                                      ("RandomNormal", {"mean": -0.1, "scale": 7.5})])
def test_default_dtype_and_odd_parameters(op, attrs):
    degenerate = attrs.get("high") in (2.0, 3e38) or attrs.get("scale") == 1e-30     # constant outputs
    check_exact(_model(op, {"shape": [5, 3], "seed": 9.0, **attrs}), varies=not degenerate)


@pytest.mark.parametrize("seed,at", [(12587189.0, 1), (4600583.0, 2), (147827.0, 16)])
def test_uniform_canonical_below_one(seed, at):
    """Seeds whose draw ``at`` rounds to 1.0 in float: libstdc++ returns nextafter(1, 0) there."""
    m = _model("RandomUniform", {"shape": [20], "seed": seed})
    check_exact(m)
    first = session(m).run(None, {})[0]
    assert first[at] == np.nextafter(np.float32(1), np.float32(0))


@pytest.mark.parametrize("op", ["RandomUniformLike", "RandomNormalLike"])
@pytest.mark.parametrize("in_t,dtype", [(T.FLOAT, None), (T.DOUBLE, None), (T.FLOAT, T.DOUBLE),
                                        (T.INT64, T.FLOAT), (T.DOUBLE, T.FLOAT)])
def test_like(op, in_t, dtype):
    attrs = {"seed": 21.0}
    if dtype is not None:
        attrs["dtype"] = dtype
    out_t = dtype if dtype is not None else in_t
    x = np.zeros((3, 4, 5), {T.FLOAT: np.float32, T.DOUBLE: np.float64, T.INT64: np.int64}[in_t])
    check_exact(_model(op, attrs, [("x", in_t, x.shape)], out_t), {"x": x})


@pytest.mark.parametrize("opset", [15, 21])
@pytest.mark.parametrize("t", TYPES, ids=["f32", "f64"])
def test_bernoulli_seeded(opset, t):
    """ORT expands Bernoulli into RandomUniformLike -> Greater -> Cast: all three claimed, exact."""
    x = np.random.default_rng(0).random((6, 7)).astype(np.float32 if t == T.FLOAT else np.float64)
    check_exact(_model("Bernoulli", {"seed": 5.0}, [("x", t, x.shape)], t, opset=opset), {"x": x})


def test_two_nodes_one_seed_and_downstream_ops():
    """Each node owns its engine (same seed: same stream), and device ops consume the values."""
    nodes = [helper.make_node("RandomNormal", [], [o], shape=[4, 6], seed=3.0) for o in ("y", "z")]
    nodes += [helper.make_node("Add", ["y", "z"], ["s"]), helper.make_node("Mul", ["s", "x"], ["p"])]
    m = make_model(nodes, [("x", T.FLOAT, (4, 6))], [("y", T.FLOAT, None), ("z", T.FLOAT, None), ("p", T.FLOAT, None)],
                   opset=21)
    x = np.random.default_rng(1).normal(size=(4, 6)).astype(np.float32)
    s = check_exact(m, {"x": x})
    y, z, _ = s.run(None, {"x": x})
    np.testing.assert_array_equal(y, z)


def test_sessions_start_from_the_seed():
    m = _model("RandomUniform", {"shape": [8], "seed": 11.0})
    a, b = session(m), session(m)
    first = a.run(None, {})[0]
    a.run(None, {})
    np.testing.assert_array_equal(b.run(None, {})[0], first)


@pytest.mark.parametrize("op,attrs,inputs,why", [
    ("RandomUniform", {"shape": [3]}, (), "no seed"),
    ("RandomNormal", {"shape": [3], "dtype": T.DOUBLE}, (), "no seed"),
    ("RandomUniformLike", {}, [("x", T.FLOAT, (2, 2))], "no seed"),
    ("RandomNormal", {"shape": [3], "seed": -1.0}, (), "seed -1.0"),
    ("RandomNormal", {"shape": [3], "seed": 5e9}, (), "seed"),
    ("RandomUniform", {"shape": [3], "seed": 1.0, "dtype": T.FLOAT16}, (), "dtype float16"),
    # ORT's libstdc++ asserts these (the process aborts): never claimed, never run on the CPU EP here
    ("RandomUniform", {"shape": [3], "seed": 1.0, "low": 2.0, "high": -1.0}, (), "low <= high"),
    ("RandomUniformLike", {"seed": 1.0, "high": float("nan")}, [("x", T.FLOAT, (2, 2))], "low <= high"),
    ("RandomNormal", {"shape": [3], "seed": 1.0, "scale": 0.0}, (), "scale must be"),
    ("RandomNormalLike", {"seed": 1.0, "scale": -2.0}, [("x", T.FLOAT, (2, 2))], "scale must be"),
    ("RandomNormal", {"shape": [3], "seed": 1.0, "mean": float("inf")}, (), "scale must be"),
])
def test_refused(op, attrs, inputs, why):
    refused(_model(op, attrs, inputs, out_type=attrs.get("dtype", T.FLOAT)), op, why)


def test_refused_opset22():
    refused(_model("RandomUniform", {"shape": [3], "seed": 1.0}, opset=22), "RandomUniform", "since_version 22")


def test_refused_elsewhere(monkeypatch):
    """Only the verified platform and onnxruntime version claim seeded generators."""
    from ortmlx import version
    from ortmlx.kernels.ops import random as rnd
    assert rnd.platform_reason() is None
    monkeypatch.setattr(sys, "platform", "darwin")
    assert "Linux x86_64 only" in rnd.platform_reason()
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(version, "_LOADED", ["1.32.0"])
    assert "onnxruntime 1.31 only" in rnd.platform_reason()


def test_like_of_a_device_value():
    """The *Like input computed on the device inside the group: only its shape is read."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("RandomNormalLike", ["r"], ["y"], seed=8.0),
             helper.make_node("Add", ["y", "r"], ["s"])]
    m = make_model(nodes, [("x", T.FLOAT, (5, 4))], [("y", T.FLOAT, None), ("s", T.FLOAT, None)], opset=21)
    x = np.random.default_rng(2).normal(size=(5, 4)).astype(np.float32)
    check_exact(m, {"x": x})
