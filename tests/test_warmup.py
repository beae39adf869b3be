"""``python -m ortmlx warmup``: every prefill bucket's closure traced and trusted ahead of the real prompts, so a
prompt of a new length replays instead of tracing; the console says where the kernels are kept."""
import os
import subprocess
import sys

import numpy as np
import pytest

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")

import ortmlx.compiled as C  # noqa: E402
from ortmlx import warmup  # noqa: E402
from ortmlx import genai as mg  # noqa: E402

pytestmark = pytest.mark.genai


def test_prompt_lengths_cover_the_first_bucket_twice_and_each_later_once():
    pairs = warmup.prompt_lengths(100, 160)
    assert pairs == [(16, 16), (16, 9), (32, 17), (64, 33), (128, 65)]
    assert all(n <= b for b, n in pairs)
    assert warmup.prompt_lengths(4096, 4096)[-1] == (4096, 2049)        # capped by the KV buffer
    assert warmup.prompt_lengths(4096, 3000)[-1] == (3000, 2049)
    # from a longer least bucket (MLX's CUDA backend: 256): still two lengths in the first, even a short up_to
    assert warmup.prompt_lengths(1000, 4096, 256) == [(256, 256), (256, 129), (512, 257), (1024, 513)]
    assert warmup.prompt_lengths(40, 4096, 256) == [(256, 40), (256, 39)]
    assert warmup.prompt_lengths(1, 4096, 256) == [] and warmup.prompt_lengths(100, 1) == []


def test_a_longer_least_bucket_pads_short_prompts_into_one_closure(monkeypatch):
    """``bucket_min``: prompts shorter than it share its bucket's closure (one trace), and the warm-up walks the
    buckets from it (in the environment's tuning, as the EP reads it)."""
    from test_compiled_genai import MAX_LENGTH, model_dir
    monkeypatch.setenv("ORTMLX_TUNING", "build_behind=0,bucket_min=64")
    assert warmup.least("cpu") == 64 and warmup.least("cpu", "bucket_min=32") == 32     # the option over it
    with C.capture() as rs:
        model, _ = mg.load_model(model_dir("qwen2"), "mlx", {}, {"search": {"past_present_share_buffer": True}})
    (att,) = [r for r in rs if hasattr(r, "prefill")]
    rows = warmup.warm(model, MAX_LENGTH, 40, decode_steps=1, vocab=500, log=lambda *_: None, device="cpu")
    assert [(r["bucket"], r["prompt"]) for r in rows] == [(64, 40), (64, 33)]
    pre = att.prefill
    assert pre.trace_counts() == [1] and all(c.trusted for c in pre.closures()), pre.counters
    calls = pre.counters["compiled_calls"]
    for n in (3, 17, 63):
        g = og.Generator(model, mg.search_options(model, MAX_LENGTH, MAX_LENGTH))
        g.append_tokens(np.arange(1, n + 1, dtype=np.int32))
        g.generate_next_token()
        del g
    assert pre.trace_counts() == [1] and pre.counters["compiled_calls"] == calls + 3, pre.counters
    del model


@pytest.mark.parametrize("behind", ["0", "1"])
def test_warm_traces_the_buckets_so_new_prompt_lengths_replay(behind):
    """In the application's process too: with the kernels built behind the calls (MLX's CPU backend's default) a
    warm-up prompt that only queued its build runs again once it is built, so its bucket is traced here."""
    from test_compiled_genai import MAX_LENGTH, model_dir
    path = model_dir("qwen2")
    with C.capture() as rs:
        model, _ = mg.load_model(path, "mlx", {"tuning": f"build_behind={behind}"},
                                 {"search": {"past_present_share_buffer": True}})
    (att,) = [r for r in rs if hasattr(r, "prefill")]
    rows = warmup.warm(model, MAX_LENGTH, 40, decode_steps=2, vocab=500, log=lambda *_: None)
    assert [(r["bucket"], r["prompt"]) for r in rows] == [(16, 16), (16, 9), (32, 17), (64, 33)]
    pre = att.prefill
    assert pre.trace_counts() == [1, 1, 1] and all(c.trusted for c in pre.closures()), pre.counters
    traced, replayed = pre.counters["traces"], pre.counters["compiled_calls"]
    for n in (12, 25, 38):                          # new lengths in the warmed buckets
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=MAX_LENGTH, do_sample=False)
        g = og.Generator(model, params)
        g.append_tokens(np.arange(1, n + 1, dtype=np.int32))
        g.generate_next_token()
        del g
    assert pre.counters["traces"] == traced and pre.counters["compiled_calls"] == replayed + 3, pre.counters
    assert att.decode.closures() and all(c.trusted for c in att.decode.closures())
    del model


def test_warmup_command(tmp_path):
    from test_compiled_genai import model_dir
    path = model_dir("qwen2")
    # the kernels go under $TMPDIR/mlx on MLX's CPU backend, into MLX_PTX_CACHE_DIR on its CUDA backend: both here
    env = dict(os.environ, TMPDIR=str(tmp_path), MLX_PTX_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "ortmlx", "warmup", path, "--up-to", "20", "--max-length", "160"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"kernels cached under {tmp_path}" in r.stdout and "KV buffer 160" in r.stdout, r.stdout
    assert "prompt    16 tokens (bucket    16)" in r.stdout and "prompt    17 tokens (bucket    32)" in r.stdout
    r = subprocess.run([sys.executable, "-m", "ortmlx", "warmup", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "no genai_config.json" in r.stdout
