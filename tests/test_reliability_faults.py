"""Issue 5, faults: an exception at any stage becomes an ORT error naming the node; the session survives."""
from __future__ import annotations

import gc
import re
import threading

import mlx.core as mx
import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from ortmlx.stats import FaultSpec
from ortmlx.testing import make_model, session, unclaimed_ops


def model():
    """Two outputs (so copy_out can fail with output 0 already allocated) and a constant."""
    nodes = [h.make_node("Add", ["X", "C"], ["a"], name="add_c"),
             h.make_node("Mul", ["a", "X"], ["Y"], name="mul_x"),
             h.make_node("Sub", ["Y", "a"], ["Z"], name="sub_a")]
    return make_model(nodes, [("X", T.FLOAT, ["N", 4])], [("Y", T.FLOAT, ["N", 4]), ("Z", T.FLOAT, ["N", 4])],
                      initializers={"C": np.arange(4, dtype=np.float32)})


def want(x):
    a = x + np.arange(4, dtype=np.float32)
    return a * x, a * x - a


X = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)


def check_good(s, x=X):
    y, z = s.run(None, {"X": x})
    wy, wz = want(x)
    np.testing.assert_allclose(y, wy, rtol=1e-6)
    np.testing.assert_allclose(z, wz, rtol=1e-6)


@pytest.mark.parametrize("stage", ["compute", "copy_in", "build", "eval", "copy_out", "copyout"])
def test_run_stage_fault_is_an_ort_error_naming_the_nodes_then_next_run_succeeds(stage):
    s = session(model(), options={"tuning": f"fault={stage}#2"})
    for _ in range(2):
        with pytest.raises(Exception) as ei:
            s.run(None, {"X": X})
        msg = str(ei.value)
        assert "EP_FAIL" in msg and "MLXExecutionProvider Compute" in msg
        canon = {"copyout": "copy_out"}.get(stage, stage)
        assert f"injected fault at {canon}" in msg
        assert "Add 'add_c'" in msg and "Mul 'mul_x'" in msg and "Sub 'sub_a'" in msg   # the group's nodes
    for _ in range(3):                     # the fault budget is spent: the same session now answers right
        check_good(s)
    assert not unclaimed_ops(s)


def test_fault_targets_one_group_by_a_node_name_inside_it():
    nodes = [h.make_node("Add", ["X", "X"], ["a"], name="g0_add"),
             h.make_node("Mul", ["a", "a"], ["b"], name="cpu_mul"),
             h.make_node("Sub", ["b", "X"], ["Y"], name="g1_sub")]
    m = make_model(nodes, [("X", T.FLOAT, [2])], [("Y", T.FLOAT, [2])])
    x = np.ones(2, np.float32)
    for target, hit, spared in (("g1_sub", "g1_sub", "g0_add"), ("g0_add", "g0_add", "g1_sub")):
        s = session(m, options={"disable_ops": "Mul", "tuning": f"fault=eval:{target}#1"})
        with pytest.raises(Exception) as ei:
            s.run(None, {"X": x})
        assert f"Sub 'g1_sub'" in str(ei.value) if hit == "g1_sub" else "Add 'g0_add'" in str(ei.value)
        assert f"'{spared}'" not in str(ei.value)
        np.testing.assert_array_equal(s.run(None, {"X": x})[0], (x + x) * (x + x) - x)
    s = session(m, options={"disable_ops": "Mul", "tuning": "fault=eval:no_such_node"})
    np.testing.assert_array_equal(s.run(None, {"X": x})[0], (x + x) * (x + x) - x)


def test_compile_fault_fails_session_creation_naming_the_group_and_a_new_session_works():
    with pytest.raises(Exception) as ei:
        session(model(), options={"tuning": "fault=compile"})
    msg = str(ei.value)
    assert "MLXExecutionProvider Compile" in msg and "injected fault at compile" in msg
    check_good(session(model()))


