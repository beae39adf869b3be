"""Device-resident mirrors of ORT buffers that a group reads and writes in place.

genai's shared KV buffer (``past_present_share_buffer``) binds a group's present K/V output
to the very buffer it reads as past K/V. Without a mirror, every call copies the whole
buffer host -> device (``mx.array``) and back (O(buffer) per token). With one:

- after a call whose output ``j`` was written into the buffer of input ``i`` (same address,
  shape and element type), the MLX result is kept as the mirror of that buffer;
- the next call whose input ``i`` has that address, shape and type gets the mirror instead
  of a copy, after checking the host rows we wrote last (and row 0 of every block) still
  hold what we wrote: anything else (a buffer replaced, reused, rewritten) re-uploads once;
- copy-out compares the new result with the mirror on the device (bit patterns, so -0.0
  and NaN payloads count) and writes only the changed row ranges (axis -2, per leading
  index) into ORT's buffer: O(new tokens) bytes per call.

Contract (genai's): between calls nobody but this group writes rows of the buffer that the
group will read. A writer that changes other rows without touching the checked ones is not
seen; ``tuning=kv_mirror=0`` turns mirrors off. A batch's buffers are mirrored too: genai shares past and
present only without beam search (``GeneratorParams::IsPastPresentShareBufferEnabled``: ``num_beams == 1``), so
no call reorders a shared buffer's batch rows; each row's own blocks are checked as above.
"""
from __future__ import annotations

import itertools
import math
import threading

import mlx.core as mx
import numpy as np

from ..compiled.mode import unfused_calls
from ..kernels import cuda_kernels as ck
from .devread import NUMPY, Reader


#: most mirrored buffers kept per group input (each holds one device copy of the buffer)
MAX_PER_INPUT = 2
#: rows of the last write kept (per leading index) to check the host buffer against
CHECK_ROWS = 4

_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def mirrorable(a) -> bool:
    """Whether an MLX result can mirror an ORT buffer: rank >= 2, non-empty, a plain type."""
    return (isinstance(a, mx.array) and a.ndim >= 2 and a.size > 0
            and a.dtype.size in _UINT)


def _changed_body(*pairs):
    """One flat bool array: for each (new, old) pair, per leading index and row (axis -2), whether the
    row's bits differ (two kernels a pair: the compare fuses into the reduction's input)."""
    out = []
    for k in range(0, len(pairs), 2):
        new, old = pairs[k], pairs[k + 1]
        s, r = new.shape[-2], new.shape[-1]
        ut = _UINT[new.dtype.size]
        out.append(mx.any(new.reshape(-1, s, r).view(ut) != old.reshape(-1, s, r).view(ut), axis=-1).reshape(-1))
    return mx.concatenate(out) if len(out) > 1 else out[0]


# traced without fusion: the write-back serves eager calls, the first generation's among them, which a fused
# kernel's build would stall for seconds
_changed_compiled = unfused_calls(mx.compile(_changed_body))


def _pick(n3, rows):
    """``mx.take(n3, rows, axis=1)`` for an [L, S, W] array: on MLX's CUDA backend through our row kernel
    (``cuda_kernels.take_rows``, the instantiation the embedding's gather already built), as MLX's gather is a
    kernel its JIT builds alone (seconds, in the first generation on a new host)."""
    L, S, W = n3.shape
    if ck.usable():
        flat = n3.reshape(L * S, W)
        idx = (mx.arange(L, dtype=mx.int32)[:, None] * S + rows[None, :]).reshape(-1)
        if ck.take_reason(flat, idx, 0) is None:
            return ck.take_rows(flat, idx)
    return mx.take(n3, rows, axis=1)


