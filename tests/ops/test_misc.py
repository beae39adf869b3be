"""Misc ops against ORT's CPU EP: NonMaxSuppression, Det."""
import numpy as np
import pytest
from onnx import TensorProto as T, helper

from ortmlx.testing import check_against_cpu, make_model, session


def _boxes(rng, b, n, center):
    if center:
        xy = rng.uniform(0, 10, (b, n, 2))
        wh = rng.uniform(0.5, 4, (b, n, 2))
        return np.concatenate([xy, wh], -1).astype(np.float32)
    p, q = rng.uniform(0, 10, (b, n, 2)), rng.uniform(0, 10, (b, n, 2))   # corners in any order
    return np.concatenate([p, q], -1).astype(np.float32)


NMS = [  # (batches, classes, boxes, max_out, iou, score threshold, center_point_box, tied scores)
    (1, 1, 20, 5, 0.5, None, 0, False),
    (2, 3, 30, 10, 0.3, 0.2, 0, False),
    (2, 2, 40, 100, 0.1, None, 1, False),
    (1, 2, 50, 50, 0.5, 0.0, 0, True),         # many equal scores: ties go to the lower index
    (3, 1, 60, 7, 0.0, None, 1, True),
    (1, 1, 10, 0, 0.5, None, 0, False),        # max 0: nothing selected
    (1, 1, 0, 3, 0.5, None, 0, False),         # no boxes
]


@pytest.mark.parametrize("b,c,n,max_out,iou,st,cpb,ties", NMS)
def test_nms(b, c, n, max_out, iou, st, cpb, ties):
    ins = ["boxes", "scores", "m", "iou"] + (["st"] if st is not None else [])
    node = helper.make_node("NonMaxSuppression", ins, ["sel"], center_point_box=cpb)
    inits = {"m": np.array([max_out], np.int64), "iou": np.array([iou], np.float32)}
    if st is not None:
        inits["st"] = np.array([st], np.float32)
    m = make_model([node], [("boxes", T.FLOAT, (b, n, 4)), ("scores", T.FLOAT, (b, c, n))],
                   [("sel", T.INT64, None)], inits)
    feeds = []
    for seed in range(3):
        rng = np.random.default_rng(seed)
        s = rng.uniform(0, 1, (b, c, n))
        if ties:
            s = np.round(s * 4) / 4
        feeds.append({"boxes": _boxes(rng, b, n, cpb), "scores": s.astype(np.float32)})
    check_against_cpu(m, feeds)


def test_nms_defaults_select_nothing():
    # without max_output_boxes_per_class the spec's default 0 selects nothing
    node = helper.make_node("NonMaxSuppression", ["boxes", "scores"], ["sel"])
    m = make_model([node], [("boxes", T.FLOAT, (1, 4, 4)), ("scores", T.FLOAT, (1, 1, 4))], [("sel", T.INT64, None)])
    rng = np.random.default_rng(0)
    check_against_cpu(m, [{"boxes": _boxes(rng, 1, 4, 0), "scores": rng.uniform(0, 1, (1, 1, 4)).astype(np.float32)}])


@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4), (2, 3, 1, 1), (5, 2, 2), (0, 3, 3), (6, 6)])
def test_det(shape):
    m = make_model([helper.make_node("Det", ["x"], ["y"])], [("x", T.FLOAT, shape)], [("y", T.FLOAT, None)])
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, shape).astype(np.float32)
    check_against_cpu(m, [{"x": x}, {"x": np.zeros(shape, np.float32)}], rtol=1e-4, atol=1e-5)



