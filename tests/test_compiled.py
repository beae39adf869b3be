"""Compiled general strategy: verify-then-trust, poisoning, fault injection, kill switches."""
from __future__ import annotations

import dataclasses
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

import ortmlx.compiled as C
from ortmlx.tuning import Tuning
from ortmlx.compiled.config import SHAPELESS, CompiledConfig
from ortmlx.testing import assert_close, make_model, session

RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((16, 32)).astype(np.float32)
B1 = RNG.standard_normal(32).astype(np.float32)
W2 = RNG.standard_normal((32, 8)).astype(np.float32)


def mlp():
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Add", ["h", "B1"], ["h2"]),
             helper.make_node("Relu", ["h2"], ["h3"]), helper.make_node("MatMul", ["h3", "W2"], ["h4"]),
             helper.make_node("Softmax", ["h4"], ["y"], axis=-1)]
    return make_model(nodes, [("x", T.FLOAT, ["N", 16])], [("y", T.FLOAT, ["N", 8])],
                      {"W1": W1, "B1": B1, "W2": W2})


def feed(n):
    return {"x": RNG.standard_normal((n, 16)).astype(np.float32)}


def compiled_session(model, options=None):
    """An MLX session and the compiled runners its creation made."""
    with C.capture() as rs:
        s = session(model, options=options)
    return s, list(rs)


def check(s, model, feeds):
    cpu = session(model, "CPUExecutionProvider", record=False)
    for f in feeds:
        for g, w in zip(s.run(None, f), cpu.run(None, f)):
            assert_close(g, w, what="mlx vs cpu")


def relu_step(runner):
    return next(st for st in runner.program.steps if st.node.op_type == "Relu")


def swap(step, fn):
    """Replace one step's translator (fault injection) for this program only."""
    step.opdef = dataclasses.replace(step.opdef, fn=fn)


# ---------------------------------------------------------------------------- general strategy
def test_general_traces_once_per_shape_and_matches_cpu():
    m = mlp()
    s, rs = compiled_session(m)
    assert len(rs) == 1 and rs[0].config.name == "general"
    r = rs[0]
    check(s, m, [feed(4), feed(4), feed(4), feed(7), feed(7), feed(4)])
    # a key's first call is eager only (``eager_calls_before_trace``); its second traces and verifies
    assert r.trace_counts() == [1, 1]
    assert r.counters["verify_calls"] == 2
    assert r.counters["compiled_calls"] == 2 and r.counters["eager_calls"] == 4
    assert r.counters["poisoned_closures"] == 0


def test_host_read_input_is_part_of_the_key():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Relu", ["r"], ["y"])]
    m = make_model(nodes, [("x", T.FLOAT, [2, 6]), ("shape", T.INT64, [2])], [("y", T.FLOAT, None)])
    s, rs = compiled_session(m)
    x = RNG.standard_normal((2, 6)).astype(np.float32)
    feeds = [{"x": x, "shape": np.array(v, np.int64)} for v in ([3, 4], [4, 3], [3, 4], [4, 3], [6, 2], [6, 2],
                                                                 [3, 4], [4, 3])]
    check(s, m, feeds)
    r = rs[0]
    assert r.trace_counts() == [1, 1, 1]           # one closure per shape value, each traced once
    # the eager first call is per shape key (the host value [3, 4] only): [4, 3] traces at once
    assert r.counters["compiled_calls"] == 4 and r.counters["eager_calls"] == 4


def test_host_computed_op_is_never_traced():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("NonZero", ["r"], ["y"])]
    m = make_model(nodes, [("x", T.FLOAT, [3, 4])], [("y", T.INT64, None)])
    s, rs = compiled_session(m)
    check(s, m, [{"x": RNG.standard_normal((3, 4)).astype(np.float32)} for _ in range(2)])
    assert all(r.counters["traces"] == 0 for r in rs)


def test_threads_share_one_runner():
    m = mlp()
    s, rs = compiled_session(m)
    cpu = session(m, "CPUExecutionProvider", record=False)
    feeds = [feed(n) for n in (3, 5, 3, 5, 3, 5, 8, 8)]
    want = [cpu.run(None, f)[0] for f in feeds]
    errors = []

    def work(k):
        try:
            for _ in range(3):
                for f, w in zip(feeds[k::2], want[k::2]):
                    assert_close(s.run(None, f)[0], w, what=f"thread {k}")
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    # MLX keys its trace cache on the stream, which is per thread: at most one trace per thread
    assert all(1 <= t <= 2 for t in rs[0].trace_counts()), rs[0].trace_counts()
    assert not any(c.poisoned for c in rs[0].closures())


