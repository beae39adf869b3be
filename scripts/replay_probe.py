"""What replaying a step's kernels ourselves would cost the host, next to MLX launching them.

    python3 scripts/replay_probe.py [--kernels 170] [--size 4096] [--steps 300] [--rounds 3]
    python3 scripts/replay_probe.py --decode [--layers 24] [--max-len 4104] [--steps 200]
    python3 scripts/replay_probe.py --model DIR [--tokens 64] [--prompt 62] [--rounds 3]

A chain of K launches of one custom kernel of ours (y = 0.5 x + 1, float32, built into MLX's kernel cache by
``kernels/cuda_cache.py`` as every kernel of ours is) run three ways, per step:
  mlx     a compiled function of the K calls, ``mx.async_eval`` (the host's part) then the wait
  driver  the same module loaded from the cache with the CUDA driver, K ``cuLaunchKernel`` from Python
  graph   those K launches captured once into a CUDA graph, one ``cuGraphLaunch`` a step
Each form's answer is checked bit for bit against MLX's. Then an MLX array's device address, which MLX 0.32 does not
export (no CUDA DLPack), is read through a kernel that writes its input's pointer, and the bytes at that address
are checked against the array: how a replay would find MLX-owned weights. A decode step of the 0.5B model is ~170
kernels (docs/performance.md), MLX's host part ~1.4 ms of it. GPU only (MLX's CUDA backend).

``--decode``: a decode step of Qwen2-0.5B's shapes (random weights) made of our kernels only, as the EP's decode
closure makes it (per layer: norm + QKV product, fused RoPE attention over the KV buffers, output product, norm +
gated MLP, down product; then the final norm + LM head), run through MLX compiled, MLX eager, and as a
``kernels/cuda_replay.py`` replay (its KV buffers written in place); per step the host's part and the wall time,
and the replay's logits checked bit for bit against MLX's at the same step.

``--model DIR``: a genai model's decode on the MLX EP with tuning ``replay=1``, in one process: generations of the
same greedy prompt alternate the replay serving and not (it records and checks either way; not serving, the
trusted closure answers, as with the replay off), after warm-up generations until the replay serves or is
refused. Per form the token's median time (the second half of each generation), the EP's Compute within it and
the rest (genai, ORT), every generation's tokens compared; the replay's state and build times, and on a refusal
every launch argument it found. ORT's CUDA EP columns: ``bench_llm.py --mlx-option tuning=replay=1``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STREAM_NON_BLOCKING = 1
CAPTURE_RELAXED = 2
THREADS = 256

SOURCE = r"""
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < N) out[i] = a[i] * static_cast<T>(0.5f) + static_cast<T>(1.0f);
"""
ADDRESS_SOURCE = r"""
    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = reinterpret_cast<uint64_t>(a);
"""


class Cuda:
    """The driver calls ``kernels/cuda_replay.py`` makes, each checked (``cuda("cuStreamSynchronize", s)``)."""

    def __init__(self):
        from ortmlx.kernels import cuda_replay
        from ortmlx.kernels.cuda_driver import driver
        drv = driver()
        if drv is None:
            raise SystemExit("replay_probe: no CUDA driver (needs MLX's CUDA backend)")
        drv.current()                       # MLX's primary context on this thread
        self.ffi = drv.ffi
        self.lib = cuda_replay.driver_lib(drv)

    def __call__(self, what: str, *args):
        rc = getattr(self.lib, what)(*args)
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUresult {rc}")


def cached_function(cuda: Cuda, kern, template: list, inputs: list, out_types: list):
    """The CUfunction of one instantiation of ``kern`` (a ``CachedKernel``), loaded from MLX's kernel cache."""
    from ortmlx.kernels import cuda_cache as cc
    func = cc.kernel_name(kern.name, template)
    src = cc.mlx_source(func, kern.header, kern.source, kern.input_names, inputs, kern.output_names, out_types,
                        template)
    path = cc.ptx_path(cc.cache_dir(), cc.module_name(func, src))
    if not os.path.exists(path):
        raise SystemExit(f"replay_probe: {path} is not in the cache (kernel cache off? {cc.reason()})")
    with open(path, "rb") as f:
        image = f.read()
    with open(path[:-4] + ".txt") as f:
        lowered = f.read().split("\t", 1)[1].strip()
    mod, fn = cuda.ffi.new("void**"), cuda.ffi.new("void**")
    cuda("cuModuleLoadData", mod, cuda.ffi.from_buffer(image))
    cuda("cuModuleGetFunction", fn, mod[0], lowered.encode())
    return fn[0]


