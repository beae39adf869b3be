"""Resize / Upsample / GridSample / AffineGrid against ORT's CPU EP (fp32 rtol 1e-4 atol 1e-5; fp16 1e-2;
nearest and integer cases exact)."""

import numpy as np
import pytest
from onnx import TensorProto as T, helper

from _nnutil import check, check_bf16, one_node, rand, stays_on_cpu
from ortmlx.testing import check_against_cpu, make_model

CTMS = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_half_pixel_for_nn",
        "half_pixel_symmetric"]


def resize_model(xs, t, attrs, scales=None, sizes=None, roi=None, opset=19):
    ins = ["x", "roi" if roi is not None else "", "scales" if scales is not None else "",
           "sizes" if sizes is not None else ""]
    while not ins[-1]:
        ins.pop()
    inits = {}
    if roi is not None:
        inits["roi"] = np.asarray(roi, np.float32)
    if scales is not None:
        inits["scales"] = np.asarray(scales, np.float32)
    if sizes is not None:
        inits["sizes"] = np.asarray(sizes, np.int64)
    node = helper.make_node("Resize", ins, ["y"], **attrs)
    return make_model([node], [("x", t, xs)], [("y", t, None)], inits, opset=opset)


GEOM = [  # (x shape, scales, sizes)
    ((1, 1, 4, 5), [1, 1, 2, 1.5], None),      # up
    ((1, 2, 7, 9), [1, 1, 0.6, 0.5], None),    # down
    ((1, 1, 5, 4), None, [1, 1, 3, 7]),        # sizes (mixed)
    ((2, 3, 6), [1, 1, 1.7], None),            # 3-D input, last axis
    ((1, 2, 3, 4), [1, 1, 2, 3], None),        # whole-number factors: nearest as repeats where the taps allow
]


def test_nearest_repeats_found_only_where_they_are():
    from ortmlx.kernels.ops.image import _repeats
    assert _repeats(np.repeat(np.arange(5), 3)[:, None]) == 3
    assert _repeats(np.arange(5)[:, None]) == 0                       # the same positions: no repeat
    assert _repeats(np.array([0, 0, 1, 1, 2, 3])[:, None]) == 0       # not every position twice
    assert _repeats(np.array([0, 1, 1, 2, 2, 3])[:, None]) == 0       # shifted (align_corners-like)