# ---------------------------------------------------------------------------- fault injection
def test_translator_raising_during_trace_falls_back_and_poisons():
    m = mlp()
    s, (r,) = compiled_session(m)
    st = relu_step(r)
    orig = st.opdef.fn

    def bomb(x):
        if C.tracing():
            raise RuntimeError("injected trace failure")
        return orig(x)

    swap(st, bomb)
    check(s, m, [feed(4), feed(4), feed(4)])
    (c,) = r.closures()
    assert c.poisoned and "injected trace failure" in c.poisoned and c.fn is None
    assert c.traces == 1 and c.calls == 0
    assert r.counters["compiled_calls"] == 0 and r.counters["eager_calls"] == 3


def test_wrong_closure_output_is_caught_and_never_called_again():
    m = mlp()
    s, (r,) = compiled_session(m)
    st = relu_step(r)
    orig = st.opdef.fn
    swap(st, lambda x: orig(x) + 1.0 if C.tracing() else orig(x))
    check(s, m, [feed(5), feed(5), feed(5)])
    (c,) = r.closures()
    assert c.poisoned and "differ from eager" in c.poisoned
    assert c.calls == 1 and c.traces == 1          # called once (the verification), never again
    assert r.counters["compiled_calls"] == 0


def test_eval_failure_falls_back_to_eager():
    m = mlp()
    s, (r,) = compiled_session(m)
    check(s, m, [feed(6), feed(6)])                 # trusted after the key's second call
    (c,) = r.closures()
    assert c.trusted

    def failing_eval(*arrays):
        raise RuntimeError("injected eval failure")

    r._eval = failing_eval
    check(s, m, [feed(6), feed(6)])
    assert c.poisoned and "eval: RuntimeError: injected eval failure" in c.poisoned
    assert c.fn is None and r.counters["compiled_calls"] == 0


def test_gpu_eval_settles_the_heap_during_an_async_eval(monkeypatch):
    """On a GPU the closure's eval starts asynchronously (one small allocation while it runs) and then
    waits: the same answers. The path is device-independent: switched on here for a CPU runner."""
    from ortmlx.compiled import core
    m = mlp()
    s, (r,) = compiled_session(m)
    check(s, m, [feed(6), feed(6)])                 # trusted after the key's second call
    started = []
    real = mx.async_eval
    monkeypatch.setattr(core.mx, "async_eval", lambda *a: started.append(len(a)) or real(*a))
    assert r._settle == (r.device == "gpu")         # a CPU runner: a plain eval (no calls made ahead either)
    if r.device != "gpu" and not r._ahead:
        check(s, m, [feed(6)])
        assert started == []
    monkeypatch.setattr(r, "_settle", True)         # what a GPU runner resolves (ORTMLX_EVAL_SETTLE unset)
    before = r.counters["compiled_calls"]
    check(s, m, [feed(6), feed(6)])
    assert started == [1, 1] and r.counters["compiled_calls"] == before + 2 and not r.closures()[0].poisoned


def test_gpu_polled_wait_comes_between_the_async_eval_and_the_eval(monkeypatch):
    """With a polling CUDA context the runner waits for the GPU with the driver's synchronize after starting
    the eval and before MLX's own wait (which then finds the work done): order and answers checked with the
    GPU path switched on for a CPU runner."""
    from ortmlx.compiled import core
    m = mlp()
    s, (r,) = compiled_session(m)
    check(s, m, [feed(6), feed(6)])                 # trusted after the key's second call
    if r.device != "gpu":
        assert r._spin is None                      # a CPU runner: no driver to poll
    order = []
    real_async, real_eval = mx.async_eval, r._eval
    monkeypatch.setattr(core.mx, "async_eval", lambda *a: order.append("async") or real_async(*a))
    monkeypatch.setattr(r, "_eval", lambda *a: order.append("eval") or real_eval(*a))
    monkeypatch.setattr(r, "_settle", True)
    monkeypatch.setattr(r, "_spin", lambda: order.append("spin") or 0)
    check(s, m, [feed(6), feed(6)])
    assert order == ["async", "spin", "eval"] * 2 and r.counters["compiled_calls"] == 2
    assert not r.closures()[0].poisoned


