"""Per-token decode times of a genai model on the MLX EP under several option sets.

    python scripts/decode_probe.py MODEL_DIR [--tokens 48] [--set default] [--set tuning=kv_mirror=0] ...
        [--profile default]

Each option set runs in its own process (a fresh MLX: kernel caches and compiled closures do
not carry over). Prints the first tokens' ms, the median of the last half, and with
``--profile`` a cProfile of the steady-state tokens (top functions by own time).
"""
from __future__ import annotations

import argparse
import json
import importlib.util
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, HERE)


def child(model_dir: str, opts: dict, tokens: int, profile: bool) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    from ortmlx import genai as mg
    from ortmlx.runtime import residency
    t0 = time.perf_counter()
    model, _ = mg.load_model(model_dir, "mlx", opts)
    load = time.perf_counter() - t0
    ids = np.arange(100, 107, dtype=np.int32)

    def gen(n, prof=None):
        params = mg.search_options(model, len(ids) + n, len(ids) + n)
        g = og.Generator(model, params)
        t = time.perf_counter()
        g.append_tokens(ids)
        times = [time.perf_counter() - t]
        residency.reset()
        while not g.is_done():
            t = time.perf_counter()
            if prof is not None and len(times) > n // 2:
                prof.enable()
            g.generate_next_token()
            if prof is not None:
                prof.disable()
            times.append(time.perf_counter() - t)
        return [1e3 * x for x in times], residency.snapshot()

    first, _ = gen(tokens)
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
    again, bytes_ = gen(tokens, prof)
    out = {"load_s": load, "first_run_ms": [round(x, 1) for x in first[:6]],
           "first_run_median_last_half": sorted(first[len(first) // 2:])[len(first[len(first) // 2:]) // 2],
           "second_run_ms": [round(x, 1) for x in again[:6]],
           "second_run_median_last_half": sorted(again[len(again) // 2:])[len(again[len(again) // 2:]) // 2],
           "bytes_second_run": bytes_}
    if prof is not None:
        import io
        import pstats
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        out["profile"] = s.getvalue()[-6000:]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--set", action="append", default=[], help="comma list of key=value MLX options ('default': none)")
    ap.add_argument("--profile", action="append", default=[], help="option sets to profile")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        spec = json.loads(args.child)
        print(json.dumps(child(args.model_dir, spec["opts"], args.tokens, spec["profile"])))
        return 0
    for s in args.set or ["default"]:
        opts = {} if s == "default" else dict(kv.split("=", 1) for kv in s.split(","))
        t0 = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, __file__, args.model_dir, "--tokens", str(args.tokens), "--child",
                                json.dumps({"opts": opts, "profile": s in args.profile})],
                               capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"[{s}] timed out after {args.timeout:.0f} s", flush=True)
            continue
        if r.returncode != 0:
            print(f"[{s}] failed rc={r.returncode}: {r.stderr[-1500:]}", flush=True)
            continue
        res = json.loads(r.stdout.strip().splitlines()[-1])
        prof = res.pop("profile", None)
        print(f"[{s}] {time.perf_counter() - t0:.1f} s: {json.dumps(res)}", flush=True)
        if prof:
            print(prof, flush=True)
        if "verbose" in opts:                       # the EP's session summary (per-group time split)
            print(r.stderr[-4000:], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
