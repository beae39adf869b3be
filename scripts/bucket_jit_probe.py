"""Which kernels a new prefill bucket builds, and what its first calls cost (MLX's CUDA backend).

    python scripts/bucket_jit_probe.py MODEL_DIR [--max-length 4104] [--prompts 300,1500] [--option k=v ...]
        [--profile N]

Loads a genai model on the MLX EP, warms one bucket (a 100-token prompt, twice), then for each prompt length
in turn: the kernels MLX's cache (``MLX_PTX_CACHE_DIR``) gains during its first call and during a second
prompt of the same bucket (which verifies the bucket's closure), each call's time, and a warm call's. A
kernel built per bucket shows up here by name; one built once shows up nowhere after the warm-up.
``--profile N``: each first and verifying call under cProfile, its N most expensive ortmlx functions
(cumulative ms): where a new bucket's time goes (eager answer, host analysis, trace, the closure's first run).
"""
from __future__ import annotations

import argparse
import cProfile
import importlib.util
import os
import pstats
import sys
import time

if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def listing(root: str) -> dict:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            try:
                out[os.path.relpath(p, root)] = os.path.getsize(p)
            except OSError:
                pass
    return out


def top(prof, n: int) -> None:
    """The ``n`` ortmlx functions with the largest cumulative time in ``prof`` (ms, calls)."""
    rows = []
    for (file, line, name), (_cc, nc, _tt, ct, _callers) in pstats.Stats(prof).stats.items():
        if f"{os.sep}ortmlx{os.sep}" in file:
            rows.append((ct, nc, f"{os.path.relpath(file, os.path.dirname(os.path.dirname(file)))}:{line} {name}"))
    for ct, nc, where in sorted(rows, reverse=True)[:n]:
        print(f"    {1e3 * ct:9.1f} ms {nc:6d}x  {where}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--max-length", type=int, default=4104)
    ap.add_argument("--prompts", default="300,1500")
    ap.add_argument("--option", action="append", default=[], help="MLX EP option key=value")
    ap.add_argument("--profile", type=int, default=0, help="first/verifying calls profiled: top N ortmlx functions")
    args = ap.parse_args(argv)
    import numpy as np
    import onnxruntime_genai as og

    import ortmlx  # noqa: F401  (sets MLX_PTX_CACHE_DIR before MLX builds a kernel)
    from ortmlx import genai as mg
    cache = os.environ.get("MLX_PTX_CACHE_DIR", "")
    print(f"kernel cache: {cache or '(MLX default)'}")
    model, _ = mg.load_model(args.model_dir, "mlx", dict(o.split("=", 1) for o in args.option))
    rng = np.random.default_rng(0)

    def prompt(n: int) -> float:
        g = og.Generator(model, mg.search_options(model, args.max_length, args.max_length))
        t = time.perf_counter()
        g.append_tokens(rng.integers(100, 480, n).astype(np.int32))
        g.generate_next_token()
        return time.perf_counter() - t

    for n in (100, 90, 100):
        print(f"warm-up prompt {n}: {1e3 * prompt(n):.1f} ms")
    for n in (int(x) for x in args.prompts.split(",") if x):
        for label, m in (("first", n), ("second (verify)", n - n // 8), ("warm", n), ("warm", n - n // 8)):
            before = listing(cache) if cache else {}
            prof = cProfile.Profile() if args.profile and label != "warm" else None
            if prof is not None:
                prof.enable()
            ms = 1e3 * prompt(m)
            if prof is not None:
                prof.disable()
            new = {k: v for k, v in (listing(cache) if cache else {}).items() if k not in before}
            print(f"prompt {m} ({label}): {ms:.1f} ms, {len(new)} new kernel file(s), {sum(new.values())} bytes")
            for k in sorted(new):
                print(f"    {k}  ({new[k]} bytes)")
            if prof is not None:
                top(prof, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
