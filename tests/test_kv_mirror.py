"""Device mirrors of buffers an output writes in place (genai's shared KV buffer, ep/mirror.py).

The buffer is bound as both the input and the output of a session (ORT IOBinding, what genai
does): after the first call the EP runs on its device copy and writes back only changed rows.
Every answer is checked against a NumPy model of the buffer, across rewinds, external writes
and buffer changes; the byte counters show O(changed rows) per call.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper

from ortmlx.runtime import residency
from ortmlx.testing import assignment, make_model, session

H, S, D = 2, 16, 8


def scatter_model():
    """present = ScatterND(past, idx, upd) * 1: writes one row per head; y = sum of present."""
    nodes = [helper.make_node("ScatterND", ["past", "idx", "upd"], ["present"]),
             helper.make_node("ReduceSum", ["present"], ["y"], keepdims=0)]
    return make_model(nodes, [("past", T.FLOAT, [1, H, S, D]), ("idx", T.INT64, [1, H, 3]),
                              ("upd", T.FLOAT, [1, H, D])],
                      [("present", T.FLOAT, [1, H, S, D]), ("y", T.FLOAT, [])])


class Buffer:
    """One KV-like buffer bound in place, and the NumPy truth of what it must hold."""

    def __init__(self, sess, seed=0):
        self.sess = sess
        self.rng = np.random.default_rng(seed)
        self.host = self.rng.standard_normal((1, H, S, D)).astype(np.float32)
        self.truth = self.host.copy()
        self.val = ort.OrtValue.ortvalue_from_numpy(self.host)     # wraps self.host (no copy)

    def step(self, pos: int):
        upd = self.rng.standard_normal((1, H, D)).astype(np.float32)
        idx = np.array([[[0, h, pos] for h in range(H)]], np.int64)
        b = self.sess.io_binding()
        b.bind_ortvalue_input("past", self.val)
        b.bind_cpu_input("idx", idx)
        b.bind_cpu_input("upd", upd)
        b.bind_ortvalue_output("present", self.val)
        b.bind_output("y")
        self.sess.run_with_iobinding(b)
        self.truth[0, :, pos, :] = upd[0]
        np.testing.assert_array_equal(self.host, self.truth)
        y = b.get_outputs()[1].numpy()
        np.testing.assert_allclose(y, self.truth.sum(dtype=np.float64), rtol=1e-5)


@pytest.fixture(autouse=True)
def always_diff(monkeypatch):
    """Diff even these small buffers (by default they are copied out whole)."""
    from ortmlx.runtime import group
    monkeypatch.setattr(group, "WHOLE_COPY_BYTES", [0, 0])


@pytest.fixture
def sess():
    s = session(scatter_model())
    assert assignment(s).get("MLXExecutionProvider", {}) == {"ScatterND": 1, "ReduceSum": 1}, assignment(s)
    return s


def test_rows_only_after_first_call(sess):
    buf = Buffer(sess)
    buf.step(0)                                 # first call: whole buffer in and out, mirror kept
    residency.reset()
    for pos in range(1, 6):
        buf.step(pos)
    got = residency.snapshot()
    row = H * D * 4
    # in: idx + upd only (the buffer comes from the mirror); out: the changed rows + y
    assert got["h2d_bytes"] == 5 * (H * 3 * 8 + H * D * 4), got
    assert got["d2h_bytes"] == 5 * (row + 4), got


def test_rewind_and_rewrite_same_row(sess):
    buf = Buffer(sess, 1)
    for pos in (0, 1, 2, 3, 1, 1, 0, 5, 2):
        buf.step(pos)


def test_external_write_is_seen(sess):
    """Host writes to checked rows (row 0, the rows written last) make the EP re-upload."""
    buf = Buffer(sess, 2)
    for pos in (0, 1, 2):
        buf.step(pos)
    for where in ((0, 0), (1, 4)):             # row 0 of head 0; then the row written last (step 4), head 1
        buf.host[0, where[0], where[1], :] += 1.0
        buf.truth[0, where[0], where[1], :] += 1.0
        residency.reset()
        buf.step(3)
        assert residency.snapshot()["h2d_bytes"] >= buf.host.nbytes     # re-uploaded whole
        buf.step(4)


def test_new_buffers_and_alternation(sess):
    """Two buffers used in turn (two generators on one session): each keeps its own mirror."""
    a, b = Buffer(sess, 3), Buffer(sess, 4)
    for pos in range(4):
        a.step(pos)
        b.step(S - 1 - pos)
    c = Buffer(sess, 5)                         # a third evicts the oldest: still right
    for pos in range(3):
        c.step(pos)
        a.step(pos + 8)
        b.step(pos + 2)


def test_not_aliased_is_a_plain_copy(sess):
    """An output in its own buffer is written whole; the input buffer is left alone."""
    buf = Buffer(sess, 6)
    buf.step(0)
    out = np.zeros_like(buf.host)
    before = buf.host.copy()
    b = sess.io_binding()
    b.bind_ortvalue_input("past", buf.val)
    b.bind_cpu_input("idx", np.array([[[0, h, 3] for h in range(H)]], np.int64))
    b.bind_cpu_input("upd", np.ones((1, H, D), np.float32))
    b.bind_ortvalue_output("present", ort.OrtValue.ortvalue_from_numpy(out))
    b.bind_output("y")
    sess.run_with_iobinding(b)
    want = before.copy()
    want[0, :, 3, :] = 1.0
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(buf.host, before)


def test_small_buffers_copied_whole(monkeypatch, sess):
    """Under the size threshold the buffer is copied out whole (mirror still used for input)."""
    from ortmlx.runtime import group
    monkeypatch.setattr(group, "WHOLE_COPY_BYTES", [1 << 20, 1 << 20])
    s = session(scatter_model())
    buf = Buffer(s, 8)
    buf.step(0)
    residency.reset()
    for pos in (1, 2, 1):
        buf.step(pos)
    got = residency.snapshot()
    assert got["h2d_bytes"] == 3 * (H * 3 * 8 + H * D * 4), got
    assert got["d2h_bytes"] == 3 * (buf.host.nbytes + 4), got


def test_kill_switch():
    s = session(scatter_model(), options={"tuning": "kv_mirror=0"})
    buf = Buffer(s, 7)
    buf.step(0)
    residency.reset()
    buf.step(1)
    assert residency.snapshot()["h2d_bytes"] >= buf.host.nbytes


@pytest.mark.parametrize("compiled", [False, True])
def test_changed_rows_matches_numpy(compiled):
    """The device diff's row ranges equal NumPy's over random edits (bit patterns: -0.0 != 0.0)."""
    import mlx.core as mx

    from ortmlx.runtime.mirror import changed_rows
    rng = np.random.default_rng(1)
    for _ in range(60):
        shape = (1, int(rng.integers(1, 4)), int(rng.integers(1, 9)), int(rng.integers(1, 5)))
        old = rng.standard_normal(shape).astype(np.float16)
        old[0, 0, 0, 0] = 0.0
        new = old.copy()
        for _ in range(int(rng.integers(0, 5))):
            new[0, rng.integers(shape[1]), rng.integers(shape[2]), rng.integers(shape[3])] += 1
        if rng.random() < 0.3:
            new[0, 0, 0, 0] = -0.0
        (got,) = changed_rows([(mx.array(new), mx.array(old))], compiled=compiled)
        flags = (new.view(np.uint16) != old.view(np.uint16)).any(-1).reshape(-1, shape[2])
        for l, row in enumerate(flags):
            idx = np.nonzero(row)[0]
            if len(idx):
                assert tuple(got[l]) == (idx[0], idx[-1] + 1), (got, flags)
            else:
                assert got[l, 0] >= got[l, 1], (got, flags)


@pytest.mark.parametrize("compiled", [False, True])
def test_predicted_rows_come_with_the_diff(compiled, monkeypatch):
    """With a predicted row, the diff's round trip brings that row of every pair's new array, pair after pair
    (on MLX's CUDA backend through our row kernel, not MLX's JIT gather)."""
    import mlx.core as mx

    from ortmlx.kernels import cuda_kernels as ck
    from ortmlx.runtime import mirror
    kernel = []
    real = ck.take_rows
    monkeypatch.setattr(ck, "take_rows", lambda *a: kernel.append(1) or real(*a))
    rng = np.random.default_rng(2)
    for dtype in (np.float16, np.float32):
        for row in (0, 3, 6):
            pairs, want = [], []
            for heads in (2, 3):
                old = rng.standard_normal((1, heads, 7, 4)).astype(dtype)
                new = old.copy()
                new[0, :, row] += 1
                pairs.append((mx.array(new), mx.array(old)))
                want.append(new[0, :, row:row + 1].tobytes())
            ranges, picked = mirror.changed_rows(pairs, compiled=compiled, predict=range(row, row + 1))
            assert picked.tobytes() == b"".join(want)
            for rng_ in ranges:
                assert (rng_ == [row, row + 1]).all(), ranges
    assert bool(kernel) == ck.usable()


def test_decode_steps_take_one_round_trip(sess, monkeypatch):
    """Rows written one after another: the diff brings the predicted next row along, so the
    second gather (write_rows) runs only when the prediction misses (a rewind)."""
    from ortmlx.runtime import group
    calls = []
    real = group.write_rows
    monkeypatch.setattr(group, "write_rows", lambda *a: calls.append(1) or real(*a))
    buf = Buffer(sess, 6)
    for pos in range(5):
        buf.step(pos)
    assert calls == [1], calls              # call 1 uploads whole; call 2 has no last range yet
    buf.step(1)                              # a rewind: predicted row 5, changed row 1
    assert calls == [1, 1], calls
    buf.step(2)                              # back in step
    assert calls == [1, 1], calls


B = 3


def batched_model():
    """The scatter model over a batch of B rows: each call writes one row per (batch row, head)."""
    nodes = [helper.make_node("ScatterND", ["past", "idx", "upd"], ["present"]),
             helper.make_node("ReduceSum", ["present"], ["y"], keepdims=0)]
    return make_model(nodes, [("past", T.FLOAT, [B, H, S, D]), ("idx", T.INT64, [B, H, 3]),
                              ("upd", T.FLOAT, [B, H, D])],
                      [("present", T.FLOAT, [B, H, S, D]), ("y", T.FLOAT, [])])


def _batched_step(sess, val, host, truth, rng, pos: list[int]):
    upd = rng.standard_normal((B, H, D)).astype(np.float32)
    idx = np.array([[[b, h, pos[b]] for h in range(H)] for b in range(B)], np.int64)
    io = sess.io_binding()
    io.bind_ortvalue_input("past", val)
    io.bind_cpu_input("idx", idx)
    io.bind_cpu_input("upd", upd)
    io.bind_ortvalue_output("present", val)
    io.bind_output("y")
    sess.run_with_iobinding(io)
    for b in range(B):
        truth[b, :, pos[b], :] = upd[b]
    np.testing.assert_array_equal(host, truth)


def test_a_batch_buffer_is_mirrored_and_checked_per_row():
    """A batch's shared buffer (genai's static batching: rows at their own positions) runs on its mirror with
    only the changed rows written back, and a host write into any batch row's checked rows is seen."""
    s = session(batched_model())
    rng = np.random.default_rng(7)
    host = rng.standard_normal((B, H, S, D)).astype(np.float32)
    truth = host.copy()
    val = ort.OrtValue.ortvalue_from_numpy(host)
    pos = [2, 5, 0]
    _batched_step(s, val, host, truth, rng, pos)                  # first call: whole buffer, mirror kept
    residency.reset()
    for _ in range(4):
        pos = [p + 1 for p in pos]
        _batched_step(s, val, host, truth, rng, pos)
    got = residency.snapshot()
    assert got["h2d_bytes"] == 4 * (B * H * 3 * 8 + B * H * D * 4), got     # idx and upd only: the mirror
    assert got["d2h_bytes"] == 4 * (B * H * D * 4 + 4), got                 # one row per (batch row, head)
    for b, row in ((2, pos[2]), (1, 0)):         # the row batch row 2 got last; then row 0 of batch row 1
        host[b, 1, row, :] += 1.0
        truth[b, 1, row, :] += 1.0
        residency.reset()
        pos = [p + 1 for p in pos]
        _batched_step(s, val, host, truth, rng, pos)
        assert residency.snapshot()["h2d_bytes"] >= host.nbytes        # re-uploaded whole
