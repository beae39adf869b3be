"""Kernel builds off the caller's thread: one persistent thread evaluates what makes MLX build a JIT kernel
(g++ on its CPU backend, NVRTC on CUDA) while the calls that need it answer another way meanwhile.

MLX keeps the kernels it builds process-wide (the CPU backend's libraries, the CUDA JIT module cache) but
compiled closures per thread, so a kernel built here is found by any thread's later trace of the same graph.
The thread never exits: MLX's thread-local state (compile cache entries holding Python objects) is destroyed
at thread exit after the thread's Python state is gone, which aborted processes (``compiled/core.py``,
``compile_thread``). At interpreter exit a build in flight is waited for (``EXIT_WAIT_S``), since MLX's
globals are destroyed under it otherwise.
"""
from __future__ import annotations

import atexit
import os
import queue
import threading
from typing import Callable

#: the longest the interpreter's exit waits for a build in flight (a g++ build takes seconds)
EXIT_WAIT_S = 120.0

QUEUED, DONE = "queued", "done"

_lock = threading.Lock()
_jobs: "queue.Queue[tuple[str, Callable[[], object]]]" = queue.Queue()
_state: dict[str, str] = {}
_idle = threading.Event()
_idle.set()
_thread: threading.Thread | None = None
_submitted = 0


def submit(key: str, build: Callable[[], object]) -> str:
    """Queue ``build`` under ``key`` unless it was queued before; ``key``'s state: ``QUEUED``, ``DONE`` or
    ``"failed: <why>"`` (a failed build is not retried)."""
    global _thread, _submitted
    with _lock:
        st = _state.get(key)
        if st is not None:
            return st
        _state[key] = QUEUED
        _submitted += 1
        _idle.clear()
        _jobs.put((key, build))     # (under the lock: the worker cannot find the queue empty and set idle first)
        if _thread is None:
            _thread = threading.Thread(target=_worker, name="ortmlx-kernel-builder", daemon=True)
            _thread.start()
    return QUEUED


def state(key: str) -> str | None:
    """``key``'s state (None: never submitted)."""
    return _state.get(key)


def done(key: str) -> bool:
    return _state.get(key) == DONE


def submitted() -> int:
    """How many builds were queued in this process so far (a caller's own count: before and after its calls)."""
    return _submitted


def wait(timeout: float | None = None) -> bool:
    """Wait until every submitted build has finished; False when ``timeout`` passed first."""
    return _idle.wait(timeout)


def _worker() -> None:
    while True:
        key, build = _jobs.get()
        try:
            build()
            st = DONE
        except BaseException as e:  # noqa: BLE001 - the caller keeps its other way; the reason is kept
            st = f"failed: {type(e).__name__}: {str(e).strip()[:200]}"
        with _lock:
            _state[key] = st
            if _jobs.empty():
                _idle.set()


def _after_fork() -> None:
    """A forked child has no builder thread: its first submit starts one; builds queued in the parent are gone."""
    global _thread, _jobs, _lock
    _thread, _jobs, _lock = None, queue.Queue(), threading.Lock()
    for k, st in list(_state.items()):
        if st == QUEUED:
            del _state[k]
    _idle.set()


atexit.register(lambda: wait(EXIT_WAIT_S))
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
