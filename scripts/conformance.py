#!/usr/bin/env python
"""Run the ONNX backend node suite through ORT with the MLX EP, and through ORT's CPU EP.

The node cases are the ones the installed ``onnx`` package generates in memory
(``onnx.backend.test.loader.load_model_tests(kind="node")``): one model, one
data set and the suite's tolerances (rtol 1e-3, atol 1e-7) each. Outputs are
compared with the suite's own ``Runner.assert_similar_outputs``.

Every case runs in a worker process (``--workers``, default 2) on two sessions:
the CPU EP alone, then the MLX EP (fallback disabled, graph assignment recorded).
A case that kills or hangs its worker is recorded as crash/timeout, the worker is
restarted and the run goes on.

Per case: cpu_loads, cpu_pass, mlx_loads, claim (full / partial / none: nodes
assigned to MLX after ORT's own graph optimizations), mlx_pass, errors, and the
partitioner's reasons for every node left to the CPU EP. Status:

  full_pass / partial_pass   CPU passes; MLX claims all / some nodes and passes
  not_claimed                CPU passes; MLX claims nothing
  folded                     CPU passes; ORT's own optimizer leaves no node to claim (e.g. Constant)
  mismatch                   CPU passes; MLX claims >= 1 node and fails (wrong output or error)
  mlx_load_error             CPU loads and passes; the MLX session cannot be created
  unclaimed_fail             CPU passes; MLX claims nothing and still fails
  mlx_crash / mlx_timeout    the MLX session killed / hung its worker
  mlx_only_pass              CPU fails; MLX claims >= 1 node and passes (bonus)
  cpu_fail                   CPU loads but fails (ORT's own failure; not counted)
  ort_cannot_load            ORT cannot load the model at all (e.g. opset 27/28 with ORT 1.31)

FAILING statuses (``FAILING``) are what CI rejects unless the case is a known gap
listed with a reason in ``scripts/conformance_known.py``.

Models whose IR version is above what ORT loads (``MAX_IR``) get their
ir_version lowered to ``MAX_IR`` (recorded per case as ``ir_adjusted``).

    python scripts/conformance.py                      # all cases, totals
    python scripts/conformance.py --filter 'test_gemm' # regex on the case name
    python scripts/conformance.py --op 'Resize' --show all --reasons 10
    python scripts/conformance.py --md docs/conformance.md --json /tmp/conf.json
"""
from __future__ import annotations

import argparse
import datetime as _dt
import io
import os
import pickle
import queue
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter, defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EP_NAME = "MLXExecutionProvider"
CPU = "CPUExecutionProvider"
MAX_IR = 13          # onnxruntime 1.31 loads IR <= 13; onnx 1.23 writes IR 14 for its newest cases

STARTUP_TIMEOUT = 300.0   # seconds a worker may take to import onnxruntime, mlx and ortmlx
FAILING = ("mismatch", "mlx_load_error", "unclaimed_fail", "mlx_crash", "mlx_timeout")
PASSING = ("full_pass", "partial_pass", "not_claimed", "folded", "mlx_only_pass")
STATUSES = ("full_pass", "partial_pass", "not_claimed", "folded", "mismatch", "mlx_load_error", "unclaimed_fail",
            "mlx_crash", "mlx_timeout", "mlx_only_pass", "cpu_fail", "cpu_crash", "ort_cannot_load")


# ----------------------------------------------------------------------------- protocol

