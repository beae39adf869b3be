"""Normalization layers against ORT's CPU EP (fp32 rtol 1e-4 atol 1e-5; fp16 1e-2; f64 1e-9)."""
import numpy as np
import pytest
from onnx import TensorProto as T, helper
from onnx.reference import ReferenceEvaluator

from _nnutil import check, check_bf16, one_node, rand, stays_on_cpu
from ortmlx.testing import make_model, session, unclaimed_ops

F = [T.FLOAT, T.FLOAT16]


# ---------------------------------------------------------------- BatchNormalization
BN = [  # (x shape, opset, attrs)
    ((2, 3), 15, {}),
    ((2, 3, 5), 15, {}),
    ((2, 3, 4, 5), 15, {"epsilon": 1e-3}),
    ((1, 3, 2, 3, 4), 15, {}),
    ((0, 3, 4, 4), 15, {}),
    ((2, 3, 4, 4), 7, {}),
    ((2, 3, 4, 4), 9, {"momentum": 0.5}),
    ((2, 3, 4, 4), 14, {"training_mode": 0}),
]


@pytest.mark.parametrize("t", F + [T.DOUBLE])
@pytest.mark.parametrize("shape,opset,attrs", BN)
def test_batchnorm(shape, opset, attrs, t):
    if t == T.DOUBLE and opset < 15 and opset != 9:
        pytest.skip("same kernel as the float32 case; float64 covered at opset 9/15")
    c = shape[1]
    ins = [("x", t, shape), ("s", t, (c,)), ("b", t, (c,)), ("m", t, (c,)), ("v", t, (c,))]
    feeds = {"x": rand(shape, t, 0, -2, 2), "s": rand((c,), t, 1), "b": rand((c,), t, 2),
             "m": rand((c,), t, 3), "v": rand((c,), t, 4, 0.1, 2.0)}
    check(one_node("BatchNormalization", ins, [("y", t, None)], attrs, opset=opset), feeds, t)


@pytest.mark.parametrize("t", F + [T.DOUBLE])
@pytest.mark.parametrize("shape", [(4, 3, 2), (2, 3, 4, 5), (3, 2)])
def test_batchnorm_training(shape, t):
    # training_mode=1 (ORT requires all three outputs): batch statistics, running mean/var updated
    c = shape[1]
    outs = ["y", "rm", "rv"]
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], outs, training_mode=1, momentum=0.7)
    m = make_model([node], [("x", t, shape), ("s", t, (c,)), ("b", t, (c,)), ("m", t, (c,)), ("v", t, (c,))],
                   [(o, t, None) for o in outs], opset=15)
    check(m, {"x": rand(shape, t, 0, -2, 3), "s": rand((c,), t, 1), "b": rand((c,), t, 2), "m": rand((c,), t, 3),
              "v": rand((c,), t, 4, 0.5, 1.5)}, t)


def test_batchnorm_old_training_outputs_refused():
    c = 3
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv", "sm", "sv"])
    m = make_model([node], [("x", T.FLOAT, (4, c, 2))],
                   [(o, T.FLOAT, None) for o in ("y", "rm", "rv", "sm", "sv")],
                   {"s": rand((c,), seed=1), "b": rand((c,), seed=2), "m": rand((c,), seed=3),
                    "v": rand((c,), seed=4, lo=0.5)}, opset=9)
    from ortmlx import partition_reports
    try:                                      # ORT's CPU EP may or may not run opset-9 training outputs
        session(m).run(None, {"x": rand((4, c, 2))})
    except Exception:
        pass
    assert any(u.op == "BatchNormalization" for u in partition_reports()[-1].unclaimed)


# ---------------------------------------------------------------- InstanceNormalization
@pytest.mark.parametrize("t", F)
@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 4, 5), (1, 2, 2, 3, 4), (0, 3, 4)])
def test_instance_norm(shape, t):
    c = shape[1]
    ins = [("x", t, shape), ("s", t, (c,)), ("b", t, (c,))]
    feeds = {"x": rand(shape, t, 0, -2, 3), "s": rand((c,), t, 1), "b": rand((c,), t, 2)}
    check(one_node("InstanceNormalization", ins, [("y", t, None)], {"epsilon": 1e-4}), feeds, t)


def test_instance_norm_infinite_scale_is_the_specs():
    """An infinite scale gives scale * (x - mean) / sqrt(var + epsilon) + B: +-inf (0 * inf where x is the mean:
    NaN), as onnx's reference evaluator. ORT's CPU EP folds scale and shift first and gives NaN (inf - inf) for
    the whole channel (``fuzz.KNOWN_BUGS``)."""
    x = np.array([[[1, 3], [1, 2]], [[0.5, 2.5], [-1, 1]]], np.float32)
    s, b = np.array([np.inf, -np.inf], np.float32), np.array([0, 1], np.float32)
    m = one_node("InstanceNormalization", [("x", T.FLOAT, x.shape), ("s", T.FLOAT, (2,)), ("b", T.FLOAT, (2,))],
                 [("y", T.FLOAT, None)], {"epsilon": 1e-4})
    feeds = {"x": x, "s": s, "b": b}
    sess = session(m)
    assert not unclaimed_ops(sess)
    got = sess.run(None, feeds)[0]
    want = ReferenceEvaluator(m).run(None, feeds)[0]
    np.testing.assert_array_equal(got, want)
    assert np.isinf(got).all()


