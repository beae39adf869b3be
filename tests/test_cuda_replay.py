"""A step of our kernels replayed as one CUDA graph (``ortmlx/kernels/cuda_replay.py``).

The launch check (``plan``), ``compiled/replay.py``'s KV sets, check and serve (on stand-ins for the replay and the
address read) and the decode runner's hooks (a stand-in replay in a genai decode) run everywhere; the replay itself
needs MLX's CUDA backend: a decode layer of our kernels (embedding row, norm + QKV product, fused RoPE attention
with its KV buffers written in place, output product, norm + gated MLP, down product) recorded twice, replayed, and
compared bit for bit with MLX running the same step on a third set of inputs, two steps in a row.
"""
from __future__ import annotations

import time
import types

import cffi
import mlx.core as mx
import numpy as np
import pytest

from ortmlx.kernels import consts, cuda_kernels, cuda_replay, cuda_rows
from ortmlx.kernels.cuda_replay import ArrayInfo, Launch, Ref, Refused, plan


class _Kernel:
    def __init__(self, name, ins, outs, contiguous=True):
        self.name, self.input_names, self.output_names, self.contiguous = name + "_abc", ins, outs, contiguous
        self.in_place, self.source = {}, ""


_K = _Kernel("k", ["x", "w"], ["y"])


def _launch(kernel, inputs, outputs, template=(("T", 1),), grid=(256, 1, 1)):
    return Launch(kernel, template, grid, (256, 1, 1), tuple(inputs), tuple(outputs), (mx.float32,), ())


def _info(addr, shape=(4,), strides=None):
    return ArrayInfo(addr, shape, strides or tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape))), 4)


def _step(base: int, w, const_addr: int, infos: dict, mlx_made: bool = False):
    """x (a step input) -> k(x, w) -> y1 -> k(y1, w) -> y2; ``mlx_made``: the second launch reads an array no
    launch made (an MLX op's result)."""
    x, y1, y2, z = (mx.zeros((4,)) for _ in range(4))
    infos.update({id(x): _info(base), id(y1): _info(base + 64), id(y2): _info(base + 128), id(z): _info(base + 192),
                  id(w): _info(const_addr)})
    return [x], [_launch(_K, [x, w], [y1]), _launch(_K, [z if mlx_made else y1, w], [y2])]


def test_plan_names_each_pointer():
    w, infos = mx.zeros((4,)), {}
    ins_a, a = _step(1000, w, 50, infos)
    ins_b, b = _step(5000, w, 50, infos)
    refs = plan(a, b, infos, (ins_a, ins_b))
    assert refs == [[Ref("input", 0, 0, 0), Ref("const", 0, 0, 0), Ref("out", 0, 0, 0)],
                    [Ref("out", 0, 0, 0), Ref("const", 0, 0, 0), Ref("out", 1, 0, 0)]]


def test_plan_refuses_an_array_no_launch_made():
    w, infos = mx.zeros((4,)), {}
    ins_a, a = _step(1000, w, 50, infos, mlx_made=True)
    ins_b, b = _step(5000, w, 50, infos, mlx_made=True)
    with pytest.raises(Refused, match="launch 1 .*input x .*: made by an operation that is not a kernel of ours"):
        plan(a, b, infos, (ins_a, ins_b))


def test_plan_refuses_a_moved_constant_and_other_launches():
    w1, w2, infos = mx.zeros((4,)), mx.zeros((4,)), {}
    ins_a, a = _step(1000, w1, 50, infos)
    ins_b, b = _step(5000, w2, 60, infos)
    with pytest.raises(Refused, match="input w .*: made by an operation"):
        plan(a, b, infos, (ins_a, ins_b))
    ins_b, b = _step(5000, w1, 50, infos)
    b[1] = _launch(_K, b[1].inputs, b[1].outputs, grid=(512, 1, 1))
    with pytest.raises(Refused, match="launch 1 .*launched it otherwise"):
        plan(a, b, infos, (ins_a, ins_b))
    with pytest.raises(Refused, match="2 and 1 launches"):
        plan(a, b[:1], infos, (ins_a, ins_b))


def test_plan_refuses_a_strided_input_to_a_kernel_that_mlx_copies_it_for():
    w, infos = mx.zeros((4,)), {}
    ins_a, a = _step(1000, w, 50, infos)
    ins_b, b = _step(5000, w, 50, infos)
    for x in (ins_a[0], ins_b[0]):
        infos[id(x)] = _info(infos[id(x)].address, (2, 2), (1, 2))
    with pytest.raises(Refused, match="strides \\(1, 2\\)"):
        plan(a, b, infos, (ins_a, ins_b))
    loose = _Kernel("k", ["x", "w"], ["y"], contiguous=False)
    a = [_launch(loose, ln.inputs, ln.outputs) for ln in a]
    b = [_launch(loose, ln.inputs, ln.outputs) for ln in b]
    assert plan(a, b, infos, (ins_a, ins_b))[0][0] == Ref("input", 0, 0, 0)


def test_plan_finds_views_inside_outputs_and_inputs():
    w, infos = mx.zeros((4,)), {}
    ins_a, a = _step(1000, w, 50, infos)
    ins_b, b = _step(5000, w, 50, infos)
    for base, lns in ((1000, a), (5000, b)):
        v = mx.zeros((2,))
        infos[id(v)] = _info(base + 64 + 8, (2,))       # the last two elements of the first launch's output
        lns[1] = _launch(_K, [v, w], lns[1].outputs)
    assert plan(a, b, infos, (ins_a, ins_b))[1][0] == Ref("out", 0, 0, 8)


