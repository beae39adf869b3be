"""Per-call memos of a steady decode step: after the gather, work is done again only for the inputs whose
address, dims or type changed since the previous call (``ep/compute.py``, ``compiled/core.py``,
``ep/kvbatch.py``). Each memo is checked against the computation it replaces, on random call sequences.
"""
from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from ortmlx.compiled import core, keys
from ortmlx.kernels import dtypes as dt
from ortmlx.compiled.result import RunResult
from ortmlx.ep import _shim, compute
from ortmlx.runtime.group import Group

FFI, LIB = _shim.ffi, _shim.lib
R = 16                                          # dims per input (the shim's ORTMLX_MAX_RANK)


def test_same_inputs_lists_every_changed_input():
    """``ortmlx_same_inputs`` lists, in order, every input whose address, rank, dims or type differs from the
    previous gather's, every omitted input, and every input when there is no previous gather."""
    n, rng = 7, random.Random(1)
    data, dims = FFI.new("const void*[]", n), FFI.new("int64_t[]", n * R)
    ndims, types = FFI.new("size_t[]", n), FFI.new("int[]", n)
    prev = (FFI.new("const void*[]", n), FFI.new("int64_t[]", n * R), FFI.new("size_t[]", n), FFI.new("int[]", n))
    changed = FFI.new("int32_t[]", n)
    last = None
    seen = set()
    for step in range(300):
        state = []
        for i in range(n):
            if last is not None and rng.random() < 0.6:
                s = last[i]                     # unchanged
            elif rng.random() < 0.1:
                s = None                        # omitted
            else:
                rank = rng.randrange(0, 4)
                s = (rng.choice([4096, 8192]), tuple(rng.choice([1, 2, 3]) for _ in range(rank)), rng.choice([1, 7]))
            state.append(s)
            if s is None:
                ndims[i], data[i], types[i] = FFI.cast("size_t", -1), FFI.NULL, 0
            else:
                data[i], types[i], ndims[i] = FFI.cast("void*", s[0]), s[2], len(s[1])
                for k, d in enumerate(s[1]):
                    dims[i * R + k] = d
        have = last is not None and step % 50 != 0
        k = LIB.ortmlx_same_inputs(n, R, data, dims, ndims, types, *prev, have, changed)
        want = [i for i in range(n) if not have or state[i] is None or state[i] != last[i]]
        assert FFI.unpack(changed, k) == want, (step, state, last)
        seen.add(len(want))
        last = state
    assert 0 in seen and n in seen and len(seen) > 3         # the sequence reached none, some and all changed


# ---------------------------------------------------------------- the runner's key
def _arrays(rng):
    """A random input: None, or a NumPy or MLX array of a random small shape and type."""
    if rng.random() < 0.1:
        return None
    shape = tuple(rng.choice([0, 1, 2, 3, 3]) for _ in range(rng.randrange(0, 4)))
    dtype = rng.choice([np.float32, np.float16, np.int64])
    a = np.zeros(shape, dtype)
    return mx.array(a) if rng.random() < 0.3 else a


def _same_kind(a, rng):
    """Another object of ``a``'s shape and type (a mirror standing in for a host buffer, or a new view)."""
    if a is None:
        return None
    host = np.zeros(a.shape, np.dtype(keys.dstr(a)))
    return mx.array(host) if rng.random() < 0.5 else host


KEY_MODES = {
    "shape-keyed": dict(shapeless=False, free=None),
    "shapeless, ranks only": dict(shapeless=True, free=None),
    "shapeless, free dims": dict(shapeless=True, free=frozenset({(0, 0), (1, 1), (2, 0), (2, 1)})),
}


def _key_runner(shapeless: bool, free, n: int):
    return keys.Keys(n, shapeless, free)


