"""QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear against ORT's CPU EP (integers exact)."""
import mlx.core as mx
import numpy as np
import pytest
from onnx import TensorProto as T, helper

from _nnutil import check, stays_on_cpu
from ortmlx.kernels.ops import quantization as QZ
from ortmlx.testing import assert_close, make_model, session, unclaimed_ops

#: MLX's GPU has no float64: there a product's integer sum is exact only up to depth ``_MAX_K_F32`` in float32, and a
#: QLinearConv's bias cannot be proven not to wrap (the translators refuse those, by design)
GPU = mx.default_device() == mx.gpu

NPT = {T.UINT8: np.uint8, T.INT8: np.int8, T.UINT16: np.uint16, T.INT16: np.int16, T.INT32: np.int32,
       T.FLOAT: np.float32, T.FLOAT16: np.float16}
X = (2, 3, 4)

CASES = [  # (qtype, float type, scale shape, attrs, with zero point, opset)
    (T.UINT8, T.FLOAT, (), {}, True, 10),
    (T.UINT8, T.FLOAT, (), {}, False, 13),
    (T.INT8, T.FLOAT, (3,), {}, True, 13),
    (T.INT8, T.FLOAT, (4,), {"axis": -1}, True, 13),
    (T.UINT8, T.FLOAT, (2,), {"axis": 0}, False, 19),
    (T.INT8, T.FLOAT16, (3,), {}, True, 19),
    (T.UINT16, T.FLOAT, (3,), {}, True, 21),
    (T.INT16, T.FLOAT, (), {}, True, 21),
    (T.INT8, T.FLOAT, (2, 3, 2), {"axis": 2, "block_size": 2}, True, 21),
    (T.UINT8, T.FLOAT, (2, 1, 4), {"axis": 1, "block_size": 3}, True, 21),
    (T.INT8, T.FLOAT, (1, 3, 4), {"axis": 0, "block_size": 2}, False, 21),
    (T.INT8, T.FLOAT, (3,), {}, True, 23),
    (T.UINT8, T.FLOAT16, (), {}, True, 23),
]


def _params(q, f, sshape, zp, seed=0):
    rng = np.random.default_rng(seed)
    p = {"s": rng.uniform(0.02, 0.2, sshape).astype(NPT[f])}
    if zp:
        info = np.iinfo(NPT[q])
        p["z"] = rng.integers(max(info.min, -20), min(info.max, 20) + 1, sshape).astype(NPT[q])
    return p


@pytest.mark.parametrize("q,f,sshape,attrs,zp,opset", CASES)
def test_dequantize(q, f, sshape, attrs, zp, opset):
    inits = _params(q, f, sshape, zp)
    node = helper.make_node("DequantizeLinear", ["x", "s"] + (["z"] if zp else []), ["y"], **attrs)
    m = make_model([node], [("x", q, X)], [("y", f, None)], inits, opset=opset)
    info = np.iinfo(NPT[q])
    x = np.random.default_rng(1).integers(info.min, int(info.max) + 1, X).astype(NPT[q])
    check(m, {"x": x}, f)


@pytest.mark.parametrize("q,f,sshape,attrs,zp,opset", CASES)
def test_quantize(q, f, sshape, attrs, zp, opset):
    inits = _params(q, f, sshape, zp)
    if not zp and q != T.UINT8:
        attrs = dict(attrs, output_dtype=q)            # without a zero point y is uint8 unless told
    node = helper.make_node("QuantizeLinear", ["x", "s"] + (["z"] if zp else []), ["y"], **attrs)
    m = make_model([node], [("x", f, X)], [("y", q, None)], inits, opset=opset)
    x = np.random.default_rng(2).uniform(-40, 40, X).astype(NPT[f])       # some values saturate
    check(m, {"x": x}, f)


def test_quantize_ties_round_half_even():
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])
    m = make_model([node], [("x", T.FLOAT, (10,))], [("y", T.INT8, None)],
                   {"s": np.array(0.5, np.float32), "z": np.array(3, np.int8)})
    check(m, {"x": np.array([0.25, 0.75, 1.25, -0.25, -0.75, -1.25, 63.0, 63.25, -65.75, -66.25], np.float32)})