def test_spin_waiter_only_for_a_polling_context(monkeypatch):
    from ortmlx.compiled import core
    from ortmlx.kernels import cuda_driver

    class Drv:
        def __init__(self, spins):
            self._spins = spins

        def spins(self):
            return self._spins

        def synchronize(self):
            return 0

    monkeypatch.setattr(cuda_driver, "driver", lambda: Drv(True))
    w = core._spin_waiter()
    assert w is not None and w() == 0
    monkeypatch.setattr(cuda_driver, "driver", lambda: Drv(False))
    assert core._spin_waiter() is None               # blocking sync: MLX's wait only
    monkeypatch.setattr(cuda_driver, "driver", lambda: None)
    assert core._spin_waiter() is None               # no CUDA driver


def test_trace_fault_option_falls_back():
    m = mlp()
    s, (r,) = compiled_session(m, {"tuning": "fault=trace"})
    check(s, m, [feed(3), feed(3)])
    (c,) = r.closures()
    assert c.poisoned and "injected fault at trace" in c.poisoned
    assert r.counters["eager_calls"] == 2


# ---------------------------------------------------------------------------- shapeless core
def _shapeless(runner, gpu_shapeless: bool = False):
    return C.CompiledSubgraph(runner.program, CompiledConfig("test", SHAPELESS),
                              tuning=Tuning(gpu_shapeless=gpu_shapeless, build_behind=False))


@pytest.fixture
def shapeless_everywhere(monkeypatch):
    """Shapeless closures compiled on a GPU too (off there by default: tuning ``gpu_shapeless``), so these tests
    check the same logic on either device."""
    real = _shapeless
    monkeypatch.setitem(globals(), "_shapeless", lambda r: real(r, gpu_shapeless=True))


def test_shapeless_traces_once_and_is_trusted_after_two_lengths(shapeless_everywhere):
    s, (r,) = compiled_session(mlp())
    sl = _shapeless(r)
    for n in (4, 4, 6, 9, 13, 4):
        x = feed(n)["x"]
        got = sl.run([x]).outputs
        want = r.program.run([x])
        assert_close(np.asarray(got[0]), np.asarray(want[0]), what=f"n={n}")
    (c,) = sl.closures()
    assert c.traces == 1 and c.trusted
    assert sl.counters["verify_calls"] == 2        # at n=4 and n=6; n=4 again was already verified
    assert sl.counters["compiled_calls"] == 4


def test_shapeless_shape_baked_constant_is_caught_at_second_length(shapeless_everywhere):
    s, (r,) = compiled_session(mlp())
    sl = _shapeless(r)
    st = relu_step(sl)
    orig = st.opdef.fn
    swap(st, lambda x: orig(x) / x.shape[0])         # the divisor is baked by a shapeless trace
    for n in (4, 6, 6):
        x = feed(n)["x"]
        assert_close(np.asarray(sl.run([x]).outputs[0]), np.asarray(sl.program.run([x])[0]), what=f"n={n}")
    (c,) = sl.closures()
    assert c.poisoned and "differ from eager" in c.poisoned
    assert c.traces == 1 and c.calls == 2          # verified at 4, caught at 6, not called at the second 6
    assert sl.counters["compiled_calls"] == 0


# ---------------------------------------------------------------------------- kill switches
@pytest.mark.parametrize("options,env,compiled", [
    ({}, {}, True),
    ({"no_compile": "1"}, {}, False),
    ({"no_general_compile": "1"}, {}, False),
    ({"tuning": "compile_mode=disabled"}, {}, False),
    ({"no_decode_compile": "1", "no_prefill_compile": "1"}, {}, True),
    ({}, {"ORTMLX_NO_COMPILE": "1"}, False),
    ({}, {"ORTMLX_NO_COMPILE": "0"}, True),
    ({}, {"ORTMLX_NO_COMPILE": ""}, True),
    ({}, {"ONNX_GENAI_MLX_NO_COMPILE": "1"}, False),
    ({}, {"ONNXRUNTIME_EP_MLX_NO_COMPILE": "1"}, False),
    ({}, {"MLX_EP_NO_GENERAL_COMPILE": "1"}, False),
    ({}, {"ONNXRUNTIME_EP_MLX_NO_GENERAL_COMPILE": "1"}, False),
    ({}, {"ORTMLX_NO_GENERAL_COMPILE": "1"}, False),
    ({}, {"MLX_EP_NO_PREFILL_COMPILE": "1", "ORTMLX_NO_DECODE_COMPILE": "1"}, True),
    ({}, {"ORTMLX_TUNING": "compile_mode=disabled"}, False),
    ({"no_compile": "general"}, {}, False),
    ({"no_compile": "decode,prefill"}, {}, True),
])
def test_kill_switches_flip_the_general_path(monkeypatch, options, env, compiled):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    m = mlp()
    s, rs = compiled_session(m, options)
    check(s, m, [feed(4), feed(4)])
    traces = sum(r.counters["traces"] for r in rs)
    assert traces == (1 if compiled else 0)
    assert (len(rs) == 1) == compiled


