"""Versions: ortmlx's, the MLX backend installed, the onnxruntime that loaded the EP (imports nothing of ortmlx)."""
from __future__ import annotations

import os
import tempfile

__version__ = "0.1.0"

#: MLX's backend packages on Linux, by the extra that installs each (``pip install "ortmlx[cpu]"``)
BACKENDS = {"mlx-cpu": "cpu", "mlx-cuda-12": "cuda12", "mlx-cuda-13": "cuda13"}

_LOADED: list[str | None] = [None]


def mlx_backends() -> list[str]:
    """The MLX backend distributions installed (Linux: mlx-cpu / mlx-cuda-12 / mlx-cuda-13; macOS: mlx-metal)."""
    from importlib import metadata
    found = []
    for dist in (*BACKENDS, "mlx-metal"):
        try:
            metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            continue
        found.append(dist)
    return found


def set_loaded_ort(version: str) -> None:
    """Record the version of the onnxruntime that loaded the EP (its ABI layer calls this)."""
    _LOADED[0] = version


def loaded_ort_version() -> str | None:
    """The version string of the onnxruntime that loaded this EP (None before it did)."""
    return _LOADED[0]


def ptx_cache_dir() -> str | None:
    """MLX's CUDA kernel cache as MLX resolves it (``ptx_cache_dir`` in mlx/backend/cuda/jit_module.cpp):
    ``MLX_PTX_CACHE_DIR`` when set, else ``$TMPDIR/mlx/<version>/ptx``; None when set empty (MLX keeps none)."""
    d = os.environ.get("MLX_PTX_CACHE_DIR")
    if d is not None:
        return os.path.abspath(d) if d else None
    import mlx.core as mx
    return os.path.join(tempfile.gettempdir(), "mlx", mx.__version__, "ptx")


def mlx_cache_dir() -> str:
    """Where MLX keeps the kernels it builds: on its CUDA backend the PTX cache (``ptx_cache_dir``); else, or with
    that cache off, ``$TMPDIR/mlx`` (the CPU backend's g++ libraries are in ``<version>/cpu`` there)."""
    import mlx.core as mx
    return (ptx_cache_dir() if mx.cuda.is_available() else None) or os.path.join(tempfile.gettempdir(), "mlx")
