"""Issue 5, observability: the trace file, the verbose summary, and silence when both are off."""
from __future__ import annotations

import gc
import json
import threading

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import ortmlx.ep.compute as compute_mod
from ortmlx import trace as trace_mod
from ortmlx.stats import SessionStats
from ortmlx.testing import make_model, session

STAGES = ("copy_in", "build", "eval", "copy_out")


def two_group_model():
    """Add -> Relu claimed, Mul disabled (left to the CPU EP) in between: two groups."""
    nodes = [h.make_node("Add", ["X", "X"], ["a"], name="add0"),
             h.make_node("Mul", ["a", "X"], ["b"], name="mul_cpu"),
             h.make_node("Sub", ["b", "X"], ["Y"], name="sub1")]
    return make_model(nodes, [("X", T.FLOAT, ["N", 4])], [("Y", T.FLOAT, ["N", 4])])


def release(*sessions):
    for s in sessions:
        del s
    gc.collect()


def load(path):
    with open(path) as f:
        return json.load(f)["traceEvents"]


def test_trace_records_claim_compile_and_per_call_stage_split(tmp_path):
    path = tmp_path / "t.json"
    s = session(two_group_model(), options={"trace": str(path), "disable_ops": "Mul"})
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for _ in range(3):
        np.testing.assert_array_equal(s.run(None, {"X": x})[0], (x + x) * x - x)
    assert not path.exists()                       # written at session release
    del s
    gc.collect()
    ev = load(path)
    names = [e["name"] for e in ev]
    assert "claim" in names and names.count("compile") == 2
    part = [e for e in ev if e["name"] == "partition"]
    assert part and part[0]["args"]["claimed"] == 2 and part[0]["args"]["nodes"] == 3
    assert any("mul_cpu" in c and "disable_ops" in c for c in part[0]["args"]["cpu"])
    calls = [e for e in ev if e["name"].startswith("compute ")]
    assert len(calls) == 6                         # 2 groups x 3 runs
    for c in calls:
        t0, t1 = c["ts"], c["ts"] + c["dur"]
        inner = sorted((e for e in ev if e.get("cat") == "compute" and e["name"] in STAGES
                        and e["tid"] == c["tid"] and t0 - 1e-3 <= e["ts"] <= t1 + 1e-3), key=lambda e: e["ts"])
        got = [e["name"] for e in inner]
        assert got[:4] == list(STAGES) and len(got) == 4, got
        for a, b in zip(inner, inner[1:]):         # contiguous: each stage starts where the last ended
            assert abs(a["ts"] + a["dur"] - b["ts"]) < 1.0
        assert all(e["dur"] >= 0 for e in inner)
    meta = [e for e in ev if e["name"] == "process_name"]
    assert len(meta) == 1 and "graph 'g'" in meta[0]["args"]["name"]


def test_trace_from_environment_and_failed_call_recorded(tmp_path, monkeypatch):
    path = tmp_path / "env.json"
    monkeypatch.setenv("ORTMLX_TRACE", str(path))
    s = session(two_group_model(), options={"tuning": "fault=eval#1"})
    x = np.ones((1, 4), np.float32)
    with pytest.raises(Exception, match="injected fault at eval"):
        s.run(None, {"X": x})
    s.run(None, {"X": x})
    del s
    gc.collect()
    ev = load(path)
    failed = [e for e in ev if e["name"].startswith("compute ") and "error" in e.get("args", {})]
    assert len(failed) == 1 and "injected fault at eval" in failed[0]["args"]["error"]
    assert sum(1 for e in ev if e["name"].startswith("compute ")) >= 2


