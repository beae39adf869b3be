"""LLM benchmark: ORT's CUDA EP (genai's default config, and with CUDA graphs) vs the MLX EP (compiled), the
same ONNX model and the same onnxruntime-genai greedy loop for every engine, side by side, ratios printed.

    python scripts/bench_llm.py --json out/llm.json                       # GPU host: 0.5b and 1.5b, fp16 and int4
    python scripts/bench_llm.py --sizes 0.5b --precisions fp16 --only prefill,stall --time-budget 540 --json a.json
    python scripts/bench_llm.py --smoke --json /tmp/smoke.json            # any CPU box: tiny models, ORT's CPU EP

Engines (each in a worker process of its own; the cases alternate between them, round by round):
  cuda        ORT's CUDA EP through genai with the model's genai_config.json as built (genai's default config)
  cuda_graph  the same with CUDA graphs: a copy of the model folder (files hard-linked) whose genai_config.json
              has "provider_options": [{"cuda": {"enable_cuda_graph": "1"}}]
  mlx         the MLX EP compiled (ortmlx.register(), genai's provider list replaced by MLXExecutionProvider)
  ref         (accuracy only) the same checkpoint built at fp32 with ``-e cpu``, on ORT's CPU EP
With --smoke the two CUDA columns run on ORT's CPU EP (value_info stripped, which the CPU EP needs for the
builder's fp16 graphs) and the MLX EP on MLX's CPU; sizes shrink (the tiny model, prompts <= 128 tokens).

Cases (--only, comma separated; default all but cold, in this order):
  cold      a fresh host as far as one can be made: each engine in a new process whose kernel caches are empty
            (MLX_PTX_CACHE_DIR, CUDA_CACHE_PATH, TMPDIR: new directories);
            process start to the first token of a 128-token prompt, and to the 16th (the OS's file cache stays warm),
            then generations of 64 tokens until --cold-window seconds after the load (tokens in all, ms a token at
            its end: kernels may still be built behind the calls); then extra MLX EP runs (--cold-variants): eager, after `python -m ortmlx warmup` filled the empty kernel
            cache (as at install), prompts eager, and in the caches its own run filled (rerun)
  stall     after one generation, 17 prompt lengths <= 4096 drawn with a fixed seed: each first call's TTFT over
            the warm TTFT at its length; the slowest ratio is reported. --stall-warmup: the MLX EP first runs
            ortmlx.warmup.warm (a prompt per bucket up to the longest length, in the worker's process) and its
            time is reported with the ratios after it
  prefill   TTFT (append_tokens + the first generated token) at 128 / 512 / 2048 / 4096: the first call at each
            length (cold) and the median of the warm ones. Both use one max_length for all lengths (the KV buffer's
            shape does not change with the prompt)
  decode    batch-1 tok/s over 128 new tokens after a 128-token prompt (warm; median of the rounds)
  batch     aggregate decode tok/s at batch 1 / 4 / 16 (static batching: batch_size in the search options,
            append_tokens with a [B, 128] array)
  accuracy  greedy tokens over 128 steps vs the CUDA EP and the fp32 reference (first mismatch); logits teacher-
            forced on the reference's tokens for K steps: max |logit - fp32 reference| per engine, MLX vs CUDA
  host      the MLX EP's own Python per decode token (scripts/step_probe.py's child run: copy-in, key, hoisted
            work, copy-out) and its share of the token
Before any case each engine's logits must be finite (prompt + a few steps); an engine that fails is left out.

Robustness: every engine call has a time limit (a worker past it is killed and started again for the next case);
a failure is one line in the table and in the JSON's "errors"; the JSON (--json) is rewritten after every case,
so a run stopped at any point leaves what it measured; workers' stderr goes to --log. --time-budget (seconds)
skips a case whose estimate does not fit in what is left and clips every limit to it.

Builds: scripts/bench_models.py (-e cuda, fp16 / int4: GQA, shared KV buffer; --prune-lm-head: the builder's
prune_lm_head, whose prompt logits are the last token's only) and, for accuracy,
models/build_llm.py (-e cpu fp32); cached under models/out; their times are printed and kept in the JSON
(--build-only: build, print, stop). The reference's tokens and logits are cached next to its build
(.bench_ref-*.npz: they depend on the checkpoint and the sizes only), so fp16 and int4 share one run of it.
The stall and prefill cases each start every engine afresh (loaded, one generation), so what ran before
them, e.g. another case's prompt lengths, does not warm their first calls.

Testing the harness: --call-limit S caps every engine call; BENCH_LLM_FAULT=op:engine:hang|crash makes a
worker hang or die at that op (tests/test_bench_llm.py runs --smoke, ~10-30 s).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "models"))
import build_llm as B  # noqa: E402  (stdlib only at import: the cache checks and paths)


def _ortmlx_home() -> str:
    """The directory of the ortmlx this Python imports (the installed package's, or a checkout on PYTHONPATH),
    else this checkout: the workers import the same one."""
    import importlib.util
    spec = importlib.util.find_spec("ortmlx")
    return os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else ROOT


ENGINES = ("cuda", "cuda_graph", "mlx")
CASES = ("cold", "stall", "prefill", "decode", "batch", "accuracy", "host")
#: what --only runs when not given ("cold" rebuilds every MLX kernel: minutes on a GPU, so it is asked for)
DEFAULT_CASES = tuple(c for c in CASES if c != "cold")
#: the cold case's extra MLX EP runs (--cold-variants): name -> provider options; "warmed" first runs
#: `python -m ortmlx warmup` into the empty kernel cache (as an install step would); "rerun" runs in the kernel
#: caches the MLX EP's own run filled (a new process on a host that ran the model before)
COLD_VARIANTS = {"eager": {"no_compile": "1"}, "warmed": {}, "prefill_eager": {"no_compile": "prefill"}, "rerun": {}}

#: sizes and counts; --smoke takes the second set (the tiny model's context is 256 positions)
FULL = dict(sizes=["0.5b", "1.5b"], precisions=["fp16", "int4"], prefill=[128, 512, 2048, 4096], stall_n=17,
            stall_max=4096, prompt=128, new_tokens=128, batches=[1, 4, 16], reps=3, rounds=3, acc_steps=32,
            check_prompt=100, check_tokens=8, host_tokens=96, budget=540.0)
SMOKE = dict(sizes=["tiny"], precisions=["fp16", "int4"], prefill=[16, 32, 64, 128], stall_n=17, stall_max=128,
             prompt=16, new_tokens=16, batches=[1, 2, 4], reps=2, rounds=2, acc_steps=8, check_prompt=12,
             check_tokens=4, host_tokens=24, budget=900.0)
#: the most one engine call of each kind may take (clipped to the time left)
LIMITS = dict(cold=300, load=300, check=300, stall=300, prefill=240, decode=180, batch=240, accuracy=240, ref=300,
              host=240, build=420)
#: kept back from --time-budget for the last table and the JSON
RESERVE = 5.0
#: what the estimates take a call at a new shape (a prompt length, batch or KV buffer not seen yet) to cost
#: until the stall case has measured it
NEW_SHAPE_S = 5.0


# =============================================================================================== worker side
class Engine:
    """One engine in a worker process: a genai model and the ops the parent asks for (each returns a dict)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.kind = spec["kind"]
        self.model = None
        self.seen: set = set()          # (prompt length, max_length, batch) already run: a later one is warm
        self.queued = 0                 # the MLX EP's kernel builds queued behind calls, at the last settle

    # ------------------------------------------------------------------ load
    def op_load(self) -> dict:
        t0 = time.perf_counter()
        import onnxruntime_genai as og
        self.og = og
        info: dict = {"genai": og.__version__}
        d = self.spec["dir"]
        if self.kind == "mlx":
            import ortmlx
            from ortmlx import genai as mg
            opts = {"device": self.spec["mlx_device"], **self.spec.get("mlx_options", {})}
            self.model, reports = mg.load_model(d, "mlx", opts)
            info["mlx_options"] = opts
            try:
                import mlx.core as mx
                info["mlx"] = f"{mx.__version__} ({mx.default_device()})"
            except Exception:  # noqa: BLE001
                pass
            if reports:
                r = reports[-1]
                info["partition"] = f"{r.n_claimed}/{r.n_nodes} nodes claimed, {len(r.groups)} group(s)"
            info["ortmlx"] = ortmlx.__version__
        else:
            config = og.Config(d)
            if self.kind == "ref" or self.spec["smoke"]:
                config.clear_providers()            # ORT's CPU EP
            self.model = og.Model(config)
            if self.kind.startswith("cuda") and not self.spec["smoke"]:
                dev = str(getattr(self.model, "device_type", "?"))
                try:
                    avail = og.is_cuda_available()
                except Exception:  # noqa: BLE001
                    avail = None
                if avail is False or "cuda" not in dev.lower():
                    info["device_warning"] = (f"genai reports model device {dev!r}, is_cuda_available={avail}: "
                                              "is this ORT's CUDA EP?")
        import onnxruntime as ort
        info.update(onnxruntime=ort.__version__, device_type=str(getattr(self.model, "device_type", "?")),
                    load_s=round(time.perf_counter() - t0, 3))
        with open(os.path.join(d, "genai_config.json")) as f:
            cfg = json.load(f)
        self.vocab = int(cfg["model"]["vocab_size"])
        info["context_length"] = int(cfg["model"]["context_length"])
        info["provider_options"] = cfg["model"]["decoder"].get("session_options", {}).get("provider_options")
        return info

    # ------------------------------------------------------------------ the loop
    def prompt(self, length: int, batch: int = 1, seed: int = 0) -> np.ndarray:
        """The same [batch, length] prompt for every engine (ids clear of the special tokens at the top)."""
        rng = np.random.default_rng([seed, length, batch])
        return rng.integers(5, min(self.vocab - 8, 150000), (batch, length)).astype(np.int32)

    def generator(self, batch: int, max_len: int, min_len: int):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_len, min_length=min_len, do_sample=False, num_beams=1,
                                  batch_size=batch)
        return self.og.Generator(self.model, params)

    def generate(self, length: int, n_new: int, max_len: int, batch: int = 1, check: bool = False,
                 seed: int = 0) -> dict:
        """The greedy loop every engine runs: append the prompt, then ``n_new`` tokens one step at a time
        (EOS suppressed by min_length, so exactly ``n_new``); times of append + first token (TTFT) and of the
        rest. ``check``: every step's logits must be finite."""
        ids = self.prompt(length, batch, seed)
        key = (length, max_len, batch)
        warm = key in self.seen
        t0 = time.perf_counter()
        g = self.generator(batch, max_len, min(max_len, length + n_new))
        t1 = time.perf_counter()
        g.append_tokens(ids if batch > 1 else ids[0])
        peak = 0.0
        if check:
            peak = _finite(g.get_logits(), "after the prompt")
        g.generate_next_token()
        toks = [np.array(g.get_next_tokens())]
        t2 = time.perf_counter()
        for i in range(n_new - 1):
            if g.is_done():
                break
            g.generate_next_token()
            toks.append(np.array(g.get_next_tokens()))
            if check:
                peak = max(peak, _finite(g.get_logits(), f"at decode step {i + 1}"))
        t3 = time.perf_counter()
        self.seen.add(key)
        del g
        n = len(toks)
        out = {"ttft_ms": 1e3 * (t2 - t1), "generator_ms": 1e3 * (t1 - t0), "decode_s": t3 - t2, "tokens_out": n,
               "tps": batch * (n - 1) / (t3 - t2) if n > 1 and t3 > t2 else None, "warm": warm,
               "total_s": t3 - t0, "tokens": [int(t[0]) for t in toks]}
        if check:
            out["max_abs_logit"] = peak
        return out

    # ------------------------------------------------------------------ ops
    def settle(self) -> bool:
        """Wait for the kernels the MLX EP builds behind its calls (a GPU's worker process, a CPU's thread): a warm
        figure is then the steady state's (the stall case times the first calls, answered eagerly meanwhile).
        Whether any build was queued since the last settle."""
        if self.kind != "mlx":
            return False
        from ortmlx.kernels import background
        queued, self.queued = background.submitted() != self.queued, background.submitted()
        return background.wait(600) and queued

    def op_check(self, length: int, n_new: int, max_len: int) -> dict:
        """Finite logits (prompt + steps), twice: the first generation (cold) and a warm one."""
        first = self.generate(length, n_new, max_len, check=True)
        if self.settle():
            self.generate(length, n_new, max_len)       # the new keys traced here and verified
        second = self.generate(length, n_new, max_len, check=True)
        return {"first": first, "warm": second}

    def op_gen(self, length: int, n_new: int, max_len: int, batch: int = 1, keep_tokens: bool = False) -> dict:
        self.settle()
        r = self.generate(length, n_new, max_len, batch)
        if self.settle():                               # new keys (a batch, a length): timed again, built
            self.generate(length, n_new, max_len, batch)
            r = self.generate(length, n_new, max_len, batch)
        if not keep_tokens:
            r.pop("tokens")
        return r

    def op_cold(self, length: int, n_new: int, max_len: int, window_s: float = 0.0) -> dict:
        """The process's first generation, with the kernel files MLX wrote meanwhile counted; then, while less than
        ``window_s`` has passed since this op began (the load's end), generations of 64 tokens one after another:
        the tokens of all of them and the ms a token of the last (what a user sees in a new process's first
        seconds, while kernels are still being built behind the calls)."""
        t0 = time.perf_counter()
        r = self.generate(length, n_new, max_len)
        r.pop("tokens")
        tokens, last = r["tokens_out"], None
        while time.perf_counter() - t0 < window_s:
            g = self.generate(length, 64, max_len)
            tokens += g["tokens_out"]
            last = 1e3 * g["decode_s"] / max(1, g["tokens_out"] - 1)
        if window_s > 0:
            r["window"] = {"s": time.perf_counter() - t0, "tokens": tokens, "last_ms_per_token": last}
        # MLX's kernel files: PTX/CUBIN on CUDA (MLX_PTX_CACHE_DIR), g++ libraries on its CPU ($TMPDIR/mlx)
        dirs = {os.environ.get("MLX_PTX_CACHE_DIR") or "", os.path.join(tempfile.gettempdir(), "mlx")}
        r["kernel_files"] = sum(len(fs) for d in dirs if d and os.path.isdir(d) for _, _, fs in os.walk(d))
        return r

    def op_ttft(self, length: int, max_len: int, reps: int) -> dict:
        """The first call at ``length`` (cold unless this length ran before) and ``reps`` more."""
        ms, warm0 = [], (length, max_len, 1) in self.seen
        self.settle()
        for k in range(1 + reps):
            ms.append(self.generate(length, 1, max_len)["ttft_ms"])
            if k == 0 and self.settle():
                self.generate(length, 1, max_len)       # its key traced here and verified (untimed)
        return {"ms": ms, "first_was_warm": warm0}

    def op_warmup(self, max_len: int, up_to: int) -> dict:
        """The MLX EP's in-process warm-up (``ortmlx.warmup.warm``): every prefill bucket up to ``up_to``."""
        from ortmlx import warmup
        t0 = time.perf_counter()
        rows = warmup.warm(self.model, max_len, up_to, decode_steps=1, vocab=min(self.vocab, 1000),
                           log=lambda *_: None)
        return {"s": time.perf_counter() - t0, "prompts": len(rows)}

    def op_forced(self, length: int, forced: list, path: str) -> dict:
        """Last-position logits after the prompt, then after each forced token (teacher forcing); saved to
        ``path`` (float32 [len(forced) + 1, vocab])."""
        ids = self.prompt(length)[0]
        n = len(ids) + len(forced) + 1
        g = self.generator(1, n, 0)
        g.append_tokens(ids)
        rows = [_last(g.get_logits())]
        for t in forced:
            g.append_tokens(np.asarray([t], dtype=np.int32))
            rows.append(_last(g.get_logits()))
        a = np.stack(rows)
        np.save(path, a)
        return {"path": path, "finite": bool(np.isfinite(a).all()), "max_abs_logit": float(np.nanmax(np.abs(a)))}

    def op_reference(self, length: int, n_new: int, steps: int, path: str) -> dict:
        """Greedy ``n_new`` tokens; the logits behind the first ``steps`` + 1 of them saved to ``path``.

        genai computes a step's logits when they are first asked for (``get_logits``, else in the next
        ``generate_next_token``): read after the prompt they give token 0, read after token i they give i + 1."""
        ids = self.prompt(length)[0]
        g = self.generator(1, length + n_new, length + n_new)
        t0 = time.perf_counter()
        g.append_tokens(ids)
        toks, rows = [], [_last(g.get_logits())]
        for i in range(n_new):
            g.generate_next_token()
            toks.append(int(g.get_next_tokens()[0]))
            if i < steps:
                rows.append(_last(g.get_logits()))
        a = np.stack(rows)
        argmax_off = sum(int(np.argmax(r)) != t for r, t in zip(rows, toks))
        np.save(path, a)
        return {"path": path, "tokens": toks, "finite": bool(np.isfinite(a).all()),
                "argmax_not_token": argmax_off, "seconds": time.perf_counter() - t0}


