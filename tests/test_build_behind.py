"""Kernels built behind the calls (tuning ``build_behind``, on with MLX's CPU backend): a new closure's first call
answers eagerly and queues its kernels' build on the builder thread (``kernels/background.py``); its key's calls
stay eager until the build is done, then the closure is traced here, verified against eager and trusted, its
kernels already built (the builder traced a shadow of the same graph). Answers as ORT's CPU EP's throughout.
The rest of the suite runs with it off (tests/conftest.py), since it counts traces and compiled calls."""
from __future__ import annotations

import os

import numpy as np

import ortmlx.compiled as C
from ortmlx.kernels import background
from ortmlx.testing import assert_close, probe_json, session

from models_basic import mlp

ON = {"tuning": "build_behind=1", "device": "cpu"}


def _feed(n: int, seed: int) -> dict:
    return {"X": np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)}


def test_a_new_closure_answers_eagerly_until_its_kernels_are_built():
    m = mlp()
    with C.capture() as rs:
        s = session(m, options=ON)
    cpu = session(m, "CPUExecutionProvider", record=False)
    (r,) = rs

    def call(seed):
        f = _feed(4, seed)
        for g, w in zip(s.run(None, f), cpu.run(None, f)):
            assert_close(g, w, what="mlx vs cpu")

    call(0)                         # a key's first call: eager (eager_calls_before_trace)
    call(1)                         # its second: the closure made, its kernels queued behind, answered eagerly
    (c,) = r.closures()
    key = c.behind
    assert key is not None and c.traces == 0 and r.counters["built_behind"] == 1
    assert background.wait(120) and background.done(key)
    call(2)                         # built: traced here and verified
    assert c.behind is None and c.traces == 1 and c.trusted
    call(3)
    assert r.counters["compiled_calls"] >= 1 and r.counters["built_behind"] == 1


_PROBE = r"""
import json, os, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import ortmlx, ortmlx.compiled as C
from ortmlx.kernels import background
from ortmlx.testing import session
from ortmlx.version import mlx_cache_dir
from models_basic import mlp
ortmlx.register(genai=False)
def files():
    return sorted(f for _, _, fs in os.walk(mlx_cache_dir()) for f in fs if f.endswith(".so"))
with C.capture() as rs:
    s = session(mlp(), options={"tuning": "build_behind=1", "device": "cpu"})
x = {"X": np.ones((4, 16), np.float32)}
s.run(None, x); s.run(None, x)
background.wait(120)
built = files()
s.run(None, x); s.run(None, x)
print(json.dumps({"built": built, "after": files(), "compiled": rs[0].counters["compiled_calls"]}))
"""


def test_the_builders_kernels_are_the_closures(tmp_path):
    """With an empty kernel cache, the builder's shadow builds kernels, and the closure traced here afterwards,
    verified and replayed, builds none of its own."""
    got = probe_json(_PROBE, tmp_path, os.path.dirname(os.path.abspath(__file__)))
    assert got["built"], "the builder built no kernel"
    assert got["after"] == got["built"] and got["compiled"] >= 1, got


