"""One fused group at run time: gather ORT's inputs, run, copy results out."""
from __future__ import annotations

import itertools
import math
import operator
import threading

import mlx.core as mx
import numpy as np

from .. import residency
from ..compiled import make_runner
from ..compiled.core import compile_thread
from ..kernels import dtypes as dt
from ..kernels.interpreter import Program
from ..trace import Probe
from . import devread
from .errors import ORT_INVALID_ARGUMENT, EpError
from .kvbatch import KvBatches
from .mirror import (MirrorSet, changed_rows, hint_bytes, mirrorable, predicted_rows, write_hinted,
                     write_predicted, write_rows)


#: (cpu, gpu): total bytes of in-place outputs copied out whole rather than diffed on the device;
#: a diff costs a device round trip (~50-250 us here) and reads both copies; on a GPU a whole copy
#: crosses the link. Tests set both to 0 to exercise the diff on small buffers.
WHOLE_COPY_BYTES = [1 << 20, 64 << 10]


#: groups with at least this many inputs keep their input views between calls (ComputeInfo.gather)
CACHED_VIEWS_FROM = 8

_SHAPE = operator.attrgetter("shape")

#: gather numbers: an input memo made at gather ``t`` serves the next gather on the same buffers, whose
#: ``prev_token`` is ``t`` (unique in the process, so one thread's number never matches another's)
_GATHERS = itertools.count(1)


def _copy_whole(dst: np.ndarray, r: mx.array, read: devread.Reader) -> int:
    host = dt.to_numpy(r)
    read.copyto(dst, host)
    return host.nbytes


def _may_alias(a) -> bool:
    """Whether an output may be written into input ``a``'s buffer (ORT's shared KV buffer: non-empty, rank >= 2,
    batch 1)."""
    return bool(a is not None and a.size and a.ndim >= 2 and a.shape[0] == 1)


def _nbytes(arrays) -> int:
    """Bytes of the gathered inputs (what MLX copies onto its device)."""
    return sum(a.nbytes for a in arrays if a is not None)


class _Buffers:
    """Per-thread out-parameters for the C gather helper (reused every call)."""

    def __init__(self, ffi, n_in: int, max_rank: int):
        n = max(n_in, 1)
        self.data = ffi.new("const void*[]", n)
        self.dims = ffi.new("int64_t[]", n * max_rank)
        self.ndims = ffi.new("size_t[]", n)
        self.types = ffi.new("int[]", n)
        self.odims = ffi.new("int64_t[]", max_rank)
        self.out = ffi.new("void**")
        #: the input addresses as a NumPy view of ``data`` (valid until the next gather on this thread)
        self.addr = np.frombuffer(ffi.buffer(self.data), np.uint64)[:n_in]
        # the last gather's (address, rank, dims, type) per input (``ortmlx_same_inputs``), and the views made
        # from them; ``last_ok``: that gather's views were all made
        self.prev_data = ffi.new("const void*[]", n)
        self.prev_dims = ffi.new("int64_t[]", n * max_rank)
        self.prev_ndims = ffi.new("size_t[]", n)
        self.prev_types = ffi.new("int[]", n)
        self.changed = ffi.new("int32_t[]", n)
        self.last_ok = False
        self.views: list = [None] * n_in
        self.uncached: set = set()      # inputs without a kept view (omitted, carriers, empty): made every call
        #: this gather's number (unique in the process: ``_GATHERS``), the previous gather's on these buffers, and
        #: the inputs whose address, dims or type may differ from that gather's (None: any of them)
        self.token, self.prev_token, self.redo = 0, -1, None
        #: ``addresses``: (the gather it was made for, per input its address or None, the address -> input map)
        self.addr_memo = (-1, None, None)
        self.n_out = 0                  # output buffers below, sized on first use (ComputeInfo._output_ptrs)
        self.last_oshapes = None
        #: ``_output_ptrs``: (the closure whose results, in place allowed, their shapes, the host results' indices)
        self.out_memo = (None, False, None, None)