def _last(x) -> np.ndarray:
    x = np.asarray(x)
    return np.array(x.reshape(-1, x.shape[-1])[-1], dtype=np.float32)


def _finite(logits, where: str) -> float:
    x = np.asarray(logits, dtype=np.float32)
    bad = ~np.isfinite(x)
    if bad.any():
        raise FloatingPointError(f"non-finite logits {where}: {int(np.isnan(x).sum())} NaN, "
                                 f"{int(np.isinf(x).sum())} inf of {x.size}")
    return float(np.abs(x).max())


def worker_main(spec: dict) -> int:
    """Answer the parent's JSON commands (stdin) with one JSON line each on the original stdout; everything
    else the libraries print goes to stderr (the parent's log)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    print(f"--- worker {spec['kind']} {spec['dir']} pid {os.getpid()}", flush=True)
    parent = os.getppid()

    def orphaned():                     # the parent killed: end (the GPU memory is freed with the process)
        while True:
            time.sleep(2.0)
            if os.getppid() != parent:
                os._exit(3)
    import threading
    threading.Thread(target=orphaned, daemon=True).start()
    eng = Engine(spec)
    # testing the harness: BENCH_LLM_FAULT=op:kind:hang|crash (kind empty: every engine)
    fault = os.environ.get("BENCH_LLM_FAULT", "").split(":") if os.environ.get("BENCH_LLM_FAULT") else None
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        t0 = time.perf_counter()
        if fault and fault[0] == cmd["op"] and fault[1] in ("", spec["kind"]):
            if fault[2] == "hang":
                time.sleep(1e6)
            elif fault[2] == "crash":
                os.kill(os.getpid(), 9)
        try:
            res = {"ok": True, **getattr(eng, "op_" + cmd["op"])(**cmd.get("args", {}))}
        except Exception as e:  # noqa: BLE001 - every failure goes back as one line
            traceback.print_exc()
            res = {"ok": False, "error": one_line(e)}
        res["op_s"] = time.perf_counter() - t0
        proto.write(json.dumps(res) + "\n")
        proto.flush()
    return 0


def one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}"[:300]


# =============================================================================================== parent side
class WorkerError(Exception):
    pass


class Worker:
    """A worker process for one engine; ``call`` sends one op and waits at most ``limit`` seconds."""

    def __init__(self, spec: dict, log, env: dict):
        self.spec = spec
        self.log = log
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, cwd=ROOT)
        self.buf = b""

    def call(self, op: str, limit: float, **args) -> dict:
        if self.p.poll() is not None:
            raise WorkerError(f"worker exited (rc={self.p.returncode})")
        try:
            self.p.stdin.write((json.dumps({"op": op, "args": args}) + "\n").encode())
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerError(f"worker gone (rc={self.p.poll()})") from None
        deadline = time.monotonic() + max(limit, 1.0)
        fd = self.p.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerError(f"timed out after {limit:.0f} s (worker killed)")
            r, _, _ = select.select([fd], [], [], min(left, 5.0))
            if not r:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                rc = self.p.wait()
                raise WorkerError(f"worker died (rc={rc}{', signal ' + str(-rc) if rc < 0 else ''})")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        res = json.loads(line)
        if not res.get("ok"):
            raise WorkerError(res.get("error", "failed"))
        return res

    def alive(self) -> bool:
        return self.p.poll() is None

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def close(self, grace: float = 5.0) -> None:
        """Ask the worker to quit (it answers between ops), killed after ``grace`` seconds."""
        if self.p.poll() is None and grace > 0:
            try:
                self.p.stdin.write(b'{"op": "quit"}\n')
                self.p.stdin.flush()
                self.p.wait(timeout=grace)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


class Budget:
    def __init__(self, seconds: float):
        self.t0 = time.monotonic()
        self.seconds = seconds
        self.call_cap = float("inf")

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0) - RESERVE

    def limit(self, cap: float) -> float:
        return max(0.0, min(cap, self.left(), self.call_cap))


def run_limited(cmd: list, limit: float, log, env: dict) -> tuple[int, str, float]:
    """(rc, stdout, seconds) of ``cmd`` run at most ``limit`` seconds (killed past it)."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, cwd=ROOT, text=True)
    try:
        out, _ = p.communicate(timeout=max(limit, 1.0))
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        return -9, out or "", time.monotonic() - t0
    return p.returncode, out, time.monotonic() - t0


