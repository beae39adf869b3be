"""A decode row's norm and MLP gating folded into the product that reads them (``ortmlx/kernels/rowfold.py``):
which steps fold, that the folded program answers bit for bit what the unfolded one does where the kernels
do not run (the CPU here), and that a decode row takes the kernels (``cuda_rows``, stood in by their
contract here; ``test_cuda_kernels.py`` runs them on a GPU, ``test_gpu_matmul.py`` against the CPU EP)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from onnx import TensorProto as T

from ortmlx.kernels import build, cuda_kernels, cuda_rows, rowfold
from ortmlx.kernels import dtypes as dt
from ortmlx.kernels.interpreter import Program
from ortmlx.ir import Graph, Node, ValueInfo
from test_cuda_kernels import reference_rms_norm, reference_swiglu

H, F, V = 64, 96, 80            # hidden, MLP width, head width
MS = "com.microsoft"


def _layer(t, *, stats=False, norm_out=False, two_readers=False, gamma_input=False, weight_input=False,
           bias=False):
    """A decoder layer's shape: skip norm -> merged q/k products; skip norm -> gate/up, SiLU gating, down;
    a final SimplifiedLayerNormalization -> the head. The keyword arguments break one fold each."""
    rng = np.random.default_rng(7)
    npt = {T.FLOAT16: np.float16, T.FLOAT: np.float32}[t]

    def w(*shape, s=0.2):
        return (rng.standard_normal(shape) * s).astype(npt)

    c = {"g1": w(H, s=1.0), "g2": w(H, s=1.0), "g3": w(H, s=1.0), "wq": w(H, H), "wk": w(H, 32), "wo": w(H + 32, H),
         "wg": w(H, F), "wu": w(H, F), "wd": w(F, H), "wh": w(H, V)}
    if bias:
        c["b1"] = w(H)
    ln1_in = ["x", "skip", "g1"] + (["b1"] if bias else [])
    nodes = [
        Node("ln1", "SkipSimplifiedLayerNormalization", MS, 1, ln1_in,
             ["n1", "mean1" if stats else "", "", "s1"], {"epsilon": 1e-6}),
        Node("q", "MatMul", "", 13, ["n1", "wq"], ["qo"]), Node("k", "MatMul", "", 13, ["n1", "wk"], ["ko"]),
        Node("cat", "Concat", "", 13, ["qo", "ko"], ["qk"], {"axis": -1}),
        Node("o", "MatMul", "", 13, ["qk", "wo"], ["oo"]),
        Node("ln2", "SkipSimplifiedLayerNormalization", MS, 1, ["oo", "s1", "g2"], ["n2", "", "", "s2"],
             {"epsilon": 1e-6}),
        Node("gate", "MatMul", "", 13, ["n2", "wg"], ["g"]), Node("up", "MatMul", "", 13, ["n2", "wu"], ["u"]),
        Node("sig", "Sigmoid", "", 13, ["g"], ["sg"]), Node("mul_a", "Mul", "", 14, ["g", "sg"], ["a"]),
        Node("mul_y", "Mul", "", 14, ["a", "u"], ["y"]), Node("down", "MatMul", "", 13, ["y", "wd"], ["d"]),
        Node("add", "Add", "", 14, ["d", "s2"], ["r"]),
        Node("ln3", "SimplifiedLayerNormalization", "", 1, ["r", "gamma3" if gamma_input else "g3"], ["n3"],
             {"epsilon": 1e-5, "axis": -1}),
        Node("head", "MatMul", "", 13, ["n3", "whead" if weight_input else "wh"], ["logits"])]
    outs = ["logits", "s2"] + (["mean1"] if stats else []) + (["n1"] if norm_out else [])
    if two_readers:
        nodes.append(Node("neg", "Neg", "", 13, ["n2"], ["nn"]))
        outs.append("nn")
    ins = ["x", "skip"] + (["gamma3"] if gamma_input else []) + (["whead"] if weight_input else [])
    if gamma_input:
        c.pop("g3")
    if weight_input:
        c.pop("wh")
    values = {v: ValueInfo(v, t) for v in ["n1", "mean1", "s1", "qo", "ko", "qk", "oo", "n2", "s2", "g", "u", "sg",
                                            "a", "y", "d", "r", "n3", "logits", "nn", "gamma3", "whead", *c]}
    values["x"] = ValueInfo("x", t, ("b", "s", H))
    values["skip"] = ValueInfo("skip", t, ("b", "s", H))
    for v in ("n1", "s1", "oo", "n2", "s2", "r", "n3"):
        values[v] = ValueInfo(v, t, ("b", "s", H))
    return Graph(nodes, ins, outs, values, c, "layer"), npt


def _programs(g, **kw):
    """(folded, unfolded) programs made as on a GPU (merged products, the gating folded, half weights kept)."""
    return tuple(Program(g, merge_matmuls=True, fold_mlp=True, widen_weights=False, fuse_rows=f, **kw)
                 for f in (True, False))


def _feeds(g, npt, shape):
    rng = np.random.default_rng(8)
    return [rng.standard_normal(shape + (H,)).astype(npt) if n in ("x", "skip") else
            (rng.standard_normal((H,) if n == "gamma3" else (H, V)) * 0.2).astype(npt) for n in g.inputs]


@pytest.mark.parametrize("t", [T.FLOAT16, T.FLOAT], ids=["fp16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 1), (2, 5)], ids=["decode-row", "rows"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_folded_layer_answers_the_same(t, shape, bias):
    g, npt = _layer(t, bias=bias)
    folded, plain = _programs(g)
    ops = [(st.node.name, st.outputs) for st in folded.steps]
    # ln1 + the merged q/k product; ln2 + gate/up + gating + down; ln3 + the head
    assert ops == [("q", ["qo", "ko", "s1"]), ("cat", ["qk"]), ("o", ["oo"]), ("down", ["d", "s2"]),
                   ("add", ["r"]), ("head", ["logits"])], ops
    assert [st.node.name for st in plain.steps] == ["ln1", "q", "cat", "o", "ln2", "gate", "down", "add", "ln3",
                                                     "head"]
    feeds = _feeds(g, npt, shape)
    for a, b, name in zip(folded.run(feeds), plain.run(feeds), g.outputs):
        a, b = dt.host(a), dt.host(b)
        assert a.dtype == b.dtype == npt and a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)


# why a layer keeps a norm of its own: what reads it, or where its parameters come from
KEPT = {
    "the norm's mean is used": (dict(stats=True), "ln1"),
    "the normalized row is a graph output": (dict(norm_out=True), "ln1"),
    "the normalized row has two readers": (dict(two_readers=True), "ln2"),
    "gamma is a graph input": (dict(gamma_input=True), "ln3"),
    "the head's weight is a graph input": (dict(weight_input=True), "ln3"),
}


@pytest.mark.parametrize("case", sorted(KEPT))
def test_norm_not_folded(case):
    kw, kept = KEPT[case]
    g, npt = _layer(T.FLOAT16, **kw)
    folded, plain = _programs(g)
    names = [st.node.name for st in folded.steps]
    assert kept in names, (case, names)
    assert len([n for n in ("ln1", "ln2", "ln3") if n in names]) == 1, (case, names)   # the others still fold
    feeds = _feeds(g, npt, (1, 1))
    for a, b in zip(folded.run(feeds), plain.run(feeds)):
        np.testing.assert_array_equal(dt.host(a), dt.host(b))


def test_not_folded_by_default_on_the_cpu():
    g, _ = _layer(T.FLOAT16)
    names = [st.node.name for st in Program(g, merge_matmuls=True, fold_mlp=True).steps]
    assert {"ln1", "ln2", "ln3", "down"} <= set(names), names


def _row_product(row, w):
    """A row times the weight in float32, rounded once to the row's type (the row kernels' product)."""
    return mx.matmul(row.astype(mx.float32), w.reshape(w.shape[-2:]).astype(mx.float32)).astype(row.dtype)


def _swiglu_row(y, width, gate_first=True):
    """``cuda_kernels.swiglu``'s contract (``test_cuda_kernels.reference_swiglu``) as an MLX array."""
    return mx.array(reference_swiglu(y, width, gate_first)).astype(y.dtype)


