"""Indexing / data movement vs the CPU EP: Slice, Gather, GatherElements, GatherND, Scatter,
ScatterElements, ScatterND, Pad, TopK, NonZero, Unique, Compress, ReverseSequence, CenterCropPad."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper

from ortmlx.testing import check_against_cpu, make_model, session, unclaimed_ops

from _movutil import DTYPE_PATHS, DTYPES, force_path, check, check_error, check_refused, data, i64, one_node, refusal_reason

BIG = 2**63 - 1
D = "data"     # placeholder: the data tensor of the case's dtype and shape


def dup_idx():
    return np.array([[1, 0, 2], [0, 2, 1], [1, 1, 0]], np.int64)     # column 0 hits row 1 twice


# id: (op, data shape, inputs after data (D = another data tensor of the same type), attrs, opset, n_out,
#      consts, out_types (None: data type); "I64" stands for int64)
CASES = {
    # Slice
    "slice_v1": ("Slice", (3, 5), [], {"starts": [1, -3], "ends": [3, BIG], "axes": [0, 1]}, 9, 1, (), None),
    "slice_basic": ("Slice", (4, 6), [i64(1, 0), i64(3, 5)], {}, 13, 1, (), None),
    "slice_axes_steps": ("Slice", (4, 6, 3), [i64(0, 5), i64(BIG, 1), i64(0, -2), i64(2, -1)], {}, 13, 1, (),
                         None),
    "slice_neg_step_clamp": ("Slice", (5, 4), [i64(-10, 100), i64(-100, -BIG), i64(0, 1), i64(-1, -2)], {}, 13,
                             1, (), None),
    "slice_neg_step_end": ("Slice", (7,), [i64(BIG), i64(-BIG), i64(0), i64(-3)], {}, 13, 1, (1, 2, 3, 4), None),
    "slice_open_end_neg_step": ("Slice", (5, 4), [i64(-6, 0), i64(BIG, 2**31 - 1), i64(0, 1), i64(-2, -1)], {},
                                13, 1, (), None),
    "slice_empty": ("Slice", (4, 3), [i64(3), i64(1), i64(0)], {}, 13, 1, (), None),
    "slice_zero_dim": ("Slice", (0, 3), [i64(0, 1), i64(1, 3)], {}, 13, 1, (), None),
    "slice_int32": ("Slice", (4, 6), [np.array([1], np.int32), np.array([-1], np.int32),
                                      np.array([-1], np.int32)], {}, 13, 1, (), None),
    # Gather family
    "gather_axis0": ("Gather", (5, 3), [i64(0, 4, -1, 2)], {}, 13, 1, (), None),
    "gather_axis1_2d": ("Gather", (2, 5, 3), [np.array([[0, -5], [4, 1]], np.int32)], {"axis": 1}, 13, 1, (),
                        None),
    "gather_scalar": ("Gather", (4, 3), [np.array(-2, np.int64)], {"axis": -2}, 13, 1, (1,), None),
    "gather_v9": ("Gather", (5, 3), [i64(0, 4, 2)], {}, 9, 1, (), None),
    "gather_empty_idx": ("Gather", (4, 3), [np.zeros((0,), np.int64)], {"axis": 1}, 13, 1, (), None),
    "gather_elements": ("GatherElements", (3, 4), [np.array([[0, -1, 2, 3], [3, 0, 1, -4]], np.int64)],
                        {"axis": 1}, 13, 1, (), None),
    "gather_elements_ax0": ("GatherElements", (3, 4), [np.array([[2, 0], [-1, 1]], np.int64)], {"axis": 0},
                            11, 1, (), None),
    "gather_nd": ("GatherND", (3, 4, 2), [np.array([[0, 1], [2, -1]], np.int64)], {}, 11, 1, (), None),
    "gather_nd_full": ("GatherND", (3, 4), [np.array([[[1, 2]], [[0, 3]]], np.int64)], {}, 13, 1, (), None),
    "gather_nd_empty_slices": ("GatherND", (2, 0), [np.array([[5]], np.int64)], {}, 13, 1, (), None),
    "gather_nd_batch": ("GatherND", (2, 3, 4), [np.array([[[1], [2]], [[0], [-1]]], np.int64)],
                        {"batch_dims": 1}, 13, 1, (), None),
    # Scatter family
    "scatter_v9": ("Scatter", (3, 3), [np.array([[1, 0, 2], [0, 2, 1]], np.int64), "upd"], {"axis": 0}, 9, 1,
                   (), None),
    "scatter_elements": ("ScatterElements", (3, 4), [np.array([[1, -1], [0, 2]], np.int64), "upd"],
                         {"axis": 1}, 13, 1, (), None),
    "scatter_elements_dup": ("ScatterElements", (3, 3), [dup_idx(), "upd"], {"axis": 0}, 13, 1, (), None),
    "scatter_elements_add": ("ScatterElements", (3, 3), [dup_idx(), "upd"], {"reduction": "add"}, 16, 1, (),
                             None),
    "scatter_elements_mul": ("ScatterElements", (3, 3), [dup_idx(), "upd"], {"reduction": "mul"}, 16, 1, (),
                             None),
    "scatter_elements_max": ("ScatterElements", (3, 3), [dup_idx(), "upd"], {"reduction": "max", "axis": -1},
                             18, 1, (), None),
    "scatter_elements_min": ("ScatterElements", (3, 3), [dup_idx(), "upd"], {"reduction": "min"}, 18, 1, (),
                             None),
    "scatter_nd": ("ScatterND", (4, 3), [np.array([[1], [-1]], np.int64), "upd"], {}, 13, 1, (), None),
    "scatter_nd_dup": ("ScatterND", (4, 3), [np.array([[1, 0], [2, 2], [1, 0]], np.int64), "upd"], {}, 13, 1,
                       (), None),
    "scatter_nd_add": ("ScatterND", (4, 3), [np.array([[1], [1], [3]], np.int64), "upd"], {"reduction": "add"},
                       16, 1, (), None),
    "scatter_nd_mul": ("ScatterND", (4, 3), [np.array([[1], [1]], np.int64), "upd"], {"reduction": "mul"}, 16,
                       1, (), None),
    "scatter_nd_max": ("ScatterND", (4, 3), [np.array([[0, 1], [0, 1]], np.int64), "upd"], {"reduction": "max"},
                       18, 1, (), None),
    "scatter_nd_min": ("ScatterND", (4, 3), [np.array([[2], [2]], np.int64), "upd"], {"reduction": "min"}, 18,
                       1, (), None),
    # Pad
    "pad_v2": ("Pad", (2, 3), [], {"pads": [0, 1, 1, 2], "value": 1.5}, 9, 1, (), None),
    "pad_v2_reflect": ("Pad", (3, 4), [], {"pads": [1, 2, 2, 1], "mode": "reflect"}, 9, 1, (), None),
    "pad_const": ("Pad", (2, 3), [i64(1, 0, 0, 2), "value"], {}, 13, 1, (), None),
    "pad_const_default": ("Pad", (2, 3), [i64(1, 1, 1, 1)], {}, 13, 1, (1,), None),
    "pad_negative": ("Pad", (4, 5), [i64(-1, 2, 1, -3), "value"], {}, 13, 1, (), None),
    "pad_reflect": ("Pad", (3, 4), [i64(2, 3, 1, 3)], {"mode": "reflect"}, 13, 1, (), None),
    "pad_edge": ("Pad", (3, 4), [i64(2, 5, 1, 0)], {"mode": "edge"}, 13, 1, (), None),
    "pad_value_2d": ("Pad", (2, 3), [i64(1, 0, 0, 2), "value2d"], {}, 13, 1, (), None),
    "pad_axes": ("Pad", (2, 3, 4), [i64(1, 2, 0, 1), "value", i64(-1, 0)], {}, 18, 1, (), None),
    "pad_wrap": ("Pad", (3, 4), [i64(1, 5, 4, 2)], {"mode": "wrap"}, 19, 1, (), None),
    "pad_crop_past_end": ("Pad", (3, 4), [i64(0, -6, 0, 8), "value"], {}, 13, 1, (), None),
    "pad_reflect_cropped": ("Pad", (3, 5), [i64(0, -1, 0, 2)], {"mode": "reflect"}, 13, 1, (), None),
    "pad_empty_input_edge": ("Pad", (0, 3), [i64(2, 1, -2, 0)], {"mode": "edge"}, 13, 1, (), None),
    "pad_zero_dim": ("Pad", (0, 3), [i64(1, 0, 1, 0), "value"], {}, 13, 1, (), None),
    # TopK
    "topk_v1": ("TopK", (3, 5), [], {"k": 2}, 9, 2, (), [None, T.INT64]),
    "topk_largest": ("TopK", (3, 6), [i64(3)], {}, 13, 2, (), [None, T.INT64]),
    "topk_smallest_axis0": ("TopK", (4, 3), [i64(2)], {"axis": 0, "largest": 0}, 13, 2, (1,), [None, T.INT64]),
    "topk_ties": ("TopK", "ties", [i64(4)], {}, 13, 2, (), [None, T.INT64]),
    "topk_ties_smallest": ("TopK", "ties", [i64(4)], {"largest": 0}, 13, 2, (), [None, T.INT64]),
    "topk_k1_axis0": ("TopK", "ties", [i64(1)], {"axis": 0}, 13, 2, (), [None, T.INT64]),
    "topk_k0": ("TopK", (2, 3), [i64(0)], {}, 13, 2, (), [None, T.INT64]),
    # host computed
    "nonzero": ("NonZero", (3, 4), [], {}, 13, 1, (), [T.INT64]),
    "nonzero_scalar": ("NonZero", (), [], {}, 13, 1, (), [T.INT64]),
    "unique_sorted": ("Unique", "ties", [], {}, 11, 4, (), [None, T.INT64, T.INT64, T.INT64]),
    "unique_unsorted": ("Unique", "ties", [], {"sorted": 0}, 11, 4, (), [None, T.INT64, T.INT64, T.INT64]),
    "unique_axis": ("Unique", "rows", [], {"axis": 0}, 11, 4, (), [None, T.INT64, T.INT64, T.INT64]),
    "unique_axis_unsorted": ("Unique", "rows", [], {"axis": -2, "sorted": 0}, 11, 4, (),
                             [None, T.INT64, T.INT64, T.INT64]),
    "unique_empty": ("Unique", (0,), [], {}, 11, 4, (), [None, T.INT64, T.INT64, T.INT64]),
    "unique_empty_axis": ("Unique", (0, 2), [], {"axis": 0}, 11, 4, (), [None, T.INT64, T.INT64, T.INT64]),
    # Compress / ReverseSequence / CenterCropPad
    "compress_flat": ("Compress", (2, 3), [np.array([1, 0, 1, 1], bool)], {}, 13, 1, (), None),
    "compress_axis": ("Compress", (3, 4), [np.array([0, 1, 1], bool)], {"axis": 0}, 13, 1, (), None),
    "compress_short": ("Compress", (3, 4), [np.array([1, 0], bool)], {"axis": -1}, 13, 1, (1,), None),
    "compress_long_cond": ("Compress", (3, 4), [np.array([1, 0, 1, 1, 0], bool)], {"axis": 0}, 13, 1, (), None),
    "revseq_time0": ("ReverseSequence", (4, 3, 2), [i64(4, 1, 2)], {}, 13, 1, (), None),
    "revseq_batch0": ("ReverseSequence", (3, 4), [i64(1, 4, 0)], {"batch_axis": 0, "time_axis": 1}, 13, 1, (),
                      None),
    "center_crop_pad": ("CenterCropPad", (5, 4, 3), [i64(2, 7)], {"axes": [0, -1]}, 18, 1, (), None),
    "center_crop_pad_all": ("CenterCropPad", (4, 3), [i64(3, 6)], {}, 18, 1, (), None),
}
NEEDS_UNIQUE = {"ties": (2, 6), "rows": (5, 3)}


def make_data(t, shape, seed=0):
    if shape == "ties":        # small value set: many equal values
        return (data(T.INT64, (3, 6), seed) % 3).astype(data(t, (1,)).dtype) if t != T.BOOL else \
            data(t, (3, 6), seed)
    if shape == "rows":        # repeated rows
        rows = data(t, (3, 3), seed)
        return rows[[0, 2, 0, 1, 2]]
    return data(t, shape, seed)


def build(case, t, bf16=False):
    op, shape, extra, attrs, opset, n_out, consts, out_types = CASES[case]
    x = make_data(t, shape)
    ins = [x]
    for k, e in enumerate(extra):
        if isinstance(e, str) and e == "upd":
            ins.append(data(t, np.asarray(extra[0]).shape[:1] + x.shape[np.asarray(extra[0]).shape[-1]:], 7)
                       if op == "ScatterND" else data(t, np.asarray(extra[0]).shape, 7))
        elif isinstance(e, str) and e.startswith("value"):
            ins.append(data(t, (1, 1) if e == "value2d" else (), 9))
        else:
            ins.append(e)
    ots = [t if o is None else o for o in (out_types or [None] * n_out)]
    return one_node(op, ins, attrs, opset, ots, n_out, consts, bf16=bf16)


@pytest.mark.parametrize("t,path", DTYPE_PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_indexing_ops(case, t, path, monkeypatch):
    force_path(monkeypatch, path)
    model, feeds = build(case, t)
    reduction = CASES[case][3].get("reduction", "none") != "none"
    if reduction and t == T.BOOL:
        assert "ORT's CPU kernel rejects it" in refusal_reason(model, CASES[case][0])
        return
    if reduction and t == T.FLOAT16:
        _check_half_reduction(case, model, feeds)
        return
    check(model, feeds)


def _check_half_reduction(case, model, feeds, out=np.float16, rtol=4e-3):
    """A float16 (bfloat16: ``model`` casts float32 in and out) scatter with a reduction, which ORT's CPU kernel
    lacks, against the float32 op on the CPU EP: within a few ulps of the type (duplicates are combined in it)."""
    s = session(model)
    assert CASES[case][0] not in unclaimed_ops(s), unclaimed_ops(s)
    ref, _ = build(case, T.FLOAT)
    f32 = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feeds.items()}
    want = session(ref, "CPUExecutionProvider", record=False).run(None, f32)[0]
    got = s.run(None, feeds)[0]
    assert got.dtype == out
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=rtol, atol=rtol * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("case", [c for c, v in CASES.items() if v[3].get("reduction", "none") != "none"])
def test_scatter_reduction_bf16(case):
    """bfloat16 data and updates (cast from float32 in the model) against the float32 op: within 4 bfloat16 ulps."""
    model, feeds = build(case, T.FLOAT, bf16=True)
    _check_half_reduction(case, model, feeds, out=np.float32, rtol=2 ** -6)


@pytest.mark.parametrize("case", ["slice_axes_steps", "gather_axis1_2d", "gather_nd_batch", "scatter_elements_dup",
                                  "scatter_nd", "pad_reflect", "pad_const", "revseq_time0"])
def test_indexing_bf16(case):
    model, feeds = build(case, T.FLOAT, bf16=True)
    check(model, feeds, op=CASES[case][0], bf16=True)


def test_topk_nan_free_float64():
    model, feeds = one_node("TopK", [data(T.DOUBLE, (4, 7)), i64(3)], {"largest": 0}, 13,
                            [T.DOUBLE, T.INT64], 2)
    check(model, feeds)


# ------------------------------------------------------------------ refused cases
def test_topk_unsorted_refused():
    model, feeds = one_node("TopK", [data(T.FLOAT, (3, 5)), i64(2)], {"sorted": 0}, 13, [T.FLOAT, T.INT64], 2)
    check_refused(model, feeds, "TopK")


def test_gather_device_indices_are_synced():
    """Indices computed on the device are read on the host (an eager sync), range-checked, and right."""
    nodes = [helper.make_node("TopK", ["v", "k"], ["vals", "idx"]),
             helper.make_node("Gather", ["x", "idx"], ["y"], axis=0)]
    model = make_model(nodes, [("x", T.FLOAT, ["a", "b"]), ("v", T.FLOAT, ["c"])],
                       [("y", T.FLOAT, None)], {"k": i64(2)}, opset=13)
    _claimed_with_sync(model, {"x": data(T.FLOAT, (5, 3)), "v": data(T.FLOAT, (5,))}, "Gather")


# ------------------------------------------------------------------ errors name the node
@pytest.mark.parametrize("op,ins,attrs,opset", [
    ("Gather", [data(T.FLOAT, (3, 2)), i64(0, 3)], {}, 13),
    ("Gather", [data(T.FLOAT, (3, 2)), i64(-4)], {}, 13),
    ("GatherElements", [data(T.FLOAT, (3, 2)), np.array([[0, 2]], np.int64)], {"axis": 1}, 13),
    ("GatherND", [data(T.FLOAT, (3, 2)), np.array([[3, 0]], np.int64)], {}, 13),
    ("ScatterElements", [data(T.FLOAT, (3, 2)), np.array([[5]], np.int64), data(T.FLOAT, (1, 1))], {}, 13),
    ("ScatterND", [data(T.FLOAT, (3, 2)), np.array([[-4]], np.int64), data(T.FLOAT, (1, 2))], {}, 13),
    ("TopK", [data(T.FLOAT, (3, 2)), i64(3)], {}, 13),
    ("Slice", [data(T.FLOAT, (3, 2)), i64(0), i64(1), i64(0), i64(0)], {}, 13),
    ("Slice", [data(T.FLOAT, (3, 2)), i64(0, 0), i64(1, 1), i64(0, -2)], {}, 13),
    ("Pad", [data(T.FLOAT, (3, 2)), i64(3, 0, 0, 0)], {"mode": "reflect"}, 13),
    ("Pad", [data(T.FLOAT, (1, 2)), i64(1, 0, 0, 0)], {"mode": "reflect"}, 13),
    ("Pad", [data(T.FLOAT, (3, 2)), i64(-3, 0, 0, 0)], {"mode": "edge"}, 13),
    ("Pad", [data(T.FLOAT, (3, 2)), i64(-3, 0, -1, 0)], {}, 13),
    ("ReverseSequence", [data(T.FLOAT, (3, 2)), i64(4, 1)], {}, 13),
    ("Pad", [data(T.FLOAT, (0, 3)), i64(1, 0, 0, 0)], {"mode": "edge"}, 13),
    ("Pad", [data(T.FLOAT, (2, 3)), i64(1, 0, 0, 0), np.zeros(0, np.float32)], {}, 13),
    ("Pad", [data(T.FLOAT, (0, 3)), i64(0, 0, 0, 0)], {"mode": "wrap"}, 19),
    ("GatherND", [data(T.FLOAT, (2, 0)), np.array([[5, 0]], np.int64)], {}, 13),
    ("OneHot", [i64(1), i64(0), np.array([0, 1], np.float32)], {}, 11),
], ids=["gather_high", "gather_low", "gather_elements", "gather_nd", "scatter_elements", "scatter_nd",
        "topk_k", "slice_step0", "slice_dup_axes", "pad_reflect_big", "pad_reflect_len1", "pad_edge_cropped_empty",
        "pad_negative_size", "revseq_len", "pad_edge_empty_axis", "pad_value_empty", "pad_wrap_empty_input",
        "gather_nd_index_into_empty", "onehot_depth0"])
def test_indexing_errors(op, ins, attrs, opset):
    n_out = 2 if op == "TopK" else 1
    out_types = [T.FLOAT, T.INT64] if op == "TopK" else [T.FLOAT] if op == "OneHot" else None
    model, feeds = one_node(op, ins, attrs, opset, out_types, n_out)
    check_error(model, feeds, f"{op}_0")


def test_gather_embedding_on_mlx():
    """Gather(weight initializer, ids graph input) -> Unsqueeze: the embedding lookup pattern."""
    nodes = [helper.make_node("Gather", ["w", "ids"], ["e"]), helper.make_node("Relu", ["e"], ["y"])]
    model = make_model(nodes, [("ids", T.INT64, ["b", "s"])], [("y", T.FLOAT, None)],
                       {"w": data(T.FLOAT, (10, 4))}, opset=13)
    check_against_cpu(model, [{"ids": np.array([[1, 9, -1]], np.int64)}, {"ids": np.zeros((2, 0), np.int64)}])


def test_unique_nan_errors():
    """ORT's Unique compares NaN as equal to anything (order-dependent); we raise instead of guessing."""
    from _movutil import session
    model, feeds = one_node("Unique", [np.array([1, np.nan, 2], np.float32)], {}, 11,
                            [T.FLOAT, T.INT64, T.INT64, T.INT64], 4)
    with pytest.raises(Exception, match="Unique_0.*NaN"):
        session(model).run(None, feeds)


