"""Sibling MatMuls merged into one product (``ortmlx/kernels/merge.py``): which nodes join, and that the
merged program answers what the unmerged one does (on the CPU here; ``test_gpu_matmul.py`` checks the
GPU, where it is the default, against ORT's CPU EP)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T

from ortmlx.kernels import dtypes as dt
from ortmlx.kernels.interpreter import Program
from ortmlx.ir import Graph, Node, ValueInfo

K = 48


def _graph(t):
    rng = np.random.default_rng(0)
    npt = {T.FLOAT16: np.float16, T.FLOAT: np.float32}[t]
    w = {f"w{i}": rng.standard_normal((K, n)).astype(npt) for i, n in enumerate((64, 64, 24, 16, 8))}
    w["w5"] = rng.standard_normal((K + 2, 8)).astype(npt)        # another K: its own product
    nodes = [Node("gate", "MatMul", "", 13, ["x", "w0"], ["g"]), Node("up", "MatMul", "", 13, ["x", "w1"], ["u"]),
             Node("sig", "Sigmoid", "", 13, ["g"], ["s"]), Node("mul", "Mul", "", 14, ["s", "u"], ["m"]),
             Node("third", "MatMul", "", 13, ["x", "w2"], ["c"]),
             Node("shared", "MatMul", "", 13, ["x", "w3"], ["d"]),        # w3 is also read by an Add
             Node("addw", "Add", "", 14, ["w3", "w3"], ["ww"]),
             Node("other_a", "MatMul", "", 13, ["y", "w4"], ["e"]),        # another A
             Node("other_k", "MatMul", "", 13, ["z", "w5"], ["f"])]
    outs = ["m", "c", "d", "ww", "e", "f"]
    values = {n: ValueInfo(n, t) for n in ["x", "y", "z", "g", "u", "s", *outs, *w]}
    return Graph(nodes, ["x", "y", "z"], outs, values, w, "g"), npt


@pytest.mark.parametrize("t", [T.FLOAT16, T.FLOAT], ids=["fp16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 1), (2, 5), ()], ids=["decode-row", "rows", "vector"])
def test_merged_siblings_answer_the_same(t, shape):
    g, npt = _graph(t)
    merged, plain = Program(g, merge_matmuls=True), Program(g, merge_matmuls=False)
    ops = [st.node.name for st in merged.steps]
    assert ops == ["gate", "sig", "mul", "shared", "addw", "other_a", "other_k"], ops
    assert [st.outputs for st in merged.steps if st.node.name == "gate"] == [["g", "u", "c"]]
    assert not {"w0", "w1", "w2"} & set(merged.constants) and {"w3", "w4", "w5"} <= set(merged.constants)
    assert len(plain.steps) == len(g.nodes)
    rng = np.random.default_rng(1)
    feeds = [rng.standard_normal(shape + (K,)).astype(npt), rng.standard_normal(shape + (K,)).astype(npt),
             rng.standard_normal(shape + (K + 2,)).astype(npt)]
    got, want = merged.run(feeds), plain.run(feeds)
    for name, a, b in zip(g.outputs, got, want):
        a, b = dt.host(a), dt.host(b)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=2e-3 if t == T.FLOAT16 else 1e-5,
                                   atol=1e-3 if t == T.FLOAT16 else 1e-5, err_msg=name)


@pytest.mark.parametrize("lead", [(1, 1), (1,), (3, 1), (1, 2)], ids=["decode-row", "2-D row", "batch-3 row", "rows"])
def test_merged_outputs_of_one_row_have_their_width_as_row_stride(lead):
    """Siblings of one width over a single row come back as row slices of a [.., G, N] view: the same values
    as last-axis slices, and a row stride of N (not G * N) for them and for an elementwise result of them,
    which MLX's matmul then takes without a copy (read here through NumPy's zero-copy view's strides)."""
    import mlx.core as mx

    from ortmlx.kernels import merge
    rng = np.random.default_rng(2)
    A = mx.array(rng.standard_normal(lead + (K,)).astype(np.float16))
    W = mx.array(rng.standard_normal((K, 3 * 40)).astype(np.float16))
    got = merge.merged_matmul(A, W, widths=(40, 40, 40))
    y = A @ W
    want = [y[..., k * 40:(k + 1) * 40] for k in range(3)]
    f = mx.compile(lambda g, u: (g * mx.sigmoid(g)) * u)
    act = f(got[0], got[1])
    mx.eval(act, *got, *want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.array_equal(np.asarray(g), np.asarray(w))
    one_row = lead[-1] == 1
    assert np.asarray(got[0]).strides[-2] == (40 if one_row else 120) * 2, np.asarray(got[0]).strides
    # several rows: the slices are not contiguous, so MLX gives the elementwise result fresh strides anyway
    assert np.asarray(act).strides[-2] == 40 * 2, (lead, np.asarray(act).strides)
    # widths that differ keep the last-axis slices
    mixed = merge.merged_matmul(A, W, widths=(40, 56, 24))
    assert [m.shape[-1] for m in mixed] == [40, 56, 24]
    assert np.array_equal(np.asarray(mixed[1]), np.asarray(y[..., 40:96]))


def test_not_merged_by_default_on_the_cpu():
    g, _ = _graph(T.FLOAT)
    assert len(Program(g).steps) == len(g.nodes)
    assert len(Program(g, device_constants=True).steps) == len(g.nodes)


def _attention_graph(extra_output: bool):
    """MatMul -> Add(bias) -> packed GroupQueryAttention (rotary), as genai's builder writes a layer."""
    n, kvn, h, p, k = 4, 2, 16, 12, 32
    rng = np.random.default_rng(2)
    half = h // 2
    ang = np.outer(np.arange(p), 1.0 / 10000 ** (np.arange(half) / half))
    consts_ = {"w": rng.standard_normal((k, (n + 2 * kvn) * h)).astype(np.float16),
               "b": rng.standard_normal((n + 2 * kvn) * h).astype(np.float16),
               "cos": np.cos(ang).astype(np.float16), "sin": np.sin(ang).astype(np.float16)}
    nodes = [Node("proj", "MatMul", "", 13, ["x", "w"], ["xw"]), Node("bias", "Add", "", 14, ["xw", "b"], ["qkv"]),
             Node("attn", "GroupQueryAttention", "com.microsoft", 1,
                  ["qkv", "", "", "pk", "pv", "seqlens_k", "total_sequence_length", "cos", "sin"], ["o", "ok", "ov"],
                  {"num_heads": n, "kv_num_heads": kvn, "do_rotary": 1})]
    outs = ["o", "ok", "ov"] + (["qkv"] if extra_output else [])
    values = {nm: ValueInfo(nm, T.FLOAT16) for nm in ["x", "xw", "qkv", "pk", "pv", "o", "ok", "ov", *consts_]}
    values.update({"seqlens_k": ValueInfo("seqlens_k", T.INT32), "total_sequence_length": ValueInfo("t", T.INT32)})
    g = Graph(nodes, ["x", "pk", "pv", "seqlens_k", "total_sequence_length"], outs, values, consts_, "g")
    feeds = [rng.standard_normal((1, 1, k)).astype(np.float16),
             rng.standard_normal((1, kvn, p, h)).astype(np.float16),
             rng.standard_normal((1, kvn, p, h)).astype(np.float16),
             np.array([5], np.int32), np.array(6, np.int32)]
    return g, feeds


@pytest.mark.parametrize("extra_output", [False, True], ids=["folded", "add-output-kept"])
def test_qkv_bias_folded_into_attention(extra_output):
    g, feeds = _attention_graph(extra_output)
    folded, plain = Program(g, fold_qkv_bias=True, fold_bias=False), Program(g, fold_qkv_bias=False, fold_bias=False)
    names = [st.node.name for st in folded.steps]
    if extra_output:                                   # the Add's output is needed: nothing folds
        assert names == ["proj", "bias", "attn"], names
    else:
        assert names == ["proj", "attn"], names
        assert folded.steps[1].inputs[0] == "xw" and folded.steps[1].inputs[16] == "b"
    for name, a, b in zip(g.outputs, folded.run(feeds), plain.run(feeds)):
        np.testing.assert_array_equal(dt.host(a), dt.host(b), err_msg=name)       # the same operations


def test_qkv_bias_fold_needs_a_private_constant():
    g, _ = _attention_graph(False)
    g.nodes.append(Node("reuse", "Neg", "", 13, ["b"], ["nb"]))     # the bias is read elsewhere too
    g.outputs.append("nb")
    g.values["nb"] = ValueInfo("nb", T.FLOAT16)
    assert [st.node.name for st in Program(g, fold_qkv_bias=True, fold_bias=False).steps] == \
        ["proj", "bias", "attn", "reuse"]


def test_lifted_weights_answer_the_same():
    """Weights of products with a declared 3-D A are stored [1, K, N] (one MLX node per product): the same
    bits; a 2-D A, a shared weight and a merged group (lifted too) are handled."""
    g, npt = _graph(T.FLOAT16)
    for n in ("x", "z"):
        g.values[n] = ValueInfo(n, T.FLOAT16, ("b", "s", K if n == "x" else K + 2))
    g.values["y"] = ValueInfo("y", T.FLOAT16, ("s", K))                  # 2-D: w4 stays 2-D
    rng = np.random.default_rng(3)
    feeds = [rng.standard_normal((1, 2, K)).astype(npt), rng.standard_normal((2, K)).astype(npt),
             rng.standard_normal((1, 2, K + 2)).astype(npt)]
    for merge_matmuls in (False, True):
        lifted = Program(g, merge_matmuls=merge_matmuls, lift_weights=True)
        plain = Program(g, merge_matmuls=merge_matmuls, lift_weights=False)
        shapes = {k: tuple(v.shape) for k, v in lifted.constants.items()}
        assert shapes["w5"] == (1, K + 2, 8) and shapes["w4"] == (K, 8) and shapes["w3"] == (K, 16), shapes
        merged = [k for k in shapes if "::merged" in k]
        assert (merged and shapes[merged[0]] == (1, K, 64 + 64 + 24)) if merge_matmuls else \
            shapes["w0"] == (1, K, 64), shapes
        for name, a, b in zip(g.outputs, lifted.run(feeds), plain.run(feeds)):
            np.testing.assert_array_equal(dt.host(a), dt.host(b), err_msg=f"{name} (merged: {merge_matmuls})")


def test_qkv_bias_fold_comes_first():
    """With both passes on, the attention takes the bias (``fold_qkv_bias``) and the product stays alone."""
    g, feeds = _attention_graph(False)
    p = Program(g, fold_qkv_bias=True, fold_bias=True)
    assert [st.node.name for st in p.steps] == ["proj", "attn"] and p.steps[0].outputs == ["xw"]
    for name, a, b in zip(g.outputs, p.run(feeds), Program(g, fold_qkv_bias=True, fold_bias=False).run(feeds)):
        np.testing.assert_array_equal(dt.host(a), dt.host(b), err_msg=name)


def test_qkv_bias_not_folded_for_split_qkv():
    """Only a packed QKV's bias folds: with separate key/value inputs the Add stays a node."""
    g, _ = _attention_graph(False)
    attn = g.nodes[2]
    attn.inputs[1:3] = ["k", "v"]
    for n in ("k", "v"):
        g.inputs.append(n)
        g.values[n] = ValueInfo(n, T.FLOAT16)
    assert [st.node.name for st in Program(g, fold_qkv_bias=True, fold_bias=False).steps] == ["proj", "bias", "attn"]


@pytest.mark.parametrize("t", [T.FLOAT16, T.BFLOAT16], ids=["fp16", "bf16"])
def test_widened_half_weights(t):
    """Half-precision MatMul weights kept in float32 (the CPU's default): the product is the float32 product
    of the widened operands, rounded once (close to MLX's own half matmul, which accumulates in float32
    too); a weight another op reads stays as it is."""
    import mlx.core as mx
    g, _ = _graph(T.FLOAT16)
    if t == T.BFLOAT16:                           # bf16 constants travel as uint16 bits
        for k in list(g.constants):
            g.constants[k] = mx.array(g.constants[k].astype(np.float32)).astype(mx.bfloat16)
            g.constants[k] = np.array(g.constants[k].view(mx.uint16))
        g.values = {n: ValueInfo(n, T.BFLOAT16, v.shape) for n, v in g.values.items()}
    wide = Program(g, widen_weights=True, lift_weights=False)
    half = Program(g, widen_weights=False, lift_weights=False)
    kinds = {k: v.dtype for k, v in wide.constants.items()}
    assert all(kinds[w] == mx.float32 for w in ("w0", "w1", "w2", "w4", "w5")), kinds
    assert kinds["w3"] != mx.float32, kinds                       # read by the Add too
    rng = np.random.default_rng(5)

    def feed(*shape):
        x = mx.array(rng.standard_normal(shape).astype(np.float32))
        return np.array(x.astype(mx.float16)) if t == T.FLOAT16 else np.array(x.astype(mx.bfloat16).view(mx.uint16))
    feeds = [feed(2, K), feed(3, K), feed(1, 2, K + 2)]
    tol = 2 ** -9 if t == T.FLOAT16 else 2 ** -6
    for name, a, b in zip(g.outputs, wide.run(feeds), half.run(feeds)):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        a32, b32 = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
        assert np.all(np.abs(a32 - b32) <= tol * np.abs(b32) + 1e-2), name


def test_widening_skipped_when_memory_is_short(monkeypatch):
    """Half weights stay half when their float32 copies would take more than a quarter of MLX's memory."""
    import mlx.core as mx

    from ortmlx.kernels import interpreter
    g, _ = _graph(T.FLOAT16)
    monkeypatch.setattr(interpreter, "MAX_VALUE_BYTES", 4 * 2 * sum(np.asarray(g.constants[k]).nbytes
                                                                    for k in ("w0", "w1", "w2", "w4", "w5")) - 4)
    assert all(v.dtype != mx.float32 for v in Program(g, widen_weights=True).constants.values())
    monkeypatch.setattr(interpreter, "MAX_VALUE_BYTES", 1 << 40)
    assert Program(g, widen_weights=True).constants["w0"].dtype == mx.float32


def test_weights_a_body_reads_stay():
    """A weight a control-flow node's body reads (an implicit input) is neither merged, lifted nor widened."""
    from ortmlx.kernels import merge
    g, _ = _graph(T.FLOAT16)
    g.values["x"] = ValueInfo("x", T.FLOAT16, ("b", "s", K))
    steps = Program(g, merge_matmuls=False).steps
    found = (merge.lifted_weights(g, steps, {k: np.shape(v) for k, v in g.constants.items()}),
             merge.widened_weights(g, steps, Program(g).types, dt.name), len(merge.sibling_groups(g)[0]))
    assert "w0" in found[0] and "w0" in found[1] and found[2] == 3, found
    g.nodes.append(Node("branch", "If", "", 16, ["cond"], ["o"], implicit_inputs=["w0"]))
    assert "w0" not in merge.lifted_weights(g, steps, {k: np.shape(v) for k, v in g.constants.items()})
    assert "w0" not in merge.widened_weights(g, steps, Program(g, merge_matmuls=False).types, dt.name)
    assert [n.name for n in merge.sibling_groups(g)[0]] == ["up", "third"]


def _mlp_graph(t, gate_first=True, swap_muls=False, n_up=64, extra_out=None, reader=None):
    """An MLP's gate/up products and genai's SiLU gating: y = (g * Sigmoid(g)) * u."""
    rng = np.random.default_rng(3)
    npt = {T.FLOAT16: np.float16, T.FLOAT: np.float32, T.DOUBLE: np.float64}[t]
    w = {"wg": rng.standard_normal((K, 64)).astype(npt), "wu": rng.standard_normal((K, n_up)).astype(npt)}
    mm = [Node("gate", "MatMul", "", 13, ["x", "wg"], ["g"]), Node("up", "MatMul", "", 13, ["x", "wu"], ["u"])]
    nodes = (mm if gate_first else mm[::-1]) + [
        Node("sig", "Sigmoid", "", 13, ["g"], ["s"]),
        Node("mul_a", "Mul", "", 14, ["s", "g"] if swap_muls else ["g", "s"], ["a"]),
        Node("mul_y", "Mul", "", 14, ["u", "a"] if swap_muls else ["a", "u"], ["y"])]
    outs = ["y"] + ([extra_out] if extra_out else [])
    if reader:
        nodes.append(Node("reader", "Neg", "", 13, [reader], ["r"]))
        outs.append("r")
    values = {v: ValueInfo(v, t) for v in ["g", "u", "s", "a", "y", "r", *w]}
    values["x"] = ValueInfo("x", t, ("b", "s", K))          # 3-D: the merged weight is stored lifted too
    return Graph(nodes, ["x"], outs, values, w, "mlp"), npt


@pytest.mark.parametrize("t", [T.FLOAT16, T.FLOAT], ids=["fp16", "fp32"])
@pytest.mark.parametrize("gate_first,swap_muls", [(True, False), (False, True)], ids=["gate-first", "up-first"])
@pytest.mark.parametrize("shape", [(1, 1), (2, 5)], ids=["decode-row", "rows"])
def test_swiglu_folded_answers_the_same(t, gate_first, swap_muls, shape):
    """The merged gate/up product and its SiLU gating become one step (on the CPU: the folded nodes' own
    translators over the product's slices, bit for bit the merged program's answer)."""
    from ortmlx.kernels import merge
    g, npt = _mlp_graph(t, gate_first, swap_muls)
    folded = Program(g, merge_matmuls=True, fold_mlp=True)
    merged = Program(g, merge_matmuls=True, fold_mlp=False)
    plain = Program(g, merge_matmuls=False)
    assert [(st.node.name, st.outputs) for st in folded.steps] == [("gate" if gate_first else "up", ["y"])]
    assert len(merged.steps) == 4 and len(plain.steps) == 5
    (fold,) = merge.swiglu_folds(g, merge.sibling_groups(g)).values()
    assert fold[0] == gate_first and fold[1] == "y"
    x = np.random.default_rng(4).standard_normal(shape + (K,)).astype(npt)
    a, b, c = (dt.host(p.run([x])[0]) for p in (folded, merged, plain))
    assert a.dtype == npt and a.shape == shape + (64,)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a.astype(np.float64), c.astype(np.float64), rtol=2e-3 if t == T.FLOAT16 else 1e-5,
                               atol=1e-3 if t == T.FLOAT16 else 1e-5)