def _send(f, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(struct.pack("<Q", len(data)))
    f.write(data)
    f.flush()


def _recv(f):
    head = f.read(8)
    if len(head) < 8:
        raise EOFError
    (n,) = struct.unpack("<Q", head)
    data = f.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


# ----------------------------------------------------------------------------- cases

def _normalize(x):
    import onnx
    from onnx import numpy_helper
    if isinstance(x, onnx.TensorProto):
        return numpy_helper.to_array(x)
    if isinstance(x, (list, tuple)):
        return [_normalize(v) for v in x]
    return x


def load_cases(pattern: str | None = None, op_pattern: str | None = None) -> list[dict]:
    """The node cases of the installed onnx, as picklable payloads (name order of the loader)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.loader import load_model_tests
        cases = load_model_tests(kind="node")
    base_op: dict[str, str] = {}
    for c in cases:
        if "_expanded" not in c.name and len(c.model.graph.node) == 1:
            base_op[c.name] = c.model.graph.node[0].op_type
    rx = re.compile(pattern) if pattern else None
    orx = re.compile(op_pattern) if op_pattern else None
    out = []
    for c in cases:
        if rx is not None and not rx.search(c.name):
            continue
        m = c.model
        expanded = "_expanded" in c.name
        op = base_op.get(c.name.split("_expanded")[0]) if expanded else None
        if op is None:
            nodes = m.graph.node
            op = nodes[0].op_type if len(nodes) == 1 else (base_op.get(c.name) or "?")
        if orx is not None and not orx.fullmatch(op):
            continue
        dom = next((n.domain for n in m.graph.node if n.op_type == op), "") or ""
        opset = max((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), default=0)
        ir_adjusted = m.ir_version > MAX_IR
        if ir_adjusted:
            m = type(m)()
            m.CopyFrom(c.model)
            m.ir_version = MAX_IR
        inits = {t.name for t in m.graph.initializer}
        in_names = [i.name for i in m.graph.input if i.name not in inits]
        (inputs, outputs), = c.data_sets
        out.append(dict(name=c.name, op=op, domain=dom, expanded=expanded, opset=opset, ir_adjusted=ir_adjusted,
                        model=m.SerializeToString(), in_names=in_names,
                        inputs=[_normalize(x) for x in inputs], outputs=[_normalize(x) for x in outputs],
                        rtol=c.rtol, atol=c.atol))
    return out


# ----------------------------------------------------------------------------- worker

def _short(e: BaseException, n: int = 400) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ")
    s = re.sub(r"/onnxruntime_src/\S+ ", "", s)
    return s[:n]


_EXOTIC = {"bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
           "int4", "uint4", "int2", "uint2", "float4_e2m1fn"}


def _exotic(x) -> bool:
    """An ml_dtypes array: ORT's Python binding only takes these as OrtValues."""
    return hasattr(x, "dtype") and x.dtype.name in _EXOTIC


def _run_session(sess, case: dict) -> list:
    """Feed the case's inputs, return the outputs as numpy (ml_dtypes arrays for types numpy lacks)."""
    import ctypes

    import numpy as np
    import onnx
    import onnxruntime as ort
    inputs = [np.asarray(x) if isinstance(x, np.generic) else x for x in case["inputs"]]
    if not any(_exotic(x) for x in inputs + list(case["outputs"])):
        return sess.run(None, dict(zip(case["in_names"], inputs)))
    feeds = {}
    for name, x in zip(case["in_names"], inputs):
        if _exotic(x):
            raw = onnx.numpy_helper.from_array(x).raw_data           # packs 4/2-bit types as ONNX does
            v = ort.OrtValue.ortvalue_from_shape_and_type(list(x.shape), onnx.helper.np_dtype_to_tensor_dtype(x.dtype))
            if v.tensor_size_in_bytes() != len(raw):
                raise ValueError(f"input {name!r}: {len(raw)} bytes for a {v.tensor_size_in_bytes()}-byte OrtValue")
            if raw:
                ctypes.memmove(v.data_ptr(), raw, len(raw))
            feeds[name] = v
        else:
            feeds[name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(x))
    out = []
    for v in sess.run_with_ort_values(None, feeds):
        et = v.element_type()
        if onnx.helper.tensor_dtype_to_np_dtype(et).name in _EXOTIC:
            t = onnx.TensorProto(data_type=et, dims=v.shape())
            t.raw_data = ctypes.string_at(v.data_ptr(), v.tensor_size_in_bytes()) if v.tensor_size_in_bytes() else b""
            out.append(onnx.numpy_helper.to_array(t))
        else:
            out.append(v.numpy())
    return out


def _selftest(what: dict) -> None:
    """Hooks for tests/test_conformance.py, proving the runner catches what it must.

    Applied at the start of phase ``what.get("phase", "mlx")``: ``{"crash": True}`` kills the
    worker, ``{"hang": s}`` sleeps, ``{"break_op": "Abs"}`` makes that op's translators return a
    wrong answer (+1) in this worker from then on.
    """
    if what.get("crash"):
        os._exit(3)
    if what.get("hang"):
        time.sleep(what["hang"])
    if what.get("break_op"):
        import dataclasses
        import functools

        from ortmlx.kernels.registry import REGISTRY
        for key, lst in REGISTRY._ops.items():
            if key[1] == what["break_op"]:
                for k, d in enumerate(lst):
                    @functools.wraps(d.fn)                  # keeps the signature the claim checks read
                    def wrong(*a, _fn=d.fn, **kw):
                        return _fn(*a, **kw) + 1
                    lst[k] = dataclasses.replace(d, fn=wrong, host=None)


def _worker() -> None:
    """Worker loop: read a case, answer ('cpu', {...}) then ('mlx', {...}) then ('done', None)."""
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                       # anything else written to stdout goes to the log
    sys.stdout = sys.stderr
    proto_in = sys.stdin.buffer
    warnings.simplefilter("ignore")
    import onnxruntime as ort
    from onnx.backend.test.runner import Runner

    import ortmlx
    from ortmlx import testing
    ort.set_default_logger_severity(3)
    ortmlx.register(genai=False)
    _send(proto_out, ("ready", None))

    def sess_options():
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        return so

    def run_one(case, provider, options=None):
        r = {"loads": False, "pass": False, "error": ""}
        before = {id(x): x for x in ortmlx.partition_reports()}     # the EP keeps only its last 64 reports

        def new_reports():
            return [x for x in ortmlx.partition_reports() if before.get(id(x)) is not x]
        try:
            s = testing.session(case["model"], provider, sess_options=sess_options(), record=provider == EP_NAME,
                                options=options)
        except Exception as e:  # noqa: BLE001
            r["error"] = "load: " + _short(e)
            if provider == EP_NAME:            # what the partitioner had claimed before the load failed
                r["mlx_ops"] = dict(Counter(lbl.split(" '")[0] for rep in new_reports()
                                            for g in rep.groups for lbl in g))
            return r
        r["loads"] = True
        if provider == EP_NAME:
            a = testing.assignment(s)
            r["n_mlx"] = sum(a.get(EP_NAME, Counter()).values())
            r["mlx_ops"] = dict(a.get(EP_NAME, Counter()))
            r["n_other"] = sum(sum(c.values()) for ep, c in a.items() if ep != EP_NAME)
            r["other_ops"] = dict(sum((c for ep, c in a.items() if ep != EP_NAME), Counter()))
            reasons = []
            for rep in new_reports():
                reasons += [f"{u.op}: {u.reason}" for u in rep.unclaimed
                            if not u.op.startswith(EP_NAME)]    # ORT's second pass sees our fused nodes
            r["unclaimed"] = list(dict.fromkeys(reasons))
        try:
            got = _run_session(s, case)
        except Exception as e:  # noqa: BLE001
            r["error"] = "run: " + _short(e)
            return r
        try:
            Runner.assert_similar_outputs(case["outputs"], got, rtol=case["rtol"], atol=case["atol"])
        except Exception as e:  # noqa: BLE001
            r["error"] = "compare: " + _short(e, 600)
            return r
        r["pass"] = True
        return r

    def blame(case, res, limit=12):
        """Op types claimed by MLX that fail the case when they alone are claimed (disable_ops the rest)."""
        ops = sorted(res.get("mlx_ops", {}))
        if len(ops) == 1:
            return ops
        bad = []
        for op in ops[:limit]:
            r = run_one(case, EP_NAME, {"disable_ops": ",".join(o for o in ops if o != op)})
            if not r["pass"] and (r.get("n_mlx") or not r["loads"]):
                bad.append(op)
        return bad or ["(only in combination: " + ",".join(ops) + ")"]

    while True:
        try:
            case = _recv(proto_in)
        except EOFError:
            return
        cpu_pass = False
        for phase in case["phases"]:
            if case.get("_selftest") and case["_selftest"].get("phase", "mlx") == phase:
                _selftest(case["_selftest"])
            t0 = time.perf_counter()
            res = run_one(case, CPU if phase == "cpu" else EP_NAME)
            if phase == "cpu":
                cpu_pass = res["pass"]
            elif cpu_pass and not res["pass"] and res.get("mlx_ops"):
                res["blame"] = blame(case, res)
            res["seconds"] = time.perf_counter() - t0
            _send(proto_out, (phase, res))
        _send(proto_out, ("done", None))


# ----------------------------------------------------------------------------- parent

class _Worker:
    def __init__(self, wid: int, events: queue.Queue, logdir: str) -> None:
        self.wid = wid
        self.log_path = os.path.join(logdir, f"worker{wid}.log")
        self.log = open(self.log_path, "ab")
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     cwd=ROOT, env=env)
        self.events = events
        self.case = None
        self.deadline = None
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        proc = self.proc
        while True:
            try:
                msg = _recv(proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                self.events.put((self, proc, "eof", None))
                return
            self.events.put((self, proc, *msg))

    def submit(self, case: dict, timeout: float) -> bool:
        self.case = case
        self.deadline = time.monotonic() + timeout
        try:
            _send(self.proc.stdin, case)
            return True
        except (BrokenPipeError, OSError):
            return False

    def log_tail(self, n: int = 300) -> str:
        try:
            self.log.flush()
            with open(self.log_path, "rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - n))
                return f.read().decode("utf-8", "replace").replace("\n", " ").strip()
        except OSError:
            return ""

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        self.log.close()


def run_cases(cases: list[dict], workers: int = 2, timeout: float = 60.0, progress=None) -> list[dict]:
    """Run every case; returns one result dict per case, in the order given."""
    events: queue.Queue = queue.Queue()
    logdir = tempfile.mkdtemp(prefix="ortmlx-conformance-")
    pending = [(i, ["cpu", "mlx"]) for i in range(len(cases))][::-1]
    results: list[dict | None] = [None] * len(cases)
    partial: dict[int, dict] = {}
    pool = [_Worker(k, events, logdir) for k in range(max(1, min(workers, len(cases) or 1)))]
    idle: list[_Worker] = []                  # workers that said "ready" and have no case
    busy: dict[int, tuple[int, list[str]]] = {}
    done = 0

    def finish(i: int) -> None:
        nonlocal done
        c = cases[i]
        r = {k: c[k] for k in ("name", "op", "domain", "expanded", "opset", "ir_adjusted")}
        r.update(partial.pop(i, {}))
        r["status"] = classify(r)
        results[i] = r
        done += 1
        if progress:
            progress(done, len(cases), r)

    def replace(w: _Worker, how: str) -> None:
        """The worker died or hung on its case: record it, restart the worker."""
        i, phases = busy.pop(w.wid)
        got = partial.setdefault(i, {})
        phase = next((ph for ph in phases if ph not in got), phases[-1])
        why = f"{how} (worker log: {w.log_tail()})" if how == "crash" else f"timeout after {timeout:g}s"
        got[phase] = {"loads": None, "pass": False, "error": why, how: True}
        w.kill()
        nw = _Worker(w.wid, events, logdir)
        pool[pool.index(w)] = nw
        if phase == "cpu" and "mlx" in phases:
            pending.append((i, ["mlx"]))          # still find out what MLX does with it
        else:
            finish(i)

    try:
        while pending or busy:
            while idle and pending:
                w = idle.pop()
                i, phases = pending.pop()
                busy[w.wid] = (i, phases)
                if not w.submit({**cases[i], "phases": phases}, timeout):
                    replace(w, "crash")
            now = time.monotonic()
            wait = min((w.deadline for w in pool if w.wid in busy), default=now + 1) - now
            try:
                w, proc, kind, payload = events.get(timeout=max(0.01, wait))
            except queue.Empty:
                now = time.monotonic()
                for w in list(pool):
                    if w.wid in busy and w.deadline <= now:
                        replace(w, "timeout")
                    elif w.wid not in busy and w not in idle and now - w.started > STARTUP_TIMEOUT:
                        raise RuntimeError(f"conformance worker not ready after {STARTUP_TIMEOUT}s: {w.log_tail()}")
                continue
            if pool[w.wid] is not w or proc is not w.proc:
                continue                                   # stale event from a replaced worker
            if w.wid not in busy:
                if kind == "ready":
                    idle.append(w)
                    continue
                raise RuntimeError(f"conformance worker died before taking a case ({kind}): {w.log_tail()}")
            i, phases = busy[w.wid]
            if kind == "eof":
                replace(w, "crash")
            elif kind == "done":
                del busy[w.wid]
                idle.append(w)
                finish(i)
            else:
                partial.setdefault(i, {})[kind] = payload
                w.deadline = time.monotonic() + timeout
    finally:
        for w in pool:
            try:
                w.proc.stdin.close()
            except OSError:
                pass
        for w in pool:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.proc.kill()
            w.log.close()
        shutil.rmtree(logdir, ignore_errors=True)       # crash records already carry the log tail
    return results  # type: ignore[return-value]


def classify(r: dict) -> str:
    cpu, mlx = r.get("cpu") or {}, r.get("mlx") or {}
    if mlx.get("crash"):
        return "mlx_crash"
    if mlx.get("timeout"):
        return "mlx_timeout"
    if cpu.get("crash") or cpu.get("timeout"):
        if mlx.get("pass") and mlx.get("n_mlx"):
            return "mlx_only_pass"
        return "cpu_crash"
    if not cpu.get("loads") and not mlx.get("loads"):
        return "ort_cannot_load"
    claimed = mlx.get("n_mlx", 0)
    r["claim"] = ("full" if claimed and not mlx.get("n_other") else "partial" if claimed else "none") \
        if mlx.get("loads") else None
    if not cpu.get("pass"):
        return "mlx_only_pass" if mlx.get("pass") and claimed else "cpu_fail"
    if not mlx.get("loads"):
        return "mlx_load_error"
    if not claimed:
        if mlx.get("pass") and not mlx.get("n_other"):
            return "folded"                  # ORT's optimizer left no node to claim (Constant, static Shape)
        return "not_claimed" if mlx.get("pass") else "unclaimed_fail"
    if not mlx.get("pass"):
        return "mismatch"
    return "full_pass" if r["claim"] == "full" else "partial_pass"


# ----------------------------------------------------------------------------- reporting

def _known_ns() -> dict:
    path = os.path.join(HERE, "conformance_known.py")
    ns: dict = {}
    if os.path.exists(path):
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), ns)  # noqa: S102 - our own data file
    return ns


