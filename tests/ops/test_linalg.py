"""MatMul, Gemm, Einsum against ORT's CPU EP (fp32 rtol 1e-4 atol 1e-5, fp16 1e-2, f64 1e-9)."""
import numpy as np
import pytest
from onnx import TensorProto as T

from _nnutil import check, check_bf16, one_node, rand, stays_on_cpu

MATMUL = [  # (a shape, b shape)
    ((3, 4), (4, 5)),
    ((4,), (4, 5)),            # 1-D left: prepend 1, then drop
    ((3, 4), (4,)),            # 1-D right
    ((4,), (4,)),              # dot -> scalar
    ((2, 3, 4), (4, 5)),       # batched x matrix
    ((2, 1, 3, 4), (5, 4, 2)),  # broadcast batch dims
    ((0, 3, 4), (4, 5)),       # zero-size batch
    ((3, 0), (0, 5)),          # zero-size contraction -> zeros
]


@pytest.mark.parametrize("t", [T.FLOAT, T.FLOAT16, T.DOUBLE])
@pytest.mark.parametrize("sa,sb", MATMUL)
def test_matmul(sa, sb, t):
    m = one_node("MatMul", [("a", t, sa), ("b", t, sb)], [("y", t, None)])
    check(m, {"a": rand(sa, t, 1), "b": rand(sb, t, 2)}, t)


def test_matmul_bf16():
    check_bf16("MatMul", [("a", (2, 3, 8)), ("b", (8, 5))], feeds={"a": rand((2, 3, 8)), "b": rand((8, 5), seed=3)})


