"""mlx-lm's decode speed on an HF checkpoint, in a process that does not import ortmlx (so MLX runs with its
own settings, or the ones this process's environment gives): ``scripts/bench.py --mlx-lm`` runs it.

    python scripts/mlx_lm_bench.py HF_DIR [--prompt-len 32] [--new-tokens 128] [--rounds 3] [--fp16]

Two loops, medians of ``--rounds`` after a warm-up each: mlx-lm's own (``generate_step``: sampling on the
device, the next step queued before the token is read), and the same model stepped as genai steps an EP (one
forward, the last position's logits read on the host, the token chosen there). The last line printed is JSON:
ttft_ms, tps, host_tps, device, env (the MLX_* variables it ran with).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def measure(hf_dir: str, prompt_len: int, n_new: int, rounds: int, fp16: bool) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model
    model, _ = load_model(Path(hf_dir))
    if fp16:
        model.set_dtype(mx.float16)
    prompt = mx.array(np.random.default_rng(0).integers(5, 500, prompt_len).astype(np.int32))

    def own_loop():
        t0 = time.perf_counter()
        t1 = None
        n = 0
        for tok, _ in generate_step(prompt, model, max_tokens=n_new):
            mx.eval(tok)
            n += 1
            if t1 is None:
                t1 = time.perf_counter()
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (n - 1) / (t2 - t1)

    def host_token(ids, cache):
        """One forward, its last logits read on the host, the greedy token chosen there."""
        last = model(ids, cache=cache)[:, -1, :]
        mx.eval(last)
        return int(np.array(last.astype(mx.float32) if last.dtype == mx.bfloat16 else last, copy=True).argmax())

    def host_loop():
        cache = make_prompt_cache(model)
        tok = host_token(prompt[None], cache)
        t1 = time.perf_counter()
        for _ in range(n_new - 1):
            tok = host_token(mx.array([[tok]], mx.int32), cache)
        return (n_new - 1) / (time.perf_counter() - t1)

    own_loop()
    host_loop()
    rs, hs = [], []
    for _ in range(rounds):
        rs.append(own_loop())
        hs.append(host_loop())
    return {"ttft_ms": statistics.median(r[0] for r in rs), "tps": statistics.median(r[1] for r in rs),
            "host_tps": statistics.median(hs), "device": f"{mx.default_device()}, {'float16' if fp16 else 'checkpoint dtype'}",
            "env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fp16", action="store_true", help="run the model in float16")
    args = ap.parse_args(argv)
    if "ortmlx" in sys.modules:
        raise RuntimeError("mlx_lm_bench.py must run without ortmlx (it sets MLX's environment)")
    print(json.dumps(measure(args.hf_dir, args.prompt_len, args.new_tokens, args.rounds, args.fp16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
