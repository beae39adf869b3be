"""MatMul with a constant weight on the GPU (kept column-major in device memory: MLX's gemv for one
row) against ORT's CPU EP. Runs where MLX has a CUDA GPU (the benchmark host); skipped elsewhere."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

from ortmlx.testing import assert_close, make_model, session

pytestmark = pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()),
                                reason="needs MLX's CUDA backend (device constants are GPU-only)")

RNG = np.random.default_rng(0)
NP = {T.FLOAT16: np.float16, T.FLOAT: np.float32}
# (A shape, K, N, type, rtol, atol): one decode row, a prefill block, K not a multiple of 32, batched A
CASES = {
    "fp16 decode row": ((1, 896), 896, 1152, T.FLOAT16, 2e-2, 5e-2),
    "fp16 prefill rows": ((5, 896), 896, 1152, T.FLOAT16, 2e-2, 5e-2),
    "fp16 wide output": ((1, 1536), 1536, 8960, T.FLOAT16, 2e-2, 8e-2),
    "fp32 K=100": ((1, 100), 100, 640, T.FLOAT, 1e-4, 1e-4),
    "fp32 batched A": ((2, 3, 256), 256, 512, T.FLOAT, 1e-4, 1e-4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_constant_weight_matmul_matches_cpu(case):
    a_shape, k, n, t, rtol, atol = CASES[case]
    w = RNG.standard_normal((k, n)).astype(NP[t])
    # the weight also feeds an elementwise op: its column-major layout must not show anywhere
    nodes = [helper.make_node("MatMul", ["a", "w"], ["y"]), helper.make_node("Add", ["w", "w"], ["w2"])]
    m = make_model(nodes, [("a", t, list(a_shape))], [("y", t, None), ("w2", t, None)], initializers={"w": w})
    feeds = {"a": RNG.standard_normal(a_shape).astype(NP[t])}
    got = session(m, options={"device": "gpu"}).run(None, feeds)
    want = session(m, "CPUExecutionProvider", record=False).run(None, feeds)
    assert_close(got[0], want[0], rtol=rtol, atol=atol, what=f"{case}: MatMul")
    np.testing.assert_array_equal(got[1], want[1], err_msg=f"{case}: w + w")


def test_sibling_matmuls_merged_match_cpu():
    """An MLP's gate and up projections (one A, two constant weights) run as one product on the GPU."""
    import ortmlx.compiled as C
    k, n = 896, 4864
    w = {"wg": RNG.standard_normal((k, n)).astype(np.float16), "wu": RNG.standard_normal((k, n)).astype(np.float16)}
    nodes = [helper.make_node("MatMul", ["a", "wg"], ["g"]), helper.make_node("MatMul", ["a", "wu"], ["u"]),
             helper.make_node("Sigmoid", ["g"], ["s"]), helper.make_node("Mul", ["g", "s"], ["gs"]),
             helper.make_node("Mul", ["gs", "u"], ["y"])]
    m = make_model(nodes, [("a", T.FLOAT16, ["b", "s", k])], [("y", T.FLOAT16, None), ("u", T.FLOAT16, None)],
                   initializers=w)
    with C.capture() as rs:
        mlx = session(m, options={"device": "gpu"})
    cpu = session(m, "CPUExecutionProvider", record=False)
    for shape in ((1, 1, k), (1, 1, k), (2, 3, k)):
        feeds = {"a": (RNG.standard_normal(shape) * 0.05).astype(np.float16)}
        got, want = mlx.run(None, feeds), cpu.run(None, feeds)
        assert_close(got[0], want[0], rtol=2e-2, atol=5e-2, what=f"{shape}: y")
        assert_close(got[1], want[1], rtol=2e-2, atol=5e-2, what=f"{shape}: u")
    steps = [st for r in rs for st in r.program.steps]
    assert [st.outputs for st in steps if st.node.op_type == "MatMul"] == [["g", "u"]], "not merged"


@pytest.mark.parametrize("t", [T.FLOAT16, T.FLOAT], ids=["fp16", "fp32"])
def test_swiglu_mlp_folded_matches_cpu(t):
    """An MLP (gate and up products, genai's SiLU gating, down projection) on the GPU: the gating runs in
    the folded step's kernel, compiled and eager, and answers what the CPU EP does."""
    import ortmlx.compiled as C
    k, n = 896, 4864
    npt = {T.FLOAT16: np.float16, T.FLOAT: np.float32}[t]
    w = {"wg": (RNG.standard_normal((k, n)) * 0.05).astype(npt), "wu": (RNG.standard_normal((k, n)) * 0.05).astype(npt),
         "wd": (RNG.standard_normal((n, k)) * 0.05).astype(npt)}
    nodes = [helper.make_node("MatMul", ["a", "wg"], ["g"]), helper.make_node("MatMul", ["a", "wu"], ["u"]),
             helper.make_node("Sigmoid", ["g"], ["s"]), helper.make_node("Mul", ["g", "s"], ["gs"]),
             helper.make_node("Mul", ["gs", "u"], ["y"]), helper.make_node("MatMul", ["y", "wd"], ["d"])]
    m = make_model(nodes, [("a", t, ["b", "s", k])], [("d", t, None)], initializers=w)
    with C.capture() as rs:
        mlx = session(m, options={"device": "gpu"})
    eager = session(m, options={"device": "gpu", "no_compile": "1"})
    cpu = session(m, "CPUExecutionProvider", record=False)
    tol = dict(rtol=2e-2, atol=2e-2) if t == T.FLOAT16 else dict(rtol=1e-4, atol=1e-4)
    for shape in ((1, 1, k), (1, 1, k), (1, 1, k), (2, 3, k)):
        feeds = {"a": RNG.standard_normal(shape).astype(npt)}
        want = cpu.run(None, feeds)[0]
        for name, sess in (("compiled", mlx), ("eager", eager)):
            assert_close(sess.run(None, feeds)[0], want, what=f"{name} {shape}: d", **tol)
    steps = [st for r in rs for st in r.program.steps]
    assert [(st.node.op_type, st.outputs) for st in steps] == [("MatMul", ["d"])], steps      # with the down product
    with C.capture() as rs:                 # fuse_rows=0: the gating's step and the down product
        apart = session(m, options={"device": "gpu", "tuning": "fuse_rows=0"})
    assert_close(apart.run(None, feeds)[0], want, what="fuse_rows=0", **tol)
    steps = [st for r in rs for st in r.program.steps]
    assert [(st.node.op_type, st.outputs) for st in steps] == [("MatMul", ["y"]), ("MatMul", ["d"])], steps
    with C.capture() as rs:                 # fold_mlp=0: the gating stays three nodes, the same answers
        unfolded = session(m, options={"device": "gpu", "tuning": "fold_mlp=0"})
    assert_close(unfolded.run(None, feeds)[0], want, what="fold_mlp=0", **tol)
    assert [st.node.op_type for r in rs for st in r.program.steps] == ["MatMul", "Sigmoid", "Mul", "Mul", "MatMul"]


