"""A prompt's closures traced without MLX's kernel fusion (tuning ``prompt_fuse``, off by default on a GPU): MLX
reads its compile mode when it traces, so ``mode.unfused`` around a closure's calls leaves it MLX's own kernels
(none to build on a new host) while decode's closures, traced outside it, stay fused. On MLX's CPU backend here,
where a fused kernel is a g++ library in the kernel cache: counted, answers as eager's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ortmlx.testing import child_env

_MODE = r"""
import json, os
import mlx.core as mx
from ortmlx.compiled.mode import current_mode, unfused
def libs():
    return sum(f.endswith(".so") for _, _, fs in os.walk(os.path.join(os.environ["TMPDIR"], "mlx")) for f in fs)
x = mx.ones((8,))
with unfused():
    mx.eval(mx.compile(lambda x: mx.exp(x) * 2 + 1)(x))
inside = libs()
mx.eval(mx.compile(lambda x: mx.exp(x) * 3 + 1)(x))
print(json.dumps({"inside": inside, "after": libs() - inside, "mode": current_mode()}))
"""

_GENAI = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import ortmlx.compiled as C
from ortmlx import genai as mg
from test_compiled_genai import model_dir
def libs():
    return sum(f.endswith(".so") for _, _, fs in os.walk(os.path.join(os.environ["TMPDIR"], "mlx")) for f in fs)
path = model_dir("qwen2")
prompt = [510, 5, 17, 33, 90, 12, 7, 100, 200, 3, 4]
prompts = [prompt, prompt[:9], prompt]                 # (a key's second call with the same inputs replays it)
eager, _ = mg.load_model(path, "mlx", {"no_compile": "1", "device": "cpu"})
want = [mg.greedy(eager, p, 12) for p in prompts]
base = libs()
with C.capture() as rs:
    model, _ = mg.load_model(path, "mlx", {"tuning": "build_behind=0," + sys.argv[2], "device": "cpu"})
got_first = mg.greedy(model, prompt, 1)
after_prompt = libs() - base
got = [mg.greedy(model, p, 12) for p in prompts]
pre = [p for r in rs for p in r.parts() if p.label == "prefill"][0]
dec = [p for r in rs for p in r.parts() if p.label == "decode"][0]
print(json.dumps({"same": got == want and got_first == want[0][:1], "after_prompt": after_prompt,
                  "after_decode": libs() - base - after_prompt, "prefill_compiled": pre.counters["compiled_calls"],
                  "decode_compiled": dec.counters["compiled_calls"]}))
"""


def _child(tmp_path, code: str, *args: str) -> dict:
    tmp_path.mkdir(exist_ok=True)
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", code, here, *args], capture_output=True, text=True, timeout=600,
                       env=child_env(TMPDIR=str(tmp_path), ORTMLX_TUNING=""))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_unfused_traces_build_no_fused_kernel_and_restore_the_mode(tmp_path):
    got = _child(tmp_path, _MODE)
    assert got == {"inside": 0, "after": 1, "mode": "enabled"}, got


@pytest.mark.genai
def test_a_prompts_closure_unfused_answers_as_eager(tmp_path):
    """``prompt_fuse=0``: the prompt's closure, traced and replayed, builds fewer kernels at the first prompt than
    ``prompt_fuse=1`` (the CPU's default; what remains is the KV mirror's and the exp's own compiled helpers),
    decode's are built as before; the tokens are eager's either way."""
    pytest.importorskip("onnxruntime_genai")
    got = {fuse: _child(tmp_path / f"f{fuse}", _GENAI, f"prompt_fuse={fuse}") for fuse in (0, 1)}
    for g in got.values():
        assert g["same"] and g["prefill_compiled"] >= 1 and g["decode_compiled"] >= 1, got
        assert g["after_decode"] > 0, got
    assert got[0]["after_prompt"] < got[1]["after_prompt"], got