def _norm_contract(x, gamma, eps, w, skip=None, bias=None, gating=None):
    """``cuda_rows.norm_gemv``'s contract: ``rms_norm``'s row and sum (``reference_rms_norm``), the row's product
    (with ``gating``: that product's SiLU gating, ``swiglu``'s contract)."""
    row, total = reference_rms_norm(x, gamma, eps, skip, bias)
    y = _row_product(row, w)
    return (y if gating is None else _swiglu_row(y, *gating)), total


def _swiglu_contract(y, w, width, gate_first=True):
    """``cuda_rows.swiglu_gemv``'s contract: ``swiglu``'s row, its product."""
    return _row_product(_swiglu_row(y, width, gate_first), w)


# (layer keywords, weights left row-major, the kernels a decode row calls with the other weights column-major)
ROW_CALLS = {
    # the gate/up product makes the gating (half its outputs), the down product's kernel multiplies that row
    "folds": ({}, (), ["norm", "norm+glu", "gemv", "norm"]),
    # the MLP's norm is kept (a second reader): the down product's kernel makes the gating from the product
    "mlp-norm-kept": ({"two_readers": True}, (), ["norm", "rms", "swiglu", "norm"]),
    # a down weight not column-major: the gated row goes to the down projection's own product
    "down-row-major": ({}, ("wd",), ["norm", "norm+glu", "norm"]),
}


