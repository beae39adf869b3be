"""``kernels/fastmath.py``: the polynomial exp on MLX's CPU backend (tuning ``poly_exp``).

Within 1 ulp of float64's exp rounded to float32 everywhere, subnormal results, inf, 0 and NaN included (MLX
0.32.4's own CPU exp flushes subnormal results to 0 and overflows to inf from x ~ 88.3, where exp(88.3) is
2.2e38); Exp and Sigmoid nodes through it answer as ORT's CPU EP does; it is used where asked only (large
enough float32, shape-keyed builds), never in a shapeless trace.
"""
from __future__ import annotations

import os
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest
from onnx import TensorProto as T

from ortmlx.kernels import background, build, fastmath

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "ops"))
from _ewutil import check, node_model  # noqa: E402

POLY = build.BuildContext(poly_exp=True)


def _edges() -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.concatenate([rng.uniform(-110, 95, 400_000), rng.standard_normal(50_000),
                           np.linspace(-104.5, -85, 40_001),              # subnormal results and underflow
                           np.linspace(85, 90, 4_001),                    # the top of the range and overflow
                           [0.0, -0.0, np.inf, -np.inf, np.nan, 88.72283, 88.72284, -87.33654, -103.97208,
                            -103.2789, 1e-30, -1e-30, 0.34657359, -0.34657359]]).astype(np.float32)


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def test_exp_within_one_ulp_everywhere():
    x = _edges()
    with np.errstate(over="ignore"):
        want = np.exp(x.astype(np.float64)).astype(np.float32)
    with build.active(POLY):
        got = np.array(fastmath.exp(mx.array(x)))
    assert np.array_equal(np.isnan(got), np.isnan(x))
    num = ~np.isnan(x)
    assert np.array_equal(np.isinf(got[num]), np.isinf(want[num]))
    assert (_ulps(got[num], want[num]) <= 1).all(), x[num][np.argmax(_ulps(got[num], want[num]))]
    assert (got[num] >= 0).all() and got[x == 0].tolist() == [1.0, 1.0]


def test_sigmoid_close_to_float64():
    x = _edges()
    with np.errstate(over="ignore"):
        want = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
    with build.active(POLY):
        got = np.array(fastmath.sigmoid(mx.array(x)))
    num = ~np.isnan(x)
    assert np.isnan(got[~num]).all()
    # relative, but for results below float32's normal range (1 / (1 + e^-x) with e^-x past float32's max: 0)
    err = np.abs(got[num] - want[num])
    assert (err <= 3e-7 * want[num] + 1e-37).all(), x[num][np.argmax(err / (3e-7 * want[num] + 1e-37))]


def test_poly_only_where_asked(monkeypatch):
    calls = []
    real = fastmath._exp_compiled
    monkeypatch.setattr(fastmath, "_exp_compiled", lambda x: calls.append(x.shape) or real(x))
    big, small = mx.zeros((4, 512)), mx.zeros((4, 8))
    fastmath.exp(big)                                                      # no build: MLX's exp
    with build.active(build.BuildContext(poly_exp=False)):
        fastmath.sigmoid(big)
    with build.active(build.BuildContext(poly_exp=True, shapeless=True)):   # view cannot be traced shapeless
        fastmath.exp(big)
    with build.active(POLY):
        fastmath.exp(small)                                                # under POLY_MIN
        fastmath.exp(big.astype(mx.float16))                               # float32 only
        fastmath.exp(big)
        fastmath.sigmoid(big)
    assert calls == [(4, 512), (4, 512)]


def test_unbuilt_kernel_answers_with_the_same_ops_while_it_builds_behind(monkeypatch):
    """Before the fused kernel is built, an eager build computes the same polynomial unfused (bit for bit the
    kernel's answer) and queues the build on the builder's thread; once built, the kernel answers."""
    monkeypatch.setattr(background, "_state", {})
    calls = []
    real = fastmath._exp_compiled
    monkeypatch.setattr(fastmath, "_exp_compiled", lambda x: calls.append((threading.current_thread().name,
                                                                            x.shape)) or real(x))
    x = mx.array(_edges())
    with build.active(build.BuildContext(poly_exp=True, build_behind=True)):
        first = np.array(fastmath.exp(x))
        assert background.state(fastmath._KERNEL) in (background.QUEUED, background.DONE)
        assert background.wait(120) and background.done(fastmath._KERNEL)
        assert calls == [("ortmlx-kernel-builder", (fastmath.POLY_MIN,))]
        second = np.array(fastmath.exp(x))
        assert calls[1:] == [(threading.current_thread().name, x.shape)]
    assert np.array_equal(first.view(np.uint32), second.view(np.uint32))


def test_builder_keeps_a_failed_builds_reason(monkeypatch):
    monkeypatch.setattr(background, "_state", {})
    background.submit("t.fail", lambda: 1 / 0)
    background.submit("t.ok", lambda: None)
    assert background.wait(60)
    assert background.state("t.fail").startswith("failed: ZeroDivisionError") and background.done("t.ok")
    assert background.submit("t.fail", lambda: None).startswith("failed")      # not retried


def test_softmaxes_take_the_polynomial_where_exp_does(monkeypatch):
    from ortmlx.kernels.ops.softmax import _softmax
    calls = []
    real = fastmath._exp_compiled
    monkeypatch.setattr(fastmath, "_exp_compiled", lambda x: calls.append(x.shape) or real(x))
    x = mx.array(np.random.default_rng(2).standard_normal((4, 3, 512)).astype(np.float32) * 20)
    want = np.asarray(mx.softmax(x, axis=1, precise=True))
    with build.active(POLY):
        got = np.asarray(_softmax(x, 1))
    with build.active(build.BuildContext(poly_exp=True, shapeless=True)):
        _softmax(x, 1)
    assert calls == [(4, 3, 512)]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    from ortmlx.kernels.ops.softmax import _log_softmax
    with build.active(POLY):
        got = np.asarray(_log_softmax(x, 1))
    assert calls == [(4, 3, 512)] * 2
    s64 = np.asarray(x, np.float64) - np.asarray(x, np.float64).max(axis=1, keepdims=True)
    np.testing.assert_allclose(got, s64 - np.log(np.exp(s64).sum(axis=1, keepdims=True)), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("op", ["Exp", "Sigmoid", "Softmax", "LogSoftmax"])
@pytest.mark.parametrize("options", [None, {"tuning": "poly_exp=0"}], ids=["poly", "off"])
def test_nodes_answer_as_the_cpu_ep(op, options):
    """On the MLX EP's default device here (the CPU backend: poly_exp on), large inputs with special values."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 1000)) * 30).astype(np.float32)
    x[0, :6] = [np.inf, -np.inf, np.nan, 0.0, -95.0, 88.5]
    if options and op == "Exp":     # MLX's own exp is inf from x ~ 88.3 (module docstring): not in that case
        x = np.where(np.isfinite(x) & (x > 88.0), 88.0, x).astype(np.float32)
    check(node_model(op, [T.FLOAT], [T.FLOAT], {}, 13), {"x0": x}, **({"options": options} if options else {}))