def test_row_contiguous_ignores_unit_dims():
    assert ArrayInfo(0, (1, 896), (1152, 1), 2).row_contiguous
    assert not ArrayInfo(0, (896, 4), (1, 896), 2).row_contiguous
    assert ArrayInfo(0, (2, 1, 3), (3, 7, 1), 4).extent == 24


class _Lib:
    """The driver calls a ``Replay``'s ``write`` and ``launch`` make, noted."""

    def __init__(self):
        self.calls = []

    def cuMemcpyHtoDAsync_v2(self, dst, src, n, stream):
        self.calls.append(("copy", dst, int(cffi.FFI().cast("uintptr_t", src)), n))
        return 0

    def cuMemcpyDtoH_v2(self, dst, src, n):
        self.calls.append(("read", int(cffi.FFI().cast("uintptr_t", dst)), src, n))
        return 0

    def cuGraphLaunch(self, exec_, stream):
        self.calls.append(("launch",))
        return 0


def test_staged_inputs_are_written_to_host_memory_and_copied_in_runs():
    """Tuning replay_staged_feed: the page-locked memory starts as the arena's step inputs (read once), ``write``
    puts each staged input there at its offset, and the next ``launch`` copies each run of them before the graph
    (a run ends at an input a kernel writes over, which is written as before); a launch with nothing written
    copies nothing; an input outside the arena (a KV buffer) takes no part."""
    lib = _Lib()
    r = cuda_replay.Replay(types.SimpleNamespace(current=lambda: None), lib, cffi.FFI())
    r.arena = 1 << 20
    r.input_keys, r.input_bytes = ["ids", "kv", "len", "past", "pos"], [8, 64, 4, 256, 4]
    r.addr = {"ids": r.arena + 256, "kv": 7 << 30, "len": r.arena + 512, "past": r.arena + 768,
              "pos": r.arena + 1024, "present": r.arena + 768}
    r.external, r.same = {"kv"}, {"present": "past"}
    made = []

    def buffer(drv, n):
        b = types.SimpleNamespace(array=np.zeros(n, np.uint8), nbytes=n, host_address=0x5000, free=lambda: None)
        made.append(b)
        return b
    r.stage_inputs(buffer)
    assert len(made) == 1 and made[0].nbytes == 1024 + 4 - 256 and r.stage_at == {0: 0, 2: 256, 4: 768}
    assert r.stage_runs == [(256, 516), (1024, 1028)]
    assert lib.calls == [("read", 0x5000, r.arena + 256, 772)]
    lib.calls.clear()
    r.write(0, np.array([[7]], np.int64))
    r.write(2, np.array([9], np.int32))
    r.write(4, np.array([5], np.int32))
    assert lib.calls == [] and made[0].array[:8].view(np.int64).tolist() == [7]
    assert made[0].array[256:260].view(np.int32).tolist() == [9] and made[0].array[768:772].tolist() == [5, 0, 0, 0]
    r.write(3, np.zeros(64, np.float32))        # (written over in place: not staged)
    assert lib.calls == [("copy", r.arena + 768, lib.calls[0][2], 256)]
    lib.calls.clear()
    r.launch()
    r.launch()
    assert lib.calls == [("copy", r.arena + 256, 0x5000, 260), ("copy", r.arena + 1024, 0x5000 + 768, 4),
                         ("launch",), ("launch",)]
    with pytest.raises(ValueError, match="step input 2: 8 bytes for an array of 4"):
        r.write(2, np.array([1], np.int64))


def test_every_kernel_waits_for_the_one_before_until_it_reads_its_output():
    """``PRIOR_WAIT`` (what a replay's programmatic launches need: tuning replay_pdl): a body without it gets it
    first; the row products place it once, after their first weight loads (constants) and before they make the
    row from what the kernel before wrote."""
    from ortmlx.kernels.cuda_kernels import PRIOR_WAIT, with_prior_wait
    assert with_prior_wait("out[0] = x[0];") == PRIOR_WAIT + "out[0] = x[0];"
    for src, reads in ((cuda_rows.NORM_SOURCE, "xr[j * xs]"), (cuda_rows.SWIGLU_SOURCE, "gv[i] = "),
                       (cuda_rows.ROW_SOURCE, "reinterpret_cast<uint4*>(ar)[c] = ")):
        assert with_prior_wait(src) == src and src.count(PRIOR_WAIT) == 1
        assert src.index("wr[q][c] = wv[") < src.index(PRIOR_WAIT) < src.index(reads)


class _CaptureLib:
    """The driver calls ``Replay._capture`` makes, noted: each launch as (call, grid, block, attributes)."""

    def __init__(self):
        self.launches = []

    def cuStreamBeginCapture_v2(self, stream, mode):
        return 0

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        self.launches.append(("plain", (gx, gy, gz), (bx, by, bz), []))
        return 0

    refuse_ex = 0                       # a CUresult for cuLaunchKernelEx to return (0: it succeeds)
    destroyed = 0

    def cuLaunchKernelEx(self, config, f, params, extra):
        attrs = [(config.attrs[i].id, config.attrs[i].value.allowed) for i in range(config.n_attrs)]
        self.launches.append(("ex", (config.gx, config.gy, config.gz), (config.bx, config.by, config.bz), attrs))
        return self.refuse_ex

    def cuStreamEndCapture(self, stream, graph):
        graph[0] = cffi.FFI().cast("void*", 1)
        return 0

    def cuGraphInstantiateWithFlags(self, exec_, graph, flags):
        return 0

    def cuGraphDestroy(self, graph):
        self.destroyed += 1
        return 0


