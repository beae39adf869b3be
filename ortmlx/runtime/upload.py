"""Host arrays onto MLX's CUDA device: large ones through page-locked staging.

``mx.array(numpy)`` copies a host array into MLX's memory at about 2 GB/s on an H200 (its pages fault in one by
one). A large input instead is copied by the host threads into page-locked staging memory mapped into the GPU
(``cuda_driver.HostBuffer``), then one kernel reads it over the bus into a new MLX array
(``cuda_kernels.copy_from_address``): 10-14 GB/s for 16-40 MB (``scripts/gpu_io_probe.py --upload``; numbers in
docs/performance.md). Inputs larger than one staging buffer go through two in turn, the host filling one while
the kernel reads the other. Each upload is evaluated before it returns, so the buffers are free for the next.

``uploader(device, enabled)`` is the ``Upload`` (``dtypes.to_mx``'s signature) a session's program uses for its
call inputs and constants: this one on MLX's CUDA backend once its self-test passed, else ``dtypes.to_mx``.
"""
from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from ..kernels import cuda_kernels
from ..kernels import dtypes as dt
from ..kernels.cuda_driver import Driver, HostBuffer
from ..kernels.cuda_driver import driver as _open_driver
from .devread import parallel_memmove

#: host arrays at least this large are staged (1 MB: 0.23 ms staged against 0.81 through ``mx.array``)
UPLOAD_MIN = 1 << 20
#: bytes one staging buffer holds; larger arrays take two, alternately
STAGE_BYTES = 32 << 20
#: element types copied as their bytes (carriers and bool go through ``dtypes.to_mx``)
_PLAIN = {t: m for t, m in dt.MLX.items() if t not in dt.CARRIER_MLX and t != dt.BOOL}


class Uploader:
    """``dtypes.to_mx`` with large plain arrays staged (see the module's docstring); after 3 failures, never."""

    def __init__(self, drv: Driver | None, copier=None, buffer=HostBuffer):
        self._drv = drv
        #: ([device address, bytes] uint64, bytes) -> the uint8 array read from there (tests: a stand-in)
        self._copier = copier or cuda_kernels.copy_from_address
        self._buffer = buffer
        self._stage: list[HostBuffer] = []
        self._lock = threading.Lock()
        self.uploads = 0
        self.failed = 0

    def __call__(self, a: np.ndarray, t: int) -> mx.array:
        m = _PLAIN.get(t)
        if m is None or self.failed >= 3 or not isinstance(a, np.ndarray) or a.nbytes < UPLOAD_MIN \
                or not a.flags.c_contiguous or a.dtype.itemsize != m.size:
            return dt.to_mx(a, t)
        try:
            r = self.staged(a, m)
        except Exception:  # noqa: BLE001 - any failure: MLX's own copy (the array is whole either way)
            self.failed += 1
            return dt.to_mx(a, t)
        self.uploads += 1
        return r

    def staged(self, a: np.ndarray, m, chunk: int = STAGE_BYTES) -> mx.array:
        """``a`` (row-major) as an evaluated MLX array of type ``m`` through the staging buffers (``chunk``:
        bytes a buffer holds; the self-test takes a small one to run the two-buffer path)."""
        n, src = int(a.nbytes), int(a.ctypes.data)
        with self._lock:
            bufs = self._buffers(min(n, chunk), 1 if n <= chunk else 2)
            parts, pending = [], [None] * len(bufs)
            for k, off in enumerate(range(0, n, chunk)):
                size, i = min(chunk, n - off), k % len(bufs)
                if pending[i] is not None:
                    mx.eval(pending[i])                 # its kernel has read this buffer
                parallel_memmove(bufs[i].host_address, src + off, size)
                part = self._copier(mx.array([bufs[i].device_address, size], dtype=mx.uint64), size)
                mx.async_eval(part)
                parts.append(part)
                pending[i] = part
            mx.eval(*[p for p in pending if p is not None])
        flat = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        return flat.view(m).reshape(a.shape)

    def _buffers(self, size: int, count: int) -> list[HostBuffer]:
        """``count`` staging buffers of at least ``size`` bytes (kept, grown in whole MiB)."""
        for i in range(count):
            if i < len(self._stage) and self._stage[i].nbytes >= size:
                continue
            b = self._buffer(self._drv, -(-size // (1 << 20)) * (1 << 20))
            if i < len(self._stage):
                self._stage[i].free()
                self._stage[i] = b
            else:
                self._stage.append(b)
        return self._stage[:count]


_lock = threading.Lock()
_made: list = []            # [Uploader or None] once probed


def _probe() -> Uploader | None:
    """A checked Uploader, or None (no CUDA backend or driver, no custom kernels, or a self-test that failed)."""
    drv = _open_driver()
    if drv is None or not cuda_kernels.usable():
        return None
    try:
        u = Uploader(drv)
        want = (np.arange(3 * 4099, dtype=np.int32) * 7 - 5).reshape(3, 4099)
        src = np.zeros(want.size + 3, np.int32)[1:-2].reshape(3, 4099)     # 4 bytes into an allocation
        src[...] = want
        one = u.staged(src, mx.int32)
        two = u.staged(src, mx.int32, chunk=4096)   # 49,176 bytes in 4,096-byte chunks: both buffers, a short last one
        ok = one.shape == want.shape and np.array_equal(np.array(one), want) and np.array_equal(np.array(two), want)
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