# Col2Im: (input shape, image_shape, block_shape, attrs)
COL2IM = {
    "basic": ((1, 5, 5), i64(5, 5), i64(1, 5), {}),
    "strides": ((1, 9, 4), i64(5, 5), i64(3, 3), {"strides": [2, 2]}),
    "pads": ((2, 4, 12), i64(3, 4), i64(2, 2), {"pads": [1, 0, 0, 1]}),
    "dilations": ((1, 8, 9), i64(5, 6), i64(2, 2), {"dilations": [2, 3]}),
    "1d": ((2, 6, 4), i64(5,), i64(3,), {"pads": [1, 0]}),
    "3d": ((1, 8, 8), i64(3, 3, 3), i64(2, 2, 2), {}),
}


@pytest.mark.parametrize("const", [False, True], ids=["dynamic", "const"])
@pytest.mark.parametrize("case", list(COL2IM))
def test_col2im(case, const):
    shape, image, block, attrs = COL2IM[case]
    model, feeds = one_node("Col2Im", [data(T.FLOAT, shape), image, block], attrs, 18, consts=(1, 2) if const else ())
    check(model, feeds)


@pytest.mark.parametrize("largest", [1, 0])
def test_topk_k1_nan(largest):
    """k=1 with NaNs follows ORT's scan: a leading NaN wins, later NaNs never do."""
    x = np.array([[np.nan, 1, 3], [2, np.nan, 5], [4, 4, np.nan], [np.nan, np.nan, 1]], np.float32)
    model, feeds = one_node("TopK", [x, i64(1)], {"largest": largest}, 13, [T.FLOAT, T.INT64], 2)
    check(model, feeds)