@pytest.mark.parametrize("pdl", [False, True])
def test_capture_makes_every_launch_after_the_first_programmatic_with_pdl(pdl):
    """Tuning replay_pdl: the first launch as before, each later one through ``cuLaunchKernelEx`` with the
    programmatic-serialization attribute and its own grid and block; without it every launch is plain."""
    ffi = cffi.FFI()
    ffi.cdef(cuda_replay.DRIVER_CDEF)
    lib = _CaptureLib()
    r = cuda_replay.Replay(types.SimpleNamespace(current=lambda: None), lib, ffi)
    r.stream, r.pdl = ffi.cast("void*", 7), pdl
    r.specs = [("f0", (4, 1, 1), (256, 1, 1), []), ("f1", (528, 2, 1), (128, 1, 1), []),
               ("f2", (1, 1, 1), (32, 1, 1), [])]
    r._capture()
    grids = [(g, b) for _, g, b, _ in lib.launches]
    assert grids == [((4, 1, 1), (256, 1, 1)), ((528, 2, 1), (128, 1, 1)), ((1, 1, 1), (32, 1, 1))]
    kinds = [(k, a) for k, _, _, a in lib.launches]
    attr = [(cuda_replay.ATTR_PROGRAMMATIC, 1)]
    assert kinds == ([("plain", []), ("ex", attr), ("ex", attr)] if pdl else [("plain", [])] * 3)
    assert r.launches == 3 and r.pdl == pdl and not r.pdl_refused


def test_a_programmatic_capture_the_driver_refuses_is_made_plain():
    ffi = cffi.FFI()
    ffi.cdef(cuda_replay.DRIVER_CDEF)
    lib = _CaptureLib()
    lib.refuse_ex = 801                 # CUDA_ERROR_NOT_SUPPORTED
    r = cuda_replay.Replay(types.SimpleNamespace(current=lambda: None), lib, ffi)
    r.stream, r.pdl = ffi.cast("void*", 7), True
    r.specs = [("f0", (4, 1, 1), (256, 1, 1), []), ("f1", (8, 1, 1), (128, 1, 1), [])]
    r._capture()
    assert [k for k, *_ in lib.launches] == ["plain", "ex", "plain", "plain"] and lib.destroyed == 1
    assert not r.pdl and r.pdl_refused == "cuLaunchKernelEx failed with CUresult 801" and r.launches == 2


# ---- StepReplay's KV sets (compiled/replay.py), on stand-ins for the replay and the address read ----

class _FakeReplay:
    """What ``StepReplay._feed`` asks of a ``cuda_replay.Replay``, noted in ``log``."""

    def __init__(self, external: dict):
        self.addr = {0: 900}                    # the host input's place in the arena
        self.addr.update(external)
        self.log: list = []

    def input_address(self, m):
        return self.addr[m]

    def rebind(self, external):
        self.addr.update(external)
        self.log.append(("rebind", dict(external)))

    def copy(self, dst, src, n):
        self.log.append(("copy", dst, src, n))

    def upload(self, dst, values):
        self.log.append(("upload", dst, values.nbytes))

    def write(self, m, values):
        self.log.append(("write", m, values.dtype, values.tobytes()))


_KV = (1, 2, 8, 4)


@pytest.fixture
def step_replay(monkeypatch):
    """A StepReplay as ``_build`` leaves it: a host int32 input (0) and two float16 KV buffers (1, 2) in a set of
    its own; an array's address is its id."""
    from ortmlx.compiled import replay

    def describe(arrays):
        return [ArrayInfo(id(a), tuple(a.shape), tuple(int(np.prod(a.shape[i + 1:])) for i in range(a.ndim)),
                          a.dtype.size) for a in arrays]
    monkeypatch.setattr(cuda_replay, "describe", describe)
    rp = replay.StepReplay(3)
    rp.record_inputs([((1, 1), mx.int32), (_KV, mx.float16), (_KV, mx.float16)])
    rp.kv, external = rp._new_set({1: mx.zeros(_KV, mx.float16), 2: mx.zeros(_KV, mx.float16)})
    rp.replay = _FakeReplay(external)
    return rp


def _ids(v=7):
    return np.array([[v]], np.int32)


def _addrs(kv):
    return {m: id(a) for m, a in kv.items()}


def test_a_call_on_the_pasts_it_handed_out_writes_its_host_inputs_only(step_replay):
    rp = step_replay
    assert rp._feed([_ids(), rp.kv[1], rp.kv[2]]) and not rp.copy
    assert rp.replay.log == [("write", 0, np.dtype(np.int32), _ids().tobytes())]


