"""Optimized BLAS under MLX's Linux CPU backend (ortmlx/blas.py): interposed, counted, same answers."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's Linux CPU wheel only")

PROBE = r"""
import json, sys
first_mlx = sys.argv[1] == "mlx-first"
if first_mlx:
    import mlx.core
import ortmlx, ortmlx.blas as b
import mlx.core as mx, numpy as np
rng = np.random.default_rng(0)
out = {"status": b.status(), "calls0": b.calls(), "err": {}}
with mx.stream(mx.cpu):
    for name, dt, mxdt in (("s", np.float32, mx.float32), ("d", np.float64, mx.float64),
                           ("c", np.complex64, mx.complex64)):
        a = rng.standard_normal((96, 80)).astype(dt)
        c = rng.standard_normal((80, 72)).astype(dt)
        if name == "c":
            a = a + 1j * rng.standard_normal((96, 80)).astype(np.float32)
            c = c - 2j * rng.standard_normal((80, 72)).astype(np.float32)
        r = mx.matmul(mx.array(a), mx.array(c))
        mx.eval(r)
        ref = a.astype(np.complex128) @ c.astype(np.complex128)
        out["err"][name] = float(np.abs(np.array(r) - ref).max() / np.abs(ref).max())
out["calls1"] = b.calls()
print(json.dumps(out))
"""


def _probe(mode: str, **env) -> dict:
    e = dict(os.environ, **env)
    p = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _have_openblas() -> bool:
    try:
        import scipy_openblas32  # noqa: F401
        from ortmlx import _blasfwd  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _have_openblas(), reason="scipy-openblas32 or the built forwarder is missing")
def test_interposed_and_counted():
    """Importing ortmlx first routes MLX's sgemm/dgemm/cgemm to OpenBLAS, with the right answers."""
    r = _probe("ortmlx-first", ORTMLX_TUNING="")
    assert r["status"]["active"], r["status"]
    assert "scipy_openblas" in r["status"]["library"]
    assert r["calls1"] - r["calls0"] >= 3, r           # every one of the three matmuls went through us
    for k, err in r["err"].items():
        assert err < 1e-5, (k, err)


def test_disabled_by_env():
    r = _probe("ortmlx-first", ORTMLX_TUNING="blas=0")
    assert not r["status"]["active"] and "ORTMLX_TUNING=blas=0" in r["status"]["reason"]
    assert r["calls1"] == 0
    for k, err in r["err"].items():
        assert err < 1e-5, (k, err)


def test_mlx_imported_first_is_reported():
    r = _probe("mlx-first", ORTMLX_TUNING="")
    assert not r["status"]["active"] and "before ortmlx" in r["status"]["reason"]
    assert r["calls1"] == 0


@pytest.mark.skipif(not _have_openblas(), reason="scipy-openblas32 or the built forwarder is missing")
def test_ep_matmul_through_openblas_matches_cpu():
    """A MatMul/Gemm graph on the EP (CPU device) goes through the forwarder and equals ORT's CPU EP."""
    import ortmlx.blas as b
    from onnx import TensorProto, helper
    from ortmlx.testing import check_against_cpu, make_model
    if not b.status()["active"]:
        pytest.skip(f"not active in this process: {b.status()['reason']}")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((256, 192)).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                       [("x", TensorProto.FLOAT, [64, 256])], [("y", TensorProto.FLOAT, [64, 192])], {"w": w})
    before = b.calls()
    check_against_cpu(model, [{"x": rng.standard_normal((64, 256)).astype(np.float32)}])
    assert b.calls() > before


@pytest.mark.skipif(not _have_openblas(), reason="scipy-openblas32 or the built forwarder is missing")
def test_thread_policy():
    """ORTMLX_TUNING=blas_threads=N sets OpenBLAS's threads; the answers stay right."""
    r = _probe("ortmlx-first", ORTMLX_TUNING="blas_threads=2", OPENBLAS_NUM_THREADS="")
    assert r["status"]["active"] and r["status"]["threads"] == 2, r["status"]
    for k, err in r["err"].items():
        assert err < 1e-5, (k, err)
    r = _probe("ortmlx-first", ORTMLX_TUNING="", OPENBLAS_NUM_THREADS="")
    assert r["status"]["threads"] == max(1, min(4, os.cpu_count() or 1)), r["status"]


@pytest.mark.skipif(not _have_openblas(), reason="scipy-openblas32 or the built forwarder is missing")
@pytest.mark.parametrize("given,want", [(None, "4"), ("7", "7")])
def test_spin_timeout_default(given, want):
    """OPENBLAS_THREAD_TIMEOUT defaults to 4 (idle workers stop spinning) and a user's value wins."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env["ORTMLX_TUNING"] = ""
    if given is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = given
    code = "import os, ortmlx, ortmlx.blas as b; print(b.status()['active'], os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["True", want], p.stdout
