"""Long fuzz run: random graphs from the registered ops, MLX EP == CPU EP (see ortmlx/fuzz.py).

Runs hypothesis in rounds of ``--chunk`` examples with fresh seeds until
``--cases`` cases were tried or ``--minutes`` elapsed. A failing round is shrunk
by hypothesis to a minimal case, recorded, and the run goes on. Prints a JSON
summary (cases tried, outcomes, claimed nodes, ops covered, distinct failures
with their minimal cases); ``--out file.json`` also writes it.

    python scripts/fuzz.py --cases 3000                 # the long run (docs/reliability.md)
    python scripts/fuzz.py --minutes 10 --avoid-known   # skip the known differences from the CPU EP
    python scripts/fuzz.py --ops Add,Mul,Where --cases 500
    python scripts/fuzz.py --calls 6 --vary --minutes 10  # compiled closures, then new values of the same shapes
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter

from hypothesis import HealthCheck, given, seed, settings

from ortmlx import fuzz


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: no limit)")
    ap.add_argument("--chunk", type=int, default=200)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--ops", default="", help="comma-separated subset of ops")
    ap.add_argument("--max-nodes", type=int, default=6)
    ap.add_argument("--avoid-known", action="store_true", help="do not generate fuzz.KNOWN_BUGS cases")
    ap.add_argument("--options", default="", help="MLX provider options k=v,k=v")
    ap.add_argument("--calls", type=int, default=1,
                    help="run each MLX EP session this many times, every answer checked (> 2: compiled closures)")
    ap.add_argument("--vary", action="store_true", help="with --calls > 2: from the middle call on, every other "
                    "call on new values (fuzz.varied_feeds)")
    ap.add_argument("--half", action="store_true", help="every float32 value float16 instead (fuzz.half_case)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    ops = fuzz.fuzzable_ops(set(a.ops.split(",")) if a.ops else None)
    opts = dict(kv.split("=", 1) for kv in a.options.split(",") if kv) or None
    avoid = frozenset(fuzz.KNOWN_BUGS) if a.avoid_known else frozenset()
    tally: Counter = Counter()
    op_count: Counter = Counter()
    failures: dict[str, dict] = {}
    t0 = time.time()
    rnd = 0
    while tally["tried"] < a.cases and (not a.minutes or time.time() - t0 < a.minutes * 60):
        rnd += 1
        last: dict = {}

        @settings(max_examples=min(a.chunk, a.cases - tally["tried"]), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
        @seed(a.seed + rnd)
        @given(case=fuzz.cases(ops, a.max_nodes, avoid))
        def prop(case):
            tally["tried"] += 1
            case = fuzz.half_case(case) if a.half else case
            last["case"] = case
            out = fuzz.check_case(case, opts, a.calls, a.vary)
            tally["varied_calls"] += out.info.get("varied", 0)
            tally[out.status] += 1
            tally["nodes"] += out.nodes
            tally["claimed"] += out.claimed
            if out.status == "ok":
                op_count.update(case.ops)

        try:
            prop()
        except Exception as e:  # noqa: BLE001 - a found failure (hypothesis re-raises the shrunk one)
            case = last.get("case")
            msg = str(e).split("\n")[0][:300]
            key = " ".join(sorted(set(case.ops))) + " | " + re.sub(r"[0-9.e+-]+", "#", msg)[:120] if case else msg
            entry = failures.setdefault(key, {"count": 0, "seed": a.seed + rnd, "error": f"{type(e).__name__}: "
                                              f"{str(e)[:1500]}", "case": repr(case)[:3000]})
            entry["count"] += 1
            tally["failed_rounds"] += 1
        print(f"round {rnd}: tried {tally['tried']} ok {tally['ok']} failures {len(failures)} "
              f"({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    res = {"seed": a.seed, "cases_tried": tally["tried"], "ok": tally["ok"], "no_reference": tally["cpu_rejects"],
           "both_fail": tally["both_fail"], "nodes": tally["nodes"], "nodes_on_mlx": tally["claimed"],
           "ops": ops, "op_uses_ok": dict(op_count.most_common()), "avoid_known": a.avoid_known, "calls": a.calls,
           "vary": a.vary, "varied_calls": tally["varied_calls"], "half": a.half,
           "distinct_failures": len(failures), "failures": failures, "seconds": round(time.time() - t0, 1)}
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
