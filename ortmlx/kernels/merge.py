"""Sibling MatMuls merged: ai.onnx MatMul nodes that read the same A with 2-D constant weights of one
type and K (an MLP's gate and up projections, separate q/k/v projections) become one product with the
weights side by side, whose output is sliced back into theirs.

Each output element is still the dot product of A's row with its own weight column: the same values.
On a GPU a decode row is then one gemv launch instead of one per sibling (the launch, not the
arithmetic, is what a decode step pays for there).
"""
from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from . import build, cuda_kernels, cuda_rows
from . import dtypes as dt
from .ops.activation import sigmoid
from .ops.contrib_quant import dequantize_blocks


def sibling_groups(graph) -> list[list]:
    """Groups (2+, in graph order) of MatMul nodes with the same A and a [K, N_i] constant weight each of
    one dtype and K; a weight read by anything else (or twice, or a graph output) keeps its node out."""
    readers = graph.consumers(implicit=True)
    outputs = set(graph.outputs)
    by_key: dict[tuple, list] = {}
    for n in graph.nodes:
        if n.op_type != "MatMul" or n.domain not in ("", "ai.onnx") or len(n.inputs) != 2 or not n.inputs[0]:
            continue
        w = graph.constants.get(n.inputs[1])
        if w is None or np.ndim(w) != 2 or len(readers.get(n.inputs[1], ())) != 1 or n.inputs[1] in outputs \
                or n.inputs[1] in graph.inputs or not n.outputs or not n.outputs[0]:
            continue
        by_key.setdefault((n.inputs[0], w.shape[0], np.asarray(w).dtype.str), []).append(n)
    return [g for g in by_key.values() if len(g) >= 2]


def merged_name(group) -> str:
    return f"{group[0].inputs[1]}::merged{len(group)}"


def merged_weight(graph, group) -> np.ndarray:
    """The group's weights side by side: [K, sum N_i]."""
    return np.concatenate([np.asarray(graph.constants[n.inputs[1]]) for n in group], axis=1)


def merged_matmul(A, W, *, widths: tuple[int, ...], mm=None):
    """``A @ W`` sliced back into the siblings' outputs (views of one product).

    A product of one row with siblings of one width (an MLP's gate and up) is viewed as one row per
    sibling ([..., G, N], sliced along that axis): each output's row stride is then its width. A
    last-axis slice keeps the merged row's stride (G * N), and so does an elementwise result of it
    (MLX gives a contiguous-enough output its input's strides), which MLX's matmul copies before it
    multiplies (a decode row's down projection: one copy kernel per layer on the GPU). ``mm``: what
    multiplies (``rowfold.norm_product``'s, which may make A itself), default ``matmul_lifted``."""
    return merged_matmul_slices((mm or matmul_lifted)(A, W), widths)


def merged_matmul_slices(y, widths: tuple[int, ...]) -> tuple:
    """The siblings' outputs from their merged product ``y`` (``merged_matmul``)."""
    if y.ndim >= 2 and y.shape[-2] == 1 and len(set(widths)) == 1 and len(widths) > 1:
        rows = y.reshape(tuple(y.shape[:-2]) + (len(widths), widths[0]))
        return tuple(rows[..., k:k + 1, :] for k in range(len(widths)))
    outs, at = [], 0
    for w in widths:
        outs.append(y[..., at:at + w])
        at += w
    return tuple(outs)


def merged_fn(graph, group):
    return functools.partial(merged_matmul, widths=tuple(int(graph.constants[n.inputs[1]].shape[1]) for n in group))


