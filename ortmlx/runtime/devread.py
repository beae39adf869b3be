"""Host reads of evaluated MLX results: through the CUDA driver's copy on MLX's CUDA backend.

MLX's CUDA memory is managed (unified) memory: ``np.asarray`` of a result is a zero-copy view,
but reading that view from the CPU migrates its pages to the host, and the next kernel that
reuses the buffer faults them back to the GPU. ``cuMemcpy`` copies the bytes where they lie and
migrates nothing (``scripts/gpu_io_probe.py``; measured: docs/performance.md, ``driver_read``). Elsewhere (MLX's CPU or Metal backends, no
CUDA driver, ``driver_read=0``) a read is a plain numpy copy.

Every read goes through ``Reader.copyto`` / ``Reader.read``; a source is the host view of an
evaluated MLX array (``dtypes.to_numpy``), which MLX returns only once the array is computed.

Large results skip the host view: ``write_result`` has a kernel write the result's bytes into a
page-locked staging buffer (``cuda_kernels.copy_to_address``), then host threads copy them into ORT's
output buffer, whose fresh pages other threads fault in ahead of the copy (``prefault``: faulting them in by
the copy itself was most of its time). Results larger than ``STAGE_CHUNK``
go through two such buffers in turn, the kernel filling one while the threads empty the other. Both are made
once, at their full size, by the first large result: a new prompt length allocates no page-locked memory
(hundreds of ms for a 4,096-token prompt's logits, tens for a few hundred tokens').
A host view of a device buffer first makes MLX copy it into managed memory, whose pages then migrate
as they are read: a prompt's logits (1.2 GB at 4,096 tokens) cost most of the prompt that way.
Page-locking ORT's buffer for the kernel instead costs more than the copy
(``scripts/gpu_io_probe.py --large``; docs/performance.md).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from ..kernels import cuda_kernels
from ..kernels.dtypes import to_numpy
from ..kernels.cuda_driver import Driver, DriverError, HostBuffer
from ..kernels.cuda_driver import driver as _open_driver
from ..tuning import Tuning


#: the bytes each of the two staging buffers holds; larger results take both, alternately
STAGE_CHUNK = 64 << 20
#: threads of a large host copy, and the least bytes each is given
COPY_THREADS = max(1, min(8, os.cpu_count() or 1))
_COPY_CHUNK_MIN = 1 << 20
_pool: list = []            # [ThreadPoolExecutor] once a copy needs one
_pool_lock = threading.Lock()
_PAGE = mmap.PAGESIZE
#: madvise(2)'s MADV_POPULATE_WRITE (Linux 5.14): pages faulted in writable, their contents unchanged
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_fault_pool: list = []      # [ThreadPoolExecutor]: prefault's threads, apart from the copy's


def _lazy_pool(holder: list, workers: int, prefix: str) -> ThreadPoolExecutor:
    """The pool ``holder`` keeps, made on first use."""
    with _pool_lock:
        if not holder:
            holder.append(ThreadPoolExecutor(workers, thread_name_prefix=prefix))
        return holder[0]


def _slice_bytes(n: int, k: int) -> int:
    """Bytes of each of ``k`` slices of ``n`` bytes, in whole pages (the last slice takes what is left)."""
    per = -(-n // k)
    return -(-per // _PAGE) * _PAGE


def populate(addr: int, n: int) -> bool:
    """Fault the pages of host memory [addr, addr + n) in, writable, their bytes unchanged (``MADV_POPULATE_WRITE``);
    False where the kernel lacks it."""
    lo = addr & ~(_PAGE - 1)
    return _libc.madvise(lo, addr + n - lo, _MADV_POPULATE_WRITE) == 0


def _populate_works() -> bool:
    m = mmap.mmap(-1, 2 * _PAGE)
    view = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(view)
    del view                        # (no export left when the map closes)
    try:
        return populate(addr, 2 * _PAGE)
    finally:
        m.close()


#: whether this kernel populates pages on request (else ``prefault`` does nothing)
POPULATE = _populate_works()


def prefault(addr: int, n: int, chunk: int, futures: list) -> None:
    """``populate`` of [addr, addr + n) on threads of their own, ``chunk`` bytes at a time in address order (the order
    the copy goes in), each cut into page-sized slices of at least 1 MiB; their futures are appended to ``futures``
    as they are made (nothing where the kernel has no populate). The copy never waits for them: populating changes
    no byte, so either may reach a page first."""
    if not POPULATE:
        return
    pool = _lazy_pool(_fault_pool, COPY_THREADS, "ortmlx-fault")
    for c in range(0, n, chunk):
        m = min(chunk, n - c)
        step = _slice_bytes(m, max(1, min(COPY_THREADS, m // _COPY_CHUNK_MIN)))
        for i in range(0, m, step):
            futures.append(pool.submit(populate, addr + c + i, min(step, m - i)))


def _settle(futures: list) -> None:
    """Wait for every future (an exception in one is its own business: populating is only a speed-up)."""
    for f in futures:
        f.exception()


def parallel_memmove(dst: int, src: int, n: int, threads: int = COPY_THREADS) -> None:
    """Copy ``n`` bytes from host address ``src`` to ``dst`` on up to ``threads`` threads."""
    parallel_copies([(dst, src, n)], threads)


def parallel_copies(jobs: list[tuple[int, int, int]], threads: int = COPY_THREADS) -> None:
    """Do every host copy (destination address, source address, bytes) of ``jobs`` (non-overlapping), cut into
    up to ``threads`` shares of whole pages and at least 1 MiB each (``ctypes.memmove`` releases the GIL); the
    last share runs on the calling thread. A fresh destination's page faults are spread over the threads too."""
    total = sum(n for _, _, n in jobs)
    k = max(1, min(threads, total // _COPY_CHUNK_MIN))
    if k == 1:
        _copies(jobs)
        return
    share = _slice_bytes(total, k)
    parts, part, room = [], [], share
    for d, s, n in jobs:
        while n:
            m = min(n, room)
            part.append((d, s, m))
            d, s, n, room = d + m, s + m, n - m, room - m
            if not room:
                parts.append(part)
                part, room = [], share
    if part:
        parts.append(part)
    pool = _lazy_pool(_pool, max(1, COPY_THREADS - 1), "ortmlx-copy")
    futs = [pool.submit(_copies, p) for p in parts[:-1]]
    _copies(parts[-1])
    for f in futs:
        f.result()


def _copies(jobs) -> None:
    for d, s, n in jobs:
        ctypes.memmove(d, s, n)


class Reader:
    """Plain numpy reads (MLX's CPU or Metal backends, or the driver path turned off)."""

    driver = False

    def copyto(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy ``src`` (a host view of an MLX result) into ``dst`` (same shape and type)."""
        np.copyto(dst, src)

    def copy_to_address(self, ptr, src: np.ndarray, ffi) -> None:
        """Copy ``src`` into ``src.nbytes`` bytes of host memory at ``ptr`` (a cffi pointer: ORT's output buffer):
        one ``memmove`` when ``src`` is row-major plain data (no view of the destination to make), else element by
        element (an object array, which no MLX result is, is refused there rather than its pointers copied)."""
        if src.flags.c_contiguous and not src.dtype.hasobject:
            ffi.memmove(ptr, src, src.nbytes)
        else:
            np.copyto(np.frombuffer(ffi.buffer(ptr, src.nbytes), src.dtype).reshape(src.shape), src)

    def copy_result(self, ptr, r: mx.array, ffi) -> None:
        """Copy evaluated MLX result ``r`` (not empty) into ``r.nbytes`` bytes of host memory at ``ptr`` (ORT's output
        buffer): one ``memmove`` from MLX's own buffer when it is row-major (no NumPy view made), else as
        ``copy_to_address`` copies its host view."""
        mv = memoryview(r)
        if mv.c_contiguous:
            ffi.memmove(ptr, mv, mv.nbytes)
        else:
            self.copy_to_address(ptr, to_numpy(r), ffi)

    def read(self, src: np.ndarray) -> np.ndarray:
        """A private host copy of ``src``."""
        return np.array(src, copy=True)

    def direct(self, nbytes: int) -> bool:
        """Whether ``write_result`` takes a result of ``nbytes`` (else the caller reads it to the host)."""
        return False

    def write_result(self, addr: int, r: mx.array) -> bool:
        """Write MLX result ``r`` (row-major bytes, ``r.nbytes`` of them) into host memory at ``addr``;
        False when it could not (nothing written that the caller may rely on: it copies as usual)."""
        return False


class DriverReader(Reader):
    """Reads through ``cuMemcpy`` (contiguous sources; anything else falls back to numpy)."""

    driver = True

    def __init__(self, drv: Driver, copier=None, prefault: bool = True):
        self._drv = drv
        #: ``_write`` has the destination's pages faulted in ahead of its copy (``prefault``)
        self.prefault = prefault
        self.copies = 0
        self.failed = 0         # driver errors seen: after 3, every read is numpy's
        #: (result, [device address, bytes] uint64) -> the one byte ordering the copy's kernel (tests: a stand-in)
        self._copier = copier
        self.direct_writes = 0
        self.direct_failed = 0  # after 3, no direct write is tried
        self._stage: list = []          # [HostBuffer]: the staging buffers (``_staging``)
        self._stage_lock = threading.Lock()

    def _copy(self, dst_addr: int, src: np.ndarray) -> bool:
        """cuMemcpy; False (nothing to rely on: the caller copies with numpy) if the driver refused."""
        try:
            self._drv.memcpy(dst_addr, src.ctypes.data, src.nbytes)
        except DriverError:
            self.failed += 1
            return False
        self.copies += 1
        return True

    def _plain(self, src: np.ndarray) -> bool:
        return src.nbytes > 0 and src.flags.c_contiguous and self.failed < 3

    def copyto(self, dst: np.ndarray, src: np.ndarray) -> None:
        if not (self._plain(src) and dst.flags.c_contiguous and dst.dtype == src.dtype and dst.shape == src.shape
                and self._copy(dst.ctypes.data, src)):
            np.copyto(dst, src)

    def copy_to_address(self, ptr, src: np.ndarray, ffi) -> None:
        if not (self._plain(src) and self._copy(int(ffi.cast("uintptr_t", ptr)), src)):
            super().copy_to_address(ptr, src, ffi)

    def copy_result(self, ptr, r: mx.array, ffi) -> None:
        self.copy_to_address(ptr, to_numpy(r), ffi)     # (the driver's copy reads MLX's memory where it lies)

    def direct(self, nbytes: int) -> bool:
        return nbytes >= cuda_kernels.DIRECT_MIN and self.direct_failed < 3 and \
            (self._copier is not None or cuda_kernels.usable())

    def write_result(self, addr: int, r: mx.array) -> bool:
        n = int(r.nbytes)
        return bool(n) and self.direct(n) and self._write(addr, r, n)

    def _write(self, addr: int, r: mx.array, n: int, chunk: int = 0) -> bool:
        """``write_result``'s copy; ``chunk``: bytes a staging buffer holds (default ``STAGE_CHUNK``; the driver's
        self-test takes a small one to run the two-buffer path)."""
        copy = self._copier or cuda_kernels.copy_to_address
        chunk = chunk or STAGE_CHUNK
        faults: list = []
        with self._stage_lock:          # one set of staging buffers per process: sessions on other threads wait
            try:
                stages = self._staging(n, chunk)
                flat, item = r.reshape(-1), r.dtype.size
                per = chunk // item                         # elements a chunk (every buffer holds them)
                cuts = list(range(0, r.size, per))

                def launch(k: int):
                    s = cuts[k]
                    e = min(s + per, r.size)
                    buf = stages[k % len(stages)]
                    part = flat if e - s == r.size else flat[s:e]
                    done = copy(part, mx.array([buf.device_address, (e - s) * item], dtype=mx.uint64))
                    mx.async_eval(done)
                    return done, buf, s * item, (e - s) * item
                nxt = launch(0)
                if self.prefault:
                    prefault(addr, n, per * item, faults)
                for k in range(len(cuts)):
                    done, buf, off, m = nxt
                    mx.eval(done)                           # this chunk's kernel has finished
                    nxt = launch(k + 1) if k + 1 < len(cuts) else None   # the next fills the other buffer
                    parallel_memmove(addr + off, buf.host_address, m)
            except Exception:  # noqa: BLE001 - any failure: the caller copies through the host as usual
                self.direct_failed += 1
                return False
            finally:
                _settle(faults)                             # (nothing of this call left running after it)
        self.direct_writes += 1
        return True

    def _staging(self, n: int, chunk: int) -> list[HostBuffer]:
        """The staging buffers for ``n`` bytes: the first when ``n <= chunk``, else both. Both are made at ``chunk``
        bytes by the first direct write and kept, so no later result allocates page-locked memory: growing them to
        each new size cost a new prompt length's first call 18-80 ms on an H100 (docs/performance.md)."""
        for i in range(2):
            b = self._stage[i] if i < len(self._stage) else None
            if b is not None and b.nbytes >= chunk:
                continue
            if b is not None:
                b.free()
                self._stage[i] = None
            nb = HostBuffer(self._drv, chunk)
            if i < len(self._stage):
                self._stage[i] = nb
            else:
                self._stage.append(nb)
        return self._stage[:1 if n <= chunk else 2]

    def read(self, src: np.ndarray) -> np.ndarray:
        if not self._plain(src):
            return np.array(src, copy=True)
        out = np.empty(src.shape, src.dtype)
        return out if self._copy(out.ctypes.data, src) else np.array(src, copy=True)


NUMPY = Reader()
_lock = threading.Lock()
_driver: list = []          # [DriverReader or None] once probed


def _probe_driver():
    """A checked DriverReader, or None (no CUDA backend, no driver, or a self-test that failed)."""
    drv = _open_driver()
    if drv is None:
        return None
    prefault_on = Tuning.from_env().prefault_out        # (a malformed setting: its one-line error, not numpy reads)
    try:
        r = DriverReader(drv, prefault=prefault_on)
        a = mx.arange(4099, dtype=mx.int32, stream=mx.gpu) * 3 + 1
        mx.eval(a)
        src = np.asarray(a)
        got = r.read(src)
        dst = np.zeros_like(got)
        r.copyto(dst, src)
        want = np.arange(4099, dtype=np.int32) * 3 + 1
        if not (np.array_equal(got, want) and np.array_equal(dst, want)):
            return None
        if cuda_kernels.usable():           # the direct write, checked the same way (else never tried)
            cuda_kernels.prebuild_copies()
            out = np.zeros(4099 + 3, np.int32)[1:-2]       # (an address 4 bytes into an allocation)
            b = a * 2
            c = a * 5                       # 16,396 bytes in 4,096-byte chunks: the two-buffer path, a short last one
            out2 = np.zeros(4099 + 3, np.int32)[1:-2]
            if not (r._write(out.ctypes.data, b, b.nbytes) and np.array_equal(out, want * 2)
                    and r._write(out2.ctypes.data, c, c.nbytes, chunk=4096) and np.array_equal(out2, want * 5)):
                r.direct_failed = 3
        return r
    except Exception:
        return None


def reader(device: str, enabled: bool = True) -> Reader:
    """The reader for a session whose MLX device is ``device``: the driver's on a CUDA GPU, else numpy."""
    if not enabled or device != "gpu":
        return NUMPY
    with _lock:
        if not _driver:
            _driver.append(_probe_driver())
        return _driver[0] or NUMPY
