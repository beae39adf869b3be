"""A trusted decode closure's step replayed as one CUDA graph of our kernels (tuning ``replay``).

MLX's host work for a decode step's ~140 launches (~1.4 ms of a ~2.4 ms token, docs/performance.md) bounds decode.
Once a decode closure is trusted, two of its calls are also built eagerly (``_Closure.outputs``) with
``kernels/cuda_replay.record`` on, writing a page-locked host buffer of their own laid out as the closure's; their
launches become one CUDA graph (``cuda_replay.Replay``). Its KV buffers are MLX arrays in unified memory (MLX never
moves those), written in place by the graph and handed out as the presents: the runtime's mirrors, the next call's
pasts. The replay answers calls only after it matched the closure byte for byte on one (host outputs, row hints).
A served call: the closure's guard (its own compiled function: the guard alone) asked of MLX, the host inputs and
hoisted values copied in meanwhile, the guard's answer, one graph launch, the wait (tuning ``replay_host_guard``:
the guard built without our kernels, on MLX's CPU stream). Any refusal or failure leaves the closure to answer,
as before.
"""
from __future__ import annotations

import contextlib
import sys
import time

import mlx.core as mx
import numpy as np

from ..kernels import cuda_driver, cuda_replay
from ..kernels import dtypes as dt
from .result import RowHints

#: calls recorded before the build (two: what differs between them is what a call feeds)
RECORDS = 2
#: calls of one decode key that take its replay from nothing to serving: the trace verified against eager, the
#: recorded ones, the checked one, a served one (a prebuild worker makes so many: ``runtime/prebuild.py``)
WARM_CALLS = 1 + RECORDS + 2
#: most sets of KV buffers a replay keeps (a set handed out as presents stays the runtime's mirror while it keeps it;
#: a call whose pasts are another mirror takes a free set, or a new one up to this many, else the closure answers)
KV_SETS = 4
#: KV element types whose unified copy is made from a NumPy array of the type
_NUMPY = {mx.float16: np.float16, mx.float32: np.float32, mx.int8: np.int8, mx.uint8: np.uint8}

#: the longest a host guard may take (a guard that reads more than a call's small host inputs computes on the CPU)
HOST_GUARD_MAX_S = 1e-3

SERVED, DECLINED, GUARD_FAILED = "served", "declined", "guard failed"
#: a served call's parts, timed (``StepReplay.spent``: seconds summed over its ``calls``)
SPENT = ("guard", "feed", "graph", "outputs")


