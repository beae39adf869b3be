"""Shape / layout ops vs the CPU EP: Shape, Size, Identity, Reshape, Transpose, Concat, Split,
Squeeze, Unsqueeze, Flatten, Expand, Tile, DepthToSpace, SpaceToDepth."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper

from ortmlx.testing import check_against_cpu, make_model

from _movutil import DTYPE_PATHS, DTYPES, force_path, check, check_error, check_refused, data, i64, one_node

# id: (op, data shape, extra inputs, attrs, opset, n_out, consts, out_types)
# extra inputs are host tensors ("same": another data tensor, ("data", shape): one of that shape);
# consts lists input positions given as initializers
CASES = {
    "shape": ("Shape", (2, 3, 4), [], {}, 13, 1, (), [T.INT64]),
    "shape_start_end": ("Shape", (2, 3, 4, 5), [], {"start": 1, "end": -1}, 21, 1, (), [T.INT64]),
    "shape_neg_start_clamp": ("Shape", (2, 3), [], {"start": -9, "end": 10}, 21, 1, (), [T.INT64]),
    "shape_empty": ("Shape", (2, 3), [], {"start": 2}, 21, 1, (), [T.INT64]),
    "size": ("Size", (2, 0, 4), [], {}, 21, 1, (), [T.INT64]),
    "identity": ("Identity", (3, 4), [], {}, 21, 1, (), None),
    "reshape": ("Reshape", (2, 3, 4), [i64(4, -1)], {}, 21, 1, (), None),
    "reshape_zero_copy": ("Reshape", (2, 3, 4), [i64(0, -1, 2)], {}, 13, 1, (1,), None),
    "reshape_allowzero": ("Reshape", (0, 3), [i64(3, 0)], {"allowzero": 1}, 14, 1, (), None),
    "reshape_allowzero_infer": ("Reshape", (0, 6), [i64(-1, 0, 3)], {"allowzero": 1}, 14, 1, (), None),
    "reshape_scalar": ("Reshape", (1, 1), [np.zeros(0, np.int64)], {}, 21, 1, (), None),
    "transpose_default": ("Transpose", (2, 3, 4), [], {}, 21, 1, (), None),
    "transpose_perm": ("Transpose", (2, 3, 4, 1), [], {"perm": [2, 0, 3, 1]}, 13, 1, (), None),
    "transpose_empty": ("Transpose", (2, 0, 3), [], {"perm": [1, 2, 0]}, 21, 1, (), None),
    "concat": ("Concat", (2, 3), ["same", "same"], {"axis": 0}, 21, 1, (), None),
    "concat_skips_empty": ("Concat", (0, 5), [("data", (2, 3))], {"axis": 0}, 13, 1, (), None),
    "concat_all_empty": ("Concat", (0, 3), [("data", (0, 4))], {"axis": 0}, 13, 1, (), None),
    "concat_neg_axis": ("Concat", (2, 3), ["same"], {"axis": -1}, 11, 1, (), None),
    "split_equal": ("Split", (6, 4), [], {"axis": 0}, 11, 3, (), None),
    "split_attr": ("Split", (5, 4), [], {"axis": 0, "split": [1, 4]}, 11, 2, (), None),
    "split_input": ("Split", (2, 7), [i64(3, 0, 4)], {"axis": -1}, 13, 3, (1,), None),
    "split_input_dyn": ("Split", (2, 7), [i64(5, 2)], {"axis": 1}, 18, 2, (), None),
    "split_num_outputs": ("Split", (7, 2), [], {"num_outputs": 3}, 18, 3, (), None),
    "split_num_outputs_uneven": ("Split", (2, 7), [], {"axis": 1, "num_outputs": 4}, 18, 4, (), None),
    "squeeze_all": ("Squeeze", (1, 3, 1, 2), [], {}, 11, 1, (), None),
    "squeeze_attr": ("Squeeze", (1, 3, 1, 2), [], {"axes": [-2]}, 11, 1, (), None),
    "squeeze_input": ("Squeeze", (1, 3, 1, 2), [i64(0, 2)], {}, 13, 1, (), None),
    "squeeze_dup_axes": ("Squeeze", (1, 3, 1), [i64(0, -3, 2)], {}, 13, 1, (), None),
    "squeeze_input_const": ("Squeeze", (1, 3, 1), [i64(-1)], {}, 21, 1, (1,), None),
    "unsqueeze_attr": ("Unsqueeze", (3, 2), [], {"axes": [0, -1]}, 11, 1, (), None),
    "unsqueeze_input": ("Unsqueeze", (3, 2), [i64(1, 4, 0)], {}, 13, 1, (), None),
    "unsqueeze_scalar": ("Unsqueeze", (), [i64(0)], {}, 21, 1, (1,), None),
    "flatten": ("Flatten", (2, 3, 4), [], {}, 21, 1, (), None),
    "flatten_0": ("Flatten", (2, 3, 4), [], {"axis": 0}, 21, 1, (), None),
    "flatten_neg": ("Flatten", (2, 3, 4, 5), [], {"axis": -1}, 11, 1, (), None),
    "flatten_rank": ("Flatten", (2, 3), [], {"axis": 2}, 21, 1, (), None),
    "expand": ("Expand", (3, 1), [i64(2, 3, 4)], {}, 13, 1, (), None),
    "expand_smaller": ("Expand", (3, 4), [i64(1, 1)], {}, 8, 1, (1,), None),
    "expand_zero": ("Expand", (1, 4), [i64(0, 1)], {}, 13, 1, (), None),
    "tile": ("Tile", (2, 3), [i64(2, 3)], {}, 13, 1, (), None),
    "tile_zero": ("Tile", (2, 3), [i64(0, 2)], {}, 6, 1, (1,), None),
    "d2s_dcr": ("DepthToSpace", (1, 8, 2, 3), [], {"blocksize": 2}, 13, 1, (), None),
    "d2s_crd": ("DepthToSpace", (2, 8, 2, 3), [], {"blocksize": 2, "mode": "CRD"}, 13, 1, (), None),
    "d2s_v1": ("DepthToSpace", (1, 9, 2, 2), [], {"blocksize": 3}, 9, 1, (), None),
    "s2d": ("SpaceToDepth", (2, 3, 4, 6), [], {"blocksize": 2}, 13, 1, (), None),
}
#: ORT CPU kernels that lack some dtypes
NO_KERNEL = {("DepthToSpace", T.INT64), ("DepthToSpace", T.INT32), ("DepthToSpace", T.BOOL),
             ("DepthToSpace", T.FLOAT16), ("SpaceToDepth", T.INT64), ("SpaceToDepth", T.INT32),
             ("SpaceToDepth", T.BOOL), ("SpaceToDepth", T.FLOAT16)}


def build(case, t, bf16=False):
    op, shape, extra, attrs, opset, n_out, consts, out_types = CASES[case]
    x = data(t, shape)
    ins = [x] + [data(t, shape, seed=k + 1) if isinstance(e, str) else
                 data(t, e[1], seed=k + 1) if isinstance(e, tuple) else e for k, e in enumerate(extra)]
    return one_node(op, ins, attrs, opset, out_types, n_out, consts, bf16=bf16)


@pytest.mark.parametrize("t,path", DTYPE_PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_shape_ops(case, t, path, monkeypatch):
    force_path(monkeypatch, path)
    op = CASES[case][0]
    if (op, t) in NO_KERNEL:
        pytest.skip(f"ORT CPU has no {op} kernel for {T.DataType.Name(t)}")
    model, feeds = build(case, t)
    check(model, feeds)


@pytest.mark.parametrize("case", ["reshape", "transpose_perm", "concat", "split_input_dyn",
                                  "squeeze_input", "unsqueeze_input", "flatten"])
def test_shape_ops_bf16(case):
    """bf16 where ORT CPU has a kernel (not Expand/Tile/DepthToSpace; Identity is optimised away)."""
    op = CASES[case][0]
    model, feeds = build(case, T.FLOAT, bf16=True)
    check(model, feeds, op=op, bf16=True)


@pytest.mark.parametrize("params", ["initializers", "graph_inputs"])
def test_shape_chain_on_mlx(params):
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape (plus Slice / Size shape math) all claimed.

    With graph-input parameters every shape op runs on the numpy twins; with initializers the
    parameters live in MLX and the device translators run.
    """
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
        helper.make_node("Slice", ["s", "st", "en"], ["tail"]),
        helper.make_node("Unsqueeze", ["b", "ax"], ["b1"]),
        helper.make_node("Concat", ["b1", "m1"], ["new"], axis=0),
        helper.make_node("Reshape", ["x", "new"], ["y"]),
        helper.make_node("Size", ["x"], ["n"]),
        helper.make_node("Mul", ["tail", "tail"], ["t2"]),
    ]
    consts = {"i0": np.array(0, np.int64), "st": i64(1), "en": i64(2**62), "ax": i64(0), "m1": i64(-1)}
    ins = [("x", T.FLOAT, ["N", "C", "H"])]
    if params == "graph_inputs":
        ins += [(k, T.INT64, list(v.shape)) for k, v in consts.items()]
    outs = [("y", T.FLOAT, None), ("n", T.INT64, None), ("t2", T.INT64, None)]
    model = make_model(nodes, ins, outs, consts if params == "initializers" else {}, opset=21)
    extra = consts if params == "graph_inputs" else {}
    check_against_cpu(model, [{"x": data(T.FLOAT, (2, 3, 4)), **extra}, {"x": data(T.FLOAT, (5, 1, 2)), **extra}])