def test_getcapability_fault_leaves_every_node_to_cpu_and_answers_right(capfd):
    s = session(model(), options={"tuning": "fault=getcapability"})
    check_good(s)
    assert sum(unclaimed_ops(s).values()) == 3
    assert "injected fault at getcapability" in capfd.readouterr().err   # ORT logs our status


def test_bad_fault_spec_is_a_clear_error(capfd):
    with pytest.raises(ValueError, match="stage 'nope' is not one of"):
        FaultSpec("nope")
    with pytest.raises(ValueError, match="count 'x' is not an integer"):
        FaultSpec("eval#x")
    session(model(), options={"tuning": "fault=nope"})           # ORT falls back to the CPU EP at creation ...
    cap = capfd.readouterr()
    assert "stage 'nope' is not one of" in cap.out + cap.err          # ... and shows our reason


def test_real_mlx_error_names_the_node_and_session_survives():
    """Dynamic dims that do not broadcast: MLX raises while building; the error names the Add node."""
    nodes = [h.make_node("Add", ["A", "B"], ["S"], name="the_add"), h.make_node("Relu", ["S"], ["Y"])]
    m = make_model(nodes, [("A", T.FLOAT, ["n"]), ("B", T.FLOAT, ["m"])], [("Y", T.FLOAT, None)])
    s = session(m)
    cpu = session(m, "CPUExecutionProvider")
    bad = {"A": np.ones(3, np.float32), "B": np.ones(4, np.float32)}
    with pytest.raises(Exception):
        cpu.run(None, bad)                                 # the CPU EP refuses it too
    with pytest.raises(Exception) as ei:
        s.run(None, bad)
    assert "Add 'the_add'" in str(ei.value) and "broadcast" in str(ei.value).lower()
    ok = {"A": np.arange(3, dtype=np.float32) - 1, "B": np.ones(1, np.float32)}
    np.testing.assert_array_equal(s.run(None, ok)[0], cpu.run(None, ok)[0])


def test_faults_under_threads_do_not_disturb_other_sessions():
    faulty = session(model(), options={"tuning": "fault=eval#40"})
    good = session(model())
    errors, wrong = [], []

    def hammer(s, n, expect_fail):
        for _ in range(n):
            try:
                y, z = s.run(None, {"X": X})
            except Exception as e:  # noqa: BLE001
                if not expect_fail:
                    errors.append(str(e)[:200])
                elif "injected fault at eval" not in str(e):
                    errors.append(str(e)[:200])
                continue
            wy, wz = want(X)
            if not (np.allclose(y, wy) and np.allclose(z, wz)):
                wrong.append(1)

    ts = [threading.Thread(target=hammer, args=(faulty, 30, True)) for _ in range(2)]
    ts += [threading.Thread(target=hammer, args=(good, 30, False)) for _ in range(2)]
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    assert not any(t.is_alive() for t in ts)
    assert errors == [] and wrong == []
    check_good(faulty)                                     # 40 faults spent across 60 calls


def test_failing_calls_leak_nothing():
    s = session(model(), options={"tuning": "fault=copy_out"})  # every call fails after allocating output 0
    for _ in range(30):
        with pytest.raises(Exception):
            s.run(None, {"X": X})
    gc.collect()
    base = mx.get_active_memory()
    for _ in range(300):
        with pytest.raises(Exception):
            s.run(None, {"X": X})
    gc.collect()
    assert mx.get_active_memory() - base < 64 * 1024, "MLX memory grows with failed calls"


def test_trace_fault_in_the_compiled_path_falls_back_eagerly_visibly(capfd):
    """A failure while mx.compile traces is not the user's problem: right answers, and the summary says so."""
    s = session(model(), options={"tuning": "fault=trace#1", "verbose": "1"})
    for n in (2, 2, 3, 2):
        check_good(s, np.linspace(-1, 1, 4 * n, dtype=np.float32).reshape(n, 4))
    del s
    gc.collect()
    err = capfd.readouterr().err
    assert "injected faults (trace): 1" in err
    assert "poisoned: trace: InjectedFault: injected fault at trace" in err and "eager fallbacks: 1" in err