def test_matmul_int_refused():
    m = one_node("MatMul", [("a", T.INT32, (2, 3)), ("b", T.INT32, (3, 2))], [("y", T.INT32, None)])
    stays_on_cpu(m, {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": np.ones((3, 2), np.int32)}, "MatMul")


GEMM = [  # (a shape, b shape, c shape or None, attrs)
    ((3, 4), (4, 5), None, {}),
    ((3, 4), (4, 5), (5,), {}),
    ((3, 4), (4, 5), (3, 1), {"alpha": 0.5, "beta": 2.0}),
    ((4, 3), (4, 5), (3, 5), {"transA": 1}),
    ((3, 4), (5, 4), (1, 5), {"transB": 1, "alpha": -1.5}),
    ((4, 3), (5, 4), (), {"transA": 1, "transB": 1, "beta": 0.0}),
    ((0, 4), (4, 5), (5,), {}),
    ((3, 0), (0, 5), (5,), {}),                  # K = 0: C
]


@pytest.mark.parametrize("t", [T.FLOAT, T.FLOAT16, T.DOUBLE])
@pytest.mark.parametrize("sa,sb,sc,attrs", GEMM)
def test_gemm(sa, sb, sc, attrs, t):
    ins = [("a", t, sa), ("b", t, sb)] + ([("c", t, sc)] if sc is not None else [])
    feeds = {"a": rand(sa, t, 1), "b": rand(sb, t, 2)}
    if sc is not None:
        feeds["c"] = rand(sc, t, 3)
    check(one_node("Gemm", ins, [("y", t, None)], attrs), feeds, t)


@pytest.mark.parametrize("opset", [7, 9, 11, 13])
def test_gemm_opsets(opset):
    m = one_node("Gemm", [("a", T.FLOAT, (3, 4)), ("b", T.FLOAT, (5, 4)), ("c", T.FLOAT, (5,))],
                 [("y", T.FLOAT, None)], {"transB": 1, "alpha": 2.0}, opset=opset)
    check(m, {"a": rand((3, 4)), "b": rand((5, 4), seed=1), "c": rand((5,), seed=2)})


@pytest.mark.parametrize("sa,sb", [((3, 0), (0, 5)), (("M", "K"), ("K", 5))], ids=["K=0", "K unknown"])
def test_gemm_beta_where_k_may_be_zero_is_refused(sa, sb):
    """With K = 0 ORT's CPU kernel returns C unscaled where the spec gives beta * C: a beta other than 0 or 1 is
    left to the CPU EP unless K is known to be positive."""
    ins = [("a", T.FLOAT, sa), ("b", T.FLOAT, sb), ("c", T.FLOAT, (5,))]
    stays_on_cpu(one_node("Gemm", ins, [("y", T.FLOAT, None)], {"beta": 0.5}),
                 {"a": rand((3, 0)), "b": rand((0, 5), seed=1), "c": rand((5,), seed=2)}, "Gemm")


def _primitives(*outs) -> list:
    import re
    import tempfile

    import mlx.core as mx
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outs)
        return [lab.split()[0] for lab in re.findall(r'label ="([^"]*)"', open(f.name).read())]


def test_gemm_bias_is_the_products_addend_on_the_cpu():
    """On MLX's CPU backend C is the product's addend (one AddMM node: no broadcast Add for mx.compile to fuse
    with what follows); other devices add it after the product. Same values either way."""
    from types import SimpleNamespace

    import mlx.core as mx

    from ortmlx.kernels.ops.linalg import gemm
    A, B, C = (mx.array(rand(s, seed=k)) for k, s in enumerate([(3, 4), (4, 5), (5,)]))
    cpu = gemm(A, B, C, alpha=0.5, beta=2.0, ctx=SimpleNamespace(device="cpu"))
    other = gemm(A, B, C, alpha=0.5, beta=2.0, ctx=SimpleNamespace(device="gpu"))   # (built, evaluated on the CPU)
    assert "AddMM" in _primitives(cpu) and "Add" not in _primitives(cpu)
    assert "AddMM" not in _primitives(other) and "Add" in _primitives(other)
    np.testing.assert_allclose(np.array(cpu), np.array(other), rtol=1e-6, atol=1e-6)
    from ortmlx.kernels import build
    with build.active(build.BuildContext(shapeless=True, tracing=True)):    # MLX replays AddMM + Relu wrong
        traced = gemm(A, B, C, alpha=0.5, beta=2.0, ctx=SimpleNamespace(device="cpu"))  # at other sizes there
    assert "AddMM" not in _primitives(traced) and "Add" in _primitives(traced)


def test_gemm_bf16():
    check_bf16("Gemm", [("a", (3, 8)), ("b", (5, 8)), ("c", (5,))], attrs={"transB": 1, "alpha": 0.5},
               feeds={"a": rand((3, 8)), "b": rand((5, 8), seed=1), "c": rand((5,), seed=2)})


EINSUM = [  # (equation, shapes)
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ii->i", [(4, 4)]),
    ("ii", [(4, 4)]),
    ("ij->ji", [(3, 4)]),
    ("ij", [(3, 4)]),
    ("ji", [(3, 4)]),
    ("i,i", [(5,), (5,)]),
    ("i,j->ij", [(3,), (4,)]),
    ("...ij,jk->...ik", [(2, 3, 4), (4, 5)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("bhqd,bhkd->bhqk", [(1, 2, 3, 4), (1, 2, 5, 4)]),
    ("ij->", [(3, 4)]),
    ("i j , j k -> i k", [(3, 4), (4, 5)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
    ("bij,bjk->bik", [(0, 3, 4), (0, 4, 5)]),
]


@pytest.mark.parametrize("t", [T.FLOAT, T.FLOAT16, T.DOUBLE])
@pytest.mark.parametrize("eq,shapes", EINSUM)
def test_einsum(eq, shapes, t):
    ins = [(f"x{i}", t, s) for i, s in enumerate(shapes)]
    m = one_node("Einsum", ins, [("y", t, None)], {"equation": eq}, opset=12)
    check(m, {f"x{i}": rand(s, t, i) for i, s in enumerate(shapes)}, t)


def test_einsum_int_refused():
    m = one_node("Einsum", [("a", T.INT64, (2, 3)), ("b", T.INT64, (3, 2))], [("y", T.INT64, None)],
                 {"equation": "ij,jk->ik"}, opset=12)
    stays_on_cpu(m, {"a": np.arange(6).reshape(2, 3), "b": np.ones((3, 2), np.int64)}, "Einsum")
