"""Host reads through the CUDA driver's copy (ep/devread.py).

This machine has no CUDA driver, so the driver reader runs here over a stand-in driver whose
``cuMemcpy`` is a plain memmove: the tests check what the EP hands it (addresses, sizes, which
reads fall back to numpy, error fallback, the thread's context) and that every answer of a
session reading through it stays the CPU EP's. The real driver is exercised on the GPU host by
the reader's own self-test (``devread._probe_driver``) and ``scripts/gpu_io_probe.py``.
"""
from __future__ import annotations

import ctypes

import cffi
import mlx.core as mx
import numpy as np
import pytest

from ortmlx.runtime import devread
from ortmlx.kernels.cuda_driver import Driver

ffi = cffi.FFI()


class FakeDriver:
    """cuCtxGetCurrent / cuCtxSetCurrent / cuDeviceGet / cuDevicePrimaryCtxRetain / cuMemcpy over memmove."""

    def __init__(self, fail: bool = False, ctx: bool = True, map_fail: bool = False, flags: int = 0x18):
        self.fail, self.ctx, self.map_fail, self.flags = fail, ctx, map_fail, flags
        self.copies, self.sets, self.retains, self.syncs = [], 0, 0, 0
        self.alive, self.freed = {}, []

    def cuCtxGetCurrent(self, p):
        p[0] = ffi.cast("void*", 0x1234) if self.ctx else ffi.NULL
        return 0

    def cuCtxSetCurrent(self, c):
        self.sets += 1
        self.ctx = True
        return 0

    def cuDeviceGet(self, dev, ordinal):
        dev[0] = ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, p, dev):
        self.retains += 1
        p[0] = ffi.cast("void*", 0x5678)
        return 0

    def cuMemcpy(self, dst, src, n):
        self.copies.append(n)
        if self.fail:
            return 700                  # CUDA_ERROR_ILLEGAL_ADDRESS
        ctypes.memmove(dst, src, n)
        return 0


    # page-locked host memory (cuda_driver.HostBuffer): a ctypes buffer; the "device" address is the host's
    def cuMemHostAlloc(self, p, n, flags):
        if self.fail:
            return 2                    # CUDA_ERROR_OUT_OF_MEMORY
        buf = ctypes.create_string_buffer(n)
        self.alive[ctypes.addressof(buf)] = (buf, flags)
        p[0] = ffi.cast("void*", ctypes.addressof(buf))
        return 0

    def cuMemHostGetDevicePointer_v2(self, d, p, flags):
        if self.map_fail:
            return 201                  # CUDA_ERROR_INVALID_CONTEXT
        d[0] = int(ffi.cast("uintptr_t", p))
        return 0

    def cuMemFreeHost(self, p):
        self.freed.append(int(ffi.cast("uintptr_t", p)))
        del self.alive[self.freed[-1]]
        return 0

    def cuCtxGetFlags(self, f):
        if self.flags is None:
            return 201                  # CUDA_ERROR_INVALID_CONTEXT
        f[0] = self.flags
        return 0

    def cuMemGetInfo_v2(self, f, t):
        f[0], t[0] = 3 << 30, 8 << 30
        return 700 if self.fail else 0

    def cuCtxSynchronize(self):
        self.syncs += 1
        return 700 if self.fail else 0



def fake_copier(r, target):
    """``cuda_kernels.copy_to_address`` on the host: ``r``'s row-major bytes to the address ``target`` holds."""
    addr, n = np.array(target).tolist()
    src = np.ascontiguousarray(np.asarray(r.view(mx.uint8)))      # (bytes: NumPy has no bfloat16)
    assert src.nbytes == n
    ctypes.memmove(addr, src.ctypes.data, n)
    return mx.array([1], dtype=mx.uint8)


def reader(copier=None, **kw):
    d = FakeDriver(**kw)
    return devread.DriverReader(Driver(d, ffi), copier), d


