"""Host<->device traffic of the EP's Compute calls, counted per process.

Every Compute hands MLX its inputs (numpy views of ORT's buffers, which MLX copies
onto its device: ``mx.array`` copies, on the GPU too) and copies every output back
into ORT's buffer. ``ortmlx.ep.compute`` adds those byte counts here; ``snapshot()``
reads them, ``reset()`` zeroes them. ``bench.py`` divides by tokens to report the
per-token host<->device bytes of a generation.

Inputs served from a device mirror (``runtime/mirror.py``: genai's shared KV buffer) count 0 bytes in;
an in-place output counts only the rows written back.
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
_c = {"calls": 0, "h2d_bytes": 0, "d2h_bytes": 0}


def add(n_in: int, n_out: int) -> None:
    """One Compute call moved ``n_in`` bytes ORT->MLX and ``n_out`` bytes MLX->ORT."""
    with _lock:
        _c["calls"] += 1
        _c["h2d_bytes"] += n_in
        _c["d2h_bytes"] += n_out


def snapshot() -> dict:
    with _lock:
        return dict(_c)


def reset() -> None:
    with _lock:
        for k in _c:
            _c[k] = 0
