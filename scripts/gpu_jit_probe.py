"""Does a compiled MLX closure pay a kernel build per new input shape on this device?

    python scripts/gpu_jit_probe.py

Times a shapeless ``mx.compile`` elementwise+reduce chain called with a growing length (what a
decode step sees: the attention mask grows by one each token) against the same length
repeated, and the uncompiled chain. Milliseconds per call, first calls and medians.
"""
from __future__ import annotations

import statistics
import time

import mlx.core as mx


def chain(x, w):
    y = mx.sigmoid(x * w + 1.0) * x
    return y.sum(axis=-1), (y * 2).astype(mx.float16)


def timed(fn, sizes, w):
    out = []
    for n in sizes:
        x = mx.random.normal((1, n))
        mx.eval(x)
        t = time.perf_counter()
        mx.eval(*fn(x, w))
        out.append(1e3 * (time.perf_counter() - t))
    return out


def main() -> None:
    print(f"mlx {mx.__version__} on {mx.default_device()}")
    w = mx.array(0.5)
    for label, fn, sizes in (("uncompiled, growing", chain, range(200, 232)),
                             ("shapeless, growing", mx.compile(chain, shapeless=True), range(300, 332)),
                             ("shape-keyed, growing", mx.compile(chain), range(400, 432)),
                             ("shape-keyed, fixed", mx.compile(chain), [500] * 32)):
        ms = timed(fn, sizes, w)
        print(f"{label:<22} first {ms[0]:8.2f} ms, then median {statistics.median(ms[1:]):8.3f} ms, "
              f"max {max(ms[1:]):8.2f} ms")


if __name__ == "__main__":
    main()