def test_numpy_reader_off_the_gpu():
    assert devread.reader("cpu") is devread.NUMPY
    assert devread.reader("gpu", enabled=False) is devread.NUMPY
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        assert devread.reader("gpu") is devread.NUMPY       # no CUDA backend here: nothing to probe


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.int64, mx.uint8, mx.bool_])
def test_reads_are_exact(dtype):
    r, d = reader()
    a = (mx.arange(3 * 5 * 7) % 11).reshape(3, 5, 7).astype(dtype)
    mx.eval(a)
    src = np.asarray(a)
    want = np.array(src, copy=True)
    got = r.read(src)
    assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    dst = np.zeros_like(want)
    r.copyto(dst, src)
    assert np.array_equal(dst, want)
    out = np.zeros_like(want)
    r.copy_to_address(ffi.cast("void*", out.ctypes.data), src, ffi)
    assert np.array_equal(out, want)
    assert d.copies == [want.nbytes] * 3


def test_strided_and_empty_sources_use_numpy():
    r, d = reader()
    a = mx.arange(24, dtype=mx.float32).reshape(4, 6).T          # a transposed view: not C-contiguous
    mx.eval(a)
    src = np.asarray(a)
    assert not src.flags.c_contiguous
    assert np.array_equal(r.read(src), np.arange(24, dtype=np.float32).reshape(4, 6).T)
    dst = np.zeros((6, 4), np.float32)
    r.copyto(dst, src)
    assert np.array_equal(dst, src)
    e = np.asarray(mx.zeros((0, 3)))
    assert r.read(e).shape == (0, 3)
    assert d.copies == []


def test_mismatched_destination_uses_numpy():
    r, d = reader()
    src = np.asarray(mx.arange(8, dtype=mx.int32))
    dst = np.zeros(8, np.int64)                                   # numpy converts; the driver would not
    r.copyto(dst, src)
    assert dst.tolist() == list(range(8)) and d.copies == []


def test_driver_errors_fall_back_and_then_stop_trying():
    r, d = reader(fail=True)
    src = np.asarray(mx.arange(100, dtype=mx.float32) * 2)
    for _ in range(5):
        assert np.array_equal(r.read(src), np.arange(100, dtype=np.float32) * 2)
    assert len(d.copies) == 3 and r.failed == 3                   # three refusals, then numpy only


def test_thread_without_context_gets_the_primary_one():
    r, d = reader(ctx=False)
    src = np.asarray(mx.arange(10, dtype=mx.int32))
    r.read(src)
    r.read(src)
    assert (d.retains, d.sets) == (1, 1)


@pytest.fixture
def fake_driver(monkeypatch):
    """Sessions created under this fixture read every result through a stand-in driver."""
    made = []

    def fake(device, enabled=True):
        r, d = reader()
        made.append(r)
        return r
    monkeypatch.setattr(devread, "reader", fake)
    return made


@pytest.mark.parametrize("options", [None, {"tuning": "kv_batch=0"}, {"no_compile": "1"}],
                         ids=["batch", "per-buffer", "eager"])
def test_kv_decode_through_the_driver_reader(fake_driver, options):
    """The KV decode of test_kv_batch (every call checked against the CPU EP, rewinds, two buffer sets)
    with results read through the driver reader: row hints, logits-like outputs and whole copies."""
    from test_kv_batch import Buffers, two_layer_model

    from ortmlx.testing import session
    m = two_layer_model()
    mlx, cpu = session(m, options=options), session(m, "CPUExecutionProvider", record=False)
    a, b = Buffers(mlx, cpu, 4), Buffers(mlx, cpu, 5)
    for pos in (3, 4, 5, 6, 4, 5, 2, 3):
        a.step(pos, f"a pos {pos}")
        b.step(pos + 2, f"b pos {pos + 2}")
    assert sum(r.copies for r in fake_driver) > 0


def test_device_diff_through_the_driver_reader(fake_driver, monkeypatch):
    """The device diff path (changed rows found on the device, written row by row) reading through it."""
    from ortmlx.runtime import group
    from test_kv_mirror import Buffer, scatter_model

    from ortmlx.testing import session
    monkeypatch.setattr(group, "WHOLE_COPY_BYTES", [0, 0])
    buf = Buffer(session(scatter_model()), seed=3)
    for pos in (0, 1, 2, 1, 5, 5, 15):
        buf.step(pos)
    assert sum(r.copies for r in fake_driver) > 0