class Bench:
    def __init__(self, args, cfg: dict):
        self.args = args
        self.cfg = cfg
        self.budget = Budget(args.time_budget)
        if args.call_limit:
            self.budget.call_cap = args.call_limit
        self.smoke = args.smoke
        self.log_path = args.log or (os.path.splitext(args.json)[0] + ".log" if args.json else
                                     os.path.join(tempfile.gettempdir(), "bench_llm.log"))
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self.log = open(self.log_path, "a", buffering=1)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env["PYTHONPATH"] = os.pathsep.join([_ortmlx_home()] + [p for p in os.environ.get("PYTHONPATH", "").split(
            os.pathsep) if p])
        self.tmp = tempfile.mkdtemp(prefix="bench_llm.")
        self.engines = [e for e in args.engines.split(",") if e]
        self.only = [c for c in args.only.split(",") if c]
        self.labels = ({"cuda": "ORT CPU", "cuda_graph": "ORT CPU (graph cfg)", "mlx": "MLX EP (cpu)"} if self.smoke
                       else {"cuda": "ORT CUDA", "cuda_graph": "ORT CUDA graph", "mlx": "MLX EP"})
        self.res = {"meta": self.meta(), "models": {}}
        self.workers: dict = {}
        self.used: dict = {}                # engine -> its worker ran a case op (not only its check)

    # ------------------------------------------------------------------ output
    def meta(self) -> dict:
        import platform
        m = {"argv": sys.argv[1:], "smoke": self.smoke, "python": platform.python_version(),
             "host": platform.node(), "cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
             "config": self.cfg, "engines": {e: self.labels[e] for e in self.engines}}
        try:
            r = subprocess.run(["git", "-C", ROOT, "log", "-1", "--format=%h %s"], capture_output=True, text=True,
                               timeout=10)
            m["commit"] = r.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            m["gpu"] = r.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            m["gpu"] = None
        return m

    def save(self) -> None:
        self.res["meta"]["elapsed_s"] = round(time.monotonic() - self.budget.t0, 1)
        if not self.args.json:
            return
        path = os.path.abspath(self.args.json)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(self.res, f, indent=1, default=_jsonable)
        os.replace(path + ".tmp", path)

    def say(self, msg: str) -> None:
        print(msg, flush=True)
        self.log.write(f"[bench_llm {time.strftime('%H:%M:%S')}] {msg}\n")

    def fail(self, M: dict, what: str, err: str) -> None:
        line = f"{what}: {err}"
        M["errors"].append(line)
        self.say(f"  !! {M['name']} {line}")

    # ------------------------------------------------------------------ workers
    def worker(self, M: dict, engine: str) -> Worker | None:
        """The engine's worker for this model, started (loaded, logits checked) if it is not alive."""
        w = self.workers.get(engine)
        if w is not None and w.alive():
            return w
        if engine in M["dead"]:
            return None
        if M["fails"].get(engine, 0) >= 3:
            M["dead"][engine] = "its worker died or timed out three times"
            return None
        starts = M["starts"].get(engine, 0)
        M["starts"][engine] = starts + 1
        w = Worker(self.spec(M, engine), self.log, self.env)
        E = M["engines"].setdefault(engine, {})
        try:
            E["load"] = w.call("load", self.budget.limit(LIMITS["load"]))
            c = self.cfg
            chk = w.call("check", self.budget.limit(LIMITS["check"]), length=c["check_prompt"],
                         n_new=c["check_tokens"], max_len=M["prefill_max_len"])
            E.setdefault("check", chk)
            E["check"]["starts"] = starts + 1
        except WorkerError as e:
            w.kill()
            what = "load" if "load" not in E or not E["load"].get("ok") else "correctness check (finite logits)"
            M["dead"][engine] = f"{what}: {e}"
            self.fail(M, f"{engine} {what}", str(e))
            return None
        if E["load"].get("device_warning"):
            self.fail(M, f"{engine} device", E["load"]["device_warning"])
        f, s = chk["first"], chk["warm"]
        self.say(f"  [{M['name']}] {engine}: loaded in {E['load']['load_s']:.1f} s ({E['load'].get('device_type')}"
                 f"{', ' + E['load']['partition'] if 'partition' in E['load'] else ''}); logits finite (max |logit| "
                 f"{max(f['max_abs_logit'], s['max_abs_logit']):.1f}); first generation {f['total_s']:.2f} s, "
                 f"warm {s['total_s']:.3f} s")
        self.workers[engine] = w
        self.used[engine] = False
        return w

    def spec(self, M: dict, kind: str, extra: dict | None = None) -> dict:
        """A worker's spec: the engine, its model folder, the MLX options (--mlx-option, then ``extra``)."""
        return {"kind": kind, "dir": M["dirs"][kind], "smoke": self.smoke, "mlx_device": self.args.mlx_device,
                "mlx_options": {**dict(kv.split("=", 1) for kv in self.args.mlx_option), **(extra or {})}}

    def fresh(self, M: dict) -> None:
        """Workers that ran more than their check are ended: the next case starts each engine again, loaded
        and after one generation (the stall and prefill cases' first calls at a length are then cold whatever
        ran before them, e.g. the MLX EP's prefill buckets)."""
        for e in [e for e, u in self.used.items() if u and e in self.workers]:
            self.workers.pop(e).close()

    def drop_workers(self, grace: float = 5.0) -> None:
        for w in self.workers.values():
            w.close(grace)
        self.workers = {}

    def ecall(self, M: dict, engine: str, case: str, op: str, cap: float, restart: bool = True,
              **args) -> dict | None:
        """One engine call of a case; a failure is recorded (one line) and answered with None. ``restart``
        False: None when the engine's worker died earlier in the case (a fresh one would be cold again)."""
        if not restart and not (engine in self.workers and self.workers[engine].alive()):
            return None
        w = self.worker(M, engine)
        if w is None:
            return None
        lim = self.budget.limit(cap)
        if lim < 1.0:
            self.fail(M, f"{case} {engine}", "no time left in the budget")
            return None
        self.used[engine] = True
        try:
            return w.call(op, lim, **args)
        except WorkerError as e:
            self.fail(M, f"{case} {engine} ({op} {_short(args)})", str(e))
            if not w.alive():
                self.workers.pop(engine, None)
                M["fails"][engine] = M["fails"].get(engine, 0) + 1
            return None

    # ------------------------------------------------------------------ estimates
    def speed(self, M: dict, engine: str) -> tuple[float, float, float]:
        """(warm TTFT s at the check's prompt, s per decode token, s a call at a new shape costs over a warm
        one: the stall case's median when it ran, else the first generation's extra, at most NEW_SHAPE_S:
        that one also paid the process's one-off costs, e.g. MLX's CUDA kernel JIT, minutes on a fresh host)."""
        chk = M["engines"].get(engine, {}).get("check")
        if not chk:
            return 0.05, 0.02, NEW_SHAPE_S          # (not loaded yet: the worker's start is estimated apart)
        f, s = chk["first"], chk["warm"]
        ttft = s["ttft_ms"] / 1e3
        tok = s["decode_s"] / max(1, s["tokens_out"] - 1)
        st = M.get("stall", {}).get(engine)
        if st:
            new = statistics.median(max(0.0, a - b) for a, b in zip(st["first_ms"], st["warm_ms"])) / 1e3
        else:
            new = min(NEW_SHAPE_S, max(0.0, f["total_s"] - s["total_s"]))
        return ttft, tok, new

    def estimate(self, M: dict, case: str) -> float:
        """Seconds the case would take on every live engine (from each one's check and the stall case)."""
        c, total = self.cfg, 0.0
        for e in self.live(M):
            ttft, tok, new = self.speed(M, e)
            E = M["engines"].get(e, {})
            if e not in self.workers or (case in ("stall", "prefill") and self.used.get(e)):
                # started (again): its load and check (the first start's also paid one-off costs, e.g. JIT)
                total += 5.0 + E.get("load", {}).get("load_s", 10.0) + \
                    min(20.0, E.get("check", {}).get("first", {}).get("total_s", 20.0))
            L0 = c["check_prompt"]

            def tt(L, B=1):
                return ttft * (0.3 + 0.7 * L * B / L0)
            if case == "cold":      # a new process each, every kernel built again (as the check's first generation:
                #                     a fresh host's; the MLX EP's eager run on top)
                f = E.get("check", {}).get("first", {}).get("total_s", 20.0)
                total += 5.0 + E.get("load", {}).get("load_s", 10.0) + (f + 30.0 if e == "mlx" else f)
            elif case == "stall":
                total += sum(new + (1 + c["reps"]) * tt(L) for L in M["stall_lens"])
                if e == "mlx" and self.args.stall_warmup:      # a prompt per bucket (16, 32, ...), each new
                    total += max(M["stall_lens"]).bit_length() * (new + tt(max(M["stall_lens"])) / 2)
            elif case == "prefill":
                total += sum(new + (1 + c["reps"]) * tt(L) for L in M["prefill_lens"])
            elif case == "decode":
                total += new + (c["rounds"] + 1) * (tt(c["prompt"]) + c["new_tokens"] * tok)
            elif case == "batch":
                total += sum(new + (c["rounds"] + 1) * (tt(c["prompt"], B) + c["new_tokens"] * tok * (1 + B / 8))
                             for B in c["batches"])
            elif case == "accuracy":
                total += 2 * new + 2 * tt(c["prompt"]) + (3 * c["acc_steps"] + c["new_tokens"]) * tok
            elif case == "host" and e == "mlx":
                total += 20.0 + 2 * new + 2 * c["host_tokens"] * tok * 2
        if case == "accuracy" and not _ref_cached(M, c):
            total += 20.0 if self.smoke else 90.0   # the fp32 reference on ORT's CPU EP
        return total

    # ------------------------------------------------------------------ models
    def build(self, M: dict, size: str, precision: str) -> bool:
        py = sys.executable
        prune = self.args.prune_lm_head
        jobs = [("model", B.gqa_dir(size, precision, prune=prune),
                 [py, os.path.join(HERE, "bench_models.py"), "--size", size, "--precision", precision]
                 + (["--prune-lm-head"] if prune else []))]
        if "accuracy" in self.only:
            jobs.append(("reference", B.out_dir("qwen2", size, "fp32"),
                         [py, os.path.join(ROOT, "models", "build_llm.py"), "--arch", "qwen2", "--precision", "fp32",
                          "--size", size]))
        ok = True
        for what, d, cmd in jobs:
            if B._is_built(d, B.fingerprint("qwen2", size)):                        # cached: no process (its imports take seconds)
                M["build"][what] = self.built(M, what, d, 0.0, True)
                continue
            lim = self.budget.limit(LIMITS["build"])
            if lim < 5:
                self.fail(M, f"build {what}", "no time left in the budget")
                ok = ok and what != "model"
                continue
            rc, out, secs = run_limited(cmd, lim, self.log, self.env)
            if rc != 0 or not B._is_built(d, B.fingerprint("qwen2", size)):
                self.fail(M, f"build {what}", f"rc={rc} after {secs:.0f} s (see {self.log_path})")
                ok = ok and what != "model"
                continue
            M["build"][what] = self.built(M, what, d, secs, False)
        return ok

    def built(self, M: dict, what: str, d: str, secs: float, cached: bool) -> dict:
        try:
            with open(os.path.join(d, B.MARKER)) as f:
                built_s = json.load(f).get("seconds")
        except (OSError, ValueError):
            built_s = None
        r = {"dir": d, "wall_s": round(secs, 1), "build_s": built_s, "cached": cached,
             "weights_mb": round(_weight_bytes(d) / 1e6, 1)}
        self.say(f"  [{M['name']}] {what} {d}: {'cached; ' if cached else ''}built in {_f(built_s)} s"
                 f"{'' if cached else f' (the step with its imports {secs:.1f} s)'}, weights {r['weights_mb']:.1f} MB")
        return r

    def variants(self, M: dict) -> None:
        """Each engine's model folder: the build, its CUDA-graph copy; with --smoke, CPU EP copies."""
        src = M["build"]["model"]["dir"]
        g = src + "-cuda-graph"                      # (next to it: the same file system, so hard links)
        copy_model(src, g, {"model": {"decoder": {"session_options": {
            "provider_options": [{"cuda": {"enable_cuda_graph": "1"}}]}}}}, strip_value_info=self.smoke)
        M["dirs"] = {"mlx": src, "cuda_graph": g, "cuda": src}
        if self.smoke:
            M["dirs"]["cuda"] = copy_model(src, src + "-cpu-ep", None, strip_value_info=True)
        if "reference" in M["build"]:
            M["dirs"]["ref"] = M["build"]["reference"]["dir"]

    def run_model(self, size: str, precision: str) -> None:
        name = f"qwen2-{size}-{precision}" + ("-prune" if self.args.prune_lm_head else "")
        M = self.res["models"][name] = {"name": name, "build": {}, "engines": {}, "errors": [], "skipped": [],
                                        "dead": {}, "starts": {}, "fails": {}}
        self.say(f"\n== {name} ({self.budget.left():.0f} s of the budget left)")
        try:
            if not self.build(M, size, precision) or self.args.build_only:
                return
            self.variants(M)
            c = self.cfg
            ctx = _context_length(M["dirs"]["mlx"])
            M["context_length"] = ctx
            M["prefill_lens"] = [L for L in c["prefill"] if L + 1 <= ctx]
            for L in c["prefill"]:
                if L + 1 > ctx:
                    self.fail(M, f"prefill {L}", f"longer than the model's context ({ctx})")
            hi = min(c["stall_max"], ctx - 2)
            M["stall_lens"] = random.Random(1234).sample(range(8, hi + 1), min(c["stall_n"], hi - 7))
            M["prefill_max_len"] = min(ctx, max(M["prefill_lens"] + [c["stall_max"], c["check_prompt"]]) + 8)
            M["decode_max_len"] = max(c.get("decode_max_len") or 0, c["prompt"] + c["new_tokens"])
            if M["decode_max_len"] > ctx:
                self.fail(M, "decode", f"max_length {M['decode_max_len']} exceeds the context ({ctx})")
            self.save()
            for e in self.engines:                  # load + correctness of every engine before any timing
                self.worker(M, e)
                self.save()
            for case in CASES:
                if case not in self.only:
                    continue
                est, left = self.estimate(M, case), self.budget.left()
                if est > left:
                    M["skipped"].append(f"{case}: needs ~{est:.0f} s, {left:.0f} s left")
                    self.say(f"  [{name}] {case}: skipped (needs ~{est:.0f} s, {left:.0f} s left)")
                    continue
                t0 = time.monotonic()
                if case in ("stall", "prefill"):
                    self.fresh(M)
                try:
                    getattr(self, "case_" + case)(M)
                except Exception as e:  # noqa: BLE001 - a bug in one case must not lose the others
                    self.fail(M, case, f"harness error {one_line(e)}")
                    traceback.print_exc(file=self.log)
                M.setdefault("case_s", {})[case] = round(time.monotonic() - t0, 1)
                self.save()
        finally:
            self.drop_workers()
            self.save()
            print_table(self, M)

    # ------------------------------------------------------------------ cases
    def live(self, M: dict) -> list:
        return [e for e in self.engines if e not in M["dead"]]

    def case_cold(self, M: dict) -> None:
        """Each engine in a process of its own with empty kernel caches: start to first token, and to the 16th."""
        c, out = self.cfg, M.setdefault("cold", {})
        n_new = 16
        runs = [(e, e, {}) for e in self.live(M)]
        if any(e == "mlx" for e, _, _ in runs):
            runs += [(f"mlx_{v}", "mlx", COLD_VARIANTS[v]) for v in self.args.cold_variants.split(",") if v]
        roots = {}
        for name, kind, extra in runs:
            reuse = roots.get("mlx") if name == "mlx_rerun" else None
            root = roots[name] = reuse or tempfile.mkdtemp(prefix=f"cold-{name}.", dir=self.tmp)
            env = dict(self.env)
            for var in ("MLX_PTX_CACHE_DIR", "CUDA_CACHE_PATH", "TMPDIR"):
                env[var] = os.path.join(root, var.lower())
                os.makedirs(env[var], exist_ok=reuse is not None)
            lim = self.budget.limit(LIMITS["cold"])
            if lim < 5:
                self.fail(M, f"cold {name}", "no time left in the budget")
                continue
            warmup_s = None
            if name == "mlx_warmed":     # the kernel cache filled ahead by `ortmlx warmup` (as at install)
                cmd = [sys.executable, "-m", "ortmlx", "warmup", M["dirs"]["mlx"], "--max-length",
                       str(M["decode_max_len"]), "--up-to", str(c["prompt"]), "--device", self.args.mlx_device]
                cmd += [f"--option={kv}" for kv in self.args.mlx_option]
                rc, _, warmup_s = run_limited(cmd, lim, self.log, env)
                if rc != 0:
                    self.fail(M, f"cold {name}", f"ortmlx warmup exited {rc} after {warmup_s:.1f} s")
                    continue
                lim = self.budget.limit(LIMITS["cold"])
            t0 = time.monotonic()
            w = Worker(self.spec(M, kind, extra), self.log, env)
            try:
                load = w.call("load", lim)
                t1 = time.monotonic()
                r = w.call("cold", max(1.0, lim - (t1 - t0)), length=c["prompt"], n_new=n_new,
                           max_len=M["decode_max_len"], window_s=self.args.cold_window)
            except WorkerError as e:
                self.fail(M, f"cold {name}", str(e))
                continue
            finally:
                w.close()
            first = (t1 - t0) + r["generator_ms"] / 1e3 + r["ttft_ms"] / 1e3
            out[name] = {"start_to_loaded_s": t1 - t0, "load_s": load["load_s"], "ttft_ms": r["ttft_ms"],
                         "start_to_first_token_s": first, "start_to_last_token_s": (t1 - t0) + r["total_s"],
                         "tokens": r["tokens_out"], "kernel_files": r["kernel_files"], "warmup_s": warmup_s,
                         "window": r.get("window")}
            ahead = "" if warmup_s is None else f" after `ortmlx warmup` ({warmup_s:.1f} s)"
            self.say(f"  [{M['name']}] cold {name}{ahead}: process start to first token {first:.2f} s (loaded after "
                     f"{t1 - t0:.1f} s, TTFT {r['ttft_ms'] / 1e3:.2f} s), to token {r['tokens_out']} "
                     f"{out[name]['start_to_last_token_s']:.2f} s; kernel files written: {r['kernel_files']}")
            win = r.get("window")
            if win:
                per = "-" if win["last_ms_per_token"] is None else f"{win['last_ms_per_token']:.2f} ms"
                self.say(f"  [{M['name']}] cold {name}: {win['tokens']} tokens in the {win['s']:.1f} s after the load, "
                         f"the last generation's {per} a token")

    def case_stall(self, M: dict) -> None:
        c, out = self.cfg, M.setdefault("stall", {})
        lens, ml = M["stall_lens"], M["prefill_max_len"]
        for e in self.live(M):
            first, warmup = [], None
            t0 = time.monotonic()
            if e == "mlx" and self.args.stall_warmup:
                warmup = self.ecall(M, e, "stall", "warmup", LIMITS["stall"], max_len=ml, up_to=max(lens))
                if warmup is None:
                    continue
                self.say(f"  [{M['name']}] stall {e}: warm-up {warmup['s']:.1f} s ({warmup['prompts']} prompts)")
            for L in lens:                                   # first calls, in the drawn order
                r = self.ecall(M, e, "stall", "ttft", LIMITS["stall"], restart=not first, length=L, max_len=ml,
                               reps=0)
                if r is None:
                    break
                first.append(r["ms"][0])
            warm = []
            for L in lens[:len(first)]:                      # then the warm time at each length
                r = self.ecall(M, e, "stall", "ttft", LIMITS["stall"], restart=False, length=L, max_len=ml,
                               reps=c["reps"] - 1)
                if r is None:
                    break
                warm.append(min(r["ms"]))
            n = len(warm)
            if not n:
                continue
            ratios = [f / w for f, w in zip(first, warm)]
            k = max(range(n), key=lambda i: ratios[i])
            out[e] = {"lengths": lens[:n], "first_ms": first[:n], "warm_ms": warm, "ratios": ratios,
                      "worst_ratio": ratios[k], "worst_length": lens[k], "worst_first_ms": first[k],
                      "median_ratio": statistics.median(ratios), "complete": n == len(lens),
                      "warmup_s": warmup["s"] if warmup else None}
            self.say(f"  [{M['name']}] stall {e}: slowest first call {ratios[k]:.1f}x its warm TTFT (length "
                     f"{lens[k]}: {first[k]:.1f} vs {warm[k]:.1f} ms), median {statistics.median(ratios):.2f}x, "
                     f"{n} lengths ({time.monotonic() - t0:.1f} s)")
            over = [f"{L}: {f:.1f} / {w:.1f}" for L, f, w, r in zip(lens, first, warm, ratios) if r > 2]
            if over:
                self.say(f"  [{M['name']}] stall {e}: over 2x (length: first / warm ms): {'; '.join(over)}")

    def case_prefill(self, M: dict) -> None:
        c, out = self.cfg, M.setdefault("prefill", {})
        for L in M["prefill_lens"]:
            for e in self.live(M):
                r = self.ecall(M, e, "prefill", "ttft", LIMITS["prefill"], length=L, max_len=M["prefill_max_len"],
                               reps=c["reps"])
                if r is None:
                    continue
                cold, warm = r["ms"][0], statistics.median(r["ms"][1:])
                out.setdefault(e, {})[str(L)] = {"cold_ms": cold, "warm_ms": warm, "warm_all_ms": r["ms"][1:],
                                                 "cold_over_warm": cold / warm, "cold_was_warm": r["first_was_warm"]}
            self.say(f"  [{M['name']}] prefill {L}: " + ", ".join(
                f"{e} {out[e][str(L)]['warm_ms']:.1f} ms warm / {out[e][str(L)]['cold_ms']:.1f} cold"
                for e in self.live(M) if str(L) in out.get(e, {})))

    def case_decode(self, M: dict) -> None:
        c, out = self.cfg, M.setdefault("decode", {})
        args = dict(length=c["prompt"], n_new=c["new_tokens"], max_len=M["decode_max_len"], keep_tokens=True)
        for e in self.live(M):                                  # warm-up at these shapes
            r = self.ecall(M, e, "decode", "gen", LIMITS["decode"], **args)
            if r is not None:
                out[e] = {"cold": _gen_row(r), "rounds": [], "tokens": r["tokens"]}
        for rnd in range(c["rounds"]):
            for e in _rotate(self.live(M), rnd):
                if e not in out:
                    continue
                r = self.ecall(M, e, "decode", "gen", LIMITS["decode"], restart=False, **args)
                if r is not None:
                    out[e]["rounds"].append(_gen_row(r))
        for e, d in out.items():
            if d["rounds"]:
                d["tps"] = statistics.median(x["tps"] for x in d["rounds"])
                d["ttft_ms"] = statistics.median(x["ttft_ms"] for x in d["rounds"])
        self.say(f"  [{M['name']}] decode (batch 1, {c['new_tokens']} tokens): " + ", ".join(
            f"{e} {d['tps']:.1f} tok/s" for e, d in out.items() if "tps" in d))

    def case_batch(self, M: dict) -> None:
        c, out = self.cfg, M.setdefault("batch", {})
        for nb in c["batches"]:
            args = dict(length=c["prompt"], n_new=c["new_tokens"], max_len=M["decode_max_len"], batch=nb)
            for e in self.live(M):
                r = self.ecall(M, e, "batch", "gen", LIMITS["batch"], **args)
                if r is not None:
                    out.setdefault(e, {})[str(nb)] = {"cold": _gen_row(r), "rounds": []}
            for rnd in range(c["rounds"]):
                for e in _rotate(self.live(M), rnd):
                    if str(nb) not in out.get(e, {}):
                        continue
                    r = self.ecall(M, e, "batch", "gen", LIMITS["batch"], restart=False, **args)
                    if r is not None:
                        out[e][str(nb)]["rounds"].append(_gen_row(r))
            for e in out:
                d = out[e].get(str(nb))
                if d and d["rounds"]:
                    d["agg_tps"] = statistics.median(x["tps"] for x in d["rounds"])
                    d["ttft_ms"] = statistics.median(x["ttft_ms"] for x in d["rounds"])
            self.say(f"  [{M['name']}] batch {nb}: " + ", ".join(
                f"{e} {out[e][str(nb)]['agg_tps']:.1f} tok/s" for e in out if "agg_tps" in out[e].get(str(nb), {})))

    def case_accuracy(self, M: dict) -> None:
        c, out = self.cfg, M.setdefault("accuracy", {})
        P, N, K = c["prompt"], c["new_tokens"], c["acc_steps"]
        ref = self.reference(M) if "ref" in M["dirs"] else None
        if "ref" not in M["dirs"]:
            self.fail(M, "accuracy", "no fp32 reference build: logit errors not measured")
        if ref is not None:
            out["ref"] = {k: ref[k] for k in ("tokens", "seconds", "finite", "argmax_not_token", "cached")}
            out["ref"]["dir"] = M["dirs"]["ref"]
            if ref["argmax_not_token"]:
                self.fail(M, "accuracy ref", f"{ref['argmax_not_token']} steps' logits do not give the token "
                          "chosen (the logits read are not those of the step)")
        R = np.load(ref["path"]) if ref else None
        forced = ref["tokens"][:K] if ref else None
        logits = {}
        for e in self.live(M):
            g = self.ecall(M, e, "accuracy", "gen", LIMITS["accuracy"], length=P, n_new=N, max_len=P + N,
                           keep_tokens=True)
            d = out.setdefault(e, {})
            if g is not None:
                d["tokens"] = g["tokens"]
            if ref is not None:
                f = self.ecall(M, e, "accuracy", "forced", LIMITS["accuracy"], length=P, forced=forced,
                               path=os.path.join(self.tmp, f"{M['name']}-{e}-forced.npy"))
                if f is not None:
                    logits[e] = np.load(f["path"])
                    d.update(_logit_errors(R, logits[e]))
                    d["finite"] = f["finite"]
        base = out.get("cuda", {}).get("tokens") or M.get("decode", {}).get("cuda", {}).get("tokens")
        for e in self.live(M):
            d = out.get(e, {})
            toks = d.get("tokens") or M.get("decode", {}).get(e, {}).get("tokens")
            if toks and base and e != "cuda":
                d["first_mismatch_vs_cuda"] = _first_mismatch(toks, base)
            if toks and ref:
                d["first_mismatch_vs_ref"] = _first_mismatch(toks, ref["tokens"])
            if e != "cuda" and "cuda" in logits and e in logits:
                d["max_abs_vs_cuda"] = float(np.max(np.abs(logits[e] - logits["cuda"])))
        self.say(f"  [{M['name']}] accuracy: " + "; ".join(
            f"{e}: tokens == CUDA for {_fm(out[e].get('first_mismatch_vs_cuda'), N)}, == fp32 for "
            f"{_fm(out[e].get('first_mismatch_vs_ref'), N)}, max |logit - fp32| {_f(out[e].get('max_abs_err'), '.3g')}"
            for e in self.live(M) if e in out))

    def reference(self, M: dict) -> dict | None:
        """The fp32 reference's greedy tokens and first logits (ORT's CPU EP), kept next to its build
        (_ref_cache) for the other precision and later runs: it depends only on the checkpoint and the sizes."""
        path = _ref_cache(M, self.cfg)
        if os.path.exists(path):
            try:
                z = np.load(path)
                np.save(os.path.join(self.tmp, M["name"] + "-ref.npy"), z["logits"])
                return {"tokens": [int(t) for t in z["tokens"]], "seconds": float(z["seconds"]), "finite": True,
                        "argmax_not_token": int(z["argmax_not_token"]), "cached": True,
                        "path": os.path.join(self.tmp, M["name"] + "-ref.npy")}
            except (OSError, ValueError, KeyError):
                pass
        c = self.cfg
        w = Worker({"kind": "ref", "dir": M["dirs"]["ref"], "smoke": self.smoke, "mlx_device": "cpu"}, self.log,
                   self.env)
        try:
            w.call("load", self.budget.limit(LIMITS["load"]))
            ref = w.call("reference", self.budget.limit(LIMITS["ref"]), length=c["prompt"], n_new=c["new_tokens"],
                         steps=c["acc_steps"], path=os.path.join(self.tmp, M["name"] + "-ref.npy"))
        except WorkerError as e:
            self.fail(M, "accuracy ref (fp32 on ORT's CPU EP)", str(e))
            return None
        finally:
            w.close()
        ref["cached"] = False
        if ref["finite"]:
            np.savez(path + ".tmp.npz", logits=np.load(ref["path"]), tokens=np.asarray(ref["tokens"]),
                     seconds=ref["seconds"], argmax_not_token=ref["argmax_not_token"])
            os.replace(path + ".tmp.npz", path)
        return ref

    def case_host(self, M: dict) -> None:
        if "mlx" not in self.live(M):
            return
        opts = ["--option=device=" + self.args.mlx_device] + [f"--option={kv}" for kv in self.args.mlx_option]
        cmd = [sys.executable, os.path.join(HERE, "step_probe.py"), M["dirs"]["mlx"], "--tokens",
               str(self.cfg["host_tokens"]), "--child", "1"] + opts
        M["host_command"] = " ".join(["python3", "scripts/step_probe.py", M["dirs"]["mlx"], "--tokens", "96",
                                      "--rounds", "3"] + opts)
        lim = self.budget.limit(LIMITS["host"])
        rc, out, secs = run_limited(cmd, lim, self.log, self.env)
        if rc != 0:
            self.fail(M, "host (step_probe)", f"rc={rc} after {secs:.0f} s; run: {M['host_command']}")
            return
        sys.path.insert(0, HERE)
        import step_probe
        ms = json.loads(out.strip().splitlines()[-1])["ms"]
        own = step_probe.ep_python(ms)
        M["host"] = {"token_ms": ms["token"], "ep_python_ms": own, "ep_python_share": own / ms["token"],
                     "outside_compute_ms": ms.get("outside_compute"), "stages_ms": ms, "seconds": round(secs, 1)}
        self.say(f"  [{M['name']}] host: MLX EP Python {own:.3f} ms of a {ms['token']:.3f} ms token "
                 f"({100 * own / ms['token']:.1f}%; step_probe's timers on, {secs:.0f} s); more: {M['host_command']}")