# ------------------------------------------------------------------ randomized differential check (slow)
def _random_cases(rng):
    """Random shapes/parameters for the ops with the most edge-case arithmetic."""
    r = int(rng.integers(1, 4))
    shape = tuple(int(v) for v in rng.integers(0, 5, r))
    x = rng.integers(-9, 9, shape).astype(np.float32)
    ax = int(rng.integers(-r, r))
    na = int(rng.integers(1, r + 1))
    axes = rng.permutation(r)[:na] - (r if rng.random() < .3 else 0)
    edge = [BIG, -BIG - 1, 2**31 - 1, 7, -7]
    pick = lambda: int(rng.choice(edge)) if rng.random() < .25 else int(rng.integers(-6, 6))  # noqa: E731
    yield "Slice", [x, i64(*[pick() for _ in axes]), i64(*[pick() for _ in axes]), i64(*axes),
                    i64(*[int(rng.choice([-3, -2, -1, 1, 2, 3])) for _ in axes])], {}, 13, None, 1
    yield "Pad", [x, i64(*rng.integers(-3, 4, 2 * r))], {"mode": str(rng.choice(["constant", "reflect", "edge",
                                                                                   "wrap"]))}, 19, None, 1
    tgt = [int(v) for v in rng.choice([-1, 0, 1, 2, 3, 4, 6], rng.integers(0, 4))]
    yield "Reshape", [x, np.array(tgt, np.int64)], {"allowzero": int(rng.integers(0, 2))}, 14, None, 1
    ids = rng.integers(-6, 6, tuple(int(v) for v in rng.integers(0, 3, rng.integers(0, 3)))).astype(np.int64)
    yield "Gather", [x, ids], {"axis": ax}, 13, None, 1
    k = int(rng.integers(1, r + 1))
    ish = tuple(int(v) for v in rng.integers(0, 3, rng.integers(1, 3))) + (k,)
    idx = rng.integers(-4, 4, ish).astype(np.int64)
    yield "GatherND", [x, idx], {}, 13, None, 1
    red = str(rng.choice(["none", "add", "mul", "max", "min"]))
    yield "ScatterND", [x, idx, rng.integers(-9, 9, ish[:-1] + shape[k:]).astype(np.float32)], {"reduction": red}, \
        18, None, 1
    ish = tuple(int(rng.integers(0, 4)) if i == ax % r else int(min(v, rng.integers(0, 4))) for i, v in enumerate(shape))
    idx = rng.integers(-4, 4, ish).astype(np.int64)
    yield "GatherElements", [x, idx], {"axis": ax}, 13, None, 1
    yield "ScatterElements", [x, idx, rng.integers(-9, 9, ish).astype(np.float32)], {"axis": ax, "reduction": red}, \
        18, None, 1
    yield "Split", [x], {"axis": ax, "num_outputs": 2}, 18, None, 2
    if x.size:
        yield "TopK", [x, i64(int(rng.integers(0, 4)))], {"axis": ax, "largest": int(rng.integers(0, 2))}, 13, \
            [T.FLOAT, T.INT64], 2


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_random_against_cpu(seed):
    """Random parameters: MLX and the CPU EP agree on the answer, or both raise."""
    from _movutil import session
    rng = np.random.default_rng(seed)
    for _ in range(60):
        for op, ins, attrs, opset, out_types, n_out in _random_cases(rng):
            model, feeds = one_node(op, ins, attrs, opset, out_types, n_out)
            try:
                want = session(model, "CPUExecutionProvider", record=False).run(None, feeds)
            except Exception:  # noqa: BLE001 - ORT rejects the case: so must we
                with pytest.raises(Exception):
                    session(model).run(None, feeds)
                continue
            got = session(model).run(None, feeds)
            for g, w in zip(got, want):
                assert g.shape == w.shape and np.array_equal(g, w), (op, attrs, [np.shape(i) for i in ins])