def known_gaps() -> dict[str, str]:
    """case name -> reason, from scripts/conformance_known.py (temporary xfails)."""
    return dict(_known_ns().get("KNOWN_GAPS", {}))


def known_gaps_onnx() -> str | None:
    """The onnx version the known-gap case names were recorded with."""
    return _known_ns().get("ONNX_VERSION")


def totals(results: list[dict]) -> dict:
    st = Counter(r["status"] for r in results)
    loadable = sum(1 for r in results if (r.get("cpu") or {}).get("loads"))          # by the CPU EP
    cpu_pass = sum(1 for r in results if (r.get("cpu") or {}).get("pass"))
    full = st["full_pass"]
    return {
        "cases": len(results),
        "loadable": loadable,
        "cpu_pass": cpu_pass,
        "full_pass": full,
        "partial_pass": st["partial_pass"],
        "not_claimed": st["not_claimed"],
        "folded": st["folded"],
        "failing": sum(st[s] for s in FAILING),
        "mismatch": st["mismatch"],
        "mlx_only_pass": st["mlx_only_pass"],
        # CPU passes not fully claimed because a tensor's type does not exist in MLX (float8, int4, string ...)
        "dtype_blocked": sum(1 for r in results if r["status"] in ("partial_pass", "not_claimed") and any(
            "not supported by MLX on" in u for u in (r.get("mlx") or {}).get("unclaimed", []))),
        "full_pass_pct": 100.0 * full / cpu_pass if cpu_pass else 0.0,
        "statuses": dict(st),
    }