@pytest.mark.parametrize("mode", ["no_fuse", "no_simplify"])
def test_compile_modes_compile_and_match(mode):
    m = mlp()
    try:
        s, rs = compiled_session(m, {"tuning": f"compile_mode={mode}"})
        check(s, m, [feed(4), feed(4), feed(4)])
        assert rs and rs[0].counters["traces"] == 1 and rs[0].counters["compiled_calls"] == 1
    finally:
        from ortmlx.compiled.mode import apply_compile_mode
        assert apply_compile_mode("enabled") is None


def test_release_all_drops_closures_and_keeps_answering():
    m = mlp()
    s, (r,) = compiled_session(m)
    check(s, m, [feed(4), feed(4)])
    assert r.closures()
    C.release_all()
    assert r.closures() == [] and r.released
    check(s, m, [feed(4)])
    assert r.counters["traces"] == 1


def test_stats_are_visible():
    s, (r,) = compiled_session(mlp())
    s.run(None, feed(2))
    s.run(None, feed(2))
    total = C.stats()
    assert total["runners"] >= 1 and total["traces"] >= 1
    assert r.counters["compiled"] == "general"
    mx.clear_cache()


def test_shapes_changing_every_call_stop_tracing():
    m = mlp()
    s, (r,) = compiled_session(m)
    check(s, m, [feed(n) for n in range(1, 12)])
    assert r.counters["traces"] == 0                          # no key came back: none was traced
    assert r.counters["compiled_calls"] == 0 and r.counters["eager_calls"] == 11
    check(s, m, [feed(n) for n in range(1, 12)])              # each key's second call, never a third
    assert r.counters["traces"] == r.config.thrash_keys       # then new keys run eagerly, untraced
    assert r.counters["compiled_calls"] == 0


def test_fixed_shape_closure_of_a_shapeless_key_gives_up_when_shapes_vary():
    """A shapeless key whose free-dim input only hoisted work reads is traced shape-keyed (MLX retraces
    per shape, nothing baked goes stale). Here the hoisted value keeps the free dim, so its shape changes
    every call: answers stay eager's, and after MAX_FIXED_TRACES traces the closure is given up."""
    m = make_model([helper.make_node("ReduceSum", ["a", "ax"], ["r"], keepdims=1),     # hoisted: [1, T] int64
                    helper.make_node("Cast", ["r"], ["f"], to=T.FLOAT),
                    helper.make_node("ReduceSum", ["f"], ["s"], keepdims=0),
                    helper.make_node("Add", ["s", "b"], ["y"])],
                   [("a", T.INT64, [1, "T"]), ("b", T.FLOAT, [1])], [("y", T.FLOAT, [1])],
                   initializers={"ax": np.array([0], np.int64)})
    s, rs = compiled_session(m)
    (r,) = rs
    sl = C.CompiledSubgraph(r.program, CompiledConfig("test", SHAPELESS), free_dims=frozenset({(0, 1)}),
                            tuning=Tuning(build_behind=False))
    b = np.array([0.5], np.float32)
    for t in range(2, 10):
        a = np.arange(t, dtype=np.int64).reshape(1, t)
        got = np.asarray(sl.run([a, b]).outputs[0])
        assert got.tolist() == [float(np.arange(t).sum()) + 0.5], (t, got)
    (c,) = sl.closures()
    assert c.hoist and c.shapeless is False, (c.hoist, c.shapeless)
    assert c.poisoned and "shapes changed between calls" in c.poisoned, c.poisoned
    assert c.traces == C.trace.MAX_FIXED_TRACES + 1, c.traces


def test_shapeless_closures_stay_eager_on_a_gpu(monkeypatch):
    """A closure that must be traced shapeless (a traced input keeps a free dim) is not compiled on a
    GPU (measured ~3x slower than eager on the H200); the same key on the CPU is."""
    s, (r,) = compiled_session(mlp())
    monkeypatch.setattr(C.core, "mx_device", lambda d: mx.cpu)      # this box has no GPU: run it on the CPU
    for device, compiled in (("gpu", False), ("cpu", True)):
        sl = _shapeless(r)
        sl.device = device
        for n in (4, 6, 9):
            x = feed(n)["x"]
            assert_close(np.asarray(sl.run([x]).outputs[0]), np.asarray(r.program.run([x])[0]), what=f"{device} n={n}")
        (c,) = sl.closures()
        assert (c.fn is not None) == compiled and (sl.counters["compiled_calls"] > 0) == compiled, device
        if not compiled:
            assert "shapeless closure on a GPU runs eagerly" in c.poisoned