def test_other_pasts_are_copied_into_a_set_no_one_holds(step_replay):
    rp = step_replay
    first = rp.kv
    mirror = [first[1], first[2]]               # the runtime keeps the presents it was handed
    other = [mx.ones(_KV, mx.float16), mx.ones(_KV, mx.float16)]
    mx.eval(other)
    assert rp._feed([_ids(), *other]) and rp.copy
    second = rp.kv
    assert second is not first and len(rp.kv_sets) == 2          # the held set is left alone
    nbytes = other[0].nbytes
    assert rp.replay.log[:3] == [("rebind", _addrs(second)), ("copy", id(second[1]), id(other[0]), nbytes),
                                 ("copy", id(second[2]), id(other[1]), nbytes)]
    # the runtime now holds the second set and lets the first go: other pasts go into the first, made no more
    mirror = [second[1], second[2]]
    rp.replay.log.clear()
    assert rp._feed([_ids(), *other]) and rp.copy
    assert rp.kv is first and len(rp.kv_sets) == 2
    assert rp.replay.log[0] == ("rebind", _addrs(first))
    # pasts that are the second set (the mirror it handed out) take it back without a copy
    rp.replay.log.clear()
    assert rp._feed([_ids(), *mirror]) and not rp.copy and rp.kv is second
    assert [e[0] for e in rp.replay.log] == ["rebind", "write"]


def test_host_pasts_are_uploaded_and_a_full_house_declines(step_replay):
    from ortmlx.compiled import replay
    rp = step_replay
    host = [np.ones(_KV, np.float16), np.ones(_KV, np.float16)]
    held = [rp.kv[1], rp.kv[2]]
    assert rp._feed([_ids(), *host]) and rp.copy
    assert [e[0] for e in rp.replay.log] == ["rebind", "upload", "upload", "write"]
    while len(rp.kv_sets) < replay.KV_SETS:     # every set held elsewhere, as many as it may make
        held += [rp.kv[1], rp.kv[2]]
        assert rp._feed([_ids(), *host])
    held += [rp.kv[1], rp.kv[2]]
    n = len(rp.replay.log)
    assert not rp._feed([_ids(), *host])
    assert len(rp.kv_sets) == replay.KV_SETS and len(rp.replay.log) == n


def test_a_call_unlike_the_recorded_ones_is_declined(step_replay):
    rp = step_replay
    kv = [rp.kv[1], rp.kv[2]]
    assert not rp._feed([_ids(), *kv][:2])                               # an input fewer
    assert not rp._feed([np.zeros((1, 2), np.int32), *kv])               # another shape
    assert not rp._feed([mx.array(_ids()), *kv])                         # a device array where a host one was
    assert not rp._feed([_ids(), kv[0].astype(mx.float32), kv[1]])       # a KV buffer of another type
    assert rp.replay.log == []


class _Closure:
    """What ``StepReplay.check`` / ``serve`` read of a decode closure: its host buffer's layout (one float16 host
    output of 4 at bytes 0..8, then the row hints at 16: output 1's and 2's new rows over inputs 1 and 2)."""

    def __init__(self):
        self.host_outs = [(0, 0, 8, (1, 4), np.float16)]
        self.hints = [(1, 1, (1, 4), 2), (2, 2, (1, 4), 2)]
        self.hint_starts = np.zeros(2, np.int64)
        self.hint_at = 16
        self.sink = types.SimpleNamespace(array=np.zeros(64, np.uint8))


def _answer(buf, v):
    """A call's answer in a host buffer: logits ``v`` and both new rows ``v + 1``, start 3."""
    buf[0:8] = np.full(4, v, np.float16).view(np.uint8)
    buf[16:32] = np.full(8, v + 1, np.float16).view(np.uint8)
    buf[32:36] = np.array([3], np.int32).view(np.uint8)


def test_the_replay_serves_only_after_it_gave_the_closures_bytes(step_replay):
    from ortmlx.compiled import replay
    rp, c = step_replay, _Closure()
    rp.sink = types.SimpleNamespace(array=np.zeros(64, np.uint8))
    rp.kv_out = {1: 1, 2: 2}
    got = [5.0]
    rp.replay.launch = lambda: _answer(rp.sink.array, got[0])
    rp.replay.wait = lambda: None
    _answer(c.sink.array, 5.0)
    rp.check(c, [_ids(), rp.kv[1], rp.kv[2]])
    assert rp.serving() and rp.refused is None
    status, outs, hints = rp.serve(c, [_ids(), rp.kv[1], rp.kv[2]], None)
    assert status == replay.SERVED and outs[1] is rp.kv[1] and outs[2] is rp.kv[2]
    assert outs[0].tolist() == [[5.0] * 4] and not outs[0].flags.writeable
    rows, starts = hints.split(hints.data)
    assert rows.view(np.float16).tolist() == [6.0] * 8 and starts.tolist() == [3, 3]
    got[0] = 7.0                                # the replay's own buffer is rewritten; the hints were copied
    rp.serve(c, [_ids(), rp.kv[1], rp.kv[2]], None)
    assert rows.view(np.float16).tolist() == [6.0] * 8
    assert rp.serve(c, [_ids(), rp.kv[1]], None)[0] == replay.DECLINED


def test_a_false_guard_launches_nothing_and_a_true_one_serves(step_replay):
    from ortmlx.compiled import replay
    rp, c = step_replay, _Closure()
    rp.sink = types.SimpleNamespace(array=np.zeros(64, np.uint8))
    rp.kv_out, rp.checked = {1: 1, 2: 2}, True
    launched, asked = [], []
    rp.replay.launch = lambda: launched.append(1) or _answer(rp.sink.array, 5.0)
    rp.replay.wait = lambda: None
    verdict = [False]
    rp.guard = lambda *dev: asked.append(dev) or mx.array(verdict[0])
    dev = [_ids(), rp.kv[1], rp.kv[2]]
    assert rp.serve(c, dev, lambda: ["guard inputs"]) == (replay.GUARD_FAILED, None, None)
    assert launched == [] and asked == [("guard inputs",)] and rp.calls == 0
    verdict[0] = True
    status, outs, _ = rp.serve(c, dev, lambda: ["guard inputs"])
    assert status == replay.SERVED and launched == [1] and outs[0].tolist() == [[5.0] * 4]
    assert rp.calls == 1 and all(rp.spent[k] >= 0 for k in replay.SPENT) and rp.spent["guard"] > 0


