"""Compiled decode on the tiny LLM variants: int4/int8 (MatMulNBits prepacked, GatherBlockQuantized
with indices as data), the growing-KV contract (past_present_share_buffer false) and fp16 (the
builder's RotaryEmbedding + MultiHeadAttention graph).

Each: the decode closure traces exactly once over 4 generations of 64 tokens and the tokens are
eager's (and the CPU EP's where it computes the same thing: fp32, and int8 at MatMulNBits
accuracy_level 0). Models come from models/build_llm.py, built once under models/out/.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install .[genai])")

import test_compiled_genai as base  # noqa: E402  (its helpers: model_dir, run, PROMPTS, N ...)

import ortmlx.compiled as C  # noqa: E402
from ortmlx import genai as mg  # noqa: E402
from ortmlx.testing import session  # noqa: E402

pytestmark = pytest.mark.genai

#: decode calls of one run: every generation's first token comes from prefill
DECODE_CALLS = len(base.PROMPTS) * (base.N - 1)


def level0(path: str, dst: str) -> str:
    """A copy of a quantized model with MatMulNBits accuracy_level=0 (the CPU EP then computes in
    float, as MLX does; at the builder's level 4 it quantizes the activations to int8)."""
    import onnx
    d = mg.variant_dir(path, dst)
    m = onnx.load(os.path.join(d, "model.onnx"), load_external_data=False)
    n = 0
    for node in m.graph.node:
        for at in node.attribute:
            if node.op_type == "MatMulNBits" and at.name == "accuracy_level":
                at.i = 0
                n += 1
    assert n > 0
    onnx.save(m, os.path.join(d, "model.onnx"))
    return d


def traced_once(part):
    """One shapeless closure, traced once, verified at two lengths, replayed for every other call."""
    assert part.trace_counts == [1], (part.counters, part.n_closures)
    assert part.counters["verify_calls"] == 2, part.counters
    assert part.counters["compiled_calls"] == DECODE_CALLS - 2, part.counters
    assert part.counters["guard_fails"] == 0 and part.counters["poisoned_closures"] == 0, part.counters


@pytest.mark.parametrize("arch,precision", [("llama", "int8"), ("qwen2", "int4")])
def test_quant_decode_traces_once_tokens_match(arch, precision, tmp_path):
    """int8 (llama) and int4 (qwen2: its embedding is GatherBlockQuantized) with genai's shared KV buffer."""
    path = base.model_dir(arch, precision)
    eager, _ = base.run(path, options={"no_compile": "1"})
    got, rs = base.run(path)
    assert got == eager
    att = base.attention_parts(rs)
    traced_once(att.decode)
    assert base.no_poison(rs) == []
    if precision == "int8":
        cpu, _ = base.run(level0(path, str(tmp_path / "m")), "cpu")
        assert got == cpu


@pytest.mark.parametrize("arch,precision", [("llama", "fp32"),
                                               pytest.param("qwen2", "int4", marks=pytest.mark.slow)])
def test_growing_kv_decode_traces_once_tokens_match(arch, precision):
    """Separate past/present buffers: the past length grows every step; one shapeless closure."""
    path = base.model_dir(arch, precision)
    eager, _ = base.run(path, options={"no_compile": "1"}, overlay=base.NOSHARE)
    got, rs = base.run(path, overlay=base.NOSHARE)
    assert got == eager
    att = base.attention_parts(rs)
    grow = next(p for r in rs if r.is_attention for p in r.parts if p.counters["compiled"] == "decode_growing")
    traced_once(grow)
    assert att.decode.n_closures == 0            # the shared-buffer decode closure is never used
    assert base.no_poison(rs) == []
    if precision == "fp32":
        cpu, _ = base.run(path, "cpu", overlay=base.NOSHARE)
        assert got == cpu


def _decode_feed(p: int, rng, pad: int = 0):
    """One growing-KV decode step of llama-tiny-fp32: past of p rows, mask of p + 1 (``pad`` leading zeros)."""
    f = {"input_ids": np.array([[rng.integers(0, 500)]], np.int64),
         "attention_mask": np.concatenate([np.zeros((1, pad), np.int64), np.ones((1, p + 1 - pad), np.int64)], 1)}
    for layer in range(2):
        for kv in ("key", "value"):
            f[f"past_key_values.{layer}.{kv}"] = rng.standard_normal((1, 2, p, 16)).astype(np.float32)
    return f


def test_growing_kv_guard_answers_eagerly():
    """A step whose valid length is not the past's row count (a padded mask: seqlens_k != P) fails
    the in-graph guard: the call answers from eager (same outputs), the closure stays trusted."""
    path = os.path.join(base.model_dir("llama"), "model.onnx")
    with C.capture() as rs:
        s = session(path)
    ref = session(path, options={"no_compile": "1"})
    (att,) = [r for r in rs if hasattr(r, "decode_growing")]
    rng = np.random.default_rng(0)
    feeds = [_decode_feed(5, rng), _decode_feed(9, rng), _decode_feed(12, rng), _decode_feed(7, rng, pad=2),
             _decode_feed(20, rng)]
    for f in feeds:
        for g, w in zip(s.run(None, f), ref.run(None, f)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    c = att.decode_growing.counters
    assert att.decode_growing.trace_counts() == [1], c
    assert (c["verify_calls"], c["compiled_calls"], c["guard_fails"], c["poisoned_closures"]) == (2, 2, 1, 0), c


def test_fp16_prefill_compiles_decode_eager():
    """fp16 (RotaryEmbedding + MultiHeadAttention, growing KV): no bucket takes this prefill, so it is traced
    only when a prompt length comes back (RotaryEmbedding traced with positions as data); decode stays eager
    (repeat_kv and the mask are built from shapes of computed tensors: see docs/compiled.md). Tokens are
    eager's."""
    path = base.model_dir("llama", "fp16")
    eager, _ = base.run(path, options={"no_compile": "1"}, overlay=base.NOSHARE)
    got, rs = base.run(path, overlay=base.NOSHARE)
    assert got == eager
    att = base.attention_parts(rs)
    assert att.prefill_exact.trace_counts == [], att.prefill_exact.counters   # four lengths, each met once
    assert att.prefill_exact.counters["eager_calls"] == len(base.PROMPTS)
    got, rs = base.run(path, overlay=base.NOSHARE, twice=True)            # each length again: traced there
    assert got == eager
    att = base.attention_parts(rs)
    assert att.prefill_exact.trace_counts == [1] * len(base.PROMPTS), att.prefill_exact.counters
    assert att.prefill_exact.counters["verify_calls"] == len(base.PROMPTS)
    assert base.no_poison(rs) == []
    grow = next(p for p in att.parts if p.counters["compiled"] == "decode_growing")
    assert grow.n_closures == 0 and grow.counters["eager_calls"] == 2 * DECODE_CALLS, grow.counters



# ----------------------------------------------------------------------------- the builder's other archs
def arch_dir(arch: str, precision: str = "fp32", target: str = "cpu") -> str:
    """models/out/<arch>-tiny-<precision>[-cuda], built if missing (a subprocess)."""
    import subprocess
    import sys
    name = f"{arch}-tiny-{precision}" + ("" if target == "cpu" else f"-{target}")
    path = os.path.join(base.OUT, name)
    if not os.path.exists(os.path.join(path, "genai_config.json")):
        res = subprocess.run([sys.executable, os.path.join(base.ROOT, "models", "build_llm.py"), "--arch", arch,
                              "--precision", precision, "--target", target, "--out", base.OUT],
                             capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return path


@pytest.mark.parametrize("arch,precision", [("gemma2", "fp32"), ("gptoss", "int4")])
def test_windowed_kv_decode_traces_once(arch, precision, tmp_path):
    """A windowed KV cache (GroupQueryAttention sliding_window_cache=1, window 16 < the prompts + 64 tokens):
    the decode closure traces once for all generations (its capacity is a shape); prefill is shape-keyed
    (a padded prompt breaks the op's seqlens_k + 1 >= S), traced when a prompt length comes back. gpt-oss int4
    adds sinks and QMoE (prepacked)."""
    path = arch_dir(arch, precision)
    eager, _ = base.run(path, options={"no_compile": "1"})
    got, rs = base.run(path)
    assert got == eager
    att = base.attention_parts(rs)
    traced_once(att.decode)
    assert att.prefill.n_closures == 0 and att.prefill.counters["compiled_calls"] == 0, att.prefill.counters
    assert att.prefill_exact.trace_counts == [], att.prefill_exact.counters          # each length met once
    again, rs2 = base.run(path, twice=True)
    assert again == eager
    assert base.attention_parts(rs2).prefill_exact.trace_counts == [1] * len(base.PROMPTS)
    assert base.no_poison(rs) == [] and base.no_poison(rs2) == []
    cpu, _ = base.run(level0(path, str(tmp_path / "m")) if precision != "fp32" else path, "cpu")
    assert got == cpu


def test_qk_norm_fp16_cuda_graph_decode_traces_once():
    """Qwen3's -e cuda fp16 graph: q/k norms fused into GroupQueryAttention (q/k_norm_weight, which ORT's
    CPU EP refuses): one shapeless decode closure; tokens are eager's. (The padded prefill of a float16
    GroupQueryAttention graph differs from eager by more than its verification allows at some prompt
    lengths, for Llama's -e cuda graph too: that closure is poisoned and answers eagerly; not checked here.)"""
    path = arch_dir("qwen3", "fp16", "cuda")
    eager, _ = base.run(path, options={"no_compile": "1"})
    got, rs = base.run(path)
    assert got == eager
    traced_once(base.attention_parts(rs).decode)


def test_conv_state_decode_traces_once_prefill_unpadded():
    """LFM2's short convolution (CausalConvWithState): decode traces once; no padded prefill (its present
    state is the sequence's tail); tokens are eager's and the CPU EP's."""
    path = arch_dir("lfm2")
    eager, _ = base.run(path, options={"no_compile": "1"})
    got, rs = base.run(path)
    assert got == eager
    att = base.attention_parts(rs)
    traced_once(att.decode)
    assert att.prefill.counters["compiled_calls"] == att.prefill.counters["verify_calls"] == 0, att.prefill.counters
    assert base.no_poison(rs) == []
    cpu, _ = base.run(path, "cpu")
    assert got == cpu


@pytest.mark.slow
def test_moe_router_ops_traced_in_prefill():
    """LFM2-MoE's router (TopK -> GatherElements -> ScatterElements) traces with the indices as data in the
    shape-keyed prefill; decode compiles too: its router reshapes by a shape computed from a traced input's shape
    (Shape -> Slice -> Concat -> Reshape), dims the decode key fixes, baked as constants since c2a1f84 (before,
    decode stayed eager)."""
    path = arch_dir("lfm2moe")
    eager, _ = base.run(path, options={"no_compile": "1"})
    got, rs = base.run(path)
    assert got == eager
    att = base.attention_parts(rs)
    assert att.prefill_exact.trace_counts == [], att.prefill_exact.counters          # each length met once
    got, rs = base.run(path, twice=True)                                              # the lengths again: traced
    assert got == eager
    att = base.attention_parts(rs)
    assert att.prefill_exact.trace_counts == [1] * len(base.PROMPTS), att.prefill_exact.counters
    assert att.prefill_exact.counters["guard_fails"] == 0
    # both runs' decode: one closure, its first two calls verified against eager, every later one compiled
    assert att.decode.trace_counts == [1], att.decode.counters
    assert att.decode.counters["compiled_calls"] == 2 * DECODE_CALLS - 2, att.decode.counters
    assert base.no_poison(rs) == []
