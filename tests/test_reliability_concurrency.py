"""Issue 5, concurrency: many sessions, many threads, ORT's own pool, one shared EP library."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from ortmlx.testing import make_model, session, unclaimed_ops


def models():
    """Three different graphs: constants, broadcasting, several groups, a dynamic batch."""
    w = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    m1 = make_model([h.make_node("MatMul", ["X", "W"], ["a"]), h.make_node("Add", ["a", "B"], ["b"]),
                     h.make_node("Relu", ["b"], ["Y"])],
                    [("X", T.FLOAT, ["n", 4])], [("Y", T.FLOAT, ["n", 4])],
                    initializers={"W": w, "B": np.arange(4, dtype=np.float32)})
    m2 = make_model([h.make_node("Mul", ["X", "X"], ["a"]), h.make_node("Sub", ["a", "X"], ["b"]),
                     h.make_node("Neg", ["b"], ["Y"])],
                    [("X", T.FLOAT, ["n", 4])], [("Y", T.FLOAT, ["n", 4])])
    m3 = make_model([h.make_node("Add", ["X", "X"], ["a"]), h.make_node("Mul", ["a", "X"], ["b"]),
                     h.make_node("Sub", ["b", "X"], ["c"]), h.make_node("Max", ["c", "a"], ["Y"])],
                    [("X", T.FLOAT, ["n", 4])], [("Y", T.FLOAT, ["n", 4])])
    return [m1, m2, m3]


def feeds(i):
    return {"X": np.random.default_rng(i).standard_normal((1 + i % 5, 4)).astype(np.float32)}


def parallel_opts(threads=4):
    so = ort.SessionOptions()
    so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    so.inter_op_num_threads = threads
    so.intra_op_num_threads = 2
    return so


def test_many_sessions_many_threads_one_library_exact_answers():
    ms = models()
    cpu = [session(m, "CPUExecutionProvider", record=False) for m in ms]
    want = {(k, i): cpu[k].run(None, feeds(i))[0] for k in range(3) for i in range(10)}
    sess = [session(m) for m in ms] + [session(m, options={"disable_ops": "Mul", "no_compile": "1"},
                                               sess_options=parallel_opts()) for m in ms]
    for s in sess[:3]:
        assert not unclaimed_ops(s)
    bad, errors = [], []

    def work(t):
        try:
            for r in range(60):
                j = (t + r) % len(sess)
                i = (t * 7 + r) % 10
                got = sess[j].run(None, feeds(i))[0]
                if not np.allclose(got, want[(j % 3, i)], rtol=1e-5, atol=1e-6):
                    bad.append((j, i))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e)[:300])

    ts = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    [t.start() for t in ts]
    [t.join(300) for t in ts]
    assert not any(t.is_alive() for t in ts), "hang"
    assert errors == [] and bad == []


def test_sessions_created_run_and_released_concurrently():
    ms = models()
    cpu = [session(m, "CPUExecutionProvider", record=False) for m in ms]
    bad, errors = [], []

    def churn(t):
        try:
            for r in range(6):
                k = (t + r) % 3
                s = session(ms[k], options={"no_compile": "1"} if r % 2 else None,
                            sess_options=parallel_opts(2) if r % 2 else None)
                for i in range(3):
                    if not np.allclose(s.run(None, feeds(i))[0], cpu[k].run(None, feeds(i))[0], rtol=1e-5, atol=1e-6):
                        bad.append((t, r))
                del s
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e)[:300])

    ts = [threading.Thread(target=churn, args=(t,)) for t in range(4)]
    [t.start() for t in ts]
    [t.join(300) for t in ts]
    assert not any(t.is_alive() for t in ts), "hang"
    assert errors == [] and bad == []


PARALLEL = textwrap.dedent("""
    import sys, threading, numpy as np, onnxruntime as ort
    from onnx import TensorProto as T, helper as h
    from ortmlx.testing import make_model, session
    so = ort.SessionOptions()
    so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    so.inter_op_num_threads = 4
    nodes = [h.make_node("Add", ["X", "X"], ["a"], name="left"), h.make_node("Mul", ["X", "X"], ["b"], name="cpu"),
             h.make_node("Sub", ["X", "C"], ["c"], name="right"), h.make_node("Add", ["a", "c"], ["d"]),
             h.make_node("Sub", ["d", "b"], ["Y"])]
    m = make_model(nodes, [("X", T.FLOAT, ["n", 4])], [("Y", T.FLOAT, ["n", 4])],
                   initializers={"C": np.full(4, 0.5, np.float32)})
    opts = {"disable_ops": "Mul", "no_compile": sys.argv[1]}
    s = session(m, options=opts, sess_options=so)
    bad = []
    def work(t):
        for i in range(40):
            x = np.random.default_rng(t * 40 + i).standard_normal((1 + i % 5, 4)).astype(np.float32)
            y = s.run(None, {"X": x})[0]
            if not np.allclose(y, (x + x) + (x - 0.5) - x * x, rtol=1e-5, atol=1e-6):
                bad.append(t)
    ts = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    [t.start() for t in ts]; [t.join() for t in ts]
    print("wrong", len(bad), flush=True)
    del s                         # release joins ORT's pool threads
    print("released", flush=True)
