#!/usr/bin/env bash
# Create (or reuse) .venv and install ortmlx from a wheel built from this checkout, with one MLX backend and
# everything the tests and the demo need (the genai model builder's torch included).
# Usage: bash scripts/setup_env.sh   (ORTMLX_BACKEND=cpu|cuda12|cuda13 overrides the pick)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip "setuptools>=77" wheel cffi
# MLX's backend is an extra (mlx-cpu and mlx-cuda-* overwrite each other's libmlx.so): one of them, or none on macOS
backend=${ORTMLX_BACKEND:-}
if [ -z "$backend" ] && [ "$(uname -s)" != Darwin ]; then
  backend=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1)
    if [ "${cuda:-0}" -ge 13 ]; then backend=cuda13; else backend=cuda12; fi
  fi
fi
extras="test,genai,builder${backend:+,$backend}"
# torch only serves onnxruntime-genai's model builder (its CPU build)
python -m pip install -q "torch==2.13.0"
rm -rf .venv/dist
python -m pip wheel -q --no-deps --no-build-isolation -w .venv/dist .
whl=$(ls .venv/dist/ortmlx-*.whl)
python -m pip install -q "$whl[$extras]"
python -m pip install -q --force-reinstall --no-deps "$whl"      # this checkout's build, same version or not
cd /
python -c "import ortmlx, mlx.core as mx, onnxruntime as ort; print('ortmlx', ortmlx.__version__, ortmlx.mlx_backends(), '| mlx', mx.__version__, mx.default_device(), '| onnxruntime', ort.__version__, '| shim', ortmlx.library_path())"