@pytest.mark.parametrize("nearest_mode", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
@pytest.mark.parametrize("ctm", CTMS)
@pytest.mark.parametrize("xs,scales,sizes", GEOM)
def test_resize_nearest(xs, scales, sizes, ctm, nearest_mode):
    m = resize_model(xs, T.FLOAT, {"mode": "nearest", "coordinate_transformation_mode": ctm,
                                   "nearest_mode": nearest_mode}, scales, sizes,
                     opset=19 if ctm != "tf_half_pixel_for_nn" else 13)
    if ctm == "half_pixel_symmetric":       # refused: ORT's coordinate rounding at ties is not reproducible
        stays_on_cpu(m, {"x": rand(xs)}, "Resize", rtol=0, atol=0)
    else:
        check(m, {"x": rand(xs)}, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize("ctm", CTMS)
@pytest.mark.parametrize("xs,scales,sizes", [g for g in GEOM if len(g[0]) == 4])
def test_resize_interp(xs, scales, sizes, ctm, mode):
    if ctm == "tf_half_pixel_for_nn":
        pytest.skip("tf_half_pixel_for_nn is a nearest-only mode")
    m = resize_model(xs, T.FLOAT, {"mode": mode, "coordinate_transformation_mode": ctm}, scales, sizes)
    check(m, {"x": rand(xs)})


RESIZE_MORE = [  # (x shape, attrs, scales, sizes, roi, opset)
    ((1, 1, 4, 4), {"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1}, [1, 1, 1.6, 0.8], None, None, 19),
    ((1, 1, 4, 4), {"mode": "cubic", "exclude_outside": 1}, [1, 1, 0.5, 2], None, None, 19),
    ((1, 1, 8, 8), {"mode": "linear", "antialias": 1}, [1, 1, 0.6, 0.4], None, None, 19),
    ((1, 1, 8, 8), {"mode": "cubic", "antialias": 1}, [1, 1, 0.5, 0.3], None, None, 19),
    ((1, 1, 8, 8), {"mode": "cubic", "antialias": 1, "exclude_outside": 1}, None, [1, 1, 3, 5], None, 19),
    ((1, 1, 8, 8), {"mode": "linear", "antialias": 1}, [1, 1, 2, 0.5], None, None, 19),
    ((1, 1, 4, 6), {"mode": "linear", "axes": [3, 2]}, [1.5, 0.5], None, None, 19),
    ((1, 1, 4, 6), {"mode": "nearest", "axes": [-1]}, None, [9], None, 19),
    ((1, 1, 4, 6), {"mode": "linear", "keep_aspect_ratio_policy": "not_larger", "axes": [2, 3]}, None, [7, 7],
     None, 19),
    ((1, 1, 4, 6), {"mode": "nearest", "keep_aspect_ratio_policy": "not_smaller", "axes": [2, 3]}, None, [7, 7],
     None, 19),
    ((1, 1, 5, 5), {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize"}, None, [1, 1, 3, 4],
     [0, 0, 0.4, 0.6, 1, 1, 0.6, 0.8], 13),
    ((1, 1, 5, 5), {"mode": "nearest", "coordinate_transformation_mode": "tf_crop_and_resize",
                    "extrapolation_value": 10.0}, None, [1, 1, 4, 3], [0, 0, -0.2, 0.1, 1, 1, 0.7, 1.3], 13),
    ((1, 1, 5, 5), {"mode": "cubic", "coordinate_transformation_mode": "tf_crop_and_resize",
                    "extrapolation_value": -1.0}, [1, 1, 0.8, 1.4], None, [0, 0, 0.1, -0.3, 1, 1, 0.9, 1.2], 13),
    ((1, 1, 5, 5), {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize", "axes": [2, 3]}, None,
     [3, 1], [0.2, 0.3, 0.8, 0.9], 19),
    ((1, 1, 4, 4), {"mode": "linear"}, [1, 1, 2, 2], None, [], 11),
    ((1, 1, 4, 4), {"mode": "cubic"}, [1, 1, 2, 2], None, None, 13),
    ((1, 1, 4, 4), {"mode": "nearest"}, [1, 1, 2, 2], None, None, 18),
    ((0, 1, 4, 4), {"mode": "linear"}, [1, 1, 2, 2], None, None, 19),
    ((1, 1, 1, 4), {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, None, [1, 1, 1, 7], None,
     19),
    ((1, 1, 4, 1), {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, None, [1, 1, 7, 1],
     None, 19),
]


@pytest.mark.parametrize("t", [T.FLOAT, T.FLOAT16])
@pytest.mark.parametrize("xs,attrs,scales,sizes,roi,opset", RESIZE_MORE)
def test_resize_more(xs, attrs, scales, sizes, roi, opset, t):
    check(resize_model(xs, t, attrs, scales, sizes, roi, opset), {"x": rand(xs, t)}, t)


@pytest.mark.parametrize("t", [T.UINT8, T.INT8, T.INT32])
def test_resize_nearest_int(t):
    x = np.arange(20).reshape(1, 1, 4, 5).astype({T.UINT8: np.uint8, T.INT8: np.int8, T.INT32: np.int32}[t])
    check_against_cpu(resize_model(x.shape, t, {"mode": "nearest"}, [1, 1, 1.5, 0.7]), [{"x": x}])


def test_resize_linear_uint8_refused():
    x = np.arange(20, dtype=np.uint8).reshape(1, 1, 4, 5)
    stays_on_cpu(resize_model(x.shape, T.UINT8, {"mode": "linear"}, [1, 1, 1.5, 0.7]), {"x": x}, "Resize",
                 rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("xs,scales", [((1, 1, 3, 4), [1, 1, 2, 3]), ((1, 1, 6, 7), [1, 1, 0.5, 0.4]),
                                       ((2, 4), [1.5, 2]), ((1, 2, 4), [1, 1.5, 2])])
def test_resize_10(xs, scales, mode):
    m = make_model([helper.make_node("Resize", ["x", "s"], ["y"], mode=mode)], [("x", T.FLOAT, xs)],
                   [("y", T.FLOAT, None)], {"s": np.asarray(scales, np.float32)}, opset=10)
    check(m, {"x": rand(xs)})


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("opset", [7, 9])
def test_upsample(mode, opset):
    scales = [1.0, 1.0, 2.0, 1.5]
    if opset == 7:
        m = make_model([helper.make_node("Upsample", ["x"], ["y"], mode=mode, scales=scales)],
                       [("x", T.FLOAT, (1, 2, 3, 4))], [("y", T.FLOAT, None)], opset=7)
    else:
        m = make_model([helper.make_node("Upsample", ["x", "s"], ["y"], mode=mode)], [("x", T.FLOAT, (1, 2, 3, 4))],
                       [("y", T.FLOAT, None)], {"s": np.asarray(scales, np.float32)}, opset=9)
    check(m, {"x": rand((1, 2, 3, 4))})


def test_resize_bf16():
    check_bf16("Resize", [("x", (1, 2, 4, 5)), ("", None), ("s", None)], opset=19,
               attrs={"mode": "linear"}, inits={"s": np.asarray([1, 1, 1.5, 0.6], np.float32)},
               feeds={"x": rand((1, 2, 4, 5))})


def test_resize_layout_checked():
    # ORT's CPU kernel rejects linear resizing of the channel axis: constant scales are refused at claim
    # time (the CPU EP then reports its own error); scales fed at run time fail with a clear error
    from ortmlx import partition_reports
    from ortmlx.testing import session
    m = resize_model((1, 3, 4, 5), T.FLOAT, {"mode": "linear"}, [1.5, 1, 2, 1])
    with pytest.raises(Exception, match="Linear"):
        session(m).run(None, {"x": rand((1, 3, 4, 5))})
    assert any(u.op == "Resize" for u in partition_reports()[-1].unclaimed)
    node = helper.make_node("Resize", ["x", "", "s"], ["y"], mode="linear")
    m = make_model([node], [("x", T.FLOAT, (1, 3, 4, 5)), ("s", T.FLOAT, (4,))], [("y", T.FLOAT, None)], opset=19)
    s = session(m)
    with pytest.raises(Exception, match="layout ORT's CPU kernel rejects"):
        s.run(None, {"x": rand((1, 3, 4, 5)), "s": np.array([1.5, 1, 2, 1], np.float32)})
    ok = s.run(None, {"x": rand((1, 3, 4, 5)), "s": np.array([1, 1, 2, 1.5], np.float32)})[0]
    want = session(m, "CPUExecutionProvider", record=False).run(
        None, {"x": rand((1, 3, 4, 5)), "s": np.array([1, 1, 2, 1.5], np.float32)})[0]
    np.testing.assert_allclose(ok, want, rtol=1e-4, atol=1e-5)


GS_MODES = {16: ["bilinear", "nearest", "bicubic"], 20: ["linear", "nearest", "cubic"]}


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("pad", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("opset,mode", [(o, m) for o in (16, 20) for m in GS_MODES[o]])
def test_grid_sample(opset, mode, pad, align):
    xs, gs = (2, 3, 5, 6), (2, 4, 7, 2)
    m = one_node("GridSample", [("x", T.FLOAT, xs), ("g", T.FLOAT, gs)], [("y", T.FLOAT, None)],
                 {"mode": mode, "padding_mode": pad, "align_corners": align}, opset=opset)
    check(m, {"x": rand(xs), "g": rand(gs, seed=1, lo=-1.4, hi=1.4)})


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("pad", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_grid_sample_3d(mode, pad, align):
    xs, gs = (1, 2, 3, 4, 5), (1, 2, 3, 4, 3)
    m = one_node("GridSample", [("x", T.FLOAT, xs), ("g", T.FLOAT, gs)], [("y", T.FLOAT, None)],
                 {"mode": mode, "padding_mode": pad, "align_corners": align}, opset=20)
    check(m, {"x": rand(xs), "g": rand(gs, seed=1, lo=-1.4, hi=1.4)})


@pytest.mark.parametrize("t", [T.FLOAT16, T.DOUBLE])
@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_grid_sample_types(mode, t):
    xs, gs = (1, 2, 4, 5), (1, 3, 3, 2)
    m = one_node("GridSample", [("x", t, xs), ("g", t, gs)], [("y", t, None)], {"mode": mode}, opset=22)
    check(m, {"x": rand(xs, t), "g": rand(gs, t, seed=1, lo=-1.2, hi=1.2)}, t)


def test_grid_sample_zero_batch():
    m = one_node("GridSample", [("x", T.FLOAT, (0, 2, 4, 5)), ("g", T.FLOAT, (0, 3, 3, 2))], [("y", T.FLOAT, None)],
                 opset=20)
    check(m, {"x": rand((0, 2, 4, 5)), "g": rand((0, 3, 3, 2))})


@pytest.mark.parametrize("t", [T.FLOAT, T.DOUBLE])
@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("size", [[2, 3, 4, 5], [1, 1, 1, 3], [1, 1, 3, 1], [2, 1, 3, 2, 4], [1, 1, 1, 2, 1]])
def test_affine_grid(size, align, t):
    k = len(size) - 2
    m = make_model([helper.make_node("AffineGrid", ["theta", "size"], ["g"], align_corners=align)],
                   [("theta", t, (size[0], k, k + 1))], [("g", t, None)],
                   {"size": np.asarray(size, np.int64)}, opset=20)
    check(m, {"theta": rand((size[0], k, k + 1), t)}, t)


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("pad", ["zeros", "border", "reflection"])
def test_grid_sample_nearest_ties(pad, align):
    # grid points landing exactly between pixels: rounding is half to even, as ORT's nearbyint
    g = np.array([-1, -0.75, -0.5, -0.25, 0, 0.25, 0.5, 0.75, 1, -1.25, 1.25, 1.125], np.float32)
    grid = np.stack(np.meshgrid(g, g), -1)[None].astype(np.float32)
    m = one_node("GridSample", [("x", T.FLOAT, (1, 1, 5, 5)), ("g", T.FLOAT, grid.shape)], [("y", T.FLOAT, None)],
                 {"mode": "nearest", "padding_mode": pad, "align_corners": align}, opset=20)
    check(m, {"x": rand((1, 1, 5, 5)), "g": grid}, rtol=0, atol=0)