def _out_buffers(ffi, b: _Buffers, n_out: int, max_rank: int) -> None:
    b.n_out = n_out
    b.oall = ffi.new("int64_t[]", n_out * max_rank)
    b.ondims = ffi.new("int64_t[]", n_out)
    b.optrs = ffi.new("uint64_t[]", n_out)
    b.optrs_np = np.frombuffer(ffi.buffer(b.optrs), np.uint64)
    b.oall_np = np.frombuffer(ffi.buffer(b.oall), np.int64).reshape(n_out, max_rank)
    b.ondims_np = np.frombuffer(ffi.buffer(b.ondims), np.int64)
    b.last_oshapes = None


class ComputeInfo:
    def __init__(self, ep, plan):
        abi = ep.abi
        ffi, lib = abi.ffi, abi.lib
        self.ep = ep
        self.abi = abi
        self.name = plan.name
        labels = [n.label for n in plan.nodes]
        ep.stats.group_nodes[plan.name] = frozenset(n.name for n in plan.nodes if n.name)
        self.label = f"{plan.name} ({len(labels)} node{'s' if len(labels) != 1 else ''}: " \
                     f"{', '.join(labels[:6])}{', ...' if len(labels) > 6 else ''})"
        self.plan = plan
        t = ep.options.tuning
        self.program = Program(plan, ep.device, device_constants=t.device_constants, cuda_kernels=t.cuda_kernels,
                               lift_weights=t.lift_weights, widen_weights=t.widen_weights, dense_nbits=t.dense_nbits,
                               pinned_hints=t.pinned_hints, fold_swiglu=None if t.fold_mlp else False,
                               fuse_rows=None if t.fuse_rows else False, gated_rows=t.gated_rows)
        self.runner = make_runner(self.program, ep.options, ep.stats)
        self._since_ok = getattr(self.runner, "supports_since", False)
        self.in_names = list(plan.inputs)
        self.in_types = [plan.value(n).dtype for n in plan.inputs]
        self.out_names = list(plan.outputs)
        self.out_types = [plan.value(n).dtype for n in plan.outputs]
        self.n_in = len(self.in_names)
        self._every_input = frozenset(range(self.n_in))
        self._tls = threading.local()
        c = self.c = ffi.new("OrtNodeComputeInfo*")
        c.ort_version_supported = abi.struct_version
        c.CreateState = lib.ortmlx_nci_create_state
        c.Compute = lib.ortmlx_nci_compute
        c.ReleaseState = lib.ortmlx_nci_release_state
        self.address = int(ffi.cast("uintptr_t", c))
        self.calls = 0
        self._observed = ep.stats.observed
        #: device mirrors of ORT buffers an output writes in place (genai's shared KV buffer)
        self.mirrors = MirrorSet() if t.kv_mirror else None
        #: the steady decode state of the row-hinted KV buffers (ep/kvbatch.py); None: per-buffer path only
        self.kv = KvBatches(abi) if self.mirrors is not None and t.kv_batch else None
        self._aliased: set[int] = set()         # inputs an output was ever written into
        #: in-place outputs up to this size are copied out whole (no device diff)
        self._whole_bytes = WHOLE_COPY_BYTES[ep.device == "gpu"]
        #: how results are read to the host (ep/devread.py: the CUDA driver's copy on MLX's CUDA backend)
        self.read = devread.reader(ep.device, t.driver_read)
        #: how in-place (mirrored) outputs were written back, per buffer write (the verbose summary shows it):
        #: row hints in one batch (ep/kvbatch.py) / row hints one by one / diffed on the device / whole
        self.kv_copy_out = {"batched": 0, "row_hints": 0, "diffed": 0, "whole": 0}
        if hasattr(ep.stats, "group"):
            ep.stats.group(plan.name)["kv_copy_out"] = self.kv_copy_out

    def release(self) -> None:
        if self.program is not None:
            self.ep.stats.group_released(self.name, self.calls)
        runner, self.runner = self.runner, None
        if runner is not None and hasattr(runner, "release"):
            runner.release()
        if self.mirrors is not None:
            self.mirrors.clear()
        if self.kv is not None:
            self.kv.clear()
        self.program = None

    # ------------------------------------------------------------------ per call
    def gather(self, kctx) -> list[np.ndarray | None]:
        """numpy views of ORT's input buffers (None: an omitted optional input).

        With many inputs (a decode step's KV buffers), an input at the same address with the same rank,
        dims and type as in the last gather keeps its view, and ``b.redo`` lists the others: one C compare
        (``ortmlx_same_inputs``), then Python work only for the inputs that changed."""
        abi, ffi = self.abi, self.abi.ffi
        b = getattr(self._tls, "b", None)
        if b is None:
            b = self._tls.b = _Buffers(ffi, self.n_in, abi.max_rank)
        b.prev_token, b.token, b.redo = b.token, next(_GATHERS), None
        abi.check(abi.gather_inputs(abi.api, kctx, self.n_in, b.data, b.dims, b.ndims, b.types))
        views = b.views
        if self.n_in >= CACHED_VIEWS_FROM:
            k = abi.same_inputs(self.n_in, abi.max_rank, b.data, b.dims, b.ndims, b.types, b.prev_data,
                                b.prev_dims, b.prev_ndims, b.prev_types, b.last_ok, b.changed)
            if b.last_ok:
                redo = ffi.unpack(b.changed, k)
                if b.uncached:
                    redo = sorted(b.uncached.union(redo))
            else:
                redo = range(self.n_in)
        else:
            redo = range(self.n_in)
        b.last_ok = False               # set again once every view below is made
        arrays = list(views)
        for i in redo:
            views[i] = None
            arrays[i] = a = self._view(b, i)
            if a is not None and a.size and b.types[i] not in dt.CARRIERS:
                views[i] = a
        if self.n_in >= CACHED_VIEWS_FROM:
            b.uncached = {i for i in redo if views[i] is None}
            b.last_ok = True
            if isinstance(redo, list):
                b.redo = redo
        return arrays

    def _view(self, b: _Buffers, i: int) -> np.ndarray | None:
        """A numpy view of gathered input ``i`` (a copy for carrier types), None when omitted."""
        ffi, r = self.abi.ffi, self.abi.max_rank
        nd = b.ndims[i]
        if nd == ffi.cast("size_t", -1):
            return None
        t = b.types[i]
        want = self.in_types[i]
        if want is not None and t != want:
            raise EpError(f"input {i} ('{self.in_names[i]}') is {dt.name(t)} at run time but the graph "
                          f"declares {dt.name(want)}", ORT_INVALID_ARGUMENT, node=self.name)
        shape = tuple(b.dims[i * r:i * r + nd])
        if t in dt.CARRIERS:        # float8 bits / packed 4- and 2-bit integers: one element per byte
            cnt = math.prod(shape)
            raw = ffi.buffer(b.data[i], dt.carrier_nbytes(t, cnt)) if cnt else b""
            return dt.unpack_carrier(raw, t, cnt).reshape(shape)
        npt = dt.NUMPY.get(t)
        if npt is None:
            raise EpError(f"input {i} ('{self.in_names[i]}') has element type {dt.name(t)}, which MLX cannot hold",
                          ORT_INVALID_ARGUMENT, node=self.name)
        cnt = math.prod(shape)
        if cnt == 0:
            return np.empty(shape, npt)
        return np.frombuffer(ffi.buffer(b.data[i], cnt * np.dtype(npt).itemsize), npt).reshape(shape)

    def addresses(self, inputs) -> dict[int, int]:
        """Buffer address -> input index, for the inputs an output may be written into (read-only: the map is
        kept for the next call while only inputs whose address, dims and type are unchanged)."""
        if self.mirrors is None:
            return {}
        b = self._tls.b
        at, ent, amap = b.addr_memo
        if b.redo is None or at != b.prev_token:
            ent = [p if _may_alias(a) else None for a, p in zip(inputs, b.addr.tolist())]
            amap = {p: i for i, p in enumerate(ent) if p is not None}
        else:
            new, dirty = list(ent), False
            for i in b.redo:
                p = int(b.addr[i]) if _may_alias(inputs[i]) else None
                if p != new[i]:
                    new[i], dirty = p, True
            if dirty:
                ent, amap = new, {p: i for i, p in enumerate(new) if p is not None}
        b.addr_memo = (b.token, ent, amap)
        return amap

    def use_mirrors(self, inputs, addrs: dict[int, int]) -> tuple[list, dict[int, mx.array]]:
        """Inputs with device mirrors substituted where ORT's buffer is one we mirror."""
        self._tls.kv = None
        if not self._aliased or not addrs:
            return inputs, {}
        run = list(inputs)
        used = {}
        if self.kv is not None and len(self.kv):
            b = self._tls.b
            kb = self.kv.take(inputs, b.addr, None if b.redo is None else (b.prev_token, b.redo))
            if kb is not None:
                self._tls.kv = kb
                L = kb.layout
                used = dict(zip(L.in_list, kb.arrays))
                if L.in_span is not None:
                    run[L.in_span[0]:L.in_span[1]] = kb.arrays
                else:
                    for i, m in used.items():
                        run[i] = m
        ent = self._tls.b.addr_memo[1]           # per input: its address in ``addrs``, or None
        for i in sorted(self._aliased.difference(used)):
            addr = ent[i]
            if addr is not None and addrs.get(addr) == i:
                m = self.mirrors.lookup(i, addr, inputs[i])
                if m is not None:
                    run[i] = used[i] = m
        return run, used

    def write_outputs(self, kctx, results, probe=None, inputs=(), addrs=None, used=None) -> int:
        """Copy every result into ORT's output buffers; returns the bytes copied.

        An output ORT places in the buffer of input ``i`` (genai's shared KV buffer) keeps its
        MLX result as that buffer's mirror; when the call ran on the mirror, only the rows
        that changed are written (``ep/mirror.py``).
        """
        moved = 0
        pending = []                    # (input index, address, result, old mirror, ORT's buffer)
        done: set[int] = set()
        hints = getattr(results, "row_hints", None)
        hinted, ptrs, hosts, batched = {}, None, {}, ()
        prev = getattr(self._tls, "kv", None)
        self._tls.kv = None
        if hints is not None:
            flat, starts = hint_bytes(hints, self.read)
            if self.kv is not None and used:
                ptrs, hosts, shapes = self._output_ptrs(kctx, results, probe, addrs)
                kb = self._write_batch(hints.meta, flat, starts, ptrs, results, inputs, used, prev, shapes)
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
                host = None if inplace else dt.host(r)
            shape = tuple(r.shape) if inplace else host.shape
            if ptrs is not None:
                ptr = self.abi.ffi.cast("void*", int(ptrs[j]))
            else:
                ptr = self._output(kctx, j, shape, probe)
            if inplace:
                addr = int(self.abi.ffi.cast("uintptr_t", ptr))
                i = self._aliased_input(addr, j, shape, inputs, addrs, done)
                if i is not None:
                    dst = inputs[i]         # ORT's buffer: the input's own (writable) view of it
                    h = hinted.get(j)
                    if h is not None and h[0] == i and i in used:
                        # the runner ran on the mirror and says which rows it changed: write just those
                        ranges = write_hinted(dst, h[1], h[2], h[3])
                        if ranges is not None:
                            moved += h[2].nbytes
                            self.mirrors.store(i, addr, dst, r, ranges)
                            self.kv_copy_out["row_hints"] += 1
                            continue
                    if used and i in used:
                        pending.append((i, addr, r, used[i], dst))
                    else:
                        moved += _copy_whole(dst, r, self.read)
                        self.mirrors.store(i, addr, dst, r, None)
                        self.kv_copy_out["whole"] += 1
                    continue
                host = dt.to_numpy(r)
            moved += self._copy(ptr, host, self.out_types[j], isinstance(r, mx.array))
            if j in hinted:
                # a hinted present computed in place (rows after the new ones are the past's) going to its
                # own buffer: ORT's kernel leaves those rows zero there
                self._zero_after_rows(ptr, host, hinted[j])
        if self.kv is not None and (rest := self._aliased.difference(done)) and \
                (stored := [a for a, i in addrs.items() if i in rest]) and len(self.kv):
            self.kv.drop(stored)        # the per-buffer path owns these buffers now
        return moved + self._write_pending(pending)

    def _output_ptrs(self, kctx, results, probe, addrs) -> tuple[np.ndarray, dict, list]:
        """ORT's buffers for every output in one C call: (addresses, {j: host result, or None for a
        device result that may go back in place}, the results' shapes)."""
        abi, b = self.abi, self._tls.b
        n = len(results)
        if b.n_out < n:
            _out_buffers(abi.ffi, b, n, abi.max_rank)
        inplace = bool(addrs)
        # the closure that made them (its outputs' types are fixed): with the same shapes, the same outputs go
        # back in place as last call (``mirrorable``: MLX results); without one, each call classifies them
        src = getattr(results, "source", None)
        memo = b.out_memo
        shapes = list(map(_SHAPE, results))
        if src is not None and memo[0] is src and memo[1] == inplace and shapes == memo[2]:
            host_idx = memo[3]
        else:
            host_idx = [j for j, r in enumerate(results) if not (inplace and mirrorable(r))]
        hosts = dict.fromkeys(range(n))
        for j in host_idx:
            hosts[j] = h = dt.host(results[j])
            if h.shape != shapes[j]:
                shapes[j] = h.shape
        b.out_memo = (src, inplace, shapes, host_idx)
        if shapes != b.last_oshapes:
            for j, shape in enumerate(shapes):
                self._check_rank(j, shape)
                b.oall_np[j, :len(shape)] = shape
                b.ondims_np[j] = len(shape)
            b.last_oshapes = shapes
        abi.check(abi.get_outputs(abi.api, kctx, n, b.oall, b.ondims, b.optrs))
        if probe is not None:
            probe.fault_point("copy_out")       # testing: fail with the outputs already allocated
        return b.optrs_np[:n], hosts, shapes    # (a view: valid until the next call on this thread)

    def _write_batch(self, meta, flat, starts, ptrs, results, inputs, used, prev, shapes):
        """The batched copy-out of every hinted row (ep/kvbatch.py), or None (nothing written)."""
        kv = self.kv
        addr = self._tls.b.addr
        L = kv.layout_for(meta, ptrs, inputs, addr, used, results, self.out_types,
                          prev.layout if prev is not None else getattr(self._tls, "kv_layout", None),
                          taken=prev is not None, res_shapes=shapes)
        if L is None:
            return None
        kb = kv.write(L, flat, starts, results, prev)
        if kb is None:
            return None
        self._tls.kv_layout = L
        if prev is None and self.mirrors is not None:
            for i, a in zip(L.in_list, L.addrs.tolist()):
                self.mirrors.drop(i, a)         # the batch owns these buffers' mirrors now
        kv.put(kb, self._tls.b.token)
        self.kv_copy_out["batched"] += len(L.in_list)
        return kb

    def _zero_after_rows(self, ptr, host: np.ndarray, hint) -> None:
        _, start, _, shape = hint
        s = shape[-2]
        if host.ndim != len(shape) or host.shape[0] != start.shape[0] or host.dtype.kind not in "fiu":
            raise EpError(f"row hint of shape {shape} does not fit an output of shape {host.shape}", node=self.name)
        dst = np.frombuffer(self.abi.ffi.buffer(ptr, host.nbytes), host.dtype).reshape(host.shape)
        for k, r0 in enumerate(start.tolist()):
            dst[k, ..., r0 + s:, :] = 0

    def _check_rank(self, j: int, shape: tuple) -> None:
        if len(shape) > self.abi.max_rank:
            raise EpError(f"output {j} ('{self.out_names[j]}') has rank {len(shape)} > {self.abi.max_rank}",
                          node=self.name)

    def _output(self, kctx, j: int, shape: tuple, probe):
        """ORT's buffer for output ``j``, allocated with ``shape``."""
        abi = self.abi
        b = self._tls.b
        self._check_rank(j, shape)
        for k, d in enumerate(shape):
            b.odims[k] = d
        abi.check(abi.get_output(abi.api, kctx, j, b.odims, len(shape), b.out))
        if j == 0 and probe is not None:
            probe.fault_point("copy_out")       # testing: fail with output 0 already allocated
        return b.out[0]

    def _copy(self, ptr, host: np.ndarray, t: int | None, device: bool = True) -> int:
        """Copy a host result (ONNX element type ``t``; ``device``: the host view of an MLX result, else
        host memory already, e.g. what a closure's kernel wrote there) into ORT's buffer at ``ptr``;
        returns bytes."""
        if not host.size:
            return 0
        ffi = self.abi.ffi
        if t in dt.CARRIERS:
            packed = dt.pack_carrier(host, t)           # a NumPy array, not a device result
            devread.NUMPY.copy_to_address(ptr, packed, ffi)
            return packed.nbytes
        (self.read if device else devread.NUMPY).copy_to_address(ptr, host, ffi)
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

    def _since(self) -> tuple | None:
        """What the runner may take from this thread's previous call (``CompiledSubgraph.run``'s ``since``)."""
        b = self._tls.b
        if b.redo is None or not self._since_ok:
            return None
        return (b.prev_token, b.token, b.redo)

    def copy_in(self, kctx) -> tuple[list, dict[int, int], list, dict[int, mx.array]]:
        """(ORT's inputs as numpy views, their buffer addresses, what the runner gets: device mirrors
        substituted where ORT's buffer has one, the substituted inputs)."""
        inputs = self.gather(kctx)
        addrs = self.addresses(inputs)
        run, used = self.use_mirrors(inputs, addrs)
        return inputs, addrs, run, used

    def copy_out(self, kctx, results, probe, inputs, addrs, used) -> None:
        """Write the results into ORT's buffers and count the bytes that crossed (mirrored inputs: none)."""
        out_bytes = self.write_outputs(kctx, results, probe, inputs, addrs, used)
        sent = self._every_input.difference(used) if used else range(len(inputs))
        residency.add(_nbytes(inputs[i] for i in sent), out_bytes)

    def compute(self, kctx) -> None:
        if self._observed:
            return self._compute_observed(kctx)
        inputs, addrs, run, used = self.copy_in(kctx)
        since = self._since()
        results = self.runner.run(run) if since is None else self.runner.run(run, since=since)
        self.copy_out(kctx, results, None, inputs, addrs, used)
        self.calls += 1
        self.ep.stats.calls += 1

    def _compute_observed(self, kctx) -> None:
        """Compute with per-stage timing, trace events and stage faults (trace/verbose/fault options)."""
        st = self.ep.stats
        probe = Probe(st.tracer, st, self.name)
        ok, err = False, None
        try:
            if st.faults is not None:
                st.fault("compute", self.name)
            probe.mark("copy_in")
            inputs, addrs, run, used = self.copy_in(kctx)
            if getattr(self.runner, "supports_probe", False):
                since = self._since()
                results = self.runner.run(run, probe=probe) if since is None else \
                    self.runner.run(run, probe=probe, since=since)       # marks build / eval itself
            else:
                probe.mark("run")
                results = self.runner.run(run)
            probe.mark("copy_out")
            self.copy_out(kctx, results, probe, inputs, addrs, used)
            ok = True
        except BaseException as e:
            err = e
            raise
        finally:
            probe.finish(ok, err)
            self.calls += 1
            st.calls += 1
