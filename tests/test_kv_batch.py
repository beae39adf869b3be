"""The batched copy-out of row-hinted KV buffers (ep/kvbatch.py).

Two GroupQueryAttention decode layers whose K/V buffers are bound as both past and present
(ORT IOBinding, as genai's shared buffer): after the closure is trusted, each call runs on the
batch's mirrors and writes the four new rows with one C copy. Every call is checked against the
CPU EP running the same bindings on its own buffers, across external writes, rewinds and two
buffer sets used in turn; the per-buffer path (``no_kv_batch=1``) gives the same bytes.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper

import ortmlx.compiled as C
from ortmlx.testing import assert_close, make_model, session

N, KVN, H, P, LAYERS = 4, 2, 16, 12, 2
CUDA = hasattr(mx, "cuda") and mx.cuda.is_available()


def two_layer_model():
    f = T.FLOAT
    nodes, ins, outs = [], [], []
    for li in range(LAYERS):
        nodes.append(helper.make_node(
            "GroupQueryAttention", [f"q{li}", f"k{li}", f"v{li}", f"past_key.{li}", f"past_value.{li}",
                                    "seqlens_k", "total_sequence_length"],
            [f"out{li}", f"present_key.{li}", f"present_value.{li}"], domain="com.microsoft",
            num_heads=N, kv_num_heads=KVN))
        ins += [(f"q{li}", f, ["batch_size", "sequence_length", N * H]),
                (f"k{li}", f, ["batch_size", "sequence_length", KVN * H]),
                (f"v{li}", f, ["batch_size", "sequence_length", KVN * H]),
                (f"past_key.{li}", f, ["batch_size", KVN, "past_sequence_length", H]),
                (f"past_value.{li}", f, ["batch_size", KVN, "past_sequence_length", H])]
        outs += [(f"out{li}", f, None), (f"present_key.{li}", f, None), (f"present_value.{li}", f, None)]
    ins += [("seqlens_k", T.INT32, ["batch_size"]), ("total_sequence_length", T.INT32, [])]
    return make_model(nodes, ins, outs, extra_opsets={"com.microsoft": 1})


class Buffers:
    """One generator's K/V buffers, bound in place in an MLX session and (copies) in a CPU EP session."""

    def __init__(self, mlx, cpu, seed: int):
        self.rng = np.random.default_rng(seed)
        self.sessions = (mlx, cpu)
        init = self.rng.standard_normal((2 * LAYERS, 1, KVN, P, H)).astype(np.float32)
        init[..., 3:, :] = 0.0                          # genai's buffers start zero past the prompt
        self.host = [init.copy(), init.copy()]          # [mlx's, cpu's], each (2*LAYERS, 1, KVN, P, H)
        self.vals = [[ort.OrtValue.ortvalue_from_numpy(h[k]) for k in range(2 * LAYERS)] for h in self.host]

    def write(self, layer: int, kv: int, row: int, delta: float = 1.0) -> None:
        """A host write into both copies (what a caller rewriting the buffer does)."""
        for h in self.host:
            h[2 * layer + kv, 0, :, row, :] += delta

    def step(self, past_len: int, what: str = "") -> None:
        feed = {}
        for li in range(LAYERS):
            feed[f"q{li}"] = self.rng.standard_normal((1, 1, N * H)).astype(np.float32)
            feed[f"k{li}"] = self.rng.standard_normal((1, 1, KVN * H)).astype(np.float32)
            feed[f"v{li}"] = self.rng.standard_normal((1, 1, KVN * H)).astype(np.float32)
        feed["seqlens_k"] = np.array([past_len], np.int32)
        feed["total_sequence_length"] = np.array(past_len + 1, np.int32)
        got = []
        for sess, vals in zip(self.sessions, self.vals):
            b = sess.io_binding()
            for name, x in feed.items():
                b.bind_cpu_input(name, x)
            for li in range(LAYERS):
                b.bind_output(f"out{li}")
            for li in range(LAYERS):
                for kv, nm in enumerate(("key", "value")):
                    b.bind_ortvalue_input(f"past_{nm}.{li}", vals[2 * li + kv])
                    b.bind_ortvalue_output(f"present_{nm}.{li}", vals[2 * li + kv])
            sess.run_with_iobinding(b)
            outs = b.get_outputs()
            got.append([outs[li].numpy() for li in range(LAYERS)])
        for li in range(LAYERS):
            assert_close(got[0][li], got[1][li], what=f"{what} layer {li} output")
        # rows up to the new one are what the CPU EP holds; later rows are never read (both leave the past's)
        np.testing.assert_array_equal(self.host[0][..., :past_len + 1, :], self.host[1][..., :past_len + 1, :],
                                      err_msg=f"{what}: buffers differ")


