"""Optimized BLAS for MLX's Linux CPU backend.

MLX's Linux CPU wheel (``mlx[cpu]``) links the reference (netlib) BLAS: a 1024^2
fp32 matmul takes ~0.5 s instead of ~10 ms. ``preload()`` runs when ``ortmlx`` is
imported, before anything imports ``mlx.core``: it loads ``ortmlx._blasfwd`` with
RTLD_GLOBAL, whose ``cblas_sgemm`` / ``cblas_dgemm`` / ``cblas_cgemm`` then win the
symbol lookup of ``libmlx.so`` (the global scope comes before libmlx's own
dependencies) and forward to scipy-openblas32's OpenBLAS (``scipy_cblas_*``, the
OpenBLAS build NumPy and SciPy ship). LAPACK calls (inverse, QR, eig ...) stay on
the reference library.

It does nothing when: ``ORTMLX_TUNING=blas=0``; not Linux;
``mlx.core`` was imported before ``ortmlx`` (too late to interpose: ``status()``
says so); scipy-openblas32 or the forwarder is missing. On the CUDA backend only
CPU-stream matmuls go through it.

Threads: ``ORTMLX_TUNING=blas_threads=N`` (or ``OPENBLAS_NUM_THREADS``) when set, else
``max(1, min(4, cpu_count))``, with ``OPENBLAS_THREAD_TIMEOUT=4`` unless set: OpenBLAS's
idle workers otherwise spin and take the cores from MLX's CPU thread and ORT's pool in the
same process (measured: docs/performance.md, ``blas_threads``).
"""
from __future__ import annotations

import ctypes
import os
import re
import sys

from .tuning import Tuning, TuningError

#: OPENBLAS_THREAD_TIMEOUT default: workers spin ~2^4 cycles before sleeping (OpenBLAS's minimum)
SPIN_TIMEOUT = "4"

_state: dict = {"active": False, "reason": "not attempted", "library": None, "threads": None}
_fwd = None


def _tuning() -> Tuning:
    """The environment's tuning (a malformed ORTMLX_TUNING is reported when an EP is created, not at import)."""
    try:
        return Tuning.from_env()
    except TuningError:
        return Tuning()


def _disabled() -> bool:
    return not _tuning().blas


def _prefix(sob) -> str:
    """The symbol prefix scipy-openblas was built with (``scipy_``), from its pkg-config text."""
    try:
        m = re.search(r"BLAS_SYMBOL_PREFIX=(\w+)", sob.get_pkg_config())
    except Exception:  # noqa: BLE001
        m = None
    return m.group(1) if m else "scipy_"


def preload() -> dict:
    """Interpose the optimized BLAS (idempotent); returns ``status()``."""
    global _fwd
    if _state["reason"] != "not attempted":
        return status()
    if _disabled():
        _state["reason"] = "disabled by ORTMLX_TUNING=blas=0"
    elif not sys.platform.startswith("linux"):
        _state["reason"] = f"not needed on {sys.platform}"
    elif "mlx.core" in sys.modules:
        _state["reason"] = "mlx.core was imported before ortmlx: MLX keeps the BLAS it bound"
    else:
        # idle workers stop spinning almost at once (OpenBLAS reads it when it loads, which importing
        # scipy_openblas32 may do): spinning workers take the cores from MLX's and ORT's own threads
        os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", SPIN_TIMEOUT)
        try:
            import scipy_openblas32 as sob
            from . import _blasfwd
        except ImportError as e:
            _state["reason"] = f"unavailable: {e}"
            return status()
        lib_path = os.path.join(sob.get_lib_dir(), f"lib{sob.get_library()}.so")
        try:
            ob = ctypes.CDLL(lib_path, mode=ctypes.RTLD_GLOBAL)
            pre = _prefix(sob)
            addrs = [ctypes.cast(getattr(ob, f"{pre}cblas_{t}gemm"), ctypes.c_void_p).value for t in "sdc"]
            fwd = ctypes.CDLL(_blasfwd.__file__, mode=ctypes.RTLD_GLOBAL)
        except (OSError, AttributeError) as e:
            _state["reason"] = f"could not load {lib_path}: {e}"
            return status()
        _blasfwd.lib.ortmlx_blas_bind(*[_blasfwd.ffi.cast("void*", a) for a in addrs])
        _fwd = (ob, fwd)
        _state.update(active=True, reason="ok", library=lib_path, threads=_set_threads(ob, pre))
    return status()


def _set_threads(ob, pre: str) -> int | None:
    """Apply the thread policy (module docstring); returns OpenBLAS's thread count."""
    want = _tuning().blas_threads
    try:
        if want is not None:
            n = want
        elif os.environ.get("OPENBLAS_NUM_THREADS", "").strip():
            n = None                                    # OpenBLAS read it itself
        else:
            n = max(1, min(4, os.cpu_count() or 1))
        if n is not None and n > 0:
            getattr(ob, f"{pre}openblas_set_num_threads")(ctypes.c_int(n))
        return int(getattr(ob, f"{pre}openblas_get_num_threads")())
    except (ValueError, AttributeError):
        return None


def calls() -> int:
    """How many cblas_*gemm calls the forwarder has routed (0 when inactive)."""
    if not _state["active"]:
        return 0
    from . import _blasfwd
    return int(_blasfwd.lib.ortmlx_blas_calls())


def status() -> dict:
    """``{'active': bool, 'reason': str, 'library': path or None, 'threads': OpenBLAS threads or None}``."""
    return dict(_state)