def test_a_host_guard_answers_for_the_device_guard_once_it_agreed(step_replay, monkeypatch):
    """Tuning replay_host_guard: the guard built without our kernels, on MLX's CPU stream, is tried on the checked
    call; agreeing, it alone is asked at served calls (its inputs as MLX arrays: host arrays copied); saying no
    there, failing or slower than the limit, the device guard stays, the reason kept."""
    from ortmlx.compiled import replay
    monkeypatch.setattr(replay, "HOST_GUARD_MAX_S", 1.0)     # (a busy test box must not make the fast one slow)
    rp, c = step_replay, _Closure()
    rp.sink = types.SimpleNamespace(array=np.zeros(64, np.uint8))
    rp.kv_out = {1: 1, 2: 2}
    rp.replay.launch = lambda: _answer(rp.sink.array, 5.0)
    rp.replay.wait = lambda: None
    _answer(c.sink.array, 5.0)
    dev, seen = [_ids(), rp.kv[1], rp.kv[2]], []

    def host(*args):
        seen.append([type(a) for a in args])
        return mx.array(verdict[0])
    verdict = [True]
    rp.host_guard, rp.guard = host, lambda *a: pytest.fail("the device guard was asked")
    rp.check(c, dev)
    assert rp.serving() and rp.guard_kind == "host" and seen == [[mx.array] * 3] * 2
    assert rp.serve(c, dev, None)[0] == replay.SERVED
    verdict[0] = False
    assert rp.serve(c, dev, None) == (replay.GUARD_FAILED, None, None) and len(seen) == 4
    monkeypatch.setattr(replay, "HOST_GUARD_MAX_S", 0.01)

    def slow(*a):
        time.sleep(2 * replay.HOST_GUARD_MAX_S)
        return mx.array(True)
    for bad, why in ((lambda *a: mx.array(False), "it said no to a call the closure's guard took"),
                     (lambda *a: 1 / 0, "ZeroDivisionError: division by zero"), (slow, "it took")):
        rp.checked, rp.host_guard, rp.guard = False, bad, lambda *a: mx.array(True)
        rp.check(c, dev)
        assert rp.serving() and rp.host_guard is None and rp.guard_kind.startswith(f"device (host guard: {why}")
        assert rp.serve(c, dev, lambda: [])[0] == replay.SERVED


def test_a_replay_whose_answer_differs_is_refused(step_replay):
    rp, c = step_replay, _Closure()
    rp.sink = types.SimpleNamespace(array=np.zeros(64, np.uint8))
    rp.kv_out = {1: 1, 2: 2}
    rp.replay.launch = lambda: _answer(rp.sink.array, 5.0)
    rp.replay.wait = lambda: None
    rp.replay.close = lambda: None
    _answer(c.sink.array, 5.0)
    c.sink.array[20] ^= 1                       # one bit of a new row
    rp.check(c, [_ids(), rp.kv[1], rp.kv[2]])
    assert not rp.serving() and rp.refused == "its answer differs from the closure's at byte 20 (of 16..36)"


class _HookReplay:
    """A stand-in ``StepReplay`` for the runner's hooks: built after two records, checked on the next call, then
    asked to serve every call (``mode``: "decline" or "raise"); nothing it does changes an answer."""

    log: list = []
    mode = "decline"

    def __init__(self, n_outputs, host_guard=False, staged_feed=False, pdl=False):
        self.records, self.replay, self.refused, self.checked = 0, None, None, False
        self.build_s, self.record_s, self.problems, self.guard_kind = 0.0, 0.0, [], ""

    def recording(self):
        return self.refused is None and self.replay is None

    def pending(self):
        return self.refused is None and self.replay is not None and not self.checked

    def serving(self):
        return self.refused is None and self.checked

    def refuse(self, why):
        self.refused = why

    def release(self):                  # (a poisoned closure releases its replay)
        self.refuse(self.refused or "released")

    def record(self, c, dev):
        assert c.trusted and all(isinstance(a, mx.array) for a in dev)
        self.log.append("record by an interim closure" if c.stand_in else "record")
        self.records += 1
        if self.records == 2:
            self.replay = types.SimpleNamespace(launches=7, timings={"capture": 0.01}, pdl=False,
                                                pdl_refused="")
            self.build_s = 0.02

    def check(self, c, given):
        self.log.append("check")
        self.checked = True

    def serve(self, c, dev_host, dev_mx):
        from ortmlx.compiled import replay
        self.log.append("serve")
        assert len(dev_mx()) == len(dev_host)
        if self.mode == "raise":
            raise RuntimeError("boom")
        return replay.DECLINED, None, None


def _hook_decode(monkeypatch, **attrs):
    """Every decode runner asks a ``_HookReplay`` (its log emptied) for its replay, with ``attrs`` set on it."""
    from ortmlx.compiled import core, replay
    init = core.CompiledSubgraph.__init__

    def hooked(self, *a, **k):
        init(self, *a, **k)
        if self.config.name == "decode":
            self._replay_on = True
            for name, v in attrs.items():
                setattr(self, name, v)
            self.counters.update(replayed_calls=0, replay="")
    monkeypatch.setattr(core.CompiledSubgraph, "__init__", hooked)
    monkeypatch.setattr(replay, "StepReplay", _HookReplay)
    monkeypatch.setattr(_HookReplay, "log", [])