def sessions(options=None):
    m = two_layer_model()
    with C.capture() as rs:
        mlx = session(m, options=options)
    cpu = session(m, "CPUExecutionProvider", record=False)
    (att,) = [r for r in rs if hasattr(r, "decode")]
    return mlx, cpu, att


def counters(att) -> dict:
    return dict(att.decode.stats.groups[att.name]["kv_copy_out"])


@pytest.mark.parametrize("options", [None, {"tuning": "kv_batch=0"}, {"tuning": "pinned_hints=0"}],
                         ids=["batch", "per-buffer", "hints-on-device"])
def test_steady_decode_is_batched_and_right(options):
    mlx, cpu, att = sessions(options)
    buf = Buffers(mlx, cpu, 0)
    for pos in range(3, 10):
        buf.step(pos, f"pos {pos}")
    kv = counters(att)
    # on MLX's CUDA backend the hints' kernel writes page-locked host memory unless asked not to
    pinned = [c.sink is not None for c in att.decode.closures()]
    hints_on_device = (options or {}).get("tuning") == "pinned_hints=0"
    assert any(pinned) == (CUDA and not hints_on_device), pinned
    if options is None or hints_on_device:
        assert kv["batched"] >= 4 * 2 * LAYERS and kv["row_hints"] <= 2 * LAYERS, kv
    else:
        assert kv["batched"] == 0 and kv["row_hints"] >= 4 * 2 * LAYERS, kv


def test_external_writes_are_seen():
    """A host write to a checked row (row 0 of a block, the row written last) drops the batch:
    the buffers are uploaded again and every answer stays the CPU EP's."""
    mlx, cpu, att = sessions()
    buf = Buffers(mlx, cpu, 1)
    for pos in range(3, 7):
        buf.step(pos)
    before = counters(att)
    buf.write(1, 0, 0)                          # row 0 of layer 1's K buffer
    buf.step(7, "after a row-0 write")
    buf.step(8)
    buf.write(0, 1, 8)                          # the row written last, layer 0's V buffer
    buf.step(9, "after a last-row write")
    buf.step(10)
    after = counters(att)
    assert after["whole"] >= before["whole"] + 2 * 2 * LAYERS, (before, after)   # two full re-uploads
    assert after["batched"] > before["batched"], (before, after)


def test_rewind_and_two_buffer_sets():
    """Rows rewritten after a rewind, and two generators' buffers used in turn: each keeps its batch."""
    mlx, cpu, att = sessions()
    a, b = Buffers(mlx, cpu, 2), Buffers(mlx, cpu, 3)
    for pos in (3, 4, 5, 6, 4, 5, 2, 3):
        a.step(pos, f"a pos {pos}")
        b.step(pos + 2, f"b pos {pos + 2}")
    kv = counters(att)
    assert kv["batched"] >= 8 * 2 * LAYERS, kv
    c = Buffers(mlx, cpu, 4)                    # a third set evicts the oldest batch: still right
    for pos in (3, 4, 5):
        c.step(pos, "c")
        a.step(pos + 5, "a")
        b.step(pos + 6, "b")


def test_wrong_row_hints_poison_the_closure(monkeypatch):
    """Compute writes back only the hinted rows, so a verified call checks them against its presents:
    hints whose first byte is off poison the closure, and every answer (buffers included) stays right."""
    from ortmlx.compiled import trace
    real = trace._hint_arrays

    def off_by_one(hints, meta, *a, **k):       # the first hint's rows, before they are gathered
        hints = [(p, q, s, r + 1 if n == 0 else r) for n, (p, q, s, r) in enumerate(hints)]
        return real(hints, meta, *a, **k)
    monkeypatch.setattr(trace, "_hint_arrays", off_by_one)
    mlx, cpu, att = sessions()
    buf = Buffers(mlx, cpu, 5)
    for pos in range(3, 8):
        buf.step(pos, f"pos {pos}")
    why = att.decode.counters["poisoned"]
    assert "row hints of output" in why, why
    assert att.decode.counters["compiled_calls"] == 0, att.decode.counters