def test_row_hints_share_start_bytes():
    """Hints with the same start array carry its bytes once; each hint still reads its own starts."""
    from ortmlx.compiled.result import RowHints
    from ortmlx.compiled.trace import _hint_arrays
    from ortmlx.runtime.mirror import hint_bytes
    pasts = [mx.zeros((2, 2, 8, 4), mx.float16) for _ in range(3)]
    s1, s2 = mx.array([3, 5], mx.int64), mx.array([1, 2], mx.int32)
    rows = [mx.full((2, 2, 1, 4), k, mx.float16) for k in range(3)]
    hints = [(p + 1, p, s, r) for p, s, r in zip(pasts, (s1, s2, s1), rows)]
    meta = [(k, k, (2, 2, 1, 4), 2) for k in range(3)]
    data, idx = _hint_arrays(hints, meta)
    assert data.size == 3 * 16 * 2 + 4 * 4                 # rows, then two distinct start arrays
    flat, starts = hint_bytes(RowHints(meta, data, idx))
    assert starts.tolist() == [3, 5, 1, 2, 3, 5]
    assert flat.view(np.float16).tolist() == [0.0] * 16 + [1.0] * 16 + [2.0] * 16


def test_row_hints_kept_only_for_group_outputs_over_traced_inputs():
    """A hint counts only when its present is a group output and its past a traced input (by identity);
    a dropped hint does not disturb the ones after it, and one output is hinted once."""
    from ortmlx.compiled.trace import _hint_arrays, _hinted_outputs
    past = mx.zeros((1, 2, 8, 4), mx.float16)
    present, other = past + 1, past + 2
    start, rows = mx.array([3], mx.int32), mx.ones((1, 2, 1, 4), mx.float16)
    hints = [(other, past, start, rows),          # not a group output: dropped
             (present, mx.zeros_like(past), start, rows),   # past not a traced input: dropped
             (present, past, start, rows),        # kept
             (present, past, start, rows)]        # the same output again: dropped
    meta = _hinted_outputs(hints, [mx.zeros((1,)), present], {id(past): 5})
    assert meta == [None, None, (1, 5, (1, 2, 1, 4), 2), None], meta
    data, idx = _hint_arrays(hints, meta)
    from ortmlx.compiled.result import RowHints
    from ortmlx.runtime.mirror import hint_bytes
    flat, starts = hint_bytes(RowHints([m for m in meta if m is not None], data, idx))
    assert data.dtype == mx.uint8 and flat.size == 16 and starts.tolist() == [3]
    assert flat.view(np.float16).tolist() == [1.0] * 8


def test_slow_first_call_says_so_once_per_process(monkeypatch, capfd):
    """A closure's first call over BUILD_NOTICE_S prints one line on stderr (what was built, where the cache is);
    only once per process; the genai warm-up hint only for the attention strategies, not a general group."""
    import ortmlx.compiled.core as core
    monkeypatch.setattr(core, "BUILD_NOTICE_S", 0.0)
    monkeypatch.setattr(core, "_NOTICED", [])
    for _ in range(2):                              # another InferenceSession, same process: no second line
        s, _rs = compiled_session(mlp())
        for _ in range(3):                          # the general group traces on its key's second call
            s.run(None, feed(3))
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if "tracing and building MLX kernels" in ln]
    assert len(lines) == 1, err
    assert lines[0].startswith("MLXExecutionProvider: the first general call at new shapes (group ")
    assert f"kept under {core.mlx_cache_dir()}" in lines[0] and "warmup" not in lines[0], lines[0]


def test_a_long_first_call_says_so_while_it_runs(monkeypatch, capfd):
    """A closure's first call still running after HEADS_UP_S prints one line before it ends (the kernels being
    built, where they are kept), once per process; one shorter than that prints none."""
    import ortmlx.compiled.core as core
    monkeypatch.setattr(core, "_HEADS_UP", [])
    monkeypatch.setattr(core, "_NOTICED", [])
    monkeypatch.setattr(core, "BUILD_NOTICE_S", 1e9)
    monkeypatch.setattr(core, "HEADS_UP_S", 60.0)
    s, _rs = compiled_session(mlp())
    for _ in range(3):
        s.run(None, feed(3))
    assert "building MLX kernels" not in capfd.readouterr().err
    real = core.CompiledSubgraph._apply

    def slow(self, *a, **k):
        time.sleep(0.3)
        return real(self, *a, **k)
    monkeypatch.setattr(core.CompiledSubgraph, "_apply", slow)
    monkeypatch.setattr(core, "HEADS_UP_S", 0.05)
    for _ in range(2):
        s, _rs = compiled_session(mlp())
        for _ in range(3):
            s.run(None, feed(3))
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "building MLX kernels" in ln]
    assert len(lines) == 1 and lines[0].startswith("MLXExecutionProvider: building MLX kernels for the first general "
                                                   "call at new shapes (group "), lines
    assert f"later processes load them from {core.mlx_cache_dir()}" in lines[0]