def swiglu_folds(graph, groups: list) -> dict[int, tuple]:
    """id(first node of a two-sibling group) -> (whether the gate comes first, the output y, ids of the three
    nodes folded) for an MLP's gate and up products of one width feeding only y = (g * Sigmoid(g)) * u
    (genai's SiLU): g read by the Sigmoid and its Mul alone, the Sigmoid by that Mul, that Mul's output and u
    by the last Mul alone, none of them a graph output, a float type the kernel takes."""
    consumers = graph.consumers(implicit=True)
    outputs = set(graph.outputs)

    def only(name, n: int) -> list | None:
        c = consumers.get(name, [])
        return c if len(c) == n and len({id(x) for x in c}) == n and name not in outputs else None

    def std(n, op: str) -> bool:
        return n.op_type == op and n.domain in ("", "ai.onnx") and not n.implicit_inputs

    folds = {}
    for g in groups:
        if len(g) != 2 or graph.constants[g[0].inputs[1]].shape[1] != graph.constants[g[1].inputs[1]].shape[1] \
                or graph.value(g[0].outputs[0]).dtype not in (dt.FLOAT16, dt.BFLOAT16, dt.FLOAT):
            continue
        for k in (0, 1):
            gate, up = g[k].outputs[0], g[1 - k].outputs[0]
            cg = only(gate, 2)
            sig = [n for n in cg or () if std(n, "Sigmoid") and n.inputs == [gate]]
            if len(sig) != 1:
                continue
            mul_a = cg[1] if cg[0] is sig[0] else cg[0]
            s = sig[0].outputs[0]
            if not std(mul_a, "Mul") or sorted(mul_a.inputs) != sorted([gate, s]) or only(s, 1) is None:
                continue
            ca, cu = only(mul_a.outputs[0], 1), only(up, 1)
            if not ca or not cu or ca[0] is not cu[0] or not std(ca[0], "Mul") or \
                    sorted(ca[0].inputs) != sorted([mul_a.outputs[0], up]) or not ca[0].outputs[0]:
                continue
            folds[id(g[0])] = (k == 0, ca[0].outputs[0], (id(sig[0]), id(mul_a), id(ca[0])))
            break
    return folds


def merged_swiglu(A, W, *, width: int, gate_first: bool, mm=None):
    """``(g * sigmoid(g)) * u`` of the merged gate/up product ``A @ W`` (``swiglu_folds``; ``mm`` as
    ``merged_matmul``'s)."""
    return swiglu_of((mm or matmul_lifted)(A, W), width, gate_first)


def swiglu_of(y, width: int, gate_first: bool):
    """The SiLU gating of a merged gate/up product y: one custom kernel on MLX's CUDA backend (any row count:
    it reads them at run time), else the folded nodes' own translators over the product's slices."""
    if cuda_kernels.enabled() and cuda_kernels.swiglu_reason(y, width) is None:
        return cuda_kernels.swiglu(y, width, gate_first)
    first, second = merged_matmul_slices(y, (width, width))
    g, u = (first, second) if gate_first else (second, first)
    return mx.multiply(mx.multiply(g, sigmoid(g)), u)


#: the GroupQueryAttention input a folded bias travels in (after the 16 of the spec)
QKV_BIAS_INPUT = 16


def qkv_bias_folds(graph) -> dict[int, tuple]:
    """id(GroupQueryAttention node) -> (its Add node, the Add's data input, the bias constant) for every
    packed-QKV GroupQueryAttention whose query is ``Add(X, bias)`` with a 1-D constant bias (size > 1)
    read by nothing else, the Add's output read only by that node and not a graph output. The Add can then
    be folded into the attention (``GroupQueryAttention``'s ``qkv_bias``), which adds it itself."""
    producers = graph.producers()
    consumers = graph.consumers(implicit=True)
    outputs = set(graph.outputs)
    folds = {}
    for n in graph.nodes:
        if n.op_type != "GroupQueryAttention" or n.domain != "com.microsoft" or not n.inputs or \
                any(i for i in n.inputs[1:3]) or len(n.inputs) > QKV_BIAS_INPUT:
            continue
        add = producers.get(n.inputs[0])
        if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2 \
                or n.inputs[0] in outputs or len(consumers.get(n.inputs[0], ())) != 1:
            continue
        for x, bias in (add.inputs, add.inputs[::-1]):
            c = graph.constants.get(bias)
            if c is not None and x not in graph.constants and np.ndim(c) == 1 and np.size(c) > 1 \
                    and len(consumers.get(bias, ())) == 1 and bias not in outputs:
                folds[id(n)] = (add, x, bias)
                break
    return folds