def median_us(xs: list) -> float:
    return statistics.median(xs) * 1e6


def decode(args) -> int:
    """``--decode``: MLX compiled / MLX eager / replayed, a synthetic decode step of our kernels."""
    import mlx.core as mx
    from ortmlx.kernels import consts, cuda_kernels as ck, cuda_replay, cuda_rows
    h, nq, nkv, d, ff, vocab, t = 896, 14, 2, 64, 4864, 151936, args.max_len or 4104
    mx.random.seed(0)

    def col(k, n):                          # a column-major [K, N] weight, as the EP stores MatMul weights
        w = (mx.random.normal((n, k)) * (k ** -0.5)).astype(mx.float16).T
        mx.eval(w)
        cuda_rows.register_col_major([w])
        return w

    def vec(n, mean=0.0):
        return (mean + mx.random.normal((n,)) * 0.02).astype(mx.float16)

    layers = [dict(g1=vec(h, 1), g2=vec(h, 1), wqkv=col(h, (nq + 2 * nkv) * d), bqkv=vec((nq + 2 * nkv) * d),
                   wo=col(nq * d, h), wgu=col(h, 2 * ff), wd=col(ff, h)) for _ in range(args.layers)]
    embed = (mx.random.normal((vocab, h)) * 0.5).astype(mx.float16)
    gf, head = vec(h, 1), col(h, vocab)
    pos = np.arange(t, dtype=np.float32)[:, None] / (10000 ** (np.arange(d, dtype=np.float32) % (d // 2) * 2 / d))
    cos, sin = mx.array(np.cos(pos)), mx.array(np.sin(pos) * np.where(np.arange(d) < d // 2, -1, 1))
    mx.eval(layers, embed, gf, head, cos, sin)

    def step(ids, position, past_len, total_len, *kv):
        x = ck.take_rows(embed, ids).reshape(1, 1, h)
        c, s_ = ck.take_rows(cos, position), ck.take_rows(sin, position)
        resid, down, presents = x, None, []
        for i, p in enumerate(layers):
            qkv, resid = cuda_rows.norm_gemv(resid if down is None else down, p["g1"], 1e-6, p["wqkv"],
                                             skip=None if down is None else resid)
            if resid is None:
                resid = x
            attn, pk, pv, _, _ = ck.decode_rope_attention(
                qkv, None, None, c, s_, kv[2 * i], kv[2 * i + 1], past_len, total_len, num_heads=nq,
                kv_num_heads=nkv, rot_dim=d, interleaved=False, alpha=d ** -0.5, qkv_bias=p["bqkv"])
            o = cuda_rows.gemv(attn, p["wo"])
            g, resid = cuda_rows.norm_gemv(o, p["g2"], 1e-6, p["wgu"], skip=resid, gating=(ff, True))
            down = cuda_rows.gemv(g, p["wd"])
            presents += [pk, pv]
        logits, _ = cuda_rows.norm_gemv(down, gf, 1e-6, head, skip=resid)
        return [logits] + presents

    def small(n: int, token: int):
        return [consts.roomy(mx.array(np.array([v], np.int32))) for v in (token, n, n, n + 1)]

    kv0 = [mx.zeros((1, nkv, t, d), mx.float16) for _ in range(2 * args.layers)]
    mx.eval(kv0)
    start = 16
    recs, ins, outs = [], [], []
    kv = kv0
    for n in (start, start + 1):
        a = small(n, n % vocab) + kv
        with cuda_replay.record() as launches:
            o = step(*a)
        mx.eval(o)
        recs.append(launches)
        ins.append(a)
        outs.append(o)
        kv = o[1:]
    second = outs[1]
    pairs = [(second[1 + j], ins[1][4 + j]) for j in range(2 * args.layers)]
    replays = {}
    for name, pdl in (("replay", False), ("replay pdl", True))[:2 if args.pdl else 1]:
        t0 = time.perf_counter()
        r = replays[name] = cuda_replay.Replay.build(recs[0], recs[1], (ins[0], ins[1]), in_place=pairs, pdl=pdl)
        print(f"{name} of {r.launches} launches built in {time.perf_counter() - t0:.2f} s ({r.timings})"
              f"{'; programmatic launches refused: ' + r.pdl_refused if r.pdl_refused else ''}")
        # the replay writes its presents over the second step's pasts (which hold the first step's rows): the
        # second step again through the replay, so both go on from its presents (MLX from its own arrays, never
        # read here: MLX moves a device buffer it reads on the host)
        for i, v in enumerate(((start + 1) % vocab, start + 1, start + 1, start + 2)):
            r.write(i, np.array([v], np.int32))
        r.launch()
        r.wait()
    mlx_kv = list(second[1:])
    fn = mx.compile(step)
    n = start + 2
    rows = {"mlx compiled": ([], []), "mlx eager": ([], [])}
    rows.update({name: ([], []) for name in replays})
    checked = None
    for k in range(args.steps):
        token = (7 * n) % vocab
        for name in rows if k % 2 == 0 else reversed(list(rows)):
            if name in replays:
                r = replays[name]
                t0 = time.perf_counter()
                for i, v in enumerate((token, n, n, n + 1)):
                    r.write(i, np.array([v], np.int32))
                r.launch()
                t1 = time.perf_counter()
                r.wait()
                t2 = time.perf_counter()
            else:
                f = fn if name == "mlx compiled" else step
                t0 = time.perf_counter()
                y = f(*small(n, token), *mlx_kv)
                mx.async_eval(y)
                t1 = time.perf_counter()
                mx.eval(y)
                t2 = time.perf_counter()
                if name == "mlx compiled":
                    mlx_y = y
            rows[name][0].append(t1 - t0)
            rows[name][1].append(t2 - t0)
        mlx_kv = mlx_y[1:]
        if checked is None:
            checked = all(np.array_equal(q.read(second[0]), np.array(mlx_y[0])) for q in replays.values())
        n += 1
        if n >= t - 1:
            break
    print(f"decode step, {args.layers} layers, KV {t} (medians over {len(rows['replay'][0])} steps, us):")
    base = median_us(rows["mlx compiled"][1])
    for name, (hst, w) in rows.items():
        print(f"  {name:13} host {median_us(hst):8.1f}  step {median_us(w):8.1f}  ({median_us(w) / base:.2f}x "
              f"MLX compiled's step)")
    print(f"the replays' logits at the first timed step {'equal' if checked else 'DIFFER from'} MLX compiled's")
    for r in replays.values():
        r.close()
    return 0 if checked else 1


def model(args) -> int:
    """``--model DIR``: a genai decode with the replay serving and not, alternating in one process."""
    import onnxruntime_genai as og
    import ortmlx.compiled as C
    from ortmlx import genai as mg
    from ortmlx.compiled import replay
    from ortmlx.ep import compute
    real = replay.StepReplay.serving
    serve = [False]
    replay.StepReplay.serving = lambda self: real(self) and serve[0]
    spent = [0.0]
    compute_real = compute.ComputeInfo.compute

    def timed(self, kctx):
        t0 = time.perf_counter()
        try:
            return compute_real(self, kctx)
        finally:
            spent[0] += time.perf_counter() - t0
    compute.ComputeInfo.compute = timed
    with C.capture() as runners:
        # prebuild off: the closure column is the fused closure traced here, not the unfused one that answers
        # while a worker builds its kernels (2x slower on an H100)
        m, _ = mg.load_model(args.model, "mlx", {"tuning": ",".join(["replay=1,prebuild=0"] + args.tuning)},
                             {"search": {"past_present_share_buffer": True}})
    with open(os.path.join(args.model, "genai_config.json")) as f:
        vocab = json.load(f)["model"]["vocab_size"]
    ids = np.random.default_rng(0).integers(0, min(vocab, 5000), args.prompt).astype(np.int32)
    max_len = args.max_len or args.prompt + args.tokens

    def decode_parts() -> list:
        return [p for r in runners for p in r.parts() if "replayed_calls" in p.counters]

    def generate() -> tuple[list, float, float]:
        gen = og.Generator(m, mg.search_options(m, max_len, max_len))
        gen.append_tokens(ids)
        toks, token_s, compute_s = [], [], []
        for _ in range(min(args.tokens, max_len - args.prompt)):
            spent[0] = 0.0
            t0 = time.perf_counter()
            gen.generate_next_token()
            toks.append(int(gen.get_next_tokens()[0]))
            token_s.append(time.perf_counter() - t0)
            compute_s.append(spent[0])
        half = len(token_s) // 2
        return toks, statistics.median(token_s[half:]), statistics.median(compute_s[half:])

    first, warm = None, 0
    while warm < 4:
        toks, _, _ = generate()
        first = first or toks
        warm += 1
        states = [p.counters["replay"] for p in decode_parts()]
        if any(x and not x.startswith("refused") for x in states) or any(x.startswith("refused") for x in states):
            break
    if not decode_parts():
        print("no decode closure records a replay here (tuning replay: MLX's CUDA backend and our kernels)")
    for p in decode_parts():
        print(f"{p.label}: replay {p.counters['replay'] or '(not built)'}")
        for c in p.closures():
            rp = c.replay
            if rp is not None and rp.replay is not None:
                print("  launches a step: " + ", ".join(f"{k} {v}" for k, v in rp.replay.labels.items()))
            for q in (rp.problems if rp is not None else []):
                print(f"  refused at: {q}")
    rows: dict = {False: [], True: []}
    same = True
    for _ in range(args.rounds):
        for on in (False, True):
            serve[0] = on
            toks, tok_s, comp_s = generate()
            same = same and toks == first
            rows[on].append((tok_s, comp_s))
    served = sum(p.counters["replayed_calls"] for p in decode_parts())
    print(f"{args.model}: {args.prompt}-token prompt, {args.tokens} new tokens, max_length {max_len}; "
          f"{warm} warm-up generations, then {args.rounds} rounds (medians of the rounds' medians, ms)")
    print(f"  {'form':16} {'token':>8} {'tok/s':>8} {'Compute':>8} {'rest':>8}")
    base = None
    for on in (False, True):
        tok = statistics.median(r[0] for r in rows[on]) * 1e3
        comp = statistics.median(r[1] for r in rows[on]) * 1e3
        base = base or tok
        print(f"  {'replay serving' if on else 'closure':16} {tok:8.3f} {1e3 / tok:8.1f} {comp:8.3f} {tok - comp:8.3f}"
              f"   ({base / tok:.2f}x the closure's speed)")
    print(f"replayed calls {served}; every generation's tokens the first's: {same}")
    for p in decode_parts():
        for c in p.closures():
            rp = c.replay
            if rp is not None and rp.calls:
                parts = ", ".join(f"{k} {v / rp.calls * 1e3:.3f}" for k, v in rp.spent.items())
                print(f"  {p.label}: a served call's parts, mean ms over {rp.calls}: {parts}")
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode", action="store_true", help="a synthetic decode step: MLX against a replay")
    ap.add_argument("--pdl", action="store_true", help="--decode: also a replay of programmatic launches")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--max-len", type=int, help="the KV buffers' length (genai's max_length; --decode: 4104, "
                    "--model: prompt + tokens)")
    ap.add_argument("--kernels", type=int, default=170, help="launches a step (K)")
    ap.add_argument("--size", type=int, default=4096, help="float32 elements each launch reads and writes")
    ap.add_argument("--steps", type=int, default=300, help="timed steps a form and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", help="a genai model directory: its decode with the replay serving and not")
    ap.add_argument("--tokens", type=int, default=64, help="--model: new tokens a generation")
    ap.add_argument("--tuning", action="append", default=[], metavar="KEY=VALUE",
                    help="--model: another tuning knob (repeatable; e.g. replay_host_guard=1)")
    ap.add_argument("--prompt", type=int, default=62, help="--model: prompt tokens")
    args = ap.parse_args()
    if args.model:
        return model(args)
    if args.decode:
        return decode(args)
    import mlx.core as mx
    from ortmlx.kernels import cuda_cache as cc
    from ortmlx.kernels import cuda_kernels as ck
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        print("replay_probe: needs MLX's CUDA backend")
        return 2
    mx.set_default_device(mx.gpu)
    k, n = args.kernels, args.size
    kern = ck._kernel("ortmlx_replay_probe", ["a"], ["out"], SOURCE)
    template = [("T", mx.float32), ("N", n)]
    blocks = -(-n // THREADS)

    def one(x):
        return kern(inputs=[x], template=template, grid=(blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                    output_shapes=[x.shape], output_dtypes=[mx.float32])[0]

    def chain(x):
        for _ in range(k):
            x = one(x)
        return x

    f = mx.compile(chain)
    host = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    x = mx.array(host)
    want = np.array(f(x))
    cuda = Cuda()
    ffi = cuda.ffi
    fn = cached_function(cuda, kern, template, [(cc.dtype_name(mx.float32), 1)], [cc.dtype_name(mx.float32)])
    bufs = [ffi.new("unsigned long long*") for _ in range(2)]
    for b in bufs:
        cuda("cuMemAlloc_v2", b, n * 4)
    stream = ffi.new("void**")
    cuda("cuStreamCreate", stream, STREAM_NON_BLOCKING)
    s = stream[0]
    params = []
    for j in range(2):          # launch j % 2 reads bufs[j % 2] and writes the other
        p = ffi.new("void*[2]")
        p[0], p[1] = bufs[j], bufs[1 - j]
        params.append(p)
    null = ffi.NULL

    def launches(checked: bool = False):
        for j in range(k):
            rc = cuda.lib.cuLaunchKernel(fn, blocks, 1, 1, THREADS, 1, 1, 0, s, params[j % 2], null)
            if checked and rc != 0:
                raise RuntimeError(f"cuLaunchKernel failed with CUresult {rc}")

    def result() -> np.ndarray:
        got = np.empty(n, np.float32)
        cuda("cuStreamSynchronize", s)
        cuda("cuMemcpyDtoH_v2", ffi.from_buffer(got), bufs[k % 2][0], n * 4)
        return got

    def reset():
        cuda("cuMemcpyHtoDAsync_v2", bufs[0][0], ffi.from_buffer(host), n * 4, s)     # (before the stream's next work)

    reset()
    launches(checked=True)
    ok_driver = np.array_equal(result(), want)
    graph, exec_ = ffi.new("void**"), ffi.new("void**")
    cuda("cuStreamBeginCapture_v2", s, CAPTURE_RELAXED)
    launches()
    cuda("cuStreamEndCapture", s, graph)
    cuda("cuGraphInstantiateWithFlags", exec_, graph[0], 0)
    reset()
    cuda("cuStreamSynchronize", s)
    cuda("cuGraphLaunch", exec_[0], s)
    ok_graph = np.array_equal(result(), want)

    rows = {"mlx": ([], []), "driver": ([], []), "graph": ([], [])}
    for _ in range(args.rounds):
        for _ in range(args.steps):
            t0 = time.perf_counter()
            y = f(x)
            mx.async_eval(y)
            t1 = time.perf_counter()
            mx.eval(y)
            t2 = time.perf_counter()
            rows["mlx"][0].append(t1 - t0)
            rows["mlx"][1].append(t2 - t0)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            launches()
            t1 = time.perf_counter()
            cuda.lib.cuStreamSynchronize(s)
            t2 = time.perf_counter()
            rows["driver"][0].append(t1 - t0)
            rows["driver"][1].append(t2 - t0)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            cuda.lib.cuGraphLaunch(exec_[0], s)
            t1 = time.perf_counter()
            cuda.lib.cuStreamSynchronize(s)
            t2 = time.perf_counter()
            rows["graph"][0].append(t1 - t0)
            rows["graph"][1].append(t2 - t0)
    print(f"{k} launches a step of a {n}-element float32 kernel ({args.rounds} x {args.steps} steps, medians, us):")
    print(f"  {'form':8} {'host':>9} {'step':>9} {'host/launch':>12}  answer")
    base = median_us(rows["mlx"][1])
    for name, (h, w) in rows.items():
        ok = {"mlx": "(reference)", "driver": ok_driver, "graph": ok_graph}[name]
        ok = ok if isinstance(ok, str) else ("equal to MLX's" if ok else "DIFFERS from MLX's")
        print(f"  {name:8} {median_us(h):9.1f} {median_us(w):9.1f} {median_us(h) / k:12.2f}  {ok}"
              f"   (step {median_us(w) / base:.2f}x MLX's)")

    addr_kern = ck._kernel("ortmlx_replay_address", ["a"], ["out"], ADDRESS_SOURCE)
    probe = mx.array(host) * 2              # device memory MLX allocated for a result
    (addr,) = addr_kern(inputs=[probe], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                        output_dtypes=[mx.uint64])
    mx.eval(addr, probe)
    at = int(np.array(addr)[0])
    got = np.empty(probe.size, np.float32)
    cuda("cuMemcpyDtoH_v2", ffi.from_buffer(got), at, got.nbytes)
    print(f"an MLX array's device address through a kernel: {at:#x}; the bytes there "
          f"{'equal the array' if np.array_equal(got, np.array(probe)) else 'DIFFER from the array'}")
    cuda("cuGraphExecDestroy", exec_[0])
    cuda("cuGraphDestroy", graph[0])
    for b in bufs:
        cuda("cuMemFree_v2", b[0])
    return 0 if ok_driver and ok_graph else 1


if __name__ == "__main__":
    sys.exit(main())
