"""What the install gave: exactly one MLX backend, the one this machine calls for, intact; the package the tests
import is the installed one (scripts/test.sh); pyproject's extras each name one backend and plain use needs no
torch."""
import hashlib
import os
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import ortmlx

ROOT = Path(__file__).resolve().parent.parent
LINUX = sys.platform.startswith("linux")


def _record_hash(dist: str, rel: str) -> str | None:
    for f in metadata.distribution(dist).files or ():
        if str(f) == rel and f.hash is not None:
            return f.hash.value
    return None


@pytest.mark.skipif(not LINUX, reason="MLX's backend extras are Linux's (macOS: plain mlx with mlx-metal)")
def test_exactly_one_backend_and_it_is_the_one_loaded():
    import mlx.core as mx
    found = [d for d in ortmlx.mlx_backends() if d in ortmlx.BACKENDS]
    assert len(found) == 1, f"MLX backends installed: {found} (want exactly one)"
    (dist,) = found
    gpu = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
    assert (dist != "mlx-cpu") == gpu, (dist, gpu)
    want = os.environ.get("ORTMLX_BACKEND")
    if want:
        assert ortmlx.BACKENDS[dist] == want
    # the libmlx.so on disk is that distribution's own (another backend's install would have overwritten it)
    lib = Path(mx.__file__).resolve().parent / "lib" / "libmlx.so"
    recorded = _record_hash(dist, "mlx/lib/libmlx.so")
    assert recorded is not None, f"{dist} records no mlx/lib/libmlx.so"
    import base64
    actual = base64.urlsafe_b64encode(hashlib.sha256(lib.read_bytes()).digest()).rstrip(b"=").decode()
    assert actual == recorded, f"{lib} is not {dist}'s build"


@pytest.mark.skipif(not os.environ.get("ORTMLX_TEST_INSTALLED"), reason="scripts/test.sh runs against the install")
def test_tests_import_the_installed_package():
    here = Path(ortmlx.__file__).resolve()
    assert here.parent != ROOT / "ortmlx", f"imported {here}, the checkout's source, not the installed package"
    assert Path(ortmlx.library_path()).is_file()


def test_extras_name_one_backend_each_and_plain_use_needs_no_torch():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = meta["dependencies"]
    extras = meta["optional-dependencies"]
    assert not any(d.split(";")[0].strip().startswith(("torch", "transformers")) for d in deps), deps
    assert not any(d.startswith("mlx[") for d in deps), f"a backend in the plain dependencies: {deps}"
    for extra, backend in (("cpu", "cpu"), ("cuda12", "cuda12"), ("cuda13", "cuda13")):
        assert extras[extra] == [f"mlx[{backend}]>=0.29"], extras[extra]
    for extra in ("genai", "test"):
        assert not any(d.startswith(("torch", "mlx")) for d in extras[extra]), extras[extra]
