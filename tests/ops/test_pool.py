"""Pooling against ORT's CPU EP (fp32 rtol 1e-4 atol 1e-5, fp16 1e-2; max pooling and indices exact)."""
import numpy as np
import pytest
from onnx import TensorProto as T

from _nnutil import check, check_bf16, one_node, rand, stays_on_cpu
from ortmlx.testing import check_against_cpu, session, unclaimed_ops

F = [T.FLOAT, T.FLOAT16]

POOL = [  # (x shape, attrs)
    ((1, 2, 7), {"kernel_shape": [3]}),
    ((2, 3, 6, 5), {"kernel_shape": [2, 2]}),
    ((1, 2, 4, 5, 6), {"kernel_shape": [2, 3, 2], "strides": [2, 1, 2]}),
    ((1, 2, 7, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((1, 2, 7, 8), {"kernel_shape": [3, 2], "strides": [2, 3], "pads": [0, 1, 2, 1]}),
    ((1, 2, 7, 8), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ((1, 2, 8, 8), {"kernel_shape": [3, 3], "strides": [3, 3], "pads": [1, 1, 1, 1], "ceil_mode": 1}),
    ((1, 2, 9, 9), {"kernel_shape": [2, 3], "dilations": [2, 2]}),
    ((1, 2, 9, 9), {"kernel_shape": [2, 2], "dilations": [2, 3], "strides": [2, 1], "pads": [1, 0, 1, 1],
                    "ceil_mode": 1}),
    ((1, 2, 7, 6), {"kernel_shape": [3, 2], "auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 2, 7, 6), {"kernel_shape": [2, 3], "auto_pad": "SAME_LOWER", "strides": [2, 1]}),
    ((1, 2, 7, 6), {"kernel_shape": [3, 2], "auto_pad": "VALID", "strides": [2, 2]}),
    ((0, 2, 5, 5), {"kernel_shape": [2, 2]}),
]


@pytest.mark.parametrize("t", F + [T.DOUBLE])
@pytest.mark.parametrize("xs,attrs", POOL)
def test_maxpool(xs, attrs, t):
    check(one_node("MaxPool", [("x", t, xs)], [("y", t, None)], attrs, opset=12), {"x": rand(xs, t)}, t)


@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize("xs,attrs", [c for c in POOL if "dilations" not in c[1] or c[0][2] == 9])
def test_maxpool_indices(xs, attrs, storage_order):
    x = np.round(rand(xs) * 4) / 4           # ties: the first maximum in the window must win
    m = one_node("MaxPool", [("x", T.FLOAT, xs)], [("y", T.FLOAT, None), ("i", T.INT64, None)],
                 {**attrs, "storage_order": storage_order}, opset=12)
    if len(xs) != 4 and storage_order:
        stays_on_cpu(m, {"x": x}, "MaxPool")      # ORT applies storage_order=1 to 2-D pooling only: refused
    else:
        check(m, {"x": x})


@pytest.mark.parametrize("op,opset", [("MaxPool", 12), ("AveragePool", 19), ("LpPool", 18)])
@pytest.mark.parametrize("xs,attrs", [
    ((1, 1, 1), {"kernel_shape": [2], "dilations": [2], "auto_pad": "SAME_UPPER", "ceil_mode": 1}),
    ((1, 2, 7, 6), {"kernel_shape": [3, 2], "dilations": [2, 1], "auto_pad": "SAME_LOWER", "strides": [2, 1]})])
def test_same_padding_with_dilations_stays_on_the_cpu_ep(op, opset, xs, attrs):
    """ORT's CPU EP pads a dilated SAME window for the undilated kernel (length 1, kernel 2, dilation 2: output length
    0 where the spec's is 1): such a pool is left to it, so its answer, shape included, is the CPU EP's."""
    stays_on_cpu(one_node(op, [("x", T.FLOAT, xs)], [("y", T.FLOAT, None)], attrs, opset=opset), {"x": rand(xs)}, op)


@pytest.mark.parametrize("indices", [False, True])
@pytest.mark.parametrize("xs,attrs", [
    ((1, 2, 1), {"kernel_shape": [2], "dilations": [2], "pads": [1, 1]}),
    ((1, 1, 1, 3), {"kernel_shape": [2, 1], "dilations": [2, 1], "pads": [1, 0, 1, 0]}),
    ((1, 2, 3, 1), {"kernel_shape": [1, 2], "dilations": [1, 2], "pads": [0, 1, 0, 1], "ceil_mode": 1}),
    ((1, 1, 1, 1, 2), {"kernel_shape": [1, 2, 1], "dilations": [1, 2, 1], "pads": [0, 1, 0, 0, 1, 0]}),
    ((2, 3, 5, 4), {"kernel_shape": [2, 2], "pads": [1, 1, 1, 1], "dilations": [2, 1]})])
def test_maxpool_windows_wholly_in_the_padding(xs, attrs, indices):
    """With dilations or Indices ORT's CPU EP runs its own loop: each window starts at the lowest finite value and
    takes an element only when greater, so a window lying wholly in the padding (dilated around a short input)
    gives -3.4e38 and an index of -1 in every coordinate. The same here (non-finite inputs: each ORT path its own
    way, docs/reliability.md)."""
    x = np.round(rand(xs) * 4) / 4
    outs = [("y", T.FLOAT, None)] + ([("i", T.INT64, None)] if indices else [])
    check(one_node("MaxPool", [("x", T.FLOAT, xs)], outs, attrs, opset=12), {"x": x})


@pytest.mark.parametrize("t", [T.FLOAT, T.FLOAT16])
@pytest.mark.parametrize("xs,attrs", [
    ((1, 1, 1, 1), {"kernel_shape": [1, 2], "dilations": [1, 2], "pads": [0, 1, 0, 0], "strides": [1, 2],
                    "ceil_mode": 1}),
    ((1, 2, 2), {"kernel_shape": [2], "dilations": [3], "pads": [1, 1]}),
    ((2, 1, 2, 1), {"kernel_shape": [2, 2], "dilations": [1, 2], "pads": [1, 1, 1, 1]})])
def test_averagepool_windows_wholly_in_the_padding(xs, attrs, t):
    """A window holding no input element (dilated around a short input, without count_include_pad) averages
    nothing: 0, as ORT's CPU EP (found by the fuzzer in float16: the MLX EP gave 0 / 0, NaN, in float32 too)."""
    x = (np.round(rand(xs) * 4) / 4).astype(np.float16 if t == T.FLOAT16 else np.float32)
    check(one_node("AveragePool", [("x", t, xs)], [("y", t, None)], attrs, opset=19), {"x": x}, t)


@pytest.mark.parametrize("t", [T.FLOAT, T.FLOAT16])
@pytest.mark.parametrize("shape", [(1, 3, 2), (1, 3, 1, 2), (1, 3, 2, 1, 1)])
def test_global_maxpool_of_a_channel_of_minus_infinity(shape, t):
    """A channel of -inf only gives the lowest finite float32, as ORT's CPU EP's maximum starts there (float16: that
    rounded, -inf: ORT pools it in float32)."""
    x = np.array([[-np.inf, -np.inf], [-2.0, -np.inf], [0.5, 1.5]], np.float32).reshape(shape)
    x = x.astype(np.float16) if t == T.FLOAT16 else x
    check(one_node("GlobalMaxPool", [("x", t, shape)], [("y", t, None)], {}, opset=12), {"x": x}, t)


def test_maxpool_nan_propagates():
    """A window or channel holding NaN gives NaN (NumPy's max; a global one never below the lowest finite float, as
    above). ORT's CPU EP skips or keeps it by shape and position (``fuzz.KNOWN_BUGS``)."""
    x = np.array([1, np.nan, 2, 3, -np.inf, -np.inf, 0, np.nan, 5, 4, np.nan, -np.inf, -np.inf, -np.inf, -np.inf,
                  -np.inf], np.float32).reshape(1, 1, 4, 4)
    x = np.concatenate([x, np.full_like(x, np.nan), np.full_like(x, -np.inf)], axis=1)      # (1, 3, 4, 4)
    cases = [("MaxPool", {"kernel_shape": [2, 2], "strides": [2, 2]}, x.reshape(1, 3, 2, 2, 2, 2).max(axis=(3, 5))),
             ("GlobalMaxPool", {}, np.maximum(x.max(axis=(2, 3), keepdims=True), np.finfo(np.float32).min))]
    for op, attrs, want in cases:
        s = session(one_node(op, [("x", T.FLOAT, x.shape)], [("y", T.FLOAT, None)], attrs, opset=12))
        assert not unclaimed_ops(s), unclaimed_ops(s)
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], want)


@pytest.mark.parametrize("t", [T.INT8, T.UINT8])
def test_maxpool_int8(t):
    x = np.random.default_rng(0).integers(0 if t == T.UINT8 else -128, 127, (1, 2, 5, 5)).astype(
        np.uint8 if t == T.UINT8 else np.int8)
    m = one_node("MaxPool", [("x", t, x.shape)], [("y", t, None)], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]},
                 opset=12)
    check_against_cpu(m, [{"x": x}])


@pytest.mark.parametrize("opset", [1, 8, 10, 11, 12, 22])
def test_maxpool_opsets(opset):
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    check(one_node("MaxPool", [("x", T.FLOAT, (1, 2, 7, 7))], [("y", T.FLOAT, None)], attrs, opset=opset),
          {"x": rand((1, 2, 7, 7))})


AVG_EXTRA = [{}, {"count_include_pad": 1}]


@pytest.mark.parametrize("t", F)
@pytest.mark.parametrize("extra", AVG_EXTRA, ids=["exclude_pad", "include_pad"])
@pytest.mark.parametrize("xs,attrs", POOL)
def test_average_pool(xs, attrs, extra, t):
    check(one_node("AveragePool", [("x", t, xs)], [("y", t, None)], {**attrs, **extra}, opset=19), {"x": rand(xs, t)},
          t)


@pytest.mark.parametrize("opset", [7, 10, 11])
@pytest.mark.parametrize("extra", AVG_EXTRA, ids=["exclude_pad", "include_pad"])
def test_average_pool_opsets(opset, extra):
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], **extra}
    if opset >= 10:
        attrs["ceil_mode"] = 1
    check(one_node("AveragePool", [("x", T.FLOAT, (1, 2, 8, 8))], [("y", T.FLOAT, None)], attrs, opset=opset),
          {"x": rand((1, 2, 8, 8))})


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("xs,attrs", [c for c in POOL if "dilations" not in c[1] and "ceil_mode" not in c[1]])
def test_lp_pool(xs, attrs, p):
    check(one_node("LpPool", [("x", T.FLOAT, xs)], [("y", T.FLOAT, None)], {**attrs, "p": p}, opset=11),
          {"x": rand(xs)})


