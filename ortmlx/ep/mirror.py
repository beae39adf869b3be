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
seen; ``no_kv_mirror=1`` turns mirrors off. Only buffers with a leading (batch) dim of 1
are mirrored (beam search reorders rows of batched buffers between calls).
"""
from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np


#: most mirrored buffers kept per group input (each holds one device copy of the buffer)
MAX_PER_INPUT = 2
#: rows of the last write kept (per leading index) to check the host buffer against
CHECK_ROWS = 4

_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def mirrorable(a) -> bool:
    """Whether an MLX result can mirror an ORT buffer: rank >= 2, batch 1, non-empty, a plain type."""
    return (isinstance(a, mx.array) and a.ndim >= 2 and a.shape[0] == 1 and a.size > 0
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


_changed_compiled = mx.compile(_changed_body)


def changed_rows(pairs: list[tuple[mx.array, mx.array]], compiled: bool) -> list[np.ndarray]:
    """For each (new, old) pair an int32 [L, 2] array of changed row ranges [first, end) per leading
    index (first >= end: none), from one device round trip of L x S flags per pair."""
    flat = [a for p in pairs for a in p]
    fn = _changed_compiled if compiled else _changed_body
    flags = np.array(fn(*flat), copy=True)
    out, at = [], 0
    for new, _ in pairs:
        s = new.shape[-2]
        n = new.size // (s * new.shape[-1])
        f = flags[at:at + n * s].reshape(n, s)
        at += n * s
        any_ = f.any(axis=1)
        first = np.where(any_, f.argmax(axis=1), s)
        end = np.where(any_, s - f[:, ::-1].argmax(axis=1), 0)
        out.append(np.stack([first, end], axis=1).astype(np.int32))
    return out


def _rows3(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-2], a.shape[-1])


class Mirror:
    """One ORT buffer's device copy and the host rows that vouch for it."""

    __slots__ = ("shape", "dtype", "array", "checks")

    def __init__(self, shape: tuple, dtype, array: mx.array, checks: list):
        self.shape = shape
        self.dtype = dtype
        self.array = array
        self.checks = checks            # [(leading index, row0, row1, bytes)]

    def holds(self, host: np.ndarray) -> bool:
        """Whether ``host`` (ORT's buffer now) still matches what was written from this mirror."""
        if host.shape != self.shape or host.dtype != self.dtype:
            return False
        h3 = _rows3(host)
        return all(h3[l, r0:r1].tobytes() == b for l, r0, r1, b in self.checks)


def checks_for(host: np.ndarray, ranges: np.ndarray | None) -> list:
    """The rows to check next call: row 0 of every block and the last rows written."""
    h3 = _rows3(host)
    s = h3.shape[1]
    out = [(l, 0, 1, h3[l, 0:1].tobytes()) for l in range(h3.shape[0])]
    for l in range(h3.shape[0]):
        if ranges is None:
            r0, r1 = max(0, s - CHECK_ROWS), s
        else:
            r0, r1 = int(ranges[l, 0]), int(ranges[l, 1])
            if r0 >= r1:
                continue
            r0 = max(r0, r1 - CHECK_ROWS)
        out.append((l, r0, r1, h3[l, r0:r1].tobytes()))
    return out


def write_rows(pending: list, ranges: list[np.ndarray]) -> int:
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
    host = np.asarray(flat)
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

    def store(self, i: int, addr: int, host: np.ndarray, array: mx.array, ranges: np.ndarray | None) -> None:
        m = Mirror(host.shape, host.dtype, array, checks_for(host, ranges))
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

