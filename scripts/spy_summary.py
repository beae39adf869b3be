"""Where sampled time went: a py-spy raw (folded) profile summarised by frame.

    py-spy record --native -r 40 -d 55 -f raw -o spy.txt -- python3 LOOP.py ...   # (py-spy: pip install py-spy)
    python scripts/spy_summary.py spy.txt [--within ComputeInfo.compute] [--skip _first --skip nvrtc] [--top 50]

Keeps the samples whose stack has a frame named ``--within`` and none matching a ``--skip``
(by default: steady Compute calls, not first calls, not NVRTC's kernel compiles), then prints
each frame's inclusive share of them and the most common innermost frames (three deep). With
``--native`` py-spy names MLX's and CUDA's C++ frames too (a slow sampler: keep the rate low).
"""
from __future__ import annotations

import argparse
import collections
import sys


def frames(stack: str) -> list[str]:
    """Frame names of one folded stack, outermost first (file and address suffixes dropped)."""
    return [f.split(" (")[0] for f in stack.split(";")]


def summarise(lines, within: str, skip: list[str]):
    incl, leaves, n = collections.Counter(), collections.Counter(), 0
    for line in lines:
        line = line.rstrip("\n")
        if not line or " " not in line:
            continue
        stack, count = line.rsplit(" ", 1)
        if within not in stack or any(s in stack for s in skip):
            continue
        k = int(count)
        n += k
        names = frames(stack)
        for name in set(names):
            if not name.startswith("0x"):
                incl[name] += k
        named = [x for x in names if not x.startswith("0x")]
        leaves[" <- ".join(reversed(named[-3:]))] += k
    return n, incl, leaves


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="py-spy record -f raw output")
    ap.add_argument("--within", default="ComputeInfo.compute")
    ap.add_argument("--skip", action="append", default=None, help="drop stacks containing this (repeatable)")
    ap.add_argument("--top", type=int, default=50)
    args = ap.parse_args(argv)
    skip = ["_first", "nvrtc"] if args.skip is None else args.skip
    with open(args.profile) as f:
        n, incl, leaves = summarise(f, args.within, skip)
    if not n:
        print(f"no samples within {args.within!r} (skipping {skip})")
        return 1
    print(f"{n} samples within {args.within!r} (skipping {skip}); inclusive share by frame:")
    for name, k in incl.most_common(args.top):
        print(f"  {k:6d} {100 * k / n:5.1f}%  {name[:110]}")
    print("innermost frames (leaf <- caller <- caller):")
    for name, k in leaves.most_common(min(args.top, 25)):
        print(f"  {k:6d} {100 * k / n:5.1f}%  {name[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