# ---------------------------------------------------------------- LayerNormalization
LN = [  # (x shape, axis, with bias, n outputs)
    ((2, 3, 8), -1, True, 1),
    ((2, 3, 8), -1, False, 1),
    ((2, 3, 8), 1, True, 1),
    ((2, 3, 8), 0, True, 3),
    ((2, 3, 8), -1, True, 3),
    ((2, 3, 8), -2, False, 2),
    ((4, 6), -1, True, 3),
    ((0, 3, 8), -1, True, 1),
]


@pytest.mark.parametrize("t", F + [T.DOUBLE])
@pytest.mark.parametrize("shape,axis,bias,nout", LN)
def test_layer_norm(shape, axis, bias, nout, t):
    norm = shape[axis % len(shape):]
    ins = [("x", t, shape), ("s", t, norm)] + ([("b", t, norm)] if bias else [])
    outs = [("y", t, None), ("mean", T.FLOAT, None), ("inv", T.FLOAT, None)][:nout]
    feeds = {"x": rand(shape, t, 0, -2, 3), "s": rand(norm, t, 1)}
    if bias:
        feeds["b"] = rand(norm, t, 2)
    m = one_node("LayerNormalization", ins, outs, {"axis": axis, "epsilon": 1e-3}, opset=17)
    check(m, feeds, t)


def test_layer_norm_bf16():
    check_bf16("LayerNormalization", [("x", (2, 3, 8)), ("s", (8,)), ("b", (8,))], opset=17,
               feeds={"x": rand((2, 3, 8), lo=-2, hi=3), "s": rand((8,), seed=1), "b": rand((8,), seed=2)})


def test_layer_norm_broadcast_scale():
    ins = [("x", T.FLOAT, (2, 3, 8)), ("s", T.FLOAT, (1, 8)), ("b", T.FLOAT, (8,))]
    check(one_node("LayerNormalization", ins, [("y", T.FLOAT, None)], {"axis": -2}, opset=17),
          {"x": rand((2, 3, 8)), "s": rand((1, 8), seed=1), "b": rand((8,), seed=2)})


# ---------------------------------------------------------------- GroupNormalization
GN = [  # (x shape, groups, opset)
    ((2, 4, 5), 2, 18), ((2, 6, 3, 3), 3, 18), ((2, 4, 5), 2, 21), ((2, 6, 3, 3), 3, 21),
    ((2, 6, 3, 3), 1, 21), ((2, 6, 3, 3), 6, 21), ((1, 4, 2, 2, 2), 2, 21),
]  # no zero-size batch: ORT's CPU EP fails on it (its function body reshapes with -1)


@pytest.mark.parametrize("t", F + [T.DOUBLE])
@pytest.mark.parametrize("shape,groups,opset", GN)
def test_group_norm(shape, groups, opset, t):
    n = groups if opset < 21 else shape[1]
    ins = [("x", t, shape), ("s", t, (n,)), ("b", t, (n,))]
    feeds = {"x": rand(shape, t, 0, -2, 3), "s": rand((n,), t, 1), "b": rand((n,), t, 2)}
    m = one_node("GroupNormalization", ins, [("y", t, None)], {"num_groups": groups, "epsilon": 1e-4}, opset=opset)
    if t == T.DOUBLE and opset >= 21:       # stash_type 1: float32 statistics, float32-level agreement
        check(m, feeds, t, rtol=1e-5, atol=1e-6)
    else:
        check(m, feeds, t)


# ---------------------------------------------------------------- RMSNormalization
RMS = [((2, 3, 8), -1), ((2, 3, 8), 1), ((2, 3, 8), 0), ((4, 8), -1), ((0, 8), -1)]


@pytest.mark.parametrize("t", F + [T.DOUBLE])
@pytest.mark.parametrize("shape,axis", RMS)
def test_rms_norm(shape, axis, t):
    norm = shape[axis % len(shape):]
    ins = [("x", t, shape), ("s", t, norm)]
    m = one_node("RMSNormalization", ins, [("y", t, None)], {"axis": axis, "epsilon": 1e-4}, opset=23)
    check(m, {"x": rand(shape, t, 0, -2, 3), "s": rand(norm, t, 1)}, t)


# ---------------------------------------------------------------- LpNormalization
LP = [((3, 4), -1), ((3, 4), 0), ((2, 3, 4), 1), ((5,), 0)]