# why a graph keeps its SiLU nodes: the graph's extra output, or a node reading a value, or widths, or the type
SWIGLU_KEPT = {
    "gate is a graph output": dict(extra_out="g"),
    "the gating's product is a graph output": dict(extra_out="a"),
    "the sigmoid read elsewhere": dict(reader="s"),
    "up read elsewhere": dict(reader="u"),
    "gate read elsewhere": dict(reader="g"),
    "widths differ": dict(n_up=48),
    "float64": dict(t=T.DOUBLE),
}


@pytest.mark.parametrize("case", sorted(SWIGLU_KEPT))
def test_swiglu_not_folded(case):
    from ortmlx.kernels import merge
    kw = dict(SWIGLU_KEPT[case])
    g, npt = _mlp_graph(kw.pop("t", T.FLOAT16), **kw)
    groups = merge.sibling_groups(g)
    assert len(groups) == 1 and merge.swiglu_folds(g, groups) == {}, case
    p = Program(g, merge_matmuls=True, fold_mlp=True)
    assert "sig" in [st.node.name for st in p.steps], case


def test_swiglu_not_folded_by_default_on_the_cpu():
    g, _ = _mlp_graph(T.FLOAT16)
    assert "sig" in [st.node.name for st in Program(g, merge_matmuls=True).steps]
