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


def sibling_groups(graph) -> list[list]:
    """Groups (2+, in graph order) of MatMul nodes with the same A and a [K, N_i] constant weight each of
    one dtype and K; a weight read by anything else (or twice, or a graph output) keeps its node out."""
    uses: dict[str, int] = {}
    for n in graph.nodes:
        for i in list(n.inputs) + list(getattr(n, "implicit_inputs", ())):
            if i:
                uses[i] = uses.get(i, 0) + 1
    outputs = set(graph.outputs)
    by_key: dict[tuple, list] = {}
    for n in graph.nodes:
        if n.op_type != "MatMul" or n.domain not in ("", "ai.onnx") or len(n.inputs) != 2 or not n.inputs[0]:
            continue
        w = graph.constants.get(n.inputs[1])
        if w is None or np.ndim(w) != 2 or uses.get(n.inputs[1]) != 1 or n.inputs[1] in outputs \
                or n.inputs[1] in graph.inputs or not n.outputs or not n.outputs[0]:
            continue
        by_key.setdefault((n.inputs[0], w.shape[0], np.asarray(w).dtype.str), []).append(n)
    return [g for g in by_key.values() if len(g) >= 2]


def merged_name(group) -> str:
    return f"{group[0].inputs[1]}::merged{len(group)}"


def merged_weight(graph, group) -> np.ndarray:
    """The group's weights side by side: [K, sum N_i]."""
    return np.concatenate([np.asarray(graph.constants[n.inputs[1]]) for n in group], axis=1)


def merged_matmul(A, W, *, widths: tuple[int, ...]):
    """``A @ W`` sliced back into the siblings' outputs (views of one product)."""
    y = mx.matmul(A, W)
    outs, at = [], 0
    for w in widths:
        outs.append(y[..., at:at + w])
        at += w
    return tuple(outs)


def merged_fn(graph, group):
    return functools.partial(merged_matmul, widths=tuple(int(graph.constants[n.inputs[1]].shape[1]) for n in group))
