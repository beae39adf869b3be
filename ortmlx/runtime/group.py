"""One fused group at run time, below the ABI: device residency and the per-call machinery.

The ABI layer (``ep/compute.py``) hands a call's inputs as NumPy views of ORT's buffers (``Gathered``) and
takes its outputs' buffers from ORT when asked (``OutputSink``). Here:

- ``Group.run``: a call with the last call's input shapes and types, where the runner said one closure alone
  answers them (``Runner.steady``), is replayed (``Runner.replay``): upload, closure, eval, nothing else.
  Otherwise inputs whose ORT buffer an output wrote in place last call (genai's shared KV buffer) are
  replaced by their device mirrors (``mirror.py``; a decode step's all at once: ``kvbatch.py``), then the
  group's runner (``compiled``: compiled or eager) answers;
- ``Group.write``: every result goes into ORT's buffer; a result ORT placed in an input's buffer becomes that
  buffer's mirror and only the rows that changed are written (the runner's row hints, else a device diff).
  A replayed call's results are copied whole, its outputs allocated in one call.
"""
from __future__ import annotations

import operator
import threading
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..compiled import RunnerOptions, RunResult, make_runner
from ..compiled.core import compile_thread
from ..errors import KernelError
from ..kernels import dtypes as dt
from ..kernels.interpreter import Program
from ..kernels.passes import BuildConfig
from . import devread, residency, upload
from .kvbatch import KvBatches, ShimCalls
from .prebuild import ModelSource, WorkerPrebuild
from .mirror import (MirrorSet, changed_rows, hint_bytes, mirrorable, predicted_rows, write_hinted, write_predicted,
                     write_rows)

#: (cpu, gpu): total bytes of in-place outputs copied out whole rather than diffed on the device; a diff costs a
#: device round trip and reads both copies, and on a GPU a whole copy crosses the link. Tests set both to 0 to
#: exercise the diff on small buffers.
WHOLE_COPY_BYTES = [1 << 20, 64 << 10]
#: hinted rows' total bytes from which their block copies run on several threads (a prompt's KV rows; a decode
#: step's are kilobytes)
PARALLEL_HINT_BYTES = 8 << 20

_SHAPE = operator.attrgetter("shape")


@dataclass(slots=True)
class Gathered:
    """One call's inputs as the ABI layer gathered them (one object per thread, refilled every call)."""
    #: NumPy views of ORT's buffers (None: an omitted optional input)
    inputs: list = field(default_factory=list)
    #: each input's buffer address (a view of the gather's C array: valid until the next gather on the thread)
    addr: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    #: address -> input index, for the inputs an output may be written into
    addrs: dict = field(default_factory=dict)
    #: per input: its address in ``addrs``, or None
    slots: list | None = None
    #: makes ``addrs`` and ``slots`` for this call (None: made already, or not wanted); a replay reads neither
    fill: object = None
    #: this gather's number (unique in the process) and the previous gather's on these buffers
    token: int = 0
    prev_token: int = -1
    #: the inputs whose address, dims or type may differ from the previous gather's (None: any of them)
    redo: list | None = None

    @property
    def since(self) -> tuple | None:
        """What the runner may take from the previous call (``CompiledSubgraph.run``'s ``since``)."""
        return None if self.redo is None else (self.prev_token, self.token, self.redo)


class OutputSink(Protocol):
    """ORT's output buffers of the call in progress (the ABI layer's)."""

    def allocate(self, shapes: list) -> np.ndarray:
        """Every output's buffer, allocated with ``shapes``, in one call: their addresses (uint64)."""

    def allocate_one(self, j: int, shape: tuple):
        """Output ``j``'s buffer allocated with ``shape``: its address as a pointer (``ffi`` cdata)."""


def may_alias(a) -> bool:
    """Whether an output may be written into input ``a``'s buffer (ORT's shared KV buffer: non-empty, rank >= 2)."""
    return bool(a is not None and a.size and a.ndim >= 2)


def _copy_whole(dst: np.ndarray, r: mx.array, read: devread.Reader) -> int:
    host = dt.to_numpy(r)
    read.copyto(dst, host)
    return host.nbytes


class GroupOptions(RunnerOptions, Protocol):
    """The session's options a group is made with (the ABI layer's ``EpOptions``)."""

    @property
    def raw(self) -> dict:
        """The provider options as given (a prebuild worker's session is made with them)."""


