"""Command line of ortmlx.

    python -m ortmlx check MODEL.onnx [--device auto|cpu|gpu] [-o key=value ...] [--time]
    python -m ortmlx warmup MODEL_DIR [--max-length N] [--up-to L] [--device ...] [-o key=value ...]
    python -m ortmlx --version

check: the partition report (the groups MLX claims, every node left to the CPU EP with its reason).
Exit status: 0 when the session was made, 1 when the model could not be loaded or the session not be made.
--time also runs the model on random inputs (dynamic dimensions 1) on the MLX EP and on ORT's own EPs, prints
the median call times and the answers' largest difference, and says which EP is faster for it on this machine.
"""
from __future__ import annotations

import argparse
import os
import sys


def _version() -> str:
    import mlx.core as mx
    import onnxruntime as ort

    from . import __version__, mlx_backends
    return (f"ortmlx {__version__} (mlx {mx.__version__}{' ' + '+'.join(mlx_backends()) if mlx_backends() else ''}, "
            f"onnxruntime {ort.__version__})")


def _options(pairs: list[str], device: str | None, cmd: str) -> dict:
    from .ep.options import from_pairs
    opts = from_pairs(pairs, "-o", prog=f"ortmlx {cmd}: ")
    if device:
        opts["device"] = device
    return opts


def _ort_message(text: str) -> str:
    """ORT's exception text without its C++ source-location prefix, in one line."""
    text = " ".join(text.split())
    for mark in ("MLXExecutionProvider ", "[ONNXRuntimeError]"):
        at = text.find(mark)
        if at >= 0:
            return text[at:]
    return text


_NP_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
             "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8", "tensor(uint8)": "uint8",
             "tensor(bool)": "bool"}


def _feeds(sess) -> dict:
    """Random inputs for ``sess``: floats standard normal, integers and bools zero, dynamic dimensions 1."""
    import numpy as np
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sess.get_inputs():
        if i.type not in _NP_TYPES:
            raise ValueError(f"input {i.name!r} is a {i.type}: --time makes inputs of {', '.join(_NP_TYPES)}")
        t = np.dtype(_NP_TYPES[i.type])
        shape = [d if isinstance(d, int) and d >= 0 else 1 for d in i.shape]
        feeds[i.name] = rng.standard_normal(shape).astype(t) if t.kind == "f" else np.zeros(shape, t)
    return feeds


def _median_ms(sess, feeds, seconds: float = 1.0, warm: int = 4) -> float:
    """The median of single calls' times after ``warm`` calls (MLX traces and verifies in its first calls)."""
    import time
    for _ in range(warm):
        sess.run(None, feeds)
    times, end = [], time.perf_counter() + seconds
    while len(times) < 5 or (time.perf_counter() < end and len(times) < 1000):
        t = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 2]


def time_report(mlx, model: str) -> list[str]:
    """``check --time``: the MLX EP's session ``mlx`` against each of ORT's own EPs here on ``model`` (lines)."""
    import math

    import numpy as np
    import onnxruntime as ort

    from . import EP_NAME
    so = ort.SessionOptions()
    so.log_severity_level = 3
    feeds = _feeds(mlx)
    want = mlx.run(None, feeds)
    ms = {EP_NAME: _median_ms(mlx, feeds)}
    diffs = {}
    for ep in [e for e in ("CUDAExecutionProvider", "CPUExecutionProvider") if e in ort.get_available_providers()]:
        s = ort.InferenceSession(model, so, providers=[ep])
        got = s.run(None, feeds)
        diffs[ep] = max((float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                         for a, b in zip(want, got) if np.asarray(a).size), default=0.0)
        ms[ep] = _median_ms(s, feeds)
    lines = ["time (random inputs, dynamic dimensions 1; medians of single calls after 4 warm-up calls):"]
    # Four significant digits, and the hint's ratio is taken from the printed times so the two agree.
    places = {ep: max(0, 3 - math.floor(math.log10(t))) if t > 0 else 3 for ep, t in ms.items()}
    ms = {ep: round(t, places[ep]) for ep, t in ms.items()}
    for ep, t in ms.items():
        d = f"   max |MLX EP - {ep}| {diffs[ep]:.3g}" if ep in diffs else ""
        lines.append(f"  {ep:24s} {t:10.{places[ep]}f} ms{d}")
    others = {ep: t for ep, t in ms.items() if ep != EP_NAME}
    if others:
        best = min(others, key=others.get)
        ratio = ms[EP_NAME] / others[best]
        if ratio > 1:
            lines.append(f"hint: on this machine {best} runs this model {ratio:.2f}x faster than the MLX EP "
                         f"(providers=['{best}'])")
        else:
            lines.append(f"hint: on this machine the MLX EP runs this model {1 / ratio:.2f}x faster than {best}")
    return lines


