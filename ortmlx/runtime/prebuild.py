"""A new compiled closure's kernels built in another process while its key's calls answer without them (a GPU's
groups: eagerly, or by the key's program traced unfused, ``compiled/core.py`` ``_interim``).

MLX's CUDA backend builds a closure's kernels (NVRTC, one after another) in the closure's first evaluation: tens
of seconds on a new host while the user waited (docs/performance.md). A thread of this process building them
starved while the main one evaluated, so a worker process builds them: the same model file in an ORT session of
its own on the MLX EP with the same options (``python -m ortmlx.prebuild``), which makes each job's call (one new
key's) twice, as a general group traces a key at its second call (a decode key whose step is replayed: until its
replay serves, so its guard's kernels are built there too). Its large float inputs go as zeros (MLX names
a kernel by its graph, not by values); the rest exactly. MLX keeps what the worker builds in its kernel cache,
where this process's own trace of the key finds it once the job is done. A ledger in the cache lists the keys
built there (per model file, options and versions), so a later process traces those at once. A job in flight
when this process exits is left to the worker, which finishes it, writes its ledger line and ends: a short run
that left before its kernels were built leaves them for the next one.

Only for a group that is the whole model (its inputs are the model's): a call of the group is a call of the
model the worker can make.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..kernels import background
from ..version import __version__, mlx_cache_dir

#: inputs up to this many bytes go to the worker as they are; larger float ones as zeros of their shape
EXACT_BYTES = 1 << 20
#: the ledger's file in MLX's kernel cache
LEDGER = "ortmlx-prebuilt.txt"
#: the worker (the front layer's ``ortmlx/prebuild.py``)
WORKER_CMD = [sys.executable, "-m", "ortmlx.prebuild"]
#: times a worker makes a job's call unless told otherwise: a general group's key is traced at its second
#: (``eager_calls_before_trace``)
CALLS = 2
#: a job not done in this long is given up (the worker killed; the key is traced where it is next called)
JOB_TIMEOUT_S = 600.0
#: a worker with no job for this long ends (its copy of the model leaves the GPU); the next job starts another
IDLE_S = 60.0
#: how often a wait for the worker's answer looks whether this process is exiting (``Worker.detach``)
POLL_S = 0.25


@dataclass(frozen=True)
class ModelSource:
    """The model file ORT loaded (``Graph_GetModelPath``) and its graph inputs: what a worker needs to make a
    group's call again."""

    path: str
    inputs: tuple

    def covers(self, group_inputs) -> bool:
        """Whether a group with ``group_inputs`` takes exactly the model's inputs, and a second copy of the model
        fits beside this one (``fits``)."""
        return bool(self.path) and os.path.isfile(self.path) and set(group_inputs) == set(self.inputs) \
            and fits(model_bytes(self.path))


#: the share of the device's free memory (else of its whole memory) a worker's copy of the model may take
MEMORY_SHARE = 0.5


def model_bytes(path: str) -> int:
    """The model file's bytes and its external data's (files beside it named after it: ``model.onnx.data``)."""
    d, base = os.path.split(os.path.abspath(path))
    return sum(e.stat().st_size for e in os.scandir(d) if e.is_file() and e.name.startswith(base))


def fits(nbytes: int) -> bool:
    """Whether a worker's copy of ``nbytes`` of weights fits the device: ``MEMORY_SHARE`` of the free memory MLX
    reports, else of its whole memory (a device that reports neither: yes)."""
    import mlx.core as mx
    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001 - no report: nothing to go by
        return True
    room = info.get("free_memory") or info.get("total_memory") or info.get("memory_size") or 0
    return not room or nbytes <= MEMORY_SHARE * room


