"""General (non-LLM) models and single ops: ORT CPU EP / ORT CUDA EP / MLX EP side by side.

    python scripts/bench_general.py --device cpu                         # the model set, preset "small"
    python scripts/bench_general.py --device cpu --ops                   # the per-op-family micro benchmark
    python scripts/bench_general.py --device gpu --cuda-fp32 --json out.json       # the GPU host (preset "full")
    python scripts/bench_general.py --models floor --breakdown all --profile 25    # the per-call floor, dissected

Models come from models/build_general.py (built on first use, cached under models/out/general/<preset>/; random
weights, batch dim dynamic; ``--models`` takes names, name prefixes, ``models``, ``floor``, ``ops``, ``all``).
Per model and batch size (``--batches``, 1,8 by default), every engine (``cpu``: ORT's CPU EP; ``cuda``: ORT's
CUDA EP with its default options, with ``--device gpu`` where onnxruntime has it; ``cuda_fp32``: the CUDA EP with
``use_tf32=0``, with ``--cuda-fp32``; ``mlx``: the MLX EP, compiled default; ``mlx_eager`` with ``--eager``;
``mlx_alt`` with ``--alt-option``: an A/B in one run) gets:

- ``first_ms``: the first call's time at that batch size (MLX: eager answer, trace, verification; CUDA: cuDNN's
  algorithm search); ``create_s``: session creation, once per model;
- ``median_ms`` (and p10/p90/min): warm latency of single calls, timed one by one over ``--rounds`` rounds whose
  engine order rotates; each engine gets an equal share of ``--time-budget`` seconds a case (a faster engine makes
  more calls), after ``--warmup`` calls;
- max |diff| vs the CPU EP per output (after the first call and after the warm-up), ``ok``: every output within
  the model's rtol/atol (``np.allclose``; fp32 rtol 1e-4, atol 1e-5 for every model of the set: a model needing
  others would carry them, and why, in its metadata), and ``tol_use``: max |diff| / (atol + rtol |cpu|) (<= 1 passes);
- the MLX EP's nodes claimed / total (``ortmlx.partition_reports()``) and the op types left to the CPU EP; for the
  CUDA EP, the nodes ORT put on its CPU EP;
- ratios MLX/CUDA, MLX/CUDA fp32, MLX/CPU (of medians); with a CUDA column, the issue's aim per model (MLX/CUDA <=
  1.0 at batch 1, <= 0.8 at batch 8, answers within tolerance) is printed after the table.

``--breakdown floor|all|none``: at batch 1, a plain MLX session and one with ``trace`` on (the EP's observed path:
``ortmlx/stats.py``, ``ortmlx/trace.py``; ``--trace-dir`` keeps the Perfetto traces), interleaved; per call, the
traced session's stages (copy_in: ORT's inputs gathered and the runner's key and closure lookup; build: upload and
the closure call; eval: ``mx.eval``, the wait included; copy_out: ORT's outputs allocated, the host read and
copy), medians and means, and what is outside Compute (ORT's session.run, the plugin call, the Python binding).
Once per run, MLX alone on the device: a [1, 4] upload, add, eval and host read, each timed, the same as a
compiled closure, an eval with nothing to do, ``mx.synchronize``. ``--profile N``: a cProfile of warm MLX calls of
the floor models, top N functions by own time (MLX's nanobind calls count as their caller's own time).

Every case runs in its own try: a failure is one line (and a JSON record), the rest go on; the exit status is 1
when any failed. ``--json`` is rewritten after every case; ``--max-seconds`` starts no case past that wall time
(the skipped ones are listed). ``BENCH_GENERAL_SIMULATE_GPU=1`` (developers) serves the CUDA columns with ORT's
CPU EP, to run the GPU host's code paths on a CPU-only onnxruntime.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "models"))

import ortmlx  # noqa: E402  (first: binds MLX's CPU BLAS before mlx.core loads)
from ortmlx.ep.options import from_pairs  # noqa: E402
from ortmlx.kernels import background  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

import build_general as B  # noqa: E402

MLX = ortmlx.EP_NAME
CUDA = "CUDAExecutionProvider"
#: engine -> column title
TITLES = {"cpu": "CPU EP", "cuda": "CUDA EP", "cuda_fp32": "CUDA EP fp32", "mlx": "MLX EP", "mlx_eager": "MLX eager",
          "mlx_alt": "MLX alt"}


# --------------------------------------------------------------------------- sessions
def make_session(engine: str, model_path: str, args, trace: str = "") -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    if engine == "cpu":
        providers = ["CPUExecutionProvider"]
    elif engine in ("cuda", "cuda_fp32"):
        opts = from_pairs(args.cuda_option, "--cuda-option", "use_tf32=0")
        if engine == "cuda_fp32":
            opts["use_tf32"] = "0"
        providers = [(CUDA, opts), "CPUExecutionProvider"]
        if args.simulate_gpu:               # (a dry run of the GPU host's code paths on a CPU-only onnxruntime)
            providers = ["CPUExecutionProvider"]
    else:
        ortmlx.register(genai=False)
        opts = {"device": args.device, **from_pairs(args.mlx_option, "--mlx-option")}
        if engine == "mlx_eager":
            opts["no_compile"] = "1"
        elif engine == "mlx_alt":
            opts.update(from_pairs(args.alt_option, "--alt-option"))
        elif engine == "mlx_observed":
            opts["trace"] = trace
        providers = [(MLX, opts)]
    s = ort.InferenceSession(model_path, so, providers=providers, enable_fallback=0)
    want = providers[0] if isinstance(providers[0], str) else providers[0][0]
    if want not in s.get_providers():
        raise RuntimeError(f"{want} is not among the session's providers {s.get_providers()}")
    return s


def assignment(sess) -> Counter:
    """EP name -> nodes assigned (ORT's record of the partition)."""
    c: Counter = Counter()
    try:
        for sub in sess.get_provider_graph_assignment_info():
            c[sub.ep_name] += len(sub.get_nodes())
    except Exception:  # noqa: BLE001 - an ORT without the record: no counts
        pass
    return c


def left_ops(sess, ep: str) -> dict:
    c: Counter = Counter()
    try:
        for sub in sess.get_provider_graph_assignment_info():
            if sub.ep_name != ep:
                c.update(n.op_type for n in sub.get_nodes())
    except Exception:  # noqa: BLE001
        pass
    return dict(c)


def live_eps() -> list:
    """The MLX EP objects alive in this process (their ``stats`` hold the observed stage timings)."""
    from ortmlx.ep.callbacks import _FACTORIES
    return [ep for f in list(_FACTORIES) for ep in list(f.eps.values())]


def release(sessions: dict) -> None:
    for k in list(sessions):
        del sessions[k]
    gc.collect()


# --------------------------------------------------------------------------- comparing
def compare(got: list, want: list, names: list[str], rtol: float, atol: float) -> dict:
    """Per output: max |diff| and tol_use; ok when every output is np.allclose within rtol/atol."""
    per, ok, use = {}, True, 0.0
    for n, g, w in zip(names, got, want):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            per[n] = f"shape/dtype {g.shape} {g.dtype} != {w.shape} {w.dtype}"
            ok = False
            continue
        if not g.size:
            per[n] = 0.0
            continue
        d = np.abs(g.astype(np.float64) - w.astype(np.float64))
        if not np.isfinite(d).all():
            bad = ~np.isfinite(d) & ~(np.isnan(g) & np.isnan(w))
            d = np.where(np.isfinite(d), d, np.where(bad, np.inf, 0.0))
        per[n] = float(d.max())
        u = float((d / (atol + rtol * np.abs(w.astype(np.float64)))).max())
        use = max(use, u)
        ok &= bool(np.allclose(g, w, rtol=rtol, atol=atol, equal_nan=True))
    return {"max_abs": per, "ok": ok, "tol_use": use}


def merge_cmp(a: dict, b: dict) -> dict:
    return {"max_abs": {k: max(v, b["max_abs"].get(k, 0.0)) if isinstance(v, float) and
                        isinstance(b["max_abs"].get(k, 0.0), float) else v for k, v in a["max_abs"].items()},
            "ok": a["ok"] and b["ok"], "tol_use": max(a["tol_use"], b["tol_use"])}


# --------------------------------------------------------------------------- timing
def timed_calls(sess, feeds, n: int, out: list) -> None:
    run = sess.run
    pc = time.perf_counter_ns
    for _ in range(n):
        t0 = pc()
        run(None, feeds)
        out.append((pc() - t0) / 1e6)


def plan_rounds(est: dict[str, float], rounds: int, budget_s: float,
                max_calls: int = 5000) -> tuple[int, dict[str, int]]:
    """(rounds, calls per round for each engine): each engine gets about an equal share of ``budget_s`` (a fast
    engine makes more calls; at least one each); fewer rounds when even one call each overruns the budget."""
    share_ms = budget_s * 1e3 / max(1, len(est))
    n = {e: max(1, min(max_calls, int(share_ms / rounds / max(v, 1e-3)))) for e, v in est.items()}
    one_round_ms = sum(est[e] * n[e] for e in est)
    if one_round_ms * rounds > 1.5 * budget_s * 1e3:
        rounds = max(1, min(rounds, int(budget_s * 1e3 / max(one_round_ms, 1e-3))))
    return rounds, n


def stats_of(samples: list[float]) -> dict:
    s = sorted(samples)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    return {"median_ms": statistics.median(s), "p10_ms": q(0.1), "p90_ms": q(0.9), "min_ms": s[0], "calls": len(s)}


# --------------------------------------------------------------------------- one model
def engines_for(args) -> list[str]:
    e = ["cpu"]
    if (args.device == "gpu" or args.simulate_gpu) and not args.no_cuda:
        if CUDA in ort.get_available_providers() or args.simulate_gpu:
            e.append("cuda")
            if args.cuda_fp32:
                e.append("cuda_fp32")
        else:
            print(f"  (no {CUDA} in this onnxruntime: {ort.get_available_providers()}; CUDA column absent)")
    e.append("mlx")
    if args.eager:
        e.append("mlx_eager")
    if args.alt_option:
        e.append("mlx_alt")
    return e


def bench_model(name: str, args, report: dict) -> None:
    path = B.build(name, args.preset)
    md = B.meta(path)
    rtol, atol = md["rtol"], md["atol"]
    sessions, created, info = {}, {}, {}
    from ortmlx.ep.provider import REPORTS
    for e in engines_for(args):
        before = {id(r) for r in REPORTS}
        t0 = time.perf_counter()
        try:
            sessions[e] = make_session(e, path, args)
        except Exception as ex:  # noqa: BLE001 - one engine failing leaves the others
            fail(report, name, None, e, "session", ex)
            continue
        created[e] = time.perf_counter() - t0
        if e.startswith("mlx"):
            reps = [r for r in REPORTS if id(r) not in before]
            info[e] = {"claimed": sum(r.n_claimed for r in reps), "nodes": sum(r.n_nodes for r in reps),
                       "groups": sum(len(r.groups) for r in reps), "left": left_ops(sessions[e], MLX)}
        elif e.startswith("cuda"):
            a = assignment(sessions[e])
            info[e] = {"on_cuda": a.get(CUDA, 0), "nodes": sum(a.values()), "left": left_ops(sessions[e], CUDA)}
    if "cpu" not in sessions:
        release(sessions)
        return
    names = [o.name for o in sessions["cpu"].get_outputs()]
    for batch in args.batches:
        if past_deadline(args):
            skip(report, name, batch)
            continue
        case = {"model": name, "batch": batch, "family": md.get("family", "model"), "preset": args.preset,
                "params": md.get("params"), "rtol": rtol, "atol": atol, "tol_why": md.get("tol_why", ""),
                "create_s": {e: round(v, 3) for e, v in created.items()}, "partition": info, "engines": {},
                "diff": {}}
        try:
            feeds = B.feeds(path, batch, seed=batch)
            ref = None
            first, est = {}, {}
            live = dict(sessions)
            for e, s in list(live.items()):
                try:
                    t0 = time.perf_counter()
                    out = s.run(None, feeds)
                    first[e] = (time.perf_counter() - t0) * 1e3
                    if e == "cpu":
                        ref = out
                    else:
                        case["diff"][e] = compare(out, ref, names, rtol, atol)
                    w = []
                    for _ in range(args.warmup):
                        t0 = time.perf_counter()
                        out = s.run(None, feeds)
                        w.append((time.perf_counter() - t0) * 1e3)
                    if e != "cpu" and background.wait(600):
                        for _ in range(2):      # kernels built behind the calls (CPU): the closures verify, then replay
                            s.run(None, feeds)
                    est[e] = min(w) if w else first[e]
                    if e != "cpu" and args.warmup:
                        case["diff"][e] = merge_cmp(case["diff"][e], compare(out, ref, names, rtol, atol))
                except Exception as ex:  # noqa: BLE001
                    fail(report, name, batch, e, "first calls", ex)
                    live.pop(e)
            rounds, n = plan_rounds(est, args.rounds, args.time_budget)
            samples: dict[str, list] = {e: [] for e in live}
            order = list(live)
            for r in range(rounds):
                k = r % len(order)
                for e in order[k:] + order[:k]:
                    try:
                        if e in live:
                            timed_calls(live[e], feeds, n[e], samples[e])
                    except Exception as ex:  # noqa: BLE001
                        fail(report, name, batch, e, "timed calls", ex)
                        live.pop(e)
            for e in live:
                case["engines"][e] = {**stats_of(samples[e]), "first_ms": first[e], "rounds": rounds,
                                      "calls_per_round": n[e]}
            med = {e: v["median_ms"] for e, v in case["engines"].items()}
            case["ratios"] = {}
            for e in ("mlx", "mlx_eager", "mlx_alt"):
                if e in med:
                    for base in ("cuda", "cuda_fp32", "cpu"):
                        if base in med:
                            case["ratios"][f"{e}/{base}"] = med[e] / med[base]
            if "mlx_alt" in med and "mlx" in med:
                case["ratios"]["mlx_alt/mlx"] = med["mlx_alt"] / med["mlx"]
        except Exception as ex:  # noqa: BLE001
            fail(report, name, batch, "-", "case", ex)
            continue
        report["cases"].append(case)
        print_case(case)
        save(report, args)
    release(sessions)
    want_breakdown = args.breakdown == "all" or (args.breakdown == "floor" and name in B.FLOOR_MODELS)
    if want_breakdown and not past_deadline(args):
        try:
            bd = breakdown(name, path, args)
            report["breakdown"].append(bd)
            print_breakdown(bd)
        except Exception as ex:  # noqa: BLE001
            fail(report, name, 1, "mlx_observed", "breakdown", ex)
    if args.profile and name in B.FLOOR_MODELS and not past_deadline(args):
        try:
            report["profiles"][name] = profile(name, path, args)
        except Exception as ex:  # noqa: BLE001
            fail(report, name, 1, "mlx", "profile", ex)
    save(report, args)


def breakdown(name: str, path: str, args) -> dict:
    """Batch 1: a plain MLX session and one with the ``trace`` option (the EP's observed path), interleaved; the
    traced one's stages per call, read from its trace events (medians and means: a shared host's outliers move
    means, not medians)."""
    feeds = B.feeds(path, 1, seed=1)
    tdir = args.trace_dir or tempfile.mkdtemp(prefix="bench_general_")
    tpath = os.path.join(tdir, f"trace_{name}_{args.device}.json")
    eps_before = {id(ep) for ep in live_eps()}
    sessions = {"mlx": make_session("mlx", path, args)}
    obs = sessions["mlx_observed"] = make_session("mlx_observed", path, args, trace=tpath)
    eps = [ep for ep in live_eps() if id(ep) not in eps_before and ep.stats.tracer is not None]
    if len(eps) != 1:
        raise RuntimeError(f"expected one traced MLX EP, found {len(eps)}")
    st = eps[0].stats
    est = {}
    for e, s in sessions.items():
        for _ in range(max(2, args.warmup)):
            s.run(None, feeds)
        t0 = time.perf_counter()
        s.run(None, feeds)
        est[e] = (time.perf_counter() - t0) * 1e3
    # (at most 400 traced calls a round: a trace kept with --trace-dir stays a few MB)
    rounds, n = plan_rounds(est, args.rounds, min(args.time_budget, 2.0), max_calls=400)
    samples = {e: [] for e in sessions}
    ev0 = len(st.tracer.events)
    for r in range(rounds):
        for e in (list(sessions) if r % 2 == 0 else list(sessions)[::-1]):
            timed_calls(sessions[e], feeds, n[e], samples[e])
    events = st.tracer.events[ev0:]
    calls, cur = [], {}
    for ph, ev_name, cat, _t0, dur, _tid, _args in events:
        if ph != "X" or cat != "compute":
            continue
        if ev_name.startswith("compute "):          # a call's whole Compute, after its stages
            cur["compute"] = cur.get("compute", 0) + dur
            calls.append(cur)
            cur = {}
        else:
            cur[ev_name] = cur.get(ev_name, 0) + dur
    traced = rounds * n["mlx_observed"]
    per_group = len(calls) // max(1, traced)        # Compute calls per session.run (one per fused group)
    runs = [dict() for _ in range(traced)]
    for k, c in enumerate(calls[:len(runs) * per_group]):
        for st_name, v in c.items():
            runs[k // max(1, per_group)][st_name] = runs[k // max(1, per_group)].get(st_name, 0) + v
    stages = sorted({k for r in runs for k in r}, key=lambda k: (k == "compute", STAGE_ORDER.get(k, 9), k))
    med = {k: statistics.median(r.get(k, 0) for r in runs) / 1e3 for k in stages}
    mean = {k: statistics.fmean(r.get(k, 0) for r in runs) / 1e3 for k in stages}
    wall_med = {e: statistics.median(v) * 1e3 for e, v in samples.items()}
    wall_mean = {e: statistics.fmean(v) * 1e3 for e, v in samples.items()}
    out = {"model": name, "batch": 1, "calls": traced, "compute_calls_per_run": per_group,
           "wall_us": wall_med, "wall_mean_us": wall_mean, "stage_median_us": med, "stage_mean_us": mean,
           "outside_compute_us": wall_med["mlx_observed"] - med.get("compute", 0.0),
           "outside_compute_mean_us": wall_mean["mlx_observed"] - mean.get("compute", 0.0),
           "observed_overhead_us": wall_med["mlx_observed"] - wall_med["mlx"],
           "groups": {g: {k: v for k, v in info.items() if isinstance(v, (int, float, str))}
                      for g, info in st.groups.items()},
           "summary": st.summary(), "trace": tpath if args.trace_dir else None}
    release(sessions)
    del obs
    gc.collect()
    from ortmlx import trace as trace_mod
    trace_mod.forget(tpath)                 # (what this process wrote there: not kept in memory)
    if not args.trace_dir:
        shutil.rmtree(tdir, ignore_errors=True)
    return out


#: the EP's per-call stages in the order they run (``ortmlx/trace.py``)
STAGE_ORDER = {"copy_in": 0, "build": 1, "run": 2, "eval": 3, "copy_out": 4}


def profile(name: str, path: str, args) -> str:
    feeds = B.feeds(path, 1, seed=1)
    s = make_session("mlx", path, args)
    for _ in range(max(2, args.warmup)):
        s.run(None, feeds)
    n = 2000 if name in B.FLOOR_MODELS else 50
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        s.run(None, feeds)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(args.profile)
    text = f"{name}: cProfile of {n} warm MLX EP calls (batch 1)\n" + buf.getvalue()
    print(text)
    del s
    gc.collect()
    return text


def mlx_floor(args) -> dict:
    """MLX alone on the EP's device, per call in microseconds: a [1, 4] array uploaded, one add, ``mx.eval``, the
    host read (each timed on its own); the same as one compiled closure; and the pieces alone: an eval with
    nothing left to do, ``mx.synchronize``, an upload with its host read."""
    dev = mx.gpu if args.device == "gpu" else mx.cpu
    x = np.ones((1, 4), np.float32)
    fn = mx.compile(lambda a: a + a)
    pc = time.perf_counter_ns
    res = {"device": args.device}
    n = 2000

    def per_call(f) -> float:
        t0 = pc()
        for _ in range(n):
            f()
        return (pc() - t0) / n / 1e3
    with mx.stream(dev):
        for _ in range(50):
            np.array(fn(mx.array(x)))
        parts = {"upload": 0, "op": 0, "eval": 0, "read": 0}
        for _ in range(n):
            t0 = pc()
            a = mx.array(x)
            t1 = pc()
            y = a + a
            t2 = pc()
            mx.eval(y)
            t3 = pc()
            np.array(y, copy=True)
            t4 = pc()
            parts["upload"] += t1 - t0
            parts["op"] += t2 - t1
            parts["eval"] += t3 - t2
            parts["read"] += t4 - t3
        res["eager_split_us"] = {k: v / n / 1e3 for k, v in parts.items()}
        res["eager_total_us"] = sum(res["eager_split_us"].values())
        res["compiled_total_us"] = per_call(lambda: np.array(fn(mx.array(x))))
        y = fn(mx.array(x))
        mx.eval(y)
        res["eval_done_us"] = per_call(lambda: mx.eval(y))
        res["synchronize_us"] = per_call(lambda: mx.synchronize())
        res["upload_read_us"] = per_call(lambda: np.array(mx.array(x)))
    return res


# --------------------------------------------------------------------------- report
def fail(report: dict, model: str, batch, engine: str, stage: str, ex: BaseException) -> None:
    msg = " ".join(f"{type(ex).__name__}: {ex}".split())
    rec = {"model": model, "batch": batch, "engine": engine, "stage": stage, "error": msg}
    if os.environ.get("BENCH_TRACEBACK"):
        rec["traceback"] = traceback.format_exc()
    report["failures"].append(rec)
    # ORT's prefix and the group's label come first: the cause is at the end, so a short form keeps both ends
    short = msg if len(msg) <= 600 else f"{msg[:200]} ... {msg[-380:]}"
    print(f"  !! {model} batch {batch} {engine} {stage}: {short}", flush=True)
    if "out of memory" in msg.lower():
        rec["memory"] = memory_state()
        print(f"     memory then: {rec['memory']}", flush=True)


def memory_state() -> dict:
    """The device's free memory (every process's use counted) and MLX's own, in GiB: what an out-of-memory
    failure met."""
    import mlx.core as mx

    from ortmlx.kernels.cuda_driver import DriverError, driver
    gib = lambda b: round(b / (1 << 30), 3)  # noqa: E731
    st = {"mlx_active": gib(mx.get_active_memory()), "mlx_cache": gib(mx.get_cache_memory()),
          "mlx_peak": gib(mx.get_peak_memory())}
    drv = driver()
    if drv is not None:
        try:
            free, total = drv.mem_info()
            st.update(device_free=gib(free), device_total=gib(total))
        except DriverError as ex:
            st["device"] = str(ex)
    return st


def skip(report: dict, model: str, batch) -> None:
    report["skipped"].append({"model": model, "batch": batch, "why": "--max-seconds reached"})
    print(f"  -- {model} batch {batch}: skipped (--max-seconds reached)", flush=True)


def past_deadline(args) -> bool:
    return bool(args.max_seconds) and time.perf_counter() - args.t_start > args.max_seconds


def save(report: dict, args) -> None:
    if not args.json:
        return
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, args.json)


def fmt_ms(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def shown_ratios(keys) -> list[str]:
    """The ratios a table shows (the JSON has every pair): MLX against each CUDA column and the CPU EP, eager
    against the first base there is, and the alt column against the MLX EP."""
    keys = set(keys)
    out = [k for k in ("mlx/cuda", "mlx/cuda_fp32", "mlx/cpu") if k in keys]
    out += [k for k in ("mlx_eager/cuda", "mlx_eager/cpu") if k in keys][:1]
    return out + [k for k in ("mlx_alt/mlx",) if k in keys]


def print_case(c: dict) -> None:
    e = c["engines"]
    cols = " | ".join(f"{TITLES[k]} {fmt_ms(v['median_ms'])}" for k, v in e.items())
    rat = " ".join(f"{k} {c['ratios'][k]:.2f}" for k in shown_ratios(c["ratios"]))
    d = c["diff"].get("mlx")
    if d:
        worst = max(d['max_abs'].values(), key=lambda x: x if isinstance(x, float) else 1e9)
        acc = f"diff {worst:.2g} {'ok' if d['ok'] else 'FAIL'}" if isinstance(worst, float) else \
            f"diff {worst} {'ok' if d['ok'] else 'FAIL'}"
    else:
        acc = "diff -"
    p = c["partition"].get("mlx", {})
    print(f"{c['model']:<28} b{c['batch']:<3} {cols} ms | {rat} | {acc} | MLX nodes "
          f"{p.get('claimed', '?')}/{p.get('nodes', '?')} | first MLX {fmt_ms(e.get('mlx', {}).get('first_ms'))} ms",
          flush=True)


def print_breakdown(b: dict) -> None:
    med = b["stage_median_us"]
    sp = ", ".join(f"{k} {v:.1f}" for k, v in med.items() if k != "compute")
    print(f"  {b['model']} b1 per call, medians (us): wall {b['wall_us']['mlx']:.1f} (traced "
          f"{b['wall_us']['mlx_observed']:.1f}) = compute {med.get('compute', 0):.1f} [{sp}] + outside compute "
          f"{b['outside_compute_us']:.1f}; means: wall {b['wall_mean_us']['mlx_observed']:.1f} compute "
          f"{b['stage_mean_us'].get('compute', 0):.1f}", flush=True)


def table(report: dict) -> str:
    """A markdown table of every case (medians in ms)."""
    eng = [e for e in TITLES if any(e in c["engines"] for c in report["cases"])]
    head = ["model", "batch"] + [f"{TITLES[e]} ms" for e in eng]
    rat = shown_ratios({k for c in report["cases"] for k in c["ratios"]})
    cuda_diff = any("cuda" in c["diff"] for c in report["cases"])
    head += rat + ["first MLX ms", "MLX max abs diff", "fp32 ok", "MLX nodes"]
    head += ["CUDA max abs diff"] if cuda_diff else []
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in report["cases"]:
        d = c["diff"].get("mlx")
        p = c["partition"].get("mlx", {})
        vals = [c["model"], str(c["batch"])]
        vals += [fmt_ms(c["engines"][e]["median_ms"]) if e in c["engines"] else "-" for e in eng]
        vals += [f"{c['ratios'][k]:.2f}" if k in c["ratios"] else "-" for k in rat]
        vals += [fmt_ms(c["engines"].get("mlx", {}).get("first_ms")),
                 f"{max(v for v in d['max_abs'].values() if isinstance(v, float)):.1e}" if d else "-",
                 ("yes" if d["ok"] else "NO") if d else "-",
                 f"{p.get('claimed', '?')}/{p.get('nodes', '?')}"]
        if cuda_diff:
            dc = c["diff"].get("cuda")
            vals.append(f"{max(v for v in dc['max_abs'].values() if isinstance(v, float)):.1e}" if dc else "-")
        rows.append("| " + " | ".join(vals) + " |")
    return "\n".join(rows)


#: issue 29's aim: the MLX EP's median latency / the CUDA EP's, per model, at these batch sizes
GOALS = {1: 1.0, 8: 0.8}


def goals(report: dict) -> str:
    """Each model case against the aim (MLX/CUDA <= GOALS[batch], answers within fp32 tolerance); empty without
    a CUDA column."""
    lines = []
    for c in report["cases"]:
        r = c["ratios"].get("mlx/cuda")
        if r is None or c["family"] != "model" or c["model"] in B.FLOOR_MODELS or c["batch"] not in GOALS:
            continue
        d = c["diff"].get("mlx", {})
        ok = r <= GOALS[c["batch"]] and d.get("ok", False)
        lines.append(f"  {'met    ' if ok else 'NOT met'} {c['model']:<14} batch {c['batch']}: MLX/CUDA {r:.2f} "
                     f"(aim <= {GOALS[c['batch']]}), fp32 answers {'ok' if d.get('ok') else 'NOT ok'}")
    if not lines:
        return ""
    met = sum(1 for ln in lines if ln.startswith("  met"))
    return f"aim (MLX/CUDA <= 1.0 at batch 1, <= 0.8 at batch 8, fp32 answers): {met} of {len(lines)} met\n" + \
        "\n".join(lines)


def environment(args) -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
           "onnxruntime": ort.__version__, "ort_providers": ort.get_available_providers(), "mlx": mx.__version__,
           "mlx_backends": ortmlx.mlx_backends(), "numpy": np.__version__, "ortmlx": ortmlx.__version__,
           "device": args.device, "preset": args.preset, "argv": sys.argv[1:],
           "simulated_cuda": args.simulate_gpu,
           "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "blas": ortmlx.blas.status(),
           "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
           "env": {k: v for k, v in os.environ.items() if k.startswith(("ORTMLX_", "MLX_", "OPENBLAS_", "OMP_"))}}
    try:
        env["git"] = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    if args.device == "gpu":
        try:
            env["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:  # noqa: BLE001
            pass
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "gpu"), default="gpu" if ortmlx_gpu() else "cpu",
                    help="the MLX EP's device; gpu adds ORT's CUDA EP column (default: gpu when MLX has one)")
    ap.add_argument("--preset", choices=B.PRESETS, default=None,
                    help="model sizes (default: small on cpu, full on gpu)")
    ap.add_argument("--models", default=None, help="comma-separated: names, 'models', 'floor', 'ops', 'all' "
                    "(default: models, or none when --ops is given)")
    ap.add_argument("--ops", nargs="?", const="ops", default=None,
                    help="the per-op-family micro benchmark: all op cases, or a comma-separated list")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="warm-up calls after the first (default 2)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds of timed calls per case (default 2)")
    ap.add_argument("--max-seconds", type=float, default=0, help="start no new case after this wall time (0: none)")
    ap.add_argument("--eager", action="store_true", help="also the MLX EP with no_compile=1")
    ap.add_argument("--no-cuda", action="store_true", help="no CUDA EP column on the GPU")
    ap.add_argument("--cuda-fp32", action="store_true",
                    help="also a 'CUDA EP fp32' column: the CUDA EP with use_tf32=0 (its default lets cuBLAS/cuDNN use "
                         "TF32 for float32 products and convolutions; the MLX EP never does)")
    ap.add_argument("--mlx-option", action="append", default=[], metavar="KEY=VALUE",
                    help="MLX EP option (all MLX columns)")
    ap.add_argument("--alt-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an 'MLX alt' column: the MLX EP with these options too (an A/B in one run)")
    ap.add_argument("--cuda-option", action="append", default=[], metavar="KEY=VALUE", help="CUDA EP provider option")
    ap.add_argument("--breakdown", choices=("none", "floor", "all"), default="floor",
                    help="per-call stage split at batch 1 (default: the one-node floor models)")
    ap.add_argument("--trace-dir", default="", help="keep the breakdown sessions' Perfetto traces here")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile of the floor models: top N")
    ap.add_argument("--json", default="", help="write every result here (rewritten after each case)")
    args = ap.parse_args(argv)
    #: developer dry run: the CUDA columns served by ORT's CPU EP, to exercise the GPU host's code paths anywhere
    args.simulate_gpu = os.environ.get("BENCH_GENERAL_SIMULATE_GPU", "") == "1"
    args.t_start = time.perf_counter()
    args.preset = args.preset or ("full" if args.device == "gpu" else "small")
    args.time_budget = args.time_budget if args.time_budget is not None else 2.0
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    spec = args.models if args.models is not None else ("" if args.ops else "models")
    names = B.select(spec) + (B.select(args.ops) if args.ops else [])
    if args.device == "gpu" and not ortmlx_gpu():
        raise SystemExit("--device gpu: MLX has no GPU here")
    report = {"env": environment(args), "cases": [], "breakdown": [], "profiles": {}, "failures": [], "skipped": []}
    print(f"bench_general: {len(names)} models, batches {args.batches}, device {args.device}, preset {args.preset}, "
          f"engines {engines_for(args)}", flush=True)
    if args.breakdown != "none":
        try:
            report["mlx_floor"] = f = mlx_floor(args)
            print(f"MLX alone ({args.device}): [1,4] upload+add+eval+read {f['eager_total_us']:.1f} us "
                  f"({', '.join(f'{k} {v:.1f}' for k, v in f['eager_split_us'].items())}); "
                  f"compiled add {f['compiled_total_us']:.1f} us; an eval with nothing to do {f['eval_done_us']:.1f}, "
                  f"mx.synchronize {f['synchronize_us']:.1f}, upload + host read {f['upload_read_us']:.1f} us",
                  flush=True)
        except Exception as ex:  # noqa: BLE001
            fail(report, "mlx_floor", 1, "mlx", "floor", ex)
    for name in names:
        if past_deadline(args):
            for b in args.batches:
                skip(report, name, b)
            continue
        try:
            bench_model(name, args, report)
        except Exception as ex:  # noqa: BLE001 - one model failing leaves the rest
            fail(report, name, None, "-", "model", ex)
        save(report, args)
    report["wall_s"] = time.perf_counter() - args.t_start
    report["env"]["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    save(report, args)
    print()
    print(table(report))
    g = goals(report)
    if g:
        print("\n" + g)
    if report["failures"]:
        print(f"\n{len(report['failures'])} failure(s):")
        for f in report["failures"]:
            print(f"  {f['model']} batch {f['batch']} {f['engine']} {f['stage']}: {f['error']}")
    if report["skipped"]:
        print(f"{len(report['skipped'])} case(s) skipped past --max-seconds")
    print(f"wall {report['wall_s']:.0f} s")
    return 1 if report["failures"] else 0


def ortmlx_gpu() -> bool:
    from ortmlx.kernels.interpreter import mlx_gpu_available
    return mlx_gpu_available()


if __name__ == "__main__":
    sys.exit(main())