@pytest.mark.parametrize("xs,attrs", [c for c in POOL if "dilations" in c[1] or "ceil_mode" in c[1]])
def test_lp_pool_18(xs, attrs):
    check(one_node("LpPool", [("x", T.FLOAT, xs)], [("y", T.FLOAT, None)], attrs, opset=18), {"x": rand(xs)})


GLOBAL = [(1, 3, 5), (2, 3, 4, 5), (1, 2, 3, 2, 4), (0, 3, 4, 4)]


@pytest.mark.parametrize("t", F)
@pytest.mark.parametrize("op,attrs", [("GlobalAveragePool", {}), ("GlobalMaxPool", {}), ("GlobalLpPool", {}),
                                      ("GlobalLpPool", {"p": 1}), ("GlobalLpPool", {"p": 3})])
@pytest.mark.parametrize("xs", GLOBAL)
def test_global_pool(op, attrs, xs, t):
    if op == "GlobalLpPool" and t == T.FLOAT16:
        # ORT's CPU EP has no float16 GlobalLpPool: float32 CPU on fp16-rounded inputs, rounded to fp16
        check_bf16(op, [("x", xs)], attrs=attrs, opset=13, feeds={"x": rand(xs)}, t=T.FLOAT16, rtol=1e-2, atol=1e-2)
        return
    check(one_node(op, [("x", t, xs)], [("y", t, None)], attrs, opset=13), {"x": rand(xs, t)}, t)