def _layout_and_buffers(rng, dtype=np.float16, kvh=2, p=9, h=8):
    """Two buffers (K, V) [1, kvh, p, h] and the Layout of their one-row hints (meta as RowHints makes it)."""
    from ortmlx.runtime.kvbatch import Layout
    bufs = [rng.standard_normal((1, kvh, p, h)).astype(dtype) for _ in range(2)]
    meta = [(j, j, (1, kvh, 1, h), np.dtype(dtype).itemsize) for j in range(2)]
    L = Layout(meta, [b.__array_interface__["data"][0] for b in bufs], [b.shape for b in bufs],
               [b.dtype for b in bufs])
    return L, bufs


def _kv_batches():
    from types import SimpleNamespace

    from ortmlx.ep import _shim
    from ortmlx.runtime.kvbatch import KvBatches
    lib = _shim.lib                             # only the block helpers: no ORT API needed
    return KvBatches(SimpleNamespace(ffi=_shim.ffi, copy_blocks=lib.ortmlx_copy_blocks,
                                     compare_blocks=lib.ortmlx_compare_blocks, kv_write=lib.ortmlx_kv_write))


# (starts, what the write does): in range -> rows written at those rows; out of range -> nothing written
WRITE_CASES = {
    "rows 3 and 5": (np.array([3, 5], np.int32), True),
    "row 0 (copies row 0 again)": (np.array([0, 8], np.int32), True),
    "a start past the buffer": (np.array([3, 9], np.int32), False),
    "a negative start": (np.array([-1, 2], np.int32), False),
    "int64 starts in range": (np.array([4, 1], np.int64), True),
    "an int64 start that narrows into range": (np.array([2, 2**32 + 1], np.int64), False),
}


