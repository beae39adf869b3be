"""Compiled fast paths (``mx.compile``) over whole claimed subgraphs.

``make_runner(program, options, stats)`` returns the group's ``Runner`` (``result.py``): a
``CompiledSubgraph`` (general strategy), an ``AttentionRunner`` (decode and prefill) or, when
compilation is off or no strategy takes the group, the eager program (``EagerRunner``). See
docs/compiled.md.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

from .analysis import is_attention, static_reason
from .attention import AttentionRunner, traced_overrides
from .config import DECODE, GENERAL, PREFILL, SHAPE_KEYED, SHAPELESS, CompiledConfig
from .core import TRACE_LOCK, CompiledSubgraph, tracing
from .mode import apply_compile_mode
from .result import EagerRunner, Prebuild, RowHints, Runner, RunnerOptions, RunResult
from ..stats import SessionStats

__all__ = ["make_runner", "release_all", "runners", "capture", "stats", "tracing", "CompiledSubgraph",
           "CompiledConfig", "GENERAL", "PREFILL", "DECODE", "SHAPELESS", "SHAPE_KEYED", "TRACE_LOCK", "Runner",
           "RunResult", "RowHints", "EagerRunner", "Prebuild", "RunnerOptions"]

_LOCK = threading.Lock()
_RUNNERS: "weakref.WeakSet" = weakref.WeakSet()
_CAPTURES: list[list] = []


def choose(program, options: RunnerOptions | None) -> tuple[CompiledConfig | str | None, str]:
    """The strategy for a group and why (config None: run eagerly)."""
    if options is None or not options.compile_enabled:
        return None, "compilation off (no_compile / compile_mode=disabled)"
    reason = static_reason(program)
    if reason:
        return None, reason
    if is_attention(program):
        if not options.compiles("decode") and not options.compiles("prefill"):
            return None, "decode and prefill compilation off (no_compile=decode,prefill)"
        return "attention", "attention"
    if not options.compiles("general"):
        return None, "general compilation off (no_compile=general)"
    return GENERAL, "general"


def make_runner(program, options: RunnerOptions | None, stats: SessionStats | None = None,
                prebuild: Prebuild | None = None) -> Runner:
    """The runner of one group; ``prebuild``: where its new closures' kernels may be built meanwhile (a GPU's)."""
    config, why = choose(program, options)
    if config is not None:
        why = apply_compile_mode(options.tuning.compile_mode)
        if why:
            config = None
    if config is None:
        if stats is not None:
            stats.group(program.graph.name)["compiled"] = f"no ({why})"
        return EagerRunner(program)
    if config == "attention":
        runner = AttentionRunner(program, options, stats)
    else:
        runner = CompiledSubgraph(program, config, stats, traced_overrides(program, None), tuning=options.tuning)
    if prebuild is not None:
        for part in runner.parts():
            part.prebuild = prebuild
    _track(runner)
    return runner


def _track(runner) -> None:
    with _LOCK:
        _RUNNERS.add(runner)
        for cap in _CAPTURES:
            cap.append(runner)


def runners() -> list[CompiledSubgraph]:
    """Every live compiled runner of this process."""
    with _LOCK:
        return list(_RUNNERS)


@contextlib.contextmanager
def capture():
    """Collect the compiled runners created inside the block (tests: ``with capture() as rs: session(...)``)."""
    got: list = []
    with _LOCK:
        _CAPTURES.append(got)
    try:
        yield got
    finally:
        with _LOCK:
            _CAPTURES.remove(got)


def stats() -> dict:
    """Counters summed over the live runners, plus the number of runners per strategy."""
    out: dict = {"runners": 0}
    for r in parts():
        out["runners"] += 1
        out[f"runners_{r.config.name}"] = out.get(f"runners_{r.config.name}", 0) + 1
        for k, v in r.counters.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out


def parts() -> list[CompiledSubgraph]:
    """Every live CompiledSubgraph (an attention runner's decode and prefill closures separately)."""
    return [p for r in runners() for p in r.parts()]


def release_all() -> None:
    """Drop every compiled closure (called at interpreter exit)."""
    for r in runners():
        try:
            r.release()
        except Exception:  # noqa: BLE001 - exit cleanup must not raise
            pass
