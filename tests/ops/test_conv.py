"""Conv / ConvTranspose against ORT's CPU EP (fp32 rtol 1e-4 atol 1e-4: sums of <= ~100 products of
values in [-1, 1]; fp16 rtol/atol 1e-2)."""
import numpy as np
import pytest
from onnx import TensorProto as T

from _nnutil import check, check_bf16, check_no_channels, one_node, rand, stays_on_cpu

F = [T.FLOAT, T.FLOAT16]

CONV = [  # (x shape, w shape, bias, attrs)
    ((1, 2, 7), (3, 2, 3), True, {}),
    ((2, 3, 6, 5), (4, 3, 3, 3), True, {}),
    ((1, 2, 4, 5, 6), (3, 2, 2, 3, 2), True, {}),
    ((1, 2, 7, 7), (3, 2, 3, 3), False, {"strides": [2, 2]}),
    ((1, 2, 7, 8), (3, 2, 3, 3), True, {"pads": [1, 2, 0, 1], "strides": [2, 1]}),
    ((1, 2, 9, 9), (2, 2, 3, 3), True, {"dilations": [2, 3], "pads": [2, 2, 2, 2]}),
    ((1, 4, 6, 6), (6, 2, 3, 3), True, {"group": 2}),
    ((1, 4, 6, 6), (4, 1, 3, 3), True, {"group": 4, "pads": [1, 1, 1, 1]}),        # depthwise
    ((1, 4, 6, 6), (8, 1, 3, 3), True, {"group": 4}),                              # depthwise x2
    ((1, 2, 7, 6), (3, 2, 3, 2), True, {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 2, 7, 6), (3, 2, 4, 2), True, {"auto_pad": "SAME_LOWER", "strides": [2, 3]}),
    ((1, 2, 7, 6), (3, 2, 3, 2), True, {"auto_pad": "VALID", "strides": [2, 1]}),
    ((1, 2, 8), (3, 2, 2), True, {"auto_pad": "SAME_UPPER", "strides": [3]}),
    ((1, 2, 5, 5, 5), (4, 1, 3, 3, 3), False, {"group": 2, "strides": [1, 2, 2], "pads": [1, 0, 1, 1, 0, 1]}),
    ((0, 2, 5, 5), (3, 2, 3, 3), True, {}),
    ((1, 2, 5, 5), (3, 2, 3, 3), True, {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    # no input channels: the bias, or zeros (MLX's own conv divides by zero: SIGFPE), against the spec
    # (``check_no_channels``: ORT's float16 Conv leaves this output uninitialized). ORT's CPU EP hangs on such a
    # Conv with pads, or N = 2 with stride 2: only cases it answers (for the output's shape) are here
    ((1, 0, 4, 4), (2, 0, 3, 3), True, {}),
    ((2, 0, 4, 4), (2, 0, 3, 3), False, {}),
    ((1, 0, 4, 4), (2, 0, 3, 3), False, {"strides": [2, 2]}),
]


@pytest.mark.parametrize("t", F)
@pytest.mark.parametrize("xs,ws,bias,attrs", CONV)
def test_conv(xs, ws, bias, attrs, t):
    ins = [("x", t, xs), ("w", t, ws)] + ([("b", t, (ws[0],))] if bias else [])
    feeds = {"x": rand(xs, t, 0), "w": rand(ws, t, 1)}
    if bias:
        feeds["b"] = rand((ws[0],), t, 2)
    model = one_node("Conv", ins, [("y", t, None)], attrs, opset=11)
    if xs[1] == 0:
        return check_no_channels(model, feeds, feeds.get("b"))
    check(model, feeds, t, atol=1e-4 if t == T.FLOAT else None)


@pytest.mark.parametrize("opset", [1, 11, 22])
def test_conv_opsets(opset):
    m = one_node("Conv", [("x", T.FLOAT, (1, 2, 5, 5)), ("w", T.FLOAT, (3, 2, 3, 3))], [("y", T.FLOAT, None)],
                 {"pads": [1, 1, 1, 1]}, opset=opset)
    check(m, {"x": rand((1, 2, 5, 5)), "w": rand((3, 2, 3, 3), seed=1)}, atol=1e-4)


def test_conv_bf16():
    check_bf16("Conv", [("x", (1, 4, 6, 6)), ("w", (4, 2, 3, 3)), ("b", (4,))], attrs={"group": 2}, opset=22,
               feeds={"x": rand((1, 4, 6, 6)), "w": rand((4, 2, 3, 3), seed=1), "b": rand((4,), seed=2)})


def test_conv_same_dilated_refused():
    # ORT's CPU EP rejects dilations with auto_pad SAME_*: refused, so the CPU EP reports the same error
    from ortmlx import partition_reports
    from ortmlx.testing import session
    m = one_node("Conv", [("x", T.FLOAT, (1, 2, 8)), ("w", T.FLOAT, (3, 2, 2))], [("y", T.FLOAT, None)],
                 {"auto_pad": "SAME_UPPER", "dilations": [2]})
    with pytest.raises(Exception, match="Dilation not supported"):
        session(m).run(None, {"x": rand((1, 2, 8)), "w": rand((3, 2, 2))})
    assert any(u.op == "Conv" for u in partition_reports()[-1].unclaimed)


def test_conv_double_refused():
    # ORT's CPU EP has no float64 Conv, so nothing could verify ours: refused (the session then fails to load)
    from ortmlx import partition_reports
    from ortmlx.testing import session
    m = one_node("Conv", [("x", T.DOUBLE, (1, 1, 3, 3)), ("w", T.DOUBLE, (1, 1, 2, 2))], [("y", T.DOUBLE, None)])
    with pytest.raises(Exception):
        session(m)
    assert any(u.op == "Conv" for u in partition_reports()[-1].unclaimed)


CONVT = [  # (x shape, w shape, bias, attrs)
    ((1, 2, 5), (2, 3, 3), True, {}),
    ((2, 3, 4, 5), (3, 2, 3, 3), True, {}),
    ((1, 2, 3, 4, 3), (2, 2, 2, 3, 2), True, {}),
    ((1, 2, 4, 4), (2, 3, 3, 3), False, {"strides": [2, 2]}),
    ((1, 2, 4, 4), (2, 3, 3, 3), True, {"strides": [2, 3], "pads": [1, 0, 2, 1]}),
    ((1, 2, 4, 4), (2, 3, 3, 3), True, {"strides": [2, 2], "output_padding": [1, 0]}),
    ((1, 2, 4, 4), (2, 3, 3, 2), True, {"dilations": [2, 2], "pads": [1, 1, 0, 2]}),
    ((1, 4, 4, 4), (4, 3, 3, 3), True, {"group": 2, "strides": [2, 1]}),
    ((1, 4, 4, 4), (4, 1, 3, 3), True, {"group": 4}),
    ((1, 2, 4, 4), (2, 3, 3, 3), True, {"strides": [2, 2], "output_shape": [9, 10]}),
    ((1, 2, 4, 4), (2, 3, 3, 3), True, {"strides": [2, 2], "output_shape": [8, 8]}),
    ((1, 2, 4, 4), (2, 3, 3, 3), True, {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 4, 5), (2, 3, 4, 3), True, {"strides": [2, 3], "auto_pad": "SAME_LOWER"}),
    ((1, 2, 4, 5), (2, 3, 4, 3), True, {"strides": [2, 3], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 4, 4), (2, 3, 3, 3), True, {"strides": [2, 2], "auto_pad": "VALID"}),
    ((1, 2, 3, 3), (2, 3, 3, 3), True, {"pads": [2, 1, 1, 3]}),                       # crops into the output
    ((1, 4, 2, 3, 2), (4, 2, 2, 2, 2), True, {"group": 2, "strides": [2, 1, 2]}),
    ((0, 2, 4, 4), (2, 3, 3, 3), True, {"strides": [2, 2]}),
    ((1, 0, 4, 4), (0, 2, 3, 3), True, {"strides": [2, 2]}),          # no input channels: the bias
    ((1, 0, 4, 4), (0, 2, 3, 3), False, {}),                          # ... zeros
    # kernels that tile the output (strides == kernel): one matmul on the CPU backend (conv._tiled_convt)
    ((2, 3, 4, 5), (3, 2, 2, 2), True, {"strides": [2, 2]}),
    ((2, 3, 4), (3, 4, 3), False, {"strides": [3]}),
    ((1, 2, 2, 3, 2), (2, 3, 2, 1, 2), True, {"strides": [2, 1, 2]}),
    ((1, 3, 4, 4), (3, 2, 2, 2), True, {"strides": [2, 2], "output_shape": [8, 8]}),
    ((1, 3, 4, 4), (3, 2, 2, 2), True, {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 3, 4, 4), (3, 2, 2, 2), True, {"strides": [2, 2], "pads": [1, 0, 0, 1]}),      # (not tiled: pads)
    ((1, 4, 4, 4), (4, 2, 2, 2), True, {"strides": [2, 2], "group": 2}),                # (not tiled: groups)
    ((1, 3, 4, 4), (3, 2, 2, 2), True, {"strides": [2, 2], "output_padding": [1, 1]}),  # (not tiled)
]


@pytest.mark.parametrize("t", F)
@pytest.mark.parametrize("xs,ws,bias,attrs", CONVT)
def test_conv_transpose(xs, ws, bias, attrs, t):
    m_out = ws[1] * attrs.get("group", 1)
    ins = [("x", t, xs), ("w", t, ws)] + ([("b", t, (m_out,))] if bias else [])
    feeds = {"x": rand(xs, t, 0), "w": rand(ws, t, 1)}
    if bias:
        feeds["b"] = rand((m_out,), t, 2)
    model = one_node("ConvTranspose", ins, [("y", t, None)], attrs, opset=11)
    if xs[1] == 0:
        return check_no_channels(model, feeds, feeds.get("b"))
    check(model, feeds, t, atol=1e-4 if t == T.FLOAT else None)


@pytest.mark.parametrize("xs,ws,strides,kw", [((2, 3, 4, 5), (3, 2, 2, 2), [2, 2], {}),
                                               ((1, 2, 5), (2, 3, 4), [4], {"output_shape": [20]}),
                                               ((1, 2, 2, 3, 2), (2, 3, 2, 1, 2), [2, 1, 2], {})])
def test_conv_transpose_tiled_is_one_matmul(monkeypatch, xs, ws, strides, kw):
    # the CPU backend's tiled form never reaches MLX's convolution, and equals the general form (on another device)
    from types import SimpleNamespace

    import mlx.core as mx

    from ortmlx.kernels.ops import conv
    x, w, b = mx.array(rand(xs)), mx.array(rand(ws, seed=1)), mx.array(rand((ws[1],), seed=2))
    general = conv.conv_transpose(x, w, b, strides=strides, ctx=SimpleNamespace(device="gpu"), **kw)

    def no_conv(*a, **k):
        raise AssertionError("the tiled ConvTranspose reached MLX's convolution")
    monkeypatch.setattr(conv, "_conv_general", no_conv)
    tiled = conv.conv_transpose(x, w, b, strides=strides, ctx=SimpleNamespace(device="cpu"), **kw)
    assert tiled.shape == general.shape
    np.testing.assert_allclose(np.array(tiled), np.array(general), rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError, match="reached"):     # not tiled: the general form
        conv.conv_transpose(x, w, b, strides=strides, pads=[1] * (2 * len(strides)), ctx=SimpleNamespace(device="cpu"))


def test_conv_transpose_bf16():
    check_bf16("ConvTranspose", [("x", (1, 2, 4, 4)), ("w", (2, 3, 3, 3))], attrs={"strides": [2, 2]}, opset=22,
               feeds={"x": rand((1, 2, 4, 4)), "w": rand((2, 3, 3, 3), seed=1)})


# ConvInteger is claimed (exactly) by ortmlx/kernels/ops/quantization.py: see tests/ops/test_quantization.py


DEFORM = [  # (x shape, w shape, attrs, with mask, with bias)
    ((1, 2, 5, 5), (3, 2, 3, 3), {}, False, False),
    ((2, 4, 6, 5), (4, 2, 3, 2), {"group": 2, "offset_group": 2, "pads": [1, 0, 1, 1]}, True, True),
    ((1, 2, 7, 7), (2, 2, 2, 3), {"strides": [2, 1], "dilations": [1, 2]}, True, False),
    ((1, 4, 5, 5), (2, 4, 3, 3), {"offset_group": 4, "pads": [1, 1, 1, 1]}, False, True),
]


@pytest.mark.parametrize("t", [T.FLOAT, T.FLOAT16])
@pytest.mark.parametrize("xs,ws,attrs,mask,bias", DEFORM)
def test_deform_conv(xs, ws, attrs, mask, bias, t):
    from ortmlx.kernels.ops.conv import _attrs
    s, d, lo, hi = _attrs(2, attrs.get("strides"), attrs.get("dilations"), attrs.get("pads"))
    oh = (xs[2] + lo[0] + hi[0] - ((ws[2] - 1) * d[0] + 1)) // s[0] + 1
    ow = (xs[3] + lo[1] + hi[1] - ((ws[3] - 1) * d[1] + 1)) // s[1] + 1
    og, K = attrs.get("offset_group", 1), ws[2] * ws[3]
    ins = [("x", t, xs), ("w", t, ws), ("off", t, (xs[0], og * K * 2, oh, ow))]
    feeds = {"x": rand(xs, t), "w": rand(ws, t, seed=1),
             "off": rand((xs[0], og * K * 2, oh, ow), t, seed=2, lo=-2, hi=2)}
    ins.append(("b", t, (ws[0],)) if bias else "")
    if bias:
        feeds["b"] = rand((ws[0],), t, seed=3)
    if mask:
        ins.append(("m", t, (xs[0], og * K, oh, ow)))
        feeds["m"] = rand((xs[0], og * K, oh, ow), t, seed=4, lo=0, hi=1)
    while ins[-1] == "":
        ins.pop()
    check(one_node("DeformConv", ins, [("y", t, None)], attrs, opset=22), feeds, t, atol=1e-4 if t == T.FLOAT else None)