# ---------------------------------------------------------------------------- an If of constants (Phi-3 LongRoPE)
CACHE_LONG = RNG.standard_normal((8, 3)).astype(np.float32)
CACHE_SHORT = RNG.standard_normal((4, 3)).astype(np.float32)


def _cache_if(computed_branch: bool = False) -> list:
    """genai's LongRoPE idiom: nodes making ``cache``, the rotary cache an If picks by the mask's length (> 4: the
    long one), both branches constants. ``computed_branch``: the long branch computes its cache from x instead."""
    then_nodes = [helper.make_node("Constant", [], ["long"], value=helper.make_tensor(
        "v", T.FLOAT, CACHE_LONG.shape, CACHE_LONG.reshape(-1).tolist()))]
    if computed_branch:
        then_nodes = [helper.make_node("Mul", ["x", "x"], ["long"])]
    then_g = helper.make_graph(then_nodes, "then", [], [helper.make_tensor_value_info("long", T.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Constant", [], ["short"], value=helper.make_tensor(
        "v", T.FLOAT, CACHE_SHORT.shape, CACHE_SHORT.reshape(-1).tolist()))], "else", [],
        [helper.make_tensor_value_info("short", T.FLOAT, None)])
    return [helper.make_node("Shape", ["mask"], ["shape"]),
            helper.make_node("Gather", ["shape", "one"], ["len"], axis=0),
            helper.make_node("Greater", ["len", "four"], ["long_ctx"]),
            helper.make_node("If", ["long_ctx"], ["cache"], then_branch=then_g, else_branch=else_g)]


_IF_CONSTS = {"one": np.array(1, np.int64), "four": np.array(4, np.int64)}


def rope_if(computed_branch: bool = False):
    """``_cache_if`` and ``y = sum(x) + cache``, x as long as the mask."""
    nodes = _cache_if(computed_branch) + [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=1),
                                          helper.make_node("Add", ["s", "cache"], ["y"])]
    return make_model(nodes, [("x", T.FLOAT, [1, "L"]), ("mask", T.INT64, [1, "L"])], [("y", T.FLOAT, None)],
                      _IF_CONSTS)


def rope_feed(n):
    return {"x": RNG.standard_normal((1, n)).astype(np.float32), "mask": np.ones((1, n), np.int64)}


def test_an_if_of_constants_is_traced_each_branch_by_its_key():
    """Shape-keyed closures take the branch the key's length picks: traced per key, equal to the CPU EP's."""
    m = rope_if()
    s, rs = compiled_session(m)
    check(s, m, [rope_feed(n) for n in (3, 3, 6, 6, 3, 6, 4, 4, 5, 5)])
    (r,) = rs
    # each length's first call eager, its second traced and verified, later ones replayed
    assert r.trace_counts() == [1, 1, 1, 1] and r.counters["verify_calls"] == 4
    assert r.counters["compiled_calls"] == 2 and r.counters["poisoned_closures"] == 0


def decode_if():
    """``_cache_if`` in a decode's shape: the mask (its length free under the key) only picks the cache."""
    return make_model(_cache_if() + [helper.make_node("Add", ["x", "cache"], ["y"])],
                      [("x", T.FLOAT, ["batch_size", 1]), ("mask", T.INT64, ["batch_size", "total_sequence_length"])],
                      [("y", T.FLOAT, None)], _IF_CONSTS)


def test_a_decode_key_hoists_the_if_and_traces_each_cache(shapeless_everywhere):
    """Under a decode key whose free dim (the mask's length) only the If reads, the If runs per call outside the
    trace and its cache enters the closure as data; the trace keeps fixed shapes, so each cache shape is traced
    once (MLX retraces on an input's new shape), and every call equals eager's across the switch and back."""
    s, (r,) = compiled_session(decode_if())
    p = r.program
    sl = C.CompiledSubgraph(p, CompiledConfig("test", SHAPELESS), free_dims=frozenset({(p.inputs.index("mask"), 1)}),
                            tuning=Tuning(gpu_shapeless=True, build_behind=False))
    x = RNG.standard_normal((1, 1)).astype(np.float32)
    for n in (2, 3, 4, 5, 6, 7, 3, 8):
        f = {"x": x, "mask": np.ones((1, n), np.int64)}
        ins = [f[k] for k in p.inputs]
        assert_close(np.asarray(sl.run(ins).outputs[0]), np.asarray(p.run(ins)[0]), what=f"n={n}")
    (c,) = sl.closures()
    assert c.hoist == ("cache",) and not c.shapeless and not c.poisoned and c.trusted and c.traces == 2
    assert sl.counters["compiled_calls"] == 6 and sl.counters["verify_calls"] == 2