def test_host_buffer_is_mapped_page_locked_memory_freed_with_it():
    import gc

    from ortmlx.kernels import cuda_driver
    d = FakeDriver(ctx=False)
    drv = cuda_driver.Driver(d, ffi)
    hb = cuda_driver.HostBuffer(drv, 5000)
    (addr,) = d.alive
    assert d.alive[addr][1] == cuda_driver.MEMHOSTALLOC_PORTABLE | cuda_driver.MEMHOSTALLOC_DEVICEMAP
    assert hb.device_address == hb.host_address == addr and hb.nbytes == 5000
    assert hb.array.dtype == np.uint8 and hb.array.shape == (5000,) and hb.array.ctypes.data == addr
    hb.array[:4] = [1, 2, 3, 4]                  # the host view is the memory itself
    assert ctypes.string_at(addr, 4) == bytes([1, 2, 3, 4])
    assert (d.retains, d.sets) == (1, 1)         # a context made current for the allocation
    del hb
    gc.collect()
    assert d.freed == [addr] and not d.alive
    with pytest.raises(ValueError, match="positive size"):
        cuda_driver.HostBuffer(drv, 0)


def test_host_buffer_errors_free_what_was_taken():
    from ortmlx.kernels import cuda_driver
    d = FakeDriver(fail=True)
    with pytest.raises(cuda_driver.DriverError, match="cuMemHostAlloc failed with CUresult 2"):
        cuda_driver.HostBuffer(cuda_driver.Driver(d, ffi), 64)
    d = FakeDriver(map_fail=True)
    with pytest.raises(cuda_driver.DriverError, match="cuMemHostGetDevicePointer failed with CUresult 201"):
        cuda_driver.HostBuffer(cuda_driver.Driver(d, ffi), 64)
    assert len(d.freed) == 1 and not d.alive


@pytest.mark.parametrize("flags,spins", [
    (0x18, True),       # CU_CTX_SCHED_AUTO with MAP_HOST | LMEM_RESIZE_TO_MAX: what MLX's context had on the H200
    (0x01, True),       # SCHED_SPIN
    (0x02, True),       # SCHED_YIELD
    (0x04, False),      # SCHED_BLOCKING_SYNC: a synchronize sleeps too, no point polling
    (0x1c, False),
    (None, False),      # cuCtxGetFlags failed
])
def test_driver_spins_unless_the_context_blocks(flags, spins):
    from ortmlx.kernels import cuda_driver
    d = FakeDriver(ctx=False, flags=flags)
    drv = cuda_driver.Driver(d, ffi)
    assert drv.spins() is spins
    assert d.sets == 1                           # a context made current first


def test_driver_synchronize_makes_a_context_current_and_returns_the_result():
    from ortmlx.kernels import cuda_driver
    d = FakeDriver(ctx=False)
    drv = cuda_driver.Driver(d, ffi)
    assert drv.synchronize() == 0 and d.syncs == 1 and d.sets == 1
    d.fail = True
    assert drv.synchronize() == 700 and d.syncs == 2     # reported, not raised: MLX's eval reports the error


def test_no_driver_without_the_cuda_backend():
    from ortmlx.kernels import cuda_driver
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        assert cuda_driver.driver() is None


def _sources():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    ro = base.copy()
    ro.flags.writeable = False
    return {
        "row-major": base,
        "transposed (not row-major)": base.T,
        "strided rows": base[::2],
        "read-only (a closure's host-memory result)": ro,
        "an MLX result's host view": np.asarray(mx.arange(10).astype(mx.float16)),
        "bool": np.array([[True, False, True]]),
        "empty": np.zeros((0, 3), np.int64),
    }