def test_pad_value_computed_on_device():
    """constant_value is read on the device, so a value computed by MLX keeps Pad claimed."""
    nodes = [helper.make_node("Relu", ["v"], ["rv"]), helper.make_node("Pad", ["x", "pads", "rv"], ["y"])]
    model = make_model(nodes, [("x", T.FLOAT, ["a", "b"]), ("v", T.FLOAT, [])], [("y", T.FLOAT, None)],
                       {"pads": i64(1, 0, 2, 1)}, opset=13)
    check_against_cpu(model, [{"x": data(T.FLOAT, (2, 3)), "v": np.array(2.5, np.float32)}])


# ---------------------------------------------------------------- TensorScatter (opset 24)
# id: (past shape, update shape, write_indices (None: omitted; "const": an initializer [1, 0, 2][:B]), attrs)
TS_CASES = {
    "linear_4d": ((2, 3, 6, 4), (2, 3, 2, 4), i64(1, 4), {}),
    "linear_no_indices": ((2, 3, 6, 4), (2, 3, 3, 4), None, {"mode": "linear"}),
    "linear_full": ((2, 5, 3), (2, 5, 3), i64(0, 0), {}),
    "linear_empty_update": ((2, 5, 3), (2, 0, 3), i64(5, 2), {}),
    "circular_wrap": ((2, 1, 5, 3), (2, 1, 3, 3), i64(4, 7), {"mode": "circular"}),
    "circular_full": ((3, 4, 2), (3, 4, 2), i64(3, 0, 9), {"mode": "circular"}),
    "axis_1": ((2, 6, 4), (2, 2, 4), i64(3, 0), {"axis": 1}),
    "axis_last": ((2, 3, 6), (2, 3, 2), i64(1, 4), {"axis": -1, "mode": "circular"}),
    "axis_2_of_4": ((2, 6, 3, 2), (2, 6, 1, 2), i64(2, 0), {"axis": 2}),
    "const_indices": ((3, 5, 2), (3, 2, 2), "const", {}),
}
TS_TYPES = [T.FLOAT, T.FLOAT16, T.DOUBLE, T.INT8, T.UINT8, T.INT32, T.INT64, T.UINT64, T.BOOL]
_NP = {T.FLOAT: np.float32, T.FLOAT16: np.float16, T.DOUBLE: np.float64, T.INT8: np.int8, T.UINT8: np.uint8,
       T.INT32: np.int32, T.INT64: np.int64, T.UINT64: np.uint64, T.BOOL: np.bool_}


