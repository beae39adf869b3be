"""Per-session counters and timings (the verbose summary and the trace read them).

Interface for the rest of the EP (keep it compatible):

- ``stats.span(what, **args)``: context manager timing a stage (claim, compile, trace ...);
  also a trace event when tracing.
- ``stats.fallback(where, why)``: a group (or part of it) ran eagerly instead of compiled;
  kept in ``stats.fallbacks`` (list of ``(where, why)``) and shown in the summary/trace.
- ``stats.group(name)``: the mutable dict of facts about one group (``stats.groups[name]``).
  Conventional keys the summary understands: ``compiled`` (bool or a str kind),
  ``traces`` (int: how many times ``mx.compile`` traced), ``poisoned`` (str: why the
  compiled closure was abandoned), ``calls`` / ``time_ns`` / ``split_ns`` (filled here).
- ``stats.fault(stage, node)``: testing hook, raises ``InjectedFault`` when the ``fault`` option
  targets ``stage`` (and ``node``); ``stats.faults`` is None when no fault is set, so
  ``if stats.faults is not None: stats.fault(...)`` costs one attribute read.
- ``stats.tracer``: None, or an ``ortmlx.trace.Tracer`` (the ``trace`` option).
- ``stats.observed``: True when per-call timing is wanted (trace, verbose or a per-call fault).
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import defaultdict

from .trace import Tracer

from .errors import InjectedFault, UserError

#: stages the ``fault`` option can target; aliases map to their canonical name
FAULT_STAGES = ("getcapability", "compile", "compute", "copy_in", "build", "run", "trace", "eval", "copy_out")
_FAULT_ALIASES = {"copyout": "copy_out", "copyin": "copy_in", "capability": "getcapability"}
#: stages checked inside a Compute call (they need the observed compute path)
CALL_STAGES = frozenset({"compute", "copy_in", "build", "run", "eval", "copy_out"})


class FaultSpec:
    """``stage[:node][#count]``: raise at ``stage`` (for ``node`` only, the first ``count`` times only).

    ``node`` is a fused group's name or the name of any node inside the group.
    """

    def __init__(self, text: str):
        spec, _, count = text.strip().partition("#")
        stage, _, node = spec.partition(":")
        stage = _FAULT_ALIASES.get(stage.strip().lower(), stage.strip().lower())
        if stage not in FAULT_STAGES:
            raise UserError(f"tuning fault={text!r}: stage {stage!r} is not one of {', '.join(FAULT_STAGES)}")
        try:
            self.remaining = int(count) if count.strip() else -1
        except ValueError:
            raise UserError(f"tuning fault={text!r}: count {count!r} is not an integer") from None
        self.stage = stage
        self.node = node.strip()
        self.hits = 0
        self.lock = threading.Lock()

    def fire(self, stage: str, node: str, members: frozenset = frozenset()) -> bool:
        """``node`` is the fused group's name; ``members`` the names of the nodes in it."""
        if stage != self.stage or (self.node and self.node != node and self.node not in members):
            return False
        with self.lock:
            if self.remaining == 0:
                return False
            if self.remaining > 0:
                self.remaining -= 1
            self.hits += 1
            return True


class SessionStats:
    def __init__(self, device: str, trace: str = "", verbose: bool = False, fault: str = ""):
        self.device = device
        self.lock = threading.Lock()
        self.calls = 0
        self.failed_calls = 0
        self.fallbacks: list[tuple[str, str]] = []
        self.time_ns: dict[str, int] = defaultdict(int)
        self.reports: list = []
        self.groups: dict[str, dict] = {}
        self.group_nodes: dict[str, frozenset] = {}     # fused group name -> names of its nodes
        self.tracer = None
        self.faults: FaultSpec | None = None
        if fault:
            self.faults = FaultSpec(fault)
        if trace:
            self.tracer = Tracer(trace, f"MLXExecutionProvider ({device})")
        self.verbose = verbose
        #: whether Compute takes the observed (timed) path
        self.observed = bool(self.tracer is not None or self.verbose
                             or (self.faults is not None and self.faults.stage in CALL_STAGES))
        self.finished = False

    # ------------------------------------------------------------------ compat
    @property
    def report(self):
        return self.reports[-1] if self.reports else None

    @report.setter
    def report(self, rep) -> None:
        if rep is None:
            return
        self.reports = [r for r in self.reports if r.graph != rep.graph] + [rep]
        if self.tracer is not None and len(self.reports) == 1:
            self.tracer.rename(f"MLXExecutionProvider ({self.device}) graph '{rep.graph}'")
        if self.tracer is not None:
            self.tracer.instant("partition", "claim", {"graph": rep.graph, "claimed": rep.n_claimed,
                                                       "nodes": rep.n_nodes, "groups": len(rep.groups),
                                                       "cpu": [f"{u.op} '{u.node}': {u.reason}"
                                                               for u in rep.unclaimed[:200]]})

    # ------------------------------------------------------------------ recording
    @contextlib.contextmanager
    def span(self, what: str, **args):
        t0 = time.perf_counter_ns()
        err = None
        try:
            yield
        except BaseException as e:
            err = e
            raise
        finally:
            t1 = time.perf_counter_ns()
            with self.lock:
                self.time_ns[what] += t1 - t0
            if self.tracer is not None:
                if err is not None:
                    args = {**args, "error": f"{type(err).__name__}: {err}"[:500]}
                self.tracer.complete(what, "session", t0, t1, {k: str(v) for k, v in args.items()} or None)

    def add_time(self, what: str, ns: int) -> None:
        with self.lock:
            self.time_ns[what] += ns

    def fallback(self, where: str, why: str) -> None:
        """Record that ``where`` runs eagerly (not compiled) and why."""
        with self.lock:
            self.fallbacks.append((where, why))
            del self.fallbacks[:-1000]
        if self.tracer is not None:
            self.tracer.instant(f"eager fallback {where}", "fallback", {"where": where, "why": why})

    def group(self, name: str) -> dict:
        with self.lock:
            return self.groups.setdefault(name, {})

    def record_call(self, group: str, split: dict[str, int], total_ns: int, ok: bool) -> None:
        """One observed Compute call (the unobserved path only counts ``calls``)."""
        with self.lock:
            g = self.groups.setdefault(group, {})
            g["observed_calls"] = g.get("observed_calls", 0) + 1
            g["time_ns"] = g.get("time_ns", 0) + total_ns
            sp = g.setdefault("split_ns", {})
            for k, v in split.items():
                sp[k] = sp.get(k, 0) + v
                self.time_ns[f"compute.{k}"] += v
            self.time_ns["compute"] += total_ns
            if not ok:
                self.failed_calls += 1
                g["failed"] = g.get("failed", 0) + 1

    def group_released(self, group: str, calls: int) -> None:
        with self.lock:
            self.groups.setdefault(group, {})["calls"] = calls

    def fault(self, stage: str, node: str = "") -> None:
        """Testing hook: raise when the ``fault`` option targets this stage (and node)."""
        f = self.faults
        if f is not None and f.fire(stage, node, self.group_nodes.get(node, frozenset())):
            raise InjectedFault(f"injected fault at {stage}" + (f" in {node}" if node else ""), node=node or None)

    # ------------------------------------------------------------------ output
    def summary(self) -> str:
        lines = [f"MLXExecutionProvider session summary (device {self.device})"]
        for rep in self.reports:
            lines.append(rep.format())
        if not self.reports:
            lines.append("  no graph was partitioned")
        lines.append(f"  compute calls: {self.calls}" + (f" ({self.failed_calls} failed)" if self.failed_calls else ""))
        total = {k: v for k, v in self.time_ns.items()}
        for k in ("claim", "compile", "trace", "compute"):
            if k in total:
                lines.append(f"  time {k}: {total.pop(k) / 1e6:.3f} ms")
        comp = self.time_ns.get("compute", 0)
        for k, v in sorted(total.items()):
            share = f" ({100.0 * v / comp:.1f}% of compute)" if k.startswith("compute.") and comp else ""
            lines.append(f"  time {k}: {v / 1e6:.3f} ms{share}")
        for g, info in self.groups.items():
            parts = [f"calls {info.get('calls', info.get('observed_calls', 0))}"]
            if "compiled" in info:
                parts.append(f"compiled {info['compiled']}")
            if "traces" in info:
                parts.append(f"traces {info['traces']}")
            if info.get("poisoned"):
                parts.append(f"poisoned: {info['poisoned']}")
            if info.get("failed"):
                parts.append(f"failed {info['failed']}")
            calls = info.get("observed_calls", 0)
            if calls:
                parts.append(f"mean {info.get('time_ns', 0) / calls / 1e3:.1f} us/call")
                sp = info.get("split_ns", {})
                parts.append("split " + ", ".join(f"{k} {v / calls / 1e3:.1f}" for k, v in sp.items()) + " us")
            extra = {k: v for k, v in info.items() if k not in
                     ("calls", "observed_calls", "compiled", "traces", "poisoned", "failed", "time_ns", "split_ns")}
            if extra:
                parts.append(", ".join(f"{k}={v}" for k, v in extra.items()))
            lines.append(f"  group {g}: " + "; ".join(parts))
        if self.fallbacks:
            lines.append(f"  eager fallbacks: {len(self.fallbacks)}")
        for where, why in self.fallbacks[:20]:
            lines.append(f"    {where}: {why}")
        if len(self.fallbacks) > 20:
            lines.append(f"    ... {len(self.fallbacks) - 20} more")
        if self.faults is not None:
            lines.append(f"  injected faults ({self.faults.stage}"
                         f"{':' + self.faults.node if self.faults.node else ''}): {self.faults.hits}")
        if self.tracer is not None:
            lines.append(f"  trace: {self.tracer.path}")
        return "\n".join(lines)

    def finish(self) -> None:
        """Session release: print the summary (verbose) and write the trace. Runs once."""
        if self.finished:
            return
        self.finished = True
        if self.tracer is not None:
            try:
                self.tracer.flush()
            except Exception as e:  # noqa: BLE001 - a trace file we cannot write must not fail the release
                sys.stderr.write(f"MLXExecutionProvider: cannot write trace {self.tracer.path}: {e}\n")
        if self.verbose:
            sys.stderr.write(self.summary() + "\n")
