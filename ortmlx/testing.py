"""Helpers to build small ONNX models and check the MLX EP against ORT's CPU EP.

Used by the tests, the conformance runner and the fuzzer.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import numpy as np
import onnx
from onnx import helper

import onnxruntime as ort

from . import EP_NAME, register

IR_VERSION = 10      # onnxruntime 1.31 loads IR <= 13; onnx 1.23's helper writes newer by default


def child_env(**extra: str) -> dict:
    """The environment for a Python child that imports the same ortmlx as this process (a checkout's or the
    installed package's), whatever its working directory."""
    import os
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != here]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), **extra)


def probe_json(script: str, tmp: str, *args: str, timeout: float = 300) -> dict:
    """Run ``script`` (``python -c``, with ``args``) in a new process whose TMPDIR (so MLX's kernel caches) is ``tmp``
    and whose tuning is the default; its last stdout line, as JSON. A failing child fails the caller's test."""
    import json
    import os
    import subprocess
    import sys
    env = child_env(TMPDIR=str(tmp), ORTMLX_TUNING="")
    env.pop("MLX_PTX_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 21, extra_opsets: dict | None = None,
               name: str = "g") -> onnx.ModelProto:
    """A model from onnx.helper pieces; inputs/outputs are ValueInfoProtos or (name, elem_type, shape)."""
    def vi(x):
        if isinstance(x, onnx.ValueInfoProto):
            return x
        n, t, s = x
        return helper.make_tensor_value_info(n, t, s)
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
    graph = helper.make_graph(list(nodes), name, [vi(i) for i in inputs], [vi(o) for o in outputs],
                              [onnx.numpy_helper.from_array(np.asarray(v), k) if not isinstance(v, onnx.TensorProto)
                               else v for k, v in (initializers.items() if isinstance(initializers, dict)
                                                   else [(t.name, t) for t in initializers])])
    return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)


def session(model, provider: str = EP_NAME, options: dict | None = None, record: bool = True,
            sess_options: ort.SessionOptions | None = None) -> ort.InferenceSession:
    """An InferenceSession on ``provider`` (the MLX EP by default), fallback disabled."""
    if provider == EP_NAME:
        register(genai=False)
    so = sess_options or ort.SessionOptions()
    if record:
        so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    blob = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    providers = [(provider, options or {})] if provider != "CPUExecutionProvider" else ["CPUExecutionProvider"]
    s = ort.InferenceSession(blob, so, providers=providers)
    s.disable_fallback()
    return s


def assignment(sess: ort.InferenceSession) -> dict[str, Counter]:
    """EP name -> Counter of op types assigned to it."""
    out: dict[str, Counter] = {}
    for sub in sess.get_provider_graph_assignment_info():
        out.setdefault(sub.ep_name, Counter()).update(n.op_type for n in sub.get_nodes())
    return out


def unclaimed_ops(sess: ort.InferenceSession) -> Counter:
    """Op types the MLX EP did not get."""
    c = Counter()
    for ep, ops in assignment(sess).items():
        if ep != EP_NAME:
            c.update(ops)
    return c


def assert_close(actual, expected, rtol: float = 1e-4, atol: float = 1e-5, what: str = "") -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {actual.shape} != expected {expected.shape}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype} != expected {expected.dtype}")
    if actual.dtype.kind in "fc":
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True, err_msg=what)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=what)


def type_refused(model, device: str) -> Counter:
    """Op types (with counts) of the main graph's nodes that MLX cannot hold on ``device`` by element type (float64
    on a GPU: ``dtypes.supported_on``, which the claim checks per node input and output): off MLX by design there.
    Types come from ONNX shape inference; a value it cannot type counts as holdable."""
    from .kernels import dtypes as dt
    if device == "cpu":
        return Counter()
    m = model if isinstance(model, onnx.ModelProto) else onnx.load_from_string(model)
    try:
        m = onnx.shape_inference.infer_shapes(m)
    except Exception:  # noqa: BLE001 - (contrib ops) the declared types only
        pass
    g = m.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.input, *g.output, *g.value_info]
             if vi.type.HasField("tensor_type")}
    types.update({t.name: t.data_type for t in g.initializer})
    return Counter(n.op_type for n in g.node
                   if any(x and types.get(x) and not dt.supported_on(types[x], device)
                          for x in [*n.input, *n.output]))


def check_against_cpu(model, feeds_list: Iterable[dict], rtol: float = 1e-4, atol: float = 1e-5,
                      all_on_mlx: bool = True, options: dict | None = None):
    """Run every feed on one MLX session and one CPU session; compare all outputs.

    Returns the MLX session. With ``all_on_mlx``, every node must be assigned to the MLX EP, except, on a
    device that cannot hold one of a node's element types (float64 on a GPU: ``type_refused``), exactly
    those nodes, which must be left to the CPU EP.
    """
    mlx_s = session(model, options=options)
    cpu_s = session(model, "CPUExecutionProvider", record=False)
    if all_on_mlx:
        from . import partition_reports
        reps = partition_reports()
        left = unclaimed_ops(mlx_s)
        expected = type_refused(model, reps[-1].device) if reps else Counter()
        if left != expected:
            rep = reps[-1].format() if reps else ""
            raise AssertionError(f"nodes left off MLX: {dict(left)}, expected {dict(expected) or 'none'}\n{rep}")
    names = [o.name for o in mlx_s.get_outputs()]
    for k, feeds in enumerate(feeds_list):
        got = mlx_s.run(None, feeds)
        want = cpu_s.run(None, feeds)
        for n, g, w in zip(names, got, want):
            assert_close(g, w, rtol, atol, what=f"feed {k} output {n}")
    return mlx_s
