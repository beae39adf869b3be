"""A prompt's KV rows into genai's buffers: block copies run together on threads (``runtime/group.py``,
``PARALLEL_HINT_BYTES``; ``devread.parallel_copies``), the same bytes as one NumPy assignment per buffer."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from ortmlx.compiled import core
from ortmlx.kernels import cuda_kernels
from ortmlx.runtime import devread, group
from ortmlx.runtime.mirror import write_hinted


def _jobs_over(dst: np.ndarray, src: np.ndarray, spans) -> list:
    return [(dst.ctypes.data + d, src.ctypes.data + s, n) for d, s, n in spans]


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_parallel_copies_copy_every_byte_once(threads, monkeypatch):
    """Blocks of odd sizes and gaps, cut across block edges into shares: every byte once, nothing between."""
    monkeypatch.setattr(devread, "_COPY_CHUNK_MIN", 4096)      # shares of a few pages: many cuts
    rng = np.random.default_rng(threads)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.full(1 << 21, 0xAB, np.uint8)
    spans, d, s = [], 5, 0
    while s < src.size - 70000:
        n = int(rng.integers(0, 70000))
        spans.append((d, s, n))
        d, s = d + n + int(rng.integers(0, 300)), s + n + int(rng.integers(0, 50))
    want = np.full_like(dst, 0xAB)
    for dd, ss, n in spans:
        want[dd:dd + n] = src[ss:ss + n]
    devread.parallel_copies(_jobs_over(dst, src, spans), threads)
    assert dst.tobytes() == want.tobytes()


def test_parallel_copies_use_the_pool(monkeypatch):
    monkeypatch.setattr(devread, "_COPY_CHUNK_MIN", 4096)
    names, real = set(), devread.ctypes.memmove

    def spy(d, s, n):
        names.add(threading.current_thread().name)
        return real(d, s, n)
    monkeypatch.setattr(devread.ctypes, "memmove", spy)
    src, dst = np.ones(64 << 10, np.uint8), np.zeros(64 << 10, np.uint8)
    devread.parallel_copies(_jobs_over(dst, src, [(0, 0, 32 << 10), (32 << 10, 32 << 10, 32 << 10)]), 4)
    assert dst.all()
    assert threading.current_thread().name in names
    if devread.COPY_THREADS > 1:
        assert any(n.startswith("ortmlx-copy") for n in names), names


@pytest.mark.parametrize("shape,starts,p", [((1, 2, 7, 4), [3], 16), ((3, 2, 5, 8), [0, 4, 11], 16),
                                            ((2, 1, 3, 2, 4), [1, 0], 9)])
def test_block_copies_write_what_the_assignment_writes(shape, starts, p):
    rng = np.random.default_rng(len(shape))
    rows = rng.standard_normal(shape).astype(np.float16)
    raw = rows.reshape(-1).view(np.uint8)
    start = np.array(starts, np.int32)
    a = rng.standard_normal(shape[:-2] + (p, shape[-1])).astype(np.float16)
    b = a.copy()
    ra = write_hinted(a, start, raw, shape)
    jobs = []
    rb = write_hinted(b, start, raw, shape, jobs)
    assert len(jobs) == np.prod(shape[:-2]) and not np.array_equal(a, b)      # b not yet written
    devread.parallel_copies(jobs)
    np.testing.assert_array_equal(ra, rb)
    assert a.tobytes() == b.tobytes()
    assert write_hinted(b, np.array([p - shape[-2] + 1] * shape[0], np.int32), raw, shape, jobs) is None


def _models():
    """The tiny Qwen2 on ORT's CPU EP and on the MLX EP (shared KV buffer, closures built in the call)."""
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install .[genai])")
    from test_compiled_genai import model_dir

    from ortmlx import genai as mg
    path = model_dir("qwen2")
    cfg = og.Config(path)
    cfg.clear_providers()
    model, _ = mg.load_model(path, "mlx", {"tuning": "build_behind=0"},
                             {"search": {"past_present_share_buffer": True}})
    return og.Model(cfg), model


@pytest.mark.genai
@pytest.mark.parametrize("borrow", [False, pytest.param(True, marks=pytest.mark.skipif(
    not cuda_kernels.usable(), reason="row hints reach host memory by a kernel on MLX's CUDA backend only"))])
