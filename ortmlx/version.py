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


def mlx_cache_dir() -> str:
    """Where MLX keeps the kernels it builds (CPU: g++ libraries; CUDA: PTX/CUBIN, ``MLX_PTX_CACHE_DIR`` if set)."""
    return os.environ.get("MLX_PTX_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "mlx")
