"""Host arrays onto MLX's CUDA device: through page-locked staging, into device memory.

``mx.array(numpy)`` copies a host array into MLX's managed (unified) memory: a large one at about 2 GB/s on an
H200 (its pages fault in one by one), and even a small one costs its first reader a page fault on every call
(the host's write took the page back; ~0.1-0.2 ms of a kernel's time on an H200, docs/general_models.md). So
every plain array is instead copied by the host into page-locked staging memory mapped into the GPU
(``cuda_driver.HostBuffer``), then one kernel reads it over the bus into a new MLX array in device memory
(``cuda_kernels.copy_from_address``; large ones 10-14 GB/s for 16-40 MB, ``scripts/gpu_io_probe.py
--upload``). A large input (``UPLOAD_MIN`` and more) goes through two buffers in turn, the host filling one while
the kernel reads the other, and is evaluated before it returns. A small one takes the next of a ring of
``SMALL_SLOTS`` buffers (one ring per thread) and returns lazily, its copy run with the graph that reads it; a
buffer is written again only once its last copy has run (as a rule long before: each call is evaluated before the
next). Inside a compiled closure's trace small arrays take MLX's copy: a trace would replay the copy from a buffer
since reused; so do arrays of ``SCALAR_BYTES`` or less (a length, a position), which MLX keeps in its pool of managed
memory: a kernel reads them across the bus (``consts.roomy``), but the attention's lengths are computed from them
once a call out of the pool (``consts.unpooled``), so they get no copy kernel of their own (a launch a call, for a
gain not measured).

``uploader(device, enabled)`` is the ``Upload`` (``dtypes.to_mx``'s signature) a session's program uses for its
call inputs and constants: this one on MLX's CUDA backend once its self-test passed, else ``dtypes.to_mx``.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..kernels import build, consts, cuda_kernels
from ..kernels import dtypes as dt
from ..kernels.cuda_driver import Driver, HostBuffer
from ..kernels.cuda_driver import driver as _open_driver
from .devread import parallel_memmove

#: host arrays at least this large go through the two large buffers, evaluated at once
UPLOAD_MIN = 1 << 20
#: bytes one large buffer holds; larger arrays take two, alternately
STAGE_BYTES = 32 << 20
#: arrays of at most this many bytes keep MLX's copy (see the module's docstring)
SCALAR_BYTES = consts.POOLED_BYTES
#: small buffers, taken in turn (a call's small inputs rarely outnumber them: then an earlier copy is run first)
SMALL_SLOTS = 16
_HEADER = cuda_kernels.COPY_IN_HEADER
#: element types copied as their bytes (carriers and bool go through ``dtypes.to_mx``)
_PLAIN = {t: m for t, m in dt.MLX.items() if t not in dt.CARRIER_MLX and t != dt.BOOL}


class Stage:
    """A page-locked buffer of at least ``nbytes`` payload bytes after its header, the one-element device array
    holding its device address (the copy kernel's argument, made once), and the last copy that reads it."""

    def __init__(self, drv, nbytes: int, buffer):
        self.buf = buffer(drv, -(-(nbytes + _HEADER) // 4096) * 4096)
        self.capacity = self.buf.nbytes - _HEADER
        # a kernel's result in device memory: no host write ever again, not in MLX's pool (``consts.roomy``)
        self.address = consts.roomy(mx.array(self.buf.device_address, dtype=mx.uint64))
        self.pending = None

    def settle(self) -> None:
        """Run (or wait for) the last copy that reads this buffer."""
        if self.pending is not None:
            mx.eval(self.pending)
            self.pending = None

    def fill(self, src: int, n: int, copier, threads: bool = False) -> mx.array:
        """Write the count and ``n`` bytes from host address ``src``; the (lazy) uint8 copy of them (a view into
        ``consts.ROOM_BYTES`` when fewer)."""
        self.settle()
        ctypes.c_uint64.from_address(self.buf.host_address).value = n
        if threads:
            parallel_memmove(self.buf.host_address + _HEADER, src, n)
        else:
            ctypes.memmove(self.buf.host_address + _HEADER, src, n)
        self.pending = copier(self.address, max(n, consts.ROOM_BYTES))      # (the kernel copies n of them)
        return self.pending if n >= consts.ROOM_BYTES else self.pending[:n]

    def free(self) -> None:
        self.settle()
        self.buf.free()


class Uploader:
    """``dtypes.to_mx`` with plain arrays staged (see the module's docstring); after 3 failures, never."""

    def __init__(self, drv: Driver | None, copier=None, buffer=HostBuffer):
        self._drv = drv
        #: (address array, bytes) -> the uint8 array read from that buffer (tests: a stand-in)
        self._copier = copier or cuda_kernels.copy_from_address
        self._buffer = buffer
        self._stage: list[Stage] = []
        #: each thread's small ring: MLX keeps a thread's streams to itself, so only the thread that made a copy
        #: can tell that it has run (another thread's eval of it fails or returns before the kernel has run)
        self._local = threading.local()
        self._lock = threading.Lock()
        self.uploads = 0
        self.small_uploads = 0
        self.failed = 0

    def __call__(self, a: np.ndarray, t: int) -> mx.array:
        m = _PLAIN.get(t)
        if m is None or self.failed >= 3 or not isinstance(a, np.ndarray) or a.nbytes <= SCALAR_BYTES \
                or not a.flags.c_contiguous or a.dtype.itemsize != m.size:
            return dt.to_mx(a, t)
        large = a.nbytes >= UPLOAD_MIN
        if not large and build.tracing():
            return dt.to_mx(a, t)
        try:
            r = self.staged(a, m) if large else self.small(a, m)
        except Exception:  # noqa: BLE001 - any failure: MLX's own copy (the array is whole either way)
            self.failed += 1
            return dt.to_mx(a, t)
        if large:
            self.uploads += 1
        else:
            self.small_uploads += 1
        return r

    def small(self, a: np.ndarray, m) -> mx.array:
        """``a`` (row-major, under ``UPLOAD_MIN`` bytes) as a lazy MLX array of type ``m`` through the next small
        buffer."""
        n = int(a.nbytes)
        ring = self.ring()
        i = ring.next
        ring.next = (i + 1) % SMALL_SLOTS
        st = ring.stages[i]
        if st is None or st.capacity < n:
            if st is not None:
                st.free()
                ring.stages[i] = None
            st = ring.stages[i] = Stage(self._drv, max(n, 4096 - _HEADER), self._buffer)
        flat = st.fill(int(a.ctypes.data), n, self._copier)
        return flat.view(m).reshape(a.shape)

    def ring(self) -> "_Ring":
        """This thread's small buffers (made on its first small upload; freed when the thread ends)."""
        r = getattr(self._local, "ring", None)
        if r is None:
            r = self._local.ring = _Ring([None] * SMALL_SLOTS)
        return r

    def staged(self, a: np.ndarray, m, chunk: int = STAGE_BYTES) -> mx.array:
        """``a`` (row-major) as an evaluated MLX array of type ``m`` through the large buffers (``chunk``: bytes a
        buffer holds; the self-test takes a small one to run the two-buffer path)."""
        n, src = int(a.nbytes), int(a.ctypes.data)
        with self._lock:
            bufs = self._buffers(min(n, chunk), 1 if n <= chunk else 2)
            parts = []
            for k, off in enumerate(range(0, n, chunk)):
                parts.append(bufs[k % len(bufs)].fill(src + off, min(chunk, n - off), self._copier, threads=True))
                mx.async_eval(parts[-1])
            for b in bufs:
                b.settle()
        flat = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        return flat.view(m).reshape(a.shape)

    def _buffers(self, size: int, count: int) -> list[Stage]:
        """``count`` large buffers of at least ``size`` bytes (kept, grown in whole MiB)."""
        for i in range(count):
            if i < len(self._stage) and self._stage[i].capacity >= size:
                continue
            b = Stage(self._drv, -(-size // (1 << 20)) * (1 << 20), self._buffer)
            if i < len(self._stage):
                self._stage[i].free()
                self._stage[i] = b
            else:
                self._stage.append(b)
        return self._stage[:count]


@dataclass
class _Ring:
    stages: list
    next: int = 0


_lock = threading.Lock()
_made: list = []            # [Uploader or None] once probed


def _probe() -> Uploader | None:
    """A checked Uploader, or None (no CUDA backend or driver, no custom kernels, or a self-test that failed)."""
    drv = _open_driver()
    if drv is None or not cuda_kernels.usable():
        return None
    cuda_kernels.prebuild_copies()
    try:
        u = Uploader(drv)
        want = (np.arange(3 * 4099, dtype=np.int32) * 7 - 5).reshape(3, 4099)
        src = np.zeros(want.size + 3, np.int32)[1:-2].reshape(3, 4099)     # 4 bytes into an allocation
        src[...] = want
        one = u.staged(src, mx.int32)
        two = u.staged(src, mx.int32, chunk=4096)   # 49,176 bytes in 4,096-byte chunks: both buffers, a short last one
        small = [u.small(src[:k], mx.int32) for k in (1, 2, 3)]        # lazy, in three small buffers
        ok = one.shape == want.shape and np.array_equal(np.array(one), want) and np.array_equal(np.array(two), want) \
            and all(np.array_equal(np.array(s), want[:k]) for k, s in zip((1, 2, 3), small))
        return u if ok else None
    except Exception:  # noqa: BLE001 - no staged uploads
        return None


def uploader(device: str, enabled: bool = True):
    """The ``Upload`` for a session whose MLX device is ``device``: staged on a CUDA GPU, else ``dtypes.to_mx``."""
    if not enabled or device != "gpu":
        return dt.to_mx
    with _lock:
        if not _made:
            _made.append(_probe())
        return _made[0] or dt.to_mx
