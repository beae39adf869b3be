"""Kernels built by a worker process (tuning ``prebuild``, on a GPU by default; ``runtime/prebuild.py``): a new
closure's key answers eagerly while a worker, the same model file in an ORT InferenceSession of its own, makes the
call (twice) and so builds its kernels into MLX's cache; then the closure is traced here, finds them built, is
verified and trusted. A ledger in the cache lets a later InferenceSession trace such a key at once. On the CPU
backend here (its g++ kernels are cached the same way), answers as ORT's CPU EP's throughout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from ortmlx.runtime import prebuild
from ortmlx.testing import child_env, probe_json
from ortmlx.runtime.prebuild import ModelSource, feed

_PROBE = r"""
import json, os, sys, time
import numpy as np
import onnx
sys.path.insert(0, sys.argv[1])
import onnxruntime as ort
import ortmlx, ortmlx.compiled as C
from ortmlx.kernels import background
from ortmlx.testing import assert_close
from ortmlx.version import mlx_cache_dir
from models_basic import mlp
ortmlx.register(genai=False)
path = os.path.join(os.environ["TMPDIR"], "mlp.onnx")
onnx.save(mlp(), path)
opts = {"tuning": sys.argv[2], "device": "cpu"}
cpu = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
x = {"X": np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)}
want = cpu.run(None, x)
out = {}
def files():
    return sorted(f for _, _, fs in os.walk(mlx_cache_dir()) for f in fs if f.endswith(".so"))
for name in ("first", "second"):
    with C.capture() as rs:
        s = ort.InferenceSession(path, providers=[("MLXExecutionProvider", opts)])
    (r,) = rs
    got = []
    for i in range(2):
        got.append(s.run(None, x))
    before = files()
    waited = background.wait(240)
    built = files()
    got.append(s.run(None, x))
    after = files()
    got.append(s.run(None, x))
    for g in got:
        assert_close(g[0], want[0], what=name)
    (c,) = r.closures()
    out[name] = {"behind": r.counters.get("built_behind", 0), "traces": c.traces, "trusted": c.trusted,
                 "compiled": r.counters["compiled_calls"], "waited": waited, "before": before, "built": built,
                 "after": after, "states": sorted(set(background._state.values()))}
