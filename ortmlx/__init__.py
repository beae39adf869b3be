"""ortmlx: an ONNX Runtime execution provider that runs ONNX graphs on MLX.

    import ortmlx, onnxruntime as ort
    ortmlx.register()
    sess = ort.InferenceSession("model.onnx", providers=["MLXExecutionProvider"])
"""
from __future__ import annotations

import atexit
import glob
import importlib.util
import os
import sys
import threading

# float32 matmuls must stay float32: MLX runs them as TF32 on CUDA/M5 GPUs unless told not to
# (a user who wants TF32 can set MLX_ENABLE_TF32=1 before importing; the EP then refuses the GPU).
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# MLX's CUDA backend: smaller CUDA graphs (commit every 30 kernels, not 100 on an H100/H200) let the GPU start on
# a decode step's first layers while the host still encodes the rest of an asynchronous eval (measured:
# docs/performance.md). MLX's CUDA caches throw ("Cache thrashing is happening") once a cache's
# misses over the process's life pass twice its size (800 for the CUDA graph cache): a performance heuristic that
# would fail inference in a long-lived process meeting many graphs (smaller graphs meet more pieces); without it
# a miss only costs a rebuild. Both are read once, when MLX makes its first GPU stream; set them to override.
if sys.platform == "linux":
    os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", "30")
    os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")

from . import blas as _blas  # noqa: E402
from .version import BACKENDS, __version__, mlx_backends  # noqa: E402,F401

# Linux CPU: bind MLX's CBLAS calls to OpenBLAS before anything imports mlx.core (ortmlx/blas.py).
_blas.preload()

def _check_backend() -> None:
    """Fail at import, in one line, when MLX has no backend (plain ``pip install ortmlx`` on Linux); warn when
    two are installed (they overwrite each other's libmlx.so: which one runs is whichever came last)."""
    try:
        import mlx.core  # noqa: F401
    except ImportError as e:
        raise ImportError(f"ortmlx: MLX cannot load ({str(e).splitlines()[0]}); on Linux install exactly one "
                          "backend: pip install \"ortmlx[cpu]\", \"ortmlx[cuda13]\" or \"ortmlx[cuda12]\"") from None
    if sys.platform.startswith("linux"):
        dup = [d for d in mlx_backends() if d in BACKENDS]
        if len(dup) > 1:
            import warnings
            warnings.warn(f"ortmlx: {' and '.join(dup)} are both installed and share mlx/lib/libmlx.so; keep one: "
                          f"pip uninstall -y {' '.join(dup)} && pip install \"ortmlx[{BACKENDS[dup[-1]]}]\"",
                          RuntimeWarning, stacklevel=2)


_check_backend()


def _kernel_cache() -> None:
    """MLX's CUDA backend keeps the kernels it builds (NVRTC) under $TMPDIR/mlx/<version>/ptx, which a reboot
    empties; point it at the user's cache folder instead, so a model's first generation after a reboot finds
    them (a MLX_PTX_CACHE_DIR set first wins; MLX reads it at its first kernel build)."""
    if "MLX_PTX_CACHE_DIR" in os.environ or not any(d.startswith("mlx-cuda") for d in mlx_backends()):
        return
    import mlx.core as mx
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.environ["MLX_PTX_CACHE_DIR"] = os.path.join(base, "ortmlx", f"mlx-{mx.__version__}-ptx")


_kernel_cache()

EP_NAME = "MLXExecutionProvider"

_lock = threading.Lock()
_registered: dict[str, str] = {}


def library_path() -> str:
    """Path of the shim ORT loads (exports CreateEpFactories / ReleaseEpFactory)."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ep")
    cands = sorted(glob.glob(os.path.join(here, "_shim*.so")) + glob.glob(os.path.join(here, "_shim*.dylib"))
                   + glob.glob(os.path.join(here, "_shim*.pyd")))
    if cands:
        return cands[0]
    spec = importlib.util.find_spec("ortmlx.ep._shim")
    if spec is None or not spec.origin:
        raise FileNotFoundError("ortmlx's shim is not built: install the package with `pip install .`")
    return spec.origin


def register(name: str = EP_NAME, genai: bool | None = None) -> str:
    """Register the EP with onnxruntime and, when installed, onnxruntime-genai's own ORT.

    Idempotent; returns the library path. ``genai=False`` skips onnxruntime-genai,
    ``genai=True`` requires it.
    """
    path = library_path()
    with _lock:
        if not _registered:
            _cffi_embedding_unlock()
        if "onnxruntime" not in _registered:
            import onnxruntime as ort
            ort.register_execution_provider_library(name, path)
            _registered["onnxruntime"] = path
        if genai is not False and "onnxruntime_genai" not in _registered:
            try:
                import onnxruntime_genai as og
            except ImportError:
                if genai:
                    raise
            else:
                og.register_execution_provider_library(name, path)
                _registered["onnxruntime_genai"] = path
                # genai's ORT must let go of the library before the interpreter finalizes
                atexit.register(_genai_unregister, og, name)
    return path


def _cffi_embedding_unlock() -> None:
    """Python < 3.12: cffi's embedding start-up (run when ORT first calls into the shim) spins
    until PyCapsule_Type.tp_version_tag is 0, but any earlier attribute lookup on a capsule
    (``import torch`` does one) sets that tag: the process would hang forever inside
    ``register_execution_provider_library``. PyType_Modified resets the tag (it only drops the
    type's attribute cache)."""
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return
    import ctypes
    import datetime
    fn = ctypes.pythonapi.PyType_Modified
    fn.argtypes, fn.restype = [ctypes.py_object], None
    fn(type(datetime.datetime_CAPI))


def _genai_unregister(og, name: str) -> None:
    try:
        og.unregister_execution_provider_library(name)
    except Exception:  # noqa: BLE001
        pass


def partition_reports() -> list:
    """Partition reports of every MLX EP created in this process (newest last)."""
    from .ep.provider import REPORTS
    return list(REPORTS)
