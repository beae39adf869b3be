"""Chrome / Perfetto traces of MLX EP sessions (``ORTMLX_TRACE=path.json`` or the ``trace`` option).

Each session is one trace "process" (its own track group, named after the
session and its graph); each thread that ran it is one track. A session's
events are written when the session is released (and, for sessions still
alive, at interpreter exit). Several sessions tracing to the same path share the
file: it is rewritten whole, atomically, on every flush, so it is always valid
JSON. Open it in https://ui.perfetto.dev or chrome://tracing.

Per Compute call the tracer records contiguous stages: ``copy_in`` (gather ORT's
inputs), ``build`` (build the lazy MLX graph), ``eval`` (``mx.eval``) and
``copy_out`` (allocate ORT's outputs and copy), under one ``compute <group>``
event. A runner that cannot split its work shows one ``run`` stage instead.

Nothing here runs when tracing is off: callers hold ``None`` instead of a tracer.
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import threading
import time
import weakref

#: events kept per session; later ones are counted, not stored (a soak with tracing on stays bounded)
MAX_EVENTS = 500_000

_EPOCH_NS = time.perf_counter_ns()
_ids = itertools.count(1)
_files_lock = threading.Lock()
_files: dict[str, list[dict]] = {}           # path -> events already written there by released sessions
_live: "weakref.WeakSet[Tracer]" = weakref.WeakSet()


def now_ns() -> int:
    return time.perf_counter_ns()


def _us(ns: int) -> float:
    return (ns - _EPOCH_NS) / 1000.0


class Tracer:
    """Collects one session's events; ``flush()`` merges them into the trace file."""

    def __init__(self, path: str, label: str = "MLXExecutionProvider session"):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.sid = next(_ids)
        self.label = f"{label} #{self.sid}"
        self.os_pid = os.getpid()
        self.events: list[tuple] = []           # (ph, name, cat, ts_ns, dur_ns, tid, args)
        self.dropped = 0
        self.flushed = False
        self._tids: dict[int, int] = {}
        self._lock = threading.Lock()
        _live.add(self)

    # ------------------------------------------------------------------ recording
    def _tid(self) -> int:
        ident = threading.get_ident()
        t = self._tids.get(ident)
        if t is None:
            with self._lock:
                t = self._tids.setdefault(ident, len(self._tids) + 1)
                self.events.append(("M", "thread_name", "", 0, 0, t,
                                    {"name": f"{threading.current_thread().name} ({ident})"}))
        return t

    def _add(self, ev: tuple) -> None:
        if len(self.events) >= MAX_EVENTS:
            self.dropped += 1
            return
        self.events.append(ev)                  # list.append is atomic under the GIL

    def complete(self, name: str, cat: str, t0_ns: int, t1_ns: int, args: dict | None = None) -> None:
        """A finished interval [t0, t1] on the calling thread's track."""
        self._add(("X", name, cat, t0_ns, t1_ns - t0_ns, self._tid(), args))

    def instant(self, name: str, cat: str, args: dict | None = None) -> None:
        self._add(("i", name, cat, now_ns(), 0, self._tid(), args))

    def rename(self, label: str) -> None:
        self.label = f"{label} #{self.sid}"

    # ------------------------------------------------------------------ output
    def chrome_events(self) -> list[dict]:
        pid = self.sid
        out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": self.label}},
               {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
                "args": {"labels": f"os pid {self.os_pid}"}}]
        for ph, name, cat, t0, dur, tid, args in list(self.events):
            ev = {"ph": ph, "name": name, "pid": pid, "tid": tid}
            if ph != "M":
                ev["cat"] = cat
                ev["ts"] = _us(t0)
            if ph == "X":
                ev["dur"] = dur / 1000.0
            elif ph == "i":
                ev["s"] = "t"
            if args:
                ev["args"] = args
            out.append(ev)
        if self.dropped:
            out.append({"ph": "i", "name": f"{self.dropped} events dropped (MAX_EVENTS={MAX_EVENTS})",
                        "cat": "ortmlx", "pid": pid, "tid": 0, "ts": _us(now_ns()), "s": "p"})
        return out

    def flush(self) -> None:
        """Merge this session's events into its file (once) and rewrite the file atomically."""
        if self.flushed:
            return
        self.flushed = True
        events = self.chrome_events()
        self.events = []
        with _files_lock:
            merged = _files.setdefault(self.path, [])
            merged.extend(events)
            doc = {"traceEvents": merged, "displayTimeUnit": "ms",
                   "otherData": {"producer": "ortmlx", "os_pid": self.os_pid}}
            d = os.path.dirname(self.path)
            if d:
                os.makedirs(d, exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self.path)


def forget(path: str) -> None:
    """Drop what this process already wrote to ``path`` (the next flush starts the file afresh)."""
    with _files_lock:
        _files.pop(os.path.abspath(os.path.expanduser(path)), None)


@atexit.register
def _flush_live() -> None:
    for t in list(_live):
        try:
            t.flush()
        except Exception:  # noqa: BLE001 - never fail interpreter exit over a trace file
            pass


class Probe:
    """One observed Compute call: contiguous stages, each closed by the next ``mark``.

    Also the place where stage faults are injected (the ``fault`` option), so a
    fault at ``eval`` is raised exactly where ``mx.eval`` would have failed.
    """

    __slots__ = ("tracer", "stats", "group", "stage", "t", "t_start", "split")

    def __init__(self, tracer: Tracer | None, stats, group: str):
        self.tracer = tracer
        self.stats = stats
        self.group = group
        self.stage = None
        self.t_start = self.t = now_ns()
        self.split: dict[str, int] = {}

    def mark(self, stage: str | None) -> None:
        """Close the current stage and open ``stage`` (None: just close)."""
        t = now_ns()
        if self.stage is not None:
            self.split[self.stage] = self.split.get(self.stage, 0) + (t - self.t)
            if self.tracer is not None:
                self.tracer.complete(self.stage, "compute", self.t, t)
        self.stage, self.t = stage, t
        if stage is not None and stage != "copy_out" and self.stats.faults is not None:
            self.stats.fault(stage, self.group)

    def fault_point(self, stage: str) -> None:
        """A fault check inside a stage (copy_out fires once output 0 is allocated)."""
        if self.stats.faults is not None:
            self.stats.fault(stage, self.group)

    def finish(self, ok: bool, error: BaseException | None = None) -> None:
        self.mark(None)
        t = now_ns()
        if self.tracer is not None:
            args = {"group": self.group}
            if error is not None:
                args["error"] = f"{type(error).__name__}: {error}"[:500]
            self.tracer.complete(f"compute {self.group}", "compute", self.t_start, t, args)
        self.stats.record_call(self.group, self.split, t - self.t_start, ok)