def unclaimed_reasons(results: list[dict]) -> Counter:
    """Normalized partitioner reasons -> number of CPU-passing cases they keep from a full claim."""
    c: Counter = Counter()
    for r in results:
        if r["status"] in ("partial_pass", "not_claimed"):
            seen = set()
            for u in (r.get("mlx") or {}).get("unclaimed", []):
                k = re.sub(r"'[^']*'", "'…'", u)
                k = re.sub(r" \(since_version \d+\)", "", k)
                if k not in seen:
                    seen.add(k)
                    c[k] += 1
    return c


def versions() -> dict[str, str]:
    import importlib.metadata as md
    out = {}
    # ml_dtypes: the onnx loader regenerates expected outputs with it (0.7 casts out-of-range floats
    # to int4/int2 as 0 where ORT wraps), so the totals depend on its version
    for p in ("onnx", "onnxruntime", "mlx", "ml_dtypes"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = "?"
    return out


def translator_op_count() -> int:
    import ortmlx.kernels  # noqa: F401 - registers every translator
    from ortmlx.kernels.registry import REGISTRY
    return len(REGISTRY.op_types(""))


def untranslated_ops() -> tuple[list[str], int]:
    """ai.onnx op types the installed onnx defines (not deprecated) without a translator, and how many it defines."""
    import onnx.defs

    import ortmlx.kernels  # noqa: F401
    from ortmlx.kernels.registry import REGISTRY
    defined = {s.name for s in onnx.defs.get_all_schemas_with_history()
               if s.domain in ("", "ai.onnx") and not s.deprecated}
    return sorted(defined - REGISTRY.op_types("")), len(defined)


def readme_block(t: dict, when: str, vers: dict) -> str:
    return (f"Conformance ({when}; onnx {vers['onnx']}, onnxruntime {vers['onnxruntime']}, mlx {vers['mlx']}; "
            f"`python scripts/conformance.py`): of {t['cases']} ONNX backend node cases, "
            f"{t['loadable']} load in ORT's CPU EP and {t['cpu_pass']} pass there; of those, "
            f"{t['full_pass']} ({t['full_pass_pct']:.1f}%) are fully claimed by MLX and pass, "
            f"{t['partial_pass']} are partially claimed and pass, {t['not_claimed']} are not claimed, "
            f"{t['folded']} have no node left after ORT's optimizer; "
            f"{t['mismatch']} mismatches ({t['failing']} failing in all); "
            f"{t['mlx_only_pass']} cases the CPU EP fails pass on MLX.")


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def write_markdown(path: str, results: list[dict], t: dict, when: str, vers: dict, wall: float,
                   pattern: str | None) -> None:
    known = known_gaps()
    w = io.StringIO()
    p = lambda *a: print(*a, file=w)  # noqa: E731
    p("# Conformance: ONNX backend node suite")
    p()
    p("Generated by `python scripts/conformance.py --md docs/conformance.md`; do not edit by hand.")
    p()
    p(f"- Date: {when}")
    p(f"- Versions: onnx {vers['onnx']}, onnxruntime {vers['onnxruntime']}, mlx {vers['mlx']}, "
      f"ml_dtypes {vers['ml_dtypes']}, "
      f"python {sys.version.split()[0]}")
    if pattern:
        p(f"- Filter: {pattern} (partial run)")
    p(f"- Wall time: {wall:.0f} s (2 workers); ai.onnx op types with a translator: {translator_op_count()}")
    p("- Tolerances: the suite's own (`Runner.assert_similar_outputs`, rtol 1e-3, atol 1e-7). "
      f"Models with IR > {MAX_IR} are lowered to IR {MAX_IR} so ORT reads them.")
    p("- Claim = nodes ORT assigns to the MLX EP after its own graph optimizations "
      "(`session.record_ep_graph_assignment_info`); the MLX session runs with fallback disabled.")
    p()
    p("Run it: `python scripts/conformance.py [--filter REGEX] [--show STATUS,...] [--json out.json]`; "
      "statuses and the CI gate are described in the script's docstring. CI: `tests/test_conformance.py` "
      "fails on any failing case not listed with a reason in `scripts/conformance_known.py`.")
    p()
    p("## Totals")
    p()
    p("| | cases |")
    p("|---|---:|")
    rows = [("Node cases generated by onnx", t["cases"]), ("Loadable by ORT (CPU EP session)", t["loadable"]),
            ("Pass on ORT's CPU EP", t["cpu_pass"]),
            (f"... fully claimed by MLX and pass ({t['full_pass_pct']:.1f}%)", t["full_pass"]),
            ("... partially claimed by MLX and pass", t["partial_pass"]),
            ("... not claimed by MLX (run on CPU, pass)", t["not_claimed"]),
            ("... no node left after ORT's own graph optimizations (nothing to claim, pass)", t["folded"]),
            ("... mismatches (MLX claims, CPU passes, MLX fails)", t["mismatch"]),
            ("... other failures (MLX load error / crash / timeout / unclaimed failure)",
             t["failing"] - t["mismatch"]),
            ("CPU EP fails, MLX claims and passes (bonus)", t["mlx_only_pass"]),
            ("CPU passes not fully claimed because a tensor type does not exist in MLX (float8, int4, string...)",
             t["dtype_blocked"])]
    for k, v in rows:
        p(f"| {k} | {v} |")
    p()
    p("Status counts: " + ", ".join(f"{k} {v}" for k, v in sorted(t["statuses"].items())))
    p()
    bad = [r for r in results if r["status"] in FAILING]
    p("## Failing cases")
    p()
    if not bad:
        p("None.")
    else:
        p("| case | op | status | failing MLX op(s) | known gap | error |")
        p("|---|---|---|---|---|---|")
        for r in bad:
            m = r.get("mlx") or {}
            p(f"| {r['name']} | {r['op']} | {r['status']} | {', '.join(m.get('blame', []))} | "
              f"{_md_escape(known.get(r['name'], '')[:100])} | {_md_escape(m.get('error', '')[:200])} |")
    p()
    p("## Bonus: the CPU EP fails, MLX passes")
    p()
    bonus = [r for r in results if r["status"] == "mlx_only_pass"]
    if not bonus:
        p("None.")
    for r in bonus:
        p(f"- {r['name']} ({r['op']}, claim {r.get('claim')}): CPU: {_md_escape((r.get('cpu') or {}).get('error', '')[:160])}")
    p()
    p("## Why CPU-passing cases are not fully claimed")
    p()
    p("Partitioner reasons (names elided), by the number of cases each appears in; a case can have several.")
    p()
    p("| cases | reason |")
    p("|---:|---|")
    for k, v in unclaimed_reasons(results).most_common(40):
        p(f"| {v} | {_md_escape(k[:160])} |")
    p()
    missing, n_defined = untranslated_ops()
    p(f"## ai.onnx op types without a translator ({len(missing)} of {n_defined} defined by onnx {vers['onnx']})")
    p()
    p(", ".join(missing) if missing else "None.")
    p()
    p("## Per op")
    p()
    p("Cases grouped by the op under test (expanded function cases count under their op). "
      "`left on CPU` is the most common reason the partitioner gave for CPU-passing cases not fully claimed.")
    p()
    p("| op | cases | CPU loads | CPU pass | full & pass | partial & pass | not claimed (incl. folded) | failing | bonus | left on CPU |")
    p("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    by_op: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        key = r["op"] if not r["domain"] or r["domain"] == "ai.onnx" else f"{r['domain']}.{r['op']}"
        by_op[key].append(r)
    for op in sorted(by_op, key=str.lower):
        rs = by_op[op]
        st = Counter(r["status"] for r in rs)
        why = Counter()
        for r in rs:
            if r["status"] in ("partial_pass", "not_claimed"):
                for u in (r.get("mlx") or {}).get("unclaimed", [])[:1]:
                    why[u] += 1
        top = _md_escape(why.most_common(1)[0][0][:140]) if why else ""
        p(f"| {op} | {len(rs)} | {sum(1 for r in rs if (r.get('cpu') or {}).get('loads'))} | "
          f"{sum(1 for r in rs if (r.get('cpu') or {}).get('pass'))} | {st['full_pass']} | {st['partial_pass']} | "
          f"{st['not_claimed'] + st['folded']} | {sum(st[s] for s in FAILING)} | {st['mlx_only_pass']} | {top} |")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(w.getvalue())


def run_suite(pattern: str | None = None, workers: int = 2, timeout: float = 60.0, progress=None,
              op_pattern: str | None = None):
    """Load, run and classify; returns (results, totals, wall seconds)."""
    t0 = time.perf_counter()
    cases = load_cases(pattern, op_pattern)
    results = run_cases(cases, workers=workers, timeout=timeout, progress=progress)
    return results, totals(results), time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--filter", help="regex on the case name (re.search)")
    ap.add_argument("--op", help="regex matched against the whole op type under test (e.g. 'Gemm|MatMul')")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case and session")
    ap.add_argument("--json", help="write every per-case record here")
    ap.add_argument("--md", help="write the markdown table (docs/conformance.md) here")
    ap.add_argument("--show", default="failing",
                    help="comma list of statuses to list case by case (default: failing; 'all', 'none')")
    ap.add_argument("--reasons", type=int, default=0, metavar="N",
                    help="print the N most common reasons CPU-passing cases are not fully claimed")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker()
        return 0

    def progress(k, n, r):
        if not a.quiet and sys.stderr.isatty():
            print(f"\r{k}/{n} {r['name'][:60]:60s}", end="", file=sys.stderr, flush=True)

    results, t, wall = run_suite(a.filter, a.workers, a.timeout, progress, a.op)
    if not a.quiet and sys.stderr.isatty():
        print(file=sys.stderr)
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    vers = versions()
    known = known_gaps()

    show = set(FAILING) if a.show == "failing" else set(STATUSES) if a.show == "all" else \
        set() if a.show == "none" else set(a.show.split(","))
    for r in results:
        if r["status"] in show:
            m, c = r.get("mlx") or {}, r.get("cpu") or {}
            tag = " [known gap: " + known[r["name"]] + "]" if r["name"] in known else ""
            print(f"{r['status']:15s} {r['name']} ({r['op']}, claim {r.get('claim')}){tag}")
            if m.get("blame"):
                print(f"    failing MLX op(s): {', '.join(m['blame'])}")
            if m.get("error"):
                print(f"    mlx: {m['error'][:300]}")
            if c.get("error") and r["status"] in ("cpu_fail", "mlx_only_pass", "cpu_crash"):
                print(f"    cpu: {c['error'][:300]}")
            if m.get("unclaimed") and r["status"] not in FAILING:
                print(f"    left on CPU: {'; '.join(m['unclaimed'])[:300]}")

    print(f"\nONNX backend node suite, onnx {vers['onnx']}, onnxruntime {vers['onnxruntime']}, "
          f"mlx {vers['mlx']}{' filter ' + repr(a.filter) if a.filter else ''}{' op ' + repr(a.op) if a.op else ''}: "
          f"{wall:.0f} s")
    print(f"  cases {t['cases']}, loadable by ORT's CPU EP {t['loadable']}, CPU EP passes {t['cpu_pass']}")
    print(f"  of the CPU passes: fully claimed & pass {t['full_pass']} ({t['full_pass_pct']:.1f}%), "
          f"partially claimed & pass {t['partial_pass']}, not claimed {t['not_claimed']}, "
          f"folded away by ORT {t['folded']}, "
          f"mismatches {t['mismatch']}, other failures {t['failing'] - t['mismatch']}")
    print(f"  MLX-only passes (CPU EP fails): {t['mlx_only_pass']}; CPU passes not fully claimed because a "
          f"tensor type does not exist in MLX: {t['dtype_blocked']}")
    print("  statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(t["statuses"].items())))
    unexpected = [r["name"] for r in results if r["status"] in FAILING and r["name"] not in known]
    xpass = [n for n in known if any(r["name"] == n and r["status"] not in FAILING for r in results)]
    print(f"  unexpected failures: {len(unexpected)}; known gaps still failing: "
          f"{sum(1 for r in results if r['status'] in FAILING and r['name'] in known)}; "
          f"known gaps now passing (remove them): {xpass or 0}")
    if a.reasons:
        print("\nwhy CPU-passing cases are not fully claimed (cases: reason):")
        for k, v in unclaimed_reasons(results).most_common(a.reasons):
            print(f"  {v:4d}: {k[:200]}")
    print("\nREADME block:\n" + readme_block(t, when, vers))

    if a.json:
        import json
        with open(a.json, "w") as f:
            json.dump({"date": when, "versions": vers, "totals": t, "wall_s": wall, "filter": a.filter, "op": a.op,
                       "results": results}, f, indent=1, default=str)
    if a.md:
        write_markdown(a.md, results, t, when, vers, wall,
                       " ".join(f"{k} {v!r}" for k, v in (("name", a.filter), ("op", a.op)) if v) or None)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