@pytest.mark.parametrize("mode", sorted(KEY_MODES))
def test_key_since_is_the_full_key(mode):
    """``Keys.since`` (the previous call's shapes and key, the inputs ``since`` names worked out again) gives
    the call's shapes and ``Keys.key``'s key, whether or not ``since`` continues the previous call."""
    n, rng = 6, random.Random(2)
    r = _key_runner(KEY_MODES[mode]["shapeless"], KEY_MODES[mode]["free"], n)
    inputs = [_arrays(rng) for _ in range(n)]
    token, reused, kept = 10, 0, 0
    for step in range(300):
        prev = token
        if step % 40 == 0:
            # a call the memo did not see (another runner's, or one that failed) changed every input
            inputs = [_arrays(rng) for _ in range(n)]
            prev = token + 1
            token += 1
        redo = sorted(i for i in range(n) if rng.random() < 0.3)
        nxt = list(inputs)
        for i in range(n):
            nxt[i] = _arrays(rng) if i in redo else _same_kind(inputs[i], rng)
        reused += r.memo[0] == prev
        token += 1
        before = r.memo[2]
        sig, k1, empty = r.since(nxt, (prev, token, redo))
        want_sig = keys.shapes_of(nxt)
        assert sig == want_sig
        want = r.key(nxt, want_sig)
        assert k1 == want, (step, redo)
        kept += k1 is before
        assert empty == any(a is not None and a.size == 0 for a in nxt), (step, redo)
        inputs = nxt
    assert reused > 200 and kept > 10


# ---------------------------------------------------------------- the address map
def _info(n: int):
    ci = object.__new__(compute.ComputeInfo)
    ci._tls = SimpleNamespace(b=SimpleNamespace(addr=np.zeros(n, np.uint64), redo=None, token=0, prev_token=-1,
                                                addr_memo=(-1, None, None)))
    return ci


def _maybe_buffer(rng):
    if rng.random() < 0.1:
        return None
    return np.zeros(rng.choice([(1, 4), (2, 4), (1, 0), (4,), (1, 2, 3)]), np.float32)


def test_addresses_memo_is_the_full_map():
    """``addresses`` kept from the previous gather (only the inputs in ``redo`` looked at again) is the map a
    fresh look at every input gives, including addresses two inputs share."""
    n, rng = 9, random.Random(3)
    ci = _info(n)
    b = ci._tls.b
    inputs = [_maybe_buffer(rng) for _ in range(n)]
    addr = [rng.choice([4096, 8192, 12288, 16384]) for _ in range(n)]
    changed_maps = 0
    last = None
    for step in range(300):
        redo = sorted(i for i in range(n) if rng.random() < 0.25)
        for i in redo:
            inputs[i] = _maybe_buffer(rng)
            addr[i] = rng.choice([4096, 8192, 12288, 16384])
        b.prev_token, b.token = b.token, b.token + 1
        if step % 30 == 15:
            # a gather whose call never reached ``addresses`` (it failed before) changed every input
            inputs = [_maybe_buffer(rng) for _ in range(n)]
            addr = [rng.choice([4096, 8192, 12288, 16384]) for _ in range(n)]
            b.prev_token, b.token = b.token, b.token + 1
        b.addr[:] = addr
        b.redo = None if step % 30 == 0 else redo              # a full gather now and then
        got = ci.addresses(inputs)
        want = {p: i for i, (a, p) in enumerate(zip(inputs, addr))
                if a is not None and a.size and a.ndim >= 2}
        assert got == want, (step, redo)
        changed_maps += got != last
        last = dict(got)
    assert changed_maps > 50


# ---------------------------------------------------------------- the outputs' shapes and kinds
class _Sink:
    """ORT's output buffers as the runtime asks for them (``runtime.group.OutputSink``): records the shapes."""

    def __init__(self):
        self.calls = []

    def allocate(self, shapes):
        self.calls.append([tuple(s) for s in shapes])
        return np.array([4096 * (j + 1) for j in range(len(shapes))], np.uint64)


def _group():
    g = object.__new__(Group)
    g._tls = threading.local()
    g._direct = False           # host copies only (devread's direct write: tests/test_devread.py)
    return g


def test_output_ptrs_memo_is_the_plain_classification():
    """With results from one closure (``source``: its outputs' kinds and types are fixed, shapes may change),
    the kept classification gives what looking at each result gives: which go back in place, the host
    copies, and the shapes ORT allocates."""
    rng = random.Random(4)
    kinds = {"A": [mx.float16, np.float32, mx.float32, mx.int32], "B": [np.float16, mx.float16, mx.float16]}
    memo, plain = _group(), _group()
    ms, ps = _Sink(), _Sink()
    for step in range(200):
        src = rng.choice(sorted(kinds))
        res = []
        for k in kinds[src]:
            shape = rng.choice([(1, 2, 3), (2, 2, 3), (1, 0, 3), (1, 3), (3,)])
            a = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + step
            res.append(mx.array(a).astype(k) if isinstance(k, mx.Dtype) else a.astype(k))
        addrs = {4096: 0} if rng.random() < 0.8 else {}
        # the same source object for every result list of this "closure"
        p1, h1, s1 = memo._output_ptrs(RunResult(res, source=kinds[src]), ms, None, addrs)
        p2, h2, s2 = plain._output_ptrs(RunResult(list(res)), ps, None, addrs)
        assert s1 == s2 and p1.tolist() == p2.tolist(), step
        assert ms.calls[-1] == ps.calls[-1]
        assert sorted(h1) == sorted(h2) == list(range(len(res)))
        for j in h2:
            assert (h1[j] is None) == (h2[j] is None), (step, j)
            if h2[j] is not None:
                np.testing.assert_array_equal(h1[j], h2[j])
    assert memo._tls.out_memo[0] is not None