@pytest.mark.parametrize("variant", sorted(ROW_CALLS))
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_decode_row_takes_the_kernels(monkeypatch, bias, variant):
    """With the kernels on (each stood in by its contract) a decode row's three norms and the gating run in
    the products' kernels, and only against weights stored column-major; prompt rows never call them."""
    kw, row_major, row_calls = ROW_CALLS[variant]
    calls = []
    monkeypatch.setattr(cuda_rows, "_COL_MAJOR", {})
    monkeypatch.setattr(cuda_rows, "norm_gemv", lambda *a, **k: calls.append("norm" + ("+glu" if k.get("gating") else ""))
                        or _norm_contract(*a, **k))
    monkeypatch.setattr(cuda_rows, "swiglu_gemv", lambda *a, **k: calls.append("swiglu") or _swiglu_contract(*a, **k))
    monkeypatch.setattr(cuda_rows, "gemv", lambda a, w: calls.append("gemv") or _row_product(a, w))
    monkeypatch.setattr(cuda_kernels, "rms_norm", lambda *a, **k: calls.append("rms") or reference_rms_norm(*a, **k))
    monkeypatch.setattr(cuda_kernels, "swiglu", lambda y, n, gf: calls.append("glu") or _swiglu_row(y, n, gf))
    g, npt = _layer(T.FLOAT16, bias=bias, **kw)
    folded, plain = _programs(g)
    feeds = _feeds(g, npt, (1, 1))
    monkeypatch.setattr(cuda_kernels, "enabled", lambda: True)
    monkeypatch.setattr(cuda_kernels, "usable", lambda: True)
    want = [dt.host(a) for a in plain.run(feeds)]
    calls.clear()
    got = [dt.host(a) for a in folded.run(feeds)]
    assert calls == ["rms", "rms", "glu", "rms"], calls       # weights not column-major: the nodes' own kernels
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert all(k in folded.constants for k in row_major)
    cuda_rows.register_col_major(v for k, v in folded.constants.items() if k not in row_major)
    calls.clear()
    got = [dt.host(a) for a in folded.run(feeds)]
    assert calls == row_calls, calls
    for a, b, name in zip(got, want, g.outputs):
        # float32 sums in another order, each rounded once: within a few half ulps
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-2, atol=1e-2, err_msg=name)
    np.testing.assert_array_equal(got[1], want[1])       # the residual sum: the same rounding, bit for bit
    feeds = _feeds(g, npt, (2, 3))
    calls.clear()
    folded.run(feeds)
    assert calls == ["rms", "rms", "glu", "rms"], calls   # rows by default: the nodes' own kernels
    # with tuning batch_rows, a batch's rows take the same kernels as a lone row
    folded, plain = _programs(g, row_limit=cuda_rows.ROWS_MAX)
    cuda_rows.register_col_major(v for k, v in folded.constants.items() if k not in row_major)
    want = [dt.host(a) for a in plain.run(feeds)]
    calls.clear()
    got = [dt.host(a) for a in folded.run(feeds)]
    assert calls == row_calls, calls
    for a, b, name in zip(got, want, g.outputs):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-2, atol=1e-2, err_msg=name)
    calls.clear()
    folded.run(_feeds(g, npt, (2, cuda_rows.ROWS_MAX)))
    assert calls == ["rms", "rms", "glu", "rms"], calls   # more rows than ROWS_MAX: the nodes' own kernels