def test_pool_bf16():
    check_bf16("MaxPool", [("x", (1, 2, 5, 5))], attrs={"kernel_shape": [2, 2]}, opset=22,
               feeds={"x": rand((1, 2, 5, 5))}, rtol=0, atol=0)
    check_bf16("AveragePool", [("x", (1, 2, 5, 5))], attrs={"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]},
               opset=22, feeds={"x": rand((1, 2, 5, 5))})


UNPOOL = [  # (x shape, attrs, output_shape)
    ((2, 3, 4, 4), {"kernel_shape": [2, 2], "strides": [2, 2]}, None),
    ((1, 2, 3, 3), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, None),
    ((1, 2, 3), {"kernel_shape": [2], "strides": [2]}, [1, 2, 7]),
    ((1, 1, 2, 2, 2), {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}, None),
]


@pytest.mark.parametrize("xs,attrs,out", UNPOOL)
def test_max_unpool(xs, attrs, out):
    # random flat indices fed as a graph input (a host value), with duplicates
    from onnx import helper
    from ortmlx.testing import make_model
    pads = attrs.get("pads") or [0] * (2 * (len(xs) - 2))
    nsp = len(xs) - 2
    shape = out or [xs[0], xs[1]] + [(n - 1) * s + k - pads[i] - pads[i + nsp] for i, (n, s, k) in
                                     enumerate(zip(xs[2:], attrs["strides"], attrs["kernel_shape"]))]
    total = int(np.prod(shape))
    rng = np.random.default_rng(0)
    idx = rng.integers(0, total, size=xs).astype(np.int64)
    idx.reshape(-1)[:2] = idx.reshape(-1)[2]             # duplicate slots: the last write wins
    ins = ["x", "i"] + (["s"] if out else [])
    inits = {"s": np.asarray(out, np.int64)} if out else {}
    m = make_model([helper.make_node("MaxUnpool", ins, ["y"], **attrs)], [("x", T.FLOAT, xs), ("i", T.INT64, xs)],
                   [("y", T.FLOAT, None)], inits, opset=11)
    check(m, {"x": rand(xs), "i": idx}, rtol=0, atol=0)


def test_max_unpool_bad_index():
    from onnx import helper
    from ortmlx.testing import make_model, session
    m = make_model([helper.make_node("MaxUnpool", ["x", "i"], ["y"], kernel_shape=[2, 2], strides=[2, 2])],
                   [("x", T.FLOAT, (1, 1, 2, 2)), ("i", T.INT64, (1, 1, 2, 2))], [("y", T.FLOAT, None)], opset=11)
    with pytest.raises(Exception, match="MaxUnpool.*out of range"):
        session(m).run(None, {"x": rand((1, 1, 2, 2)), "i": np.array([0, 1, 2, 99], np.int64).reshape(1, 1, 2, 2)})
