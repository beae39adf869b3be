"""A new host's first token, taken apart: which kernel files a genai model's first generation writes, and when.

    python scripts/cold_probe.py MODEL_DIR [KEY=VALUE ...]     # MLX EP provider options, e.g. no_compile=1

Runs in fresh, empty kernel caches (``MLX_PTX_CACHE_DIR``, ``CUDA_CACHE_PATH``, ``TMPDIR``: new directories made
here), prints the load time, the first token's and the 16th's, then every kernel file written
with its time against the load's end (a gap: a build waited for alone), and cProfile's top functions of the first
token; with ``COLD_PROBE_FOR=S``, then generations (64 tokens after a 128-token prompt) one after another until
S seconds after the load, each one's first token and tokens; with ``COLD_PROBE_LOAD_PROFILE=1``, cProfile's
top functions of the load too. What it measured: docs/performance.md ("a new host's first token").
"""
import os
import sys
import tempfile

if __name__ == "__main__" and not os.environ.get("COLD_PROBE_CHILD"):
    # the caches must be empty before MLX is imported: set them and run again
    d = tempfile.mkdtemp(prefix="cold_probe_")
    env = dict(os.environ, COLD_PROBE_CHILD="1")
    for var, sub in (("MLX_PTX_CACHE_DIR", "ptx"), ("CUDA_CACHE_PATH", "cuda"), ("TMPDIR", "tmp")):
        env[var] = os.path.join(d, sub)
        os.makedirs(env[var], exist_ok=True)
    os.execve(sys.executable, [sys.executable] + sys.argv, env)

import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402

T0 = time.time()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402
import onnxruntime_genai as og  # noqa: E402

from ortmlx import genai as mg  # noqa: E402

T_IMPORTS = time.time()


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    model_dir, opts = sys.argv[1], dict(kv.split("=", 1) for kv in sys.argv[2:])
    load_prof = cProfile.Profile() if os.environ.get("COLD_PROBE_LOAD_PROFILE") else None
    if load_prof:
        load_prof.enable()
    model, _ = mg.load_model(model_dir, "mlx", opts, overlay={"model": {"context_length": 256}})
    t1 = time.time()
    if load_prof:
        load_prof.disable()
    print(f"loaded {t1 - T0:.2f} s after the process started (imports {T_IMPORTS - T0:.2f} s)", flush=True)
    if load_prof:
        out = io.StringIO()
        pstats.Stats(load_prof, stream=out).sort_stats("cumulative").print_stats(r"ortmlx|onnxruntime|mlx", 40)
        print(out.getvalue()[:8000])
    prof = cProfile.Profile()
    prof.enable()
    g = og.Generator(model, mg.search_options(model, 256, 129))
    g.append_tokens(np.random.default_rng(0).integers(100, 480, 128).astype(np.int32))
    g.generate_next_token()
    prof.disable()
    print(f"first token {time.time() - t1:.2f} s after the load (a 128-token prompt)", flush=True)
    for _ in range(15):
        g.generate_next_token()
    print(f"16th token {time.time() - t1:.2f} s after the load", flush=True)
    # MLX's CUDA kernels (and ours) under MLX_PTX_CACHE_DIR; its CPU backend's g++ libraries under $TMPDIR/mlx
    roots = (os.environ["MLX_PTX_CACHE_DIR"], os.path.join(os.environ["TMPDIR"], "mlx"))
    files = sorted((os.path.getmtime(os.path.join(r, f)), os.path.join(r, f))
                   for root in roots for r, _, fs in os.walk(root) for f in fs)
    prev = t1
    print(f"{len(files)} kernel files written (time after the load, gap since the one before):")
    for m, f in files:
        print(f"  {m - t1:+7.2f} s ({m - prev:5.2f})  {os.path.basename(f)[:110]}")
        prev = m
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    print(out.getvalue()[:4000])
    # what the user sees next: generations one after another until COLD_PROBE_FOR seconds after the load
    until = t1 + float(os.environ.get("COLD_PROBE_FOR", "0"))
    rng = np.random.default_rng(1)
    while time.time() < until:
        g = og.Generator(model, mg.search_options(model, 256, 129 + 64))
        t = time.time()
        g.append_tokens(rng.integers(100, 480, 128).astype(np.int32))
        g.generate_next_token()
        first = time.time() - t
        t = time.time()
        for _ in range(63):
            g.generate_next_token()
        print(f"  at {time.time() - t1:6.1f} s: a 128-token prompt's first token {1e3 * first:8.1f} ms, then "
              f"{1e3 * (time.time() - t) / 63:6.2f} ms a token", flush=True)
    if until > t1:
        # the builds behind the calls (a worker process's MLX kernels among them) since the listing above
        later = sorted((os.path.getmtime(os.path.join(r, f)), f) for root in roots for r, _, fs in os.walk(root)
                       for f in fs if os.path.getmtime(os.path.join(r, f)) > prev)
        print(f"{len(later)} kernel files written since:")
        for m, f in later:
            print(f"  {m - t1:+7.2f} s  {f[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