def test_genai_prompts_write_their_rows_on_threads(monkeypatch, borrow):
    """Every per-buffer hinted write (a compiled prompt's rows) through the block copies (threshold 0, shares of a
    page): greedy tokens equal to ORT's CPU EP over prompts of several lengths, ORT's buffers holding the device
    result's rows when each becomes a mirror. ``borrow`` (GPU): every call without a call made ahead reads its
    rows in the closure's host buffer (``HINT_BORROW_MIN`` 0), decode steps too, whose batch copies them."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install .[genai])")
    from test_compiled_genai import greedy

    monkeypatch.setattr(group, "PARALLEL_HINT_BYTES", 0)
    monkeypatch.setattr(devread, "_COPY_CHUNK_MIN", 4096)
    if borrow:
        monkeypatch.setattr(core, "HINT_BORROW_MIN", 0)
    calls, real = [], devread.parallel_copies

    def spy(jobs, *a):
        calls.append(sum(n for _, _, n in jobs))
        return real(jobs, *a)
    monkeypatch.setattr(devread, "parallel_copies", spy)
    checked, store = [], group.MirrorSet.store

    def stored(self, i, addr, host, array, ranges):
        # ORT's buffer holds the device result's rows by the time it becomes the mirror
        if ranges is not None:
            h3, a3 = host.reshape(-1, *host.shape[-2:]), np.array(array).reshape(-1, *host.shape[-2:])
            for lead, (r0, r1) in enumerate(ranges.tolist()):
                assert h3[lead, r0:r1].tobytes() == a3[lead, r0:r1].tobytes(), (lead, r0, r1)
            checked.append(int(ranges[:, 1].max() - ranges[:, 0].min()))
        return store(self, i, addr, host, array, ranges)
    monkeypatch.setattr(group.MirrorSet, "store", stored)
    borrowed, write = [], group.Group.write_outputs

    def writes(self, result, *a, **k):
        if result.row_hints is not None:
            borrowed.append(result.row_hints.borrowed)
        return write(self, result, *a, **k)
    monkeypatch.setattr(group.Group, "write_outputs", writes)
    cpu, model = _models()
    rng = np.random.default_rng(7)
    for n in (40, 21, 40, 60, 9):         # a bucket's later prompts run its closure, whose rows come hinted
        ids = rng.integers(5, 400, n).astype(np.int32)
        assert greedy(model, ids) == greedy(cpu, ids), n
    assert calls and min(calls) > 0 and max(checked) > 1, (calls, checked)
    assert any(borrowed) == borrow, borrowed
    del model


@pytest.mark.genai
def test_genai_first_prompt_rows_go_in_one_batch(monkeypatch):
    """A first prompt's rows (its past buffers stood in by zeros) below ``PARALLEL_HINT_BYTES`` go the KV batch's way:
    greedy tokens equal to ORT's CPU EP, the batch taken by the next call, and at every take ORT's buffers hold the
    device mirrors' rows of the prompt."""
    import ctypes

    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install .[genai])")
    from test_compiled_genai import greedy

    from ortmlx.runtime import kvbatch
    prompt_batches, write_batch = [], group.Group._write_batch

    def batch(self, meta, flat, starts, ptrs, results, g, used, *a, **k):
        kb = write_batch(self, meta, flat, starts, ptrs, results, g, used, *a, **k)
        if isinstance(used, frozenset):         # (the standins: a first prompt)
            prompt_batches.append(kb is not None)
        return kb
    monkeypatch.setattr(group.Group, "_write_batch", batch)
    rows, taken, take = [0], [], kvbatch.KvBatches.take

    def took(self, *a, **k):
        b = take(self, *a, **k)
        if b is not None:
            L = b.layout
            for addr, shape, dtype, dev in zip(L.addrs.tolist(), L.shapes, L.dtypes, b.arrays):
                n = int(np.prod(shape)) * np.dtype(dtype).itemsize
                host = np.frombuffer((ctypes.c_char * n).from_address(addr), dtype).reshape(shape)
                assert host[..., :rows[0], :].tobytes() == np.array(dev)[..., :rows[0], :].tobytes()
            taken.append(rows[0])
        return b
    monkeypatch.setattr(kvbatch.KvBatches, "take", took)
    cpu, model = _models()
    rng = np.random.default_rng(11)
    for n in (40, 40, 21, 44, 30):
        ids = rng.integers(5, 400, n).astype(np.int32)
        rows[0] = n
        assert greedy(model, ids) == greedy(cpu, ids), n
    assert any(prompt_batches) and set(taken) >= {21, 30, 40, 44}, (prompt_batches, sorted(set(taken)))
    del model
