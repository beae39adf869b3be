import os
import tempfile

import pytest

os.environ.setdefault("ORTMLX_TEST", "1")
# Each pytest-xdist worker keeps MLX's kernel caches ($TMPDIR/mlx) to itself: MLX's CPU backend writes a kernel's
# source and library in place, so another process building the same kernel at once could load a half-written one.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _tmp = os.path.join(tempfile.gettempdir(), "ortmlx-tests-" + os.environ["PYTEST_XDIST_WORKER"])
    os.makedirs(_tmp, exist_ok=True)
    os.environ["TMPDIR"] = _tmp
    tempfile.tempdir = None
# Calls answer as they did before kernels built behind them (tuning build_behind): the suite counts traces and
# compiled calls, which would otherwise depend on how fast the builder thread is. test_build_behind.py turns it on.
os.environ.setdefault("ORTMLX_TUNING", "build_behind=0")

# Before any test module imports MLX, as a user's process does: ``import ortmlx`` first puts OpenBLAS under MLX's
# CPU products (ortmlx/blas.py), which then sum in OpenBLAS's order whatever the modules' collection order.
import ortmlx  # noqa: E402,F401


@pytest.fixture(scope="session", autouse=True)
def _register():
    import ortmlx
    ortmlx.register(genai=False)
