"""Tuning ``conv_gemm``: 2-D convolutions as products over the kernel's shifted input views (``ops/conv.py``)."""
import mlx.core as mx
import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

from ortmlx.kernels import build
from ortmlx.kernels.passes import BuildConfig
from ortmlx.kernels.ops import conv as C
from ortmlx.testing import check_against_cpu, make_model
from ortmlx.tuning import Tuning

CASES = {   # name: (N, C, H, W), M, group, attributes
    "3x3": ((2, 6, 9, 11), 5, 1, dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    "stride2_asym_pads": ((1, 4, 12, 10), 8, 1, dict(kernel_shape=[3, 2], pads=[0, 1, 2, 0], strides=[2, 3])),
    "dilated": ((1, 3, 13, 13), 4, 1, dict(kernel_shape=[3, 3], dilations=[2, 3], pads=[2, 2, 1, 1])),
    "1x1": ((3, 16, 7, 5), 8, 1, dict(kernel_shape=[1, 1])),
    "stem7x7s2": ((1, 3, 32, 32), 8, 1, dict(kernel_shape=[7, 7], strides=[2, 2], pads=[3, 3, 3, 3])),
    "same_upper": ((1, 5, 10, 9), 6, 1, dict(kernel_shape=[4, 3], auto_pad="SAME_UPPER", strides=[2, 1])),
    "depthwise": ((2, 12, 14, 14), 12, 12, dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    "depthwise_s2": ((1, 8, 15, 15), 8, 8, dict(kernel_shape=[5, 5], pads=[2, 2, 2, 2], strides=[2, 2])),
    "grouped": ((1, 8, 9, 9), 4, 2, dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),     # MLX's own convolution
    "shifted": ((1, 4, 64, 70), 6, 1, dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),   # 4,480 positions
    "shifted_dilated": ((2, 3, 48, 50), 5, 1, dict(kernel_shape=[3, 2], dilations=[2, 3], pads=[2, 0, 1, 3])),
}


def _model(shape, m, group, attrs, bias=True):
    n, c, h, w = shape
    k = attrs["kernel_shape"]
    rng = np.random.default_rng(3)
    inits = {"W": (rng.standard_normal((m, c // group, *k)) * 0.3).astype(np.float32)}
    if bias:
        inits["B"] = rng.standard_normal(m).astype(np.float32)
    node = helper.make_node("Conv", ["x", "W"] + (["B"] if bias else []), ["y"], group=group, **attrs)
    return make_model([node], [("x", T.FLOAT, ["N", c, h, w])], [("y", T.FLOAT, None)], inits)


@pytest.mark.parametrize("name", list(CASES))
def test_answers_as_the_cpu_ep(name):
    shape, m, group, attrs = CASES[name]
    feeds = [{"x": np.random.default_rng(i).standard_normal(shape).astype(np.float32)} for i in range(2)]
    for options in ({"tuning": "conv_gemm=1"}, {"no_compile": "1", "tuning": "conv_gemm=1"}):
        check_against_cpu(_model(shape, m, group, attrs, bias=name != "1x1"), feeds, options=options)


@pytest.mark.parametrize("name", [n for n in CASES if n != "grouped"])
def test_the_products_replace_mlx_convolution(name, monkeypatch):
    """With the knob on, every case but a grouped one computes without ``mx.conv_general``, and agrees with it."""
    shape, m, group, attrs = CASES[name]
    rng = np.random.default_rng(0)
    X = mx.array(rng.standard_normal(shape).astype(np.float32))
    W = mx.array(rng.standard_normal((m, shape[1] // group, *attrs["kernel_shape"])).astype(np.float32))
    kw = {k: v for k, v in attrs.items() if k != "kernel_shape"}
    want = C.conv(X, W, group=group, **kw)
    called = []
    real = mx.conv_general
    monkeypatch.setattr(mx, "conv_general", lambda *a, **k: called.append(1) or real(*a, **k))
    with build.active(build.BuildContext(conv_gemm=C.GEMM_FORMS)):
        got = C.conv(X, W, group=group, **kw)
    assert not called
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)
    with build.active(build.BuildContext(conv_gemm=frozenset())):
        C.conv(X, W, group=group, **kw)
    assert called                                   # off: MLX's convolution


def test_reasons():
    x, w = mx.zeros((1, 5, 5, 4)), mx.zeros((4, 3, 3, 1))
    assert C._gemm_form(x, w, 4, [1, 1], [1, 1])[1] is None
    assert "depthwise" in C._gemm_form(x, mx.zeros((8, 3, 3, 2)), 2, [0, 0], [0, 0])[1]
    assert "1-D" in C._gemm_form(mx.zeros((1, 5, 4)), mx.zeros((4, 3, 4)), 1, [0], [0])[1]
    assert "negative" in C._gemm_form(x, mx.zeros((4, 3, 3, 4)), 1, [-1, 0], [0, 0])[1]
    with build.active(build.BuildContext(conv_gemm=C.GEMM_FORMS, shapeless=True)):
        assert "shapeless" in C._gemm_form(x, w, 4, [1, 1], [1, 1])[1]


def test_forms():
    x = mx.zeros((1, 5, 5, 4))
    assert C._gemm_form(x, mx.zeros((6, 1, 1, 4)), 1, [0, 0], [0, 0])[0] == "pointwise"
    assert C._gemm_form(x, mx.zeros((6, 3, 3, 4)), 1, [1, 1], [1, 1])[0] == "im2col"
    big, w3 = mx.zeros((2, 48, 48, 4)), mx.zeros((6, 3, 3, 4))       # 2 x 48 x 48 = 4,608 output positions
    assert C._gemm_form(big, w3, 1, [1, 1], [1, 1], (1, 1), (48, 48))[0] == "shifted"
    assert C._gemm_form(big, w3, 1, [1, 1], [1, 1], (2, 1), (24, 48))[0] == "im2col"       # strided
    assert C._gemm_form(big[:1], w3, 1, [1, 1], [1, 1], (1, 1), (48, 48))[0] == "im2col"   # 2,304 positions
    assert C._gemm_form(x, mx.zeros((4, 3, 3, 1)), 4, [1, 1], [1, 1])[0] == "depthwise"
    assert C._gemm_form(x, mx.zeros((8, 3, 3, 2)), 2, [1, 1], [1, 1])[0] is None


def test_device_defaults_and_the_knob():
    cpu, gpu = BuildConfig.for_device("cpu"), BuildConfig.for_device("gpu")
    assert cpu.conv_gemm == {"pointwise", "depthwise", "shifted"}     # MLX's CPU im2col measured slower than its conv
    assert gpu.conv_gemm == C.GEMM_FORMS - {"shifted"} and gpu.conv_gemm_batch == 4 and cpu.conv_gemm_batch == 1
    assert BuildConfig.for_device("gpu", Tuning.parse("conv_gemm=1")).conv_gemm_batch == 1
    assert BuildConfig.for_device("cpu", Tuning.parse("conv_gemm=1")).conv_gemm == C.GEMM_FORMS
    assert BuildConfig.for_device("gpu", Tuning.parse("conv_gemm=0")).conv_gemm == frozenset()
    assert BuildConfig.for_device("cpu").context().conv_gemm == cpu.conv_gemm
    assert gpu.context().conv_gemm_batch == 4


def test_from_the_batch_given(monkeypatch):
    rng = np.random.default_rng(4)
    W = mx.array(rng.standard_normal((5, 4, 3, 3)).astype(np.float32))
    called = _conv_calls(monkeypatch)
    with build.active(build.BuildContext(conv_gemm=C.GEMM_FORMS, conv_gemm_batch=4)):
        C.conv(mx.array(rng.standard_normal((4, 4, 6, 6)).astype(np.float32)), W)
        assert not called
        C.conv(mx.array(rng.standard_normal((3, 4, 6, 6)).astype(np.float32)), W)
        assert called                               # below the batch: MLX's convolution


def _conv_calls(monkeypatch) -> list:
    called = []
    real = mx.conv_general
    monkeypatch.setattr(mx, "conv_general", lambda *a, **k: called.append(1) or real(*a, **k))
    return called


def _concat_calls(monkeypatch) -> list:
    """The number of arrays each ``mx.concatenate`` joined (im2col's columns)."""
    joined = []
    real = mx.concatenate
    monkeypatch.setattr(mx, "concatenate", lambda a, *r, **k: joined.append(len(a)) or real(a, *r, **k))
    return joined


def test_only_the_chosen_forms(monkeypatch):
    rng = np.random.default_rng(1)
    X = mx.array(rng.standard_normal((2, 4, 8, 8)).astype(np.float32))
    W3 = mx.array(rng.standard_normal((5, 4, 3, 3)).astype(np.float32))
    W1 = mx.array(rng.standard_normal((5, 4, 1, 1)).astype(np.float32))
    called = _conv_calls(monkeypatch)
    with build.active(build.BuildContext(conv_gemm=frozenset({"pointwise", "depthwise"}))):
        C.conv(X, W1)
        assert not called
        C.conv(X, W3, pads=[1, 1, 1, 1])
        assert called                               # im2col not chosen: MLX's convolution


def test_a_large_batch_goes_in_parts(monkeypatch):
    """Over GEMM_MAX_COLUMNS the im2col product runs a few samples at a time (same answer); a sample alone over it
    runs MLX's convolution."""
    rng = np.random.default_rng(2)
    X = mx.array(rng.standard_normal((5, 3, 9, 9)).astype(np.float32))
    W = mx.array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
    want = np.array(C.conv(X, W, pads=[1, 1, 1, 1]))
    per = 9 * 9 * 3 * 3 * 3
    concat = _concat_calls(monkeypatch)
    monkeypatch.setattr(C, "GEMM_MAX_COLUMNS", 2 * per)
    called = _conv_calls(monkeypatch)
    with build.active(build.BuildContext(conv_gemm=C.GEMM_FORMS)):
        got = C.conv(X, W, pads=[1, 1, 1, 1])
    assert not called and concat[-1] == 3           # samples 0-1, 2-3, 4: three parts joined
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(C, "GEMM_MAX_COLUMNS", per - 1)
    with build.active(build.BuildContext(conv_gemm=C.GEMM_FORMS)):
        C.conv(X, W, pads=[1, 1, 1, 1])
    assert called


@pytest.mark.parametrize("name", ["3x3", "dilated", "same_upper", "shifted_dilated"])
def test_stride_one_as_shifted_products(name, monkeypatch):
    """The shifted form: no ``mx.conv_general``, no im2col concatenation, MLX's convolution's answer; where it is not
    among the forms, im2col takes a convolution the shifted form would have."""
    shape, m, group, attrs = CASES[name]
    rng = np.random.default_rng(5)
    X = mx.array(rng.standard_normal(shape).astype(np.float32))
    W = mx.array(rng.standard_normal((m, shape[1], *attrs["kernel_shape"])).astype(np.float32))
    kw = {k: v for k, v in attrs.items() if k not in ("kernel_shape", "strides")}
    want = np.array(C.conv(X, W, **kw))
    monkeypatch.setattr(C, "SHIFTED_MIN_POSITIONS", 1)
    called = _conv_calls(monkeypatch)
    concat = _concat_calls(monkeypatch)
    with build.active(build.BuildContext(conv_gemm=frozenset({"shifted"}))):
        got = C.conv(X, W, **kw)
    assert not called and not concat
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)
    with build.active(build.BuildContext(conv_gemm=frozenset({"im2col"}))):
        got = C.conv(X, W, **kw)
    assert not called and concat                    # im2col
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)


def test_a_large_stride_one_convolution_by_default_on_the_cpu(monkeypatch):
    shape, m, group, attrs = CASES["shifted"]
    feeds = [{"x": np.random.default_rng(i).standard_normal(shape).astype(np.float32)} for i in range(2)]
    calls = []
    real = C._shifted_conv
    monkeypatch.setattr(C, "_shifted_conv", lambda *a: calls.append(1) or real(*a))
    for options in ({"device": "cpu"}, {"device": "cpu", "no_compile": "1"}):
        n = len(calls)
        check_against_cpu(_model(shape, m, group, attrs), feeds, options=options)
        assert len(calls) > n