# ---------------------------------------------------------------- the KV batch a call takes
def test_take_since_trusts_only_the_previous_gather():
    """``KvBatches.take(since=)`` skips looking at each buffer only for a batch left by the previous gather's
    call when none of its buffers changed; otherwise the buffers are looked at (and a mismatch takes nothing)."""
    from test_kv_batch import _kv_batches, _layout_and_buffers
    rng = np.random.default_rng(6)
    L, bufs = _layout_and_buffers(rng)
    addr = np.array([b.__array_interface__["data"][0] for b in bufs], np.uint64)
    kv = _kv_batches()
    flat = rng.standard_normal(2 * 2 * 8).astype(np.float16).view(np.uint8)

    def left(token):
        kv.clear()
        kb = kv.write(L, flat, np.array([2, 2], np.int32), ["a", "b"], None)
        kv.put(kb, token)
        return kb

    other = [np.zeros((1, 2, 9, 4), np.float16), bufs[1]]      # input 0: another shape at the same address
    kb = left(5)
    assert kv.take(other, addr, (5, [])) is kb                  # trusted: the previous gather, nothing changed
    left(5)
    assert kv.take(other, addr, (5, [0])) is None               # input 0 changed: looked at, and it differs
    left(5)
    assert kv.take(other, addr, (4, [])) is None                # not the previous gather's batch: looked at
    kb = left(5)
    assert kv.take(bufs, addr, (4, [0, 1])) is kb               # looked at, and they are its buffers


# ---------------------------------------------------------------- the closure's device inputs
@pytest.mark.parametrize("idx", [(), (2,), (0, 2, 3), (3, 1)])
def test_picker_gives_a_tuple(idx):
    xs = ["a", "b", "c", "d"]
    assert core.picker(idx)(xs) == tuple(xs[i] for i in idx)


def test_device_inputs_memo_uploads_exactly_the_host_arrays():
    """``_upload`` keeps which of a closure's inputs were host arrays while the inputs' types repeat;
    each call's device inputs are the MLX arrays as given and the host arrays uploaded, whatever mix comes."""
    rng = random.Random(8)
    c = core._Closure((0, 2, 3, 5), {})
    runner = SimpleNamespace(_in_types=[None] * 6, program=SimpleNamespace(upload=dt.to_mx))
    for step in range(100):
        inputs = []
        for i in range(6):
            a = np.full((1, 2), step * 10 + i, np.float32)
            inputs.append(mx.array(a) if rng.random() < 0.5 else a)
        got = core.CompiledSubgraph._upload(runner, c, list(c.pick(inputs)))
        assert len(got) == 4
        for k, i in enumerate(c.dev_idx):
            assert isinstance(got[k], mx.array)
            if isinstance(inputs[i], mx.array):
                assert got[k] is inputs[i]
            np.testing.assert_array_equal(np.array(got[k]), np.asarray(inputs[i]))


def test_layout_span_only_for_consecutive_inputs():
    from ortmlx.runtime.kvbatch import Layout
    bufs = [np.zeros((1, 2, 9, 8), np.float16) for _ in range(3)]
    addrs = [b.__array_interface__["data"][0] for b in bufs]

    def layout(ins):
        meta = [(j, i, (1, 2, 1, 8), 2) for j, i in enumerate(ins)]
        return Layout(meta, addrs, [b.shape for b in bufs], [b.dtype for b in bufs])
    assert layout([4, 5, 6]).in_span == (4, 7)
    assert layout([4, 6, 5]).in_span is None
    assert layout([1, 2, 4]).in_span is None
