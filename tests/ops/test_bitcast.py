"""BitCast against ORT's CPU EP: outputs compared byte for byte (NaN payloads, -0.0 included)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper

from _ewutil import NP, refusal
from ortmlx.testing import make_model, session, unclaimed_ops

rng = np.random.default_rng(26)
HOST = [t for t in NP if t != T.BOOL]                   # every type numpy holds but bool (bf16 below)
PAIRS = [(s, d) for s in HOST for d in HOST if np.dtype(NP[s]).itemsize == np.dtype(NP[d]).itemsize]
SPECIAL = {4: [0x7FC00001, 0xFFC00000, 0x7F800001, 0x80000000, 0x7F800000, 0x00000001],
           2: [0x7E01, 0xFC00, 0x7C01, 0x8000, 0x0001, 0xFFFF],
           8: [0x7FF8000000000001, 0xFFF0000000000000, 0x7FF0000000000001, 0x8000000000000000, 1, 2**64 - 1]}


def _bits(t, shape):
    """Values of type ``t`` from random bytes, with NaN payloads, infinities, -0.0 and denormals."""
    w = np.dtype(NP[t]).itemsize
    u = rng.integers(0, 256, (*shape, w), dtype=np.uint8).view(f"<u{w}").reshape(shape)
    flat = u.reshape(-1)
    sp = SPECIAL.get(w, [0, 0xFF, 0x80, 0x7F])
    flat[:min(len(sp), flat.size)] = np.array(sp[:flat.size], f"<u{w}")
    return u.view(NP[t])


def _check_exact(model, feeds_list):
    s = session(model)
    left = unclaimed_ops(s)
    assert not left, f"nodes left off MLX: {dict(left)}"
    cpu = session(model, "CPUExecutionProvider", record=False)
    for feeds in feeds_list:
        for g, w in zip(s.run(None, feeds), cpu.run(None, feeds)):
            assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
            np.testing.assert_array_equal(np.ascontiguousarray(g).view(np.uint8),
                                          np.ascontiguousarray(w).view(np.uint8))


def _model(src, to):
    return make_model([helper.make_node("BitCast", ["x"], ["y"], to=to)], [("x", src, None)], [("y", to, None)],
                      opset=26)


@pytest.mark.parametrize("src,to", PAIRS, ids=str)
def test_bitcast_pairs(src, to):
    _check_exact(_model(src, to), [{"x": _bits(src, (3, 5))}, {"x": _bits(src, ())}, {"x": _bits(src, (0, 2))}])


def test_bitcast_non_contiguous_and_chained():
    """A transposed input (a strided view in MLX) and a BitCast chain through bfloat16."""
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
             helper.make_node("BitCast", ["xt"], ["i"], to=T.INT32),
             helper.make_node("BitCast", ["h"], ["b"], to=T.BFLOAT16),
             helper.make_node("BitCast", ["b"], ["f"], to=T.FLOAT16),
             helper.make_node("BitCast", ["f"], ["u"], to=T.INT16)]
    m = make_model(nodes, [("x", T.FLOAT, None), ("h", T.UINT16, None)], [("i", T.INT32, None), ("u", T.INT16, None)],
                   opset=26)
    _check_exact(m, [{"x": _bits(T.FLOAT, (4, 6)), "h": _bits(T.UINT16, (7,))}])


@pytest.mark.parametrize("src,to", [(T.UINT8, T.BOOL), (T.BOOL, T.INT8), (T.BOOL, T.BOOL)], ids=str)
def test_bitcast_bool_refused(src, to):
    """ORT's CPU EP has no bool BitCast kernel (a width change is an invalid model ORT rejects first)."""
    assert "bool" in refusal(_model(src, to), "BitCast")
