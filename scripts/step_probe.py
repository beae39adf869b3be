"""Where a steady genai decode token goes, stage by stage, without a profiler's overhead.

    python scripts/step_probe.py MODEL_DIR [--tokens 96] [--option key=value ...] [--env K=V ...]
    python scripts/step_probe.py MODEL_DIR --prompt 128,2048 --max-length 4104 --tokens 5   # prompts
    python scripts/step_probe.py MODEL_DIR --batch 16              # a batch's decode step (static batching)
    python scripts/step_probe.py MODEL_DIR --prompt 128 --max-length 4104 --tokens 4 --env "" \
        --env PROBE_NO_DECODE=1,PROBE_SAME_IDS=1,PROBE_BENCH_MIN=1,PROBE_FIRST_GEN=1   # bench_llm's TTFT loop

Wraps the EP's per-call stages with ``perf_counter`` timers (a few hundred ns each) and runs a
greedy genai generation on the MLX EP: per decode token (median of the second half), the time in
each stage, the MLX closure's call (graph replay) and eval, and what is left of the token outside
Compute (genai's own step and ORT's plumbing). ``--env`` sets variables before MLX loads
(``MLX_MAX_OPS_PER_BUFFER=50``); each ``--env`` set runs in its own process, in turn.

``--tree DIR`` (repeatable) also runs another checkout's ortmlx (its shim built: ``python setup.py
build_ext --inplace`` there), in processes alternating with this tree's, ``--rounds`` times; each run
prints the EP's own Python per token (copy-in, key and lookup, hoisted work, copy-out) and its share
of the token, and a last table gives each configuration's medians over the rounds. Processes of one
configuration differ by 10-40% on a shared host: compare within rounds.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import importlib.util
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, HERE)

#: (module, class, method, stage name): the per-call stages of Compute, outermost first (the layout since the
#: runtime layer; a checkout from before it, run with ``--tree``, finds its own under the same names)
STAGES = [
    ("ortmlx.ep.compute", "ComputeInfo", "compute", "compute"),
    ("ortmlx.ep.compute", "ComputeInfo", "gather", "copy_in.gather"),
    ("ortmlx.ep.compute", "ComputeInfo", "addresses", "copy_in.addresses"),
    ("ortmlx.runtime.group", "Group", "use_mirrors", "copy_in.mirrors"),
    ("ortmlx.ep.compute", "ComputeInfo", "use_mirrors", "copy_in.mirrors"),
    ("ortmlx.runtime.kvbatch", "KvBatches", "take", "copy_in.mirrors.kv_take"),
    ("ortmlx.ep.kvbatch", "KvBatches", "take", "copy_in.mirrors.kv_take"),
    ("ortmlx.runtime.group", "Group", "write_outputs", "copy_out"),
    ("ortmlx.ep.compute", "ComputeInfo", "write_outputs", "copy_out"),
    ("ortmlx.runtime.group", "Group", "_output_ptrs", "copy_out.output_ptrs"),
    ("ortmlx.ep.compute", "ComputeInfo", "_output_ptrs", "copy_out.output_ptrs"),
    ("ortmlx.runtime.group", "Group", "_write_batch", "copy_out.kv_batch"),
    ("ortmlx.ep.compute", "ComputeInfo", "_write_batch", "copy_out.kv_batch"),
    ("ortmlx.runtime.kvbatch", "KvBatches", "layout_for", "copy_out.kv_batch.layout"),
    ("ortmlx.ep.kvbatch", "KvBatches", "layout_for", "copy_out.kv_batch.layout"),
    ("ortmlx.runtime.kvbatch", "KvBatches", "write", "copy_out.kv_batch.write"),
    ("ortmlx.ep.kvbatch", "KvBatches", "write", "copy_out.kv_batch.write"),
    ("ortmlx.runtime.group", "Group", "_copy", "copy_out.host_outputs"),
    ("ortmlx.ep.compute", "ComputeInfo", "_copy", "copy_out.host_outputs"),
    ("ortmlx.runtime.mirror", None, "hint_bytes", "copy_out.hint_read"),
    ("ortmlx.ep.compute", "_Sink", "allocate", "copy_out.allocate"),                 # (ORT's output buffers)
    ("ortmlx.runtime.devread", "DriverReader", "write_result", "copy_out.direct"),   # (a large result, by a kernel)
    ("ortmlx.runtime.devread", None, "parallel_memmove", "copy_out.direct.memmove"),
    ("ortmlx.ep.mirror", None, "hint_bytes", "copy_out.hint_read"),
    ("ortmlx.compiled.core", "CompiledSubgraph", "run", "run"),
    ("ortmlx.compiled.keys", "Keys", "key", "run.key"),
    ("ortmlx.compiled.core", "CompiledSubgraph", "_key1", "run.key"),
    ("ortmlx.compiled.keys", "Keys", "since", "run.key_since"),                       # (calls key on a memo miss)
    ("ortmlx.compiled.core", "CompiledSubgraph", "_key_since", "run.key_since"),
    ("ortmlx.compiled.core", "CompiledSubgraph", "_apply", "run.apply"),
    ("ortmlx.compiled.core", "CompiledSubgraph", "_hoisted_values", "run.apply.hoisted"),
    ("ortmlx.compiled.core", "CompiledSubgraph", "_upload_hoisted", "run.apply.hoisted_upload"),
    ("ortmlx.compiled.core", "CompiledSubgraph", "_call_ahead", "run.apply.ahead"),     # (the next call's, made now)
    ("ortmlx.kernels.cuda_driver", "Driver", "synchronize", "run.apply.spin"),      # (GPU: the polled wait)
    ("ortmlx.compiled.core", "CompiledSubgraph", "_settled_eval", "run.apply.settled"),  # (launch, wait, eval)
    ("mlx.core", None, "async_eval", "mx.async_eval"),     # (MLX's launch of a graph: its host work, every caller's)
    # a prompt's call (--prompt): padding to its bucket, uploads, a first call's trace, eager and verification
    ("ortmlx.compiled.attention", "BucketedPrefill", "_prepare", "run.prepare"),
    ("ortmlx.compiled.core", "CompiledSubgraph", "_upload", "run.apply.upload"),
    ("ortmlx.compiled.core", "CompiledSubgraph", "_first", "run.first"),
    ("ortmlx.compiled.core", "CompiledSubgraph", "_eager_env", "run.eager"),
    ("ortmlx.compiled.core", "CompiledSubgraph", "_verify", "run.verify"),
]
#: modules that import the module functions above by name (their references are wrapped too)
IMPORTERS = ("ortmlx.runtime.group", "ortmlx.ep.compute")


def child(model_dir: str, opts: dict, tokens: int, prompts: list[int] | None = None, max_length: int = 0,
          batch: int = 1) -> dict:
    import importlib

    tree = os.environ.get("ORTMLX_PROBE_TREE")
    if tree:
        sys.path.insert(0, tree)        # that checkout's ortmlx (before this one's)
    import numpy as np
    import onnxruntime_genai as og

    from ortmlx import genai as mg

    acc: dict = collections.defaultdict(float)

    def timed(fn, name):
        @functools.wraps(fn)
        def w(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t
        return w

    for mod, cls, meth, name in STAGES:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue                    # (a module another checkout does not have)
        owner = getattr(m, cls, None) if cls else m
        if owner is None or not hasattr(owner, meth):
            continue                    # (a stage another checkout does not have)
        setattr(owner, meth, timed(getattr(owner, meth), name))
        if cls is None:                 # module functions are imported by name elsewhere
            for other in IMPORTERS:
                try:
                    om = importlib.import_module(other)
                except ImportError:
                    continue
                if getattr(om, meth, None) is not None:
                    setattr(om, meth, getattr(owner, meth))
    # the closure call itself: wrap each closure's fn when it is made, and each runner's eval
    from ortmlx.compiled import core
    if hasattr(core, "compile_closure"):
        make_fn, init = core.compile_closure, core.CompiledSubgraph.__init__

        def compile_fn_timed(*a, **k):
            return timed(make_fn(*a, **k), "run.apply.closure_call")

        def init_timed(self, *a, **k):
            init(self, *a, **k)
            self._eval = timed(self._eval, "run.apply.eval")      # an instance attribute (mx.eval)
        core.compile_closure = compile_fn_timed
        core.CompiledSubgraph.__init__ = init_timed
    else:                               # a checkout from before compiled/trace.py (--tree)
        make = core.CompiledSubgraph._compile

        def compile_timed(self, c):
            if not getattr(self._eval, "_timed", False):
                self._eval = timed(self._eval, "run.apply.eval")
                self._eval._timed = True
            return timed(make(self, c), "run.apply.closure_call")
        core.CompiledSubgraph._compile = compile_timed

    ml = (max_length or max(prompts) + tokens) if prompts else None
    # a test build's context (256 for the small ones) raised to the prompts' buffer
    overlay = {"model": {"context_length": ml}} if ml and os.environ.get("PROBE_NO_OVERLAY") != "1" else None
    model, _ = mg.load_model(model_dir, "mlx", opts, overlay=overlay)
    if prompts:
        return {"prompts": prompt_calls(model, acc, prompts, ml, tokens)}
    ids = np.arange(100, 107, dtype=np.int32)
    rows = []
    from ortmlx.kernels import background
    for rnd in range(2):
        if rnd == 1:
            background.wait(600)        # new keys' kernels built behind the first round (a GPU's worker): done
        params = mg.search_options(model, len(ids) + tokens, len(ids) + tokens)
        if batch > 1:           # genai's static batching: the same prompt in every row
            params.set_search_options(batch_size=batch)
        g = og.Generator(model, params)
        g.append_tokens(np.tile(ids, (batch, 1)) if batch > 1 else ids)
        while not g.is_done():
            acc.clear()
            t = time.perf_counter()
            g.generate_next_token()
            tok = time.perf_counter() - t
            if rnd == 1:
                rows.append(dict(acc, token=tok))
    rows = rows[len(rows) // 2:]
    med = {k: 1e3 * statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0]}
    med["outside_compute"] = 1e3 * statistics.median(r["token"] - r.get("compute", 0.0) for r in rows)
    return {"tokens": len(rows), "ms": med}


def prompt_calls(model, acc: dict, prompts: list[int], max_length: int, calls: int) -> dict:
    """Prompts' calls (``append_tokens``) stage by stage, per length: the first one, then the median of ``calls``
    warm ones, each with a fresh generator (each is a first prompt, as a new request's is); with each, the
    generator's creation, the first token's sampling and the first decode step, timed whole (``genai.*``)."""
    import numpy as np
    import onnxruntime_genai as og

    from ortmlx import genai as mg
    from ortmlx.kernels import background

    rng = np.random.default_rng(0)
    res = {}
    # bench_llm's TTFT loop, part by part (set through --env): no decode step between prompts, the same prompt
    # every call, min_length of the prompt + 1, and (PROBE_FIRST_GEN) its check's generation before them
    no_decode, same_ids, bench_min = (os.environ.get(k) == "1" for k in ("PROBE_NO_DECODE", "PROBE_SAME_IDS",
                                                                       "PROBE_BENCH_MIN"))
    if os.environ.get("PROBE_FIRST_GEN") == "1":       # bench_llm's check before: a generation in a 256-token buffer
        g = og.Generator(model, mg.search_options(model, 256, 256))
        g.append_tokens(rng.integers(100, 480, prompts[0]).astype(np.int32))
        for _ in range(16):
            g.generate_next_token()
        del g
    for prompt in prompts:
        rows = []
        same = rng.integers(100, 480, prompt).astype(np.int32)
        for k in range(calls + 2):
            if k == 1:
                background.wait(600)    # the first call's kernels built behind it (a GPU's worker): done
            ids = same if same_ids else rng.integers(100, 480, prompt).astype(np.int32)
            t0 = time.perf_counter()
            g = og.Generator(model, mg.search_options(model, max_length, prompt + 1 if bench_min else max_length))
            acc.clear()
            t = time.perf_counter()
            g.append_tokens(ids)
            row = dict(acc, token=time.perf_counter() - t, **{"genai.generator": t - t0})
            # what bench_llm's TTFT adds to the prompt (the first token's sampling), and the first decode step
            for key in ("genai.sample_after_prompt",) + (() if no_decode else ("genai.first_decode_step",)):
                t = time.perf_counter()
                g.generate_next_token()
                row[key] = time.perf_counter() - t
            rows.append(row)
            del g
        first, warm = rows[0], rows[2:]
        med = {k: 1e3 * statistics.median(r.get(k, 0.0) for r in warm) for k in warm[0]}
        med["outside_compute"] = 1e3 * statistics.median(r["token"] - r.get("compute", 0.0) for r in warm)
        res[prompt] = {"tokens": len(warm), "ms": med, "first_ms": {k: 1e3 * v for k, v in first.items()}}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--option", action="append", default=[], help="MLX EP option key=value")
    ap.add_argument("--env", action="append", default=[], help="comma list of K=V environment settings (a run each)")
    ap.add_argument("--tree", action="append", default=[], help="another checkout to run in alternating processes")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every configuration, in turn")
    ap.add_argument("--prompt", default="",
                    help="comma list of prompt lengths: time prompts instead (--tokens warm ones each, each a new "
                         "generator, after a first one)")
    ap.add_argument("--max-length", type=int, default=0, help="the generators' max_length with --prompt")
    ap.add_argument("--batch", type=int, default=1, help="decode rows (genai static batching; not with --prompt)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    opts = dict(o.split("=", 1) for o in args.option)
    if args.child is not None:
        prompts = [int(x) for x in args.prompt.split(",") if x]
        print(json.dumps(child(args.model_dir, opts, args.tokens, prompts, args.max_length, args.batch)))
        return 0
    configs = [(spec, tree) for tree in [None] + [os.path.abspath(t) for t in args.tree] for spec in args.env or [""]]
    seen: dict = collections.defaultdict(list)
    for _ in range(max(1, args.rounds)):
        for spec, tree in configs:
            env = dict(os.environ)
            env.update(kv.split("=", 1) for kv in spec.split(",") if kv)
            if tree:
                env["ORTMLX_PROBE_TREE"] = tree
            label = f"{spec or 'default'}{f' @ {tree}' if tree else ''}"
            r = subprocess.run([sys.executable, os.path.abspath(__file__), args.model_dir, "--tokens",
                                str(args.tokens), "--prompt", args.prompt, "--max-length", str(args.max_length),
                                "--batch", str(args.batch), "--child", "1"] + [f"--option={o}" for o in args.option],
                               capture_output=True, text=True, env=env, cwd=tree or None)
            if r.returncode != 0:
                print(f"[{label}] failed rc={r.returncode}: {r.stderr[-1500:]}")
                continue
            res = json.loads(r.stdout.strip().splitlines()[-1])
            if "prompts" in res:
                for p, pr in res["prompts"].items():
                    ml = args.max_length or max(map(int, res["prompts"])) + args.tokens
                    show(f"[{label}] {os.path.basename(args.model_dir.rstrip('/'))}, options {opts}, a {p}-token "
                         f"prompt (max_length {ml}): median of {pr['tokens']} warm calls [the first call]", pr)
                continue
            ms = res["ms"]
            own = ep_python(ms)
            seen[label].append((ms["token"], own))
            show(f"[{label}] {os.path.basename(args.model_dir.rstrip('/'))}, options {opts}, "
                 f"median of {res['tokens']} steady tokens" + (f" (batch {args.batch})" if args.batch > 1 else ""), res)
    if len(configs) > 1 or args.rounds > 1:
        print("\nmedians over the rounds (ms): token, EP Python, its share")
        for label, got in seen.items():
            tok, own = statistics.median(t for t, _ in got), statistics.median(o for _, o in got)
            shares = ", ".join(f"{100 * o / t:.1f}%" for t, o in got)
            print(f"  {label:<40} {tok:7.3f} {own:7.3f}  {100 * own / tok:5.1f}%  (each run: {shares})")
    return 0


def show(title: str, res: dict) -> None:
    """One run's stage table (ms; a prompt's first call in brackets)."""
    ms, first = res["ms"], res.get("first_ms", {})
    print(title + ", ms:")
    for k in ["token", "outside_compute"] + list(dict.fromkeys(s[3] for s in STAGES)) + [
            "run.apply.closure_call", "run.apply.eval", "genai.generator", "genai.sample_after_prompt",
            "genai.first_decode_step"]:
        if k in ms or k in first:
            print(f"  {k:<28} {ms.get(k, 0.0):8.3f}" + (f"  [{first.get(k, 0.0):9.1f}]" if first else ""))
    own = ep_python(ms)
    print(f"  {'ep_python':<28} {own:8.3f}")
    print(f"  {'ep_python_share_pct':<28} {100 * own / ms['token']:8.1f}")


def ep_python(ms: dict) -> float:
    """The EP's own Python in a token (ms): copy-in, the key and closure lookup (``run`` less ``run.apply``),
    hoisted work (its uploads too, counting those of the call made ahead) and copy-out; MLX's closure call
    and eval, the call made ahead while the device runs (``run.apply.ahead``), genai and ORT are not in it."""
    return (sum(ms.get(k, 0.0) for k in ("copy_in.gather", "copy_in.addresses", "copy_in.mirrors",
                                          "run.apply.hoisted", "run.apply.hoisted_upload", "copy_out"))
            + ms.get("run", 0.0) - ms.get("run.apply", 0.0))


if __name__ == "__main__":
    sys.exit(main())