def _changed_and_rows_body(rows, *pairs):
    """``_changed_body``'s flags, and the ``rows`` (int32, axis -2, every leading index) of each
    pair's new array as one flat byte array: a predicted write-back in the same round trip."""
    picked = []
    for k in range(0, len(pairs), 2):
        new = pairs[k]
        n3 = new.reshape(-1, new.shape[-2], new.shape[-1])
        picked.append(_pick(n3, rows).reshape(-1).view(mx.uint8))
    return _changed_body(*pairs), mx.concatenate(picked) if len(picked) > 1 else picked[0]


_changed_and_rows_compiled = unfused_calls(mx.compile(_changed_and_rows_body))


def changed_rows(pairs: list[tuple[mx.array, mx.array]], compiled: bool, predict: range | None = None,
                 read: Reader = NUMPY):
    """For each (new, old) pair an int32 [L, 2] array of changed row ranges [first, end) per leading
    index (first >= end: none), from one device round trip of L x S flags per pair.

    With ``predict`` (rows along axis -2 valid in every pair), that round trip also brings those
    rows of every new array: returns (ranges, those rows' host bytes, pair after pair) instead.
    ``compiled``: one closure call (traced unfused), else MLX's ops one by one.
    """
    flat = [a for p in pairs for a in p]
    if predict is not None:
        fn = _changed_and_rows_compiled if compiled else _changed_and_rows_body
        rows = mx.array(np.arange(predict.start, predict.stop, dtype=np.int32))
        f, picked = fn(rows, *flat)
        mx.eval(f, picked)
        return _ranges(pairs, read.read(np.asarray(f))), read.read(np.asarray(picked))
    fn = _changed_compiled if compiled else _changed_body
    return _ranges(pairs, read.read(np.asarray(fn(*flat))))


def _ranges(pairs, flags: np.ndarray) -> list[np.ndarray]:
    """Per pair, [first, end) of the set flags of each leading index's S rows (runs of pairs
    with the same layout are done in one NumPy pass)."""
    out, at, k = [], 0, 0
    while k < len(pairs):
        new = pairs[k][0]
        s = new.shape[-2]
        n = new.size // (s * new.shape[-1])
        m = 1                                   # pairs k .. k+m-1 share (n, s)
        while k + m < len(pairs) and pairs[k + m][0].shape[-2] == s and \
                pairs[k + m][0].size // (s * pairs[k + m][0].shape[-1]) == n:
            m += 1
        f = flags[at:at + m * n * s].reshape(m * n, s)
        at += m * n * s
        any_ = f.any(axis=1)
        first = np.where(any_, f.argmax(axis=1), s)
        end = np.where(any_, s - f[:, ::-1].argmax(axis=1), 0)
        both = np.stack([first, end], axis=1).astype(np.int32).reshape(m, n, 2)
        out.extend(both)
        k += m
    return out


def _rows3(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-2], a.shape[-1])


class Mirror:
    """One ORT buffer's device copy and the host rows that vouch for it."""

    __slots__ = ("shape", "dtype", "array", "row0", "checks", "ends")

    def __init__(self, shape: tuple, dtype, array: mx.array, checks: tuple[list, list],
                 ends: np.ndarray | None = None):
        self.shape = shape
        self.dtype = dtype
        self.array = array
        # [(leading index, row0, row1, bytes)]: row 0 of every block, and the rows written last
        self.row0, self.checks = checks
        self.ends = ends                # end of the last changed range per leading index (None: unknown)

    def holds(self, host: np.ndarray) -> bool:
        """Whether ``host`` (ORT's buffer now) still matches what was written from this mirror."""
        if host.shape != self.shape or host.dtype != self.dtype:
            return False
        h3 = _rows3(host)
        return all(h3[l, r0:r1].tobytes() == b for l, r0, r1, b in itertools.chain(self.row0, self.checks))


