"""One fused group's compute info: ORT's kernel context in, ORT's output buffers out.

``compute`` is gather -> run -> write: the inputs become NumPy views of ORT's buffers (``gather``: C helpers of
the shim, a memo of the views of unchanged buffers), the group's runtime (``runtime/group.py``) runs them and
writes the results into the output buffers this layer allocates from ORT (``_Sink``).
"""
from __future__ import annotations

import itertools
import math
import threading

import numpy as np

from ..kernels import dtypes as dt
from ..runtime.group import Gathered, Group, may_alias
from ..trace import Probe
from .errors import ORT_INVALID_ARGUMENT, EpError

#: the gather helper's rank for an omitted optional input (size_t -1)
_OMITTED = (1 << 64) - 1
#: bytes per element of each plain element type
_ITEMSIZE = {t: np.dtype(npt).itemsize for t, npt in dt.NUMPY.items()}

#: gather numbers: an input memo made at gather ``t`` serves the next gather on the same buffers, whose
#: ``prev_token`` is ``t`` (unique in the process, so one thread's number never matches another's)
_GATHERS = itertools.count(1)


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
        self.n_out = 0                  # output buffers below, sized on first use (_Sink.allocate)
        self.last_oshapes = None
        #: what the runtime gets: this thread's gathered call (refilled every call)
        self.call = Gathered()


def _out_buffers(ffi, b: _Buffers, n_out: int, max_rank: int) -> None:
    b.n_out = n_out
    b.oall = ffi.new("int64_t[]", n_out * max_rank)
    b.ondims = ffi.new("int64_t[]", n_out)
    b.optrs = ffi.new("uint64_t[]", n_out)
    b.optrs_np = np.frombuffer(ffi.buffer(b.optrs), np.uint64)
    b.oall_np = np.frombuffer(ffi.buffer(b.oall), np.int64).reshape(n_out, max_rank)
    b.ondims_np = np.frombuffer(ffi.buffer(b.ondims), np.int64)
    b.last_oshapes = None


