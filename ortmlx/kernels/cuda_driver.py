"""The CUDA driver API (``libcuda.so.1`` through cffi) for what MLX does not expose.

Three users: host reads that copy a result where it lies (``runtime/devread.py``); page-locked host
memory mapped into the GPU's address space (``HostBuffer``), which a kernel writes and the host
reads after ``mx.eval`` without any copy call (the compiled decode's row hints, ``compiled/core.py``);
and ORT's own output buffers page-locked and mapped for one call (``Driver.register``), which a kernel
writes straight into (large results: ``devread.DriverReader.write_result``).
"""
from __future__ import annotations

import threading
import weakref

import numpy as np

CDEF = """
int cuInit(unsigned int flags);
int cuCtxGetCurrent(void** pctx);
int cuCtxSetCurrent(void* ctx);
int cuDeviceGet(int* device, int ordinal);
int cuDevicePrimaryCtxRetain(void** pctx, int dev);
int cuMemcpy(unsigned long long dst, unsigned long long src, size_t n);
int cuMemHostAlloc(void** pp, size_t bytesize, unsigned int flags);
int cuMemHostGetDevicePointer_v2(unsigned long long* pdptr, void* p, unsigned int flags);
int cuMemFreeHost(void* p);
int cuCtxSynchronize(void);
int cuCtxGetFlags(unsigned int* flags);
int cuMemGetInfo_v2(size_t* free, size_t* total);
int cuDeviceGetAttribute(int* pi, int attrib, int dev);
"""

#: cuDeviceGetAttribute: the device's streaming multiprocessors
ATTRIBUTE_MULTIPROCESSOR_COUNT = 16

#: the context's scheduling bits (``cuCtxGetFlags``): how a host thread waits for the GPU
CTX_SCHED_MASK = 0x07
CTX_SCHED_BLOCKING_SYNC = 0x04

#: cuMemHostAlloc flags: usable from every context, mapped into the device's address space
MEMHOSTALLOC_PORTABLE = 0x01
MEMHOSTALLOC_DEVICEMAP = 0x02


class DriverError(RuntimeError):
    pass


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise DriverError(f"{what} failed with CUresult {rc}")


class Driver:
    """A driver library (the real one, or a test's stand-in with the same functions) and the
    context its calls need on the calling thread."""

    def __init__(self, lib, ffi):
        self.lib, self.ffi = lib, ffi
        self._tls = threading.local()
        self._ctx = None

    def current(self) -> None:
        """Make a CUDA context current on this thread (MLX's threads have the primary one already)."""
        p = getattr(self._tls, "p", None)
        if p is None:
            p = self._tls.p = self.ffi.new("void**")
        if self.lib.cuCtxGetCurrent(p) == 0 and p[0] != self.ffi.NULL:
            return
        if self._ctx is None:                   # retained for the life of the process (as MLX keeps it)
            dev, ctx = self.ffi.new("int*"), self.ffi.new("void**")
            check(self.lib.cuDeviceGet(dev, 0), "cuDeviceGet")
            check(self.lib.cuDevicePrimaryCtxRetain(ctx, dev[0]), "cuDevicePrimaryCtxRetain")
            self._ctx = ctx[0]
        check(self.lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def memcpy(self, dst: int, src: int, n: int) -> None:
        self.current()
        check(self.lib.cuMemcpy(dst, src, n), "cuMemcpy")

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device's memory, as the driver counts them (every process's use)."""
        self.current()
        f, t = self.ffi.new("size_t*"), self.ffi.new("size_t*")
        check(self.lib.cuMemGetInfo_v2(f, t), "cuMemGetInfo")
        return int(f[0]), int(t[0])

    def multiprocessors(self) -> int:
        """The streaming multiprocessors of device 0 (MLX's), as this process sees it (a MIG slice: the slice's)."""
        self.current()
        n, dev = self.ffi.new("int*"), self.ffi.new("int*")
        check(self.lib.cuDeviceGet(dev, 0), "cuDeviceGet")
        check(self.lib.cuDeviceGetAttribute(n, ATTRIBUTE_MULTIPROCESSOR_COUNT, dev[0]), "cuDeviceGetAttribute")
        return int(n[0])

    def spins(self) -> bool:
        """Whether a context synchronize on this thread waits by polling (the context's scheduling is not
        blocking sync: CUDA's default, spin or yield, with fewer active contexts than cores)."""
        self.current()
        f = self.ffi.new("unsigned int*")
        return self.lib.cuCtxGetFlags(f) == 0 and (f[0] & CTX_SCHED_MASK) != CTX_SCHED_BLOCKING_SYNC

    def synchronize(self) -> int:
        """Wait for all the context's launched work (the CUresult; an error is also MLX's to report)."""
        self.current()
        return self.lib.cuCtxSynchronize()


class HostBuffer:
    """``nbytes`` of page-locked host memory mapped into the device: ``device_address`` for kernels,
    ``array`` (uint8) for the host. Read it only after the kernels that write it have finished
    (``mx.eval`` of their outputs waits for them). Freed when the object goes (not at exit)."""

    def __init__(self, drv: Driver, nbytes: int):
        if nbytes <= 0:
            raise ValueError(f"HostBuffer needs a positive size, got {nbytes}")
        lib, ffi = drv.lib, drv.ffi
        drv.current()
        p = ffi.new("void**")
        check(lib.cuMemHostAlloc(p, nbytes, MEMHOSTALLOC_PORTABLE | MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc")
        host = p[0]
        fin = weakref.finalize(self, _free, drv, host)
        fin.atexit = False                      # the driver may be gone at exit; the process frees it anyway
        d = ffi.new("unsigned long long*")
        try:
            check(lib.cuMemHostGetDevicePointer_v2(d, host, 0), "cuMemHostGetDevicePointer")
        except DriverError:
            fin()
            raise
        self.nbytes = nbytes
        self.device_address = int(d[0])
        self.host_address = int(ffi.cast("uintptr_t", host))
        self.array = np.frombuffer(ffi.buffer(host, nbytes), np.uint8)
        self._fin = fin

    def free(self) -> None:
        self._fin()


def _free(drv: Driver, host) -> None:
    try:
        drv.current()
        drv.lib.cuMemFreeHost(host)
    except Exception:  # noqa: BLE001 - a finalizer: nothing to report to
        pass


_lock = threading.Lock()
_driver: list = []          # [Driver or None] once opened


def driver() -> Driver | None:
    """The real driver when MLX runs on CUDA and ``libcuda.so.1`` initialises, else None."""
    with _lock:
        if not _driver:
            _driver.append(_open())
        return _driver[0]


def _open() -> Driver | None:
    try:
        import mlx.core as mx
        if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
            return None
        import cffi
        ffi = cffi.FFI()
        ffi.cdef(CDEF)
        lib = ffi.dlopen("libcuda.so.1")
        check(lib.cuInit(0), "cuInit")
        return Driver(lib, ffi)
    except Exception:  # noqa: BLE001 - no driver: callers take their plain paths
        return None