def test_an_if_hoisted_out_of_a_shapeless_trace_answers_eagerly(shapeless_everywhere):
    """When a traced input keeps a free dim the trace is shapeless and would not see the cache's shape change
    (a baked row count going stale): that key answers eagerly."""
    s, (r,) = compiled_session(rope_if())
    sl = _shapeless(r)
    for n in (2, 3, 5, 6):
        f = rope_feed(n)
        got = sl.run([f["x"], f["mask"]]).outputs
        assert_close(np.asarray(got[0]), np.asarray(r.program.run([f["x"], f["mask"]])[0]), what=f"n={n}")
    (c,) = sl.closures()
    assert c.poisoned and "shapeless" in c.poisoned and sl.counters["compiled_calls"] == 0


def test_a_prompt_with_an_if_of_constants_is_not_padded_to_a_bucket():
    """Padding the mask to a bucket would pick the If's branch by the bucket's length, not the prompt's."""
    from ortmlx.compiled.attention import BucketedPrefill
    cache = helper.make_graph([helper.make_node("Constant", [], ["c"], value=helper.make_tensor(
        "v", T.FLOAT, [1, 1, 4], [1.0] * 4))], "b", [], [helper.make_tensor_value_info("c", T.FLOAT, None)])
    nodes = [helper.make_node("Shape", ["mask"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["len"], axis=0),
             helper.make_node("Greater", ["len", "th"], ["long_ctx"]),
             helper.make_node("If", ["long_ctx"], ["cache"], then_branch=cache, else_branch=cache),
             helper.make_node("Mul", ["x", "cache"], ["y"]),
             helper.make_node("Identity", ["past"], ["present"])]
    m = make_model(nodes, [("x", T.FLOAT, ["batch_size", "sequence_length", 4]),
                           ("mask", T.INT64, ["batch_size", "total_sequence_length"]),
                           ("past", T.FLOAT, ["batch_size", 1, "past_sequence_length", 4])],
                   [("y", T.FLOAT, ["batch_size", "sequence_length", 4]),
                    ("present", T.FLOAT, ["batch_size", 1, "past_sequence_length", 4])],
                   {"one": np.array(1, np.int64), "th": np.array(20, np.int64)})
    s, (r,) = compiled_session(m)
    p = r.program
    bp = BucketedPrefill(p, tuning=Tuning(build_behind=False))
    f = {"x": np.ones((1, 18, 4), np.float32), "mask": np.ones((1, 18), np.int64),
         "past": np.zeros((1, 1, 64, 4), np.float32)}
    assert bp.bucket([f[k] for k in p.inputs]) is None


def test_an_if_that_computes_is_never_traced():
    m = rope_if(computed_branch=True)
    s, rs = compiled_session(m)
    check(s, m, [rope_feed(n) for n in (3, 3, 6, 6)])
    assert all(r.counters["traces"] == 0 for r in rs)


# ---------------------------------------------------------------------------- shapes a decode key fixes
def router_like():
    """LFM2-MoE's router idiom: a value reshaped by its own shape's leading dims (Shape -> Slice -> Concat ->
    Reshape) next to the growing mask's sum: x's dims are fixed by the key, the mask's length is not."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Shape", ["r"], ["shape"]),
             helper.make_node("Slice", ["shape", "zero", "two"], ["lead"]),
             helper.make_node("Concat", ["lead", "minus_one"], ["to"], axis=0),
             helper.make_node("Reshape", ["r", "to"], ["flat"]),
             helper.make_node("Cast", ["mask"], ["maskf"], to=T.FLOAT),
             helper.make_node("ReduceSum", ["maskf"], ["n"], keepdims=0),
             helper.make_node("Add", ["flat", "n"], ["y"])]
    return make_model(nodes, [("x", T.FLOAT, ["batch_size", "sequence_length", 2, 4]),
                              ("mask", T.INT64, ["batch_size", "total_sequence_length"])],
                      [("y", T.FLOAT, ["batch_size", "sequence_length", 8])],
                      {"zero": np.array([0], np.int64), "two": np.array([2], np.int64),
                       "minus_one": np.array([-1], np.int64)})


def _free_mask(program) -> frozenset:
    """The key's free dims: the mask's length, (its input index, axis 1)."""
    return frozenset({(program.inputs.index("mask"), 1)})


def test_a_shape_the_decode_key_fixes_is_baked_not_refused(shapeless_everywhere):
    """A traced value's shape whose declared dims are all fixed by the key (batch_size, sequence_length, numbers)
    is baked like a constant, though the mask's length (a free dim) makes the trace shapeless: the closure traces
    and matches eager at every length (before, "values computed from traced shapes would be baked (to)")."""
    s, (r,) = compiled_session(router_like())
    p = r.program
    sl = C.CompiledSubgraph(p, CompiledConfig("test", SHAPELESS), free_dims=_free_mask(p),
                            tuning=Tuning(gpu_shapeless=True, build_behind=False))
    x = RNG.standard_normal((1, 1, 2, 4)).astype(np.float32)
    for n in (3, 4, 5, 6, 9):
        feeds = {"x": x, "mask": np.ones((1, n), np.int64)}
        ins = [feeds[k] for k in p.inputs]
        assert_close(np.asarray(sl.run(ins).outputs[0]), np.asarray(r.program.run(ins)[0]), what=f"n={n}")
    (c,) = sl.closures()
    assert c.fn is not None and c.trusted and not c.poisoned and c.shapeless and c.traces == 1
    assert sl.counters["compiled_calls"] == 3 and sl.counters["verify_calls"] == 2


def test_keyed_shapes_reads_the_declared_dims():
    from ortmlx.compiled.analysis import keyed_shapes
    s, (r,) = compiled_session(router_like())
    p = r.program
    keyed = keyed_shapes(p, _free_mask(p))
    assert keyed("r") and keyed("x") and keyed("y")             # batch_size, sequence_length, numbers
    assert not keyed("mask") and not keyed("flat")              # total_sequence_length: free; unknown dims
    both = _free_mask(p) | {(p.inputs.index("x"), 1)}
    assert not keyed_shapes(p, both)("r")                       # sequence_length free too


def test_a_wrongly_declared_shape_is_caught_at_the_next_verification(shapeless_everywhere):
    """v is declared [batch_size, sequence_length] (fixed by the key) but is the mask's [batch_size,
    total_sequence_length]: its baked length would make a later condition wrong at lengths the outputs' comparison
    does not reach, so each verification compares v's shape with the traced one and poisons the closure."""
    nodes = [helper.make_node("Cast", ["mask"], ["v"], to=T.FLOAT),
             helper.make_node("Shape", ["v"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["len"], axis=0),
             helper.make_node("Greater", ["len", "five"], ["gt"]),
             helper.make_node("Cast", ["gt"], ["gtf"], to=T.FLOAT),
             helper.make_node("Add", ["gtf", "one_f"], ["scale"]),
             helper.make_node("Mul", ["x", "scale"], ["xs"]),
             helper.make_node("ReduceSum", ["v"], ["n"], keepdims=0),
             helper.make_node("Add", ["xs", "n"], ["y"])]
    m = make_model(nodes, [("x", T.FLOAT, ["batch_size", "sequence_length", 4]),
                           ("mask", T.INT64, ["batch_size", "total_sequence_length"])],
                   [("y", T.FLOAT, ["batch_size", "sequence_length", 4])],
                   {"one": np.array(1, np.int64), "five": np.array(5, np.int64), "one_f": np.array(1.0, np.float32)})
    m.graph.value_info.append(helper.make_tensor_value_info("v", T.FLOAT, ["batch_size", "sequence_length"]))
    s, (r,) = compiled_session(m)
    p = r.program
    sl = C.CompiledSubgraph(p, CompiledConfig("test", SHAPELESS), free_dims=frozenset({(p.inputs.index("mask"), 1)}),
                            tuning=Tuning(gpu_shapeless=True, build_behind=False))
    x = np.ones((1, 1, 4), np.float32)
    for n in (3, 4, 5, 6, 7):
        f = {"x": x, "mask": np.ones((1, n), np.int64)}
        ins = [f[k] for k in p.inputs]
        assert_close(np.asarray(sl.run(ins).outputs[0]), np.asarray(p.run(ins)[0]), what=f"n={n}")
    (c,) = sl.closures()
    assert c.poisoned and "changed under one key" in c.poisoned and sl.counters["compiled_calls"] == 0
