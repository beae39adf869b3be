"""A decode group's KV buffers in steady state: a few C calls and NumPy operations per Compute
instead of ~10 Python operations per buffer (a 24-layer model has 48 of them).

The per-buffer path (``mirror.py``) is the reference. A call whose every row-hinted output
(``compiled.core.RowHints``: the decode attention wrote one declared row into each shared
K/V buffer) went back into its own input's buffer, each such input having run on its mirror (or,
a first prompt's, on zeros in its place: ``RunResult.standins``), leaves a ``KvBatch``:

- the buffers (``Layout``: input and output indices, addresses, shapes, types) and their
  device mirrors (the call's results);
- the blocks that vouch for the mirrors, as (host address, expected bytes' address, length):
  row 0 of every block (leading index) and the rows just written, whose expected bytes are the
  hinted rows themselves, kept alive in the batch (``mirror.checks_for`` checks the same rows).

The next call whose inputs are the same buffers compares all those blocks in one C call: equal,
and every mirror is substituted (the call owns the batch until its copy-out leaves the next one);
any difference, and the batch is gone: the per-buffer path uploads those buffers whole, as it
does for a mirror that no longer holds. The rows go into ORT's buffers in one C copy.
Contract and limits are ``mirror.py``'s; a batch's rows are written each at its own start.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Protocol

import numpy as np

from ..compiled.core import picker
from ..kernels import dtypes as dt

#: batches kept per group (two generators alternating on one model each keep theirs)
MAX_BATCHES = 2


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class Layout:
    """The hinted buffers of one closure at fixed addresses: what every steady call shares."""

    def __init__(self, meta: list, addrs: list[int], shapes: list[tuple], dtypes: list):
        self.meta = meta                                    # the closure's RowHints.meta (by identity)
        self.ins = np.array([i for _, i, _, _ in meta], np.intp)
        self.outs = np.array([j for j, _, _, _ in meta], np.intp)
        self.in_list = [i for _, i, _, _ in meta]
        self.out_list = [j for j, _, _, _ in meta]
        self.addrs = np.array(addrs, np.uint64)
        self.addr_bytes = self.addrs.tobytes()             # one bytes compare per call (``same_at``)
        self.addr_set = frozenset(addrs)
        self.shapes, self.dtypes = tuple(shapes), dtypes   # host shapes / numpy dtypes per buffer (the outputs' too)
        # the C copy's units: each hinted buffer's batch rows in turn (the hints' starts come in that order), each
        # unit a run of blocks (heads) of rows written at its own start; made for all buffers at once (a loop over
        # 48 buffers' NumPy arrays cost a new generator's first calls ~1 ms)
        u64 = np.uint64
        b = np.array([shape[0] for _, _, shape, _ in meta], np.int64)
        heads = np.array([math.prod(shape[1:-2]) for _, _, shape, _ in meta], np.int64)
        s = np.array([shape[-2] for _, _, shape, _ in meta], np.int64)
        row = np.array([shape[-1] * isz for _, _, shape, isz in meta], np.int64)
        p = np.array([h[-2] for h in shapes], np.int64)
        size = b * heads * s * row
        self.nblk = np.repeat(heads, b)
        self.max_start = np.repeat(p - s, b)
        nb = b * heads                                                  # (batch row, head) blocks per buffer
        blk = (np.arange(int(nb.sum()), dtype=np.int64) - np.repeat(np.cumsum(nb) - nb, nb)).astype(u64)
        self.rb = np.repeat(row, nb).astype(u64)
        self.base = np.repeat(np.array(addrs, u64), nb) + blk * np.repeat(p * row, nb).astype(u64)
        self.lens = np.repeat(s * row, nb).astype(u64)
        offset = np.cumsum(size) - size                                 # each buffer's rows' offset in the flat bytes
        self.rel_src = np.repeat(offset, nb).astype(u64) + blk * np.repeat(s * row, nb).astype(u64)
        self.flat_bytes = int(size.sum())
        self.row0_at = np.concatenate([[0], np.cumsum(self.rb)[:-1]]).astype(np.uint64)
        self.row0_bytes = int(self.rb.sum())
        self.nblocks = int(self.nblk.sum())
        self.check_lens = np.concatenate([self.rb, self.lens])               # a batch's check: row 0s, then rows
        self._c = None
        self.out_set = frozenset(self.out_list)
        self.in_set = frozenset(self.in_list)
        self.pick_outs = picker(self.out_list)          # the outputs' entries of a list, as a tuple
        #: (first, end) when the inputs are a run of consecutive indices in order (a slice assigns them)
        lo = self.in_list[0] if self.in_list else 0
        self.in_span = (lo, lo + len(self.in_list)) if self.in_list == list(range(lo, lo + len(self.in_list))) \
            else None
        self._others: tuple = (-1, [])

    def others(self, n: int) -> list[int]:
        """Of ``n`` outputs, those not in the layout, in order."""
        if self._others[0] != n:
            self._others = (n, [j for j in range(n) if j not in self.out_set])
        return self._others[1]

    def c_args(self, ffi) -> tuple:
        """The layout's constant arrays as ``ortmlx_kv_write`` takes them (made once; they keep the arrays)."""
        if self._c is None:
            f = ffi.from_buffer
            self._c = (f("int64_t[]", self.max_start), f("int64_t[]", self.nblk),
                       f("uint64_t[]", self.base), f("uint64_t[]", self.rb), f("uint64_t[]", self.rel_src),
                       f("uint64_t[]", self.lens))
        return self._c

    def same_at(self, addrs: np.ndarray) -> bool:
        """``addrs`` (uint64, in layout order) are the layout's buffer addresses."""
        return addrs.dtype == np.uint64 and addrs.tobytes() == self.addr_bytes

    def same_buffers(self, inputs: list, in_addr: np.ndarray) -> bool:
        """These inputs are the layout's buffers (addresses, shapes, types)."""
        if not self.same_at(in_addr[self.ins]):
            return False
        for i, shape, dtype in zip(self.in_list, self.shapes, self.dtypes):
            x = inputs[i]
            if x is None or x.shape != shape or x.dtype != dtype:
                return False
        return True