print(json.dumps(out))
"""


def _run(tmp_path, tuning: str) -> dict:
    return probe_json(_PROBE, tmp_path, os.path.dirname(os.path.abspath(__file__)), tuning, timeout=600)


def test_a_worker_builds_a_new_closures_kernels_and_the_ledger_keeps_them(tmp_path):
    """An empty kernel cache: the first InferenceSession's new key answers eagerly, its kernels built by the worker
    (none here before the wait, some after it), then the closure traced here builds none of its own; a second
    InferenceSession of the same model traces that key at once (the ledger), with no job."""
    got = _run(tmp_path, "build_behind=1,prebuild=1")
    first, second = got["first"], got["second"]
    assert first["behind"] == 1 and first["states"] == ["done"], first
    assert not first["before"] and first["built"], "the worker built no kernel"
    assert first["after"] == first["built"] and first["traces"] == 1 and first["trusted"], first
    assert first["compiled"] >= 1, first
    assert second["behind"] == 0 and second["traces"] == 1 and second["compiled"] >= 2, second
    assert second["after"] == first["built"], "the second InferenceSession built kernels of its own"
    with open(os.path.join(tmp_path, "mlx", prebuild.LEDGER)) as f:
        assert len(f.read().split()) == 1


def test_without_the_worker_the_process_builds_them(tmp_path):
    """``prebuild=0`` (and the CPU's default): no job; the closure is traced here."""
    got = _run(tmp_path, "build_behind=0,prebuild=0")
    assert got["first"]["behind"] == 0 and got["first"]["before"] and got["first"]["compiled"] >= 2, got
    assert not os.path.exists(os.path.join(tmp_path, "mlx", prebuild.LEDGER))


def test_a_failed_job_leaves_the_build_to_the_process(monkeypatch, tmp_path):
    """A worker that fails (here: the model file gone) fails its job; the key is then traced here, answers
    unchanged."""
    import onnx

    import ortmlx.compiled as C
    from ortmlx.kernels import background
    from ortmlx.testing import assert_close, session
    from models_basic import mlp
    m = mlp()
    path = str(tmp_path / "mlp.onnx")
    onnx.save(m, path)
    src = ModelSource(path, ("X",))
    assert src.covers(["X"]) and not src.covers(["X", "Y"]) and not ModelSource("", ("X",)).covers(["X"])
    def gone(self, feeds, record=None, calls=None):
        raise RuntimeError("gone")
    monkeypatch.setattr(prebuild.Worker, "run", gone)
    with C.capture() as rs:
        s = session(m, options={"tuning": "build_behind=1,prebuild=1", "device": "cpu"})
    (r,) = rs
    # an InferenceSession from bytes has no model path: give its group the worker as the EP would for a file
    pb = prebuild.WorkerPrebuild(src, {}, ["X"])
    monkeypatch.setattr(prebuild, "_ledger", lambda: set())
    for part in r.parts():
        part.prebuild = pb
    x = {"X": np.ones((4, 16), np.float32)}
    cpu = session(m, "CPUExecutionProvider", record=False)
    want = cpu.run(None, x)

    def call():
        pb.bind([x["X"]])
        assert_close(s.run(None, x)[0], want[0], what="mlx vs cpu")
    call()
    call()
    (c,) = r.closures()
    assert r.counters["built_behind"] == 1 and c.traces == 0
    assert background.wait(60) and background.state(c.behind).startswith("failed: RuntimeError: gone")
    call()
    assert c.traces == 1 and c.trusted and c.behind is None
    assert any("kernels built behind the calls: failed: RuntimeError: gone" in w for w in r._said), r._said


def test_a_worker_only_where_a_second_copy_fits(monkeypatch, tmp_path):
    """The model file and its external data count; a device reporting less than ``1 / MEMORY_SHARE`` times that
    free (else in all) gets no worker, one reporting nothing does."""
    import mlx.core as mx
    (tmp_path / "m.onnx").write_bytes(b"x" * 100)
    (tmp_path / "m.onnx.data").write_bytes(b"x" * 900)
    (tmp_path / "other.bin").write_bytes(b"x" * 5000)
    path = str(tmp_path / "m.onnx")
    assert prebuild.model_bytes(path) == 1000
    src = ModelSource(path, ("X",))
    for info, ok in (({"free_memory": 1500, "total_memory": 9000}, False), ({"free_memory": 2000}, True),
                     ({"total_memory": 1900}, False), ({"memory_size": 4000}, True), ({}, True)):
        monkeypatch.setattr(mx, "device_info", lambda info=info: info)
        assert src.covers(["X"]) == ok, info


def test_a_jobs_inputs():
    """Small inputs and large non-float ones go as they are; large float ones (a KV cache) as zeros' shape."""
    small = np.arange(6, dtype=np.float16)
    big = np.ones((2, 1 << 19), np.float32)
    ids = np.ones((1, 1 << 19), np.int64)
    assert feed(None) is None
    np.testing.assert_array_equal(feed(small), small)
    assert feed(big) == ("zeros", (2, 1 << 19), "<f4")
    np.testing.assert_array_equal(feed(ids), ids)


def test_a_job_is_run_as_often_as_it_asks(monkeypatch):
    """The worker makes a job's call ``calls`` times (a replayed decode key's five), then writes its ledger line;
    the client sends the count it was given, else ``CALLS``."""
    from ortmlx import prebuild as worker
    runs, lines = [], []

    class Session:
        def run(self, names, feeds):
            runs.append(sorted(feeds))
    monkeypatch.setattr(worker, "record_built", lines.append)
    x = np.ones(3, np.float32)
    worker.run_job(Session(), {"feeds": {"X": x}, "record": "line", "calls": 5})
    assert runs == [["X"]] * 5 and lines == ["line"]
    runs.clear()
    worker.run_job(Session(), {"feeds": {"X": ("zeros", (2,), "<f4")}, "record": None, "calls": 2})
    assert len(runs) == 2 and lines == ["line"] and prebuild.CALLS == 2
    sent = []
    w = prebuild.Worker("model.onnx", {})

    def start():
        w.proc = types.SimpleNamespace(poll=lambda: None)
    monkeypatch.setattr(w, "_start", start)
    monkeypatch.setattr(w, "_send", sent.append)
    monkeypatch.setattr(w, "_reply", lambda want: (want,))
    w.run({"X": x}, "line", 5)
    w.run({"X": x}, "line")
    assert [m["calls"] for m in sent] == [5, prebuild.CALLS]


@pytest.mark.parametrize("bad", [b"", b"\x80\x05junk"])
def test_the_worker_ends_quietly_on_bad_input(bad):
    """The worker answers a closed or garbled input by ending, never hanging."""
    r = subprocess.run([sys.executable, "-m", "ortmlx.prebuild"], input=bad, capture_output=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode in (0, 1), r.stderr[-2000:]


@pytest.mark.parametrize("script, limit, why", [("import time; time.sleep(60)", 2.0, "took over 2 s"),
                                                ("import sys; sys.exit(3)", 60.0, "exited (rc 3)")])
def test_a_worker_that_hangs_or_dies_fails_its_jobs(monkeypatch, script, limit, why):
    """A worker that never answers is killed after ``JOB_TIMEOUT_S``, one that exits is seen to; either fails
    that job and every later one (their keys are traced where they are next called)."""
    monkeypatch.setattr(prebuild, "WORKER_CMD", [sys.executable, "-c", script])
    monkeypatch.setattr(prebuild, "JOB_TIMEOUT_S", limit)
    w = prebuild.Worker("model.onnx", {})
    for _ in range(2):
        with pytest.raises(RuntimeError, match=why.replace("(", r"\(").replace(")", r"\)")):
            w.run({"X": np.ones(2)})
    assert w.proc.poll() is not None


#: a worker (``ortmlx.prebuild.main`` itself) whose session's call marks its start in a file, then takes argv[1] s;
#: its job limit argv[2] s
_SLOW_WORKER = r"""
import sys, time
import ortmlx.prebuild as w
class Slow:
    def run(self, outputs, feeds):
        open(sys.argv[3], "a").close()
        time.sleep(float(sys.argv[1]))
w._session = lambda path, options: Slow()
w.JOB_TIMEOUT_S = float(sys.argv[2])
sys.exit(w.main())
"""

#: a process that gives its worker a job and exits once the job has started: the worker's pid and the ledger
_EXITS_IN_A_JOB = r"""
import json, os, sys, time
import numpy as np
from ortmlx.kernels import background
from ortmlx.runtime import prebuild
started = os.path.join(os.environ["TMPDIR"], "started")
prebuild.WORKER_CMD = [sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3], started]
w = prebuild._worker("model.onnx", {})
background.submit("job", lambda: w.run({"X": np.ones(2)}, record="a-key-built"))
t0 = time.monotonic()
while not os.path.exists(started) and time.monotonic() - t0 < 120:
    time.sleep(0.02)
print(json.dumps({"pid": w.proc.pid, "ledger": prebuild._ledger_path(), "started": os.path.exists(started)}))
"""


def _ended(pid: int) -> bool:
    """Whether process ``pid`` (not this one's child) has ended: gone, or a zombie not yet reaped."""
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("limit, built", [(600, True), (2, False)])
def test_a_job_in_flight_at_exit_is_left_to_the_worker(tmp_path, limit, built):
    """A process that exits while its worker builds a key's kernels does not wait for them, nor kill the worker: the
    worker finishes the job, writes its ledger line (the next process traces that key at once) and ends; a job over
    the worker's own limit ends it with no line."""
    env = child_env(TMPDIR=str(tmp_path), ORTMLX_TUNING="")
    env.pop("MLX_PTX_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", _EXITS_IN_A_JOB, _SLOW_WORKER, "8", str(limit)], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["started"], r.stderr[-3000:]
    assert f"process {got['pid']} finishes them" in r.stderr, r.stderr[-3000:]
    assert not os.path.exists(got["ledger"]), "the exiting process waited for the job"
    t0 = time.monotonic()
    while not _ended(got["pid"]) and time.monotonic() - t0 < 60:
        time.sleep(0.1)
    assert _ended(got["pid"]), "the worker did not end"
    if built:
        with open(got["ledger"]) as f:
            assert f.read().split() == ["a-key-built"]
    else:
        assert not os.path.exists(got["ledger"])