def test_quantize_precision_refused():
    # precision=float16 asks for a float16 division: not implemented, stays on CPU
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], precision=T.FLOAT16)
    m = make_model([node], [("x", T.FLOAT, (4,))], [("y", T.UINT8, None)],
                   {"s": np.array(0.3, np.float32), "z": np.array(3, np.uint8)}, opset=23)
    try:
        stays_on_cpu(m, {"x": np.array([0.1, 1.0, 2.5, 40.0], np.float32)}, "QuantizeLinear")
    except Exception as e:                       # noqa: BLE001
        if "precision" in str(e) and "MLX" not in str(e):
            pytest.skip(f"ORT's CPU EP cannot run it either: {e}")
        raise


def test_dequantize_int32():
    node = helper.make_node("DequantizeLinear", ["x", "s"], ["y"])
    m = make_model([node], [("x", T.INT32, (6,))], [("y", T.FLOAT, None)], {"s": np.array(0.01, np.float32)})
    check(m, {"x": np.array([-2**31, 2**31 - 1, 0, 1, -7, 123456789], np.int32)})


def test_dequantize_int32_nonzero_zero_point_refused():
    node = helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"])
    m = make_model([node], [("x", T.INT32, (3,)), ("z", T.INT32, ())], [("y", T.FLOAT, None)],
                   {"s": np.array(0.5, np.float32)})
    stays_on_cpu(m, {"x": np.array([1, 2, 3], np.int32), "z": np.array(0, np.int32)}, "DequantizeLinear")


@pytest.mark.parametrize("x", [
    np.array([[-1.5, 0.0, 2.25], [7.0, -3.0, 0.5]], np.float32),
    np.array([0.1, 2.0, 3.0, 255.0], np.float32),          # all >= 0: zero point 0
    np.array([-0.1, -2.0, -3.5], np.float32),               # all <= 0: zero point 255
    np.zeros((3, 2), np.float32),                           # constant: scale 0 -> ORT's convention
    np.random.default_rng(3).normal(0, 4, (5, 7)).astype(np.float32),
])
def test_dynamic_quantize(x):
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])
    m = make_model([node], [("x", T.FLOAT, x.shape)], [("y", T.UINT8, None), ("s", T.FLOAT, None),
                                                        ("z", T.UINT8, None)])
    check(m, {"x": x})


IMM = [  # (A dtype, B dtype, A shape, B shape, a_zp, b_zp ('' none, 's' scalar, 'c' per column))
    (T.UINT8, T.UINT8, (4, 8), (8, 5), "s", "s"),
    (T.INT8, T.INT8, (2, 3, 16), (16, 6), "s", "c"),
    (T.UINT8, T.INT8, (3, 7), (2, 7, 4), "", ""),
    (T.INT8, T.UINT8, (5, 300), (300, 3), "s", "c"),        # K = 300: > float32's exact depth, two chunks
    (T.UINT8, T.INT8, (2, 3, 600), (600, 4), "s", "c"),     # three chunks (the last padded), A batched
    (T.UINT8, T.UINT8, (3, 517), (2, 517, 5), "s", "s"),    # B batched, A broadcast over it
    (T.UINT8, T.UINT8, (2, 1, 4, 8), (3, 8, 2), "s", ""),
]


def _ints(t, shape, seed):
    info = np.iinfo(NPT[t])
    return np.random.default_rng(seed).integers(info.min, int(info.max) + 1, shape).astype(NPT[t])


