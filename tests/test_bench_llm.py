"""scripts/bench_llm.py --smoke end to end (tiny fp16 model; ORT's CPU EP stands in for the CUDA columns): the
JSON holds every engine's numbers and the correctness fields. Nothing here is timed: the benchmark's
numbers are only checked to be there (and the teacher-forced logits to line up with the fp32 reference's).
~20 s with the tiny models built, ~50 s building them: in the slow suite (`bash scripts/test.sh -m slow`).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from ortmlx.testing import child_env

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install .[genai])")
_missing = [m for m in ("torch", "transformers", "tokenizers", "onnx_ir") if importlib.util.find_spec(m) is None]
if _missing:
    pytest.skip(f"{_missing} needed to build the benchmark's tiny models (pip install .[builder])",
                allow_module_level=True)

pytestmark = pytest.mark.genai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ("cuda", "cuda_graph", "mlx")


def _num(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.mark.slow   # ~50 s cold on 2 cores: the harness end to end (bash scripts/test.sh -m slow)
def test_bench_llm_smoke_json_has_every_engine(tmp_path):
    out = tmp_path / "smoke.json"
    env = child_env()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_llm.py"), "--smoke", "--precisions",
                        "fp16", "--time-budget", "100", "--json", str(out)], capture_output=True, text=True,
                       env=env, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    M = r["models"]["qwen2-tiny-fp16"]
    if M["skipped"]:
        pytest.skip(f"this machine was too slow for the budget: {M['skipped']}")
    assert not M["errors"] and not M["dead"], (M["errors"], M["dead"], p.stdout[-3000:])
    assert M["build"]["model"]["weights_mb"] > 0 and "reference" in M["build"]
    for e in ENGINES:
        chk = M["engines"][e]["check"]
        assert _num(chk["first"]["max_abs_logit"]) and _num(chk["warm"]["ttft_ms"]), e
        st = M["stall"][e]
        assert st["complete"] and len(st["lengths"]) == 17 and _num(st["worst_ratio"]), e
        for L in M["prefill_lens"]:
            assert _num(M["prefill"][e][str(L)]["warm_ms"]) and _num(M["prefill"][e][str(L)]["cold_ms"]), (e, L)
        assert _num(M["decode"][e]["tps"]) and len(M["decode"][e]["tokens"]) == r["meta"]["config"]["new_tokens"]
        for B in r["meta"]["config"]["batches"]:
            assert _num(M["batch"][e][str(B)]["agg_tps"]), (e, B)
        a = M["accuracy"][e]
        assert a["finite"] and "first_mismatch_vs_ref" in a, (e, a)
        assert a["steps"] == r["meta"]["config"]["acc_steps"] + 1
        # the forced logits line up with the reference's steps (fp16 vs fp32: within 2% of the logits' scale)
        assert a["max_abs_err"] <= 2e-2 * a["ref_max_abs_logit"] and a["top1_equal"] >= a["steps"] - 1, (e, a)
        if e != "cuda":
            assert "first_mismatch_vs_cuda" in a and _num(a["max_abs_vs_cuda"]), (e, a)
    assert M["accuracy"]["ref"]["argmax_not_token"] == 0
    assert _num(M["host"]["ep_python_ms"]) and 0 < M["host"]["ep_python_share"] < 1
    # the table names every engine's column
    assert "ORT CPU (graph cfg)" in p.stdout and "MLX/graph" in p.stdout


@pytest.mark.slow   # ~60 s on 2 cores: every MLX kernel built again in new processes
def test_bench_llm_cold_case_starts_each_engine_with_empty_caches(tmp_path):
    out = tmp_path / "cold.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_llm.py"), "--smoke", "--precisions",
                        "fp16", "--only", "cold", "--cold-window", "3", "--time-budget", "200", "--json", str(out)],
                       capture_output=True,
                       text=True, env=child_env(), timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    M = json.loads(out.read_text())["models"]["qwen2-tiny-fp16"]
    if M["skipped"]:
        pytest.skip(f"this machine was too slow for the budget: {M['skipped']}")
    assert not M["errors"], M["errors"]
    for e in ENGINES + ("mlx_eager",):
        c = M["cold"][e]
        assert c["tokens"] == 16 and 0 < c["start_to_first_token_s"] <= c["start_to_last_token_s"], (e, c)
        # generations of 64 go on until 3 s after the load (none more where the first took longer: a loaded box)
        w = c["window"]
        assert w["s"] >= 3 and w["tokens"] >= 16 and (w["last_ms_per_token"] or 1) > 0, (e, w)
        assert e != "cuda" or (w["tokens"] >= 16 + 64 and w["last_ms_per_token"] > 0), (e, w)
    # the MLX EP's processes built their kernels into the new, empty cache (compiled: g++ libraries on the CPU)
    assert M["cold"]["mlx"]["kernel_files"] > 0, M["cold"]["mlx"]
    assert "cold: start to first token" in p.stdout and "cold: tokens in the 3 s after the load" in p.stdout