def _check(args) -> int:
    import onnxruntime as ort

    from . import EP_NAME, partition_reports, register
    from .ep.provider import REPORTS

    if not os.path.isfile(args.model):
        print(f"ortmlx check: no such file: {args.model}", file=sys.stderr)
        return 1
    register(genai=False)
    REPORTS.clear()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    failed = sess = None
    try:
        # enable_fallback=0: an MLX EP that cannot be created is an error here, not a silent CPU-EP session
        opts = _options(args.option, args.device, "check")
        sess = ort.InferenceSession(args.model, so, providers=[(EP_NAME, opts)], enable_fallback=0)
    except Exception as e:  # noqa: BLE001 - the report (if any) is still printed
        failed = _ort_message(str(e))
    reports = partition_reports()
    total = claimed = 0
    for rep in reports:
        print(rep.format())
        total += rep.n_nodes
        claimed += rep.n_claimed
    if reports:
        left = total - claimed
        print(f"total: {claimed}/{total} nodes on MLX, {left} on the CPU EP")
        counts: dict = {}
        for rep in reports:
            for u in rep.unclaimed:
                counts[(u.op, u.reason)] = counts.get((u.op, u.reason), 0) + 1
        if counts:
            print("left on the CPU EP by reason:")
            for (op, reason), n in sorted(counts.items(), key=lambda kv: -kv[1]):
                print(f"  {n:4d} x {op}: {reason}")
    if failed:
        print(f"ortmlx check: the session could not be made: {failed}", file=sys.stderr)
        return 1
    if not reports:
        print("ortmlx check: the MLX EP saw no graph", file=sys.stderr)
        return 1
    if not args.time and sys.platform.startswith("linux") and any(r.device == "cpu" for r in reports):
        print("hint: on a Linux CPU ORT's own CPU EP runs most models faster than MLX's CPU backend "
              "(docs/performance.md); --time measures this model on both")
    if args.time:
        try:
            print("\n".join(time_report(sess, args.model)))
        except Exception as e:  # noqa: BLE001 - a model --time cannot feed is reported, not raised
            print(f"ortmlx check --time: {_ort_message(str(e))}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ortmlx",
                                description="ortmlx: ONNX Runtime's MLX execution provider, from the command line")
    p.add_argument("--version", action="store_true", help="print the versions of ortmlx, MLX and onnxruntime")
    sub = p.add_subparsers(dest="cmd")
    c = sub.add_parser("check", help="partition report of a model: what runs on MLX, what is left and why")
    c.add_argument("model", help="an .onnx file")
    c.add_argument("--device", choices=["auto", "cpu", "gpu"], default=None)
    c.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a provider option (repeatable), e.g. -o disable_ops=LSTM")
    c.add_argument("--time", action="store_true",
                   help="also time the model on the MLX EP and on ORT's own EPs (random inputs) and say which is faster")
    w = sub.add_parser("warmup", help="build a genai model's compiled prompts and kernels ahead (MLX's kernel cache)")
    w.add_argument("model_dir", help="an onnxruntime-genai model folder (genai_config.json)")
    w.add_argument("--max-length", type=int, default=0,
                   help="the KV buffer length the application uses (default: genai_config's search.max_length)")
    w.add_argument("--up-to", type=int, default=4096, help="the longest prompt to prepare (default 4096)")
    w.add_argument("--device", choices=["auto", "cpu", "gpu"], default=None)
    w.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE", help="a provider option")
    args = p.parse_args(argv)
    if args.version:
        print(_version())
        return 0
    if args.cmd == "check":
        return _check(args)
    if args.cmd == "warmup":
        from . import warmup
        args.options = _options(args.option, None, "warmup")
        return warmup.main(args)
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
