"""What a bucketed prompt's present K/V costs on MLX's CUDA backend, built five ways, and whether managed memory
slows it.

    python scripts/managed_probe.py [--rows 4104] [--prompt 256] [--layers 24]

A bucketed prompt builds each layer's presents over genai's whole KV buffer (``rows``): ``where(keep, pad(new), 0)``.
MLX allocates arrays of 8 bytes or less (a one-element zero, ``mx.pad``'s fill value) in managed memory, and every
thread of a kernel reading one reads it there; a device array of 16 bytes or more lives in device memory. Each form,
K and V of every layer chained (GPU time per kernel from CUPTI, through torch's profiler, and wall time):

- ``pad, then where``: the zero a one-element array, ``mx.pad``'s fill a scalar (both managed);
- ``where over the new rows, then pad``: the same zeros, the select over the bucket's rows only;
- the same two with the zero (and the pad's fill) element 0 of an 8-element device array;
- ``where over the new rows, then concatenate``: the rows after the bucket an evaluated device zero block.

Then the same after MLX's buffer cache was filled with device results viewed from the host (which MLX moves to managed
memory first) of the presents' size, and after ``mx.clear_cache()``.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4104, help="the KV buffer's rows (genai's max_length)")
    ap.add_argument("--prompt", type=int, default=256, help="the bucket's rows written")
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args(argv)
    import mlx.core as mx
    import numpy as np
    import ortmlx  # noqa: F401 - the environment ortmlx sets for MLX
    from ortmlx.kernels import cuda_kernels
    if not cuda_kernels.cuda_backend():
        print("managed_probe: needs MLX's CUDA backend")
        return 1
    from torch.profiler import ProfilerActivity, profile

    shape = (1, 2, args.rows, 64)
    news = [mx.random.normal((1, 2, args.prompt, 64)).astype(mx.float16) for _ in range(2 * args.layers)]
    keep = mx.arange(args.rows).reshape(1, 1, args.rows, 1) < args.prompt - 3
    keep_s = mx.arange(args.prompt).reshape(1, 1, args.prompt, 1) < args.prompt - 3
    pooled = mx.zeros((1,), mx.float16)                 # 2 bytes: MLX's managed small pool
    device = mx.zeros((8,), mx.float16)[:1]             # a view of 16 bytes of device memory
    block = mx.zeros((1, 2, args.rows - args.prompt, 64), mx.float16)
    mx.eval(news, keep, keep_s, pooled, device, block)
    widths = [(0, 0), (0, 0), (0, args.rows - args.prompt), (0, 0)]

    def whole(zero, fill):
        return lambda *xs: [mx.where(keep, mx.pad(x, widths, constant_values=fill), zero) for x in xs]

    def rows_first(zero, fill):
        return lambda *xs: [mx.pad(mx.where(keep_s, x, zero), widths, constant_values=fill) for x in xs]

    def concat(*xs):
        return [mx.concatenate([mx.where(keep_s, x, device), block], axis=2) for x in xs]
    forms = {"pad, then where; pooled zero": mx.compile(whole(pooled, 0)),
             "where over the new rows, then pad; pooled zero": mx.compile(rows_first(pooled, 0)),
             "pad, then where; device zero": mx.compile(whole(device, device)),
             "where over the new rows, then pad; device zero": mx.compile(rows_first(device, device)),
             "where over the new rows, then concatenate; device zeros": mx.compile(concat)}
    for f in forms.values():
        mx.eval(f(*news))

    def timed(label: str) -> None:
        for form, f in forms.items():
            walls = []
            for _ in range(5):
                t = time.perf_counter()
                out = f(*news)
                mx.eval(out)
                walls.append(time.perf_counter() - t)
                del out
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                out = f(*news)
                mx.eval(out)
                del out
            ev = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
            gpu = sum(e.self_device_time_total for e in ev)
            kinds = sorted(((e.key[:34], e.count, e.self_device_time_total) for e in ev), key=lambda r: -r[2])[:3]
            print(f"{label:<13} {form:<56} wall {np.median(walls) * 1e3:6.3f} ms, GPU {gpu / 1e3:6.3f} ms  "
                  + "; ".join(f"{k} x{c}: {g:.0f} us" for k, c, g in kinds), flush=True)

    print(f"presents [1, 2, {args.rows}, 64] float16 from {args.prompt} rows, {2 * args.layers} of them", flush=True)
    timed("fresh")
    a = [mx.ones(shape, mx.float16) * (i + 1) for i in range(4 * args.layers)]
    mx.eval(a)
    for x in a:
        np.asarray(x).sum()             # MLX moves each to managed memory, read by the host
    del a
    timed("host-viewed")
    mx.clear_cache()
    timed("cache cleared")
    return 0


if __name__ == "__main__":
    sys.exit(main())