def bias_product_folds(graph, types: dict) -> dict[int, tuple]:
    """id(MatMul node) -> (its Add node, the bias constant) for every half-precision (float16/bfloat16) MatMul of a
    constant 2-D weight [K, N] whose output only ``Add(., bias)`` reads and is not a graph output, the bias a
    1-D constant (N,) nothing else reads: the two can run as one product that adds the bias before rounding
    (``matmul_bias``), as ORT's kernels do."""
    producers = graph.producers()
    consumers = graph.consumers(implicit=True)
    outputs = set(graph.outputs)
    folds = {}
    for add in graph.nodes:
        if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2 or \
                types.get(add.outputs[0]) not in (dt.FLOAT16, dt.BFLOAT16):
            continue
        for x, bias in (add.inputs, add.inputs[::-1]):
            mm = producers.get(x)
            c = graph.constants.get(bias)
            if mm is None or c is None or mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx") or x in outputs \
                    or len(consumers.get(x, ())) != 1 or len(consumers.get(bias, ())) != 1 or bias in outputs:
                continue
            w = graph.constants.get(mm.inputs[1])
            if w is not None and np.ndim(w) == 2 and np.shape(c) == (np.shape(w)[1],) and mm.inputs[0] not in graph.constants:
                folds[id(mm)] = (add, bias)
                break
    return folds


def matmul_bias(A, B, bias):
    """``A @ B + bias`` rounded once (a MatMul and its bias Add as one step, ``bias_product_folds``): MLX's addmm adds
    the bias in the product's float32 accumulator, where two steps round the product to the half type first.
    A weight widened to float32 (``widened_weights``) widens A and the bias too, the result rounded back."""
    if A.dtype == B.dtype:
        return mx.addmm(bias.astype(A.dtype), A, B)
    return mx.addmm(bias.astype(B.dtype), A.astype(B.dtype), B).astype(A.dtype)


def step_readers(graph, steps) -> dict[str, list]:
    """Value -> what reads it once the program's steps are made (merged and folded steps read other values
    than the graph's nodes): the steps by their inputs, and control-flow nodes by the outer values their
    bodies read (``Graph.consumers`` for the steps)."""
    out: dict[str, list] = {}
    for st in steps:
        for i in st.inputs:
            if i:
                out.setdefault(i, []).append(st)
    for n in graph.nodes:
        for i in n.implicit_inputs:
            out.setdefault(i, []).append(n)
    return out


def lifted_weights(graph, steps, shapes: dict) -> set[str]:
    """Constant 2-D MatMul weights (``shapes``: name -> shape of every constant, merged ones included) whose
    only reader is one ai.onnx MatMul step with a 3-D A (its declared rank): stored [1, K, N], the product
    is one MLX node (MLX flattens a 3-D A against a 2-D B and unflattens the result: two more nodes to
    build and evaluate per product, per call)."""
    readers = step_readers(graph, steps)
    outputs = set(graph.outputs)
    out = set()
    for st in steps:
        if st.node.op_type != "MatMul" or st.node.domain not in ("", "ai.onnx") or len(st.inputs) != 2:
            continue
        a, w = st.inputs
        if a and len(shapes.get(w, ())) == 2 and len(readers.get(w, ())) == 1 and w not in outputs \
                and graph.value(a).rank == 3:
            out.add(w)
    return out