def test_reversed_host_slice_feeds_device():
    """A host Slice with a negative step (a negative-stride numpy view) consumed by a device op.

    The slice parameters are graph inputs: host values (constant initializers live in MLX).
    """
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "st", "en", "ax", "step"], ["r"]),
             helper.make_node("Cast", ["r"], ["rf"], to=T.FLOAT),
             helper.make_node("Mul", ["rf", "w"], ["y"])]
    ins = [("x", T.FLOAT, ["a", "b", "c"]), ("w", T.FLOAT, [3])] + [(n, T.INT64, [1]) for n in ("st", "en", "ax", "step")]
    model = make_model(nodes, ins, [("y", T.FLOAT, None)])
    feeds = {"x": data(T.FLOAT, (2, 3, 4)), "w": np.ones(3, np.float32), "st": i64(-1), "en": i64(-2**63),
             "ax": i64(0), "step": i64(-1)}
    check_against_cpu(model, [feeds])


# ------------------------------------------------------------------ refused cases
def test_reshape_shape_from_device_is_synced():
    """A shape computed on the device is read on the host (an eager sync): claimed, still right."""
    nodes = [helper.make_node("OneHot", ["i", "depth", "vals"], ["oh"], axis=-1),
             helper.make_node("Flatten", ["oh"], ["shp"], axis=0),
             helper.make_node("Squeeze", ["shp", "ax"], ["shp1"]),
             helper.make_node("Reshape", ["x", "shp1"], ["y"], name="Reshape_0")]
    inits = {"depth": i64(2), "vals": i64(2, 3), "ax": i64(0)}
    model = make_model(nodes, [("x", T.FLOAT, None), ("i", T.INT64, None)], [("y", T.FLOAT, None)], inits)
    import ortmlx
    from ortmlx.testing import check_against_cpu
    check_against_cpu(model, [{"x": data(T.FLOAT, (6,)), "i": i64(1)}])
    assert any("Reshape" in s for s in ortmlx.partition_reports()[-1].syncs)


