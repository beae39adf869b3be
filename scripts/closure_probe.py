"""How much of a decode token is MLX's own work: the compiled decode closure replayed alone.

    python scripts/closure_probe.py MODEL_DIR [--tokens 48] [--replays 200] [--option device=gpu] [--dot F]

Runs a greedy genai generation on the MLX EP and keeps the decode closure and its device
inputs of one steady call. Then, in the same process and interleaved in rounds, it times
(a) a genai token (the whole step: genai, the EP's Python, the closure) and (b) the closure
alone: the replay call (building the lazy graph from the compiled tape) and ``mx.eval``.
Prints the closure's primitive counts (from ``mx.export_to_dot``): all, and those that are
not views (reshape/transpose/slice...: no kernel), and the share of the token the EP adds.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, HERE)

#: primitives that make no kernel when their input is contiguous (views, metadata)
VIEWS = {"Reshape", "Transpose", "Flatten", "Unflatten", "Slice", "Squeeze", "ExpandDims", "View",
         "Broadcast", "BroadcastAxes", "AsStrided", "Split", "StopGradient", "Depends"}


def primitive_counts(outs) -> collections.Counter:
    import mlx.core as mx
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outs)
        text = open(f.name).read()
    return collections.Counter(lab.split()[0] for lab in re.findall(r'label ="([^"]*)"', text))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--replays", type=int, default=100, help="closure replays per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--option", action="append", default=[], help="MLX EP option key=value")
    ap.add_argument("--dot", help="also write the closure's graph here (mx.export_to_dot)")
    args = ap.parse_args(argv)

    import mlx.core as mx
    import numpy as np
    import onnxruntime_genai as og

    from ortmlx import genai as mg
    from ortmlx.compiled import core

    kept = {}
    apply = core.CompiledSubgraph._apply

    def spy(self, c, call, probe):
        # a steady decode call of a trusted closure: keep the closure and the device inputs it gets
        if c.trusted and c.calls >= 3 and "fn" not in kept and c.fn is not None:
            ins = call.inputs
            dev = self._upload(c, list(c.pick(ins)))
            if c.hoist:
                dev.extend(self._upload_hoisted(c, self._hoisted_values(c, ins)))
            mx.eval(*dev)
            kept.update(fn=c.fn, dev=dev)
        return apply(self, c, call, probe)

    core.CompiledSubgraph._apply = spy
    opts = dict(o.split("=", 1) for o in args.option)
    model, _ = mg.load_model(args.model_dir, "mlx", opts)
    ids = np.arange(100, 107, dtype=np.int32)

    def tokens(n: int) -> list[float]:
        g = og.Generator(model, mg.search_options(model, len(ids) + n, len(ids) + n))
        g.append_tokens(ids)
        out = []
        while not g.is_done():
            t = time.perf_counter()
            g.generate_next_token()
            out.append(time.perf_counter() - t)
        return out[len(out) // 2:]                       # steady state: the second half

    tokens(args.tokens)
    if "fn" not in kept:
        print("no trusted compiled decode closure ran (eager decode?): nothing to replay")
        return 1
    fn, dev = kept["fn"], kept["dev"]
    outs = fn(*dev)
    counts = primitive_counts(outs)
    if args.dot:
        mx.export_to_dot(args.dot, *outs)
    mx.eval(*outs)
    del outs
    step, call, ev = [], [], []
    for _ in range(args.rounds):
        step += tokens(args.tokens)
        for _ in range(args.replays):
            t0 = time.perf_counter()
            o = fn(*dev)
            t1 = time.perf_counter()
            mx.eval(*o)
            call.append(t1 - t0)
            ev.append(time.perf_counter() - t1)
        del o
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    total = sum(counts.values())
    views = sum(v for k, v in counts.items() if k in VIEWS)
    print(f"device {mx.default_device()}, MLX {mx.__version__}, model {os.path.basename(args.model_dir.rstrip('/'))}")
    print(f"closure: {total} primitives, {total - views} not views: "
          + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    c, e, s = ms(call), ms(ev), ms(step)
    print(f"token (genai step, median of {len(step)}): {s:.3f} ms")
    print(f"closure alone (median of {len(call)}): call {c:.3f} ms + eval {e:.3f} ms = {c + e:.3f} ms "
          f"({100 * (c + e) / s:.0f}% of the token; the rest, {s - c - e:.3f} ms, is genai + the EP)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