TFIDF = [  # (mode, min, max gram length, max skip, weights, input dtype, input shape)
    ("TF", 1, 1, 0, None, T.INT64, (12,)),
    ("TF", 2, 2, 0, None, T.INT32, (2, 10)),
    ("TF", 1, 3, 2, None, T.INT64, (3, 12)),
    ("IDF", 1, 2, 1, None, T.INT64, (2, 9)),
    ("IDF", 1, 3, 3, [0.5, 2.0, 1.5, 1.0, 3.0, 0.25, 0.75, 2.5, 1.25], T.INT32, (14,)),
    ("TFIDF", 2, 3, 4, [0.5, 2.0, 1.5, 1.0, 3.0, 0.25, 0.75, 2.5, 1.25], T.INT64, (2, 15)),
    ("TFIDF", 1, 2, 0, None, T.INT64, (1, 5)),
]
# pool: unigrams 1 2 3, bigrams (1 2) (2 3) (3 1), trigrams (1 2 3) (2 1 2) (3 3 3); columns scrambled
POOL = dict(pool_int64s=[1, 2, 3, 1, 2, 2, 3, 3, 1, 1, 2, 3, 2, 1, 2, 3, 3, 3], ngram_counts=[0, 3, 9],
            ngram_indexes=[4, 0, 7, 2, 8, 1, 3, 6, 5])


@pytest.mark.parametrize("mode,lo,hi,skip,weights,t,shape", TFIDF)
def test_tfidf(mode, lo, hi, skip, weights, t, shape):
    attrs = dict(POOL, mode=mode, min_gram_length=lo, max_gram_length=hi, max_skip_count=skip)
    if weights:
        attrs["weights"] = weights
    m = make_model([helper.make_node("TfIdfVectorizer", ["x"], ["y"], **attrs)], [("x", t, shape)],
                   [("y", T.FLOAT, None)])
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.integers(0, 5, shape).astype(np.int64 if t == T.INT64 else np.int32)} for _ in range(3)]
    check_against_cpu(m, feeds)


def test_tfidf_empty_batch_is_an_error():
    attrs = dict(POOL, mode="TF", min_gram_length=1, max_gram_length=2, max_skip_count=0)
    m = make_model([helper.make_node("TfIdfVectorizer", ["x"], ["y"], **attrs)], [("x", T.INT64, (0, 5))],
                   [("y", T.FLOAT, None)])
    with pytest.raises(Exception, match="0 rows"):
        session(m).run(None, {"x": np.zeros((0, 5), np.int64)})


ROI = [  # (opset, attrs)
    (16, {}),
    (16, {"output_height": 3, "output_width": 4, "sampling_ratio": 2, "spatial_scale": 0.5}),
    (16, {"coordinate_transformation_mode": "output_half_pixel", "output_height": 2, "output_width": 2}),
    (16, {"mode": "max", "output_height": 3, "output_width": 3}),
    (16, {"mode": "max", "output_height": 2, "output_width": 5, "sampling_ratio": 3, "spatial_scale": 0.25}),
    (10, {"output_height": 4, "output_width": 4, "spatial_scale": 0.5}),
    (10, {"mode": "max", "output_height": 2, "output_width": 3}),
]


@pytest.mark.parametrize("opset,attrs", ROI)
def test_roi_align(opset, attrs):
    node = helper.make_node("RoiAlign", ["x", "rois", "bi"], ["y"], **attrs)
    m = make_model([node], [("x", T.FLOAT, (2, 3, 10, 12)), ("rois", T.FLOAT, (6, 4)), ("bi", T.INT64, (6,))],
                   [("y", T.FLOAT, None)], opset=opset)
    rng = np.random.default_rng(0)
    scale = attrs.get("spatial_scale", 1.0)
    p, q = rng.uniform(-3, 13, (6, 2)) / scale, rng.uniform(-3, 13, (6, 2)) / scale
    rois = np.concatenate([np.minimum(p, q), np.maximum(p, q)], 1).astype(np.float32)
    rois[0] = [2.0, 3.0, 2.5, 3.2]                                      # tiny ROI
    rois[1] = [20.0, 20.0, 30.0, 30.0]                                  # mostly outside the map
    feeds = {"x": rng.normal(0, 1, (2, 3, 10, 12)).astype(np.float32), "rois": rois,
             "bi": rng.integers(0, 2, 6).astype(np.int64)}
    check_against_cpu(m, [feeds])