def test_two_sessions_share_one_trace_file_and_threads_get_tracks(tmp_path):
    path = tmp_path / "shared.json"
    trace_mod.forget(str(path))
    a = session(two_group_model(), options={"trace": str(path)})
    b = session(two_group_model(), options={"trace": str(path)})
    x = np.ones((2, 4), np.float32)

    def work(s):
        for _ in range(5):
            s.run(None, {"X": x})

    ts = [threading.Thread(target=work, args=(s,)) for s in (a, b, a)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    del a
    gc.collect()
    first = load(path)
    del b
    gc.collect()
    ev = load(path)
    assert len(ev) > len(first)
    pids = {e["pid"] for e in ev if e["name"] == "process_name"}
    assert len(pids) == 2
    threads = {(e["pid"], e["tid"]) for e in ev if e["name"] == "thread_name"}
    assert len(threads) >= 3                       # main (claim/compile) + one worker per session at least


def test_verbose_summary_at_release(capfd):
    s = session(two_group_model(), options={"verbose": "1", "disable_ops": "Mul"})
    x = np.ones((3, 4), np.float32)
    for _ in range(4):
        s.run(None, {"X": x})
    assert "session summary" not in capfd.readouterr().err      # nothing before release
    del s
    gc.collect()
    err = capfd.readouterr().err
    assert "MLXExecutionProvider session summary (device cpu)" in err
    assert "2/3 nodes claimed in 2 group(s)" in err
    assert "CPU: Mul 'mul_cpu': disabled by the disable_ops option" in err
    assert "compute calls: 8" in err
    for k in STAGES:
        assert f"time compute.{k}:" in err
    assert err.count("calls 4;") == 2 and "us/call" in err


def test_nothing_printed_or_written_when_off(capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("ORTMLX_TRACE", "ORTMLX_VERBOSE", "ORTMLX_FAULT"):
        monkeypatch.delenv(var, raising=False)
    s = session(two_group_model())
    s.run(None, {"X": np.ones((1, 4), np.float32)})
    del s
    gc.collect()
    cap = capfd.readouterr()
    assert "MLXExecutionProvider" not in cap.out and "MLXExecutionProvider" not in cap.err
    assert list(tmp_path.iterdir()) == []


def test_fast_path_builds_no_probe_when_off(monkeypatch):
    """With trace/verbose/fault off, Compute takes no timestamps: the Probe is never made."""
    def boom(*a, **k):
        raise AssertionError("Probe constructed on the unobserved path")
    monkeypatch.setattr(compute_mod, "Probe", boom)
    s = session(two_group_model())
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(s.run(None, {"X": x})[0], (x + x) * x - x)
    s2 = session(two_group_model(), options={"verbose": "1"})
    with pytest.raises(Exception, match="Probe constructed"):
        s2.run(None, {"X": x})                     # ... and the observed path does use it (the check can fail)


def test_fallbacks_and_compiled_facts_reach_summary_and_trace(tmp_path):
    """The interface the compiled path reports through: stats.fallback / stats.group."""
    st = SessionStats("cpu", trace=str(tmp_path / "fb.json"), verbose=True)
    g = st.group("grp0")
    g.update(compiled="shapeless", traces=3, poisoned="shape-dependent Reshape")
    st.fallback("grp0", "dynamic rank input")
    with st.span("trace", group="grp0"):
        pass
    text = st.summary()
    assert "group grp0: calls 0; compiled shapeless; traces 3; poisoned: shape-dependent Reshape" in text
    assert "eager fallbacks: 1" in text and "grp0: dynamic rank input" in text
    assert "time trace:" in text
    st.finish()
    ev = load(tmp_path / "fb.json")
    fb = [e for e in ev if e["name"] == "eager fallback grp0"]
    assert fb and fb[0]["args"]["why"] == "dynamic rank input"
    assert any(e["name"] == "trace" and e["args"]["group"] == "grp0" for e in ev)


def test_trace_event_cap_keeps_memory_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_mod, "MAX_EVENTS", 50)
    t = trace_mod.Tracer(str(tmp_path / "cap.json"))
    for i in range(200):
        t.complete("x", "c", i, i + 1)
    assert len(t.events) == 50 and t.dropped > 0
    t.flush()
    ev = load(tmp_path / "cap.json")
    assert any("events dropped" in e["name"] for e in ev)
