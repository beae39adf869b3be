"""Time ``cuda_recurrent.recurrence`` alone on MLX's CUDA backend: a layer's steps in one kernel.

    python scripts/recurrent_probe.py                                  # LSTM, 2 directions, B 1 and 8, H 256
    python scripts/recurrent_probe.py --cell gru --hidden 128 --blocks 8,16,32 --no-barrier

Per configuration: the median of ``--reps`` calls (launch, the kernel, ``mx.eval``) at each ``--steps`` length, and
a step's cost: (the longest's time - the second length's) / their steps. ``--blocks``: the most blocks a direction
(the kernel's ``BLOCKS_MAX``) in turn; ``--no-barrier`` adds a run whose blocks skip the barrier: wrong answers,
but the steps' arithmetic alone, so the difference is what the barrier costs. Random inputs; no answers are
checked here (``tests/test_cuda_recurrent.py`` does that).
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


def _time(rec, cell, t, d, b, h, reps):
    import mlx.core as mx
    g = rec.GATES[cell]
    xw = mx.random.normal((t, d, b, g * h))
    r = mx.random.normal((d, g * h, h)) * h ** -0.5
    h0, c0, rbh = mx.zeros((d, b, h)), mx.zeros((d, b, h)), mx.zeros((d, h))
    mx.eval(xw, r, h0, c0, rbh)

    def call():
        out = rec.recurrence(cell, xw, r, h0, c0 if cell == "lstm" else None, rbh if cell == "gru" else None, None)
        mx.eval(out[0], out[1])
    call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", default="lstm", choices=["lstm", "gru", "gru_early", "rnn"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--dirs", type=int, default=2, choices=[1, 2])
    ap.add_argument("--batch", default="1,8", help="batch sizes, comma separated")
    ap.add_argument("--steps", default="1,10,50,200", help="sequence lengths, comma separated")
    ap.add_argument("--blocks", default="", help="most blocks a direction, comma separated (default: the kernel's)")
    ap.add_argument("--no-barrier", action="store_true", help="also run without the barrier (wrong answers)")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args(argv)
    import mlx.core as mx
    import ortmlx  # noqa: F401 - the environment ortmlx sets for MLX
    from ortmlx.kernels import cuda_kernels, cuda_recurrent as rec
    if not cuda_kernels.cuda_backend():
        print("recurrent_probe: needs MLX's CUDA backend")
        return 1
    steps = [int(x) for x in a.steps.split(",")]
    base_src, base_most = rec.SOURCE, rec.BLOCKS_MAX
    barrier = "meet(sync + d * SYNC_STRIDE, ++met * gridDim.x);"
    if a.no_barrier and barrier not in base_src:
        print("recurrent_probe: the kernel's step barrier is not where --no-barrier looks for it")
        return 1
    runs = [(f"blocks {m}", m, False) for m in ([int(x) for x in a.blocks.split(",")] if a.blocks else [base_most])]
    if a.no_barrier:
        runs.append((f"blocks {runs[0][1]}, no barrier", runs[0][1], True))
    with mx.stream(mx.gpu):
        for b in (int(x) for x in a.batch.split(",")):
            for label, most, nobar in runs:
                rec.BLOCKS_MAX = most
                rec.SOURCE = base_src.replace(barrier, "__syncthreads();") if nobar else base_src
                rec._kernel_for.cache_clear()
                ms = [_time(rec, a.cell, t, a.dirs, b, a.hidden, a.reps) for t in steps]
                lo = 1 if len(steps) > 2 else 0
                step = (ms[-1] - ms[lo]) / (steps[-1] - steps[lo]) * 1e3 if len(steps) > 1 else float("nan")
                print(f"{a.cell} D {a.dirs} B {b} H {a.hidden}, {label}: T " + "/".join(map(str, steps)) + ": "
                      + " / ".join(f"{x:.3f}" for x in ms) + f" ms; a step {step:.1f} us", flush=True)
    rec.SOURCE, rec.BLOCKS_MAX = base_src, base_most
    rec._kernel_for.cache_clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
