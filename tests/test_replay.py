"""Replays (``Runner.steady`` / ``Runner.replay``, ``runtime/group.py``): a call with the last call's input shapes
and types, answered by a trusted closure alone, skips keying, mirrors and the general copy-out. The answers stay
the CPU EP's; a failure poisons the closure and answers eagerly; an output written into an input's buffer ends
replays for the group."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper

import ortmlx.compiled as C
from ortmlx.testing import assert_close, make_model, session

RNG = np.random.default_rng(11)
W = RNG.standard_normal((16, 8)).astype(np.float32)


def mlp():
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    return make_model(nodes, [("x", T.FLOAT, ["N", 16])], [("y", T.FLOAT, ["N", 8])], {"W": W})


def replays_counted(runner) -> list:
    """Spy on ``runner.replay``: one entry per replay that answered (True) or declined (False)."""
    seen, real = [], runner.replay

    def replay(steady, inputs):
        out = real(steady, inputs)
        seen.append(out is not None)
        return out
    runner.replay = replay
    return seen


def compiled(model):
    with C.capture() as rs:
        s = session(model)
    (r,) = rs
    return s, r


def test_steady_calls_are_replays_with_the_cpu_eps_answers():
    m = mlp()
    s, r = compiled(m)
    cpu = session(m, "CPUExecutionProvider", record=False)
    seen = replays_counted(r)
    for n in [4] * 5 + [7] * 4 + [4] * 2:
        f = {"x": RNG.standard_normal((n, 16)).astype(np.float32)}
        assert_close(s.run(None, f)[0], cpu.run(None, f)[0], what=f"batch {n}")
    # per shape: eager, trace + verify, compiled (the replay is made), then replays; a new shape goes through
    # the keys again (batch 4's closure answers it at once), then replays
    assert seen == [True, True, True, True], seen
    assert r.trace_counts() == [1, 1] and r.counters["poisoned_closures"] == 0, r.counters
    assert r.counters["compiled_calls"] == 7 and r.counters["eager_calls"] == 4, r.counters   # replays count in


def test_a_failing_replay_poisons_its_closure_and_answers_eagerly():
    m = mlp()
    s, r = compiled(m)
    cpu = session(m, "CPUExecutionProvider", record=False)
    seen = replays_counted(r)
    feeds = [{"x": RNG.standard_normal((3, 16)).astype(np.float32)} for _ in range(6)]
    for f in feeds[:4]:
        s.run(None, f)
    assert seen == [True]
    (c,) = r.closures()

    def broken(*args):
        raise RuntimeError("injected")
    c.fn = broken
    for f in feeds[4:]:
        assert_close(s.run(None, f)[0], cpu.run(None, f)[0], what="after the failure")
    assert seen == [True, False], seen          # the failed replay; the next call runs eagerly, not replayed
    assert c.poisoned and "injected" in c.poisoned and r.counters["poisoned_closures"] == 1, r.counters


def test_an_output_written_into_an_input_buffer_ends_replays():
    """y = x + x with y bound to x's own buffer (as genai's shared KV buffer is): each run doubles it."""
    m = make_model([helper.make_node("Add", ["x", "x"], ["y"])], [("x", T.FLOAT, [2, 8])], [("y", T.FLOAT, [2, 8])])
    s, r = compiled(m)
    seen = replays_counted(r)
    x = RNG.standard_normal((2, 8)).astype(np.float32)
    for _ in range(4):
        assert_close(s.run(None, {"x": x})[0], 2 * x, what="unbound")
    assert seen == [True]
    val = ort.OrtValue.ortvalue_from_numpy(x.copy())
    io = s.io_binding()
    io.bind_ortvalue_input("x", val)
    io.bind_ortvalue_output("y", val)
    for k in range(1, 5):
        s.run_with_iobinding(io)
        assert_close(val.numpy(), x * 2.0 ** k, what=f"in place, run {k}")
    assert seen == [True, True], seen           # the first bound call was replayed, then no more
