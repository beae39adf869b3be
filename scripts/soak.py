"""Soak: many runs on MLX EP sessions; RSS and MLX memory must stay flat after warm-up.

Runs ``--runs`` calls round-robin over a few models (constants, dynamic batch
sizes that change every call, several groups, two outputs), checks every answer
against the CPU EP, then creates and releases ``--sessions`` sessions. Prints
one JSON line with the numbers; exit status 1 when RSS grew more than
``--max-growth`` (default 5%) after warm-up, when MLX active memory grew, or on
any wrong answer.

    python scripts/soak.py --runs 10000           # the full soak (docs/reliability.md)
    python scripts/soak.py --runs 1500 --quick    # what CI runs (tests/test_reliability_resources.py)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import mlx.core as mx
import numpy as np
from onnx import TensorProto as T
from onnx import helper as h

from ortmlx.testing import make_model, session


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def models():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    m1 = make_model([h.make_node("MatMul", ["X", "W"], ["a"]), h.make_node("Add", ["a", "B"], ["b"]),
                     h.make_node("Relu", ["b"], ["Y"]), h.make_node("Sub", ["b", "X"], ["Z"])],
                    [("X", T.FLOAT, ["n", 16])], [("Y", T.FLOAT, ["n", 16]), ("Z", T.FLOAT, ["n", 16])],
                    initializers={"W": w, "B": rng.standard_normal(16).astype(np.float32)})
    m2 = make_model([h.make_node("Mul", ["X", "X"], ["a"]), h.make_node("Neg", ["a"], ["b"]),
                     h.make_node("Add", ["b", "X"], ["Y"])],
                    [("X", T.FLOAT, ["n", 16])], [("Y", T.FLOAT, ["n", 16])])
    return [m1, m2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10000)
    ap.add_argument("--warmup", type=int, default=0, help="runs before the baseline (default runs/10)")
    ap.add_argument("--sessions", type=int, default=100, help="sessions created and released after the runs")
    ap.add_argument("--max-growth", type=float, default=0.05)
    ap.add_argument("--options", default="", help="provider options k=v,k=v")
    ap.add_argument("--quick", action="store_true", help="fewer distinct batch sizes (CI)")
    a = ap.parse_args(argv)
    opts = dict(kv.split("=", 1) for kv in a.options.split(",") if kv)
    ms = models()
    mlx_s = [session(m, options=opts, record=False) for m in ms]
    cpu_s = [session(m, "CPUExecutionProvider", record=False) for m in ms]
    sizes = [1, 2, 3, 5, 8] if a.quick else [1, 2, 3, 4, 5, 7, 8, 16, 31, 64]
    feeds = [{"X": np.random.default_rng(i).standard_normal((n, 16)).astype(np.float32)} for i, n in enumerate(sizes)]
    want = [[c.run(None, f) for f in feeds] for c in cpu_s]
    warm = a.warmup or max(1, a.runs // 10)
    wrong = 0
    t0 = time.perf_counter()
    base_rss = base_mx = None
    samples = []
    for r in range(a.runs):
        if r == warm:
            gc.collect()
            base_rss, base_mx = rss_bytes(), mx.get_active_memory()
        k, i = r % len(ms), (r // len(ms)) % len(feeds)
        got = mlx_s[k].run(None, feeds[i])
        for g, w_ in zip(got, want[k][i]):
            if not np.allclose(g, w_, rtol=1e-4, atol=1e-5):
                wrong += 1
        if r % max(1, a.runs // 20) == 0:
            samples.append(rss_bytes())
    run_s = time.perf_counter() - t0
    gc.collect()
    end_rss, end_mx = rss_bytes(), mx.get_active_memory()
    # session churn: create + run + release; memory must come back
    for j in range(a.sessions):
        s = session(ms[j % len(ms)], options=opts, record=False)
        s.run(None, feeds[j % len(feeds)])
        del s
    gc.collect()
    churn_rss, churn_mx = rss_bytes(), mx.get_active_memory()
    growth = (end_rss - base_rss) / base_rss
    churn_growth = (churn_rss - base_rss) / base_rss
    res = {"runs": a.runs, "warmup": warm, "wrong": wrong, "us_per_run": round(run_s / a.runs * 1e6, 1),
           "rss_base_mb": round(base_rss / 2**20, 1), "rss_end_mb": round(end_rss / 2**20, 1),
           "rss_growth_pct": round(100 * growth, 2), "mlx_active_base": base_mx, "mlx_active_end": end_mx,
           "sessions_churned": a.sessions, "rss_after_churn_mb": round(churn_rss / 2**20, 1),
           "rss_growth_after_churn_pct": round(100 * churn_growth, 2), "mlx_active_after_churn": churn_mx,
           "rss_samples_mb": [round(x / 2**20, 1) for x in samples], "options": opts}
    ok = (wrong == 0 and growth < a.max_growth and churn_growth < a.max_growth
          and end_mx <= base_mx + (1 << 20) and churn_mx <= base_mx + (1 << 20))
    res["ok"] = ok
    print(json.dumps(res))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
