"""Host time MLX spends launching one primitive of each kind, on the device MLX picks (a GPU where there is one).

    python scripts/mlx_host_cost.py [--ops 96] [--reps 40]

Each case chains ``--ops`` primitives of one kind in an ``mx.compile``d function (each reads the last one's
result, so none is left out and none runs beside another) and times, per primitive, the host's part
(the compiled call plus ``mx.async_eval``: building the graph and encoding its kernels) and the wall time to
the result (host plus whatever GPU time the host did not hide). On MLX's CUDA backend a prompt or a decode
token is hundreds of such launches, so their host cost, not the GPU's work, sets a short call's time
(docs/performance.md). Medians of ``--reps`` calls after five warm ones.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def per_op(fn, args, ops: int, reps: int) -> tuple[float, float]:
    """(host us, wall us) per primitive of the compiled ``fn``."""
    import mlx.core as mx
    g = mx.compile(fn)
    for _ in range(5):
        mx.eval(g(*args))
    host, wall = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = g(*args)
        mx.async_eval(out)
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        host.append(t1 - t0)
        wall.append(t2 - t0)
    return 1e6 * statistics.median(host) / ops, 1e6 * statistics.median(wall) / ops


def cases(ops: int) -> dict:
    import mlx.core as mx
    import numpy as np
    rng = np.random.default_rng(0)

    def half(*shape, s=0.1):
        return mx.array((rng.standard_normal(shape) * s).astype(np.float16))

    def chain(step):
        def f(x, *rest):
            for _ in range(ops):
                x = step(x, *rest)
            return x
        return f
    out = {}
    w = half(896, 896, s=0.03)
    for m in (1, 4, 128, 512, 2048):
        out[f"product fp16 [{m}, 896] x [896, 896] (cuBLAS)"] = (chain(lambda x, w: x @ w), (half(m, 896), w))
    q, k = mx.array(rng.standard_normal((14, 128, 64)).astype(np.float32)), mx.array(
        rng.standard_normal((14, 128, 64)).astype(np.float32))
    out["two float32 batched products [14, 128, 64] (a prompt's attention)"] = (
        chain(lambda q, k: (q @ k.swapaxes(-1, -2)) @ k * 0.01), (q, k))
    x = half(128, 896, s=1.0)
    out["softmax fp16 [128, 896]"] = (chain(lambda x: mx.softmax(x, axis=-1, precise=True)), (x,))
    ones = mx.ones((896,), mx.float16)
    out["rms_norm fp16 [128, 896]"] = (chain(lambda x, g: mx.fast.rms_norm(x, g, 1e-6)), (x, ones))
    out["fused elementwise + a reduction, [128, 896]"] = (
        chain(lambda x: (x.astype(mx.float32).sum(-1, keepdims=True) + x).astype(mx.float16)), (x,))
    for s in (128, 512):
        qs, ks = half(1, 14, s, 64, s=1.0), half(1, 2, s, 64, s=1.0)
        out[f"scaled_dot_product_attention causal, S {s} (cuDNN on CUDA)"] = (
            chain(lambda q, k: mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask="causal")), (qs, ks))
    from ortmlx.kernels import cuda_kernels, cuda_rows
    for n, tag in ((896, "[896, 896]"), (151936, "[896, 151936] (an LM head)")):
        wc = half(n, 896, s=0.03).T                 # column-major [K, N], as the EP keeps weights on a GPU
        row = half(1, 1, 896)
        out[f"one row x column-major {tag}, + a slice and a scale"] = (
            chain(lambda x, w: (x @ w)[..., :896] * 0.5), (row, wc))
        if cuda_kernels.cuda_backend():
            out[f"the same through cuda_rows.gemv (a custom kernel)"] = (
                chain(lambda x, w: cuda_rows.gemv(x, w)[..., :896] * 0.5), (row, wc))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=96, help="primitives chained in each case")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args(argv)
    import mlx.core as mx
    print(f"MLX {mx.__version__}, device {mx.default_device()}; per primitive, median of {args.reps} calls")
    print(f"{'case':70s} {'host us':>8s} {'wall us':>8s}")
    for name, (fn, a) in cases(args.ops).items():
        try:
            h, w = per_op(fn, a, args.ops, args.reps)
            print(f"{name:70s} {h:8.2f} {w:8.2f}", flush=True)
        except Exception as e:  # noqa: BLE001 - a case the backend refuses is reported, the rest run
            print(f"{name:70s} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
