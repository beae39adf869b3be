"""What ``import ortmlx`` sets in the process environment for MLX (before MLX reads it), and that a value
the user set first is kept."""
import os
import subprocess
import sys

import pytest

LINUX = sys.platform.startswith("linux")

# (variable, the user's value or None, the value after ``import ortmlx``, why)
CASES = [
    ("MLX_ENABLE_TF32", None, "0", "float32 matmuls stay float32 on CUDA / M5 GPUs"),
    ("MLX_ENABLE_TF32", "1", "1", "the user's choice is kept (the EP then refuses the GPU)"),
    ("MLX_MAX_OPS_PER_BUFFER", None, "30" if LINUX else None,
     "CUDA graphs of 30 kernels on Linux (the GPU starts while the host encodes); untouched elsewhere"),
    ("MLX_MAX_OPS_PER_BUFFER", "100", "100", "the user's choice is kept"),
    ("MLX_ENABLE_CACHE_THRASHING_CHECK", None, "0" if LINUX else None,
     "no exception from MLX's CUDA graph cache after 800 misses in a process; untouched elsewhere"),
    ("MLX_ENABLE_CACHE_THRASHING_CHECK", "1", "1", "the user's choice is kept"),
    ("MLX_PTX_CACHE_DIR", "/tmp/elsewhere", "/tmp/elsewhere", "the user's choice is kept"),
]
_CUDA = any(d.startswith("mlx-cuda") for d in __import__("ortmlx").mlx_backends())
if not _CUDA:
    CASES.append(("MLX_PTX_CACHE_DIR", None, None, "MLX's CPU backend builds no CUDA kernels: left unset"))


@pytest.mark.parametrize("var,given,want,why", CASES, ids=[f"{c[0]}={c[1]}" for c in CASES])
def test_import_sets_defaults_only(var, given, want, why):
    env = {k: v for k, v in os.environ.items() if k != var}
    if given is not None:
        env[var] = given
    code = f"import os, ortmlx; print(os.environ.get({var!r}, 'unset'))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split()[-1] == (want if want is not None else "unset"), why


@pytest.mark.skipif(not _CUDA, reason="MLX's CUDA backend only (its NVRTC kernel cache)")
def test_cuda_kernel_cache_is_kept_across_reboots(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MLX_PTX_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    code = "import os, ortmlx, mlx.core as mx; print(os.environ['MLX_PTX_CACHE_DIR'], mx.__version__)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    path, version = p.stdout.split()
    assert path == str(tmp_path / "ortmlx" / f"mlx-{version}-ptx"), p.stdout
