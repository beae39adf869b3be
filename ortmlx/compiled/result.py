"""What a runner is and returns: the contract between the compiled layer and the runtime above it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..tuning import Tuning


class RowHints:
    """What a trace declared about its aliased outputs (``decode_ops.add_row_hint``), evaluated:
    ``meta`` [(output j, input i, row shape, item size)] and ``data``: one flat byte array of the rows, then
    the distinct start arrays (int32 bytes, ``n_starts`` values); ``starts`` indexes those values for each
    hint's batch rows in turn (hints sharing one start array share its bytes): one round trip. ``data`` is
    an MLX array, or (written to host memory by the kernel) a NumPy array: the call's own, or with ``borrowed``
    a read-only view of the closure's host buffer, valid until the closure's next evaluation (a prompt's rows:
    tens of MB, which the call's copy-out writes before that; whoever keeps them longer copies them)."""

    __slots__ = ("meta", "data", "n_starts", "starts", "nbytes", "borrowed")

    #: (meta, starts, n_starts, nbytes) of the last hints built, matched by identity: a closure's meta and
    #: starts stay the same objects from its trace on, so the counts are worked out once, not per call
    _sizes: tuple = (None, None, 0, 0)

    def __init__(self, meta: list, data: mx.array, starts: np.ndarray):
        self.meta = meta
        self.data = data
        self.starts = starts
        self.borrowed = False
        last = RowHints._sizes
        if last[0] is meta and last[1] is starts:
            self.n_starts, self.nbytes = last[2], last[3]
            return
        self.n_starts = int(starts.max()) + 1 if starts.size else 0
        #: the bytes of ``data`` that hold rows and starts (``data`` may be longer: ``HINT_ROOM``)
        self.nbytes = sum(math.prod(m[2]) * m[3] for m in meta) + 4 * self.n_starts
        RowHints._sizes = (meta, starts, self.n_starts, self.nbytes)

    def host_data(self, read=np.array) -> np.ndarray:
        """``data`` on the host: itself when the kernel wrote it to host memory, else ``read`` (a private copy)
        of its first ``nbytes`` (the rows and starts; the device buffer may be longer)."""
        raw = self.data
        return raw if isinstance(raw, np.ndarray) else read(np.asarray(raw)[:self.nbytes])

    def split(self, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the rows as flat bytes, each hinted batch row's start) from ``data`` on the host (at least
        ``nbytes``; any bytes past them are not read)."""
        data = data[:self.nbytes]
        k = data.nbytes - 4 * self.n_starts
        return data[:k], data[k:].view(np.int32)[self.starts]

    def per_output(self, flat: np.ndarray, starts: np.ndarray) -> dict[int, tuple[int, np.ndarray, np.ndarray, tuple]]:
        """Per output (``flat``/``starts`` from ``split``): output j -> (input i, start row per batch row, the
        rows' bytes, the rows' shape (B, ..., S, H))."""
        out, at, sat = {}, 0, 0
        for j, i, shape, itemsize in self.meta:
            n = math.prod(shape) * itemsize
            out[j] = (i, starts[sat:sat + shape[0]], flat[at:at + n], shape)
            sat += shape[0]
            at += n
        return out



@dataclass(slots=True)
class RunResult:
    """One call's answer: ``outputs`` (evaluated MLX arrays or host arrays, one per group output, in order);
    ``row_hints``: the rows a decode closure changed in the outputs it wrote over its inputs (the KV buffers),
    so the runtime writes back just those; ``source``: the closure that made them (fixed output types and kinds:
    the runtime's copy-out memo is keyed on it); ``standins``: the inputs the closure ran on zeros in their place
    (a first prompt's past KV, whose values it does not read): over them, as over a mirror, the hinted rows are
    all an output changed; ``replayed``: made by ``Runner.replay`` (every output an evaluated MLX array)."""
    outputs: list
    row_hints: RowHints | None = None
    source: object | None = None
    standins: frozenset = frozenset()
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class Steady:
    """A trusted closure's replay for calls whose inputs have exactly ``shapes`` and ``dtypes`` (None: omitted),
    all host arrays: outputs = the closure of the inputs ``idx`` uploaded as ``types`` (``Runner.steady``)."""
    shapes: tuple
    dtypes: tuple
    idx: tuple
    types: tuple
    closure: object

    def matches(self, inputs: list) -> bool:
        """Whether this call's inputs have the replay's shapes and types."""
        if len(inputs) != len(self.shapes):
            return False
        for a, s, d in zip(inputs, self.shapes, self.dtypes):
            if a is None:
                if s is not None:
                    return False
            elif s is None or type(a) is not np.ndarray or a.shape != s or a.dtype != d:
                return False
        return True


class RunnerOptions(Protocol):
    """The session's options a runner is made with (the ABI layer's ``EpOptions``)."""

    @property
    def tuning(self) -> Tuning:
        """The developer knobs."""

    @property
    def compile_enabled(self) -> bool:
        """Whether any group may be compiled."""

    def compiles(self, path: str) -> bool:
        """Whether the compiled ``path`` (general / prefill / decode) is on."""


class Prebuild(Protocol):
    """Builds a new closure's kernels in another process while its key's calls answer without them here (the
    runtime's ``runtime/prebuild.py``; on a GPU, where a builder thread of this process starved)."""

    def submit(self, label: str, key: str, calls: int | None = None) -> str | None:
        """Queue a build of the kernels of closure ``key`` of runner ``label``, made from the call in progress
        (``calls`` times; None: as often as a key takes to be traced): the ``kernels/background.py`` key its state
        is kept under; None: build here (already built on this host, or no other process can)."""


class Runner(Protocol):
    """What the runtime calls for one group: the eager program wrapped (``EagerRunner``), a ``CompiledSubgraph``
    or an ``AttentionRunner``."""

    def run(self, inputs: list, probe=None, since: tuple | None = None) -> RunResult:
        """Outputs for ``inputs`` (numpy views of ORT's buffers, or device mirrors). ``probe`` marks stages;
        ``since``: (previous gather number, this one's, the inputs that may have changed since)."""

    def steady(self, inputs: list) -> Steady | None:
        """After a call on ``inputs``: the replay of what answered it, for calls with the same input shapes and
        types, where a closure alone answers them (None: each call goes through ``run``)."""

    def replay(self, steady: Steady, inputs: list) -> RunResult | None:
        """``steady``'s answer for ``inputs`` (which ``steady.matches``), or None: ask ``run``."""

    def release(self) -> None:
        """Drop every closure (the session is going)."""

    def parts(self) -> list:
        """The compiled parts (``CompiledSubgraph``) it is made of (none for the eager runner)."""


class EagerRunner:
    """The eager ``Program`` as a runner (compilation off, or a group no strategy takes)."""

    def __init__(self, program):
        self.program = program

    def run(self, inputs: list, probe=None, since: tuple | None = None) -> RunResult:
        return RunResult(self.program.run(inputs, probe=probe))

    def steady(self, inputs: list) -> None:
        return None

    def replay(self, steady: Steady, inputs: list) -> None:
        return None

    def release(self) -> None:
        pass

    def parts(self) -> list:
        return []