def test_row_reason():
    """What the kernels take: 1 to ROWS_MAX rows of the weight's type against a registered
    weight of K rows, the row within shared memory."""
    w = mx.zeros((64, 32), mx.float16)
    w3 = mx.zeros((1, 64, 32), mx.float16)
    cuda_rows.register_col_major([w, w3])
    row = mx.zeros((1, 1, 64), mx.float16)
    assert cuda_rows.row_reason(row, w, 64) is None and cuda_rows.row_reason(row, w3, 64) is None
    assert cuda_rows.row_reason(row[0, 0], w, 64) is None
    assert "column-major" in cuda_rows.row_reason(row, mx.zeros((64, 32), mx.float16), 64)
    assert "batch_rows" in cuda_rows.row_reason(mx.zeros((4, 1, 64), mx.float16), w, 64)   # one row by default
    with build.active(build.BuildContext(row_limit=cuda_rows.ROWS_MAX)):
        assert cuda_rows.row_reason(mx.zeros((4, 1, 64), mx.float16), w, 64) is None      # a batch's rows
        assert cuda_rows.row_reason(mx.zeros((2, cuda_rows.ROWS_MAX // 2, 64), mx.float16), w, 64) is None
        assert "rows" in cuda_rows.row_reason(mx.zeros((1, cuda_rows.ROWS_MAX + 1, 64), mx.float16), w, 64)
        assert "rows" in cuda_rows.row_reason(mx.zeros((0, 1, 64), mx.float16), w, 64)
    assert cuda_rows.row_reason(row.astype(mx.float32), w, 64) is not None
    assert cuda_rows.row_reason(row, w, 48) is not None
    big = mx.zeros((cuda_rows.ROW_MAX_BYTES // 2 + 8, 2), mx.float16)
    cuda_rows.register_col_major([big])
    assert "size" in cuda_rows.row_reason(mx.zeros((1, big.shape[0]), mx.float16), big, big.shape[0])


def test_block_shape():
    """Threads split an output's K by about eight 16-byte loads each (32..256, all in registers); a product
    has at most ``GRID_MAX`` blocks, its rounds of outputs spread evenly over them."""
    assert cuda_rows.threads_per_output(896, 8) == 32 and cuda_rows.threads_per_output(4864, 8) == 128
    assert cuda_rows.threads_per_output(8960, 8) == 256 and cuda_rows.threads_per_output(100, 4) == 32
    assert cuda_rows.grid_blocks(1152, 32) == 144              # a 0.5B QKV: one round of 8 outputs a block
    assert cuda_rows.grid_blocks(9728, 32) == 406              # its gate/up: 1,216 groups in 3 rounds
    for n, tpr in ((1152, 32), (9728, 32), (896, 128), (17920, 32), (151936, 32), (5, 256)):
        per = cuda_rows.THREADS // tpr
        blocks = cuda_rows.grid_blocks(n, tpr)
        groups = -(-n // per)
        rounds = -(-groups // blocks)
        assert 1 <= blocks <= cuda_rows.GRID_MAX and blocks * rounds >= groups > blocks * (rounds - 1) - rounds, \
            (n, tpr, blocks, rounds)


def test_fold_functions_exist_for_the_steps():
    """The folded steps' functions: the rowfold ones, their keywords fixed at load."""
    g, _ = _layer(T.FLOAT16)
    folded, _ = _programs(g)
    fns = {st.node.name: st.opdef.fn for st in folded.steps}
    assert fns["q"].func is rowfold.norm_product and fns["head"].func is rowfold.norm_product
    assert fns["down"].keywords["product"].func is rowfold.swiglu_down
    assert fns["q"].keywords["skip_form"] and not fns["head"].keywords["skip_form"]
    assert fns["q"].keywords["epsilon"] == 1e-6 and fns["head"].keywords["epsilon"] == 1e-5


@pytest.mark.genai
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_genai_models_fold_and_answer_the_same(arch, monkeypatch):
    """The tiny genai LLMs' graphs, their programs made as on a GPU with and without the folds (on the CPU
    the folded steps run the nodes' own functions): every layer's two norms fold into their products, the
    final norm into the LM head, and the greedy tokens are the same."""
    import dataclasses
    import functools
    import json

    from ortmlx.kernels import interpreter
    from test_compiled_genai import greedy, mg, model_dir
    path = model_dir(arch)
    with open(f"{path}/genai_config.json") as f:
        layers = json.load(f)["model"]["decoder"]["num_hidden_layers"]
    orig = interpreter.Program.__init__
    out = {}
    for fuse in (True, False):
        folds = []

        def init(self, graph, device="cpu", config=None, _fuse=fuse, _folds=folds, **k):
            if config is not None:          # a group's program (a control-flow body's gets none)
                config = dataclasses.replace(config, merge_matmuls=True, fold_mlp=True, widen_weights=False,
                                             fuse_rows=_fuse)
            orig(self, graph, device, config, **k)
            _folds.append(sum(isinstance(st.opdef.fn, functools.partial) and
                              st.opdef.fn.func is rowfold.norm_product for st in self.steps))
        monkeypatch.setattr(interpreter.Program, "__init__", init)
        model, _ = mg.load_model(path, "mlx", {"device": "cpu"})
        out[fuse] = (greedy(model, [510, 5, 17, 33, 90, 12, 7]), max(folds, default=0))
        del model
    monkeypatch.setattr(interpreter.Program, "__init__", orig)
    assert out[True][0] == out[False][0]
    assert out[True][1] == 2 * layers + 1 and out[False][1] == 0, (out[True][1], layers)


@pytest.mark.parametrize("size", [2, 4])
def test_row_blocks_fit_static_shared_memory(size):
    """Every row block the product kernels may be launched with (rows up to ``ROWS_MAX``, any K ``row_reason``
    takes) fits in 48 KB of static shared memory: its rows, the norm's per-row warp sums and the reduction's
    per-row partials (two weight columns when gated), and takes at least one row, at most the rows there are."""
    warps = cuda_rows.THREADS // 32
    for rows in range(1, cuda_rows.ROWS_MAX + 1):
        for k in range(8, cuda_rows.ROW_MAX_BYTES // size + 1, 8):
            rb = cuda_rows.rows_per_block(rows, k, size)
            assert 1 <= rb <= rows
            assert rb * k * size + rb * warps * 4 + rb * 2 * warps * 4 <= 48 << 10, (rows, k, rb)