@pytest.mark.parametrize("name", list(_sources()))
def test_numpy_reader_copies_to_an_address_in_logical_order(name):
    """``copy_to_address`` (ORT's output buffer): row-major sources in one memmove, others element by element;
    the destination gets the values in row-major order and nothing past their bytes."""
    src = _sources()[name]
    raw = np.full(src.nbytes + 16, 0xAB, np.uint8)
    devread.NUMPY.copy_to_address(ffi.cast("void*", raw.ctypes.data), src, ffi)
    assert raw[:src.nbytes].tobytes() == np.ascontiguousarray(src).tobytes()
    assert (raw[src.nbytes:] == 0xAB).all()


def _results() -> dict:
    """Evaluated MLX results: row-major, and strided views whose buffer is not in logical order."""
    a = mx.arange(24, dtype=mx.float32).reshape(4, 6)
    out = {"rows": a * 2, "transposed": a.T, "sliced": a[:, 1:4], "broadcast": mx.broadcast_to(a[:1], (3, 6)),
           "scalar": mx.array(7.5), "bf16": (a / 3).astype(mx.bfloat16), "bf16_t": (a / 3).astype(mx.bfloat16).T,
           "bool": a > 5, "int64": a.astype(mx.int64)[::2]}
    mx.eval(*out.values())
    return out


@pytest.mark.parametrize("name", list(_results()))
def test_numpy_reader_copies_a_result_in_logical_order(name):
    """``copy_result`` (a replayed call's output): one memmove from MLX's buffer when it is row-major, else the host
    view's copy; either way the bytes of ``copy_to_address`` of the host view, nothing past them."""
    from ortmlx.kernels.dtypes import to_numpy
    r = _results()[name]
    want = np.ascontiguousarray(to_numpy(r)).tobytes()
    raw = np.full(r.nbytes + 16, 0xAB, np.uint8)
    devread.NUMPY.copy_result(ffi.cast("void*", raw.ctypes.data), r, ffi)
    assert raw[:r.nbytes].tobytes() == want
    assert (raw[r.nbytes:] == 0xAB).all()


def test_numpy_reader_never_copies_object_pointers():
    src = np.array(["a", "b"], dtype=object)
    raw = np.zeros(64, np.uint8)
    with pytest.raises(ValueError):
        devread.NUMPY.copy_to_address(ffi.cast("void*", raw.ctypes.data), src, ffi)
    assert not raw.any()


# ----------------------------------------------------------------------------------------- direct writes
@pytest.fixture
def small_direct(monkeypatch):
    """Direct writes from 64 bytes up (the real threshold is megabytes), staging buffers of 8 MiB (64 MiB)."""
    from ortmlx.kernels import cuda_kernels
    monkeypatch.setattr(cuda_kernels, "DIRECT_MIN", 64)
    monkeypatch.setattr(devread, "STAGE_CHUNK", 8 << 20)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.int64, mx.uint8])
def test_direct_write_goes_through_one_staging_buffer(small_direct, dtype):
    """The kernel writes the staging buffer (page-locked, mapped), the host copies it into ORT's buffer: the exact
    bytes at any offset, nothing outside them; the buffer is kept and reused, never the driver's cuMemcpy."""
    from ortmlx.kernels import cuda_driver
    r, d = reader(fake_copier)
    for k in range(3):
        a = ((mx.arange(9 * 11) % 13) - 6 + k).reshape(9, 11).astype(dtype)      # >= 64 bytes in every type
        raw = np.full(a.nbytes + 8, 0xAB, np.uint8)
        addr = raw.ctypes.data + 4
        assert r.direct(a.nbytes) and r.write_result(addr, a)
        assert raw[4:4 + a.nbytes].tobytes() == bytes(memoryview(np.asarray(a.view(mx.uint8)))), "wrong bytes"
        assert (raw[:4] == 0xAB).all() and (raw[4 + a.nbytes:] == 0xAB).all()
    assert [f for _, f in d.alive.values()] == [cuda_driver.MEMHOSTALLOC_PORTABLE | cuda_driver.MEMHOSTALLOC_DEVICEMAP] * 2
    assert r.direct_writes == 3 and d.copies == [] and d.freed == []