@pytest.mark.parametrize("t", [T.FLOAT16, T.FLOAT], ids=["fp16", "fp32"])
def test_layer_rows_fused_match_cpu(t, monkeypatch):
    """A decoder layer's norms and MLP (skip norm -> merged q/k products; skip norm -> gate/up, SiLU gating,
    down; a final norm -> the head) on the GPU against the CPU EP, compiled and eager: a decode row's norms
    and gating are made inside the products' kernels (counted), prompt rows keep the nodes' own kernels;
    ``fuse_rows=0`` answers the same."""
    from ortmlx.kernels import cuda_rows
    calls = []
    for name in ("norm_gemv", "swiglu_gemv", "gemv"):
        real = getattr(cuda_rows, name)
        monkeypatch.setattr(cuda_rows, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    h, f, v = 896, 4864, 2048
    npt = {T.FLOAT16: np.float16, T.FLOAT: np.float32}[t]

    def w(*shape, s=0.05):
        return (RNG.standard_normal(shape) * s).astype(npt)
    inits = {"g1": w(h, s=1.0), "g2": w(h, s=1.0), "g3": w(h, s=1.0), "wq": w(h, h), "wk": w(h, 128),
             "wo": w(h + 128, h), "wg": w(h, f), "wu": w(h, f), "wd": w(f, h), "wh": w(h, v)}
    nodes = [
        helper.make_node("SkipSimplifiedLayerNormalization", ["x", "r0", "g1"], ["n1", "", "", "s1"],
                         domain="com.microsoft", epsilon=1e-6),
        helper.make_node("MatMul", ["n1", "wq"], ["q"]), helper.make_node("MatMul", ["n1", "wk"], ["k"]),
        helper.make_node("Concat", ["q", "k"], ["qk"], axis=-1), helper.make_node("MatMul", ["qk", "wo"], ["o"]),
        helper.make_node("SkipSimplifiedLayerNormalization", ["o", "s1", "g2"], ["n2", "", "", "s2"],
                         domain="com.microsoft", epsilon=1e-6),
        helper.make_node("MatMul", ["n2", "wg"], ["g"]), helper.make_node("MatMul", ["n2", "wu"], ["u"]),
        helper.make_node("Sigmoid", ["g"], ["sg"]), helper.make_node("Mul", ["g", "sg"], ["a"]),
        helper.make_node("Mul", ["a", "u"], ["y"]), helper.make_node("MatMul", ["y", "wd"], ["d"]),
        helper.make_node("Add", ["d", "s2"], ["r"]),
        helper.make_node("SimplifiedLayerNormalization", ["r", "g3"], ["n3"], epsilon=1e-5),
        helper.make_node("MatMul", ["n3", "wh"], ["logits"])]
    m = make_model(nodes, [("x", t, ["b", "s", h]), ("r0", t, ["b", "s", h])],
                   [("logits", t, None), ("s2", t, None)], initializers=inits, extra_opsets={"com.microsoft": 1})
    cpu = session(m, "CPUExecutionProvider", record=False)
    tol = dict(rtol=3e-2, atol=3e-2) if t == T.FLOAT16 else dict(rtol=1e-4, atol=1e-4)
    sessions = [("compiled", session(m, options={"device": "gpu"})),
                ("eager", session(m, options={"device": "gpu", "no_compile": "1"})),
                ("fuse_rows=0", session(m, options={"device": "gpu", "tuning": "fuse_rows=0"}))]
    for shape in ((1, 1, h), (1, 1, h), (1, 1, h), (2, 3, h)):
        feeds = {"x": RNG.standard_normal(shape).astype(npt), "r0": RNG.standard_normal(shape).astype(npt)}
        want = cpu.run(None, feeds)
        for name, sess in sessions:
            calls.clear()
            got = sess.run(None, feeds)
            for j, what in enumerate(("logits", "s2")):
                assert_close(got[j], want[j], what=f"{name} {shape}: {what}", **tol)
            fused = name != "fuse_rows=0" and shape[1] == 1
            # each build of a decode row calls the kernels in this order; a compiled call builds when it traces
            # (and when it checks a trace against eager), else replays the trace without building
            # (the gate/up product makes the gating, the down product multiplies that row)
            one = ["norm_gemv", "norm_gemv", "gemv", "norm_gemv"]
            assert calls == one * (len(calls) // 4), (name, shape, calls)
            assert fused or not calls, (name, shape, calls)
            if name == "eager" and fused:
                assert calls == one, (name, shape, calls)
