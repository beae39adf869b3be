"""What host<->device traffic costs MLX on this machine: small uploads, a kernel, and host reads of
fresh device results (medians of 200). On a GPU, MLX's memory is read through page migration.

    python scripts/gpu_io_probe.py          # on a machine where MLX's default device is the GPU
    python scripts/gpu_io_probe.py --large 39,155,622   # reads of prompt-sized logits (MB), each way there is

``--large``: a fresh result of that many MB (one kernel) read into a fresh host buffer, as ORT hands an EP a
new output buffer for each prompt, by each route: ``np.asarray`` and the driver's copy (what a read over
``HOST_OUT_MAX`` does), a kernel writing page-locked memory then a host copy (what a smaller one does; one
thread and several), and a kernel writing the destination itself once it is registered (``cuMemHostRegister``);
also what first-touching the fresh pages costs alone. Medians of 7, ms and GB/s.

``--upload``: a host input of that many MB (a kept buffer, as ORT's arena hands an EP its inputs) onto the
device and consumed by one kernel, by each route: ``mx.array`` (MLX's copy into its own memory) and a host copy
into page-locked staging (1 thread / the copy threads) followed by a kernel reading it
(``cuda_kernels.copy_from_address``); the consuming kernel alone beside them. Medians of 15, ms and GB/s.
"""
from __future__ import annotations

import statistics
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
    ffi, lib = drv.ffi, drv.lib
    ffi.cdef("int cuMemAllocHost_v2(void** pp, size_t n);", override=True)
    pp = ffi.new("void**")
    drv.current()
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