def checks_for(host: np.ndarray, ranges: np.ndarray | None, row0: list | None = None) -> tuple[list, list]:
    """The rows to check next call: (row 0 of every block, the last rows written).

    ``row0``: the row-0 checks of the previous mirror, reused when ``ranges`` wrote no row 0
    (they were checked at this call's copy-in and nothing wrote them since).
    """
    h3 = _rows3(host)
    s, n = h3.shape[1], h3.shape[0]
    rl = None if ranges is None else ranges.tolist()
    if row0 is not None and rl is not None and len(row0) == n and min(r[0] for r in rl) > 0:
        first = row0
    else:
        first = [(l, 0, 1, h3[l, 0:1].tobytes()) for l in range(n)]
    out = []
    for l in range(n):
        if rl is None:
            r0, r1 = max(0, s - CHECK_ROWS), s
        else:
            r0, r1 = rl[l]
            if r0 >= r1:
                continue
            r0 = max(r0, r1 - CHECK_ROWS)
        out.append((l, r0, r1, h3[l, r0:r1].tobytes()))
    return first, out


def predicted_rows(ends: list[np.ndarray | None], shapes: list[tuple]) -> range | None:
    """The row a decode step writes next in every buffer: the row after the last range written
    when all buffers (and leading indices) agree and it exists in all of them, else None."""
    row = None
    for e, shape in zip(ends, shapes):
        if e is None or e.size == 0 or not (e == e.flat[0]).all():
            return None
        r = int(e.flat[0])
        if (row is not None and r != row) or r <= 0 or r >= shape[-2]:
            return None
        row = r
    return None if row is None else range(row, row + 1)


def write_predicted(pending: list, ranges: list[np.ndarray], rows: range, picked: np.ndarray) -> int | None:
    """Write the changed rows from ``picked`` (``rows`` of every (result, ORT buffer) pair, flat bytes in
    pair order) when every changed range lies inside ``rows``; returns bytes, or None (write nothing:
    some change lies outside the prediction)."""
    for rng in ranges:
        live = rng[:, 0] < rng[:, 1]
        if live.any() and ((rng[live, 0] < rows.start).any() or (rng[live, 1] > rows.stop).any()):
            return None
    k, at, moved = len(rows), 0, 0
    for (new, dst), rng in zip(pending, ranges):
        d3 = _rows3(dst)
        L, r = d3.shape[0], d3.shape[2]
        block = picked[at:at + L * k * r * d3.itemsize].view(d3.dtype).reshape(L, k, r)
        at += block.nbytes
        for l in range(L):
            r0, r1 = int(rng[l, 0]), int(rng[l, 1])
            if r0 < r1:
                np.copyto(d3[l, r0:r1], block[l, r0 - rows.start:r1 - rows.start])
                moved += (r1 - r0) * r * d3.itemsize
    return moved


def hint_bytes(hints, read: Reader = NUMPY) -> tuple[np.ndarray, np.ndarray]:
    """A runner's row hints (``compiled.core.RowHints``) on the host: (the rows as flat bytes, the
    start rows), one round trip for every hinted output."""
    return hints.split(hints.host_data(read.read))


def write_hinted(dst: np.ndarray, start: np.ndarray, raw: np.ndarray, shape: tuple,
                 jobs: list | None = None) -> np.ndarray | None:
    """Write the rows (``raw`` bytes of ``shape`` (B, ..., S, H) in dst's type) into ``dst`` (B, ..., P, H)
    at row ``start[b]`` of each batch row; returns the written ranges per leading index ([L, 2], as
    ``changed_rows``), or None when they do not fit (nothing written). ``jobs``: where both are row-major, the
    copies are appended there as (destination address, source address, bytes), one per block, for the caller
    to run (``devread.parallel_copies``) before it reads ``dst``, instead of being made here."""
    b, s, p = shape[0], shape[-2], dst.shape[-2]
    if tuple(shape[:-2]) != dst.shape[:-2] or shape[-1] != dst.shape[-1] or start.shape != (b,) \
            or raw.nbytes != math.prod(shape) * dst.itemsize:
        return None
    st = start.tolist()
    if min(st) < 0 or max(st) + s > p:
        return None
    per = math.prod(dst.shape[1:-2])
    ranges = np.empty((b * per, 2), np.int32)
    if jobs is not None and dst.flags.c_contiguous and raw.flags.c_contiguous:
        row = shape[-1] * dst.itemsize
        d0, s0 = dst.ctypes.data, raw.ctypes.data
        for k, r0 in enumerate(st):
            for m in range(k * per, (k + 1) * per):
                jobs.append((d0 + (m * p + r0) * row, s0 + m * s * row, s * row))
            ranges[k * per:(k + 1) * per] = (r0, r0 + s)
        return ranges
    rows = raw.view(dst.dtype).reshape(shape)
    for k, r0 in enumerate(st):
        dst[k, ..., r0:r0 + s, :] = rows[k]
        ranges[k * per:(k + 1) * per] = (r0, r0 + s)
    return ranges