@pytest.mark.parametrize("case", sorted(WRITE_CASES))
def test_write_rows_and_check(case):
    """``KvBatches.write`` (one C call): the rows land at each buffer's start row, nothing else changes, and
    the batch's check names row 0 of every block and the rows written; a start out of range writes nothing."""
    starts, fits = WRITE_CASES[case]
    rng = np.random.default_rng(3)
    L, bufs = _layout_and_buffers(rng)
    rows = [rng.standard_normal((1, 2, 1, 8)).astype(np.float16) for _ in range(2)]
    flat = np.concatenate([r.view(np.uint8).ravel() for r in rows])
    before = [b.copy() for b in bufs]
    kb = _kv_batches().write(L, flat, starts, ["r0", "r1"], None)
    if not fits:
        assert kb is None
        for b, b0 in zip(bufs, before):
            np.testing.assert_array_equal(b, b0)
        return
    want = [b.copy() for b in before]
    for w, r, s in zip(want, rows, starts.tolist()):
        w[0, :, s, :] = r[0, :, 0, :]
    for b, w in zip(bufs, want):
        np.testing.assert_array_equal(b, w)
    assert kb.arrays == ["r0", "r1"]
    dst, src, lens = kb.check
    nb = L.nblocks
    assert nb == 4 and dst.shape == src.shape == lens.shape == (2 * nb,)
    # every block's row 0 against its copy, then every written row against the hinted bytes: all equal now
    for d, s, n in zip(dst.tolist(), src.tolist(), lens.tolist()):
        assert bytes(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(d))) == \
            bytes(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(s)))
    assert dst[:nb].tolist() == L.base.tolist()
    assert dst[nb:].tolist() == [int(L.base[k]) + int(starts[k // 2]) * 16 for k in range(nb)]


def test_write_reuses_row0_only_when_no_start_is_0():
    """A batch written after one of the same layout keeps its row-0 copy, unless this write touched row 0."""
    rng = np.random.default_rng(4)
    L, bufs = _layout_and_buffers(rng)
    kv = _kv_batches()
    flat = rng.standard_normal(2 * 2 * 8).astype(np.float16).view(np.uint8)
    first = kv.write(L, flat, np.array([2, 2], np.int32), ["a", "b"], None)
    again = kv.write(L, flat, np.array([3, 3], np.int32), ["a", "b"], first)
    assert again.row0 is first.row0 and again.check[1][:L.nblocks].tolist() == first.row0[1].tolist()
    at0 = kv.write(L, flat, np.array([0, 3], np.int32), ["a", "b"], again)
    assert at0.row0 is not again.row0
    np.testing.assert_array_equal(at0.row0[3].view(np.float16).reshape(4, 8),
                                  np.stack([bufs[0][0, k, 0] for k in range(2)] + [bufs[1][0, k, 0] for k in range(2)]))


def test_write_a_batch_at_each_rows_start():
    """A batch's buffers (B = 3, rows at their own positions, genai's static batching): one C call writes each
    batch row's rows at its own start, nothing else changes; a start out of range for any row writes nothing."""
    from ortmlx.runtime.kvbatch import Layout
    rng = np.random.default_rng(5)
    b, kvh, p, h = 3, 2, 9, 8
    bufs = [rng.standard_normal((b, kvh, p, h)).astype(np.float16) for _ in range(2)]
    meta = [(j, j, (b, kvh, 1, h), 2) for j in range(2)]
    L = Layout(meta, [x.__array_interface__["data"][0] for x in bufs], [x.shape for x in bufs],
               [x.dtype for x in bufs])
    assert L.nblocks == 2 * b * kvh and L.max_start.shape == (2 * b,)
    rows = [rng.standard_normal((b, kvh, 1, h)).astype(np.float16) for _ in range(2)]
    flat = np.concatenate([r.view(np.uint8).ravel() for r in rows])
    starts = np.array([3, 0, 8, 5, 1, 2], np.int32)         # buffer 0's batch rows, then buffer 1's
    before = [x.copy() for x in bufs]
    assert _kv_batches().write(L, flat, np.array([3, 0, 9, 5, 1, 2], np.int32), ["r0", "r1"], None) is None
    for x, x0 in zip(bufs, before):
        np.testing.assert_array_equal(x, x0)
    kb = _kv_batches().write(L, flat, starts, ["r0", "r1"], None)
    assert kb is not None
    for k, (x, x0, r) in enumerate(zip(bufs, before, rows)):
        want = x0.copy()
        for row in range(b):
            want[row, :, starts[k * b + row], :] = r[row, :, 0, :]
        np.testing.assert_array_equal(x, want)


def _layout_by_buffer(meta, addrs, shapes):
    """Layout's C arrays built one buffer at a time (the definition the vectorized constructor must equal)."""
    import math
    nblk, max_start, rb, base, lens, rel_src, first = [], [], [], [], [], [], 0
    for (_, _, shape, isz), addr, hshape in zip(meta, addrs, shapes):
        heads, s, row, p = math.prod(shape[1:-2]), shape[-2], shape[-1] * isz, hshape[-2]
        for blk in range(shape[0] * heads):
            rb.append(row)
            base.append(addr + blk * p * row)
            lens.append(s * row)
            rel_src.append(first + blk * s * row)
        nblk += [heads] * shape[0]
        max_start += [p - s] * shape[0]
        first += math.prod(shape) * isz
    return nblk, max_start, rb, base, lens, rel_src, first


@pytest.mark.parametrize("seed", range(6))
def test_layout_blocks_are_each_buffers_in_turn(seed):
    from ortmlx.runtime.kvbatch import Layout
    rng = np.random.default_rng(seed)
    meta, addrs, shapes = [], [], []
    at = 1 << 40
    for k in range(int(rng.integers(1, 9))):
        b, s, h, isz = int(rng.integers(1, 4)), int(rng.integers(1, 40)), int(rng.choice([8, 64])), int(rng.choice([2, 4]))
        heads = tuple(int(x) for x in rng.integers(1, 4, int(rng.integers(1, 3))))
        p = s + int(rng.integers(0, 100))
        meta.append((2 * k, k + 1, (b, *heads, s, h), isz))
        shapes.append((b, *heads, p, h))
        addrs.append(at)
        at += int(np.prod(shapes[-1])) * isz + 4096
    L = Layout(meta, addrs, shapes, [np.float16] * len(meta))
    nblk, max_start, rb, base, lens, rel_src, first = _layout_by_buffer(meta, addrs, shapes)
    assert L.nblk.tolist() == nblk and L.max_start.tolist() == max_start and L.flat_bytes == first
    assert L.rb.tolist() == rb and L.base.tolist() == base and L.lens.tolist() == lens and L.rel_src.tolist() == rel_src
    assert L.nblk.dtype == np.int64 and L.max_start.dtype == np.int64
    assert {a.dtype for a in (L.rb, L.base, L.lens, L.rel_src)} == {np.dtype(np.uint64)}
    assert L.nblocks == len(rb) and L.row0_bytes == sum(rb)