def matmul_lifted(A, B):
    """``A @ B`` for a weight stored [1, K, N] (``lifted_weights``: a 3-D A multiplies it as it is) and/or
    widened to float32 (``widened_weights``: a half A is widened too, the product rounded once back). Decode rows
    by a column-major weight take our row kernel where the build asks (``build.row_products``)."""
    if A.dtype == B.dtype and A.ndim >= 2 and build.row_products() and cuda_kernels.enabled() \
            and cuda_rows.row_reason(A, B, A.shape[-1]) is None:
        return cuda_rows.gemv(A, B)
    if B.ndim == 3 and A.ndim != 3:
        B = B.reshape(B.shape[1:])
    if A.dtype == B.dtype:
        return mx.matmul(A, B)
    return mx.matmul(A.astype(B.dtype), B).astype(A.dtype)


HALVES = ("float16", "bfloat16")


def widened_weights(graph, steps, types: dict, dtype_name) -> set[str]:
    """Constant half-precision (float16/bfloat16) 2-D MatMul weights whose only readers are ai.onnx MatMul
    steps: on MLX's CPU backend they are kept in float32 (an exact widening) so products run in the BLAS's
    sgemm (MLX's own half-precision CPU matmul is not BLAS-backed). ``dtype_name``: ONNX type -> name."""
    out = set()
    for name, sts in step_readers(graph, steps).items():
        if name not in graph.constants or name in graph.outputs \
                or dtype_name(types.get(name)) not in HALVES or np.ndim(graph.constants[name]) != 2:
            continue
        # a control-flow node reading it from a body (``step_readers``: the node itself) is no MatMul
        if all(getattr(st, "node", st).op_type == "MatMul" and st.node.domain in ("", "ai.onnx")
               and (len(st.inputs) == 2 or st.opdef.fn is matmul_bias) and st.inputs[1] == name
               and st.inputs[0] != name for st in sts):
            out.add(name)
    return out


def dense_nbits(graph, steps) -> dict[int, tuple[str, dict, set]]:
    """Step index -> (packed weight name, attributes, the constants only it reads) for every com.microsoft
    MatMulNBits whose packed weight, scales and zero points are constants (no g_idx, not prepacked): on
    MLX's CPU backend their float32 weight is made once at load (``nbits_weight``) and the product runs in
    the BLAS's sgemm (MLX's quantized CPU matmul is a plain loop). Constants others read too (a tied
    embedding's GatherBlockQuantized) stay."""
    readers = step_readers(graph, steps)
    out = {}
    for k, st in enumerate(steps):
        if st.node.op_type != "MatMulNBits" or st.node.domain != "com.microsoft":
            continue
        a = {**{n: v for n, v in st.opdef.attrs.items() if n in ("bits", "accuracy_level", "weight_prepacked")},
             **st.attrs}
        found = _nbits_constants(graph, st.inputs, a)
        if found is not None:
            names, consts_ = found
            out[k] = (names[1], a, {c for c in consts_ if len(readers.get(c, ())) == 1 and c not in graph.outputs})
    return out


def _nbits_constants(graph, inputs: list[str], attrs: dict) -> tuple[list[str], list[str]] | None:
    """(a MatMulNBits' inputs padded to six, its weight's constants: packed, scales, zero points) when that weight
    is constant (packed uint8, no g_idx, not prepacked, K, N and block_size known), else None."""
    names = list(inputs) + [""] * (6 - len(inputs))
    if names[4] or attrs.get("weight_prepacked", 0) or any(attrs.get(x) is None for x in ("K", "N", "block_size")):
        return None
    consts_ = [names[1], names[2]] + ([names[3]] if names[3] else [])
    if all(c in graph.constants for c in consts_) and np.asarray(graph.constants[names[1]]).dtype == np.uint8:
        return names, consts_
    return None


