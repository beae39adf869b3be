"""ORT CPU EP vs MLX EP (eager, compiled) side by side in one run, plus PyTorch eager and
mlx-lm on the same random weights where installed; ratios and the weight-bandwidth limit.

    python scripts/bench.py                                   # graphs only (MLP, CNN, 1024^2 matmul)
    python scripts/bench.py --model models/out/qwen2-tiny-fp32 --model models/out/llama-tiny-fp32
    python scripts/bench.py --no-graphs --model models/out/qwen2-0.5b-fp16 --device gpu \
        --hf models/out/hf/qwen2-0.5b --torch --mlx-lm --new-tokens 128 --bytes-run 1024

Graphs: median latency per call (rounds interleaved). LLMs (onnxruntime-genai loop, greedy,
batch 1, exactly --new-tokens tokens): prefill TTFT (append_tokens + first token) and decode
tokens/s; eager and compiled MLX must give the same tokens (else it stops). Host<->device bytes
per decode token are the EP's own counters (ortmlx.residency). The limit is weight bytes /
--bw-gbs per token (default 4300 GB/s, one H200's HBM, with --device gpu).

The GPU comparison with ORT's CUDA EP (genai's default config and with CUDA graphs) on the same model and loop,
prefill at several lengths, first-call stalls, static batching and accuracy against an fp32 reference, is
scripts/bench_llm.py (``--smoke`` runs it on a CPU box).
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import statistics
import sys
import time

if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the environment this process started with, before ``import ortmlx`` set its defaults (mlx-lm's own runs get it)
START_ENV = dict(os.environ)

import ortmlx  # noqa: E402  (first: binds MLX's CPU BLAS before mlx.core loads)
import numpy as np  # noqa: E402
from onnx import TensorProto as T  # noqa: E402
from onnx import helper  # noqa: E402

from ortmlx.kernels import background  # noqa: E402
from ortmlx.runtime import residency  # noqa: E402
from ortmlx.testing import make_model, session  # noqa: E402

RNG = np.random.default_rng(0)


def w(*shape):
    return (RNG.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)


def mlp(width=1024, depth=4, batch=64):
    nodes, inits, x = [], {}, "x"
    for k in range(depth):
        inits[f"W{k}"], inits[f"B{k}"] = w(width, width), w(width)
        nodes += [helper.make_node("MatMul", [x, f"W{k}"], [f"m{k}"]),
                  helper.make_node("Add", [f"m{k}", f"B{k}"], [f"a{k}"]),
                  helper.make_node("Relu", [f"a{k}"], [f"h{k}"])]
        x = f"h{k}"
    model = make_model(nodes, [("x", T.FLOAT, ["N", width])], [("h%d" % (depth - 1), T.FLOAT, ["N", width])], inits)
    return model, {"x": RNG.standard_normal((batch, width)).astype(np.float32)}


def matmul1024():
    model = make_model([helper.make_node("MatMul", ["x", "W"], ["y"])], [("x", T.FLOAT, [1024, 1024])],
                       [("y", T.FLOAT, [1024, 1024])], {"W": w(1024, 1024)})
    return model, {"x": RNG.standard_normal((1024, 1024)).astype(np.float32)}


def cnn():
    nodes = [helper.make_node("Conv", ["x", "C1", "CB1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "C2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("GlobalAveragePool", ["r2"], ["gp"]),
             helper.make_node("Flatten", ["gp"], ["f"], axis=1),
             helper.make_node("Gemm", ["f", "FW", "FB"], ["y"])]
    inits = {"C1": w(16, 3, 3, 3), "CB1": w(16), "C2": w(32, 16, 3, 3), "FW": w(32, 10), "FB": w(10)}
    model = make_model(nodes, [("x", T.FLOAT, ["N", 3, 64, 64])], [("y", T.FLOAT, ["N", 10])], inits)
    return model, {"x": RNG.standard_normal((4, 3, 64, 64)).astype(np.float32)}


def tiny():
    model = make_model([helper.make_node("Add", ["x", "x"], ["y"])], [("x", T.FLOAT, [1, 4])], [("y", T.FLOAT, [1, 4])])
    return model, {"x": np.ones((1, 4), np.float32)}


def per_call_us(fn, n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n / 1e3


def bench_graph(name, model, feeds, device, rounds, budget_s=1.0):
    sess = {"cpu_ep": session(model, "CPUExecutionProvider"),
            "mlx_eager": session(model, options={"no_compile": "1", "device": device}),
            "mlx_compiled": session(model, options={"device": device})}
    ref = sess["cpu_ep"].run(None, feeds)
    for k in ("mlx_eager", "mlx_compiled"):
        for _ in range(3):                          # trace, verification against eager, JIT
            got = sess[k].run(None, feeds)
        for a, b in zip(ref, got):
            err = float(np.max(np.abs(b - a) / (np.abs(a) + 1e-3)))
            if not np.allclose(b, a, rtol=1e-3, atol=1e-4):
                print(f"  !! {name}: {k} DIFFERS from the CPU EP beyond rtol 1e-3/atol 1e-4 "
                      f"(max abs {float(np.max(np.abs(b - a))):.2e}, max rel {err:.2e})")
    t1 = per_call_us(lambda: sess["mlx_eager"].run(None, feeds), 1)
    n = max(3, min(2000, int(budget_s * 1e6 / max(t1, 1.0) / 3 / rounds)))
    times = {k: [] for k in sess}
    for _ in range(rounds):
        for k, s in sess.items():
            times[k].append(per_call_us(lambda: s.run(None, feeds), n))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{name:<18} CPU EP {med['cpu_ep']:10.1f} us | MLX eager {med['mlx_eager']:10.1f} us | "
          f"MLX compiled {med['mlx_compiled']:10.1f} us | eager/CPU {med['mlx_eager'] / med['cpu_ep']:5.2f}x  "
          f"compiled/CPU {med['mlx_compiled'] / med['cpu_ep']:5.2f}x  (lower is faster; {n} calls x {rounds})")
    return med


# --------------------------------------------------------------------------- LLMs (genai loop)
def weight_bytes(model_dir: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(model_dir, "*.onnx*")))


def genai_gen(og, mg, model, ids, n_new, trace_bytes=False):
    """(TTFT ms, decode tok/s, tokens, per-token (h2d, d2h) byte deltas when trace_bytes)."""
    params = mg.search_options(model, len(ids) + n_new, len(ids) + n_new)
    g = og.Generator(model, params)
    t0 = time.perf_counter_ns()
    g.append_tokens(ids)
    g.generate_next_token()
    toks = [int(g.get_next_tokens()[0])]
    t1 = time.perf_counter_ns()
    per = []
    last = residency.snapshot()
    while not g.is_done():
        g.generate_next_token()
        toks.append(int(g.get_next_tokens()[0]))
        if trace_bytes:
            now = residency.snapshot()
            per.append((now["h2d_bytes"] - last["h2d_bytes"], now["d2h_bytes"] - last["d2h_bytes"]))
            last = now
    t2 = time.perf_counter_ns()
    return (t1 - t0) / 1e6, (len(toks) - 1) / ((t2 - t1) / 1e9), toks, per


def bench_llm(path, device, rounds, prompt_len, n_new, engines, bytes_run, bw, extra=None, alt=None):
    import onnxruntime_genai as og
    from ortmlx import genai as mg
    name = os.path.basename(os.path.normpath(path))
    models = {}
    if "cpu_ep" in engines:
        models["cpu_ep"] = mg.load_model(path, "cpu")[0]
    if "mlx_eager" in engines:
        models["mlx_eager"] = mg.load_model(path, "mlx", {**(extra or {}), "no_compile": "1", "device": device})[0]
    models["mlx_compiled"] = mg.load_model(path, "mlx", {**(extra or {}), "device": device})[0]
    if alt:                                     # the same compiled EP with other options, in the same rounds
        models["mlx_compiled_alt"] = mg.load_model(path, "mlx", {**(extra or {}), **alt, "device": device})[0]
    ids = np.asarray(RNG.integers(5, 500, prompt_len), np.int32)
    first = {}
    for k, m in models.items():                 # warm-up: traces, verification, kernel JIT
        t0 = time.perf_counter()
        first[k] = genai_gen(og, mg, m, ids, n_new)
        print(f"  [{name}] {k}: first generation {time.perf_counter() - t0:.1f} s "
              f"({first[k][1]:.1f} tok/s after the first token)", flush=True)
    if background.wait(600):                    # kernels built behind the calls (CPU): verified, then replayed
        for k, m in models.items():
            genai_gen(og, mg, m, ids, n_new)
    res = {k: {"ttft": [], "tps": []} for k in models}
    toks = {}
    for _ in range(rounds):
        for k, m in models.items():
            ttft, tps, t, _ = genai_gen(og, mg, m, ids, n_new)
            res[k]["ttft"].append(ttft)
            res[k]["tps"].append(tps)
            toks[k] = t
            print(f"  [{name}] {k}: TTFT {ttft:.2f} ms, decode {tps:.1f} tok/s", flush=True)
    if "mlx_eager" in toks and toks["mlx_eager"] != toks["mlx_compiled"]:
        raise SystemExit(f"{name}: compiled tokens differ from eager: {toks['mlx_compiled'][:16]} vs "
                         f"{toks['mlx_eager'][:16]}")
    if "mlx_compiled_alt" in toks:              # an option may change rounding (e.g. device_constants): report
        same = sum(a == b for a, b in zip(toks["mlx_compiled_alt"], toks["mlx_compiled"]))
        print(f"  [{name}] tokens of mlx_compiled_alt == mlx_compiled: {same}/{len(toks['mlx_compiled'])}")
    wb = weight_bytes(path)
    print(f"\n{name}: prompt {prompt_len}, {n_new} new tokens, batch 1, greedy, device {device}, "
          f"weights {wb / 1e6:.1f} MB")
    med = {k: (statistics.median(v["ttft"]), statistics.median(v["tps"])) for k, v in res.items()}
    for k, (ttft, tps) in med.items():
        same = "" if k not in toks or "cpu_ep" not in toks else \
            f"  tokens == CPU EP: {sum(a == b for a, b in zip(toks[k], toks['cpu_ep']))}/{len(toks[k])}"
        print(f"  {k:<16} TTFT {ttft:9.2f} ms   decode {tps:9.1f} tok/s   (first generation TTFT "
              f"{first[k][0]:.1f} ms){same}")
    base = med["mlx_compiled"][1]
    for k in med:
        if k != "mlx_compiled":
            print(f"  decode ratio compiled / {k}: {base / med[k][1]:.2f}x")
    if "mlx_eager" in med:
        print(f"  TTFT ratio eager / compiled: {med['mlx_eager'][0] / med['mlx_compiled'][0]:.2f}x")
    if bw:
        print(f"  weight-bandwidth limit: {bw * 1e9 / wb:.0f} tok/s ({bw:.0f} GB/s / {wb / 1e6:.1f} MB); "
              f"MLX compiled at {100 * base / (bw * 1e9 / wb):.1f}% of it")
    if bytes_run:
        genai_gen(og, mg, models["mlx_compiled"], ids, bytes_run)      # warm-up at this buffer size
        print(f"  [{name}] {bytes_run}-token warm-up done", flush=True)
        residency.reset()
        _, tps, t, per = genai_gen(og, mg, models["mlx_compiled"], ids, bytes_run, trace_bytes=True)
        h = [a for a, _ in per]
        d = [b for _, b in per]
        print(f"  host<->device bytes per decode token, {bytes_run}-token generation (MLX compiled, "
              f"{tps:.1f} tok/s): in first {h[0]:,} median {int(statistics.median(h)):,} last {h[-1]:,}; "
              f"out first {d[0]:,} median {int(statistics.median(d)):,} last {d[-1]:,}")
    return med, toks


def bench_torch(hf_dir, prompt_len, n_new, rounds):
    import torch
    import transformers
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if dev == "cuda" else torch.float32
    m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(dev).eval()
    ids = torch.tensor(RNG.integers(5, 500, (1, prompt_len)), device=dev)

    def run(n):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    run(n_new)
    ttft = statistics.median(run(1) for _ in range(rounds))
    total = statistics.median(run(n_new) for _ in range(rounds))
    tps = (n_new - 1) / (total - ttft)
    print(f"  {'torch_eager':<14} TTFT {ttft * 1e3:9.2f} ms   decode {tps:9.1f} tok/s   ({dev}, {dtype}, HF generate)")
    return ttft * 1e3, tps


def bench_mlx_lm(hf_dir, prompt_len, n_new, rounds, fp16, env: dict | None = None, label: str = "mlx_lm"):
    """mlx-lm on the same weights in a process of its own (``scripts/mlx_lm_bench.py``, which does not import
    ortmlx), with ``env`` as its environment (default: the one this process started with, so MLX's own settings
    where ortmlx sets some, e.g. ``MLX_MAX_OPS_PER_BUFFER``). Returns (TTFT ms, tok/s of its own loop, tok/s
    stepped as genai steps an EP) and prints both."""
    import json
    import subprocess
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "mlx_lm_bench.py"), hf_dir,
           "--prompt-len", str(prompt_len), "--new-tokens", str(n_new), "--rounds", str(rounds)]
    p = subprocess.run(cmd + (["--fp16"] if fp16 else []), capture_output=True, text=True,
                       env=START_ENV if env is None else env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"mlx_lm_bench.py exited {p.returncode}: {p.stderr.strip()[-600:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    ops = r["env"].get("MLX_MAX_OPS_PER_BUFFER") or "unset"
    print(f"  {label:<16} TTFT {r['ttft_ms']:9.2f} ms   decode {r['tps']:9.1f} tok/s   ({r['device']}, "
          f"generate_step; own process, MLX_MAX_OPS_PER_BUFFER={ops})")
    print(f"  {label + '_host':<16} {'':17}   decode {r['host_tps']:9.1f} tok/s   (one step at a time, logits read "
          f"on the host: what genai asks of an EP)")
    return r["ttft_ms"], r["tps"], r["host_tps"]


BLAS_SNIPPET = """
import time, ortmlx, mlx.core as mx, numpy as np
a = mx.array(np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32))
with mx.stream(mx.cpu):
    mx.eval(a @ a)
    ts = []
    for _ in range(3):
        t = time.perf_counter(); mx.eval(a @ a); ts.append(time.perf_counter() - t)
