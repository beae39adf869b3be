"""Host<->device byte counters (ortmlx.residency): exact counts per Compute call."""
import numpy as np
from onnx import TensorProto as T
from onnx import helper

from ortmlx.runtime import residency
from ortmlx.testing import make_model, session


def test_bytes_counted_per_call():
    """Inputs in (runtime inputs only: constants live on the device) and outputs out, every call."""
    w = np.arange(32, dtype=np.float32).reshape(4, 8)
    model = make_model([helper.make_node("Add", ["x", "w"], ["s"]), helper.make_node("Cast", ["s"], ["y"], to=T.FLOAT16)],
                       [("x", T.FLOAT, [4, 8])], [("y", T.FLOAT16, [4, 8])], {"w": w})
    sess = session(model)
    x = np.ones((4, 8), np.float32)
    sess.run(None, {"x": x})                       # first call (may trace / verify): not counted below
    residency.reset()
    for _ in range(3):
        (y,) = sess.run(None, {"x": x})
    np.testing.assert_array_equal(y, (x + w).astype(np.float16))
    got = residency.snapshot()
    assert got == {"calls": 3, "h2d_bytes": 3 * x.nbytes, "d2h_bytes": 3 * y.nbytes}, got


def test_reset_and_observed_path():
    """The observed (verbose/trace) Compute path counts the same bytes."""
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", T.FLOAT, [2, 3])], [("y", T.FLOAT, [2, 3])])
    sess = session(model, options={"verbose": "1"})      # verbose: the observed Compute path
    x = -np.ones((2, 3), np.float32)
    sess.run(None, {"x": x})
    residency.reset()
    assert residency.snapshot() == {"calls": 0, "h2d_bytes": 0, "d2h_bytes": 0}
    sess.run(None, {"x": x})
    assert residency.snapshot() == {"calls": 1, "h2d_bytes": 24, "d2h_bytes": 24}