_INTERIM = r"""
import json, os, sys, threading
import numpy as np
sys.path.insert(0, sys.argv[1])
import ortmlx, ortmlx.compiled as C
from ortmlx.kernels import background
from ortmlx.testing import assert_close, session
from ortmlx.version import mlx_cache_dir
from models_basic import mlp
ortmlx.register(genai=False)
gate = threading.Event()
real = background.submit
background.submit = lambda key, build: real(key, lambda: (gate.wait(120), build())[1])
def files():
    return sorted(f for _, _, fs in os.walk(mlx_cache_dir()) for f in fs if f.endswith(".so"))
m = mlp()
with C.capture() as rs:
    s = session(m, options={"tuning": "build_behind=1," + sys.argv[2], "device": "cpu"})
cpu = session(m, "CPUExecutionProvider", record=False)
(r,) = rs
def call(seed):
    x = {"X": np.random.default_rng(seed).standard_normal((4, 16)).astype(np.float32)}
    for g, w in zip(s.run(None, x), cpu.run(None, x)):
        assert_close(g, w, what="mlx vs cpu")
for i in range(5):
    call(i)
(c,) = r.closures()
held = {"queued": background.state(c.behind), "files": files(), "traces": c.traces,
        "interim_traces": c.interim.traces if c.interim else None,
        "interim_trusted": bool(c.interim and c.interim.trusted),
        "interim_poisoned": bool(c.interim and c.interim.poisoned),
        "interim_calls": r.counters.get("interim_calls", 0), "compiled": r.counters["compiled_calls"]}
gate.set()
background.wait(120)
for i in range(5, 8):
    call(i)
print(json.dumps({"held": held, "files": files(), "traces": c.traces, "trusted": c.trusted,
                  "interim_calls": r.counters.get("interim_calls", 0), "compiled": r.counters["compiled_calls"]}))
"""


def _interim(tmp_path, tuning: str) -> dict:
    return probe_json(_INTERIM, tmp_path, os.path.dirname(os.path.abspath(__file__)), tuning)


def test_meanwhile_the_program_unfused_answers(tmp_path):
    """While a key's fused kernels wait to be built (the builder held here), its program traced without fusion
    answers from the key's third call (verified at it) and builds no kernel (an empty cache stays empty); once
    the build is done the fused closure takes over. Answers as ORT's CPU EP's throughout."""
    got = _interim(tmp_path, "interim=1")
    held = got["held"]
    assert held["queued"] == background.QUEUED and held["traces"] == 0, held
    assert held["interim_traces"] == 1 and held["interim_trusted"] and held["interim_calls"] == 2, held
    assert held["compiled"] == 2 and held["files"] == [], held
    assert got["traces"] == 1 and got["trusted"] and got["files"], got
    assert got["interim_calls"] == 2 and got["compiled"] >= 4, got


def test_without_the_interim_those_calls_are_eager(tmp_path):
    got = _interim(tmp_path, "interim=0")
    held = got["held"]
    assert held["interim_traces"] is None and held["interim_calls"] == 0 and held["compiled"] == 0, held
    assert got["traces"] == 1 and got["trusted"] and got["interim_calls"] == 0, got


def test_an_interim_that_fails_leaves_the_calls_eager(tmp_path):
    """Any doubt: an interim closure whose trace fails (an injected fault) is poisoned and its key's calls answer
    eagerly until the fused closure is built, which then takes over."""
    got = _interim(tmp_path, "interim=1,fault=trace#1")
    held = got["held"]
    assert held["interim_poisoned"] and not held["interim_trusted"], held
    assert held["interim_calls"] == 0 and held["compiled"] == 0 and held["traces"] == 0, held
    assert got["traces"] == 1 and got["trusted"] and got["compiled"] >= 2, got


def test_where_no_worker_takes_the_group_the_builder_thread_does():
    """``prebuild=1`` asks for a worker process, which takes only a group that is a model file's whole model: an
    InferenceSession made from bytes has none, so its new closures' kernels are built on the builder thread."""
    m = mlp()
    with C.capture() as rs:
        s = session(m, options={"tuning": "build_behind=1,prebuild=1", "device": "cpu"})
    cpu = session(m, "CPUExecutionProvider", record=False)
    (r,) = rs
    assert all(p.prebuild is None for p in r.parts())

    def call(seed):
        f = _feed(4, seed)
        for g, w in zip(s.run(None, f), cpu.run(None, f)):
            assert_close(g, w, what="mlx vs cpu")
    call(0)
    call(1)
    (c,) = r.closures()
    assert c.behind is not None and c.behind.startswith("closure") and c.traces == 0, r.counters
    assert background.wait(120) and background.done(c.behind)
    call(2)
    assert c.behind is None and c.traces == 1 and c.trusted
