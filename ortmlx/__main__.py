"""Command line: ``python -m ortmlx check model.onnx [--device cpu|gpu]``.

``check`` prints the partition report: the groups MLX claims and every node left
to the CPU EP with the reason (unsupported op / dtype / attribute / host input).
"""
from __future__ import annotations

import argparse
import sys


def _check(args) -> int:
    import onnxruntime as ort

    from . import EP_NAME, partition_reports, register
    from .ep.provider import REPORTS

    register(genai=False)
    REPORTS.clear()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    opts = {"device": args.device} if args.device else {}
    try:
        ort.InferenceSession(args.model, so, providers=[(EP_NAME, opts)])
    except Exception as e:  # noqa: BLE001 - the report is still useful when the session fails
        print(f"session creation failed: {e}", file=sys.stderr)
    reports = partition_reports()
    if not reports:
        print("the MLX EP saw no graph (did the model load?)", file=sys.stderr)
        return 1
    total = claimed = 0
    for rep in reports:
        print(rep.format())
        total += rep.n_nodes
        claimed += rep.n_claimed
    left = total - claimed
    print(f"total: {claimed}/{total} nodes on MLX, {left} on the CPU EP")
    if left:
        counts = {}
        for rep in reports:
            for u in rep.unclaimed:
                counts[(u.op, u.reason)] = counts.get((u.op, u.reason), 0) + 1
        print("left on the CPU EP by reason:")
        for (op, reason), n in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"  {n:4d} x {op}: {reason}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ortmlx", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="partition report of a model")
    c.add_argument("model")
    c.add_argument("--device", choices=["auto", "cpu", "gpu"], default=None)
    args = p.parse_args(argv)
    if args.cmd == "check":
        return _check(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