def _identity(path: str, options: dict) -> str:
    """What the kernels a key builds depend on besides the key: the model file, the EP's options, the versions."""
    st = os.stat(path)
    import mlx.core as mx
    text = repr((os.path.abspath(path), st.st_size, st.st_mtime_ns, sorted(options.items()), __version__,
                 _source_stamp(), mx.__version__))
    return hashlib.sha1(text.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def _source_stamp() -> int:
    """The newest modification time of ortmlx's sources (a checkout's edits change kernels, not the version)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return max((e.stat().st_mtime_ns for d, _, fs in os.walk(root) for e in os.scandir(d)
                if e.is_file() and e.name.endswith(".py")), default=0)


def _ledger_path() -> str:
    return os.path.join(mlx_cache_dir(), LEDGER)


def _ledger() -> set:
    try:
        with open(_ledger_path()) as f:
            return {line.strip() for line in f}
    except OSError:
        return set()


def record_built(sig: str) -> None:
    """Add ``sig`` to the ledger (a key whose kernels are in the cache)."""
    try:
        os.makedirs(mlx_cache_dir(), exist_ok=True)
        with open(_ledger_path(), "a") as f:       # (one short line per write: O_APPEND keeps writers apart)
            f.write(sig + "\n")
    except OSError:
        pass


def feed(a) -> object:
    """A job's value of one input: the array itself, or for a large float input ``("zeros", shape, dtype)``."""
    if a is None:
        return None
    a = np.asarray(a)
    if a.nbytes > EXACT_BYTES and a.dtype.kind == "f":
        return ("zeros", tuple(a.shape), a.dtype.str)
    return np.array(a)


def read_msg(fd: int, timeout: float | None = None):
    """One message (an 8-byte length, then its pickle) from ``fd``; None at its end; ``TimeoutError`` after
    ``timeout`` seconds with nothing to read."""
    if timeout is not None and not select.select([fd], [], [], timeout)[0]:
        raise TimeoutError
    head = _read(fd, 8)
    if head is None:
        return None
    body = _read(fd, struct.unpack("<Q", head)[0])
    return None if body is None else pickle.loads(body)


def write_msg(fd: int, msg) -> None:
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    data = struct.pack("<Q", len(body)) + body
    while data:
        data = data[os.write(fd, data):]


def _read(fd: int, n: int) -> bytes | None:
    parts = []
    while n:
        b = os.read(fd, min(n, 1 << 24))
        if not b:
            return None
        parts.append(b)
        n -= len(b)
    return b"".join(parts)


class Worker:
    """One worker process for one model and options: started at its first job, jobs run one at a time."""

    def __init__(self, path: str, options: dict):
        self.path, self.options = path, options
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.dead = ""
        self.last = time.monotonic()
        self.busy = False               # a job given to the worker (its message sent), not yet answered
        self.detached = False           # this process is exiting: the job in flight is the worker's own

    def _start(self) -> None:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(WORKER_CMD, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        self._send({"model": self.path, "options": self.options})
        self._reply("ready")

    def _send(self, msg) -> None:
        try:
            write_msg(self.proc.stdin.fileno(), msg)
        except BrokenPipeError:
            raise RuntimeError(f"the kernel-build worker exited (rc {self.proc.wait()})") from None

    def _reply(self, want: str):
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while True:
            if self.detached:
                raise RuntimeError("this process is exiting; the kernel-build worker finishes the job on its own")
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise RuntimeError(f"the kernel-build worker took over {JOB_TIMEOUT_S:.0f} s")
            try:
                msg = read_msg(self.proc.stdout.fileno(), min(POLL_S, left))
                break
            except TimeoutError:
                continue
        if msg is None:
            raise RuntimeError(f"the kernel-build worker exited (rc {self.proc.wait()})")
        if msg[0] != want:
            raise RuntimeError(f"the kernel-build worker: {msg[-1]}")
        return msg

    def run(self, feeds: dict, record: str | None = None, calls: int | None = None) -> None:
        """Make the call of ``feeds`` in the worker (``calls`` times; None: ``CALLS``), which then writes ``record``
        into the ledger (raises on its failure; a worker that failed to start or died in a job fails every later
        job)."""
        with self.lock:
            if self.dead:
                raise RuntimeError(self.dead)
            if self.detached:
                raise RuntimeError("this process is exiting")
            if self.proc is not None and (self.proc.poll() is not None or time.monotonic() - self.last > IDLE_S / 2):
                self.stop()             # ended idle, or about to: a new one
                self.proc = None
            try:
                if self.proc is None:
                    self._start()
                self._send({"feeds": feeds, "record": record, "calls": calls or CALLS})
                self.busy = True
                self._reply("done")
            except (OSError, RuntimeError, pickle.PickleError) as e:
                if self.proc is not None and self.proc.poll() is not None:
                    self.dead = str(e)
                raise
            finally:
                self.busy = False
                self.last = time.monotonic()

    def stop(self) -> None:
        """Kill the worker (a job in flight fails: its closure is built where it is next called)."""
        p = self.proc
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()

    def detach(self) -> int | None:
        """At this process's exit: a worker in a job is left to finish it (its kernels and ledger line land in
        the cache for the next process), then to end at the end of its input; an idle one is killed. The pid of
        the one left, else None."""
        p = self.proc
        if p is None or p.poll() is not None:
            return None
        self.detached = True            # (the builder thread waiting for its answer gives up within POLL_S)
        if not self.busy:               # (idle, or still being given its job: its input may be in use)
            self.stop()
            return None
        try:
            p.stdin.close()
        except OSError:
            pass
        return p.pid


_WORKERS: dict = {}
_LOCK = threading.Lock()
_SAID: list = []


def _worker(path: str, options: dict) -> Worker:
    key = (path, tuple(sorted(options.items())))
    with _LOCK:
        w = _WORKERS.get(key)
        if w is None:
            w = _WORKERS[key] = Worker(path, options)
        return w


def stop_all() -> None:
    """At interpreter exit, before ``background`` waits for a build in flight (registered after it, so run
    first): idle workers killed, busy ones left to finish their job (``Worker.detach``), said once."""
    left = [pid for w in list(_WORKERS.values()) if (pid := w.detach()) is not None]
    if left:
        sys.stderr.write(f"MLXExecutionProvider: kernels for new shapes are still being built; process "
                         f"{', '.join(map(str, left))} finishes them into {mlx_cache_dir()} for the next run\n")


atexit.register(stop_all)


class WorkerPrebuild:
    """``compiled.Prebuild`` for one group: its calls' inputs (``bind``) become a worker's jobs."""

    def __init__(self, source: ModelSource, options: dict, input_names: list):
        self.path = source.path
        self.options = dict(options)
        self.names = list(input_names)
        self.ident = _identity(source.path, self.options)
        self._tls = threading.local()

    def bind(self, inputs: list) -> None:
        """The inputs of the group's call in progress (a job is made from them)."""
        self._tls.inputs = inputs

    def submit(self, label: str, key: str, calls: int | None = None) -> str | None:
        sig = hashlib.sha1(f"{self.ident} {label} {key}".encode()).hexdigest()
        if sig in _ledger():
            return None
        inputs = getattr(self._tls, "inputs", None)
        if inputs is None or len(inputs) != len(self.names):
            return None
        feeds = {n: feed(a) for n, a in zip(self.names, inputs) if a is not None}
        worker = _worker(self.path, self.options)

        def build():
            worker.run(feeds, record=sig, calls=calls)
        bkey = f"prebuild {sig}"
        background.submit(bkey, build)
        if not _SAID:
            _SAID.append(True)
            sys.stderr.write(f"MLXExecutionProvider: building MLX kernels for new shapes in a background process "
                             f"(on a host's first run, seconds to a minute; kept under {mlx_cache_dir()}); calls "
                             "answer without them meanwhile\n")
        return bkey