@pytest.mark.parametrize("t", [T.FLOAT, T.DOUBLE])
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("shape,axis", LP)
def test_lp_norm(shape, axis, p, t):
    x = rand(shape, t, 0, -2, 2)
    x[0] = 0                                   # a zero slice (zero norm along the last axis)
    check(one_node("LpNormalization", [("x", t, shape)], [("y", t, None)], {"axis": axis, "p": p}, opset=1),
          {"x": x}, t)


@pytest.mark.parametrize("t", [T.FLOAT16, T.BFLOAT16])
@pytest.mark.parametrize("p", [1, 2])
def test_lp_norm_half(p, t):
    # ORT's CPU EP fails to load float16 LpNormalization (its inserted Cast is malformed): float32 reference
    x = rand((3, 4), lo=-2, hi=2)
    x[0] = 0
    check_bf16("LpNormalization", [("x", (3, 4))], attrs={"p": p}, opset=22, feeds={"x": x}, t=t)


# ---------------------------------------------------------------- LRN
LRN = [  # (shape, attrs); ORT's CPU EP runs only 4-D inputs with an odd size: others vs onnx.reference
    ((2, 5, 3, 3), {"size": 3}),
    ((2, 5, 3, 3), {"size": 5, "alpha": 0.01, "beta": 0.5, "bias": 2.0}),
    ((2, 7, 3, 3), {"size": 1}),
    ((0, 5, 3, 3), {"size": 3}),
]


@pytest.mark.parametrize("t", F)
@pytest.mark.parametrize("shape,attrs", LRN)
def test_lrn(shape, attrs, t):
    check(one_node("LRN", [("x", t, shape)], [("y", t, None)], attrs, opset=13), {"x": rand(shape, t, 0, -3, 3)}, t)


@pytest.mark.parametrize("shape,attrs", [((1, 3, 4), {"size": 3}), ((2, 5, 3, 3), {"size": 4})])
def test_lrn_refused(shape, attrs):
    # ORT's CPU EP runs only 4-D odd-size LRN: other cases are refused (here the CPU EP fails too)
    from ortmlx import partition_reports
    import onnxruntime as ort
    m = one_node("LRN", [("x", T.FLOAT, shape)], [("y", T.FLOAT, None)], attrs, opset=13)
    try:
        session(m).run(None, {"x": rand(shape)})
    except ort.capi.onnxruntime_pybind11_state.Fail:
        pass
    assert any(u.op == "LRN" for u in partition_reports()[-1].unclaimed)


# ---------------------------------------------------------------- MeanVarianceNormalization
# the default axes [0, 2, 3] of a 1-, 2-, 3- and 5-D input, axes past the rank and repeats: as ORT's CPU kernel,
# axes outside the rank are dropped and repeats count once (the MLX EP failed on rank 3 before; found by the fuzzer)
MVN = [((2, 3, 4, 5), None, 13), ((2, 3, 4, 5), [1], 13), ((2, 3, 4, 5), [0, 1, 2, 3], 13), ((3, 4), [0], 9),
       ((2, 3, 4, 5), [2, 3], 9), ((2, 3, 4), None, 13), ((1, 2, 3), None, 13), ((5,), None, 13), ((2, 5), None, 13),
       ((2, 3, 4, 5, 2), None, 13), ((2, 3, 4), [0, 3], 13), ((2, 3, 4), [1, 1], 13), ((2, 3, 4), [-1], 13)]


@pytest.mark.parametrize("shape,axes,opset", MVN)
def test_mvn(shape, axes, opset):
    attrs = {} if axes is None else {"axes": axes}
    m = one_node("MeanVarianceNormalization", [("x", T.FLOAT, shape)], [("y", T.FLOAT, None)], attrs, opset=opset)
    check(m, {"x": rand(shape, T.FLOAT, 0, -2, 3)})


def test_mvn_constant_group_is_the_specs():
    """A constant group gives 0: the spec's (x - mean) / (sd + 1e-9), as onnx's reference evaluator; ORT's CPU EP
    adds no epsilon and gives NaN (``docs/reliability.md``)."""
    x = np.full((1, 2, 2, 2), 2.0, np.float32)
    x[0, 1] = [[1, 2], [3, 4]]
    m = one_node("MeanVarianceNormalization", [("x", T.FLOAT, x.shape)], [("y", T.FLOAT, None)], {}, opset=13)
    s = session(m)
    assert not unclaimed_ops(s)
    got = s.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ReferenceEvaluator(m).run(None, {"x": x})[0], rtol=1e-6)
    assert (got[0, 0] == 0).all()


def test_mvn_half():
    # ORT's CPU EP cannot load float16 MeanVarianceNormalization (its function body mixes types)
    check_bf16("MeanVarianceNormalization", [("x", (2, 3, 4, 5))], opset=13, feeds={"x": rand((2, 3, 4, 5))},
               t=T.FLOAT16)