def large_reads(drv, sizes_mb: list[float], reps: int = 7) -> None:
    """Reads of large fresh results into fresh host buffers, route by route (see the module's docstring)."""
    from concurrent.futures import ThreadPoolExecutor

    from ortmlx.kernels import cuda_driver, cuda_kernels
    ffi, lib = drv.ffi, drv.lib
    ffi.cdef("int cuMemHostRegister_v2(void* p, size_t n, unsigned int flags); int cuMemHostUnregister(void* p);",
             override=True)
    pool = ThreadPoolExecutor(8)

    def par_copy(dst, src, k=8):
        step = -(-dst.size // k)
        list(pool.map(lambda i: np.copyto(dst[i:i + step], src[i:i + step]), range(0, dst.size, step)))

    for mb in sizes_mb:
        n = int(mb * (1 << 20)) // 16 * 16
        a = mx.zeros((n // 2,), mx.float16) + 1
        mx.eval(a)
        sink = cuda_driver.HostBuffer(drv, n)
        addr = mx.array([sink.device_address], dtype=mx.uint64)
        ts: dict = {}

        def timed(name, f):
            t = time.perf_counter()
            r = f()
            ts.setdefault(name, []).append(time.perf_counter() - t)
            return r

        for _ in range(reps):
            b = a + 0
            timed("kernel+eval", lambda: mx.eval(b))
            dst = np.empty(n, np.uint8)
            timed("first touch of a fresh buffer (memset)", lambda: dst.fill(0))
            dst = None
            # today above HOST_OUT_MAX: np.asarray (MLX moves the buffer to managed memory) + the driver's copy
            b = a + 0
            mx.eval(b)
            dst = np.empty(n, np.uint8)
            src = timed("asarray", lambda: np.asarray(b).view(np.uint8).reshape(-1))
            timed("driver copy managed->fresh", lambda: drv.memcpy(dst.ctypes.data, src.ctypes.data, n))
            dst = src = b = None
            # today up to HOST_OUT_MAX: a kernel writes page-locked memory, Compute copies it out
            b = a + 0
            timed("kernel+copy kernel->pinned", lambda: mx.eval(cuda_kernels.copy_to_host(b, addr)))
            dst = np.empty(n, np.uint8)
            timed("pinned->fresh, 1 thread", lambda: np.copyto(dst, sink.array))
            dst = np.empty(n, np.uint8)
            timed("pinned->fresh, 8 threads", lambda: par_copy(dst, sink.array))
            timed("pinned->warm, 8 threads", lambda: par_copy(dst, sink.array))
            # a kernel writing the destination itself
            for label, dst in (("fresh", np.empty(n, np.uint8)), ("warm", dst)):
                p = ffi.cast("void*", dst.ctypes.data)
                b = a + 0
                mx.eval(b)
                rc = timed(f"register {label}", lambda: lib.cuMemHostRegister_v2(p, n, 0x02))
                if rc != 0:
                    ts.setdefault(f"register {label} failed: CUresult {rc}", [0.0])
                    continue
                d = ffi.new("unsigned long long*")
                lib.cuMemHostGetDevicePointer_v2(d, p, 0)
                to = mx.array([int(d[0])], dtype=mx.uint64)
                timed(f"copy kernel->{label} registered", lambda: mx.eval(cuda_kernels.copy_to_host(b, to)))
                timed(f"unregister {label}", lambda: lib.cuMemHostUnregister(p))
                ok = bool(np.all(dst.view(np.float16)[:: max(1, n // 2 // 4096)] == 1))
                ts.setdefault(f"{label} registered copy correct: {ok}", [0.0])
            dst = None
        sink.free()
        print(f"read of a fresh {mb:g} MB result ({n} bytes), medians of {reps}:")
        for k, v in ts.items():
            ms = 1e3 * statistics.median(v)
            print(f"  {k:<42} {ms:9.2f} ms" + (f"  {n / ms / 1e6:7.2f} GB/s" if ms > 0 else ""))
    pool.shutdown()


def uploads(drv, sizes_mb: list[float], reps: int = 15) -> None:
    """Host inputs onto the device, route by route (see the module's docstring)."""
    from ortmlx.kernels import cuda_driver, cuda_kernels
    from ortmlx.runtime.upload import Stage
    for mb in sizes_mb:
        n = int(mb * (1 << 20)) // 16 * 16
        host = (np.arange(n // 4, dtype=np.float32) % 977).astype(np.float32)
        stage = Stage(drv, n, cuda_driver.HostBuffer)
        dev = mx.array(host)
        mx.eval(dev)
        ts: dict = {}

        def timed(name, f):
            t = time.perf_counter()
            f()
            ts.setdefault(name, []).append(time.perf_counter() - t)

        def staged(threads):
            x = stage.fill(host.ctypes.data, n, cuda_kernels.copy_from_address, threads=threads > 1).view(mx.float32)
            mx.eval(x + 1)

        ok = []
        for i in range(reps + 1):
            timed("kernel alone (x + 1 on the device)", lambda: mx.eval(dev + 1))
            timed("mx.array + kernel", lambda: mx.eval(mx.array(host) + 1))
            timed("staging 1 thread + copy kernel + kernel", lambda: staged(1))
            timed("staging threads + copy kernel + kernel", lambda: staged(8))
            if i == 0:
                got = np.array(stage.fill(host.ctypes.data, n, cuda_kernels.copy_from_address).view(mx.float32))
                ok.append(bool(np.array_equal(got, host)))
                ts.clear()
        stage.free()
        print(f"upload of a {mb:g} MB input ({n} bytes), medians of {reps}; staged copy equal: {ok[0]}")
        for k, v in ts.items():
            ms = 1e3 * statistics.median(v)
            print(f"  {k:<42} {ms:9.3f} ms" + (f"  {n / ms / 1e6:7.2f} GB/s" if ms > 0 else ""))


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--large", default="", help="comma list of MB: only the large reads")
    ap.add_argument("--upload", default="", help="comma list of MB: only the uploads of host inputs")
    args = ap.parse_args()
    for sizes, measure in ((args.upload, uploads), (args.large, large_reads)):
        if sizes:
            from ortmlx.kernels import cuda_driver
            drv = cuda_driver.driver()
            if drv is None:
                print("no CUDA driver (MLX's CPU or Metal backend): nothing to measure")
                return
            measure(drv, [float(x) for x in sizes.split(",")])
            return
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
            print(f"kernel + eval + host read {name} through the CUDA driver (runtime/devread.py): %.1f us"
                  % median_us(read_after_kernel(a, drv)))
    print("two kernels + eval + reads of 24 KB and 300 KB: %.1f us" % median_us(two_reads))
    if drv.driver:
        staged(drv, (("24 KB", x24), ("300 KB", x300)))
    if not drv.driver:
        print("no CUDA driver reader here (MLX's CPU or Metal backend): reads are numpy copies")


if __name__ == "__main__":
    main()
