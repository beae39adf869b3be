"""Zero-size dims through the neural-network ops the fuzzer does not draw, against ORT's CPU EP.

A zero-size case must give ORT's answer (or stay off MLX), never crash: MLX's convolution divided by zero on
no input channels (SIGFPE) until Conv answered that case itself. Only cases ORT's CPU EP answers are here
(it hangs on a Conv with no input channels and pads, and errs on pools over 0 channels or 0 spatial size).
"""
import pytest
from onnx import TensorProto as T

from _nnutil import check, check_no_channels, one_node, rand

F = T.FLOAT

#: name -> (op, [(input, shape)], attrs, opset)
CASES = {
    "Conv no input channels, bias": ("Conv", [("x", (1, 0, 4, 4)), ("w", (2, 0, 3, 3)), ("b", (2,))], {}, 11),
    "Conv no input channels, stride": ("Conv", [("x", (1, 0, 4, 4)), ("w", (2, 0, 3, 3))], {"strides": [2, 2]}, 11),
    "Conv no batch": ("Conv", [("x", (0, 2, 4, 4)), ("w", (3, 2, 3, 3))], {}, 11),
    "ConvTranspose no input channels": ("ConvTranspose", [("x", (1, 0, 4, 4)), ("w", (0, 2, 3, 3)), ("b", (2,))],
                                        {}, 11),
    "ConvTranspose no output channels": ("ConvTranspose", [("x", (1, 2, 4, 4)), ("w", (2, 0, 3, 3))], {}, 11),
    "Gemm K = 0": ("Gemm", [("a", (3, 0)), ("b", (0, 5)), ("c", (5,))], {}, 13),
    "Gemm K = 0, beta 0": ("Gemm", [("a", (3, 0)), ("b", (0, 5)), ("c", (5,))], {"beta": 0.0}, 13),
    "MatMul K = 0, batched": ("MatMul", [("a", (2, 3, 0)), ("b", (0, 5))], {}, 13),
    "Einsum K = 0": ("Einsum", [("a", (3, 0)), ("b", (0, 5))], {"equation": "ik,kj->ij"}, 13),
    "BatchNormalization no channels": ("BatchNormalization", [("x", (2, 0, 3)), ("s", (0,)), ("b", (0,)),
                                                              ("m", (0,)), ("v", (0,))], {}, 15),
    "InstanceNormalization no channels": ("InstanceNormalization", [("x", (1, 0, 3)), ("s", (0,)), ("b", (0,))],
                                          {}, 6),
    "InstanceNormalization no positions": ("InstanceNormalization", [("x", (1, 2, 0)), ("s", (2,)), ("b", (2,))],
                                           {}, 6),
    "LayerNormalization no rows": ("LayerNormalization", [("x", (0, 3)), ("s", (3,))], {}, 17),
    "LRN no channels": ("LRN", [("x", (1, 0, 4, 4))], {"size": 3}, 13),
    "DepthToSpace no batch": ("DepthToSpace", [("x", (0, 4, 2, 2))], {"blocksize": 2}, 13),
    "SpaceToDepth no rows": ("SpaceToDepth", [("x", (1, 1, 0, 4))], {"blocksize": 2}, 13),
    "Softmax over an empty axis": ("Softmax", [("x", (3, 0))], {"axis": 1}, 13),
    "Hardmax over an empty axis": ("Hardmax", [("x", (3, 0))], {"axis": 1}, 13),
}


@pytest.mark.parametrize("name", list(CASES))
def test_zero_size(name):
    op, ins, attrs, opset = CASES[name]
    model = one_node(op, [(n, F, s) for n, s in ins], [("y", F, None)], attrs, opset=opset)
    feeds = {n: rand(s, seed=k) for k, (n, s) in enumerate(ins)}
    if op.startswith("Conv") and ins[0][1][1] == 0:      # no input channels: against the spec
        return check_no_channels(model, feeds, feeds.get("b"))
    check(model, feeds)


_REPEAT = """
import sys
import numpy as np
from onnx import TensorProto as T
from ortmlx.testing import make_model, session
from onnx import helper
m = make_model([helper.make_node("InstanceNormalization", ["x", "s", "b"], ["y"])],
               [("x", T.FLOAT, (1, 2, 0)), ("s", T.FLOAT, (2,)), ("b", T.FLOAT, (2,))], [("y", T.FLOAT, None)], opset=6)
feeds = {"x": np.zeros((1, 2, 0), np.float32), "s": np.ones(2, np.float32), "b": np.ones(2, np.float32)}
for _ in range(30):
    s = session(m)
    for _ in range(100):
        assert s.run(None, feeds)[0].shape == (1, 2, 0)
print("done")
"""


def test_empty_results_do_not_hang_mlx():
    """MLX 0.32.4's CPU backend could hang evaluating the graph behind an empty result (InstanceNormalization
    over no positions: 2 of 3 runs of 1,000 calls hung); the interpreter now stands a fresh empty array in for
    every empty step output. 3,000 calls in a subprocess, so a regression fails on the timeout, not hangs CI."""
    import subprocess
    import sys

    from ortmlx.testing import child_env
    r = subprocess.run([sys.executable, "-c", _REPEAT], capture_output=True, text=True, timeout=60, env=child_env())
    assert r.returncode == 0 and "done" in r.stdout, r.stderr[-2000:]


#: zero-size Einsums, against NumPy: ORT 1.31.1's CPU EP dies of SIGFPE on the first (so it cannot be the
#: reference, and the fuzzer draws no zero sizes for Einsum); the MLX EP claims and answers each
EINSUM_VS_NUMPY = {
    "bad,dad->da over zeros": ("bad,dad->da", [(0, 2, 0), (0, 2, 0)]),
    "a product over an empty K": ("ab,bc->ac", [(2, 0), (0, 3)]),
    "a diagonal of a 0 x 0": ("...ii->...i", [(2, 0, 0)]),
    "a sum of nothing": ("ab->", [(0, 3)]),
    "three operands, one empty": ("ab,bc,cd->ad", [(2, 0), (0, 3), (3, 2)]),
}


@pytest.mark.parametrize("name", list(EINSUM_VS_NUMPY))
def test_zero_size_einsum_against_numpy(name):
    import numpy as np

    from ortmlx import EP_NAME
    from ortmlx.testing import assignment, session
    eq, shapes = EINSUM_VS_NUMPY[name]
    feeds = {f"x{k}": rand(s, seed=k) for k, s in enumerate(shapes)}
    model = one_node("Einsum", [(n, F, a.shape) for n, a in feeds.items()], [("y", F, None)], {"equation": eq},
                     opset=12)
    s = session(model)
    assert dict(assignment(s)) == {EP_NAME: {"Einsum": 1}}
    got = s.run(None, feeds)[0]
    want = np.einsum(eq, *feeds.values())
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
