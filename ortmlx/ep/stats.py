"""Per-session counters and timings (the verbose summary and the trace read them)."""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import defaultdict


class SessionStats:
    def __init__(self, device: str):
        self.device = device
        self.lock = threading.Lock()
        self.calls = 0
        self.fallbacks: list[tuple[str, str]] = []
        self.time_ns: dict[str, int] = defaultdict(int)
        self.report = None
        self.groups: dict[str, dict] = {}

    @contextlib.contextmanager
    def span(self, what: str, **args):
        t0 = time.perf_counter_ns()
        try:
            yield
        finally:
            dt = time.perf_counter_ns() - t0
            with self.lock:
                self.time_ns[what] += dt

    def add_time(self, what: str, ns: int) -> None:
        with self.lock:
            self.time_ns[what] += ns

    def summary(self) -> str:
        lines = [f"MLXExecutionProvider session summary (device {self.device})"]
        if self.report is not None:
            lines.append(self.report.format())
        lines.append(f"  compute calls: {self.calls}")
        for k, v in sorted(self.time_ns.items()):
            lines.append(f"  time {k}: {v / 1e6:.3f} ms")
        for g, info in self.groups.items():
            lines.append(f"  group {g}: {info}")
        for where, why in self.fallbacks[:20]:
            lines.append(f"  eager fallback in {where}: {why}")
        return "\n".join(lines)

    def finish(self, options) -> None:
        if options.verbose:
            sys.stderr.write(self.summary() + "\n")
