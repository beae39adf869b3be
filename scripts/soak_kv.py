"""Soak the KV mirror: many genai generations on one model with the shared KV buffer.

Random prompts, two generators stepped in turn, random ``rewind_to`` and re-appends; every token
stream is replayed on the CPU EP with the same schedule and must be identical. Also checks that
RSS and MLX active memory stay flat after warm-up, the first third of the generations (mirrors are
dropped with their session's buffers; RSS grows while new prompt shapes are traced and compiled, then
stays: seed 5 on tiny fp16 GQA 108 -> 118 MB by generation 100, 118 MB to generation 500). Prints one JSON line; exit status 1 on any difference or growth.

    python scripts/soak_kv.py [--model models/out/qwen2-tiny-fp32] [--generations 200] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import importlib.util
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, HERE)

from ortmlx import genai as mg  # noqa: E402

SHARE = {"search": {"past_present_share_buffer": True}}


def schedule(rng, n: int, max_length: int) -> list[dict]:
    """Per generation pair: prompts, steps, and where (if anywhere) generator A rewinds."""
    out = []
    for _ in range(n):
        pa, pb = (int(x) for x in rng.integers(2, 24, 2))
        steps = int(rng.integers(4, 40))
        rewind = None
        if rng.random() < 0.5:
            rewind = (int(rng.integers(1, steps)), int(rng.integers(1, pa + 1)), int(rng.integers(1, 6)))
        out.append({"a": rng.integers(5, 500, pa).tolist(), "b": rng.integers(5, 500, pb).tolist(),
                    "steps": min(steps, max_length - 40), "rewind": rewind})
    return out


def play(og, model, s: dict, max_length: int, block: int = 1) -> list[list[int]]:
    """Both generators' streams; they take turns every ``block`` steps (1: every step)."""
    params = mg.search_options(model, max_length, 0)
    a, b = og.Generator(model, params), og.Generator(model, params)
    a.append_tokens(np.asarray(s["a"], np.int32))
    b.append_tokens(np.asarray(s["b"], np.int32))
    ta, tb = [], []
    for k0 in range(0, s["steps"], block):
        for g, t in ((a, ta), (b, tb)):
            for k in range(k0, min(k0 + block, s["steps"])):
                if g is a and s["rewind"] is not None and k == s["rewind"][0]:
                    _, keep, extra = s["rewind"]
                    a.rewind_to(keep)
                    ta.append(-1)                       # marks the rewind in the stream
                    a.append_tokens(np.arange(300, 300 + extra, dtype=np.int32))
                if not g.is_done():
                    g.generate_next_token()
                    t.append(int(g.get_next_tokens()[0]))
    return [ta, tb]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(HERE, "models", "out", "qwen2-tiny-fp32"))
    ap.add_argument("--generations", type=int, default=200)
    ap.add_argument("--max-length", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force-diff", action="store_true", help="diff even small buffers (exercise the row path)")
    ap.add_argument("--reference", choices=("cpu", "mlx-no-mirror"), default="cpu",
                    help="what the streams must equal: the CPU EP, or the MLX EP with tuning=kv_mirror=0 (for fp16 "
                         "models, whose near-tied logits may pick other tokens than the CPU EP's fp16 kernels)")
    ap.add_argument("--block", type=int, default=1,
                    help="steps each generator takes before the other's turn (> 1: steady runs of one generator, "
                         "where the next call's closure call is made ahead: ORTMLX_TUNING=call_ahead=1)")
    args = ap.parse_args(argv)
    import mlx.core as mx

    import ortmlx.compiled as C
    import onnxruntime_genai as og
    if args.force_diff:
        from ortmlx.runtime import group
        group.WHOLE_COPY_BYTES[:] = [0, 0]
    sched = schedule(np.random.default_rng(args.seed), args.generations, args.max_length)
    if args.reference == "cpu":
        cpu, _ = mg.load_model(args.model, "cpu", None, SHARE)
    else:
        cpu, _ = mg.load_model(args.model, "mlx", {"tuning": "kv_mirror=0"}, SHARE)
    mlx_model, _ = mg.load_model(args.model, "mlx", None, SHARE)
    t0 = time.time()
    wrong, tokens, warm_rss, warm_mem = 0, 0, None, None
    for i, s in enumerate(sched):
        got = play(og, mlx_model, s, args.max_length, args.block)
        want = play(og, cpu, s, args.max_length, args.block)
        tokens += sum(len(x) for x in got)
        if got != want:
            wrong += 1
            print(f"generation {i}: MLX {got} != {args.reference} {want}", file=sys.stderr)
        if i == min(max(10, len(sched) // 3), len(sched) - 1):     # after warm-up: new prompt shapes trace
            warm_rss, warm_mem = rss(), mx.get_active_memory()
    end_rss, end_mem = rss(), mx.get_active_memory()
    growth = (end_rss - warm_rss) / warm_rss if warm_rss else 0.0
    res = {"generations": len(sched), "tokens": tokens, "wrong_generations": wrong, "seconds": round(time.time() - t0, 1),
           "rss_growth_after_warmup": round(growth, 4), "mlx_active_bytes_warm": warm_mem,
           "mlx_active_bytes_end": end_mem, "force_diff": args.force_diff, "reference": args.reference,
           "block": args.block, "calls_made_ahead": C.stats().get("ahead_calls", 0)}
    print(json.dumps(res))
    return 1 if wrong or growth > 0.05 or end_mem > warm_mem * 1.05 + (1 << 20) else 0


if __name__ == "__main__":
    sys.exit(main())