class KvBatch:
    """One call sequence's mirrored KV buffers and the blocks that vouch for them."""

    __slots__ = ("layout", "arrays", "row0", "check", "keep", "token")

    def __init__(self, layout: Layout, arrays: list, row0: tuple, check: tuple, keep: tuple):
        self.layout = layout
        self.token = None                   # the gather of the call that left it (``put``)
        self.arrays = arrays                # the device mirrors (MLX results), in layout order
        self.row0 = row0                    # (block addresses, where their row-0 copy is, lengths, the copy)
        self.check = check                  # (host, expected, lengths): uint64 arrays for one C compare
        self.keep = keep                    # arrays the expected addresses point into


class ShimCalls(Protocol):
    """The shim's C helpers the runtime calls (the ABI layer's ``Abi``): its cffi ``ffi`` and, from its library,
    ``ortmlx_copy_blocks``, ``ortmlx_compare_blocks`` and ``ortmlx_kv_write`` (``ep/cdef.py``)."""
    ffi: Any
    copy_blocks: Callable[..., None]
    compare_blocks: Callable[..., int]
    kv_write: Callable[..., int]


class KvBatches:
    """A group's batches: a call takes the one its inputs are, its copy-out leaves the next."""

    def __init__(self, abi: ShimCalls):
        self._lock = threading.Lock()
        self._batches: list[KvBatch] = []
        self._ffi = abi.ffi
        self._copy, self._compare = abi.copy_blocks, abi.compare_blocks
        self._kv_write = abi.kv_write

    def _blocks(self, fn, a: np.ndarray, b: np.ndarray, n: np.ndarray):
        f = self._ffi.from_buffer
        return fn(len(n), f("uint64_t[]", a), f("uint64_t[]", b), f("uint64_t[]", n))

    def take(self, inputs: list, in_addr: np.ndarray, since: tuple | None = None) -> KvBatch | None:
        """The batch these inputs are, if ORT's buffers still hold what it wrote (the call owns it
        now); a batch of these buffers that no longer holds is dropped. ``since``: (the previous
        gather on these inputs' buffers, the inputs whose address, dims or type may have changed since):
        a batch left by that gather's call whose buffers are none of those is these inputs' without
        looking at each."""
        with self._lock:
            for k, b in enumerate(self._batches):
                if since is not None and b.token == since[0] and b.layout.in_set.isdisjoint(since[1]) or \
                        b.layout.same_buffers(inputs, in_addr):
                    del self._batches[k]
                    break
            else:
                return None
        host, want, n = b.check
        return b if self._blocks(self._compare, host, want, n) < 0 else None

    def put(self, b: KvBatch, token=None) -> None:
        """Keep ``b`` for the next call (``token``: the gather of the call that left it)."""
        b.token = token
        with self._lock:
            self._batches = [x for x in self._batches if x.layout.addr_set.isdisjoint(b.layout.addr_set)]
            self._batches.append(b)
            del self._batches[:-MAX_BATCHES]

    def drop(self, addrs) -> None:
        """Forget batches holding any of these buffer addresses (the per-buffer path wrote them)."""
        a = np.array(list(addrs), np.uint64)
        with self._lock:
            self._batches = [b for b in self._batches
                             if not np.intersect1d(b.layout.addrs, a).size]

    def clear(self) -> None:
        with self._lock:
            self._batches = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._batches)

    # ------------------------------------------------------------------ copy-out
    def layout_for(self, meta: list, ptrs: np.ndarray, inputs: list, in_addr: np.ndarray, used: dict,
                   results: list, out_types: list, prev: Layout | None, taken: bool = False,
                   res_shapes: list | None = None) -> Layout | None:
        """The layout of a call's hinted outputs when every one qualifies (its ORT buffer is its
        input's, that input ran on a mirror or on zeros in its place (``used``), shapes and types fit), else None.

        ``taken``: ``prev`` is the layout of the batch this call took at copy-in (its inputs were
        checked to be those buffers, and every one ran on its mirror). ``res_shapes``: the results' shapes."""
        if prev is not None and prev.meta is meta and prev.same_at(ptrs[prev.outs]) and \
                (taken or (prev.same_buffers(inputs, in_addr) and all(i in used for i in prev.in_list))):
            L = prev
        else:
            if not meta:
                return None
            at = in_addr[[i for _, i, _, _ in meta]]
            if not np.array_equal(ptrs[[j for j, _, _, _ in meta]], at) or not at.all():
                return None
            addrs, shapes, dtypes = at.tolist(), [], []
            for j, i, shape, itemsize in meta:
                x = inputs[i]
                npt = dt.NUMPY.get(out_types[j])
                if x is None or i not in used or npt is None or x.dtype != npt or x.itemsize != itemsize or \
                        len(shape) < 3 or shape[:-2] != x.shape[:-2] or shape[-1] != x.shape[-1]:
                    return None
                shapes.append(x.shape)
                dtypes.append(x.dtype)
            if len(set(addrs)) != len(addrs):
                return None
            L = Layout(meta, addrs, shapes, dtypes)
        if res_shapes is None:
            res_shapes = [tuple(r.shape) for r in results]
        if L.pick_outs(res_shapes) != L.shapes:
            return None
        return L

    def write(self, L: Layout, flat: np.ndarray, starts: np.ndarray, results: list,
              prev: KvBatch | None) -> KvBatch | None:
        """Write the hinted rows (``flat``: their bytes in meta order; ``starts``: first row per
        buffer and batch row) into ORT's buffers; returns the next batch, or None (nothing written) when the
        rows do not fit. One C call (``ortmlx_kv_write``) checks the starts, copies every block
        and lays out the next call's check; after an eval, each NumPy operation here cost ~10 us."""
        if flat.nbytes != L.flat_bytes or starts.shape != L.max_start.shape:
            return None
        if starts.dtype != np.int32 or not starts.flags.c_contiguous:
            if ((starts < 0) | (starts > L.max_start)).any():
                return None                 # (checked before narrowing: a wrapped start must not fit)
            starts = np.ascontiguousarray(starts, np.int32)
        nb = L.nblocks
        dst, src = np.empty(2 * nb, np.uint64), np.empty(2 * nb, np.uint64)
        reuse = prev is not None and prev.layout is L
        f = self._ffi.from_buffer
        lo = self._kv_write(len(L.nblk), f("int32_t[]", starts), *L.c_args(self._ffi), _addr(flat),
                            f("uint64_t[]", prev.row0[1]) if reuse else self._ffi.NULL,
                            f("uint64_t[]", dst), f("uint64_t[]", src))
        if lo < 0:
            return None
        if reuse and lo > 0:
            row0 = prev.row0                # checked at this call's copy-in and not written since
        else:
            row0 = self._row0(L)
            src[:nb] = row0[1]
        return KvBatch(L, list(L.pick_outs(results)), row0, (dst, src, L.check_lens), (flat, row0[3]))

    def _row0(self, L: Layout) -> tuple:
        """A copy of every block's row 0 as it is now: (block addresses, the copies' addresses, lengths, the copy)."""
        copy0 = np.empty(L.row0_bytes, np.uint8)
        where0 = _addr(copy0) + L.row0_at
        self._blocks(self._copy, where0, L.base, L.rb)
        return (L.base, where0, L.rb, copy0)