def nbits_weight(graph, names: list[str], attrs: dict):
    """The (N, K) float32 weight a MatMulNBits dequantizes (its translator's arithmetic), evaluated."""
    B = mx.array(np.asarray(graph.constants[names[1]]))
    s = mx.array(np.asarray(graph.constants[names[2]]))
    if s.dtype == mx.uint16:
        s = s.view(mx.bfloat16)                  # bf16 constants travel as bits
    z = mx.array(np.asarray(graph.constants[names[3]])) if len(names) > 3 and names[3] else None
    w = dequantize_blocks(B.reshape(attrs["N"], -1, attrs["block_size"] * attrs.get("bits", 4) // 8), s, z,
                          K=attrs["K"], N=attrs["N"], bits=attrs.get("bits", 4), block_size=attrs["block_size"],
                          dtype=mx.float32)
    w = mx.contiguous(w)
    mx.eval(w)
    return w


def matmul_dense_nbits(A, W, scales=None, zero_points=None, g_idx=None, bias=None, *, K, N, block_size, bits=4,
                       accuracy_level=0, weight_prepacked=0):
    """MatMulNBits over its float32 (N, K) weight made at load: A @ W^T (+ bias) in float32, one rounding."""
    if A.shape[-1] != K:
        raise ValueError(f"A's last dim {A.shape[-1]} != K={K}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias shape {bias.shape}, expected ({N},)")
    y = A.astype(mx.float32) @ W.T
    if bias is not None:
        y = y + bias.astype(mx.float32)
    return y.astype(A.dtype)


#: most bytes of half weights ``nbits_as_matmuls`` makes for one group (device memory beside the packed ones
#: that other nodes still read)
HALF_DENSE_MAX = 4 << 30


def nbits_as_matmuls(graph, cap: int = HALF_DENSE_MAX, device: str = "cpu"):
    """A copy of ``graph`` whose com.microsoft 4-bit MatMulNBits with half-precision A and constant weights (no
    g_idx, bias or prepacked layout) are ai.onnx MatMuls over their (K, N) weights dequantized once to A's type, or
    None (none such, or their weights would take more than ``cap`` bytes). The dequantized value is the
    translator's (q - zero point) * scale, rounded once to the half type (4 bits only: wider values lose more
    to that rounding than ORT's CPU EP, which dequantizes in float32).

    The passes then treat an int4 model as its fp16 form: merged siblings, column-major device weights and,
    for decode rows, the row kernels (``cuda_rows``) with the norm and gating folded in. MLX's quantized
    product on a GPU runs one kernel per projection with the norms and gating as kernels of their own.
    The weights are made on ``device``'s stream (MLX's CPU takes seconds for a 0.5B model's, a GPU milliseconds)."""
    from ..ir import Graph, Node, ValueInfo
    picked = []
    for n in graph.nodes:
        if n.op_type != "MatMulNBits" or n.domain != "com.microsoft" or len(n.outputs) != 1:
            continue
        a, half = n.attrs, graph.value(n.inputs[0]).dtype
        found = _nbits_constants(graph, n.inputs, a)
        if found is not None and half in (dt.FLOAT16, dt.BFLOAT16) and a.get("bits", 4) == 4 and not found[0][5]:
            picked.append((n, found[0], a, half))
    if not picked or sum(2 * a["K"] * a["N"] for _, _, a, _ in picked) > cap:
        return None
    constants, values, swap = dict(graph.constants), dict(graph.values), {}
    for n, names, a, half in picked:
        name = f"{names[1]}::half"
        with mx.stream(mx.gpu if device == "gpu" else mx.cpu):
            w = nbits_weight(graph, names, a).T.astype(dt.MLX[half])
            w = np.array(w.view(mx.uint16) if half == dt.BFLOAT16 else w)     # bf16 constants travel as bits
        constants[name] = w
        values[name] = ValueInfo(name, half, (a["K"], a["N"]))
        swap[id(n)] = Node(n.name, "MatMul", "", 13, [names[0], name], list(n.outputs), {}, n.index)
    readers = graph.consumers(implicit=True)
    gone = {i for n, names, _, _ in picked for i in names[1:4] if i}
    users = {id(n) for n, _, _, _ in picked}
    for c in gone:
        if all(id(r) in users for r in readers.get(c, ())) and c not in graph.outputs:
            constants.pop(c, None)
    return Graph([swap.get(id(n), n) for n in graph.nodes], list(graph.inputs), list(graph.outputs), values,
                 constants, graph.name)