def _genai_decode() -> tuple:
    """(logits, tokens, every part's counters) of ``test_ahead._steps`` on the tiny fp32 qwen2 build."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install .[genai])")
    import ortmlx.compiled as C
    from test_ahead import _steps
    from test_compiled_genai import SHARE, mg, model_dir
    logits, tokens = [], []
    with C.capture() as rs:
        model, _ = mg.load_model(model_dir("qwen2"), "mlx", None, SHARE)
    _steps(model, logits, tokens)
    counters = [dict(p.counters) for r in rs for p in r.parts()]
    del model
    return np.stack(logits), tokens, counters


@pytest.mark.genai
@pytest.mark.parametrize("mode", ["decline", "raise"])
def test_the_runner_records_checks_then_asks_the_replay_and_answers_the_same(monkeypatch, mode):
    """On any backend, with the decode closure's replay hooks on and a stand-in replay: two trusted calls recorded,
    the next checked, every later call offered to it first; declined or failing, the closure answers, logits bit for
    bit as without the hooks; a failure refuses the replay for good, named in the counters."""
    ref, toks_ref, _ = _genai_decode()
    _hook_decode(monkeypatch)
    monkeypatch.setattr(_HookReplay, "mode", mode)
    out, toks, c = _genai_decode()
    assert toks == toks_ref and ref.tobytes() == out.tobytes()
    decode = [x for x in c if "replayed_calls" in x]
    assert decode and sum(x["replayed_calls"] for x in decode) == 0
    log = _HookReplay.log
    assert log[:3] == ["record", "record", "check"] and log[3] == "serve", log
    if mode == "decline":
        assert log.count("check") == 1 and log.count("serve") >= 20, log
        built = "7 launches (recorded in 0.00 s, built in 0.02 s: capture 0.01)"
        assert any(x["replay"] == built for x in decode), decode
    else:
        assert log.count("serve") == 1, log
        assert any(x["replay"] == "refused: serve: RuntimeError: boom" for x in decode), decode


class _QueuedBuild:
    """A ``Prebuild`` whose build never ends: every call of a new key is answered by its interim closure. Notes
    how many calls each job asked of the worker."""

    def __init__(self):
        self.calls = []

    def submit(self, label, what, calls=None):
        self.calls.append(calls)
        return "queued forever"


@pytest.mark.genai
def test_an_interim_closure_records_no_replay(monkeypatch):
    """While a key's fused kernels are built elsewhere its interim closure answers; it records nothing for the
    replay (a recording builds our kernels in this process: the stall the worker is there to avoid). The worker
    is asked to make the key's call as often as takes its replay to serving (its guard's kernels built there)."""
    from ortmlx.compiled import replay
    from ortmlx.kernels import background
    queued = _QueuedBuild()
    _hook_decode(monkeypatch, prebuild=queued)
    monkeypatch.setattr(background, "state", lambda key: background.QUEUED)
    _, _, counters = _genai_decode()
    decode = [x for x in counters if "replayed_calls" in x]
    assert decode and sum(x.get("interim_calls", 0) for x in decode) >= 20, decode
    assert _HookReplay.log == [], _HookReplay.log
    assert queued.calls and set(queued.calls) == {replay.WARM_CALLS} and replay.WARM_CALLS == 5, queued.calls


@pytest.mark.genai
def test_the_guard_built_without_our_kernels_is_the_closures(monkeypatch):
    """Tuning replay_host_guard's guard (``_Closure.guard_only``, compiled for MLX's CPU stream by
    ``StepReplay._make_guards``) makes as many guards as the closure's trace and answers as the closure's own
    guard: yes on a decode call, no with a total length or a past length past the KV buffer; a guard count that
    differs from the trace's refuses at its call."""
    from ortmlx.compiled import replay
    record, got, real = _HookReplay.record, [], replay.StepReplay

    def probe(self, c, dev):
        if not got:
            rp = real(len(dev), host_guard=True)
            rp.record_inputs([(tuple(a.shape), a.dtype) for a in dev])
            rp._make_guards(c)
            k_total, k_seq = len(dev) - 2, len(dev) - 1          # the hoisted total and seqlens_k (the tiny build)
            rows = next(a.shape[2] for a in dev if a.ndim == 4)
            for at, value in ((None, None), (k_total, rows + 5), (k_seq, rows + 5)):
                args = list(dev)
                if at is not None:
                    args[at] = np.full(dev[at].shape, value, np.int32)      # as a call's host array
                host = bool(rp._host_guard(args).item())
                closure = bool(c.fn(*[mx.array(a) for a in args])[-1].item())
                got.append((closure, host, c.guard_only(*[mx.array(a) for a in args])[1], c.guard_count))
            c.guard_count += 1
            rp._make_guards(c)
            with pytest.raises(Refused, match="guards built without our kernels"):
                rp._host_guard(list(dev)).item()
            c.guard_count -= 1
        return record(self, c, dev)
    _hook_decode(monkeypatch)
    monkeypatch.setattr(_HookReplay, "record", probe)
    _genai_decode()
    assert [g[:2] for g in got] == [(True, True), (False, False), (False, False)], got
    assert all(made == count > 0 for _, _, made, count in got), got