def _ts_model(ps, us, w, attrs, t=T.FLOAT, name="ts"):
    ins = ["p", "u"] + ([] if w is None else ["w"])
    inits = {"w": i64(1, 0, 2)[:ps[0]]} if isinstance(w, str) else {}
    vis = [("p", t, None), ("u", t, None)] + ([("w", T.INT64, None)] if w is not None and not inits else [])
    return make_model([helper.make_node("TensorScatter", ins, ["y"], name=name, **attrs)], vis, [("y", t, None)],
                      inits, opset=24)


def _ts_data(t, shape, seed):
    if t == T.BOOL:
        return np.random.default_rng(seed).random(shape) < 0.5
    return data(t, shape, seed).astype(_NP[t]) if t != T.UINT64 else np.abs(data(T.INT64, shape, seed)).astype(np.uint64)


@pytest.mark.parametrize("case", list(TS_CASES), ids=str)
def test_tensor_scatter(case):
    ps, us, w, attrs = TS_CASES[case]
    feeds = {"p": data(T.FLOAT, ps, 1), "u": data(T.FLOAT, us, 2)}
    if w is not None and not isinstance(w, str):
        feeds["w"] = w
    check_against_cpu(_ts_model(ps, us, w, attrs), [feeds], rtol=0, atol=0)