""")

# Found here: mx.compile's per-thread cache on ORT's pool threads held Python objects; when the session
# joined its pool (release, exit) the threads' TLS destructors waited for the GIL the releasing thread held:
# deadlock, or 'terminate called' at exit. Fixed in the compiled path (d060c90); these tests guard it.


def run_script(code, *args, timeout=120):
    try:
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"hang: no exit after {timeout}s; stdout {e.stdout!r}") from None


@pytest.mark.parametrize("compiled", [False, True])
def test_ort_parallel_pool_threads_right_answers_and_clean_release(compiled):
    """Independent branches run on ORT's inter-op threads; the session is released with them alive."""
    out = run_script(PARALLEL, "0" if compiled else "1", timeout=40)     # ~4 s when healthy
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["wrong", "0", "released"], out.stdout


EXIT = textwrap.dedent("""
    import gc, os, sys, threading, numpy as np, onnxruntime as ort, ortmlx
    from onnx import TensorProto as T, helper as h
    from ortmlx.testing import make_model
    ortmlx.register(genai=False)
    m = make_model([h.make_node("Add", ["X", "C"], ["a"]), h.make_node("Relu", ["a"], ["Y"])],
                   [("X", T.FLOAT, ["n", 4])], [("Y", T.FLOAT, ["n", 4])],
                   initializers={"C": np.ones(4, np.float32)}).SerializeToString()
    so = ort.SessionOptions()
    so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    opts = {"trace": sys.argv[1], "verbose": "1", "no_compile": sys.argv[2]}
    keep = []
    def work(i):
        s = ort.InferenceSession(m, so, providers=[("MLXExecutionProvider", opts)])
        for _ in range(30):
            s.run(None, {"X": np.ones((i + 1, 4), np.float32)})
        if i % 2:
            keep.append(s)            # some sessions are still alive at interpreter exit
    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in ts]; [t.join() for t in ts]
    print("done", len(keep))
""")


@pytest.mark.parametrize("compiled", [False, True])
def test_interpreter_exit_with_live_sessions_made_on_worker_threads(tmp_path, compiled):
    path = tmp_path / "exit.json"
    out = run_script(EXIT, str(path), "0" if compiled else "1", timeout=40)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "done 2"
    import json
    ev = json.loads(path.read_text())["traceEvents"]
    assert len({e["pid"] for e in ev if e["name"] == "process_name"}) == 4      # all four sessions written
    assert out.stderr.count("session summary") >= 2                             # released ones printed


SEQ_EXIT = textwrap.dedent("""
    import threading, numpy as np, onnxruntime as ort, ortmlx
    from onnx import TensorProto as T, helper as h
    from ortmlx.testing import make_model
    ortmlx.register(genai=False)
    m = make_model([h.make_node("Add", ["X", "C"], ["a"]), h.make_node("Relu", ["a"], ["Y"])],
                   [("X", T.FLOAT, ["n", 4])], [("Y", T.FLOAT, ["n", 4])],
                   initializers={"C": np.ones(4, np.float32)}).SerializeToString()
    keep = []
    def work(i):
        s = ort.InferenceSession(m, providers=["MLXExecutionProvider"])
        for k in range(30):
            s.run(None, {"X": np.ones((k % 4 + 1, 4), np.float32)})
        keep.append(s)
    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in ts]; [t.join() for t in ts]
    print("done", len(keep))
""")


def test_interpreter_exit_with_compiled_sessions_from_python_threads():
    """The default (compiled) path, sessions built and run on Python threads, alive at exit."""
    out = run_script(SEQ_EXIT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "done 4"