# ------------------------------------------------------------------ errors name the node
@pytest.mark.parametrize("op,ins,attrs,opset", [
    ("Reshape", [data(T.FLOAT, (2, 3)), i64(4, -1)], {}, 21),
    ("Reshape", [data(T.FLOAT, (2, 3)), i64(-1, -1)], {}, 21),
    ("Expand", [data(T.FLOAT, (2, 3)), i64(4, 3)], {}, 13),
    ("Squeeze", [data(T.FLOAT, (2, 3)), i64(0)], {}, 13),
    ("Split", [data(T.FLOAT, (5, 3))], {"axis": 0}, 13),
    ("Tile", [data(T.FLOAT, (2, 3)), i64(2)], {}, 13),
    ("Split", [data(T.FLOAT, (4, 3))], {"num_outputs": 3}, 18),
    ("Reshape", [data(T.FLOAT, (0, 3)), i64(0, -1)], {}, 14),
    ("Unsqueeze", [data(T.FLOAT, (3,)), i64(0, 0)], {}, 13),
    ("Reshape", [data(T.FLOAT, (0, 3)), i64(2, -1, 0)], {"allowzero": 1}, 14),
], ids=["reshape_size", "reshape_two_unknown", "expand_incompatible", "squeeze_non1", "split_uneven",
        "tile_rank", "split_empty_last_chunk", "reshape_zero_size_unknown", "unsqueeze_dup",
        "reshape_allowzero_indivisible"])
def test_shape_errors(op, ins, attrs, opset):
    n_out = attrs.get("num_outputs", 2) if op == "Split" else 1
    model, feeds = one_node(op, ins, attrs, opset, n_out=n_out)
    check_error(model, feeds, f"{op}_0")


@pytest.mark.parametrize("a,b,axis", [((0, 0, 1), (1, 0, 0), 0), ((1, 0, 0), (0, 0, 1), 0), ((0, 3), (2, 0), 1)])
def test_concat_of_empty_inputs_into_an_empty_output(a, b, axis):
    """Every input empty, their off-axis dims unlike, the output empty too: ORT's shape (the first input's off the
    axis), not an error (nothing is left uninitialized)."""
    model, feeds = one_node("Concat", [data(T.FLOAT, a), data(T.FLOAT, b)], {"axis": axis}, 13)
    check(model, feeds)


def test_concat_empty_input_with_axis_extent_errors():
    """ORT skips the shape check of an empty input but still counts its axis extent, returning
    uninitialized memory; we raise instead of guessing."""
    from _movutil import session
    model, feeds = one_node("Concat", [data(T.FLOAT, (1, 2)), data(T.FLOAT, (0, 2))], {"axis": -1}, 13)
    with pytest.raises(Exception, match="Concat_0.*uninitialized"):
        session(model).run(None, feeds)