def write_rows(pending: list, ranges: list[np.ndarray], read: Reader = NUMPY) -> int:
    """Copy the changed row ranges of each (result, ORT buffer) into the buffer; returns bytes.

    The rows are gathered on the device into one small array first, so only they cross to
    the host (a host view of a whole GPU result would migrate all of its pages).
    """
    pieces, where = [], []
    for (new, dst), rng in zip(pending, ranges):
        n3 = new.reshape(-1, new.shape[-2], new.shape[-1])
        for l in range(rng.shape[0]):
            r0, r1 = int(rng[l, 0]), int(rng[l, 1])
            if r0 < r1:
                pieces.append(n3[l, r0:r1].flatten().view(mx.uint8))
                where.append((dst, l, r0, r1))
    if not pieces:
        return 0
    flat = mx.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    host = read.read(np.asarray(flat))
    at = 0
    for dst, l, r0, r1 in where:
        d = _rows3(dst)[l, r0:r1]
        n = d.nbytes
        np.copyto(d, host[at:at + n].view(d.dtype).reshape(d.shape))
        at += n
    return at


class MirrorSet:
    """A group's mirrors: group input index -> {buffer address -> Mirror}."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_input: dict[int, dict[int, Mirror]] = {}

    def lookup(self, i: int, addr: int, host: np.ndarray) -> mx.array | None:
        with self._lock:
            m = self._by_input.get(i, {}).get(addr)
        if m is None:
            return None
        if m.holds(host):
            return m.array
        self.drop(i, addr)
        return None

    def ends(self, i: int, addr: int) -> np.ndarray | None:
        """Where the last write into this buffer ended, per leading index (None: not known)."""
        with self._lock:
            m = self._by_input.get(i, {}).get(addr)
        return None if m is None else m.ends

    def store(self, i: int, addr: int, host: np.ndarray, array: mx.array, ranges: np.ndarray | None) -> None:
        ends = None
        if ranges is not None and (ranges[:, 0] < ranges[:, 1]).all():
            ends = ranges[:, 1].copy()
        with self._lock:
            old = self._by_input.get(i, {}).get(addr)
        same = old is not None and old.shape == host.shape and old.dtype == host.dtype
        checks = checks_for(host, ranges, old.row0 if same else None)
        if same:
            with self._lock:
                if self._by_input.get(i, {}).get(addr) is old:     # a decode step: update in place
                    old.array, (old.row0, old.checks), old.ends = array, checks, ends
                    return
        m = Mirror(host.shape, host.dtype, array, checks, ends)
        with self._lock:
            per = self._by_input.setdefault(i, {})
            per.pop(addr, None)
            per[addr] = m
            while len(per) > MAX_PER_INPUT:
                per.pop(next(iter(per)))

    def drop(self, i: int, addr: int) -> None:
        with self._lock:
            self._by_input.get(i, {}).pop(addr, None)

    def clear(self) -> None:
        with self._lock:
            self._by_input.clear()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._by_input.values())

