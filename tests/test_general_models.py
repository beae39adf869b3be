"""The general-model benchmark set (models/build_general.py) at its tiny preset: every model and op case loads with
all its nodes on MLX and answers as ORT's CPU EP does, at two batch sizes (the batch dim is dynamic).

Eager (no_compile=1) for the multi-node models, so no case waits for MLX's CPU JIT; the one-node floor models
also compiled. Timing is scripts/bench_general.py's business, never a test's."""
from __future__ import annotations

import os
import sys

import onnx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))

import build_general as B  # noqa: E402

from ortmlx.testing import check_against_cpu  # noqa: E402


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("general"))


def _check(name: str, root: str, options: dict) -> None:
    path = B.build(name, "tiny", root)
    md = B.meta(path)
    model = onnx.load(path)
    feeds = [B.feeds(path, b, seed=b) for b in (1, 3)]
    check_against_cpu(model, feeds, rtol=md["rtol"], atol=md["atol"], all_on_mlx=True, options=options)


@pytest.mark.parametrize("name", list(B.MODELS))
def test_model_on_mlx(name, root):
    _check(name, root, {"device": "cpu", "no_compile": "1"})


@pytest.mark.parametrize("name", list(B.FLOOR_MODELS))
def test_floor_model_compiled(name, root):
    _check(name, root, {"device": "cpu"})


@pytest.mark.parametrize("name", list(B.OPS))
def test_op_case_on_mlx(name, root):
    _check(name, root, {"device": "cpu", "no_compile": "1"})


def test_build_is_cached_and_dynamic(root):
    path = B.build("add_1x4", "tiny", root)
    mtime = os.stat(path).st_mtime_ns
    assert B.build("add_1x4", "tiny", root) == path and os.stat(path).st_mtime_ns == mtime
    m = onnx.load(path)
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    assert B.feeds(path, 5)["x"].shape == (5, 4)
    assert B.feeds(B.build("op_lstm", "tiny", root), 2)["x"].shape[1] == 2       # [T, N, F]: batch on axis 1
