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


def staged(drv, arrays) -> None:
    """A fresh result's read split in its steps (medians of 200, us): kernel + eval, ``np.asarray`` (MLX
    moves a device-memory buffer to managed memory here), and ``cuMemcpy`` into pageable memory vs into
    page-locked memory (``cuMemAllocHost``) followed by a host copy to the pageable destination."""
    import ctypes
    ffi, lib = drv._ffi, drv._lib
    ffi.cdef("int cuMemAllocHost_v2(void** pp, size_t n); int cuMemFreeHost(void* p);", override=True)
    pp = ffi.new("void**")
    drv._current()
    if lib.cuMemAllocHost_v2(pp, 1 << 20) != 0:
        print("cuMemAllocHost failed: no page-locked staging measured")
        return
    pinned = int(ffi.cast("uintptr_t", pp[0]))
    for name, a in arrays:
        dst = np.empty(a.nbytes, np.uint8)
        ts = {k: [] for k in ("kernel+eval", "asarray", "pageable cuMemcpy", "pinned cuMemcpy", "pinned->pageable")}
        for i in range(201):
            t0 = time.perf_counter()
            b = a + 0
            mx.eval(b)
            t1 = time.perf_counter()
            src = np.asarray(b)
            t2 = time.perf_counter()
            if i % 2:                   # which copy reads the fresh buffer first alternates
                lib.cuMemcpy(dst.ctypes.data, src.ctypes.data, src.nbytes)
                t3 = time.perf_counter()
                lib.cuMemcpy(pinned, src.ctypes.data, src.nbytes)
                t4 = time.perf_counter()
                page, pin = t3 - t2, t4 - t3
            else:
                lib.cuMemcpy(pinned, src.ctypes.data, src.nbytes)
                t3 = time.perf_counter()
                lib.cuMemcpy(dst.ctypes.data, src.ctypes.data, src.nbytes)
                t4 = time.perf_counter()
                pin, page = t3 - t2, t4 - t3
            ctypes.memmove(dst.ctypes.data, pinned, src.nbytes)
            t5 = time.perf_counter()
            if i:
                for k, v in zip(ts, (t1 - t0, t2 - t1, page, pin, t5 - t4)):
                    ts[k].append(v)
        print(f"read of {name} in steps: " + ", ".join(f"{k} {1e6 * sorted(v)[len(v) // 2]:.1f}" for k, v in ts.items())
              + " us")
    lib.cuMemFreeHost(pp[0])


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
    from ortmlx.runtime import devread
    drv = devread.reader("gpu") if mx.default_device() == mx.gpu else devread.NUMPY
    for name, a in (("24 KB", x24), ("300 KB", x300), ("324 KB", x324)):
        print(f"kernel + eval + host read {name}: %.1f us" % median_us(read_after_kernel(a)))
        if drv.driver:
            print(f"kernel + eval + host read {name} through the CUDA driver (ep/devread.py): %.1f us"
                  % median_us(read_after_kernel(a, drv)))
    print("two kernels + eval + reads of 24 KB and 300 KB: %.1f us" % median_us(two_reads))
    if drv.driver:
        staged(drv, (("24 KB", x24), ("300 KB", x300)))
    if not drv.driver:
        print("no CUDA driver reader here (MLX's CPU or Metal backend): reads are numpy copies")


if __name__ == "__main__":
    main()
