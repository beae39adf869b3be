#!/usr/bin/env bash
# Create (or reuse) .venv and install ortmlx with everything the tests and demo need.
# Usage: source scripts/setup_env.sh   (or bash it; it leaves .venv ready)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel cffi
case "$(uname -s)" in
  Darwin) mlx_req="mlx" ;;
  *) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then mlx_req="mlx[cuda13]"; else mlx_req="mlx[cpu]"; fi ;;
esac
# torch only serves the onnxruntime-genai model builder (CPU build; 2.13.0 lies on this kind's disk)
python -m pip install -q "$mlx_req==0.32.4" "torch==2.13.0" 
python -m pip install -q --no-build-isolation -e ".[test,genai]"   # editable: the shim is built in-tree
python -c "import ortmlx, mlx.core as mx, onnxruntime as ort; print('ortmlx', ortmlx.__version__, '| mlx', mx.__version__, mx.default_device(), '| onnxruntime', ort.__version__, '| shim', ortmlx.library_path())"