class _Sink:
    """ORT's output buffers of one thread's call in progress (``runtime.group.OutputSink``)."""

    def __init__(self, info: "ComputeInfo", b: _Buffers):
        self.info, self.b, self.kctx = info, b, None

    def allocate(self, shapes: list) -> np.ndarray:
        info, b = self.info, self.b
        abi = info.abi
        n = len(shapes)
        if not n:                       # a group whose outputs no one reads (ORT kept a dead node)
            return np.zeros(0, np.uint64)
        if b.n_out < n:
            _out_buffers(abi.ffi, b, n, abi.max_rank)
        if shapes != b.last_oshapes:
            for j, shape in enumerate(shapes):
                info.check_rank(j, shape)
                b.oall_np[j, :len(shape)] = shape
                b.ondims_np[j] = len(shape)
            b.last_oshapes = shapes
        abi.check(abi.get_outputs(abi.api, self.kctx, n, b.oall, b.ondims, b.optrs))
        return b.optrs_np[:n]           # (a view: valid until the next call on this thread)

    def allocate_one(self, j: int, shape: tuple):
        info, b = self.info, self.b
        abi = info.abi
        info.check_rank(j, shape)
        for k, d in enumerate(shape):
            b.odims[k] = d
        abi.check(abi.get_output(abi.api, self.kctx, j, b.odims, len(shape), b.out))
        return b.out[0]


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
        self.group = Group(plan, ep.device, ep.options, ep.stats, abi, ep.source)
        self.in_names = list(plan.inputs)
        self.in_types = [plan.value(n).dtype for n in plan.inputs]
        self.out_names = list(plan.outputs)
        self.n_in = len(self.in_names)
        self._tls = threading.local()
        c = self.c = ffi.new("OrtNodeComputeInfo*")
        c.ort_version_supported = abi.struct_version
        c.CreateState = lib.ortmlx_nci_create_state
        c.Compute = lib.ortmlx_nci_compute
        c.ReleaseState = lib.ortmlx_nci_release_state
        self.address = int(ffi.cast("uintptr_t", c))
        self.calls = 0
        self._observed = ep.stats.observed
        #: ``Gathered.fill`` of every call: the address map, made when asked, for a group that reads it
        self._fill = self._fill_addresses if self.group.wants_addresses else None

    def release(self) -> None:
        if self.group is not None:
            self.ep.stats.group_released(self.name, self.calls)
            self.group.release()
        self.group = None

    # ------------------------------------------------------------------ per call
    def compute(self, kctx) -> None:
        if self._observed:
            return self._compute_observed(kctx)
        g, sink = self.gather(kctx)
        result, used = self.group.run(g)
        self.group.write(g, result, used, sink)
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
            g, sink = self.gather(kctx)
            result, used = self.group.run(g, probe)          # the runner marks build / eval itself
            probe.mark("copy_out")
            self.group.write(g, result, used, sink, probe)
            ok = True
        except BaseException as e:
            err = e
            raise
        finally:
            probe.finish(ok, err)
            self.calls += 1
            st.calls += 1

    def gather(self, kctx) -> tuple[Gathered, _Sink]:
        """The call's inputs (numpy views of ORT's input buffers, None: an omitted optional input) and its
        output buffers.

        An input at the same address with the same rank, dims and type as in the last gather keeps its view,
        and ``b.redo`` lists the others: one C compare (``ortmlx_same_inputs``), then Python work only for the
        inputs that changed (a decode step's KV buffers stay; a steady call on the same buffers makes no view)."""
        abi, ffi = self.abi, self.abi.ffi
        b = getattr(self._tls, "b", None)
        if b is None:
            b = self._tls.b = _Buffers(ffi, self.n_in, abi.max_rank)
            b.sink = _Sink(self, b)
        b.prev_token, b.token, b.redo = b.token, next(_GATHERS), None
        abi.check(abi.gather_inputs(abi.api, kctx, self.n_in, b.data, b.dims, b.ndims, b.types))
        views = b.views
        redo = range(self.n_in)
        if self.n_in:
            k = abi.same_inputs(self.n_in, abi.max_rank, b.data, b.dims, b.ndims, b.types, b.prev_data,
                                b.prev_dims, b.prev_ndims, b.prev_types, b.last_ok, b.changed)
            if b.last_ok:
                redo = ffi.unpack(b.changed, k) if k else []
                if b.uncached:
                    redo = sorted(b.uncached.union(redo))
        b.last_ok = False               # set again once every view below is made
        arrays = list(views)
        for i in redo:
            views[i] = None
            arrays[i] = a = self._view(b, i)
            if a is not None and a.size and b.types[i] not in dt.CARRIERS:
                views[i] = a
        if redo:
            b.uncached = {i for i in redo if views[i] is None}
        b.last_ok = True
        if isinstance(redo, list):
            b.redo = redo
        g = b.call
        g.inputs, g.addr, g.token, g.prev_token, g.redo = arrays, b.addr, b.token, b.prev_token, b.redo
        g.fill = self._fill
        b.sink.kctx = kctx
        return g, b.sink

    def _fill_addresses(self) -> None:
        """``Gathered.fill``: this thread's call gets its address map (``addresses``)."""
        b = self._tls.b
        g = b.call
        g.addrs = self.addresses(g.inputs)
        g.slots = b.addr_memo[1]
        g.fill = None

    def _view(self, b: _Buffers, i: int) -> np.ndarray | None:
        """A numpy view of gathered input ``i`` (a copy for carrier types), None when omitted."""
        ffi, r = self.abi.ffi, self.abi.max_rank
        nd = b.ndims[i]
        if nd == _OMITTED:
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
        return np.frombuffer(ffi.buffer(b.data[i], cnt * _ITEMSIZE[t]), npt).reshape(shape)

    def addresses(self, inputs) -> dict[int, int]:
        """Buffer address -> input index, for the inputs an output may be written into (read-only: the map is
        kept for the next call while only inputs whose address, dims and type are unchanged)."""
        b = self._tls.b
        at, ent, amap = b.addr_memo
        if b.redo is None or at != b.prev_token:
            ent = [p if may_alias(a) else None for a, p in zip(inputs, b.addr.tolist())]
            amap = {p: i for i, p in enumerate(ent) if p is not None}
        else:
            new, dirty = list(ent), False
            for i in b.redo:
                p = int(b.addr[i]) if may_alias(inputs[i]) else None
                if p != new[i]:
                    new[i], dirty = p, True
            if dirty:
                ent, amap = new, {p: i for i, p in enumerate(new) if p is not None}
        b.addr_memo = (b.token, ent, amap)
        return amap

    def check_rank(self, j: int, shape: tuple) -> None:
        if len(shape) > self.abi.max_rank:
            raise EpError(f"output {j} ('{self.out_names[j]}') has rank {len(shape)} > {self.abi.max_rank}",
                          node=self.name)
