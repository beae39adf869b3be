"""Eager vs compiled (mx.compile) per-call time for a general MLP/CNN group and for LLM
decode and prefill through onnxruntime-genai, measured side by side in one process.

Each pair of sessions (``no_compile=1`` vs default) runs interleaved in rounds so machine
noise hits both alike; prints medians and the eager/compiled ratio (> 1: compiled is faster).
Warm-up calls (trace, verification against eager, g++ JIT on MLX's CPU backend) are excluded
and reported separately as the first-call time.

    python scripts/bench_compile.py [--rounds 5] [--calls 50] [--model models/out/llama-tiny-fp32]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from onnx import TensorProto as T
from onnx import helper

import ortmlx
import ortmlx.compiled as C
from ortmlx.testing import make_model, session

RNG = np.random.default_rng(0)


def w(*shape):
    return (RNG.standard_normal(shape) * 0.1).astype(np.float32)


def mlp(width: int = 256, depth: int = 6):
    nodes, inits, x = [], {}, "x"
    for k in range(depth):
        inits[f"W{k}"], inits[f"B{k}"] = w(width, width), w(width)
        nodes += [helper.make_node("MatMul", [x, f"W{k}"], [f"m{k}"]),
                  helper.make_node("Add", [f"m{k}", f"B{k}"], [f"a{k}"]),
                  helper.make_node("Relu", [f"a{k}"], [f"r{k}"]),
                  helper.make_node("Mul", [f"r{k}", f"a{k}"], [f"h{k}"])]
        x = f"h{k}"
    nodes.append(helper.make_node("Softmax", [x], ["y"], axis=-1))
    model = make_model(nodes, [("x", T.FLOAT, ["N", width])], [("y", T.FLOAT, ["N", width])], inits)
    return model, {"x": RNG.standard_normal((8, width)).astype(np.float32)}


def cnn():
    nodes = [helper.make_node("Conv", ["x", "C1", "CB1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "C2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c2"], ["s2"]),
             helper.make_node("Mul", ["c2", "s2"], ["r2"]),
             helper.make_node("GlobalAveragePool", ["r2"], ["gp"]),
             helper.make_node("Flatten", ["gp"], ["f"], axis=1),
             helper.make_node("Gemm", ["f", "FW", "FB"], ["y"])]
    inits = {"C1": w(16, 3, 3, 3), "CB1": w(16), "C2": w(16, 16, 3, 3), "FW": w(16, 10), "FB": w(10)}
    model = make_model(nodes, [("x", T.FLOAT, ["N", 3, 32, 32])], [("y", T.FLOAT, ["N", 10])], inits)
    return model, {"x": RNG.standard_normal((2, 3, 32, 32)).astype(np.float32)}


def timed(fn, n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n / 1e3


def side_by_side(name: str, eager_fn, compiled_fn, rounds: int, calls: int, first: tuple[float, float]) -> dict:
    e, c = [], []
    for _ in range(rounds):
        e.append(timed(eager_fn, calls))
        c.append(timed(compiled_fn, calls))
    me, mc = statistics.median(e), statistics.median(c)
    print(f"{name:<22} eager {me:10.1f} us   compiled {mc:10.1f} us   ratio {me / mc:6.2f}x   "
          f"(first call: eager {first[0] / 1e3:.1f} ms, compiled {first[1] / 1e3:.1f} ms)")
    return {"eager_us": me, "compiled_us": mc, "ratio": me / mc}


def first_call_us(fn) -> float:
    return timed(fn, 1)


def bench_graph(name: str, model, feeds, rounds: int, calls: int) -> dict:
    eager = session(model, options={"no_compile": "1"})
    with C.capture() as rs:
        comp = session(model)
    fe = first_call_us(lambda: eager.run(None, feeds))
    fc = first_call_us(lambda: comp.run(None, feeds))
    for _ in range(2):                      # verification call(s) and JIT
        comp.run(None, feeds)
        eager.run(None, feeds)
    a, b = eager.run(None, feeds), comp.run(None, feeds)
    for x, y in zip(a, b):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)
    res = side_by_side(name, lambda: eager.run(None, feeds), lambda: comp.run(None, feeds), rounds, calls, (fe, fc))
    parts = [p for r in rs for p in r.parts()]
    res["traces"] = sum(p.counters["traces"] for p in parts)
    res["compiled_calls"] = sum(p.counters["compiled_calls"] for p in parts)
    if not res["compiled_calls"]:
        print(f"  note: {name} never replayed a compiled closure: {[p.counters for p in parts]}")
    return res


def bench_llm(path: str, rounds: int, prompt_len: int, n_decode: int) -> None:
    from ortmlx import genai as mg
    import onnxruntime_genai as og
    eager, _ = mg.load_model(path, "mlx", {"no_compile": "1"})
    with C.capture() as rs:
        comp, _ = mg.load_model(path, "mlx")
    ids = np.asarray([int(t) for t in RNG.integers(5, 500, prompt_len)], np.int32)

    def gen(model, n_new: int) -> tuple[float, float, list[int]]:
        """(prefill ms: append_tokens + first token, mean decode ms per token, tokens)."""
        params = mg.search_options(model, len(ids) + n_new, len(ids) + n_new)
        g = og.Generator(model, params)
        t0 = time.perf_counter_ns()
        g.append_tokens(ids)
        g.generate_next_token()
        t1 = time.perf_counter_ns()
        toks = [int(g.get_next_tokens()[0])]
        while not g.is_done():
            g.generate_next_token()
            toks.append(int(g.get_next_tokens()[0]))
        t2 = time.perf_counter_ns()
        return (t1 - t0) / 1e6, (t2 - t1) / 1e6 / max(1, len(toks) - 1), toks

    fe, fc = gen(eager, n_decode), gen(comp, n_decode)      # warm-up: traces, verification, JIT
    if fe[2] != fc[2]:
        raise SystemExit(f"compiled tokens differ from eager: {fc[2]} vs {fe[2]}")
    pe, pc, de, dc = [], [], [], []
    for _ in range(rounds):
        a, b = gen(eager, n_decode), gen(comp, n_decode)
        if a[2] != b[2]:
            raise SystemExit("compiled tokens differ from eager")
        pe.append(a[0]), pc.append(b[0]), de.append(a[1]), dc.append(b[1])
    for what, e, c, f in (("prefill", pe, pc, (fe[0], fc[0])), ("decode/token", de, dc, (fe[1], fc[1]))):
        me, mc = statistics.median(e), statistics.median(c)
        print(f"{what + ' (' + os.path.basename(path) + ')':<22} eager {me * 1e3:10.1f} us   compiled "
              f"{mc * 1e3:10.1f} us   ratio {me / mc:6.2f}x   (first generation: eager {f[0]:.1f} ms, "
              f"compiled {f[1]:.1f} ms)")
    for r in rs:
        for p in r.parts():
            print(f"  {p.label}: traces {p.trace_counts()}, compiled calls {p.counters['compiled_calls']}, "
                  f"eager calls {p.counters['eager_calls']}, poisoned {p.counters['poisoned'] or 'no'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--model", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "models", "out", "llama-tiny-fp32"))
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode", type=int, default=32)
    args = ap.parse_args()
    ortmlx.register()
    print(f"MLX {__import__('mlx.core').core.__version__}, JIT cache {os.environ.get('TMPDIR', '/tmp')}/mlx")
    bench_graph("general MLP", *mlp(), args.rounds, args.calls)
    bench_graph("general CNN", *cnn(), args.rounds, args.calls)
    if os.path.exists(os.path.join(args.model, "genai_config.json")):
        bench_llm(args.model, args.rounds, args.prompt_len, args.decode)
    else:
        print(f"LLM decode/prefill skipped: {args.model} not built (python models/build_llm.py --all-tiny)",
              file=sys.stderr)


if __name__ == "__main__":
    main()
