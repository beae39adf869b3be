"""Shared helpers for the elementwise/activation/compare/cast/reduction tables."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as T, helper

from ortmlx.testing import check_against_cpu, make_model, session, unclaimed_ops

NP = {T.FLOAT: np.float32, T.FLOAT16: np.float16, T.DOUBLE: np.float64, T.INT8: np.int8,
      T.UINT8: np.uint8, T.INT16: np.int16, T.UINT16: np.uint16, T.INT32: np.int32,
      T.UINT32: np.uint32, T.INT64: np.int64, T.UINT64: np.uint64, T.BOOL: np.bool_}
FLOATS = (T.FLOAT, T.FLOAT16, T.DOUBLE)
INTS = (T.INT8, T.UINT8, T.INT16, T.UINT16, T.INT32, T.UINT32, T.INT64, T.UINT64)
TOL = {T.FLOAT16: dict(rtol=2e-3, atol=1e-3), T.BFLOAT16: dict(rtol=1e-2, atol=1e-2)}


def rand(t, shape, rng, lo=-4, hi=4, special=False, nonzero=False):
    """Random values of ONNX type ``t``; ``special`` sprinkles NaN/+-Inf/+-0 into floats."""
    dtype = NP[t]
    if t == T.BOOL:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.floating):
        a = rng.uniform(lo, hi, shape).astype(dtype)
        if special and a.size >= 6:
            flat = a.reshape(-1)
            idx = rng.choice(a.size, 5, replace=False)
            flat[idx] = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], dtype)
        if nonzero:
            a[a == 0] = 1
        return a
    info = np.iinfo(dtype)
    lo, hi = max(lo, info.min), min(hi, info.max)
    a = rng.integers(lo, hi + 1, shape, dtype=dtype)
    if nonzero:
        a[a == 0] = 1
    return a


def node_model(op, in_types, out_types, attrs=None, opset=21, initializers=None, in_shapes=None,
               out_shapes=None):
    """A one-node model; inputs x0.., outputs y0..; initializers override inputs by name."""
    initializers = initializers or {}
    names = [f"x{i}" if t is not None else "" for i, t in enumerate(in_types)]
    node = helper.make_node(op, names, [f"y{i}" for i in range(len(out_types))], **(attrs or {}))
    ins = [(n, t, (in_shapes[i] if in_shapes else None)) for i, (n, t) in enumerate(zip(names, in_types))
           if n and n not in initializers]
    outs = [(f"y{i}", t, out_shapes[i] if out_shapes else None) for i, t in enumerate(out_types)]
    return make_model([node], ins, outs, initializers, opset=opset)


def check(model, feeds, t=None, **kw):
    """check_against_cpu with the tolerance of element type ``t``."""
    tol = dict(TOL.get(t, {}))
    tol.update(kw)
    return check_against_cpu(model, feeds if isinstance(feeds, list) else [feeds], **tol)


def check_refused(model, feeds, op, rtol=1e-4, atol=1e-5):
    """The node stays off MLX and the session still answers like the CPU EP."""
    s = session(model)
    assert op in unclaimed_ops(s), f"{op} should stay on CPU"
    cpu = session(model, "CPUExecutionProvider", record=False)
    for g, w in zip(s.run(None, feeds), cpu.run(None, feeds)):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, equal_nan=True)


def refusal(model, op):
    """The MLX EP's reason for leaving ``op`` on the CPU EP (session errors from the CPU kernel are ignored)."""
    from ortmlx import partition_reports
    seen = {id(r) for r in partition_reports()}
    try:
        session(model)
    except Exception:  # noqa: BLE001 - the CPU EP may reject the node too; only our claim matters
        pass
    reps = [r for r in partition_reports() if id(r) not in seen]
    assert reps, "MLX EP produced no partition report"
    reasons = [u.reason for r in reps for u in r.unclaimed if u.op == op]
    assert reasons, f"{op} was claimed by MLX"
    return reasons[0]


def bf16_models(op, n_in, attrs=None, opset=22, out_bool=False, inits=None, n_float=None):
    """(test, reference) models for a bf16 case; numpy and ORT's CPU EP lack most bf16 kernels.

    test: float32 inputs -> Cast(bf16) -> op in bf16 -> Cast(float32), all on MLX.
    reference: float32 inputs rounded through bf16 -> op in float32 on the CPU EP -> rounded
    through bf16. ``n_float``: how many leading inputs are float (others pass through as given);
    ``inits``: extra initializer inputs by name, appended after the float inputs.
    """
    n_float = n_in if n_float is None else n_float
    inits = inits or {}
    xs = [f"x{i}" for i in range(n_float)]
    extra = list(inits)
    tn = [helper.make_node("Cast", [x], [x + "b"], to=T.BFLOAT16) for x in xs]
    tn.append(helper.make_node(op, [x + "b" for x in xs] + extra, ["yb" if not out_bool else "y"], **(attrs or {})))
    if not out_bool:
        tn.append(helper.make_node("Cast", ["yb"], ["y"], to=T.FLOAT))
    rn = []
    for x in xs:
        rn += [helper.make_node("Cast", [x], [x + "b"], to=T.BFLOAT16),
               helper.make_node("Cast", [x + "b"], [x + "r"], to=T.FLOAT)]
    rn.append(helper.make_node(op, [x + "r" for x in xs] + extra, ["yf" if not out_bool else "y"], **(attrs or {})))
    if not out_bool:
        rn += [helper.make_node("Cast", ["yf"], ["yb"], to=T.BFLOAT16), helper.make_node("Cast", ["yb"], ["y"], to=T.FLOAT)]
    ins = [(x, T.FLOAT, None) for x in xs]
    out = [("y", T.BOOL if out_bool else T.FLOAT, None)]
    return make_model(tn, ins, out, inits, opset=opset), make_model(rn, ins, out, inits, opset=opset)


def check_bf16(op, feeds, attrs=None, opset=22, out_bool=False, inits=None, exact=False):
    """The bf16 op on MLX equals the float32 op on ORT's CPU EP rounded to bf16 (1 bf16 ulp unless ``exact``)."""
    n = len(feeds)
    test, ref = bf16_models(op, n, attrs, opset, out_bool, inits)
    s = session(test)
    left = unclaimed_ops(s)
    assert not left, f"nodes left off MLX: {dict(left)}"
    cpu = session(ref, "CPUExecutionProvider", record=False)
    got, want = s.run(None, feeds)[0], cpu.run(None, feeds)[0]
    if out_bool or exact:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6, equal_nan=True)