# ---- on MLX's CUDA backend ----

gpu = pytest.mark.skipif(not cuda_kernels.cuda_backend(), reason="needs MLX's CUDA backend")

H, NQ, NKV, D, FF, T = 256, 4, 2, 64, 512, 64


def _col(w: np.ndarray):
    a = mx.contiguous(mx.array(w).astype(mx.float16).T).T
    mx.eval(a)
    cuda_rows.register_col_major([a])
    return a


def _weights(rng):
    f = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float32)  # noqa: E731
    return dict(embed=mx.array(f(32, H)).astype(mx.float16), g1=mx.array(1 + f(H)).astype(mx.float16),
                g2=mx.array(1 + f(H)).astype(mx.float16), wqkv=_col(f(H, (NQ + 2 * NKV) * D)),
                bqkv=mx.array(f((NQ + 2 * NKV) * D)).astype(mx.float16), wo=_col(f(NQ * D, H)),
                wgu=_col(f(H, 2 * FF)), wd=_col(f(FF, H)), cos=mx.array(np.cos(f(T, D) * 40)),
                sin=mx.array(np.sin(f(T, D) * 40)))


def _layer(p, ids, pos, past_len, total_len, past_k, past_v):
    """One decode layer of our kernels; returns (down row, residual, present_k, present_v)."""
    x = cuda_kernels.take_rows(p["embed"], ids).reshape(1, 1, H)
    cos, sin = cuda_kernels.take_rows(p["cos"], pos), cuda_kernels.take_rows(p["sin"], pos)
    qkv, _ = cuda_rows.norm_gemv(x, p["g1"], 1e-6, p["wqkv"])
    attn, pk, pv, _, _ = cuda_kernels.decode_rope_attention(
        qkv, None, None, cos, sin, past_k, past_v, past_len, total_len, num_heads=NQ, kv_num_heads=NKV, rot_dim=D,
        interleaved=False, alpha=D ** -0.5, qkv_bias=p["bqkv"])
    o = cuda_rows.gemv(attn, p["wo"])
    g, resid = cuda_rows.norm_gemv(o, p["g2"], 1e-6, p["wgu"], skip=x, gating=(FF, True))
    return cuda_rows.gemv(g, p["wd"]), resid, pk, pv


def _inputs(rng, n: int):
    """A step's inputs at past length ``n``: ids, position, past_len, total_len (int32, kept off MLX's managed
    pool) and the KV buffers."""
    ints = [consts.roomy(mx.array(np.array([v], np.int32))) for v in (rng.integers(32), n, n, n + 1)]
    kv = [mx.array((rng.standard_normal((1, NKV, T, D)) * 0.5).astype(np.float16)) for _ in range(2)]
    mx.eval(kv)
    return ints + kv


@gpu
@pytest.mark.parametrize("staged,pdl", [(False, False), (True, False), (False, True)],
                         ids=["copies", "staged", "pdl"])
def test_a_recorded_decode_layer_replays_bit_for_bit(staged, pdl):
    """Two recorded calls of a decode layer, then a third and a fourth through the replay: bit for bit as MLX
    answers them; ``staged``: its small inputs through page-locked memory (``stage_inputs``), the KV buffers it
    writes over as before; ``pdl``: each launch after the first may start while the one before it ends."""
    if cuda_replay.cuda_driver.driver() is None or cuda_replay.cc.cache_dir() is None:
        pytest.skip("no CUDA driver or no MLX kernel cache")
    rng = np.random.default_rng(7)
    mx.set_default_device(mx.gpu)
    p = _weights(rng)
    steps = [_inputs(rng, n) for n in (5, 9, 12)]
    records, results = [], []
    for ins in steps[:2]:
        with cuda_replay.record() as launches:
            outs = _layer(p, *ins)
        mx.eval(outs)
        records.append(launches)
        results.append(outs)
    want = _layer(p, *steps[2])
    mx.eval(want)
    want = [np.array(a) for a in want]
    (d, resid, pk, pv) = results[1]
    r = cuda_replay.Replay.build(records[0], records[1], (steps[0], steps[1]),
                                 in_place=[(pk, steps[1][4]), (pv, steps[1][5])], pdl=pdl)
    try:
        assert r.launches == len(records[1]) == 8 and r.pdl == pdl
        if staged:
            r.stage_inputs()
            assert sorted(r.stage_at) == [0, 1, 2, 3] and len(r.stage_runs) == 1
        for i, a in enumerate(steps[2]):
            r.write(i, np.array(a))
        r.launch()
        r.wait()
        for got, w, name in zip((r.read(d), r.read(resid), r.read(pk), r.read(pv)), want, ("down", "resid", "k", "v")):
            np.testing.assert_array_equal(got, w, err_msg=name)
        assert r.address(pk) == r.address(steps[1][4])
        # the next step over the KV buffers the replay wrote: ids, position and lengths only
        nxt = [consts.roomy(mx.array(np.array([v], np.int32))) for v in (3, 13, 13, 14)]
        want2 = _layer(p, *nxt, mx.array(want[2]), mx.array(want[3]))
        mx.eval(want2)
        for i, a in enumerate(nxt):
            r.write(i, np.array(a))
        r.launch()
        r.wait()
        np.testing.assert_array_equal(r.read(d), np.array(want2[0]))
        np.testing.assert_array_equal(r.read(pk), np.array(want2[2]))
    finally:
        r.close()


