"""The ``fold_bias`` pass: a half-precision MatMul and its bias Add as one product, the bias added before rounding."""
import mlx.core as mx
import numpy as np
import pytest
from onnx import TensorProto as T

from ortmlx.ir import Graph, Node, ValueInfo
from ortmlx.kernels import dtypes as dt
from ortmlx.kernels.interpreter import Program

K, N = 48, 40


def _graph(t=T.FLOAT16, bias_first=False, extra=None):
    """x @ w + b (the Add's operands in either order); ``extra``: 'mm_output' (the product is a graph output too),
    'bias_reader' (another node reads the bias), 'wide_bias' (a bias of another width)."""
    rng = np.random.default_rng(0)
    npt = {T.FLOAT16: np.float16, T.FLOAT: np.float32}[t]
    consts = {"w": rng.standard_normal((K, N)).astype(npt),
              "b": (rng.standard_normal(N if extra != "wide_bias" else 1) * 4).astype(npt)}
    add_in = ["b", "p"] if bias_first else ["p", "b"]
    nodes = [Node("mm", "MatMul", "", 13, ["x", "w"], ["p"]), Node("add", "Add", "", 14, add_in, ["y"])]
    outs = ["y"]
    if extra == "mm_output":
        outs.append("p")
    if extra == "bias_reader":
        nodes.append(Node("neg", "Neg", "", 13, ["b"], ["nb"]))
        outs.append("nb")
    values = {n: ValueInfo(n, t) for n in ["x", "p", "y", "nb", "w", "b"]}
    return Graph(nodes, ["x"], outs, values, consts, "g"), npt


def _feed(npt, shape=(2, 7, K)):
    return [np.random.default_rng(1).standard_normal(shape).astype(npt)]


@pytest.mark.parametrize("widen", [True, False], ids=["widened", "half"])
@pytest.mark.parametrize("bias_first", [False, True])
def test_one_rounding(widen, bias_first):
    g, npt = _graph(bias_first=bias_first)
    folded = Program(g, fold_bias=True, widen_weights=widen)
    plain = Program(g, fold_bias=False, widen_weights=widen)
    assert [st.node.name for st in folded.steps] == ["mm"] and len(plain.steps) == 2
    x = _feed(npt)
    exact = x[0].astype(np.float64) @ g.constants["w"].astype(np.float64) + g.constants["b"].astype(np.float64)
    once = np.array(dt.host(folded.run(x)[0])).astype(np.float64)
    twice = np.array(dt.host(plain.run(x)[0])).astype(np.float64)
    assert once.dtype == twice.dtype and once.shape == exact.shape
    # one rounding of the float32 sum: within half an fp16 ulp of the exact value but for float32's own error
    ulp = np.spacing(np.abs(exact).astype(np.float16)).astype(np.float64)
    assert np.all(np.abs(once - exact) <= 0.5 * ulp + 1e-4 * np.abs(exact) + 1e-6)
    assert np.abs(once - exact).sum() < np.abs(twice - exact).sum()     # two roundings: further off


@pytest.mark.parametrize("extra", ["mm_output", "bias_reader", "wide_bias"])
def test_not_folded_when_the_values_are_needed_apart(extra):
    g, npt = _graph(extra=extra)
    p = Program(g, fold_bias=True)
    assert [st.node.name for st in p.steps][:2] == ["mm", "add"]
    x = _feed(npt)
    want = Program(g, fold_bias=False).run(x)
    for a, b in zip(p.run(x), want):
        np.testing.assert_array_equal(np.array(dt.host(a)), np.array(dt.host(b)))


def test_float32_is_left_as_it_is():
    g, npt = _graph(T.FLOAT)
    assert len(Program(g, fold_bias=True).steps) == 2


def test_on_by_default_on_the_cpu_only():
    from ortmlx.kernels.passes import BuildConfig
    from ortmlx.tuning import Tuning
    assert BuildConfig.for_device("cpu").fold_bias and not BuildConfig.for_device("gpu").fold_bias
    assert not BuildConfig.for_device("cpu", Tuning.parse("fold_bias=0")).fold_bias
    assert BuildConfig.for_device("gpu", Tuning.parse("fold_bias=1")).fold_bias


def test_matmul_bias_is_addmm():
    from ortmlx.kernels.merge import matmul_bias
    a = mx.array(np.ones((3, K), np.float16))
    w32 = mx.array(np.full((K, N), 0.5, np.float32))
    b = mx.array(np.arange(N, dtype=np.float16))
    y = matmul_bias(a, w32, b)                     # a widened weight: the result back in A's type
    assert y.dtype == mx.float16
    np.testing.assert_array_equal(np.array(y), np.broadcast_to(K * 0.5 + np.arange(N), (3, N)).astype(np.float16))
