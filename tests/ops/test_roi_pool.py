"""MaxRoiPool against ORT's CPU EP, exactly (float32; the ROIs are read on the host)."""
import numpy as np
import pytest
from onnx import TensorProto as T, helper

from _nnutil import stays_on_cpu
from ortmlx.testing import check_against_cpu, make_model, session


def _model(pooled, scale=None, opset=21, rois_init=None, x_shape=None, n_rois=None):
    attrs = {"pooled_shape": list(pooled)}
    if scale is not None:
        attrs["spatial_scale"] = scale
    node = helper.make_node("MaxRoiPool", ["x", "rois"], ["y"], **attrs)
    inputs = [("x", T.FLOAT, x_shape)]
    inits = {}
    if rois_init is None:
        inputs.append(("rois", T.FLOAT, (n_rois, 5) if n_rois is not None else None))
    else:
        inits["rois"] = rois_init
    return make_model([node], inputs, [("y", T.FLOAT, None)], inits, opset=opset)


def _x(shape, seed=0):
    return np.random.default_rng(seed).normal(0, 1, shape).astype(np.float32)


R = np.float32
CASES = [  # (x shape, rois, pooled_shape, spatial_scale)
    ((1, 2, 8, 8), [[0, 0, 0, 7, 7]], (2, 2), None),
    ((1, 3, 10, 12), [[0, 1, 2, 9, 8], [0, 0, 0, 11, 9], [0, 3, 3, 3, 3]], (3, 4), None),
    # ROI bigger than the bins can split evenly, and smaller than the pooled grid (empty/overlapping bins)
    ((1, 2, 9, 9), [[0, 2, 2, 4, 3], [0, 0, 0, 1, 1], [0, 5, 1, 6, 8]], (4, 5), None),
    # partly and wholly outside the image (clipped, empty bins -> 0), malformed (end < start -> 1x1)
    ((1, 2, 6, 7), [[0, -3, -2, 3, 2], [0, 4, 3, 12, 9], [0, 20, 20, 30, 30], [0, 5, 4, 1, 0],
                    [0, -9, -9, -4, -5]], (3, 3), None),
    # spatial_scale != 1 with halves that round away from zero (2.5 -> 3, -0.5 -> -1)
    ((1, 2, 12, 10), [[0, 5, 5, 17, 21], [0, -1, 3, 9, 13], [0, 0.5, 1.5, 2.5, 3.5]], (2, 3), 0.5),
    ((1, 1, 16, 16), [[0, 3.3, 7.9, 40.1, 50.6], [0, 10, 10, 10, 10]], (7, 7), 0.3125),
    # several batches, batch indices truncated toward zero
    ((3, 4, 7, 9), [[2, 0, 0, 8, 6], [0, 1, 1, 5, 5], [1.9, 2, 0, 7, 3], [1, 3, 2, 8, 6], [0.2, 0, 0, 2, 2],
                    [2, 6, 4, 8, 6]], (2, 2), None),
    ((2, 3, 5, 5), [[1, 0, 0, 4, 4]], (1, 1), 1.0),
    ((2, 3, 5, 5), np.zeros((0, 5)), (2, 2), None),                        # no ROIs
]


@pytest.mark.parametrize("xs,rois,pooled,scale", CASES)
@pytest.mark.parametrize("as_init", [False, True], ids=["input", "initializer"])
def test_max_roi_pool(xs, rois, pooled, scale, as_init):
    r = np.asarray(rois, np.float32).reshape(-1, 5)
    m = _model(pooled, scale, rois_init=r if as_init else None, x_shape=xs)
    feeds = {"x": _x(xs)} if as_init else {"x": _x(xs), "rois": r}
    check_against_cpu(m, [feeds, {**feeds, "x": _x(xs, 1)}], rtol=0, atol=0)


