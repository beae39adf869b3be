"""Tracing a closure: the traced body of one key's ``mx.compile`` closure and what it adds to the outputs.

Besides the group's outputs a trace may return, in order: the row hints' bytes (the rows a decode step wrote
into its in-place KV outputs, gathered by one kernel, on a GPU straight into page-locked host memory: the
closure's ``sink``), and the guard (the traced checks, one boolean). Outputs read on the host (the logits) may
be written by a kernel into the sink too.
"""
from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from ..kernels import build, consts, cuda_cache, cuda_driver, cuda_kernels
from ..kernels import dtypes as dt
from ..stats import SessionStats
from .config import CompiledConfig
from .decode_ops import Untraceable
from .mode import unfused_calls

#: traces a shape-keyed closure of a shapeless key may make before it is given up (shapes vary)
MAX_FIXED_TRACES = 3


def compile_closure(c, n_group_inputs: int, out_types: list, config: CompiledConfig, counters: dict,
                    stats: SessionStats | None, name: str, fuse: bool = True):
    """The ``mx.compile`` closure of closure ``c``'s program (``c.trace_prog``) for one key: ``c``'s device inputs
    traced (the group's ``n_group_inputs``, then its hoisted values), the others baked in; while tracing it sets
    the closure's trace state (traces, row hints, host outputs in its page-locked sink, guard). ``fuse`` False:
    traced without MLX's kernel fusion (``mode.unfused``)."""
    program = c.trace_prog
    n, host_vals = len(program.inputs), c.host_vals
    dev_idx = c.dev_idx + tuple(range(n_group_inputs, n))      # then the hoisted values
    contiguous = config.contiguous_outputs

    shapeless = c.shapeless
    #: the row hints' bytes gathered by one custom kernel (not one copy kernel per piece)
    one_kernel = program.cuda_kernels and cuda_kernels.usable()
    #: ... straight into page-locked host memory (read after the eval: no device buffer, no copy call)
    to_host = one_kernel and program.pinned_hints

    def body(*dev):
        c.traces += 1                       # a Python side effect: runs only while tracing
        counters["traces"] += 1
        if not shapeless and config.shapeless and c.traces > MAX_FIXED_TRACES:
            raise Untraceable(f"shapes changed between calls ({c.traces} traces of a fixed-shape closure)")
        if stats is not None and stats.faults is not None:
            stats.fault("trace", name)
        return outputs(*dev)

    def program_inputs(dev) -> list:
        inputs: list = [None] * n
        for i, a in zip(dev_idx, dev):
            inputs[i] = a
        for i, v in host_vals.items():
            inputs[i] = v
        return inputs

    def trace_context(kernels: bool):
        return program.config.context(cuda_kernels=kernels, shapeless=shapeless, tracing=True, guards=[], hints=[])

    def outputs(*dev):
        """The traced body's outputs (also built eagerly, with real arrays: ``compiled/replay.py`` records a
        step's launches so)."""
        inputs = program_inputs(dev)
        ctx = trace_context(program.cuda_kernels and cuda_kernels.usable())
        with build.active(ctx):
            env = program.build(inputs, ctx=ctx)
            outs = [device_output(env[o], t, contiguous) for o, t in zip(program.outputs, out_types)]
            guards, hints = ctx.guards, list(ctx.hints)
            meta = _hinted_outputs(hints, outs, {id(inputs[i]): i for i in dev_idx})
            c.hints = [m for m in meta if m is not None]
            retrace = to_host and c.sink is not None
            # outputs read on the host (the logits) go to host memory too, ahead of the hints' bytes
            host_outs = _host_outputs(outs, hints, [inputs[i] for i in dev_idx],
                                      cuda_kernels.DIRECT_MIN if program.direct_out else None) \
                if to_host and not shapeless else []
            layout, hint_at = [], 0
            for j in host_outs:
                layout.append((j, hint_at, tuple(outs[j].shape), outs[j].dtype))
                hint_at = -(-(hint_at + outs[j].nbytes) // 256) * 256
            c.hint_at = hint_at
            if c.hints:
                data, c.hint_starts = _hint_arrays(
                    hints, meta, one_kernel, (lambda used: _sink_address(c, hint_at, used)) if to_host else None)
                outs.append(data)
            if layout and _sink_address(c, 0, hint_at) is not None:
                for j, off, _, _ in layout:
                    outs[j] = cuda_kernels.copy_to_host(outs[j], _sink_address(c, off, outs[j].nbytes))
                c.host_outs = [(j, off, off + math.prod(shape) * d.size, shape, dt.NUMPY[dt.FROM_MLX[d]])
                               for j, off, shape, d in layout]
            c.guard_count = len(guards)
            if guards:
                outs.append(_guard_value(guards, shapeless))
            if c.sink is not None:
                mine = (tuple(c.hints), tuple(c.hint_starts.tolist()) if c.hints else (), hint_at, tuple(layout),
                        c.guarded)
                if retrace and mine != c.sink_layout:
                    raise Untraceable("a retrace of a closure whose kernels write host memory lays it out otherwise")
                c.sink_layout = mine
            cuda_cache.settle()             # the trace's kernel builds, run at once, done before its first eval
            return outs

    def guard_only(*dev):
        """(The body's guard, how many guards made it) built from ``dev`` without our kernels: MLX's ops only, so
        any stream may evaluate it (the guards do not depend on which kernels a translator takes)."""
        inputs = program_inputs(dev)
        ctx = trace_context(False)
        with build.active(ctx):
            program.build(inputs, ctx=ctx)
            guards = ctx.guards
            return (_guard_value(guards, shapeless) if guards else mx.array(True)), len(guards)

    c.outputs, c.guard_only = outputs, guard_only
    fn = mx.compile(body, shapeless=shapeless)
    return fn if fuse else unfused_calls(fn)


def _hinted_outputs(hints: list, outs: list, inputs: dict) -> list:
    """Per hint (output j, input i, row shape, item size) when its present is a group output and its past
    a traced group input (by identity), else None (that output is diffed as usual)."""
    out_at = {id(o): j for j, o in enumerate(outs)}
    meta = []
    for present, past, start, rows in hints:
        j, i = out_at.get(id(present)), inputs.get(id(past))
        if j is None or i is None or rows.dtype != present.dtype or rows.ndim != present.ndim \
                or start.size != present.shape[0] or any(m is not None and m[0] == j for m in meta):
            meta.append(None)
            continue
        meta.append((j, i, tuple(rows.shape), rows.dtype.size))
    return meta


def _hint_arrays(hints: list, meta: list, one_kernel: bool = False, sink=None) -> tuple[mx.array, np.ndarray]:
    """The extra output of the kept hints (their rows as flat bytes, then each distinct start array as
    int32 bytes: one copy kernel per piece, or ``one_kernel``: ``cuda_kernels.gather_bytes``), and per
    hint batch row the index of its start value. ``sink`` (with ``one_kernel``): called with the bytes
    used, the address array of host memory the kernel writes them to instead (then the output is one
    byte), or None."""
    kept = [h for h, m in zip(hints, meta) if m is not None]
    if one_kernel and len(kept) + len({id(s) for _, _, s, _ in kept}) <= cuda_kernels.GATHER_MAX \
            and all(r.size for _, _, _, r in kept):
        # the kernel copies each array's bytes as they are: no reshape or uint8 view (two primitives each)
        rows = [r for _, _, _, r in kept]
    else:
        one_kernel = False
        rows = [r.reshape(-1).view(mx.uint8) for _, _, _, r in kept]
    pieces, at, index, n = [], {}, [], 0     # ``kept`` holds every start: ids stay unique here
    for _, _, s, _ in kept:
        if id(s) not in at:
            at[id(s)] = n
            n += s.size
            s32 = s.astype(mx.int32)
            pieces.append(s32 if one_kernel else s32.reshape(-1).view(mx.uint8))
        index.extend(range(at[id(s)], at[id(s)] + s.size))
    if one_kernel:
        used = sum(int(a.nbytes) for a in rows + pieces)
        address = sink(used) if sink is not None else None
        if address is not None:
            return cuda_kernels.gather_bytes(rows + pieces, to_host=address), np.asarray(index, np.intp)
        return cuda_kernels.gather_bytes(rows + pieces, size=_hint_room(used)), np.asarray(index, np.intp)
    return mx.concatenate(rows + pieces), np.asarray(index, np.intp)


def _sink_address(c, offset: int, nbytes: int) -> mx.array | None:
    """The device address of ``nbytes`` at ``offset`` of the closure's page-locked host buffer, as the
    uint64 array a kernel reads (the trace keeps it); the buffer is made for its one trace (page-rounded).
    None without the CUDA driver."""
    if c.sink is None:
        drv = cuda_driver.driver()
        if drv is None:
            return None
        try:
            c.sink = cuda_driver.HostBuffer(drv, -(-(offset + nbytes) // 4096) * 4096)
        except cuda_driver.DriverError:
            return None
    if offset + nbytes > c.sink.nbytes:
        raise Untraceable(f"{offset + nbytes} bytes outgrew the closure's host buffer ({c.sink.nbytes} bytes)")
    # one array per place: a recorded step reads it as a constant (``compiled/replay.py``)
    made = c.sink.__dict__.setdefault("addresses", {})
    if offset not in made:
        made[offset] = consts.roomy(mx.array([c.sink.device_address + offset], dtype=mx.uint64))
    return made[offset]


#: element types an output may take through host memory (a NumPy view of the bytes; not bfloat16)
_HOST_OUT_TYPES = frozenset((mx.float32, mx.float16, mx.int32, mx.int64, mx.int8, mx.uint8, mx.int16,
                             mx.uint16, mx.uint32, mx.uint64))
#: most bytes of outputs one closure sends to host memory
HOST_OUT_MAX = 64 << 20


def _host_outputs(outs: list, hints: list, traced: list, direct: int | None = None) -> list[int]:
    """The outputs a closure's kernels write to host memory: not a present a row hint names nor shaped
    like a traced input (a buffer that may be written in place and kept as a device mirror), of a type
    NumPy holds, more than one element (the kernel's one-byte output stands for them), within
    ``HOST_OUT_MAX`` together, each under ``direct`` bytes when given (larger ones the runtime writes
    straight into ORT's buffer: ``runtime/devread.py``)."""
    named = {id(h[0]) for h in hints}
    inputs = {(tuple(a.shape), a.dtype) for a in traced if isinstance(a, mx.array)}
    picked, total = [], 0
    for j, o in enumerate(outs):
        if id(o) in named or (tuple(o.shape), o.dtype) in inputs or o.dtype not in _HOST_OUT_TYPES or \
                o.size < 2 or total + o.nbytes > HOST_OUT_MAX or (direct is not None and o.nbytes >= direct):
            continue
        picked.append(j)
        total += o.nbytes
    return picked


#: Extra bytes of the row hints' device buffer on MLX's CUDA backend. Reading a result on the host
#: (``np.asarray``) moves a device-memory buffer into managed memory first (``cudaMallocManaged`` and a
#: blocking copy, host time a decode token pays: docs/history/performance-2026-11.md); a managed buffer stays managed when MLX's cache hands it out again, but only to a request of
#: about its size (within 32 KB). A decode row's hints (~12 KB) share their size class (16 KB) with
#: every layer's MLP activations, so the buffer they get is mostly a device one. Padded to a page
#: multiple plus this, the buffer has a size of its own, and the managed buffer of one token comes back
#: the next. The pad is never written nor read.
HINT_ROOM = 149 << 14


def _guard_value(guards: list, shapeless: bool) -> mx.array:
    """The closure's one boolean: every guard true. One-element guards (``decode_ops.every``) are
    and-ed elementwise, one fused kernel, and reduced once; the others reduce each. A chain of
    ands, not a stack (a copy kernel per guard). In a shapeless trace every guard reduces (a
    size seen at trace time may change)."""
    elementwise = [] if shapeless else [g for g in guards if g.size == 1]
    reduced = [mx.all(g) for g in guards if shapeless or g.size != 1]
    if elementwise:
        reduced.insert(0, mx.all(functools.reduce(mx.logical_and, elementwise)))
    return functools.reduce(mx.logical_and, reduced)


def _hint_room(used: int) -> int:
    """The padded byte size of a row-hint buffer of ``used`` bytes (``HINT_ROOM``)."""
    return -(-used // (1 << 14)) * (1 << 14) + HINT_ROOM


def device_output(v, t: int | None, contiguous: bool) -> mx.array:
    """A traced output as an MLX array (host outputs become constants of this key's trace)."""
    if not isinstance(v, mx.array):
        a = np.asarray(v)
        v = dt.to_mx(a, t if t is not None else dt.onnx_type_of(a))
    return mx.contiguous(v) if contiguous else v


