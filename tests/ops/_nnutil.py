"""Shared helpers of the neural-network op tests (linalg, conv, pool, normalization, ...)."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto as T, helper

from ortmlx import EP_NAME
from ortmlx.testing import assert_close, assignment, check_against_cpu, make_model, session

NP = {T.FLOAT: np.float32, T.FLOAT16: np.float16, T.DOUBLE: np.float64}
TOL = {T.FLOAT: (1e-4, 1e-5), T.FLOAT16: (1e-2, 1e-2), T.DOUBLE: (1e-9, 1e-12), T.BFLOAT16: (2e-2, 2e-2)}


def rand(shape, t=T.FLOAT, seed=0, lo=-1.0, hi=1.0):
    """Uniform random values in [lo, hi) of ONNX element type ``t`` (float32 bits for bf16)."""
    rng = np.random.default_rng(seed)
    return rng.uniform(lo, hi, size=shape).astype(NP.get(t, np.float32))


def one_node(op, inputs, outputs, attrs=None, opset=21, inits=None, out_types=None):
    """A one-node model. ``inputs``: list of (name, elem_type, shape) or names of initializers."""
    inits = inits or {}
    node = helper.make_node(op, [i if isinstance(i, str) else i[0] for i in inputs],
                            [o if isinstance(o, str) else o[0] for o in outputs], **(attrs or {}))
    graph_in = [i for i in inputs if not isinstance(i, str) and i[0] and i[0] not in inits]
    outs = [o for o in outputs if not isinstance(o, str) and o[0]]
    return make_model([node], graph_in, outs, inits, opset=opset)


def check(model, feeds, t=T.FLOAT, rtol=None, atol=None):
    """check_against_cpu with the default tolerance of element type ``t``."""
    r, a = TOL[t]
    return check_against_cpu(model, [feeds], rtol=rtol or r, atol=atol or a)


def check_no_channels(model, feeds, bias=None):
    """A Conv / ConvTranspose over no input channels, all on MLX, against the spec: every output is the bias
    (or zero), a sum over nothing. ORT's CPU EP gives only the output's shape here: its float16 Conv leaves such
    an output uninitialized (NaN and -0.0 in one CI run; non-zero values in 6 of 300 fresh sessions, float32 in
    none)."""
    from ortmlx.testing import unclaimed_ops
    want = session(model, "CPUExecutionProvider", record=False).run(None, feeds)[0]
    want = np.zeros(want.shape, want.dtype)
    if bias is not None:
        want += bias.reshape((1, -1) + (1,) * (want.ndim - 2)).astype(want.dtype)
    s = session(model)
    assert not unclaimed_ops(s), unclaimed_ops(s)
    got = s.run(None, feeds)[0]
    assert_close(got, want, 0.0, 0.0, what="output y")


def stays_on_cpu(model, feeds, op, rtol=1e-5, atol=1e-6):
    """The node is refused (left to the CPU EP) and the session still answers like the CPU EP."""
    s = check_against_cpu(model, [feeds], rtol=rtol, atol=atol, all_on_mlx=False)
    on_mlx = assignment(s).get(EP_NAME, {})
    assert op not in on_mlx, f"{op} was claimed by MLX but should be refused"
    return s


def check_bf16(op, inputs, n_out=1, attrs=None, opset=21, feeds=None, rtol=2e-2, atol=2e-2, inits=None,
               t=T.BFLOAT16):
    """bf16 case ORT's CPU EP has no kernel for: compare with the op run in float32 on bf16-rounded inputs.

    ``t=FLOAT16`` does the same for a float16 case ORT's CPU EP cannot run.

    ``inputs``: list of (name, shape); ``feeds``: float32 arrays. The MLX model casts inputs to bf16
    (Cast nodes run wherever they are claimed), runs ``op`` in bf16 and casts back. The reference model
    rounds inputs through bf16 and runs ``op`` in float32 on the CPU EP, then rounds the result to bf16.
    """
    attrs = attrs or {}
    inits = inits or {}

    def build(mid_type, reference):
        nodes, gin = [], []
        names = []
        for n, shape in inputs:
            if not n or n in inits:               # omitted input, or a constant initializer used as is
                names.append(n)
                continue
            gin.append((n, T.FLOAT, shape))
            nodes.append(helper.make_node("Cast", [n], [n + "_b"], to=t))
            src = n + "_b"
            if reference:
                nodes.append(helper.make_node("Cast", [src], [n + "_f"], to=T.FLOAT))
                src = n + "_f"
            names.append(src)
        outs = [f"y{k}" for k in range(n_out)]
        nodes.append(helper.make_node(op, names, [o + "_m" for o in outs], **attrs))
        for o in outs:
            if reference:
                nodes.append(helper.make_node("Cast", [o + "_m"], [o + "_r"], to=t))
                nodes.append(helper.make_node("Cast", [o + "_r"], [o], to=T.FLOAT))
            else:
                nodes.append(helper.make_node("Cast", [o + "_m"], [o], to=T.FLOAT))
        return make_model(nodes, gin, [(o, T.FLOAT, None) for o in outs], inits, opset=opset)

    mlx_s = session(build(t, False))
    assert op in assignment(mlx_s).get(EP_NAME, {}), f"bf16 {op} not claimed by MLX"
    ref_s = session(build(T.FLOAT, True), "CPUExecutionProvider", record=False)
    got, want = mlx_s.run(None, feeds), ref_s.run(None, feeds)
    for k, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, rtol, atol, what=f"bf16 {op} output {k}")


def check_reference(model, feeds, rtol=1e-4, atol=1e-5):
    """For a case ORT's CPU EP cannot run: MLX (every node claimed) against onnx.reference."""
    from onnx.reference import ReferenceEvaluator

    s = session(model)
    left = {k: v for k, v in assignment(s).items() if k != EP_NAME}
    assert not left, f"nodes left off MLX: {left}"
    got = s.run(None, feeds)
    want = ReferenceEvaluator(model).run(None, feeds)
    for k, (g, w) in enumerate(zip(got, want)):
        assert_close(g, np.asarray(w).astype(g.dtype), rtol, atol, what=f"output {k} vs onnx.reference")