def test_max_roi_pool_special_values():
    """NaN (passed over by the next element, kept when last), -inf (-> lowest()), negatives, signed zeros."""
    x = -np.abs(_x((1, 2, 6, 6)))
    x[0, 0, 0, 1] = np.nan                      # not last in its bin: the fold passes over it
    x[0, 0, 1, 1] = np.nan                      # last in its 2x2 bin: the result is NaN
    x[0, 0, 4:6, 0:2] = -np.inf                 # a bin of -inf: lowest()
    x[0, 1, 0:2, 0:2] = [[0.0, -0.0], [-0.0, -1.0]]   # ties: the later zero wins (-0.0)
    x[0, 1, 2:4, 2:4] = [[-0.0, 0.0], [-2.0, -3.0]]
    x[0, 1, 4:6, 4:6] = [[np.nan, -0.0], [0.0, -0.0]]
    rois = np.array([[0, 0, 0, 5, 5], [0, 0, 0, 1, 1]], np.float32)
    m = _model((3, 3), x_shape=x.shape)
    s = check_against_cpu(m, [{"x": x, "rois": rois}], rtol=0, atol=0)
    got = s.run(None, {"x": x, "rois": rois})[0]
    want = session(m, "CPUExecutionProvider", record=False).run(None, {"x": x, "rois": rois})[0]
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    assert np.isnan(want).any() and (want == np.finfo(np.float32).min).any()


def test_max_roi_pool_many_sizes():
    """Many random ROIs of very different sizes (several gather buckets), order kept."""
    rng = np.random.default_rng(3)
    p, q = rng.uniform(-4, 36, (40, 2)), rng.uniform(-4, 36, (40, 2))
    rois = np.concatenate([rng.integers(0, 2, (40, 1)), np.minimum(p, q), np.maximum(p, q)], 1).astype(np.float32)
    m = _model((5, 4), 0.75, x_shape=(2, 3, 24, 26))
    check_against_cpu(m, [{"x": _x((2, 3, 24, 26)), "rois": rois}], rtol=0, atol=0)


def test_max_roi_pool_bad_batch_index():
    m = _model((2, 2), x_shape=(2, 1, 4, 4))
    s = session(m)
    with pytest.raises(Exception, match="batch index"):
        s.run(None, {"x": _x((2, 1, 4, 4)), "rois": np.array([[2, 0, 0, 3, 3]], np.float32)})


def test_max_roi_pool_rois_from_device_refused():
    """ROIs computed inside the group would need a sync to read: refused (and still right on the CPU EP)."""
    nodes = [helper.make_node("Relu", ["r0"], ["rois"]),
             helper.make_node("MaxRoiPool", ["x", "rois"], ["y"], pooled_shape=[2, 2])]
    m = make_model(nodes, [("x", T.FLOAT, (1, 2, 6, 6)), ("r0", T.FLOAT, (2, 5))], [("y", T.FLOAT, None)], opset=21)
    stays_on_cpu(m, {"x": _x((1, 2, 6, 6)), "r0": np.array([[0, 0, 0, 5, 5], [0, 1, 1, 3, 4]], np.float32)},
                 "MaxRoiPool", rtol=0, atol=0)


def test_max_roi_pool_opset22_refused():
    """MaxRoiPool-22 has no ORT CPU kernel to verify against: refused (so ORT finds no kernel at all)."""
    import onnxruntime as ort
    from ortmlx import partition_reports
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.NotImplemented, match="MaxRoiPool"):
        session(_model((2, 2), opset=22, x_shape=(1, 1, 4, 4)))
    assert any(u.op == "MaxRoiPool" and "22" in u.reason for u in partition_reports()[-1].unclaimed)


def test_max_roi_pool_byte_exact_special_values_chunked(monkeypatch):
    """Random ROIs over data sprinkled with NaN, +-0 and -inf, gathered in many small chunks: byte-equal."""
    import ortmlx.kernels.ops.roi_pool as rp
    monkeypatch.setattr(rp, "CHUNK_ELEMS", 1000)
    rng = np.random.default_rng(5)
    p, q = rng.uniform(-10, 70, (60, 2)), rng.uniform(-10, 70, (60, 2))
    rois = np.concatenate([rng.integers(0, 3, (60, 1)), np.minimum(p, q), np.maximum(p, q)], 1).astype(np.float32)
    x = rng.normal(size=(3, 5, 40, 44)).astype(np.float32)
    for v, frac in ((np.nan, 0.02), (0.0, 0.05), (-0.0, 0.05), (-np.inf, 0.02)):
        x[rng.random(x.shape) < frac] = v
    m = _model((6, 5), 0.8, x_shape=x.shape)
    s = check_against_cpu(m, [{"x": x, "rois": rois}], rtol=0, atol=0)
    got = s.run(None, {"x": x, "rois": rois})[0]
    want = session(m, "CPUExecutionProvider", record=False).run(None, {"x": x, "rois": rois})[0]
    assert np.isnan(want).any() and np.signbit(want[want == 0]).any()
    assert got.tobytes() == want.tobytes()
