"""A genai model built with the builder's ``prune_lm_head``: the LM head reads only the last token's hidden state
(``Gather(axis=1, index -1)`` on ``[batch_size, sequence_length, hidden]``), so its logits are ``[B, 1, V]``.

A prompt padded to its bucket ends in padding: the compiled prefill must gather the prompt's own last row
(``decode_ops.gather_padded_tail``), or its closure answers from the padding's row (verification caught that
and left every prompt eager). The model here is the tiny Qwen2 with that Gather inserted as the builder does."""
from __future__ import annotations

import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import helper

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install .[genai])")

import ortmlx.compiled as C  # noqa: E402
from ortmlx import genai as mg  # noqa: E402

pytestmark = pytest.mark.genai


def pruned_copy(src: str, dst: str) -> str:
    """``src``'s model with the builder's pruned LM head: Gather(axis=1, -1) + Unsqueeze before its MatMul."""
    shutil.copytree(src, dst)
    m = onnx.load(os.path.join(src, "model.onnx"))             # (its weights too: saved again below)
    g = m.graph
    (head,) = [n for n in g.node if "logits" in n.output]
    x = head.input[0]
    g.initializer.extend([onnx.numpy_helper.from_array(np.array(-1, np.int64), "prune/minus_one"),
                          onnx.numpy_helper.from_array(np.array([1], np.int64), "prune/axis_one")])
    gather = helper.make_node("Gather", [x, "prune/minus_one"], ["prune/last"], name="/lm_head/prune/Gather", axis=1)
    unsq = helper.make_node("Unsqueeze", ["prune/last", "prune/axis_one"], ["prune/last3"],
                            name="/lm_head/prune/Unsqueeze")
    head.input[0] = "prune/last3"
    at = list(g.node).index(head)
    g.node.insert(at, unsq)
    g.node.insert(at, gather)
    g.output[0].type.tensor_type.shape.dim[1].Clear()
    g.output[0].type.tensor_type.shape.dim[1].dim_value = 1
    os.remove(os.path.join(dst, "model.onnx"))
    os.remove(os.path.join(dst, "model.onnx.data"))
    onnx.save(m, os.path.join(dst, "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return dst


def test_a_padded_prompt_gathers_its_own_last_row(tmp_path):
    from test_compiled_genai import greedy, model_dir
    path = pruned_copy(model_dir("qwen2"), str(tmp_path / "pruned"))
    cfg = og.Config(path)
    cfg.clear_providers()
    cpu = og.Model(cfg)
    with C.capture() as rs:
        model, _ = mg.load_model(path, "mlx", {"tuning": "build_behind=0"},
                                 {"search": {"past_present_share_buffer": True}})
    (att,) = [r for r in rs if hasattr(r, "prefill")]
    rng = np.random.default_rng(3)
    for n in (20, 25, 40, 33, 20):          # padded to 32, 32, 64, 64, 32
        ids = rng.integers(5, 400, n).astype(np.int32)
        assert greedy(model, ids) == greedy(cpu, ids), n
    pre = att.prefill.counters
    assert not pre["poisoned"] and pre["compiled_calls"] >= 2, pre
    del model