@pytest.mark.parametrize("ta,tb,sa,sb,azp,bzp", IMM)
def test_matmul_integer(ta, tb, sa, sb, azp, bzp):
    """Against an exact int64 NumPy product, not ORT's CPU EP: on x86 CPUs without VNNI (AVX2) its u8 x s8
    kernel sums pairs in saturating int16 (pmaddubsw) and is wrong by design at large products."""
    n = sb[-1]
    inits = {}
    ins = ["a", "b", "az" if azp else "", "bz" if bzp else ""]
    if azp:
        inits["az"] = _ints(ta, (), 3)
    if bzp:
        inits["bz"] = _ints(tb, (n,) if bzp == "c" else (), 4)
    while not ins[-1]:
        ins.pop()
    m = make_model([helper.make_node("MatMulInteger", ins, ["y"])], [("a", ta, sa), ("b", tb, sb)],
                   [("y", T.INT32, None)], inits)
    a, b = _ints(ta, sa, 1), _ints(tb, sb, 2)
    want = (a.astype(np.int64) - inits.get("az", 0)) @ (b.astype(np.int64) - inits.get("bz", 0))
    s = session(m)
    assert not unclaimed_ops(s), unclaimed_ops(s)
    assert_close(s.run(None, {"a": a, "b": b})[0], want.astype(np.int32), what="y")


QLMM = [  # (A/B/Y dtype, scale dtype, A shape, B shape, per-column b)
    (T.UINT8, T.FLOAT, (4, 8), (8, 5), False),
    (T.INT8, T.FLOAT, (2, 3, 16), (16, 6), True),
    (T.UINT8, T.FLOAT16, (3, 40), (40, 4), False),
    (T.INT8, T.FLOAT, (2, 300), (300, 3), True),
]


@pytest.mark.parametrize("q,f,sa,sb,per_col", QLMM)
def test_qlinear_matmul(q, f, sa, sb, per_col):
    n = sb[-1]
    rng = np.random.default_rng(5)
    inits = {"as": np.array(0.05, NPT[f]), "az": _ints(q, (), 6),
             "bs": rng.uniform(0.01, 0.05, (n,) if per_col else ()).astype(NPT[f]),
             "bz": _ints(q, (n,) if per_col else (), 7), "ys": np.array(0.3 * np.sqrt(sa[-1]), NPT[f]),
             "yz": _ints(q, (), 8)}
    node = helper.make_node("QLinearMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"])
    m = make_model([node], [("a", q, sa), ("b", q, sb)], [("y", q, None)], inits)
    check(m, {"a": _ints(q, sa, 1), "b": _ints(q, sb, 2)})


def test_matmul_integer_deep_sums_exact():
    """K = 3,001 of 255 x 255: float32 alone rounds the sum (195,140,032 for 195,140,025); chunks of at most
    ``_MAX_K_F32`` summed in int32 give it exactly, on any device."""
    m = make_model([helper.make_node("MatMulInteger", ["a", "b"], ["y"])],
                   [("a", T.UINT8, (2, 3001)), ("b", T.UINT8, (3001, 3))], [("y", T.INT32, None)])
    s = session(m)
    assert not unclaimed_ops(s), unclaimed_ops(s)
    y = s.run(None, {"a": np.full((2, 3001), 255, np.uint8), "b": np.full((3001, 3), 255, np.uint8)})[0]
    assert (y == 255 * 255 * 3001).all(), y


def test_matmul_integer_unknown_depth_refused():
    m = make_model([helper.make_node("MatMulInteger", ["a", "b"], ["y"])],
                   [("a", T.UINT8, (2, "k")), ("b", T.UINT8, ("k", 3))], [("y", T.INT32, None)])
    stays_on_cpu(m, {"a": _ints(T.UINT8, (2, 5), 1), "b": _ints(T.UINT8, (5, 3), 2)}, "MatMulInteger")


QCONV = [  # (dtype, x shape, w shape, attrs, per-channel w, with bias)
    (T.UINT8, (1, 3, 7, 7), (4, 3, 3, 3), {}, False, False),
    (T.UINT8, (2, 4, 8, 6), (6, 2, 3, 2), {"group": 2, "pads": [1, 0, 1, 1], "strides": [2, 1]}, True, True),
    (T.INT8, (1, 3, 9), (5, 3, 4), {"dilations": [2], "pads": [2, 1]}, True, True),
    (T.INT8, (1, 2, 5, 5), (3, 2, 3, 3), {"auto_pad": "VALID"}, False, True),
    (T.UINT8, (1, 64, 5, 5), (2, 64, 3, 3), {"pads": [1, 1, 1, 1]}, True, False),   # depth 576: float64 path
    (T.INT8, (1, 4, 6, 6), (4, 1, 3, 3), {"group": 4, "auto_pad": "SAME_LOWER"}, True, True),   # depthwise
    (T.UINT8, (1, 64, 6, 6), (4, 32, 3, 3), {"group": 2, "strides": [2, 2]}, False, True),  # grouped float64
]