@pytest.mark.parametrize("t", TS_TYPES, ids=str)
def test_tensor_scatter_dtypes(t):
    ps, us, w, attrs = TS_CASES["circular_wrap"]
    feeds = {"p": _ts_data(t, ps, 1), "u": _ts_data(t, us, 2), "w": w}
    check_against_cpu(_ts_model(ps, us, w, attrs, t), [feeds], rtol=0, atol=0)


def test_tensor_scatter_bf16():
    """bfloat16 cache (Cast in and out, all on MLX): data movement only, so exact."""
    nodes = [helper.make_node("Cast", ["p"], ["pb"], to=T.BFLOAT16), helper.make_node("Cast", ["u"], ["ub"], to=T.BFLOAT16),
             helper.make_node("TensorScatter", ["pb", "ub", "w"], ["yb"], mode="circular"),
             helper.make_node("Cast", ["yb"], ["y"], to=T.FLOAT)]
    m = make_model(nodes, [("p", T.FLOAT, None), ("u", T.FLOAT, None), ("w", T.INT64, None)], [("y", T.FLOAT, None)],
                   opset=24)
    check_against_cpu(m, [{"p": data(T.FLOAT, (2, 5, 3), 1), "u": data(T.FLOAT, (2, 2, 3), 2), "w": i64(4, 1)}],
                      rtol=0, atol=0)


