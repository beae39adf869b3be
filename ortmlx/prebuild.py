"""The kernel-build worker (``runtime/prebuild.py`` starts it): ``python -m ortmlx.prebuild``.

Reads messages on stdin (``read_msg``: a length, then a pickle): first ``{"model": path, "options": {...}}`` (an
ORT session of that model on the MLX EP, building in its own calls: tuning ``build_behind=0``), then
``{"feeds": {name: array | ("zeros", shape, dtype)}, "record": ledger line | None, "calls": n}`` per job, each run
``n`` times (a general group's key is traced at its second call; a replayed decode key's replay is recorded,
checked and served within ``compiled.replay.WARM_CALLS``), then its line written into the ledger; answers
``("ready",)``, ``("done",)`` or ``("failed", why)`` on stdout. Its kernels land in MLX's kernel cache, shared
with the process that started it. Ends at the end of its input, on one it cannot read, after ``IDLE_S`` without a
job, when its answer finds no reader (the process that started it has exited: the job is done first), or after
``JOB_TIMEOUT_S`` in one job.
"""
from __future__ import annotations

import os
import signal
import sys

from .runtime.prebuild import IDLE_S, JOB_TIMEOUT_S, read_msg, record_built, write_msg


def _session(path: str, options: dict):
    import onnxruntime as ort

    from . import EP_NAME, register
    register(genai=False)
    opts = dict(options)
    opts["tuning"] = ",".join(x for x in (opts.get("tuning", ""), "build_behind=0") if x)
    return ort.InferenceSession(path, ort.SessionOptions(), providers=[(EP_NAME, opts)])


def _alarm(seconds: int) -> None:
    """End this process after ``seconds`` (0: no longer), where the platform has SIGALRM."""
    if hasattr(signal, "alarm"):
        signal.alarm(seconds)


def _feeds(spec: dict) -> dict:
    import numpy as np
    return {n: np.zeros(v[1], np.dtype(v[2])) if isinstance(v, tuple) else v for n, v in spec.items()}


def run_job(sess, job: dict) -> None:
    """A job's call, as many times as it asks (the client's ``Worker.run`` always says), then its ledger line."""
    feeds = _feeds(job["feeds"])
    for _ in range(int(job["calls"])):
        sess.run(None, feeds)
    if job.get("record"):
        record_built(job["record"])


def main() -> int:
    # the replies own the real stdout; anything printed on the way goes to stderr
    out = os.dup(1)
    os.dup2(2, 1)

    def send(*msg) -> None:
        write_msg(out, msg)
    try:
        hello = read_msg(0)
        if hello is None:
            return 0
        sess = _session(hello["model"], hello["options"])
    except Exception as e:  # noqa: BLE001 - said to the parent, which builds its kernels itself
        send("failed", f"session: {type(e).__name__}: {str(e).strip()[:300]}")
        return 1
    send("ready")
    while True:
        try:
            job = read_msg(0, IDLE_S)
        except TimeoutError:
            return 0
        if job is None:
            return 0
        # a job left to this worker by an exited process is bounded here (SIGALRM's default ends the process)
        _alarm(max(1, int(JOB_TIMEOUT_S)))
        try:
            run_job(sess, job)
            answer = ("done",)
        except Exception as e:  # noqa: BLE001
            answer = ("failed", f"{type(e).__name__}: {str(e).strip()[:300]}")
        _alarm(0)
        try:
            send(*answer)
        except OSError:                 # no reader: the process that started it has exited
            return 0


if __name__ == "__main__":
    sys.exit(main())
