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
import threading

from . import blas as _blas

# Linux CPU: bind MLX's CBLAS calls to OpenBLAS before anything imports mlx.core (ortmlx/blas.py).
_blas.preload()

__version__ = "0.1.0"
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


def _genai_unregister(og, name: str) -> None:
    try:
        og.unregister_execution_provider_library(name)
    except Exception:  # noqa: BLE001
        pass


def partition_reports() -> list:
    """Partition reports of every MLX EP created in this process (newest last)."""
    from .ep.provider import REPORTS
    return list(REPORTS)