@pytest.mark.parametrize("q,xs,wsh,attrs,per_ch,bias", QCONV)
def test_conv_integer(q, xs, wsh, attrs, per_ch, bias):
    inits = {"xz": _ints(q, (), 3), "wz": _ints(q, (), 4)}      # ORT's ConvInteger takes a scalar w zero point
    node = helper.make_node("ConvInteger", ["x", "w", "xz", "wz"], ["y"], **attrs)
    m = make_model([node], [("x", q, xs), ("w", q, wsh)], [("y", T.INT32, None)], inits)
    feeds = {"x": _ints(q, xs, 1), "w": _ints(q, wsh, 2)}
    if GPU and int(np.prod(wsh[1:])) > QZ._MAX_K_F32:
        stays_on_cpu(m, feeds, "ConvInteger")
    else:
        check(m, feeds)


@pytest.mark.parametrize("q,xs,wsh,attrs,per_ch,bias", QCONV)
def test_qlinear_conv(q, xs, wsh, attrs, per_ch, bias):
    mo = wsh[0]
    rng = np.random.default_rng(9)
    depth = int(np.prod(wsh[1:]))
    inits = {"xs": np.array(0.04, np.float32), "xz": _ints(q, (), 3),
             "ws": rng.uniform(0.01, 0.05, (mo,) if per_ch else ()).astype(np.float32),
             "wz": np.zeros((mo,) if per_ch else (), NPT[q]) if q == T.INT8 else _ints(q, (mo,) if per_ch else (), 4),
             "ys": np.array(0.15 * np.sqrt(depth), np.float32), "yz": _ints(q, (), 5)}
    ins = ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"]
    if bias:
        inits["b"] = rng.integers(-3000, 3000, (mo,)).astype(np.int32)
        ins.append("b")
    node = helper.make_node("QLinearConv", ins, ["y"], **attrs)
    m = make_model([node], [("x", q, xs), ("w", q, wsh)], [("y", q, None)], inits)
    feeds = {"x": _ints(q, xs, 1), "w": _ints(q, wsh, 2)}
    if GPU and (bias or depth > QZ._MAX_K_F32):
        stays_on_cpu(m, feeds, "QLinearConv")
    else:
        check(m, feeds)


def test_qlinear_conv_bias_from_input_refused():
    # a non-constant bias cannot be proven not to wrap ORT's int32 accumulator
    q = T.UINT8
    inits = {"xs": np.array(0.04, np.float32), "xz": _ints(q, (), 3), "ws": np.array(0.02, np.float32),
             "wz": _ints(q, (), 4), "ys": np.array(0.5, np.float32), "yz": _ints(q, (), 5)}
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"])
    m = make_model([node], [("x", q, (1, 2, 4, 4)), ("w", q, (3, 2, 2, 2)), ("b", T.INT32, (3,))], [("y", q, None)],
                   inits)
    stays_on_cpu(m, {"x": _ints(q, (1, 2, 4, 4), 1), "w": _ints(q, (3, 2, 2, 2), 2),
                     "b": np.array([5, -7, 100], np.int32)}, "QLinearConv")


def test_conv_integer_deep_dilated_refused():
    # depth 576 needs float64, and MLX has no dilated float64 convolution
    q = T.UINT8
    node = helper.make_node("ConvInteger", ["x", "w"], ["y"], dilations=[2, 2])
    m = make_model([node], [("x", q, (1, 64, 7, 7)), ("w", q, (2, 64, 3, 3))], [("y", T.INT32, None)])
    stays_on_cpu(m, {"x": _ints(q, (1, 64, 7, 7), 1), "w": _ints(q, (2, 64, 3, 3), 2)}, "ConvInteger")
