"""Every architecture genai's builder makes here (models/build_llm.py ARCHS), end to end through genai on
the MLX EP: all nodes on MLX, greedy tokens identical to the reference of the correctness policy
(scripts/arch_cases.py: the CPU EP on the same model; int4 at accuracy_level 0), and for the -e cuda
half-precision graphs the teacher-forced logits against the same graph in float32 on the CPU EP.

The default suite runs a few cases that cover the ops this file was made for (windowed KV cache, sinks,
MoE/QMoE, q/k norm inputs, the causal convolution); the whole matrix is ``-m slow`` (also
``python scripts/llm_report.py --section archs``, which writes the table in docs/llm_partition.md).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import mlx.core as mx
import pytest

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install .[genai])")
_missing = [m for m in ("torch", "transformers", "tokenizers", "onnx_ir") if importlib.util.find_spec(m) is None]
if _missing:
    pytest.skip(f"{_missing} needed to build the test LLMs (pip install .[genai])", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "models"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import arch_cases  # noqa: E402
import build_llm as bl  # noqa: E402

pytestmark = pytest.mark.genai
OUT = os.environ.get("ORTMLX_MODELS_OUT", os.path.join(ROOT, "models", "out"))
N = 64


def _built(arch: str, target: str, precision: str) -> str | None:
    """The model's directory (built in a subprocess if missing); None when the builder cannot make it."""
    path = bl.out_dir(arch, "tiny", precision, OUT, target)
    if not os.path.exists(os.path.join(path, "model.onnx")) and not bl.failure(path):
        subprocess.run([sys.executable, os.path.join(ROOT, "models", "build_llm.py"), "--arch", arch, "--target",
                        target, "--precision", precision, "--out", OUT], capture_output=True, text=True, timeout=900)
    return path if os.path.exists(os.path.join(path, "model.onnx")) else None


def check_case(arch: str, target: str, precision: str) -> dict:
    if _built(arch, target, precision) is None:
        pytest.skip(f"not built: {bl.failure(bl.out_dir(arch, 'tiny', precision, OUT, target))}")
    if target == "cuda":
        _built(arch, "cpu", "fp32")         # the float32 reference where the CPU EP cannot run the graph
    r = arch_cases.run_case(arch, target, precision, N, "cpu", OUT)
    assert r["on_mlx"] == r["nodes"], r["report"]
    if target == "cpu":
        assert r["agree"] == N, (r["agree"], r["reference"])
    else:
        # float16: the MLX EP within 2e-2 of the CPU EP running the same float16 graph where that has the
        # kernels, else of float32 (10 mantissa bits; two layers and the head); bfloat16 (7 bits) has no
        # CPU kernels: 1e-1 is the table's bound, asserted at 2e-1 here (a wrong weight or layout is O(1))
        if precision == "fp16" and "logits_rel_cpu_half" in r:
            assert r["logits_rel_cpu_half"] <= 2e-2, r
        elif precision == "fp16":
            assert r["logits_rel"] <= 2e-2, r
        else:
            assert r["logits_rel"] <= 2e-1, r
    return r


FAST = [("gemma2", "cpu", "fp32"), ("gptoss", "cpu", "int4"), ("lfm2moe", "cpu", "fp32"), ("qwen3", "cuda", "fp16")]


@pytest.mark.parametrize("arch,target,precision", FAST, ids=["-".join(c) for c in FAST])
def test_arch_case(arch, target, precision):
    r = check_case(arch, target, precision)
    if arch == "gemma2":        # the windowed layer's decode is compiled (one shapeless trace)
        parts = {p["label"]: p for p in r["decode"]["parts"]}
        assert parts["decode"]["traces"] == [1] and parts["decode"]["compiled_calls"] == N - 3, parts["decode"]


@pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()), reason="MLX's CUDA backend only")
def test_longrope_decode_compiled_on_gpu():
    """Phi-3 LongRoPE's decode closure traces again when its If switches from the short to the long RoPE cache
    (new input shapes). On a GPU the closure's kernels write page-locked host memory (the KV rows, the
    logits), which the second trace shares: it must lay that memory out as the first did, and then decode
    stays compiled (it ran eagerly from the switch on before)."""
    if _built("phi3-longrope", "cuda", "fp16") is None:
        pytest.skip("phi3-longrope -e cuda fp16 not built")
    r = arch_cases.run_case("phi3-longrope", "cuda", "fp16", N, "gpu", OUT)
    parts = {p["label"]: p for p in r["decode"]["parts"]}
    assert parts["decode"]["poisoned"] == "" and parts["decode"]["traces"] == [2], parts["decode"]
    assert parts["decode"]["compiled_calls"] == N - 3, parts["decode"]


_ALL = [c for c in bl.matrix() if not bl.ARCHS[c[0]].skip]


@pytest.mark.slow
@pytest.mark.parametrize("arch,target,precision", _ALL, ids=["-".join(c) for c in _ALL])
def test_every_arch(arch, target, precision):
    check_case(arch, target, precision)