def test_the_first_direct_write_makes_both_staging_buffers_at_full_size(small_direct):
    """No later result, larger or smaller, allocates page-locked memory: growing it to each new prompt length's
    logits cost that length's first call 18-80 ms on an H100."""
    r, d = reader(fake_copier)
    held = []
    for n in (100, 70, 3 << 20, 1 << 20, (17 << 20) + 1, 5 << 20):
        a = (mx.arange(n) % 251).astype(mx.uint8)
        out = np.zeros(n, np.uint8)
        assert r.write_result(out.ctypes.data, a) and np.array_equal(out, np.arange(n) % 251)
        held.append(tuple(id(b) for b in r._stage))
    assert len(set(held)) == 1 and len(d.alive) == 2 and d.freed == [], (held, d.freed)
    assert [b.nbytes for b in r._stage] == [devread.STAGE_CHUNK] * 2


@pytest.mark.parametrize("dtype", [mx.uint8, mx.float16, mx.float32, mx.int64])
def test_large_results_go_through_two_buffers_in_turn(small_direct, monkeypatch, dtype):
    """A result over ``STAGE_CHUNK`` is copied chunk by chunk through two staging buffers, alternately: every byte
    in place (an odd address, a last chunk of any size), nothing outside it, and a larger result allocates nothing."""
    monkeypatch.setattr(devread, "STAGE_CHUNK", 2 << 20)
    seen = []

    def spy(r, target):
        seen.append(tuple(np.array(target).tolist()))
        return fake_copier(r, target)
    r, d = reader(spy)
    item = np.dtype(dt_np(dtype)).itemsize
    for k, elems in enumerate(((5 << 20) // item + 3, (2 << 20) // item, (9 << 20) // item + 1)):
        a = ((mx.arange(elems) * 7 + k) % 241).astype(dtype)
        raw = np.full(a.nbytes + 10, 0xAB, np.uint8)
        seen.clear()
        assert r.write_result(raw.ctypes.data + 5, a)
        assert raw[5:5 + a.nbytes].tobytes() == bytes(memoryview(np.asarray(a.view(mx.uint8)))), "wrong bytes"
        assert (raw[:5] == 0xAB).all() and (raw[5 + a.nbytes:] == 0xAB).all()
        assert sum(m for _, m in seen) == a.nbytes and all(m <= 2 << 20 for _, m in seen)
        if len(seen) > 1:
            assert len({p for p, _ in seen[0::2]}) == 1 and len({p for p, _ in seen[1::2]}) == 1
            assert seen[0][0] != seen[1][0], "one buffer for two chunks in flight"
    assert len(d.alive) == 2 and d.freed == [] and all(b.nbytes == 2 << 20 for b in r._stage)


def test_the_self_tests_small_chunks_take_the_two_buffer_path(small_direct):
    """The driver's self-test writes 16,396 bytes in 4,096-byte chunks (``_write(..., chunk=4096)``): five kernels
    into two small buffers in turn, every byte in place; the first full-size write replaces both with full ones."""
    seen = []

    def spy(r, target):
        seen.append(tuple(np.array(target).tolist()))
        return fake_copier(r, target)
    r, d = reader(spy)
    c = mx.arange(4099, dtype=mx.int32) * 5
    out = np.zeros(4099 + 3, np.int32)[1:-2]
    assert r._write(out.ctypes.data, c, c.nbytes, chunk=4096) and np.array_equal(out, np.arange(4099) * 5)
    assert [m for _, m in seen] == [4096] * 4 + [16396 - 4 * 4096]
    assert len({p for p, _ in seen[0::2]}) == 1 and len({p for p, _ in seen[1::2]}) == 1 and seen[0][0] != seen[1][0]
    big = (mx.arange(3 << 18, dtype=mx.int32) % 97)          # 3 MiB: one buffer
    out = np.zeros(3 << 18, np.int32)
    seen.clear()
    assert r.write_result(out.ctypes.data, big) and np.array_equal(out, np.arange(3 << 18) % 97) and len(seen) == 1
    assert len(d.freed) == 2 and [b.nbytes for b in r._stage] == [devread.STAGE_CHUNK] * 2


def dt_np(dtype):
    return {mx.uint8: np.uint8, mx.float16: np.float16, mx.float32: np.float32, mx.int64: np.int64}[dtype]


@pytest.mark.parametrize("n", [0, 1, 4095, 1 << 20, (2 << 20) + 1, (5 << 20) + 4093, 9 << 20])
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_parallel_memmove_copies_every_byte_once(n, threads):
    src = np.random.default_rng(n).integers(0, 256, n + 3, dtype=np.uint8)
    dst = np.full(n + 16, 0xAB, np.uint8)
    devread.parallel_memmove(dst.ctypes.data + 8, src.ctypes.data + 3, n, threads)
    assert dst[8:8 + n].tobytes() == src[3:].tobytes()
    assert (dst[:8] == 0xAB).all() and (dst[8 + n:] == 0xAB).all()


def test_parallel_memmove_uses_the_threads(monkeypatch):
    """Large copies are cut into page-aligned slices, one per thread (the calling thread takes the last)."""
    import threading
    seen = []
    real = devread.ctypes.memmove

    def spy(dst, src, n):
        seen.append((threading.current_thread().name, dst, n))
        return real(dst, src, n)
    monkeypatch.setattr(devread.ctypes, "memmove", spy)
    n = (8 << 20) + 5
    src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    devread.parallel_memmove(dst.ctypes.data, src.ctypes.data, n, 4)
    seen.sort(key=lambda s: s[1])
    assert dst.all() and len(seen) == 4 and sum(k for _, _, k in seen) == n
    assert [a - dst.ctypes.data for _, a, _ in seen] == [0, 1 * seen[0][2], 2 * seen[0][2], 3 * seen[0][2]]
    assert seen[0][2] % 4096 == 0 and seen[-1][0] == threading.current_thread().name
    if devread.COPY_THREADS > 1:
        assert all(t.startswith("ortmlx-copy") for t, _, _ in seen[:-1])


def _resident(m, n_pages) -> list:
    """mincore(2)'s residency of the first ``n_pages`` pages of mmap ``m``."""
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    view = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(view)
    del view
    vec = (ctypes.c_ubyte * n_pages)()
    assert libc.mincore(addr, n_pages * mmap.PAGESIZE, vec) == 0
    return [v & 1 for v in vec], addr


def test_populate_faults_pages_in_and_keeps_their_bytes():
    import mmap
    if not devread.POPULATE:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 16 * page)
    try:
        before, addr = _resident(m, 16)
        assert sum(before) == 0                         # a fresh anonymous map: nothing faulted in yet
        assert devread.populate(addr + 2 * page + 5, 3 * page)       # pages 2..5 (an unaligned start)
        after, _ = _resident(m, 16)
        assert after == [0, 0, 1, 1, 1, 1] + [0] * 10, after
        assert m[:] == bytes(16 * page)
    finally:
        m.close()
    raw = np.random.default_rng(1).integers(0, 256, (3 << 20) + 77, dtype=np.uint8)
    want = raw.copy()
    assert devread.populate(raw.ctypes.data + 5, raw.nbytes - 9)
    assert np.array_equal(raw, want)


def test_prefault_goes_chunk_by_chunk_in_page_sized_slices(monkeypatch):
    made = []
    monkeypatch.setattr(devread, "POPULATE", True)
    monkeypatch.setattr(devread, "populate", lambda a, n: None)

    class Pool:                                         # records the order of submission
        def submit(self, fn, a, n):
            made.append((a, n))
            from concurrent.futures import Future
            f = Future()
            f.set_result(None)
            return f
    monkeypatch.setattr(devread, "_fault_pool", [Pool()])
    base, n, chunk = 0x10000 + 3, (9 << 20) + 11, 4 << 20
    futs = []
    devread.prefault(base, n, chunk, futs)
    assert len(futs) == len(made) and made == sorted(made), "not in the copy's order"
    assert sum(k for _, k in made) == n and made[0][0] == base
    assert all(a + k == b for (a, k), (b, _) in zip(made, made[1:]))
    assert all(k % 4096 == 0 for (a, k) in made if (a - base + k) % chunk and a + k != base + n)
    assert all((a - base) // chunk == (a - base + k - 1) // chunk for a, k in made), "a slice across two chunks"
    monkeypatch.setattr(devread, "POPULATE", False)
    made.clear()
    devread.prefault(base, n, chunk, futs := [])
    assert futs == [] and made == []


def test_a_prefault_that_fails_midway_leaves_nothing_running(small_direct, monkeypatch):
    """Submitting fails after two slices (no thread to start): the write still waits for those two."""
    import time
    monkeypatch.setattr(devread, "STAGE_CHUNK", 2 << 20)
    monkeypatch.setattr(devread, "POPULATE", True)
    running = []

    def slow(a, n):
        running.append(1)
        time.sleep(0.05)
        running.pop()
        return True
    monkeypatch.setattr(devread, "populate", slow)
    from concurrent.futures import ThreadPoolExecutor
    real = ThreadPoolExecutor(2)
    calls = []

    class Pool:
        def submit(self, fn, *a):
            calls.append(1)
            if len(calls) > 2:
                raise RuntimeError("can't start new thread")
            return real.submit(fn, *a)
    monkeypatch.setattr(devread, "_fault_pool", [Pool()])
    a = ((mx.arange((5 << 20) + 3) * 7) % 241).astype(mx.uint8)
    mx.eval(a)
    r, d = reader(fake_copier)
    raw = np.zeros(a.nbytes, np.uint8)
    assert not r.write_result(raw.ctypes.data, a) and r.direct_failed == 1
    assert not running, "a populate still running after the write returned"
    real.shutdown()


def test_a_write_returns_only_after_its_prefault(small_direct, monkeypatch):
    """The copy never waits for the prefault (it changes no byte), but the write does not return before every slice
    of it is done, failed or not: nothing of a call runs on after it."""
    import threading
    import time
    monkeypatch.setattr(devread, "STAGE_CHUNK", 2 << 20)
    monkeypatch.setattr(devread, "POPULATE", True)
    running = []
    real = devread.populate

    def slow(a, n):
        running.append(1)
        time.sleep(0.02)
        ok = real(a, n)
        running.pop()
        return ok
    monkeypatch.setattr(devread, "populate", slow)
    a = ((mx.arange((5 << 20) + 3) * 7) % 241).astype(mx.uint8)
    mx.eval(a)
    for fails in (False, True):
        r, d = reader(fake_copier)
        raw = np.full(a.nbytes + 10, 0xAB, np.uint8)
        if fails:                           # the first chunk's kernel fails while the prefault runs
            monkeypatch.setattr(devread.mx, "eval", lambda *x: (_ for _ in ()).throw(RuntimeError("kernel failed")))
        ok = r.write_result(raw.ctypes.data + 5, a)
        assert not running, "a prefault still running after the write returned"
        assert ok != fails and r.direct_failed == int(fails)
        if not fails:
            assert np.array_equal(raw[5:5 + a.nbytes], np.asarray(a))
        assert (raw[:5] == 0xAB).all() and (raw[5 + a.nbytes:] == 0xAB).all()
    assert threading.active_count() < 64


def test_prefault_off_touches_nothing(small_direct, monkeypatch):
    monkeypatch.setattr(devread, "prefault", lambda *a: pytest.fail("prefault with prefault=False"))
    d = FakeDriver()
    r = devread.DriverReader(Driver(d, ffi), fake_copier, prefault=False)
    a = (mx.arange(1 << 12) % 251).astype(mx.uint8)
    out = np.zeros(1 << 12, np.uint8)
    assert r.write_result(out.ctypes.data, a) and np.array_equal(out, np.arange(1 << 12) % 251)


def test_direct_write_only_for_large_results(small_direct):
    r, d = reader(fake_copier)
    small = mx.arange(8, dtype=mx.float32)               # 32 bytes: under the threshold
    out = np.zeros(8, np.float32)
    assert not r.direct(small.nbytes) and not r.write_result(out.ctypes.data, small)
    assert not d.alive and not out.any()
    assert not devread.NUMPY.direct(1 << 30) and not devread.NUMPY.write_result(out.ctypes.data, small)


def test_direct_write_failures_fall_back_then_stop(small_direct):
    a = mx.arange(32, dtype=mx.int32)
    out = np.zeros(32, np.int32)
    r, d = reader(fake_copier)
    d.fail = True                                        # cuMemHostAlloc: CUDA_ERROR_OUT_OF_MEMORY
    for _ in range(4):
        assert not r.write_result(out.ctypes.data, a)
    assert r.direct_failed == 3 and not r.direct(a.nbytes) and not out.any() and not d.alive

    def broken(r, target):
        raise RuntimeError("kernel failed")
    r, d = reader(broken)
    assert not r.write_result(out.ctypes.data, a) and r.direct_failed == 1 and not out.any()
    r, d = reader(fake_copier, map_fail=True)            # allocated but not mapped: freed again
    assert not r.write_result(out.ctypes.data, a) and not d.alive and not any(r._stage)


def test_direct_writes_from_threads_share_the_buffer(small_direct):
    """Sessions on several threads write through the one set of staging buffers one at a time: every answer
    intact, nothing allocated after the first."""
    from concurrent.futures import ThreadPoolExecutor
    r, d = reader(fake_copier)

    def one(k):
        a = mx.arange(4096, dtype=mx.int32) * 7 + k
        out = np.zeros(4096, np.int32)
        return r.write_result(out.ctypes.data, a) and np.array_equal(out, np.arange(4096) * 7 + k)
    with ThreadPoolExecutor(6) as ex:
        assert all(ex.map(one, range(60)))
    assert r.direct_writes == 60 and len(d.alive) == 2 and d.freed == []


@pytest.fixture
def direct_reader(monkeypatch, small_direct):
    """Sessions created under this fixture write every large result through the direct path (stand-in driver)."""
    made = []

    def fake(device, enabled=True):
        r, d = reader(fake_copier)
        made.append(r)
        return r
    monkeypatch.setattr(devread, "reader", fake)
    return made


@pytest.mark.parametrize("options", [None, {"no_compile": "1"}, {"tuning": "direct_out=0"}],
                         ids=["compiled", "eager", "off"])
def test_session_answers_through_direct_writes(direct_reader, options):
    """Logits-like outputs of a KV decode (every call checked against the CPU EP) written by the direct path;
    the tuning knob turns it off."""
    from test_kv_batch import Buffers, two_layer_model

    from ortmlx.testing import session
    m = two_layer_model()
    mlx, cpu = session(m, options=options), session(m, "CPUExecutionProvider", record=False)
    a = Buffers(mlx, cpu, 4)
    for pos in (3, 4, 5, 2, 3):
        a.step(pos, f"pos {pos}")
    writes = sum(r.direct_writes for r in direct_reader)
    assert (writes == 0) if options and "tuning" in options else (writes > 0)


def test_replayed_calls_write_large_results_directly(direct_reader):
    """A general group's steady calls (replays, ``Group._write_replayed``) and its first ones (``write_outputs``)
    write their result through the direct path; every answer is the CPU EP's."""
    import ortmlx.compiled as C
    from test_replay import mlp, replays_counted

    from ortmlx.testing import assert_close, session
    m = mlp()
    with C.capture() as rs:
        s = session(m)
    (runner,) = rs
    cpu = session(m, "CPUExecutionProvider", record=False)
    seen = replays_counted(runner)
    rng = np.random.default_rng(5)
    per_call = []
    for n in [4] * 5 + [1] + [6] * 3:                   # batch 1's 32-byte result is under the threshold
        f = {"x": rng.standard_normal((n, 16)).astype(np.float32)}
        assert_close(s.run(None, f)[0], cpu.run(None, f)[0], what=f"batch {n}")
        per_call.append(sum(r.direct_writes for r in direct_reader))
    assert any(seen), "no replay ran"
    assert np.diff([0] + per_call).tolist() == [1, 1, 1, 1, 1, 0, 1, 1, 1], per_call


def test_driver_memory_info():
    from ortmlx.kernels.cuda_driver import DriverError
    d = FakeDriver()
    assert Driver(d, ffi).mem_info() == (3 << 30, 8 << 30)
    d.fail = True
    with pytest.raises(DriverError):
        Driver(d, ffi).mem_info()