class Group:
    """A fused group's program, runner and device-resident state (one per ORT compute info)."""

    def __init__(self, plan, device: str, options: GroupOptions, stats, abi: ShimCalls,
                 source: ModelSource | None = None):
        self.name = plan.name
        self.device = device
        self.stats = stats
        self.ffi = abi.ffi
        t = options.tuning
        self.program = Program(plan, device, BuildConfig.for_device(device, t),
                               upload=upload.uploader(device, t.direct_in))
        #: new closures' kernels built by a worker process meanwhile (a GPU's group that is the whole model)
        self.prebuild = None
        if t.build_behind and (t.prebuild if t.prebuild is not None else device == "gpu") \
                and source is not None and source.covers(plan.inputs):
            self.prebuild = WorkerPrebuild(source, options.raw, list(plan.inputs))
        self.runner = make_runner(self.program, options, stats, self.prebuild)
        self.out_names = list(plan.outputs)
        self.out_types = [plan.value(n).dtype for n in plan.outputs]
        self._every_input = frozenset(range(len(plan.inputs)))
        #: device mirrors of ORT buffers an output writes in place (genai's shared KV buffer)
        self.mirrors = MirrorSet() if t.kv_mirror else None
        #: the steady decode state of the row-hinted KV buffers (kvbatch.py); None: per-buffer path only
        self.kv = KvBatches(abi) if self.mirrors is not None and t.kv_batch else None
        self._aliased: set[int] = set()         # inputs an output was ever written into
        #: in-place outputs up to this size are copied out whole (no device diff)
        self._whole_bytes = WHOLE_COPY_BYTES[device == "gpu"]
        #: how results are read to the host (devread.py: the CUDA driver's copy on MLX's CUDA backend)
        self.read = devread.reader(device, t.driver_read)
        #: large results written by a kernel straight into ORT's buffer (``devread.DriverReader.write_result``)
        self._direct = t.direct_out and self.read.driver
        #: how in-place (mirrored) outputs were written back, per buffer write (the verbose summary shows it):
        #: row hints in one batch (kvbatch.py) / row hints one by one / diffed on the device / whole
        self.kv_copy_out = {"batched": 0, "row_hints": 0, "diffed": 0, "whole": 0}
        if stats is not None:
            stats.group(plan.name)["kv_copy_out"] = self.kv_copy_out
        #: per thread: the KV batch this call took, the last batch layout, the copy-out memo
        self._tls = threading.local()
        #: the replay of the last call's closure (``Runner.steady``: main thread only); ``_replays``: still allowed
        self._steady = None
        self._replays = True

    @property
    def wants_addresses(self) -> bool:
        """Whether ``run`` reads ``Gathered.addrs`` (outputs may go back in place: mirrors are on)."""
        return self.mirrors is not None

    def release(self) -> None:
        self._steady = None
        runner, self.runner = self.runner, None
        if runner is not None:
            runner.release()
        if self.mirrors is not None:
            self.mirrors.clear()
        if self.kv is not None:
            self.kv.clear()
        self.program = None

    # ------------------------------------------------------------------ per call
    def run(self, g: Gathered, probe=None) -> tuple[RunResult, dict]:
        """(The runner's answer, the inputs that ran on device mirrors: index -> mirror)."""
        st = self._steady
        if st is not None and probe is None and st.matches(g.inputs) and compile_thread():
            res = self.runner.replay(st, g.inputs)
            if res is not None:
                return res, {}
            self._steady = None
        if g.fill is not None:
            g.fill()
        if self.prebuild is not None:
            self.prebuild.bind(g.inputs)
        run, used = self.use_mirrors(g)
        res = self.runner.run(run, probe, g.since)
        # no buffer ever written in place (no mirrors to keep): the next call may be a replay
        if probe is None and not used and not self._aliased and self._replays and compile_thread():
            self._steady = self.runner.steady(run)
        return res, used

    def use_mirrors(self, g: Gathered) -> tuple[list, dict[int, mx.array]]:
        """The call's inputs with device mirrors substituted where ORT's buffer is one we mirror."""
        tls = self._tls
        tls.kv = None
        inputs, addrs = g.inputs, g.addrs
        if not self._aliased or not addrs:
            return inputs, {}
        run = list(inputs)
        used = {}
        if self.kv is not None and len(self.kv):
            kb = self.kv.take(inputs, g.addr, None if g.redo is None else (g.prev_token, g.redo))
            if kb is not None:
                tls.kv = kb
                L = kb.layout
                used = dict(zip(L.in_list, kb.arrays))
                if L.in_span is not None:
                    run[L.in_span[0]:L.in_span[1]] = kb.arrays
                else:
                    for i, m in used.items():
                        run[i] = m
        ent = g.slots                       # per input: its address in ``addrs``, or None
        for i in sorted(self._aliased.difference(used)):
            addr = ent[i]
            if addr is not None and addrs.get(addr) == i:
                m = self.mirrors.lookup(i, addr, inputs[i])
                if m is not None:
                    run[i] = used[i] = m
        return run, used

    def write(self, g: Gathered, result: RunResult, used: dict, sink: OutputSink, probe=None) -> None:
        """Write the results into ORT's buffers and count the bytes that crossed (mirrored inputs: none)."""
        if result.replayed and not self._aliased:
            out_bytes = self._write_replayed(result.outputs, sink, g)
        else:
            out_bytes = self.write_outputs(result, sink, probe, g, used)
        inputs = g.inputs
        kept = used.keys() | result.standins if result.standins else used
        sent = self._every_input.difference(kept) if kept else range(len(inputs))
        residency.add(sum(inputs[i].nbytes for i in sent if inputs[i] is not None), out_bytes)

    def _write_replayed(self, results: list, sink: OutputSink, g: Gathered) -> int:
        """A replayed call's results copied whole into ORT's buffers; returns the bytes. An output ORT placed in an
        input's buffer (a shared buffer) ends replays for this group: later calls keep mirrors (``write_outputs``)."""
        ptrs = sink.allocate(list(map(_SHAPE, results))).tolist()
        moved = 0
        cast, read, types, direct = self.ffi.cast, self.read, self.out_types, self._direct
        for j, (p, r) in enumerate(zip(ptrs, results)):
            if direct and self._direct_one(r, j) and read.write_result(p, r):
                moved += r.nbytes
            elif not r.size:
                continue
            elif types[j] in dt.CARRIERS:
                moved += self._copy(cast("void*", p), dt.to_numpy(r), types[j])
            else:
                read.copy_result(cast("void*", p), r, self.ffi)
                moved += r.nbytes
        ins = g.addr.tolist()
        if any(p in ins for p in ptrs):
            self._steady, self._replays = None, False
        return moved

    def write_outputs(self, result: RunResult, sink: OutputSink, probe, g: Gathered, used: dict) -> int:
        """Copy every result into ORT's output buffers; returns the bytes copied.

        An output ORT places in the buffer of input ``i`` (genai's shared KV buffer) keeps its MLX result as that
        buffer's mirror; when the call ran on the mirror, only the rows that changed are written (``mirror.py``).
        """
        results, hints = result.outputs, result.row_hints
        inputs, addrs = g.inputs, g.addrs
        ffi = self.ffi
        moved = 0
        pending = []                    # (input index, address, result, old mirror, ORT's buffer)
        done: set[int] = set()
        hinted, ptrs, hosts, batched = {}, None, {}, ()
        jobs, stores = None, []         # a large hinted write's block copies, made together on threads (a prompt's)
        prev = getattr(self._tls, "kv", None)
        self._tls.kv = None
        if hints is not None:
            flat, starts = hint_bytes(hints, self.read)
            if flat.nbytes >= PARALLEL_HINT_BYTES:
                jobs = []
            # a first prompt ran on zeros in place of its past buffers: its rows go the batch's way too (one C call
            # and one check next call, not ~20 us of Python per buffer), unless large (then the threads')
            ran = used or (result.standins if jobs is None else None)
            if self.kv is not None and ran:
                ptrs, hosts, shapes = self._output_ptrs(result, sink, probe, addrs)
                kb = self._write_batch(hints.meta, flat, starts, ptrs, results, g, ran, prev, shapes,
                                       hints.borrowed)
                if kb is not None:
                    done.update(kb.layout.in_list)
                    batched = kb.layout
                    moved += kb.layout.flat_bytes
            if not done:
                hinted = hints.per_output(flat, starts)
        for j in (batched.others(len(results)) if batched else range(len(results))):   # not written by the batch
            r = results[j]
            if ptrs is not None:        # _output_ptrs left None exactly for the results that may go back in place
                host = hosts[j]
                inplace = host is None
            else:
                inplace = bool(addrs) and isinstance(r, mx.array) and mirrorable(r)
                host = None if inplace else r if self._direct_one(r, j) else dt.host(r)
            shape = tuple(r.shape) if inplace else host.shape
            if ptrs is not None:
                ptr = ffi.cast("void*", int(ptrs[j]))
            else:
                ptr = sink.allocate_one(j, shape)
                if j == 0 and probe is not None:
                    probe.fault_point("copy_out")       # testing: fail with output 0 already allocated
            if inplace:
                addr = int(ffi.cast("uintptr_t", ptr))
                i = self._aliased_input(addr, j, shape, inputs, addrs, done)
                if i is not None:
                    dst = inputs[i]         # ORT's buffer: the input's own (writable) view of it
                    h = hinted.get(j)
                    if h is not None and h[0] == i and (i in used or i in result.standins):
                        # the runner ran on the mirror (or on zeros in place of a past it does not read) and
                        # says which rows it changed: write just those
                        ranges = write_hinted(dst, h[1], h[2], h[3], jobs)
                        if ranges is not None:
                            moved += h[2].nbytes
                            stores.append((i, addr, dst, r, ranges))
                            self.kv_copy_out["row_hints"] += 1
                            continue
                    if used and i in used:
                        pending.append((i, addr, r, used[i], dst))
                    else:
                        moved += _copy_whole(dst, r, self.read)
                        self.mirrors.store(i, addr, dst, r, None)
                        self.kv_copy_out["whole"] += 1
                    continue
                host = r if self._direct_one(r, j) else dt.to_numpy(r)      # (not ORT's buffer of an input)
            if isinstance(host, mx.array):      # (``_direct_one``) a kernel writes it into ORT's buffer
                if j not in hinted and self.read.write_result(int(ffi.cast("uintptr_t", ptr)), host):
                    moved += host.nbytes
                    continue
                host = dt.to_numpy(host)
            moved += self._copy(ptr, host, self.out_types[j], isinstance(r, mx.array))
            if j in hinted:
                # a hinted present computed in place (rows after the new ones are the past's) going to its
                # own buffer: ORT's kernel leaves those rows zero there
                self._zero_after_rows(ptr, host, hinted[j])
        if jobs:
            devread.parallel_copies(jobs)
        for st in stores:               # (after the rows are in: a mirror keeps some of them to check)
            self.mirrors.store(*st)
        if self.kv is not None and (rest := self._aliased.difference(done)) and \
                (stored := [a for a, i in addrs.items() if i in rest]) and len(self.kv):
            self.kv.drop(stored)        # the per-buffer path owns these buffers now
        return moved + self._write_pending(pending)

    def _output_ptrs(self, result: RunResult, sink: OutputSink, probe, addrs) -> tuple[np.ndarray, dict, list]:
        """ORT's buffers for every output in one call: (addresses, {j: host result, or None for a device result
        that may go back in place}, the results' shapes)."""
        results = result.outputs
        n = len(results)
        inplace = bool(addrs)
        # the closure that made them (its outputs' types are fixed): with the same shapes, the same outputs go
        # back in place as last call (``mirrorable``: MLX results); without one, each call classifies them
        src = result.source
        memo = getattr(self._tls, "out_memo", None) or (None, False, None, None)
        shapes = list(map(_SHAPE, results))
        if src is not None and memo[0] is src and memo[1] == inplace and shapes == memo[2]:
            host_idx = memo[3]
        else:
            host_idx = [j for j, r in enumerate(results) if not (inplace and mirrorable(r))]
        hosts = dict.fromkeys(range(n))
        for j in host_idx:
            r = results[j]
            hosts[j] = h = r if self._direct_one(r, j) else dt.host(r)
            if tuple(h.shape) != shapes[j]:
                shapes[j] = tuple(h.shape)
        self._tls.out_memo = (src, inplace, shapes, host_idx)
        ptrs = sink.allocate(shapes)
        if probe is not None:
            probe.fault_point("copy_out")       # testing: fail with the outputs already allocated
        return ptrs, hosts, shapes

    def _direct_one(self, r, j: int) -> bool:
        """Whether result ``j`` may go to ORT's buffer by ``devread``'s direct write: a large MLX result of the
        output's own element type (its bytes are ORT's)."""
        return self._direct and isinstance(r, mx.array) and self.read.direct(r.nbytes) and \
            dt.FROM_MLX.get(r.dtype) == self.out_types[j] and self.out_types[j] not in dt.CARRIERS

    def _write_batch(self, meta, flat, starts, ptrs, results, g: Gathered, used, prev, shapes, borrowed=False):
        """The batched copy-out of every hinted row (kvbatch.py), or None (nothing written). The batch keeps the
        rows to check the buffers against next call: ``borrowed`` ones (``RowHints``) are copied for it."""
        kv = self.kv
        L = kv.layout_for(meta, ptrs, g.inputs, g.addr, used, results, self.out_types,
                          prev.layout if prev is not None else getattr(self._tls, "kv_layout", None),
                          taken=prev is not None, res_shapes=shapes)
        if L is None:
            return None
        if borrowed:
            flat = flat.copy()
        kb = kv.write(L, flat, starts, results, prev)
        if kb is None:
            return None
        self._tls.kv_layout = L
        if prev is None and self.mirrors is not None:
            for i, a in zip(L.in_list, L.addrs.tolist()):
                self.mirrors.drop(i, a)         # the batch owns these buffers' mirrors now
        kv.put(kb, g.token)
        self.kv_copy_out["batched"] += len(L.in_list)
        return kb

    def _zero_after_rows(self, ptr, host: np.ndarray, hint) -> None:
        _, start, _, shape = hint
        s = shape[-2]
        if host.ndim != len(shape) or host.shape[0] != start.shape[0] or host.dtype.kind not in "fiu":
            raise KernelError(f"row hint of shape {shape} does not fit an output of shape {host.shape}")
        dst = np.frombuffer(self.ffi.buffer(ptr, host.nbytes), host.dtype).reshape(host.shape)
        for k, r0 in enumerate(start.tolist()):
            dst[k, ..., r0 + s:, :] = 0

    def _copy(self, ptr, host: np.ndarray, t: int | None, device: bool = True) -> int:
        """Copy a host result (ONNX element type ``t``; ``device``: the host view of an MLX result, else host
        memory already, e.g. what a closure's kernel wrote there) into ORT's buffer at ``ptr``; returns bytes."""
        if not host.size:
            return 0
        if t in dt.CARRIERS:
            packed = dt.pack_carrier(host, t)           # a NumPy array, not a device result
            devread.NUMPY.copy_to_address(ptr, packed, self.ffi)
            return packed.nbytes
        (self.read if device else devread.NUMPY).copy_to_address(ptr, host, self.ffi)
        return host.nbytes

    def _aliased_input(self, addr: int, j: int, shape: tuple, inputs, addrs: dict, done: set) -> int | None:
        """The input whose buffer (at ``addr``) ORT gave as output ``j``'s (same shape and type), else None."""
        i = addrs.get(addr)
        if i is None or i in done:
            return None
        src, t = inputs[i], self.out_types[j]
        npt = dt.NUMPY.get(t)
        if src.shape != shape or npt is None or src.dtype != np.dtype(npt) or t in dt.CARRIERS:
            return None
        done.add(i)
        self._aliased.add(i)
        return i

    def _write_pending(self, pending: list) -> int:
        """Write back in-place results computed on mirrors: whole when small, else changed rows only."""
        if not pending:
            return 0
        if sum(d.nbytes for *_, d in pending) <= self._whole_bytes:
            moved = 0
            for i, addr, r, _, dst in pending:      # small buffers: a whole copy beats a diff round trip
                moved += _copy_whole(dst, r, self.read)
                self.mirrors.store(i, addr, dst, r, None)
            self.kv_copy_out["whole"] += len(pending)
            return moved
        self.kv_copy_out["diffed"] += len(pending)
        pairs = [(r, old) for _, _, r, old, _ in pending]
        writes = [(r, dst) for _, _, r, _, dst in pending]
        # a decode step writes the row after the last one in every buffer: bring it with the diff
        rows = predicted_rows([self.mirrors.ends(i, addr) for i, addr, *_ in pending], [d.shape for *_, d in pending])
        moved = None
        if rows is not None:
            ranges, picked = changed_rows(pairs, compiled=compile_thread(), predict=rows, read=self.read)
            moved = write_predicted(writes, ranges, rows, picked)
        else:
            ranges = changed_rows(pairs, compiled=compile_thread(), read=self.read)
        if moved is None:
            moved = write_rows(writes, ranges, self.read)
        for (i, addr, r, _, dst), rng in zip(pending, ranges):
            self.mirrors.store(i, addr, dst, r, rng)
        return moved
