"""What host<->device traffic costs MLX on this machine: small uploads, a kernel, and host reads of
fresh device results (medians of 200). On a GPU, MLX's memory is read through page migration.

    python scripts/gpu_io_probe.py          # on a machine where MLX's default device is the GPU
"""
from __future__ import annotations

import time

import mlx.core as mx
import numpy as np


def median_us(f, n: int = 200) -> float:
    f()
    ts = []
    for _ in range(n):
        a = time.perf_counter()
        f()
        ts.append(time.perf_counter() - a)
    return 1e6 * sorted(ts)[n // 2]


def read_after_kernel(a: mx.array, reader=None):
    """A fresh device result each time (one kernel), evaluated, then copied to the host (with numpy, or
    through an ``ortmlx.ep.devread`` reader)."""
    def f():
        b = a + 0
        mx.eval(b)
        if reader is None:
            np.array(b, copy=True)
        else:
            reader.read(np.asarray(b))
    return f


def main() -> None:
    small = np.array([[5]], np.int32)
    x24, x300, x324 = (mx.zeros((k * 1024,), mx.uint8) + 1 for k in (24, 300, 324))
    mx.eval(x24, x300, x324)

    def up1():
        mx.eval(mx.array(small))

    def up3():
        mx.eval(mx.array(small), mx.array(np.array([6], np.int32)), mx.array(np.array(7, np.int32)))

    def kernel():
        mx.eval(x24 + 0)

    def two_reads():
        b, c = x24 + 0, x300 + 0
        mx.eval(b, c)
        np.array(b, copy=True)
        np.array(c, copy=True)

    print("device", mx.default_device())
    print("upload 1 small array + eval: %.1f us" % median_us(up1))
    print("upload 3 small arrays + eval: %.1f us" % median_us(up3))
    print("one tiny kernel + eval: %.1f us" % median_us(kernel))
    from ortmlx.ep import devread
    drv = devread.reader("gpu") if mx.default_device() == mx.gpu else devread.NUMPY
    for name, a in (("24 KB", x24), ("300 KB", x300), ("324 KB", x324)):
        print(f"kernel + eval + host read {name}: %.1f us" % median_us(read_after_kernel(a)))
        if drv.driver:
            print(f"kernel + eval + host read {name} through the CUDA driver (ep/devread.py): %.1f us"
                  % median_us(read_after_kernel(a, drv)))
    print("two kernels + eval + reads of 24 KB and 300 KB: %.1f us" % median_us(two_reads))
    if not drv.driver:
        print("no CUDA driver reader here (MLX's CPU or Metal backend): reads are numpy copies")


if __name__ == "__main__":
    main()
