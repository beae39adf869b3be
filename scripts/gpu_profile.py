"""CUDA-level profile of genai decode tokens on the MLX EP (and optionally of mlx-lm's model stepped
the same way), through PyTorch's profiler (CUPTI sees MLX's CUDA work in the same process): per token,
the CUDA API calls the host makes (CUDA graph building and launching dominate) and the GPU kernels.

    python scripts/gpu_profile.py MODEL_DIR [--hf HF_DIR] [--tokens 8] [--settle 10] [--option key=value ...]
    python scripts/gpu_profile.py --general resnet18,bert [--batch 1] [--tokens 20]
    python scripts/gpu_profile.py MODEL_DIR --prompt 128,2048 --engine cuda [--tokens 4]

``--prompt N,...``: genai prompts of N tokens instead of decode tokens (each: a new generator, ``append_tokens`` and the
first token, what TTFT times), on the MLX EP or (``--engine cuda``) ORT's CUDA EP; run both in two processes.

``--general``: models of ``models/build_general.py`` (full preset), each call of the MLX EP and of ORT's CUDA EP
(``use_tf32=0``) in turn, per call: wall time, the host's CUDA API calls and the GPU's kernels.

Needs torch with CUDA next to MLX's CUDA backend (the benchmark host has both).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import numpy as np

if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def summarize(prof, label: str, n: int, top: int = 18) -> None:
    rows = [(e.key, e.count, e.self_cpu_time_total, getattr(e, "self_device_time_total", 0))
            for e in prof.key_averages()]
    api = sorted((r for r in rows if r[0].startswith("cu") and r[2] > 0), key=lambda r: -r[2])
    print(f"\n== {label}, per call ({n} calls)\nCUDA API calls: count, host us")
    for k, c, cpu, _ in api[:14]:
        print(f"  {k:<40} {c / n:8.1f} {cpu / n:10.1f}")
    ker = sorted((r for r in rows if r[3] > 0), key=lambda r: -r[3])
    print(f"GPU activities: {sum(r[1] for r in ker) / n:.0f}, {sum(r[3] for r in ker) / n:.0f} us of GPU time; top:")
    for k, c, _, g in ker[:top]:
        print(f"  {k[:72]:<72} {c / n:7.1f} {g / n:9.1f}")


def profile_general(args) -> int:
    """``--general``: per call of each engine on each model, wall time, CUDA API calls and kernels."""
    import onnxruntime as ort
    from torch.profiler import ProfilerActivity, profile

    import ortmlx
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
    import build_general as B
    ortmlx.register(genai=False)
    mlx_opts = {"device": "gpu", **dict(o.split("=", 1) for o in args.option)}
    engines = {"MLX EP": [("MLXExecutionProvider", mlx_opts)],
               "ORT CUDA EP": [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]}
    n = args.tokens
    for name in args.general.split(","):
        path = B.build(name, "full")
        feeds = B.feeds(path, args.batch, seed=1)
        outs = {}
        for label, providers in engines.items():
            so = ort.SessionOptions()
            so.log_severity_level = 3
            s = ort.InferenceSession(path, so, providers=providers)
            for _ in range(6):                  # warm-up: traces, verification, kernel JIT
                outs[label] = s.run(None, feeds)
            t = time.perf_counter()
            for _ in range(n):
                s.run(None, feeds)
            plain = (time.perf_counter() - t) / n
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                for _ in range(n):
                    s.run(None, feeds)
                dt = (time.perf_counter() - t) / n
            print(f"\n{name} batch {args.batch}, {label}: {plain * 1e3:.3f} ms a call ({dt * 1e3:.3f} under the "
                  "profiler)")
            summarize(prof, f"{name}, {label}", n)
            del s
        a, b = outs["MLX EP"], outs["ORT CUDA EP"]
        print(f"max |MLX - CUDA EP| over outputs: {max(float(np.max(np.abs(x - y))) for x, y in zip(a, b)):.3g}")
    return 0


def profile_prompt(args) -> int:
    """``--prompt N[,N...]``: per warm prompt of N tokens on one engine, wall time, CUDA API calls and kernels."""
    import onnxruntime_genai as og
    from torch.profiler import ProfilerActivity, profile

    from ortmlx import genai as mg
    opts = {"device": "gpu", **dict(o.split("=", 1) for o in args.option)} if args.engine == "mlx" else {}
    model, _ = mg.load_model(args.model_dir, args.engine, opts)
    with open(os.path.join(args.model_dir, "genai_config.json")) as f:
        vocab = int(json.load(f)["model"]["vocab_size"])
    lengths = [int(v) for v in args.prompt.split(",")]
    max_len = max(lengths) + 8

    def ttft(ids) -> float:
        if args.clear_cache:
            import mlx.core as mx
            mx.clear_cache()
        g = og.Generator(model, mg.search_options(model, max_len))
        t = time.perf_counter()
        g.append_tokens(ids)
        g.generate_next_token()
        dt = time.perf_counter() - t
        del g
        return dt
    n = args.tokens
    for length in lengths:
        ids = np.random.default_rng(length).integers(5, min(vocab - 8, 150000), length).astype(np.int32)
        for _ in range(3):
            ttft(ids)
        if args.engine == "mlx":
            from ortmlx.kernels import background
            background.wait(600)                # the bucket's closure built and verified behind the calls
            for _ in range(3):
                ttft(ids)
        plain = sorted(ttft(ids) for _ in range(n))[n // 2]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            under = sum(ttft(ids) for _ in range(n)) / n
        print(f"\n{args.engine} prompt {length}: TTFT median {plain * 1e3:.2f} ms ({under * 1e3:.2f} under the "
              "profiler)")
        summarize(prof, f"{args.engine}, prompt {length}", n, args.top)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?")
    ap.add_argument("--general", default="", help="comma-separated build_general.py models instead of MODEL_DIR")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hf", help="also profile mlx-lm on this checkpoint (float16), stepped one token at a time")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--option", action="append", default=[], help="MLX EP option key=value")
    ap.add_argument("--prompt", default="", help="profile genai prompts of these lengths (comma list)")
    ap.add_argument("--engine", choices=("mlx", "cuda"), default="mlx", help="--prompt's engine")
    ap.add_argument("--clear-cache", action="store_true", help="--prompt: mx.clear_cache() before each prompt")
    ap.add_argument("--top", type=int, default=18, help="kernels listed")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="decode: seconds to wait after the warm-up, then 4 more warm tokens, so a closure whose fused "
                         "kernels a worker process builds is profiled, not its unfused stand-in (interim)")
    args = ap.parse_args(argv)
    if args.general:
        return profile_general(args)
    if args.prompt:
        if not args.model_dir:
            ap.error("--prompt needs MODEL_DIR")
        return profile_prompt(args)
    if not args.model_dir:
        ap.error("MODEL_DIR or --general is needed")
    import mlx.core as mx
    import onnxruntime_genai as og
    from torch.profiler import ProfilerActivity, profile

    from ortmlx import genai as mg
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    n = args.tokens
    model, _ = mg.load_model(args.model_dir, "mlx", {"device": "gpu", **dict(o.split("=", 1) for o in args.option)})
    ids = np.arange(100, 132, dtype=np.int32)
    g = og.Generator(model, mg.search_options(model, 32 + n + 24, 32 + n + 24))
    g.append_tokens(ids)
    for _ in range(12):                         # warm-up: traces, verification, kernel JIT
        g.generate_next_token()
    if args.settle > 0:
        time.sleep(args.settle)
        for _ in range(4):
            g.generate_next_token()
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(n):
            g.generate_next_token()
        dt = (time.perf_counter() - t) / n
    print(f"MLX EP: {dt * 1e3:.2f} ms per genai token under the profiler")
    summarize(prof, "MLX EP (genai)", n)
    del g, model
    if args.hf:
        from pathlib import Path

        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load_model
        lm, _ = load_model(Path(args.hf))
        lm.set_dtype(mx.float16)
        cache = make_prompt_cache(lm)
        tok = int(np.array(lm(mx.array(ids)[None], cache=cache)[0, -1]).argmax())

        def step(tok):
            last = lm(mx.array([[tok]], mx.int32), cache=cache)[0, -1]
            mx.eval(last)
            return int(np.array(last, copy=True).argmax())
        for _ in range(10):
            tok = step(tok)
        with profile(activities=acts) as prof:
            t = time.perf_counter()
            for _ in range(n):
                tok = step(tok)
            dt = (time.perf_counter() - t) / n
        print(f"\nmlx-lm: {dt * 1e3:.2f} ms per token (one step at a time, logits read on the host)")
        summarize(prof, "mlx-lm", n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