class StepReplay:
    """One closure's replay: recording, then checked once against the closure, then serving its calls."""

    def __init__(self, n_outputs: int, host_guard: bool = False, staged_feed: bool = False, pdl: bool = False):
        self.n_out = n_outputs
        self.want_pdl = pdl                     # tuning replay_pdl (``cuda_replay.Replay.build``)
        self.want_host_guard = host_guard       # tuning replay_host_guard
        self.want_staged_feed = staged_feed     # tuning replay_staged_feed (``Replay.stage_inputs``)
        self.records: list = []         # (dev inputs, outputs, launches) of the recorded calls
        self.replay: cuda_replay.Replay | None = None
        self.refused: str | None = None
        self.checked = False
        self.kv: dict = {}              # dev input position -> MLX array in unified memory (written in place)
        self.kv_sets: list = []         # every set of them made (``kv`` is one); a set no one else holds is free
        self.kv_out: dict = {}          # group output j -> the dev input position of its KV buffer
        self.shapes: list = []          # (shape, dtype) of every dev input, as recorded
        self.types: list = []
        self.np_types: list = []
        self.sink: cuda_driver.HostBuffer | None = None
        self.guard = None               # the closure's guard alone, compiled
        #: the guard built without our kernels, compiled for MLX's CPU stream (tuning replay_host_guard; once it
        #: agreed with the closure on the checked call), and where the served calls' guard runs
        self.host_guard = None
        self.guard_kind = ""
        self.calls = 0
        self.spent = dict.fromkeys(SPENT, 0.0)
        self.build_s = 0.0
        self.record_s = 0.0             # the recorded calls' eager builds, evaluated
        self.copy = False               # this call's pasts are copied into the set (``_take_set``)
        self.problems: list = []        # every launch argument the refusal found (``cuda_replay.plan``)

    # ------------------------------------------------------------------ states
    def recording(self) -> bool:
        return self.refused is None and self.replay is None

    def pending(self) -> bool:
        """Built, not yet matched against the closure (its call must not be made ahead: the check reads the
        closure's host buffer)."""
        return self.refused is None and self.replay is not None and not self.checked

    def serving(self) -> bool:
        return self.refused is None and self.checked

    def refuse(self, why: str) -> None:
        self.refused = why
        self.records = []
        if self.replay is not None:
            self.replay.close()
            self.replay = None
        self.kv, self.kv_sets = {}, []

    # ------------------------------------------------------------------ recording
    @contextlib.contextmanager
    def _own_sink(self, c):
        """The closure's trace state set by a build of its body, kept; the body writes this replay's host buffer."""
        saved = (c.sink, c.hints, c.hint_starts, c.host_outs, c.hint_at, c.guard_count, c.sink_layout)
        if self.sink is None:
            self.sink = cuda_driver.HostBuffer(cuda_driver.driver(), c.sink.nbytes)
        c.sink = self.sink
        try:
            yield
        finally:
            c.sink, c.hints, c.hint_starts, c.host_outs, c.hint_at, c.guard_count, c.sink_layout = saved

    def eligible(self, c) -> str | None:
        """Why ``c`` cannot be replayed (None: it may be tried)."""
        if c.outputs is None or c.sink is None or not c.hints:
            return "no KV buffer written in place through a host buffer (pinned_hints)"
        host = {j for j, *_ in c.host_outs}
        kv = {j for j, *_ in c.hints}
        other = [j for j in range(self.n_out) if j not in host and j not in kv]
        if other:
            return f"output {other[0]} is neither a KV buffer written in place nor written to host memory"
        return None

    def record(self, c, dev: list) -> None:
        """Build ``c``'s body again on this call's device inputs with the launches noted; the second record builds
        the replay. Never raises (a failure refuses)."""
        try:
            why = self.eligible(c)
            if why:
                self.refuse(why)
                return
            t0 = time.perf_counter()
            with self._own_sink(c), cuda_replay.record() as launches:
                outs = c.outputs(*dev)
                guarded = c.guarded
            # not the guard: its MLX ops, unfused, are kernels no closure built (each compiled here, at a call)
            mx.eval(outs[:-1] if guarded else outs)
            self.record_s += time.perf_counter() - t0
            self.records.append((list(dev), list(outs), launches))
            if len(self.records) == RECORDS:
                self._build(c)
        except cuda_replay.Refused as e:
            self.problems = list(getattr(e, "problems", []))
            self.refuse(str(e))
        except Exception as e:  # noqa: BLE001 - the closure answers as before
            self.refuse(f"{type(e).__name__}: {e}")

    def _build(self, c) -> None:
        t0 = time.perf_counter()
        (dev_a, _, first), (dev_b, outs_b, second) = self.records
        self.records = []
        pos = {i: k for k, i in enumerate(c.dev_idx)}
        self.kv_out = {j: pos[i] for j, i, _, _ in c.hints}
        for m in self.kv_out.values():
            if dev_b[m].dtype not in _NUMPY:
                raise cuda_replay.Refused(f"a KV buffer of {dev_b[m].dtype}")
        self.kv, external = self._new_set({m: dev_b[m] for m in self.kv_out.values()})
        pairs = [(outs_b[j], dev_b[m]) for j, m in self.kv_out.items()]
        self.record_inputs([(tuple(a.shape), a.dtype) for a in dev_b])
        self.replay = cuda_replay.Replay.build(first, second, (dev_a, dev_b), in_place=pairs, external=external,
                                               pdl=self.want_pdl)
        if self.want_staged_feed:
            self.replay.stage_inputs()
        if c.guarded:
            self._make_guards(c)
        self.build_s = time.perf_counter() - t0

    def record_inputs(self, shapes: list) -> None:
        """The recorded inputs' (shape, MLX dtype), and each one's ONNX type and NumPy dtype, looked up once
        (None: an MLX type no host array carries)."""
        self.shapes = shapes
        self.types = [dt.FROM_MLX.get(dtype) for _, dtype in shapes]
        self.np_types = [None if t is None else dt.NUMPY[t] for t in self.types]

    def _make_guards(self, c) -> None:
        """The closure's guard alone, compiled (evaluated on MLX's device stream); with ``want_host_guard`` also
        as built without our kernels (``_Closure.guard_only``), for MLX's CPU stream, which must make as many
        guards as the closure's trace did."""
        def guard(*dev):
            with self._own_sink(c):
                return c.outputs(*dev)[-1]
        self.guard, self.guard_kind = mx.compile(guard), "device"
        if self.want_host_guard:
            count = c.guard_count

            def host_guard(*dev):
                ok, made = c.guard_only(*dev)
                if made != count:
                    raise cuda_replay.Refused(f"{made} guards built without our kernels, {count} with them")
                return ok
            self.host_guard = mx.compile(host_guard)       # traced at its first call, on the CPU stream

    def _new_set(self, like: dict) -> tuple[dict, dict]:
        """A set of KV buffers shaped as ``like``'s (position -> array), made from the host (unified memory: MLX
        never moves it), and their addresses."""
        kv = {m: mx.array(np.zeros(a.shape, _NUMPY[a.dtype])) for m, a in like.items()}
        mx.eval(list(kv.values()))
        self.kv_sets.append(kv)
        infos = cuda_replay.describe(list(kv.values()))
        return kv, {m: info.address for m, info in zip(kv, infos)}

    def _free_set(self) -> dict | None:
        """A set no one but this replay holds (its arrays referenced by ``kv_sets`` alone; any other reference,
        a call's inputs or the runtime's mirror, keeps it)."""
        for kv in self.kv_sets:
            if all(sys.getrefcount(kv[m]) <= 2 for m in kv):   # (``kv_sets``' dict, and the call's argument)
                return kv
        return None

    def _take_set(self, dev: list) -> bool:
        """Make the set the next launch writes: the set ``dev``'s pasts are (one handed out: the runtime's mirror,
        as the replay left it), else a free one (or a new one) with the pasts to be copied in (``copy``); False
        where none can be had."""
        self.copy = False
        for kv in self.kv_sets:
            if all(dev[m] is kv[m] for m in kv):
                return self._bind(kv)
        self.copy = True
        kv = self._free_set()
        if kv is None:
            if len(self.kv_sets) >= KV_SETS:
                return False
            kv, _ = self._new_set(self.kv)
        return self._bind(kv)

    def _bind(self, kv: dict) -> bool:
        if kv is not self.kv:
            infos = cuda_replay.describe(list(kv.values()))
            self.replay.rebind({m: info.address for m, info in zip(kv, infos)})
            self.kv = kv
        return True

    # ------------------------------------------------------------------ calls
    def _feed(self, dev: list) -> bool:
        """This call's device inputs into the replay: each KV buffer copied in unless it is the one handed out
        last (the mirror), the others (host arrays) copied to their place. False: a call it cannot take."""
        r = self.replay
        self.copy = False
        if len(dev) != len(self.shapes):
            return False
        for a, (shape, dtype) in zip(dev, self.shapes):
            if tuple(a.shape) != shape or (isinstance(a, mx.array) and a.dtype != dtype):
                return False
        if any(dev[m] is not u for m, u in self.kv.items()):
            # pasts other than the set bound now: their own set, or copied into one no one else holds
            if not self._take_set(dev):
                return False
        if self.copy:
            srcs = [m for m in self.kv if isinstance(dev[m], mx.array)]
            mx.eval([dev[m] for m in srcs])
            infos = dict(zip(srcs, cuda_replay.describe([dev[m] for m in srcs])))
            if not all(i.row_contiguous for i in infos.values()):
                return False
            mx.synchronize()
            for m in self.kv:
                if m in infos:
                    r.copy(r.input_address(m), infos[m].address, dev[m].nbytes)
                else:
                    r.upload(r.input_address(m), np.asarray(dev[m]))
        for m, (a, npt) in enumerate(zip(dev, self.np_types)):
            if m in self.kv:
                continue
            if isinstance(a, mx.array) or npt is None:
                return False
            r.write(m, np.ascontiguousarray(a, dtype=npt))
        return True

    def _outputs(self, c) -> tuple[list, RowHints]:
        outs: list = [None] * self.n_out
        for j, m in self.kv_out.items():
            outs[j] = self.kv[m]
        for j, off, end, shape, npt in c.host_outs:
            v = self.sink.array[off:end].view(npt).reshape(shape)
            v.flags.writeable = False
            outs[j] = v
        hints = RowHints(c.hints, None, c.hint_starts)
        hints.data = self.sink.array[c.hint_at:c.hint_at + hints.nbytes].copy()
        return outs, hints

    def _host_guard(self, dev: list) -> mx.array:
        """The host guard asked of MLX's CPU stream for a call whose device inputs are ``dev`` (host arrays as
        MLX copies in unified memory, mirrors as they are)."""
        args = [a if isinstance(a, mx.array) else dt.to_mx(np.asarray(a), t) for a, t in zip(dev, self.types)]
        with mx.stream(mx.cpu):
            ok = self.host_guard(*args)
            mx.async_eval(ok)
        return ok

    def _try_host_guard(self, dev: list) -> None:
        """The host guard on the checked call, which the closure's guard took: it serves the calls from now on
        only if it says yes there too, twice, the second time within ``HOST_GUARD_MAX_S`` (else the device guard
        does, the reason kept in ``guard_kind``)."""
        try:
            ok = bool(self._host_guard(dev).item())         # (its first call traces and builds it)
            t0 = time.perf_counter()
            ok = ok and bool(self._host_guard(dev).item())
            spent = time.perf_counter() - t0
            why = None if ok else "it said no to a call the closure's guard took"
            if ok and spent > HOST_GUARD_MAX_S:
                ok, why = False, f"it took {spent * 1e3:.2f} ms"
        except Exception as e:  # noqa: BLE001
            ok, why = False, f"{type(e).__name__}: {e}"
        if ok:
            self.guard_kind = "host"
        else:
            self.host_guard = None
            self.guard_kind = f"device (host guard: {why})"

    def check(self, c, dev: list) -> None:
        """After the closure answered a call (its host buffer holds its answer): the same call through the replay
        (``dev``: its device inputs as host arrays and mirrors, hoisted values last), its host outputs and row
        hints compared byte for byte. Never raises (a difference refuses)."""
        try:
            if not self._feed(dev):
                self.refuse("the checked call's inputs do not fit the recorded ones")
                return
            self.replay.launch()
            self.replay.wait()
            hints = RowHints(c.hints, None, c.hint_starts)
            spans = [(off, end) for _, off, end, _, _ in c.host_outs] + [(c.hint_at, c.hint_at + hints.nbytes)]
            for lo, hi in spans:            # (the bytes between them are never written)
                mine, theirs = self.sink.array[lo:hi], c.sink.array[lo:hi]
                if not np.array_equal(mine, theirs):
                    at = lo + int(np.flatnonzero(mine != theirs)[0])
                    self.refuse(f"its answer differs from the closure's at byte {at} (of {lo}..{hi})")
                    return
            if self.host_guard is not None:
                self._try_host_guard(dev)
            self.checked = True
        except Exception as e:  # noqa: BLE001
            self.refuse(f"check: {type(e).__name__}: {e}")

    def serve(self, c, dev_host: list, dev_mx) -> tuple[str, list | None, RowHints | None]:
        """(SERVED, outputs, hints), (GUARD_FAILED, None, None) or (DECLINED, None, None) for a call whose
        device inputs are ``dev_host`` (host arrays and mirrors, hoisted values last); ``dev_mx()`` gives them
        as MLX arrays (the guard's inputs). Raises on a failure (the caller refuses and answers otherwise)."""
        t0 = time.perf_counter()
        ok = None
        # the guard runs on an MLX stream while the inputs are copied to the replay's (the graph waits for both)
        if self.host_guard is not None:
            ok = self._host_guard(dev_host)
        elif self.guard is not None:
            ok = self.guard(*dev_mx())
            mx.async_eval(ok)
        t1 = time.perf_counter()
        fed = self._feed(dev_host)
        t2 = time.perf_counter()
        if ok is not None and not bool(ok.item()):
            return GUARD_FAILED, None, None
        if not fed:
            return DECLINED, None, None
        t3 = time.perf_counter()
        self.replay.launch()
        self.replay.wait()
        t4 = time.perf_counter()
        self.calls += 1
        outs, hints = self._outputs(c)
        # guard: asking for it and waiting for its answer (the feed ran between)
        for k, v in zip(SPENT, ((t1 - t0) + (t3 - t2), t2 - t1, t4 - t3, time.perf_counter() - t4)):
            self.spent[k] += v
        return SERVED, outs, hints

    def release(self) -> None:
        self.refuse(self.refused or "released")
