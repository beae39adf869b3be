"""bfloat16 checks for ops ORT's CPU EP has no bf16 kernel for: the op runs in bf16 on MLX and is
compared with the same op in float32 on ORT's CPU, on bf16-representable inputs and weights."""
from __future__ import annotations

import copy

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortmlx.testing import assert_close, session, unclaimed_ops

F32, BF16 = TensorProto.FLOAT, TensorProto.BFLOAT16


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _rounded_inits(model: onnx.ModelProto, to_bf16: bool) -> onnx.ModelProto:
    m = copy.deepcopy(model)
    for i, t in enumerate(m.graph.initializer):
        if t.data_type == F32:
            a = round_bf16(numpy_helper.to_array(t))
            new = numpy_helper.from_array(a.astype(ml_dtypes.bfloat16) if to_bf16 else a, t.name)
            m.graph.initializer[i].CopyFrom(new)
    return m


def bf16_model(model: onnx.ModelProto, keep_float=()) -> onnx.ModelProto:
    """The float32 single-node test model in bfloat16; graph I/O stays float32 through Casts.
    ``keep_float``: node outputs that are float32 by the schema (statistics)."""
    m = _rounded_inits(model, to_bf16=True)
    g = m.graph
    node = g.node[0]
    casts_in, casts_out = [], []
    for vi in g.input:
        if vi.type.tensor_type.elem_type == F32:
            for j, n in enumerate(node.input):
                if n == vi.name:
                    node.input[j] = n + "__bf16"
            casts_in.append(helper.make_node("Cast", [vi.name], [vi.name + "__bf16"], to=BF16))
    for vi in g.output:
        if vi.type.tensor_type.elem_type == F32 and vi.name not in keep_float:
            for j, n in enumerate(node.output):
                if n == vi.name:
                    node.output[j] = n + "__bf16"
            casts_out.append(helper.make_node("Cast", [vi.name + "__bf16"], [vi.name], to=F32))
    nodes = casts_in + list(g.node) + casts_out
    del g.node[:]
    g.node.extend(nodes)
    return m


def check_bf16_vs_fp32(model: onnx.ModelProto, feeds_list, rtol: float, atol: float, keep_float=()):
    """bf16 on MLX (the op itself must be claimed) vs float32 on ORT's CPU, same rounded values."""
    ms = session(bf16_model(model, keep_float))
    left = dict(unclaimed_ops(ms))
    left.pop("Cast", None)
    assert not left, f"left off MLX: {left}"
    cs = session(_rounded_inits(model, to_bf16=False), "CPUExecutionProvider", record=False)
    names = [o.name for o in ms.get_outputs()]
    for k, f in enumerate(feeds_list):
        f = {n: round_bf16(v) if v.dtype == np.float32 else v for n, v in f.items()}
        for n, g, w in zip(names, ms.run(None, f), cs.run(None, f)):
            assert_close(g, w, rtol, atol, what=f"feed {k} {n} (bf16 vs fp32)")