def _ref_cache(M: dict, c: dict) -> str:
    return os.path.join(M["dirs"]["ref"], f".bench_ref-p{c['prompt']}-n{c['new_tokens']}-k{c['acc_steps']}.npz")


def _ref_cached(M: dict, c: dict) -> bool:
    return "ref" in M.get("dirs", {}) and os.path.exists(_ref_cache(M, c))


def _rotate(xs: list, k: int) -> list:
    k %= max(1, len(xs))
    return xs[k:] + xs[:k]


def _gen_row(r: dict) -> dict:
    return {k: r[k] for k in ("ttft_ms", "tps", "decode_s", "tokens_out", "generator_ms", "warm") if k in r}


def _first_mismatch(a: list, b: list) -> int | None:
    """Index of the first differing token (None: equal over the shorter)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def _logit_errors(ref: np.ndarray, got: np.ndarray) -> dict:
    n = min(len(ref), len(got))
    diff = np.abs(ref[:n] - got[:n])
    per = diff.max(axis=1)
    top1 = int(sum(int(np.argmax(ref[i])) == int(np.argmax(got[i])) for i in range(n)))
    return {"max_abs_err": float(per.max()), "max_abs_err_per_step": [float(x) for x in per],
            "mean_abs_err": float(diff.mean()), "ref_max_abs_logit": float(np.abs(ref[:n]).max()),
            "top1_equal": top1, "steps": n}


def _fm(i, n) -> str:
    return f"all {n}" if i is None else f"{i} tokens"


def _f(x, fmt: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _short(args: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in args.items() if not isinstance(v, (list, dict)) and k != "path")


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def _weight_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if ".onnx" in f)


def _context_length(d: str) -> int:
    with open(os.path.join(d, "genai_config.json")) as f:
        return int(json.load(f)["model"]["context_length"])


def copy_model(src: str, dst: str, config_update: dict | None, strip_value_info: bool = False) -> str:
    """A copy of a genai model folder (files hard-linked where possible: ORT refuses external data outside the
    model's folder, so no symlinks), genai_config.json deep-merged with ``config_update`` (lists replaced)."""
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    for f in os.listdir(src):
        s, t = os.path.join(src, f), os.path.join(dst, f)
        if not os.path.isfile(s) or f == "genai_config.json" or (strip_value_info and f.endswith(".onnx")):
            continue
        try:
            os.link(s, t)
        except OSError:
            shutil.copy2(s, t)
    with open(os.path.join(src, "genai_config.json")) as f:
        cfg = json.load(f)
    _merge(cfg, config_update or {})
    with open(os.path.join(dst, "genai_config.json"), "w") as f:
        json.dump(cfg, f, indent=4)
    if strip_value_info:                # the builder's fp16 graphs carry shapes ORT's CPU EP rejects
        import onnx
        for f in os.listdir(src):
            if f.endswith(".onnx"):
                m = onnx.load(os.path.join(src, f), load_external_data=False)
                del m.graph.value_info[:]
                onnx.save(m, os.path.join(dst, f))
    return dst


def _merge(base: dict, upd: dict) -> None:
    for k, v in upd.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


# =============================================================================================== the table
def print_table(b: Bench, M: dict) -> None:
    engines = [e for e in b.engines]
    lab = b.labels
    rows: list[tuple[str, list, str]] = []           # (label, values per engine, unit/direction)

    def add(label, vals, unit, fmt=".1f"):
        rows.append((label, vals, unit, fmt))
    E = M.get("engines", {})
    add("load s", [E.get(e, {}).get("load", {}).get("load_s") for e in engines], "s", ".1f")
    add("first generation s", [E.get(e, {}).get("check", {}).get("first", {}).get("total_s") for e in engines],
        "s, lower", ".2f")
    cd = M.get("cold", {})
    if cd:
        add("cold: start to first token", [cd.get(e, {}).get("start_to_first_token_s") for e in engines],
            "s, lower", ".2f")
        add("cold: start to 16th token", [cd.get(e, {}).get("start_to_last_token_s") for e in engines],
            "s, lower", ".2f")
        if any((cd.get(e) or {}).get("window") for e in engines):
            win = [(cd.get(e) or {}).get("window") or {} for e in engines]
            add(f"cold: tokens in the {b.args.cold_window:g} s after the load", [w.get("tokens") for w in win],
                "tokens, higher", ".0f")
            add("cold: ms a token at its end", [w.get("last_ms_per_token") for w in win], "ms, lower", ".2f")
        for v in COLD_VARIANTS:
            w = cd.get(f"mlx_{v}")
            if w is None:
                continue
            ahead = f"{w['warmup_s']:.1f} / " if w.get("warmup_s") is not None else ""
            add(f"cold: MLX EP {v} ({COLD_VARIANTS[v] or 'default options'}), {'warmup / ' if ahead else ''}"
                "first / 16th", [f"{ahead}{w['start_to_first_token_s']:.2f} / {w['start_to_last_token_s']:.2f}"
                                 if e == "mlx" else None for e in engines], "s", "s")
    pf = M.get("prefill", {})
    for L in M.get("prefill_lens", []) if pf else []:
        add(f"TTFT {L} warm", [pf.get(e, {}).get(str(L), {}).get("warm_ms") for e in engines], "ms, lower", ".2f")
        add(f"TTFT {L} first call", [pf.get(e, {}).get(str(L), {}).get("cold_ms") for e in engines], "ms, lower",
            ".2f")
    st = M.get("stall", {})
    if st:
        add("stall: slowest first/warm", [st.get(e, {}).get("worst_ratio") for e in engines], "x, lower", ".2f")
        add("stall: at length", [st.get(e, {}).get("worst_length") for e in engines], "", "d")
        add("stall: median first/warm", [st.get(e, {}).get("median_ratio") for e in engines], "x, lower", ".2f")
        if any(st.get(e, {}).get("warmup_s") is not None for e in engines):
            add("stall: warm-up before (s)", [st.get(e, {}).get("warmup_s") for e in engines], "s", ".2f")
    dc = M.get("decode", {})
    if dc:
        ml = M.get("decode_max_len")
        add(f"decode b1 ({b.cfg['new_tokens']} tok, max_length {ml})", [dc.get(e, {}).get("tps") for e in engines],
            "tok/s, higher")
        add("decode TTFT (prompt %d)" % b.cfg["prompt"], [dc.get(e, {}).get("ttft_ms") for e in engines],
            "ms, lower", ".2f")
    bt = M.get("batch", {})
    for nb in b.cfg["batches"] if bt else []:
        add(f"batch {nb} aggregate", [bt.get(e, {}).get(str(nb), {}).get("agg_tps") for e in engines],
            "tok/s, higher")
    ac = M.get("accuracy", {})
    if ac:
        N = b.cfg["new_tokens"]
        add(f"tokens == CUDA (of {N})", [_mm(ac.get(e, {}), "first_mismatch_vs_cuda", N) for e in engines],
            "first mismatch", "d")
        add(f"tokens == fp32 ref (of {N})", [_mm(ac.get(e, {}), "first_mismatch_vs_ref", N) for e in engines],
            "first mismatch", "d")
        K1 = b.cfg["acc_steps"] + 1
        add(f"max |logit - fp32| ({K1} steps)", [ac.get(e, {}).get("max_abs_err") for e in engines],
            "abs, lower", ".3g")
        add("  (fp32 max |logit|)", [ac.get(e, {}).get("ref_max_abs_logit") for e in engines], "abs", ".3g")
        add(f"top-1 == fp32 (of {K1} steps)", [ac.get(e, {}).get("top1_equal") for e in engines], "", "d")
        add("max |logit - CUDA EP|", [ac.get(e, {}).get("max_abs_vs_cuda") for e in engines], "abs", ".3g")
    h = M.get("host")
    if h:
        add("MLX EP Python per token", [h["ep_python_ms"] if e == "mlx" else None for e in engines], "ms", ".3f")
        add("... share of the token", [100 * h["ep_python_share"] if e == "mlx" else None for e in engines], "%")
    build = M.get("build", {})
    head = f"\n{M['name']}"
    if "model" in build:
        bm = build["model"]
        head += (f": weights {bm['weights_mb']:.1f} MB, build {_f(bm['build_s'])} s"
                 f"{' (cached)' if bm['cached'] else ''}")
    if "reference" in build:
        head += f", fp32 reference build {_f(build['reference']['build_s'])} s"
    print(head)
    if not E:                                       # (--build-only, or nothing loaded)
        for err in M.get("errors", []):
            print(f"  error: {err}")
        return
    w0 = max([len(r[0]) for r in rows] + [10]) + 1
    cols = [lab[e] for e in engines]
    ratio = "mlx" in engines and "cuda_graph" in engines
    cw = max(14, max(len(c) for c in cols) + 1)
    line = f"  {'':<{w0}}" + "".join(f"{c:>{cw}}" for c in cols) + (f"{'MLX/graph':>11}" if ratio else "") + \
        "  unit"
    print(line)
    for label, vals, unit, fmt in rows:
        cells = "".join(f"{_cell(v, fmt):>{cw}}" for v in vals)
        r = ""
        if ratio:
            a, g = vals[engines.index("mlx")], vals[engines.index("cuda_graph")]
            r = f"{a / g:>10.2f}x" if isinstance(a, (int, float)) and isinstance(g, (int, float)) and g and \
                unit.split(",")[0] in ("ms", "tok/s", "s", "x") else f"{'':>11}"
        print(f"  {label:<{w0}}{cells}{r}  {unit}")
    for e in engines:
        if e in M.get("dead", {}):
            print(f"  {lab[e]}: not run: {M['dead'][e]}")
    for s in M.get("skipped", []):
        print(f"  skipped {s}")
    for err in M.get("errors", []):
        print(f"  error: {err}")
    if M.get("host_command"):
        print(f"  EP host time stage by stage: {M['host_command']}")


def _mm(d: dict, key: str, n: int):
    """The first mismatching index; ``n`` when all ``n`` tokens agree; None when not compared."""
    if key not in d:
        return None
    return n if d[key] is None else d[key]


def _cell(v, fmt: str) -> str:
    if v is None:
        return "-"
    if fmt == "d":
        return str(int(v))
    return format(v, fmt)


# =============================================================================================== main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny models on this box: ORT's CPU EP for the CUDA columns")
    ap.add_argument("--sizes", help="comma list (default 0.5b,1.5b; --smoke: tiny)")
    ap.add_argument("--precisions", help="comma list of fp16,int4 (default both)")
    ap.add_argument("--only", default=",".join(DEFAULT_CASES),
                    help=f"comma list of {','.join(CASES)} (default all but cold)")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {','.join(ENGINES)}")
    ap.add_argument("--time-budget", type=float, help="seconds for the whole run (default 540; --smoke 900)")
    ap.add_argument("--call-limit", type=float, help="at most this many seconds for any one engine call or build "
                    "(default: each kind's own limit, 180-420 s)")
    ap.add_argument("--json", help="write the results here (rewritten after every case)")
    ap.add_argument("--log", help="the workers' and builds' output (default: next to --json)")
    ap.add_argument("--mlx-device", choices=("cpu", "gpu", "auto"), help="default gpu (--smoke: cpu)")
    ap.add_argument("--mlx-option", action="append", default=[], metavar="KEY=VALUE",
                    help="MLX EP provider option (device, no_compile, trace, verbose, disable_ops, tuning)")
    ap.add_argument("--cold-window", type=float, default=10.0,
                    help="the cold case's generations go on until this many seconds after the load (0: the first only)")
    ap.add_argument("--cold-variants", default="eager,warmed",
                    help=f"the cold case's extra MLX EP runs, comma list of {','.join(COLD_VARIANTS)} (or empty)")
    ap.add_argument("--prune-lm-head", action="store_true",
                    help="models built with the builder's prune_lm_head (a prompt's logits: its last token only)")
    ap.add_argument("--stall-warmup", action="store_true",
                    help="stall: the MLX EP runs ortmlx.warmup.warm over every bucket first (in its process)")
    ap.add_argument("--prefill", help="comma list of prompt lengths (default 128,512,2048,4096)")
    ap.add_argument("--batches", help="comma list of batch sizes (default 1,4,16)")
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--prompt", type=int, help="decode / batch / accuracy prompt length (default 128)")
    ap.add_argument("--decode-max-length", type=int, dest="decode_max_len",
                    help="genai's max_length (the KV buffer) of the decode and batch cases (default prompt + new "
                         "tokens; an application with a long context sets its context length)")
    ap.add_argument("--rounds", type=int, help="timed rounds of decode and batch (default 3)")
    ap.add_argument("--reps", type=int, help="warm repeats per prefill length (default 3)")
    ap.add_argument("--acc-steps", type=int, help="teacher-forced steps compared with the fp32 reference (32)")
    ap.add_argument("--build-only", action="store_true", help="build (or find cached) the models and, unless --only "
                    "leaves accuracy out, the fp32 references; print their times; measure nothing")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(json.loads(args.worker))
    cfg = dict(SMOKE if args.smoke else FULL)
    for k in ("sizes", "precisions", "prefill", "batches"):
        v = getattr(args, k)
        if v:
            cfg[k] = [x if k in ("sizes", "precisions") else int(x) for x in v.split(",") if x]
    for k in ("new_tokens", "prompt", "rounds", "reps", "acc_steps", "decode_max_len"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    cfg["reps"] = max(1, cfg["reps"])
    if args.time_budget is None:
        args.time_budget = cfg["budget"]
    if args.mlx_device is None:
        args.mlx_device = "cpu" if args.smoke else "gpu"
    bad = [c for c in args.only.split(",") if c and c not in CASES] + \
        [e for e in args.engines.split(",") if e and e not in ENGINES]
    if bad:
        ap.error(f"unknown case/engine {bad}; cases {CASES}, engines {ENGINES}")
    b = Bench(args, cfg)
    b.say(f"bench_llm: {'SMOKE (ORT CPU EP for the CUDA columns, MLX on its CPU)' if b.smoke else 'GPU'}; models "
          f"{','.join(cfg['sizes'])} x {','.join(cfg['precisions'])}; cases {','.join(b.only)}; engines "
          f"{','.join(b.engines)}; budget {args.time_budget:.0f} s; log {b.log_path}; json {args.json}")

    def stop(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, stop)
    try:
        for size in cfg["sizes"]:
            for prec in cfg["precisions"]:
                if b.budget.left() < 10:
                    b.say(f"qwen2-{size}-{prec}: skipped (budget spent)")
                    b.res["models"].setdefault(f"qwen2-{size}-{prec}", {"skipped": ["budget spent"]})
                    continue
                b.run_model(size, prec)
    except KeyboardInterrupt as e:
        b.say(f"stopped ({e}); partial results kept")
        b.drop_workers(grace=0)
    finally:
        b.drop_workers()
        b.save()
        shutil.rmtree(b.tmp, ignore_errors=True)
        b.say(f"done in {time.monotonic() - b.budget.t0:.0f} s; json {args.json or '(none: --json)'}; "
              f"log {b.log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