@pytest.mark.parametrize("ps,us,w,attrs", [
    ((2, 4, 3), (2, 2, 3), i64(3, 0), {}),                          # linear: 3 + 2 > 4
    ((2, 4, 3), (2, 2, 3), i64(-1, 0), {"mode": "circular"}),        # negative write index
    ((2, 4, 3), (2, 5, 3), i64(0, 0), {"mode": "circular"}),         # sequence_length > max_sequence_length
    ((2, 4, 3), (2, 2, 3), i64(0, 0, 0), {}),                        # write_indices not [batch]
    ((2, 4, 3), (2, 4, 3), i64(0, 0), {"axis": 0}),                  # axis 0 (the batch)
], ids=["overflow", "negative", "too_long", "indices_shape", "axis0"])
def test_tensor_scatter_errors(ps, us, w, attrs):
    """ORT's CPU kernel fails on these; so do we, naming the node."""
    feeds = {"p": data(T.FLOAT, ps, 1), "u": data(T.FLOAT, us, 2), "w": w}
    check_error(_ts_model(ps, us, w, attrs, name="ts_err"), feeds, "ts_err")


def _claimed_with_sync(model, feeds, op):
    """The whole graph runs on MLX, equal to the CPU EP; the report names the host read of ``op``."""
    import ortmlx
    from ortmlx.testing import check_against_cpu
    check_against_cpu(model, [feeds])
    syncs = ortmlx.partition_reports()[-1].syncs
    assert any(op in s for s in syncs), syncs


@pytest.mark.parametrize("mode", ["reflect", "edge", "constant"])
def test_reversed_one_element_slice_then_pad(mode):
    """A one-element graph input sliced with a negative step is a host array with negative strides (NumPy calls it
    contiguous); Pad then handed it to MLX, which refused it (found by scripts/fuzz.py, 2026-12-06)."""
    nodes = [helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"]),
             helper.make_node("Pad", ["y", "p", "", "pa"], ["z"], mode=mode)]
    m = make_model(nodes, [("x", T.INT32, [1, 1, 1])], [("z", T.INT32, None)],
                   initializers={"s": i64(-1), "e": i64(-2**62), "a": i64(2), "st": i64(-1), "p": i64(0, 0),
                                 "pa": i64(2)})
    check_against_cpu(m, [{"x": np.array([[[7]]], np.int32)}])
