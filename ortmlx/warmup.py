"""Build a genai model's compiled closures and MLX kernels ahead of its first real prompts.

    python -m ortmlx warmup MODEL_DIR [--max-length N] [--up-to L] [--device auto|cpu|gpu] [-o key=value ...]

The first call at a new prefill bucket (16, 32, 64, ... tokens, capped by the KV buffer) traces a closure and
builds its kernels (g++ on MLX's CPU backend, NVRTC on CUDA): seconds, while the user waits. This runs a
prompt per bucket up to ``--up-to`` (two in the first: a closure is trusted after matching eager at two
lengths, later buckets of the same body at their first match) and a few decode steps after each, with the
same KV buffer length the application uses (``--max-length``, default the model's ``search.max_length``: the
closures are keyed by it). The kernels land in MLX's cache (``version.mlx_cache_dir``); the closures themselves
live in the process, so an application gains from a warmup run in its own process (``warm(model, ...)``) or,
across processes, from the kernel cache alone.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from .compiled.attention import BUCKET_MIN, bucket_for, least_bucket
from .kernels import background
from .version import mlx_cache_dir


#: the longest a warm-up prompt waits for the kernels it queued on the builder thread (g++ builds take seconds)
BUILD_WAIT_S = 600.0


def least(device: str | None = None, tuning: str | None = None) -> int:
    """The shortest prefill bucket the MLX EP uses on ``device`` ("cpu"/"gpu"; None: MLX's default device) with the
    provider option ``tuning`` over the environment's, as the EP reads them (``compiled/attention.least_bucket``)."""
    import mlx.core as mx

    from .kernels.passes import BuildConfig
    from .tuning import Tuning
    t = Tuning.parse(tuning, Tuning.from_env(), where="option tuning")
    dev = device if device in ("cpu", "gpu") else ("gpu" if mx.default_device() == mx.gpu else "cpu")
    return least_bucket(BuildConfig.for_device(dev, t), t)


def prompt_lengths(up_to: int, max_length: int, least: int = BUCKET_MIN) -> list[tuple[int, int]]:
    """(bucket, prompt length) pairs up to ``up_to`` tokens under a KV buffer of ``max_length``, buckets from
    ``least``: two lengths in the first bucket (a padded bucket's closure is trusted after matching eager at two
    lengths), then the shortest of each later one (trusted at its first match once one bucket matched at two:
    ``compiled/core.py``)."""
    pairs, b = [], least
    up_to = min(up_to, max_length - 1)
    if up_to < 2:
        return pairs                # (a 1-token prompt is no bucket's)
    first = True
    while first or b // 2 + 1 <= up_to:
        top = min(b, up_to)
        lengths = {top, max(2, min(b // 2 + 1, top - 1))} if first else {b // 2 + 1}
        first = False
        for n in sorted(lengths, reverse=True):
            bucket = bucket_for(n, max_length, least)
            if bucket is not None and (bucket, n) not in pairs:
                pairs.append((bucket, n))
        b *= 2
    return pairs


def warm(model, max_length: int, up_to: int, decode_steps: int = 3, vocab: int = 100, log=print,
         device: str | None = None, tuning: str | None = None) -> list[dict]:
    """Run ``model`` (an ``og.Model`` on the MLX EP with options ``device`` (None: MLX's default) and ``tuning``)
    over every bucket's prompts; returns one record per prompt."""
    import onnxruntime_genai as og
    rng = np.random.default_rng(0)
    rows = []

    def generate(n: int) -> tuple[float, float]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=max_length, do_sample=False)
        g = og.Generator(model, params)
        t0 = time.perf_counter()
        g.append_tokens(rng.integers(1, vocab, n).astype(np.int32))
        g.generate_next_token()
        prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        steps = 0
        while steps < decode_steps and not g.is_done():
            g.generate_next_token()
            steps += 1
        decode = (time.perf_counter() - t1) / max(steps, 1)
        del g                   # (its KV buffers go before the next prompt's)
        return prefill, decode
    for bucket, n in prompt_lengths(up_to, max_length, least(device, tuning)):
        queued = background.submitted()
        prefill, decode = generate(n)
        if background.submitted() != queued:
            # MLX's CPU backend answered eagerly while it builds the kernels behind (tuning build_behind): once
            # they are built the same prompt traces and verifies its bucket's closure here
            background.wait(BUILD_WAIT_S)
            extra, decode = generate(n)
            prefill += extra
        rows.append({"bucket": bucket, "prompt": n, "prefill_s": prefill, "decode_s": decode})
        log(f"  prompt {n:5d} tokens (bucket {bucket:5d}): first token {prefill:7.3f} s, "
            f"then {1e3 * decode:7.2f} ms a token")
    return rows


def main(args) -> int:
    from . import genai as mg
    path = args.model_dir
    cfg_path = os.path.join(path, "genai_config.json")
    if not os.path.isfile(cfg_path):
        print(f"ortmlx warmup: no genai_config.json in {path}")
        return 1
    with open(cfg_path) as f:
        cfg = json.load(f)
    max_length = args.max_length or int(cfg.get("search", {}).get("max_length", 0)) or \
        int(cfg.get("model", {}).get("context_length", 2048))
    up_to = min(args.up_to, max_length - 1)
    vocab = int(cfg.get("model", {}).get("vocab_size", 100))
    opts = dict(args.options)
    # the kernels are built in the calls themselves (nothing waits for an answer here): none behind them
    if "build_behind" not in opts.get("tuning", ""):
        opts["tuning"] = ",".join(x for x in (opts.get("tuning", ""), "build_behind=0") if x)
    if args.device:
        opts["device"] = args.device
    t0 = time.perf_counter()
    model, _ = mg.load_model(path, "mlx", opts)
    print(f"ortmlx warmup: {path}: loaded in {time.perf_counter() - t0:.1f} s; prompts up to {up_to} tokens, "
          f"KV buffer {max_length} (must match the application's max_length); kernels cached under {mlx_cache_dir()}")
    t1 = time.perf_counter()
    warm(model, max_length, up_to, vocab=min(vocab, 1000), device=args.device, tuning=opts.get("tuning"))
    print(f"ortmlx warmup: done in {time.perf_counter() - t1:.1f} s")
    return 0
