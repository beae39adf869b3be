"""Shared helpers for the shape / indexing / generator tables."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper

from ortmlx.testing import EP_NAME, assignment, check_against_cpu, make_model, session, unclaimed_ops

ONNX_OF = {np.dtype(np.float32): T.FLOAT, np.dtype(np.float16): T.FLOAT16, np.dtype(np.float64): T.DOUBLE,
           np.dtype(np.int8): T.INT8, np.dtype(np.uint8): T.UINT8, np.dtype(np.int16): T.INT16,
           np.dtype(np.uint16): T.UINT16, np.dtype(np.int32): T.INT32, np.dtype(np.uint32): T.UINT32,
           np.dtype(np.int64): T.INT64, np.dtype(np.uint64): T.UINT64, np.dtype(np.bool_): T.BOOL}
NP_OF = {v: k.type for k, v in ONNX_OF.items()}
#: the data dtypes every data-movement table runs over (bf16 separately, through Casts)
DTYPES = [T.FLOAT, T.FLOAT16, T.INT64, T.INT32, T.BOOL]


def data(t, shape, seed=0):
    rng = np.random.default_rng(seed)
    if t == T.BOOL:
        return rng.random(shape) < 0.5
    if t in (T.FLOAT, T.FLOAT16, T.DOUBLE):
        return rng.uniform(-4, 4, shape).astype(NP_OF[t])
    return rng.integers(-50, 50, shape).astype(NP_OF[t])


def i64(*v):
    return np.array(v, dtype=np.int64)


def one_node(op, inputs, attrs=None, opset=21, out_types=None, n_out=1, consts=(), bf16=False):
    """A one-node model with inputs x0.. (graph inputs of symbolic shape, or initializers for
    indices in ``consts``) and outputs y0..; returns (model, feeds).

    ``bf16``: float32 inputs are fed through Cast->bfloat16 and bf16 outputs are cast back.
    """
    names = [f"x{i}" if a is not None else "" for i, a in enumerate(inputs)]
    types = [ONNX_OF[np.asarray(a).dtype] if a is not None else None for a in inputs]
    if out_types is None:
        out_types = [types[0]] * n_out
    nodes, node_in, outs = [], list(names), []
    if bf16:
        for i, (n, t) in enumerate(zip(names, types)):
            if t == T.FLOAT:
                nodes.append(helper.make_node("Cast", [n], [n + "b"], to=T.BFLOAT16))
                node_in[i] = n + "b"
        out_types = [T.BFLOAT16 if t == T.FLOAT else t for t in out_types]
    node_out = [f"y{j}" for j in range(len(out_types))]
    raw_out = [f"r{j}" if bf16 and t == T.BFLOAT16 else f"y{j}" for j, t in enumerate(out_types)]
    nodes.append(helper.make_node(op, node_in, raw_out, name=f"{op}_0", **(attrs or {})))
    for j, t in enumerate(out_types):
        if raw_out[j] != node_out[j]:
            nodes.append(helper.make_node("Cast", [raw_out[j]], [node_out[j]], to=T.FLOAT))
        outs.append((node_out[j], T.FLOAT if raw_out[j] != node_out[j] else t, None))
    inits = {n: np.asarray(a) for i, (n, a) in enumerate(zip(names, inputs)) if n and i in consts}
    ins = [(n, t, [f"{n}_{k}" for k in range(np.ndim(a))]) for n, t, a in zip(names, types, inputs)
           if n and n not in inits]
    feeds = {n: np.asarray(a) for n, a in zip(names, inputs) if n and n not in inits}
    return make_model(nodes, ins, outs, inits, opset=opset), feeds


def skip_without_cpu_kernel(model):
    """Skip (with the reason) when ORT's CPU EP has no kernel for the case: nothing to verify against."""
    try:
        session(model, "CPUExecutionProvider", record=False)
    except Exception as e:  # noqa: BLE001
        if "NOT_IMPLEMENTED" in str(e) or "Could not find an implementation" in str(e):
            pytest.skip(f"ORT CPU has no kernel: {str(e).split(':')[-1].strip()[:120]}")
        if "Type Error" in str(e):
            pytest.skip(f"the op schema does not allow this type: {str(e).split('Type Error:')[-1][:120]}")
        raise


def check(model, feeds, op=None, tol=None, bf16=False):
    """Compare with the CPU EP; with ``bf16`` only ``op`` must be on MLX (the Casts may not be)."""
    skip_without_cpu_kernel(model)
    kw = dict(rtol=1e-2, atol=1e-2) if bf16 else (tol or {})
    s = check_against_cpu(model, [feeds], all_on_mlx=not bf16, **kw)
    if bf16:
        assert op in assignment(s).get(EP_NAME, {}), f"{op} not on MLX: {assignment(s)}"
    return s


def check_refused(model, feeds, op):
    """The node stays on the CPU EP and the session still answers like the CPU EP."""
    s = session(model)
    assert op in unclaimed_ops(s), f"{op} should stay on CPU: {assignment(s)}"
    cpu = session(model, "CPUExecutionProvider", record=False)
    for g, w in zip(s.run(None, feeds), cpu.run(None, feeds)):
        np.testing.assert_array_equal(g, w)


def check_error(model, feeds, node_name):
    """Both EPs fail; ours names the node."""
    cpu = session(model, "CPUExecutionProvider", record=False)
    with pytest.raises(Exception):
        cpu.run(None, feeds)
    s = session(model)
    assert not unclaimed_ops(s), f"expected the node on MLX: {assignment(s)}"
    with pytest.raises(Exception, match=node_name):
        s.run(None, feeds)


def refusal_reason(model, op):
    """The MLX EP's reason for leaving ``op`` on the CPU EP."""
    import ortmlx
    try:
        session(model)
    except Exception:  # noqa: BLE001 - the CPU EP may have no kernel for the case either; our claim is what matters
        pass
    reasons = [u.reason for u in ortmlx.partition_reports()[-1].unclaimed if u.op == op]
    assert reasons, f"{op} was claimed by MLX"
    return reasons[0]


def _paths():
    """(dtype, path) pairs: integer/bool data runs on the numpy twins ('host') when every input is a
    host value and on the MLX translators ('device') when host evaluation is switched off."""
    out = []
    for t in DTYPES:
        for path in (("device",) if t in (T.FLOAT, T.FLOAT16) else ("host", "device")):
            out.append(pytest.param(t, path, id=f"{T.DataType.Name(t).lower()}-{path}"))
    return out


DTYPE_PATHS = _paths()


def force_path(monkeypatch, path):
    """'device': no host evaluation at all (the size limit for host values drops below zero)."""
    if path == "device":
        import ortmlx.compiled.analysis as an
        import ortmlx.kernels.interpreter as it
        monkeypatch.setattr(it, "HOST_MAX_ELEMS", -1)
        if hasattr(an, "HOST_MAX_ELEMS"):
            monkeypatch.setattr(an, "HOST_MAX_ELEMS", -1)