print(min(ts) * 1e3, ortmlx.blas.status()['reason'])
"""


def blas_compare(rounds: int) -> None:
    """MLX CPU 1024^2 fp32 matmul with and without the OpenBLAS binding (fresh processes, alternated)."""
    import subprocess
    got = {"on": [], "off": []}
    for _ in range(rounds):
        for k in got:
            env = dict(os.environ, ORTMLX_TUNING="blas=1" if k == "on" else "blas=0")
            p = subprocess.run([sys.executable, "-c", BLAS_SNIPPET], capture_output=True, text=True, env=env)
            if p.returncode:
                print(f"  blas compare failed: {p.stderr[-300:]}")
                return
            ms, why = p.stdout.split(maxsplit=1)
            got[k].append(float(ms))
    on, off = statistics.median(got["on"]), statistics.median(got["off"])
    print(f"MLX CPU 1024^2 fp32 matmul: reference BLAS {off:.1f} ms | OpenBLAS binding {on:.1f} ms | "
          f"{off / on:.1f}x  ({why.strip()})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=[], help="genai model dir (repeatable)")
    ap.add_argument("--device", choices=("cpu", "gpu", "auto"), default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--blas", action="store_true", help="MLX CPU matmul with vs without the OpenBLAS binding")
    ap.add_argument("--no-cpu-ep", action="store_true", help="LLMs: skip the ORT CPU EP")
    ap.add_argument("--no-eager", action="store_true", help="LLMs: skip MLX eager")
    ap.add_argument("--bytes-run", type=int, default=0, help="also one N-token generation counting bytes per token")
    ap.add_argument("--hf", help="HF checkpoint of the same weights (for --torch / --mlx-lm)")
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--mlx-lm", action="store_true", help="also mlx-lm's own loop, in a process of its own with the "
                    "environment this one started with (MLX's settings, not those ortmlx sets)")
    ap.add_argument("--mlx-lm-ep-env", action="store_true", help="also mlx-lm with this process's environment (the "
                    "settings ortmlx sets, e.g. MLX_MAX_OPS_PER_BUFFER)")
    ap.add_argument("--bw-gbs", type=float, default=None, help="memory bandwidth GB/s for the limit")
    ap.add_argument("--mlx-option", action="append", default=[], metavar="KEY=VALUE",
                    help="extra MLX EP option for the LLM sessions (repeatable)")
    ap.add_argument("--alt-option", action="append", default=[], metavar="KEY=VALUE",
                    help="LLMs: also run the compiled EP with these options (repeatable), interleaved in the "
                         "same rounds: an A/B of an option on one machine (a tuning knob: tuning=KEY=VALUE)")
    args = ap.parse_args(argv)

    import mlx.core as mx
    import onnxruntime as ort
    device = args.device
    if device == "auto":
        device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    bw = args.bw_gbs if args.bw_gbs is not None else (4300.0 if device == "gpu" else None)
    print(f"mlx {mx.__version__} ({mx.default_device()}), onnxruntime {ort.__version__}, numpy {np.__version__}, "
          f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, BLAS: {ortmlx.blas.status()['reason']}")
    if device == "gpu":
        # (process-wide: mlx-lm and MLX eager below run with the same CUDA graph size as the MLX EP)
        print(f"MLX_MAX_OPS_PER_BUFFER={os.environ.get('MLX_MAX_OPS_PER_BUFFER', 'unset')} (CUDA graph size: ortmlx "
              f"sets 30 on Linux unless set; MLX's own default on an H100/H200 is 100)")
    ortmlx.register()
    if args.blas:
        blas_compare(args.rounds)
    if not args.no_graphs:
        print("\ngraphs (median us per run; ratios: MLX time / CPU EP time, < 1 is faster than the CPU EP)")
        for name, (m, f) in (("tiny Add [1,4]", tiny()), ("matmul 1024^2", matmul1024()),
                             ("MLP 4x1024 b64", mlp()), ("CNN 64x64 b4", cnn())):
            bench_graph(name, m, f, device, args.rounds)
    engines = {"mlx_compiled"} | (set() if args.no_cpu_ep else {"cpu_ep"}) | (set() if args.no_eager else {"mlx_eager"})
    for path in args.model:
        med, _ = bench_llm(path, device, args.rounds, args.prompt_len, args.new_tokens, engines, args.bytes_run, bw,
                             dict(kv.split("=", 1) for kv in args.mlx_option),
                             dict(kv.split("=", 1) for kv in args.alt_option))
        others = {}
        if args.hf and args.torch:
            try:
                others["torch_eager"] = bench_torch(args.hf, args.prompt_len, args.new_tokens, args.rounds)
            except Exception as e:  # noqa: BLE001
                print(f"  torch_eager: not run: {type(e).__name__}: {e}")
        if args.hf and args.mlx_lm:
            runs = [("mlx_lm", None)] + ([("mlx_lm_ep_env", dict(os.environ))] if args.mlx_lm_ep_env else [])
            for label, env in runs:
                try:
                    ttft, tps, host = bench_mlx_lm(args.hf, args.prompt_len, args.new_tokens, args.rounds,
                                                   "fp16" in path, env, label)
                    others[label] = (ttft, tps)
                    others[label + "_host"] = (None, host)
                except Exception as e:  # noqa: BLE001
                    print(f"  {label}: not run: {type(e).__name__}: {e}")
        for k, (_, tps) in others.items():
            print(f"  decode ratio MLX EP compiled / {k}: {med['mlx_compiled'][1] / tps:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