@gpu
def test_a_step_with_an_mlx_op_is_refused():
    if cuda_replay.cuda_driver.driver() is None:
        pytest.skip("no CUDA driver")
    mx.set_default_device(mx.gpu)
    rng = np.random.default_rng(3)
    p = _weights(rng)
    recs, ins = [], []
    for _ in range(2):
        x = mx.array(rng.standard_normal((1, 1, H)).astype(np.float16))
        with cuda_replay.record() as launches:
            qkv, _ = cuda_rows.norm_gemv(x * 2, p["g1"], 1e-6, p["wqkv"])
        mx.eval(qkv)
        recs.append(launches)
        ins.append([x])
    with pytest.raises(Refused, match="made by an operation that is not a kernel of ours"):
        cuda_replay.Replay.build(recs[0], recs[1], (ins[0], ins[1]))


# ---- the EP: genai decode of an ``-e cuda`` fp16 model with tuning replay ----

def _cuda_model(arch: str = "qwen2") -> str:
    """The small fp16 build (-e cuda): its products take our row kernels on a GPU and its MLPs fold (the tiny
    build's weights are too small to be stored column-major, so its QKV product is MLX's and the replay refuses
    the step)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.join(root, "models", "out")
    path = os.path.join(out, f"{arch}-small-fp16-cuda")
    if not os.path.exists(os.path.join(path, "genai_config.json")):
        for mod in ("torch", "transformers", "tokenizers", "onnx_ir"):
            pytest.importorskip(mod, reason=f"{mod} is needed to build the test LLMs (pip install .[genai])")
    # (asked even when built: build_llm keeps a build of the current recipe and rebuilds one of an older)
    res = subprocess.run([sys.executable, os.path.join(root, "models", "build_llm.py"), "--arch", arch,
                          "--precision", "fp16", "--target", "cuda", "--size", "small", "--out", out],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return path


@pytest.mark.genai
def test_the_small_builds_mlps_fold_as_on_a_gpu(monkeypatch):
    """The program the small build gets as on a GPU (on any machine): both MLPs' gate/up products merged and
    their gating folded into the product kernels, no Sigmoid or Mul left, so nothing between its products is
    MLX's (a head wired to layer 0's norm merged with its gate/up once, and that layer's gating stayed MLX's)."""
    import dataclasses
    import functools

    from ortmlx import testing
    from ortmlx.kernels import interpreter, rowfold
    from ortmlx.kernels.passes import BuildConfig
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai's builder makes the model")
    path = _cuda_model()
    orig, made = interpreter.Program.__init__, []

    def init(self, graph, device="cpu", config=None, **k):
        if config is not None:          # a group's program, configured as on a GPU, run by the CPU's functions
            config = dataclasses.replace(BuildConfig.for_device("gpu"), device="cpu", cuda_kernels=False,
                                         merge_matmuls=True, fold_mlp=True, fuse_rows=True, fold_qkv_bias=True,
                                         half_dense_nbits=False, conv_gemm=frozenset())
        orig(self, graph, device, config, **k)
        if config is not None:
            made.append(self)
    monkeypatch.setattr(interpreter.Program, "__init__", init)
    testing.session(f"{path}/model.onnx", options={"device": "cpu"})
    assert made
    steps = [st for p in made for st in p.steps]
    folds = [st for st in steps if isinstance(st.opdef.fn, functools.partial) and st.opdef.fn.func is
             rowfold.norm_product and st.opdef.fn.keywords["product"].func is rowfold.swiglu_down]
    assert len(folds) == 2, [st.node.name for st in steps]
    assert not [st.node.name for st in steps if st.node.op_type in ("Sigmoid", "Mul")]


@gpu
@pytest.mark.genai
def test_replayed_decode_gives_the_closures_logits_bit_for_bit(monkeypatch):
    """Two generators in turn on one session, one rewound (``test_ahead._steps``): with the replay serving, every
    token and logit as with it recording and checking but never serving (the same kernels)."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install .[genai])")
    import ortmlx.compiled as C
    from ortmlx.compiled import replay
    from test_ahead import _steps
    from test_compiled_genai import SHARE, mg
    path = _cuda_model()
    got = {}
    for serve in (False, True):
        if not serve:
            monkeypatch.setattr(replay.StepReplay, "serving", lambda self: False)
        else:
            monkeypatch.undo()
        logits, tokens = [], []
        with C.capture() as rs:
            # (prebuild off: both passes run the closure traced here, fused, not one answered unfused meanwhile)
            model, _ = mg.load_model(path, "mlx", {"tuning": "replay=1,prebuild=0"}, SHARE)
        _steps(model, logits, tokens)
        counters = [dict(p.counters) for r in rs for p in r.parts()]
        del model
        got[serve] = (np.stack(logits), tokens, counters)
    (ref, toks_ref, c_ref), (out, toks, c) = got[False], got[True]
    assert toks == toks_ref and len(toks) == 38
    assert ref.tobytes() == out.tobytes()
    decode = [x for x in c if "replayed_calls" in x]
    assert decode and not any(x["poisoned"] for x in c), c
    assert sum(x.get("replayed_calls", 0) for x in c_ref) == 0
    states = [(x["compiled"], x["replay"], x["replayed_calls"]) for x in decode]
    assert sum(x["replayed_calls"] for x in decode) >= 20, states
    assert all(not x["replay"].startswith("refused") for x in decode), states
