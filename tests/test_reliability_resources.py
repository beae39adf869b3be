"""Issue 5, resource hygiene: release frees constants and closures; a short soak stays flat; exit is clean."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import weakref

import mlx.core as mx
import numpy as np
from onnx import TensorProto as T
from onnx import helper as h

from ortmlx.ep import callbacks
from ortmlx.ep.compute import ComputeInfo
from ortmlx.testing import make_model, session

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIG = 1 << 22                                   # 4M float32 = 16 MiB constant


def big_const_model():
    nodes = [h.make_node("Add", ["X", "W"], ["a"]), h.make_node("Mul", ["a", "W"], ["Y"])]
    return make_model(nodes, [("X", T.FLOAT, [BIG])], [("Y", T.FLOAT, [BIG])],
                      initializers={"W": np.full(BIG, 0.5, np.float32)})


def live_infos():
    return [o for o in callbacks.objects().values() if isinstance(o, ComputeInfo)]


def test_session_release_frees_constants_programs_and_compute_infos():
    gc.collect()
    before_infos = {id(o) for o in live_infos()}
    base = mx.get_active_memory()
    s = session(big_const_model())
    x = np.ones(BIG, np.float32)
    np.testing.assert_array_equal(s.run(None, {"X": x})[0][:3], [0.75, 0.75, 0.75])
    held = mx.get_active_memory() - base
    assert held >= BIG * 4, f"the constant should live in MLX while the session does ({held} bytes)"
    mine = [o for o in live_infos() if id(o) not in before_infos]
    assert mine
    refs = [weakref.ref(o) for o in mine] + [weakref.ref(o.group) for o in mine]
    refs += [weakref.ref(o.group.program) for o in mine] + [weakref.ref(o.group.runner) for o in mine]
    del s, mine
    gc.collect()
    assert all(r() is None for r in refs), "compute infos / programs survive session release"
    assert mx.get_active_memory() - base < (1 << 20), "MLX memory not returned after release"


def test_repeated_sessions_do_not_accumulate():
    x = np.ones(BIG, np.float32)
    s = session(big_const_model())
    s.run(None, {"X": x})
    del s
    gc.collect()
    base_mx = mx.get_active_memory()
    n_infos = len(live_infos())
    for _ in range(8):
        s = session(big_const_model())
        s.run(None, {"X": x})
        del s
    gc.collect()
    assert mx.get_active_memory() - base_mx < (1 << 20)
    assert len(live_infos()) == n_infos


def test_short_soak_rss_flat_and_answers_right():
    """The CI version of scripts/soak.py (the full 10,000-run soak is documented in docs/reliability.md)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "soak.py"), "--runs", "1500", "--quick",
                          "--sessions", "30"], capture_output=True, text=True, timeout=600)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert line, out.stdout + out.stderr[-2000:]
    res = json.loads(line[-1])
    assert res["wrong"] == 0
    assert res["rss_growth_pct"] < 5 and res["rss_growth_after_churn_pct"] < 5, res
    assert res["mlx_active_end"] <= res["mlx_active_base"] + (1 << 20), res
    assert out.returncode == 0 and res["ok"], res


EXIT_ANY = textwrap.dedent("""
    import sys, numpy as np, ortmlx
    from onnx import TensorProto as T, helper as h
    from ortmlx.testing import make_model, session
    m = make_model([h.make_node("Add", ["X", "X"], ["a"]), h.make_node("Relu", ["a"], ["Y"])],
                   [("X", T.FLOAT, ["n"])], [("Y", T.FLOAT, ["n"])])
    kept = [session(m, options={"verbose": "1", "trace": sys.argv[1]})]
    bad = session(m, options={"tuning": "fault=eval"})
    try:
        bad.run(None, {"X": np.ones(3, np.float32)})
    except Exception:
        pass
    for n in range(1, 20):
        kept[0].run(None, {"X": np.ones(n, np.float32)})
    print("ok")
""")


def test_interpreter_exit_is_clean_with_live_traced_and_faulted_sessions(tmp_path):
    path = tmp_path / "t.json"
    out = subprocess.run([sys.executable, "-c", EXIT_ANY, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
    ev = json.loads(path.read_text())["traceEvents"]
    assert sum(1 for e in ev if e["name"].startswith("compute ")) == 19     # written even though never released
