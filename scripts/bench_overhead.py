"""Per-run overhead of the MLX EP over ORT's CPU EP on a tiny 2-node [1,4] graph.

Both sessions run side by side in one process, interleaved in rounds so that
machine noise hits both alike; prints medians and the difference/ratio.
Usage: python scripts/bench_overhead.py [--runs 2000] [--device cpu|gpu]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

import ortmlx


def tiny_model() -> bytes:
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4])
    g = helper.make_graph([helper.make_node("Add", ["X", "X"], ["a"]), helper.make_node("Mul", ["a", "X"], ["Y"])],
                          "tiny", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()


def per_run_us(sess, feeds, n: int) -> float:
    run = sess.run
    t0 = time.perf_counter_ns()
    for _ in range(n):
        run(None, feeds)
    return (time.perf_counter_ns() - t0) / n / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    ortmlx.register(genai=False)
    model = tiny_model()
    opts = {"device": args.device} if args.device else {}
    mlx_s = ort.InferenceSession(model, providers=[("MLXExecutionProvider", opts)])
    cpu_s = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    feeds = {"X": np.arange(4, dtype=np.float32).reshape(1, 4)}
    np.testing.assert_array_equal(mlx_s.run(None, feeds)[0], cpu_s.run(None, feeds)[0])
    for s in (mlx_s, cpu_s):
        per_run_us(s, feeds, 200)
    m, c = [], []
    for _ in range(args.rounds):
        m.append(per_run_us(mlx_s, feeds, args.runs // args.rounds))
        c.append(per_run_us(cpu_s, feeds, args.runs // args.rounds))
    mm, cm = statistics.median(m), statistics.median(c)
    print(f"CPU EP {cm:.1f} us/run | MLX EP {mm:.1f} us/run | overhead {mm - cm:+.1f} us | ratio {mm / cm:.2f}x")


if __name__ == "__main__":
    main()
