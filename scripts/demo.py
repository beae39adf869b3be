"""ortmlx demo: small models on the MLX EP next to ORT's CPU EP, then a tiny LLM
generating through onnxruntime-genai on MLX.

    python scripts/demo.py [--device auto|cpu|gpu] [--no-llm]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "models")]
if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, ROOT)

import ortmlx  # noqa: E402
from ortmlx.testing import assignment, session  # noqa: E402


def small_models(device: str | None) -> None:
    from models_basic import cnn, mlp, transformer_block
    rng = np.random.default_rng(0)
    opts = {"device": device} if device else {}
    for name, build, shape in (("MLP", mlp, (8, 16)), ("CNN", cnn, (2, 3, 16, 16)),
                               ("transformer block", transformer_block, (2, 16, 32))):
        model = build()
        mlx_s = session(model, options=opts)
        cpu_s = session(model, "CPUExecutionProvider", record=False)
        x = {"X": rng.standard_normal(shape).astype(np.float32)}
        got, want = mlx_s.run(None, x)[0], cpu_s.run(None, x)[0]
        on = assignment(mlx_s)
        n_mlx = sum(on.get("MLXExecutionProvider", {}).values())
        n_all = sum(sum(c.values()) for c in on.values())
        t0 = time.perf_counter()
        for _ in range(20):
            mlx_s.run(None, x)
        t_mlx = (time.perf_counter() - t0) / 20
        t0 = time.perf_counter()
        for _ in range(20):
            cpu_s.run(None, x)
        t_cpu = (time.perf_counter() - t0) / 20
        print(f"{name:18s} {n_mlx}/{n_all} nodes on MLX ({ortmlx.partition_reports()[-1].device}), "
              f"max |MLX - CPU| = {float(np.abs(got - want).max()):.2e}, "
              f"{t_mlx * 1e3:.2f} ms/run on MLX vs {t_cpu * 1e3:.2f} ms on the CPU EP")


def llm(device: str | None, n_new: int) -> None:
    try:
        import onnxruntime_genai  # noqa: F401

        import build_llm
        from ortmlx import genai as mg
    except ImportError as e:
        print(f"(LLM part skipped: {e}; `bash scripts/setup_env.sh` installs it)")
        return
    print("building the tiny random-weight Llama (cached under models/out)...")
    d = build_llm.build("llama", "fp32", "tiny")
    opts = {"device": device} if device else None
    prompt = list(range(5, 21))
    out = {}
    for prov in ("mlx", "cpu"):
        model, reports = mg.load_model(d, prov, options=opts if prov == "mlx" else None)
        if prov == "mlx":
            claimed = sum(r.n_claimed for r in reports)
            total = sum(r.n_nodes for r in reports)
            print(f"genai model: {claimed}/{total} nodes on MLX")
        t0 = time.perf_counter()
        first = mg.greedy(model, prompt, n_new)          # the first run traces/compiles on MLX
        t1 = time.perf_counter()
        out[prov] = mg.greedy(model, prompt, n_new)
        t2 = time.perf_counter()
        if out[prov] != first:
            raise SystemExit(f"{prov}: two greedy runs gave different tokens")
        print(f"  {prov:3s}: {n_new} greedy tokens: first run {1e3 * (t1 - t0):.0f} ms, second "
              f"{1e3 * (t2 - t1):.0f} ms: {out[prov][:12]}...")
    print(f"tokens identical on MLX and CPU: {out['mlx'] == out['cpu']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default=None)
    ap.add_argument("--no-llm", action="store_true")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    print(f"ortmlx {ortmlx.__version__}: library {ortmlx.register()}")
    small_models(args.device)
    if not args.no_llm:
        llm(args.device, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
