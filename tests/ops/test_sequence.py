"""Sequence and optional ops vs the CPU EP: SequenceConstruct, SequenceEmpty, SequenceAt, SequenceInsert,
SequenceErase, SequenceLength, SplitToSequence, ConcatFromSequence, Optional, OptionalHasElement,
OptionalGetElement. Each case is a small graph whose sequences/optionals live inside it (the EP only
exchanges tensors with ORT), so every node must land on the MLX EP; a sequence or optional that is a
graph input/output must keep its nodes on the CPU EP."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

import ortmlx
from ortmlx import compiled as C
from ortmlx.testing import assert_close, assignment, check_against_cpu, make_model, session, unclaimed_ops

EP = "MLXExecutionProvider"
RNG = np.random.default_rng(7)


def nd(op, ins, outs, **attrs):
    """A node named after its first output (errors name it)."""
    return helper.make_node(op, ins, outs, name=f"{op}_{outs[0]}", **attrs)


def arr(shape, t=np.float32, seed=0):
    r = np.random.default_rng(seed)
    if np.dtype(t) == np.bool_:
        return r.random(shape) > 0.5
    if np.dtype(t).kind in "iu":
        return r.integers(-9, 10, shape).astype(t)
    return r.standard_normal(shape).astype(t)


def i64(*v):
    return np.array(v if len(v) != 1 else v[0], np.int64)


def seq_vi(name, t):
    return helper.make_tensor_sequence_value_info(name, t, None)


# A case: (nodes, inputs [(name, elem type, shape)], outputs [(name, elem type, shape)], feeds, opset, inits)
def case(nodes, inputs, outputs, feeds, opset=18, inits=None):
    return nodes, inputs, outputs, feeds, opset, inits or {}


def build(c):
    nodes, inputs, outputs, feeds, opset, inits = c
    return make_model(nodes, inputs, outputs, inits, opset=opset), feeds


def run_case(c):
    model, feeds = build(c)
    check_against_cpu(model, [feeds])


X34 = ("x", T.FLOAT, [3, 4])
x34 = arr((3, 4))
Y = ("y", T.FLOAT, None)

# ---------------------------------------------------------------------------- SplitToSequence
# SequenceAt(-1) shows the last chunk, SequenceLength how many; then stack them (new_axis=1: equal chunks,
# no split) or concatenate them back along the axis
SPLIT = {
    "default_axis0": ({"axis": 0}, None, (4, 3)),
    "default_axis1_keepdims0": ({"axis": 1, "keepdims": 0}, None, (3, 4)),
    "default_neg_axis": ({"axis": -1}, None, (2, 5)),
    "scalar_even": ({"axis": 1}, i64(2), (3, 6)),
    "scalar_uneven": ({"axis": 0}, i64(2), (5, 2)),
    "scalar_larger_than_dim": ({"axis": 0}, i64(9), (4, 2)),
    "sizes": ({"axis": 1}, i64(1, 3, 2), (2, 6)),
    "sizes_keepdims0_ignored": ({"axis": 0, "keepdims": 0}, i64(2, 1), (3, 2)),
    "sizes_int32": ({"axis": -2}, np.array([3, 1], np.int32), (4, 2)),
    "empty_input_axis": ({"axis": 0}, None, (0, 3)),
}


def split_case(attrs, split, shape, split_as_input=False):
    ins = ["x"] + (["split"] if split is not None else [])
    inputs, feeds, inits = [("x", T.FLOAT, list(shape))], {"x": arr(shape)}, {}
    if split is not None:
        if split_as_input:
            inputs.append(("split", T.INT32 if split.dtype == np.int32 else T.INT64, list(split.shape)))
            feeds["split"] = split
        else:
            inits["split"] = split
    nodes = [nd("SplitToSequence", ins, ["s"], **attrs), nd("SequenceLength", ["s"], ["n"]),
             nd("SequenceAt", ["s", "last"], ["y"])]
    return case(nodes, inputs, [Y, ("n", T.INT64, [])], feeds, inits={**inits, "last": i64(-1)}) \
        if shape[attrs.get("axis", 0)] == 0 else \
        case(nodes + [nd("ConcatFromSequence", ["s"], ["z"], axis=0 if split is None else attrs.get("axis", 0),
                         new_axis=int(split is None))], inputs,
             [Y, ("n", T.INT64, []), ("z", T.FLOAT, None)], feeds, inits={**inits, "last": i64(-1)})


@pytest.mark.parametrize("name,split_as_input",
                         [(k, False) for k in SPLIT] + [(k, True) for k, v in SPLIT.items() if v[1] is not None],
                         ids=lambda v: {False: "const_split", True: "input_split"}.get(v, v) if isinstance(v, bool) else v)
def test_split_to_sequence(name, split_as_input):
    attrs, split, shape = SPLIT[name]
    c = split_case(attrs, split, shape, split_as_input)
    if shape[attrs.get("axis", 0)] == 0:
        model, feeds = build(c)          # no chunk: SequenceAt(-1) errors on both EPs
        s = session(model)
        assert not unclaimed_ops(s), assignment(s)
        with pytest.raises(Exception, match="SequenceAt_y"):
            s.run(None, feeds)
        return
    run_case(c)


@pytest.mark.parametrize("split,keepdims,shape", [(np.zeros(0, np.int64), 0, (2, 3)), (np.zeros(0, np.int64), 1, (2, 3)),
                                                 (i64(3, 0), 1, (3, 2)), (i64(0, 0), 1, (0, 2))],
                         ids=["empty_keepdims0", "empty_keepdims1", "zero_chunk", "zero_chunks_empty_axis"])
def test_split_to_sequence_ort_permissive_splits(split, keepdims, shape):
    """ORT 1.31 reads an empty 1-D split as no split (length-1 chunks, keepdims applies) and accepts
    chunks of size 0 (the spec asks for positive sizes); we follow it."""
    nodes = [nd("SplitToSequence", ["x", "split"], ["s"], axis=0, keepdims=keepdims),
             nd("SequenceLength", ["s"], ["n"]), nd("SequenceAt", ["s", "last"], ["y"]),
             nd("ConcatFromSequence", ["s"], ["z"], axis=0, new_axis=1 - keepdims)]
    run_case(case(nodes, [("x", T.FLOAT, list(shape)), ("split", T.INT64, list(split.shape))],
                  [Y, ("n", T.INT64, []), ("z", T.FLOAT, None)], {"x": arr(shape), "split": split},
                  inits={"last": i64(-1)}))


#: element types ORT's CPU SplitToSequence has a kernel for (float32, float64, int32); bool/int64 via Cast
@pytest.mark.parametrize("opset", [11, 18, 24])
@pytest.mark.parametrize("t", [np.float32, np.float64, np.int32], ids=["float32", "float64", "int32"])
def test_split_to_sequence_dtypes_and_opsets(t, opset):
    et = NP2ONNX[np.dtype(t)]
    nodes = [nd("SplitToSequence", ["x", "split"], ["s"], axis=1), nd("SequenceInsert", ["s", "t"], ["s1"]),
             nd("SequenceErase", ["s1", "zero"], ["s2"]), nd("ConcatFromSequence", ["s2"], ["y"], axis=1),
             nd("SequenceLength", ["s2"], ["n"])]
    run_case(case(nodes, [("x", et, [2, 5]), ("t", et, [2, 1])], [("y", et, None), ("n", T.INT64, [])],
                  {"x": arr((2, 5), t), "t": arr((2, 1), t, seed=3)}, opset=opset,
                  inits={"split": i64(2, 3), "zero": i64(0)}))


def test_split_to_sequence_scalar_split_keepdims0_refused():
    """ORT drops the axis for a scalar split with keepdims=0; the spec ignores keepdims: left to ORT."""
    c = split_case({"axis": 0, "keepdims": 0}, i64(1), (3, 2))
    model, feeds = build(c)
    s = session(model)
    assert "SplitToSequence" in unclaimed_ops(s), assignment(s)
    reasons = [u.reason for u in ortmlx.partition_reports()[-1].unclaimed if u.op == "SplitToSequence"]
    assert "keepdims=0" in reasons[0]
    cpu = session(model, "CPUExecutionProvider", record=False)
    for g, w in zip(s.run(None, feeds), cpu.run(None, feeds)):
        assert_close(g, w)


@pytest.mark.parametrize("split", [i64(0), i64(-1), i64(2, 2), i64(4, -1)],
                         ids=["scalar_zero", "scalar_negative", "sum_short", "negative_size"])
def test_split_to_sequence_bad_split_names_node(split):
    c = split_case({"axis": 0}, split, (3, 2), split_as_input=True)
    model, feeds = build(c)
    with pytest.raises(Exception):
        session(model, "CPUExecutionProvider", record=False).run(None, feeds)
    s = session(model)
    assert not unclaimed_ops(s), assignment(s)
    with pytest.raises(Exception, match="SplitToSequence_s"):
        s.run(None, feeds)


# ---------------------------------------------------------------------------- ConcatFromSequence
# SequenceConstruct(a, b, c) -> ConcatFromSequence
CONCAT = {
    "axis0": ({"axis": 0}, [(2, 3), (1, 3), (4, 3)], np.float32),
    "axis_neg1": ({"axis": -1}, [(2, 1), (2, 3), (2, 2)], np.float32),
    "axis1_rank3": ({"axis": 1}, [(2, 1, 3), (2, 2, 3)], np.float32),
    "one_tensor": ({"axis": 0}, [(2, 3)], np.float32),
    "skips_empty": ({"axis": 0}, [(0, 3), (2, 3)], np.float32),
    "int64": ({"axis": 0}, [(2,), (3,)], np.int64),
    "bool": ({"axis": 1}, [(2, 2), (2, 1)], np.bool_),
    "float16": ({"axis": 0}, [(1, 2), (2, 2)], np.float16),
    "stack_axis0": ({"axis": 0, "new_axis": 1}, [(2, 3)] * 3, np.float32),
    "stack_axis_last": ({"axis": 2, "new_axis": 1}, [(2, 3)] * 2, np.float32),
    "stack_axis_neg1": ({"axis": -1, "new_axis": 1}, [(2, 3)] * 2, np.float32),
    "stack_axis_neg3": ({"axis": -3, "new_axis": 1}, [(2, 3)] * 4, np.float32),
    "stack_scalars": ({"axis": 0, "new_axis": 1}, [()] * 3, np.float32),
    "stack_int32": ({"axis": 1, "new_axis": 1}, [(3,)] * 2, np.int32),
}
NP2ONNX = {np.dtype(k): v for k, v in {np.float32: T.FLOAT, np.float16: T.FLOAT16, np.int64: T.INT64,
                                         np.int32: T.INT32, np.bool_: T.BOOL, np.float64: T.DOUBLE}.items()}


def concat_case(attrs, shapes, t):
    names = [f"a{k}" for k in range(len(shapes))]
    et = NP2ONNX[np.dtype(t)]
    nodes = [nd("SequenceConstruct", names, ["s"]), nd("ConcatFromSequence", ["s"], ["y"], **attrs)]
    return case(nodes, [(n, et, list(sh)) for n, sh in zip(names, shapes)], [("y", et, None)],
                {n: arr(sh, t, seed=k) for k, (n, sh) in enumerate(zip(names, shapes))})


@pytest.mark.parametrize("name", list(CONCAT))
def test_concat_from_sequence(name):
    run_case(concat_case(*CONCAT[name]))


@pytest.mark.parametrize("attrs,shapes", [({"axis": 0, "new_axis": 1}, [(2, 3), (3, 2)]),
                                          ({"axis": 0}, [(), ()]),
                                          ({"axis": 2}, [(2, 3), (2, 3)]),
                                          ({"axis": 3, "new_axis": 1}, [(2, 3), (2, 3)]),
                                          ({"axis": 0}, [(2, 3), (2, 4)])],
                         ids=["stack_mismatch", "concat_scalars", "axis_oob", "stack_axis_oob", "concat_mismatch"])
def test_concat_from_sequence_bad_input_names_node(attrs, shapes):
    model, feeds = build(concat_case(attrs, shapes, np.float32))
    with pytest.raises(Exception):
        session(model, "CPUExecutionProvider", record=False).run(None, feeds)
    s = session(model)
    assert not unclaimed_ops(s), assignment(s)
    with pytest.raises(Exception, match="ConcatFromSequence_y"):
        s.run(None, feeds)


def test_concat_from_sequence_new_axis_2_refused():
    """The spec allows new_axis 0 or 1 (ORT stacks for any other value): left to ORT, with its answer."""
    model = make_model([nd("SplitToSequence", ["x"], ["s"]), nd("ConcatFromSequence", ["s"], ["y"], axis=0, new_axis=2)],
                       [X34], [Y], opset=18)
    s = _cpu_equal(model, {"x": x34})
    assert {"SplitToSequence", "ConcatFromSequence"} <= set(unclaimed_ops(s)), assignment(s)
    assert "new_axis=2" in _reasons("ConcatFromSequence")[0]


# ---------------------------------------------------------------------------- SequenceConstruct / SequenceAt
# SequenceConstruct(a (2,3), b (1,3), c (4,)) -> SequenceAt(position)
AT = {
    "first": i64(0), "last": i64(2), "neg1": i64(-1), "neg3": i64(-3),
    "int32": np.array(1, np.int32), "one_elem_1d": np.array([1], np.int64),
}


def at_case(pos, as_input, shapes=((2, 3), (1, 3), (4,))):
    names = [f"a{k}" for k in range(len(shapes))]
    nodes = [nd("SequenceConstruct", names, ["s"]), nd("SequenceAt", ["s", "p"], ["y"])]
    inputs = [(n, T.FLOAT, list(sh)) for n, sh in zip(names, shapes)]
    feeds = {n: arr(sh, seed=k) for k, (n, sh) in enumerate(zip(names, shapes))}
    inits = {}
    if as_input:
        inputs.append(("p", T.INT32 if pos.dtype == np.int32 else T.INT64, list(pos.shape)))
        feeds["p"] = pos
    else:
        inits["p"] = pos
    return case(nodes, inputs, [Y], feeds, inits=inits)


@pytest.mark.parametrize("as_input", [False, True], ids=["const_pos", "input_pos"])
@pytest.mark.parametrize("name", list(AT))
def test_sequence_at(name, as_input):
    run_case(at_case(AT[name], as_input))


@pytest.mark.parametrize("pos", [3, -4], ids=["past_end", "before_start"])
def test_sequence_at_out_of_range_names_node(pos):
    model, feeds = build(at_case(i64(pos), True))
    with pytest.raises(Exception):
        session(model, "CPUExecutionProvider", record=False).run(None, feeds)
    s = session(model)
    assert not unclaimed_ops(s), assignment(s)
    with pytest.raises(Exception, match=r"SequenceAt_y.*out of range"):
        s.run(None, feeds)


CONSTRUCT = {
    "single": [(2, 2)],
    "mixed_shapes": [(3,), (2, 2), ()],
    "five": [(1, 2)] * 5,
}


@pytest.mark.parametrize("name", list(CONSTRUCT))
def test_sequence_construct(name):
    shapes = CONSTRUCT[name]
    names = [f"a{k}" for k in range(len(shapes))]
    nodes = [nd("SequenceConstruct", names, ["s"]), nd("SequenceLength", ["s"], ["n"])]
    outs = [("n", T.INT64, [])]
    for k in range(len(shapes)):
        nodes.append(nd("SequenceAt", ["s", f"p{k}"], [f"y{k}"]))
        outs.append((f"y{k}", T.FLOAT, None))
    run_case(case(nodes, [(n, T.FLOAT, list(sh)) for n, sh in zip(names, shapes)], outs,
                  {n: arr(sh, seed=k) for k, (n, sh) in enumerate(zip(names, shapes))},
                  inits={f"p{k}": i64(k - len(shapes) if k % 2 else k) for k in range(len(shapes))}))


# ---------------------------------------------------------------------------- SequenceInsert / SequenceErase
# SplitToSequence(x (3,4), axis 0: three (1,4) rows) -> SequenceInsert(t (1,4), position) -> SequenceErase -> Concat
INSERT = {
    "append_default": None, "front": i64(0), "middle": i64(2), "at_length": i64(3), "neg1": i64(-1), "neg3": i64(-3),
    "int32": np.array(1, np.int32),
}


def insert_case(pos, erase=None, as_input=True):
    ins = ["s", "t"] + (["p"] if pos is not None else [])
    nodes = [nd("SplitToSequence", ["x"], ["s"], axis=0), nd("SequenceInsert", ins, ["s2"])]
    last = "s2"
    inputs = [X34, ("t", T.FLOAT, [1, 4])]
    feeds = {"x": x34, "t": arr((1, 4), seed=5)}
    inits = {}
    if pos is not None:
        if as_input:
            inputs.append(("p", T.INT32 if pos.dtype == np.int32 else T.INT64, list(pos.shape)))
            feeds["p"] = pos
        else:
            inits["p"] = pos
    if erase is not False:
        nodes.append(nd("SequenceErase", ["s2"] + (["e"] if erase is not None else []), ["s3"]))
        last = "s3"
        if erase is not None:
            inits["e"] = erase
    nodes += [nd("ConcatFromSequence", [last], ["y"], axis=0), nd("SequenceLength", [last], ["n"])]
    return case(nodes, inputs, [Y, ("n", T.INT64, [])], feeds, inits=inits)


@pytest.mark.parametrize("name,as_input",
                         [(k, True) for k in INSERT] + [(k, False) for k, v in INSERT.items() if v is not None],
                         ids=lambda v: {False: "const_pos", True: "input_pos"}.get(v, v) if isinstance(v, bool) else v)
def test_sequence_insert(name, as_input):
    run_case(insert_case(INSERT[name], erase=False, as_input=as_input))


@pytest.mark.parametrize("pos", [4, -5], ids=["past_end", "before_start"])
def test_sequence_insert_out_of_range_names_node(pos):
    model, feeds = build(insert_case(i64(pos), erase=False))
    with pytest.raises(Exception):
        session(model, "CPUExecutionProvider", record=False).run(None, feeds)
    s = session(model)
    with pytest.raises(Exception, match=r"SequenceInsert_s2.*out of range"):
        s.run(None, feeds)


ERASE = {"last_default": None, "first": i64(0), "neg2": i64(-2), "last": i64(3), "int32": np.array(1, np.int32)}


@pytest.mark.parametrize("name", list(ERASE))
def test_sequence_erase(name):
    run_case(insert_case(i64(1), erase=ERASE[name]))


def test_sequence_erase_out_of_range_names_node():
    model, feeds = build(insert_case(None, erase=i64(4)))
    with pytest.raises(Exception):
        session(model, "CPUExecutionProvider", record=False).run(None, feeds)
    with pytest.raises(Exception, match=r"SequenceErase_s3.*out of range"):
        session(model).run(None, feeds)


@pytest.mark.parametrize("pos", [None, i64(0)], ids=["default", "pos0"])
def test_sequence_erase_from_empty_names_node(pos):
    ins = ["s0"] + (["p"] if pos is not None else [])
    model = make_model([nd("SequenceEmpty", [], ["s0"]), nd("SequenceErase", ins, ["s1"]),
                        nd("SequenceLength", ["s1"], ["n"])], [], [("n", T.INT64, [])],
                       {"p": pos} if pos is not None else {}, opset=18)
    with pytest.raises(Exception):
        session(model, "CPUExecutionProvider", record=False).run(None, {})
    s = session(model)
    assert not unclaimed_ops(s), assignment(s)
    with pytest.raises(Exception, match=r"SequenceErase_s1.*(empty|out of range)"):
        s.run(None, {})


# ---------------------------------------------------------------------------- SequenceEmpty / SequenceLength
EMPTY = {
    "float_default": ({}, T.FLOAT, np.float32),
    "int64": ({"dtype": T.INT64}, T.INT64, np.int64),
    "float16": ({"dtype": T.FLOAT16}, T.FLOAT16, np.float16),
}


@pytest.mark.parametrize("name", list(EMPTY))
def test_sequence_empty_then_insert(name):
    """SequenceEmpty -> length 0; insert two tensors -> stack them."""
    attrs, et, t = EMPTY[name]
    nodes = [nd("SequenceEmpty", [], ["s0"], **attrs), nd("SequenceLength", ["s0"], ["n0"]),
             nd("SequenceInsert", ["s0", "a"], ["s1"]), nd("SequenceInsert", ["s1", "b", "zero"], ["s2"]),
             nd("ConcatFromSequence", ["s2"], ["y"], axis=0, new_axis=1)]
    run_case(case(nodes, [("a", et, [2]), ("b", et, [2])],
                  [("y", et, None), ("n0", T.INT64, [])],
                  {"a": arr((2,), t), "b": arr((2,), t, seed=1)}, inits={"zero": i64(0)}))


LENGTH = {
    "add": lambda: [nd("Add", ["n", "one"], ["y"])],
    "reshape_by_length": lambda: [nd("Unsqueeze", ["n", "ax0"], ["n1"]), nd("Concat", ["n1", "minus1"], ["shp"], axis=0),
                                  nd("Reshape", ["x", "shp"], ["y"])],
    "range": lambda: [nd("Range", ["zero", "n", "one"], ["y"])],
}


@pytest.mark.parametrize("name", list(LENGTH))
def test_sequence_length_feeds_arithmetic(name):
    nodes = [nd("SplitToSequence", ["x"], ["s"], axis=1), nd("SequenceLength", ["s"], ["n"])] + LENGTH[name]()
    model, feeds = build(case(nodes, [X34], [("y", T.FLOAT if name == "reshape_by_length" else T.INT64, None)],
                              {"x": x34}, inits={"one": i64(1), "zero": i64(0), "ax0": np.array([0]), "minus1": np.array([-1])}))
    check_against_cpu(model, [feeds])
    if name == "reshape_by_length":    # the length is host shape math: no device sync for Reshape's shape
        assert not ortmlx.partition_reports()[-1].syncs


# ---------------------------------------------------------------------------- Optional
OPT_T = helper.make_tensor_type_proto(T.FLOAT, None)
OPTIONAL = {
    # Optional(x) -> has / get -> Add
    "tensor_v15": (lambda: [nd("Optional", ["x"], ["o"]), nd("OptionalHasElement", ["o"], ["h"]),
                            nd("OptionalGetElement", ["o"], ["g"]), nd("Add", ["g", "x"], ["y"])], 15),
    "tensor_v18": (lambda: [nd("Optional", ["x"], ["o"]), nd("OptionalHasElement", ["o"], ["h"]),
                            nd("OptionalGetElement", ["o"], ["g"]), nd("Add", ["g", "x"], ["y"])], 18),
    # an empty optional (type attribute: a TypeProto ORT cannot expose, not needed)
    "empty_v18": (lambda: [nd("Optional", [], ["o"], type=OPT_T), nd("OptionalHasElement", ["o"], ["h"]),
                           nd("Neg", ["x"], ["y"])], 18),
    "empty_v15": (lambda: [nd("Optional", [], ["o"], type=OPT_T), nd("OptionalHasElement", ["o"], ["h"]),
                           nd("Neg", ["x"], ["y"])], 15),
    # v18: a tensor input holds a value; an omitted input does not
    "has_tensor_v18": (lambda: [nd("OptionalHasElement", ["x"], ["h"]), nd("OptionalGetElement", ["x"], ["y"])], 18),
    "has_omitted_v18": (lambda: [nd("OptionalHasElement", [""], ["h"]), nd("Neg", ["x"], ["y"])], 18),
    # an optional sequence
    "sequence": (lambda: [nd("SplitToSequence", ["x"], ["s"], axis=0), nd("Optional", ["s"], ["o"]),
                          nd("OptionalHasElement", ["o"], ["h"]), nd("OptionalGetElement", ["o"], ["s2"]),
                          nd("ConcatFromSequence", ["s2"], ["y"], axis=1)], 18),
    "has_sequence_v18": (lambda: [nd("SplitToSequence", ["x"], ["s"], axis=1), nd("OptionalHasElement", ["s"], ["h"]),
                                  nd("OptionalGetElement", ["s"], ["s2"]),
                                  nd("ConcatFromSequence", ["s2"], ["y"], axis=0)], 18),
    # the presence flag drives arithmetic
    "has_to_cast": (lambda: [nd("Optional", ["x"], ["o"]), nd("OptionalHasElement", ["o"], ["h"]),
                             nd("Cast", ["h"], ["hf"], to=T.FLOAT), nd("Mul", ["x", "hf"], ["y"])], 18),
}


@pytest.mark.parametrize("name", list(OPTIONAL))
def test_optional(name):
    fn, opset = OPTIONAL[name]
    nodes = fn()
    outs = [Y] + ([("h", T.BOOL, [])] if any(n.output[0] == "h" for n in nodes) else [])
    run_case(case(nodes, [X34], outs, {"x": x34}, opset=opset))


def test_optional_get_element_of_empty_names_node():
    model, feeds = build(case([nd("Optional", [], ["o"], type=OPT_T), nd("OptionalGetElement", ["o"], ["g"]),
                               nd("Add", ["g", "x"], ["y"])], [X34], [Y], {"x": x34}))
    with pytest.raises(Exception):
        session(model, "CPUExecutionProvider", record=False).run(None, feeds)
    s = session(model)
    assert not unclaimed_ops(s), assignment(s)
    with pytest.raises(Exception, match=r"OptionalGetElement_g.*empty"):
        s.run(None, feeds)


# ---------------------------------------------------------------------------- boundaries: never a group input/output
def _cpu_equal(model, feeds, options=None):
    """Both sessions give the same outputs (sequences compared element by element)."""
    s = session(model, options=options)
    cpu = session(model, "CPUExecutionProvider", record=False)
    for g, w in zip(s.run(None, feeds), cpu.run(None, feeds)):
        if isinstance(w, list):
            assert isinstance(g, list) and len(g) == len(w)
            for a, b in zip(g, w):
                assert_close(a, b)
        else:
            assert_close(g, w)
    return s


def _reasons(op):
    return [u.reason for u in ortmlx.partition_reports()[-1].unclaimed if u.op == op]


def test_sequence_graph_output_stays_on_cpu():
    model = make_model([nd("SplitToSequence", ["x"], ["s"], axis=1), nd("SequenceAt", ["s", "p"], ["y"])],
                       [X34], [Y, seq_vi("s", T.FLOAT)], {"p": i64(-1)}, opset=18)
    s = _cpu_equal(model, {"x": x34})
    assert {"SplitToSequence", "SequenceAt"} <= set(unclaimed_ops(s)), assignment(s)
    assert "graph input or output" in _reasons("SplitToSequence")[0]


def test_sequence_graph_input_stays_on_cpu():
    model = make_model([nd("SequenceAt", ["s", "p"], ["y0"]), nd("Neg", ["y0"], ["y"])],
                       [seq_vi("s", T.FLOAT), ("p", T.INT64, [])], [Y], opset=18)
    feeds = {"s": [arr((2, 3)), arr((1, 3), seed=1)], "p": i64(1)}
    s = _cpu_equal(model, feeds)
    assert "SequenceAt" in unclaimed_ops(s) and "Neg" in assignment(s).get(EP, {}), assignment(s)
    assert "graph input or output" in _reasons("SequenceAt")[0]


def test_optional_graph_output_stays_on_cpu():
    opt = helper.make_value_info("o", helper.make_optional_type_proto(OPT_T))
    model = make_model([nd("Optional", ["x"], ["o"]), nd("OptionalGetElement", ["o"], ["y"])], [X34], [Y, opt], opset=18)
    s = _cpu_equal(model, {"x": x34})
    assert {"Optional", "OptionalGetElement"} <= set(unclaimed_ops(s)), assignment(s)


def test_sequence_through_unclaimed_node_regroups():
    """A sequence crossing to a node we refuse (SequenceInsert, disabled here) would leave the group: every
    node touching it is refused, then the refusal spreads to the next sequence, until no sequence crosses."""
    nodes = [nd("SplitToSequence", ["x"], ["s"], axis=0), nd("SequenceErase", ["s"], ["s1"]),
             nd("SequenceInsert", ["s1", "x"], ["s2"]), nd("SequenceErase", ["s2"], ["s3"]),
             nd("ConcatFromSequence", ["s3"], ["y0"], axis=0), nd("Neg", ["y0"], ["y"])]
    model = make_model(nodes, [X34], [Y], opset=18)
    s = _cpu_equal(model, {"x": x34}, options={"disable_ops": "SequenceInsert"})
    left = unclaimed_ops(s)
    assert left == {"SplitToSequence": 1, "SequenceErase": 2, "SequenceInsert": 1, "ConcatFromSequence": 1}, \
        assignment(s)
    assert "Neg" in assignment(s).get(EP, {})
    assert "must stay inside one MLX group" in _reasons("SplitToSequence")[0]


def _if_reading_sequence():
    """Branches read a sequence of the outer scope (SequenceAt), chosen by its length."""
    branch = lambda name, k: helper.make_graph(  # noqa: E731
        [helper.make_node("SequenceAt", ["s", f"k{name}"], [name])], name, [],
        [helper.make_tensor_value_info(name, T.FLOAT, None)], [onnx.numpy_helper.from_array(i64(k), f"k{name}")])
    nodes = [nd("SplitToSequence", ["x"], ["s"], axis=1), nd("SequenceLength", ["s"], ["n"]),
             nd("Greater", ["n", "two"], ["c"]),
             nd("If", ["c"], ["y"], then_branch=branch("t", 1), else_branch=branch("e", 0))]
    return make_model(nodes, [X34], [Y], {"two": i64(2)}, opset=18)


def test_sequence_read_inside_if_branch():
    """A body reading a sequence of the outer scope: the sequence stays inside the group holding the If."""
    s = _cpu_equal(_if_reading_sequence(), {"x": x34})
    assert not unclaimed_ops(s), assignment(s)


def test_sequence_read_inside_unclaimed_if_stays_on_cpu():
    """The If left to the CPU EP (disabled here) would make the sequence a fused output: its nodes are refused."""
    s = _cpu_equal(_if_reading_sequence(), {"x": x34}, options={"disable_ops": "If"})
    assert {"SplitToSequence", "SequenceLength", "If"} <= set(unclaimed_ops(s)), assignment(s)
    assert "used by a node outside its group" in _reasons("SplitToSequence")[0]


def test_sequence_groups_are_never_compiled():
    plain = make_model([nd("Neg", ["x"], ["y"])], [X34], [Y])
    with C.capture() as rs:
        session(plain, options={"tuning": "compile_mode=enabled"})
    assert rs, "control: a tensor-only group should get a compiled runner"
    model, feeds = build(insert_case(i64(1), erase=i64(0)))
    with C.capture() as rs:
        s = session(model, options={"tuning": "compile_mode=enabled"})
    assert not unclaimed_ops(s) and rs == [], (assignment(s), rs)
    cpu = session(model, "CPUExecutionProvider", record=False)
    for _ in range(2):
        for g, w in zip(s.run(None, feeds), cpu.run(None, feeds)):
            assert_close(g, w)


def test_concat_from_sequence_over_memory_cap_is_clear_error(monkeypatch):
    """A result larger than MLX may allocate is refused before evaluation, naming the node."""
    from ortmlx.kernels import interpreter
    model, feeds = build(concat_case({"axis": 0}, [(4, 4), (4, 4)], np.float32))
    s = session(model)
    monkeypatch.setattr(interpreter, "MAX_VALUE_BYTES", 100)
    with pytest.raises(Exception, match=r"ConcatFromSequence_y.*would take"):
        s.run(None, feeds)


# ---------------------------------------------------------------------------- SequenceMap
# A body runs once per element of input 0 (with the matching element of each additional sequence, each
# additional tensor whole); its outputs are collected into sequences. ORT's CPU EP runs the spec's function
# body (a Loop of SequenceLength(input 0) iterations doing SequenceAt on every sequence).
def tvi(name, t=T.FLOAT, shape=None):
    return helper.make_tensor_value_info(name, t, shape)


def body(nodes, inputs, outputs, inits=None):
    """A body graph; inputs/outputs are names (float tensors) or (name, elem type) pairs."""
    pair = lambda v: v if isinstance(v, tuple) else (v, T.FLOAT)  # noqa: E731
    return helper.make_graph(nodes, "smap_body", [tvi(*pair(i)) for i in inputs], [tvi(*pair(o)) for o in outputs],
                             [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])


def smap(ins, outs, b, name="SequenceMap_o"):
    return helper.make_node("SequenceMap", ins, outs, body=b, name=name)


RELU = body([helper.make_node("Relu", ["a"], ["r"])], ["a"], ["r"])
ADD = body([helper.make_node("Add", ["a", "b"], ["c"])], ["a", "b"], ["c"])
SPLIT_X = nd("SplitToSequence", ["x"], ["s"], axis=0)
SPLIT_Z = nd("SplitToSequence", ["z"], ["sz"], axis=0)
X24, Z = ("x", T.FLOAT, [2, 4]), ("z", T.FLOAT, None)
x24 = arr((2, 4), seed=11)


def cat(seq, out, axis=0, new_axis=0):
    return nd("ConcatFromSequence", [seq], [out], axis=axis, new_axis=new_axis)


def if_body():
    """A nested If: the branch follows the sign of the element's sum (its branches read the element)."""
    then_b = helper.make_graph([helper.make_node("Neg", ["a"], ["t"])], "then", [], [tvi("t")])
    else_b = helper.make_graph([helper.make_node("Mul", ["a", "a"], ["e"])], "else", [], [tvi("e")])
    return body([helper.make_node("ReduceSum", ["a"], ["sm"], keepdims=0), helper.make_node("Greater", ["sm", "zf"], ["c"]),
                 helper.make_node("If", ["c"], ["r"], then_branch=then_b, else_branch=else_b)], ["a"], ["r"],
                {"zf": np.float32(0)})


SMAP = {
    # the body per row, then the rows back together
    "relu": lambda: case([SPLIT_X, smap(["s"], ["o"], RELU), cat("o", "y"), nd("SequenceLength", ["o"], ["n"])],
                         [X34], [Y, ("n", T.INT64, [])], {"x": x34}),
    # an additional tensor passed whole to every iteration (broadcast against each row)
    "add_tensor": lambda: case([SPLIT_X, smap(["s", "t"], ["o"], ADD), cat("o", "y")],
                               [X34, ("t", T.FLOAT, [4])], [Y], {"x": x34, "t": arr((4,), seed=2)}),
    # two sequences of equal length, element by element
    "add_two_sequences": lambda: case([SPLIT_X, SPLIT_Z, smap(["s", "sz"], ["o"], ADD), cat("o", "y", 1)],
                                      [X34, Z], [Y], {"x": x34, "z": arr((3, 4), seed=3)}),
    # ORT reads only as many elements of an additional sequence as input 0 holds: extra ones are ignored
    "longer_additional_sequence": lambda: case([SPLIT_X, SPLIT_Z, smap(["s", "sz"], ["o"], ADD), cat("o", "y")],
                                               [X34, Z], [Y], {"x": x34, "z": arr((5, 4), seed=4)}),
    # two outputs: a float tensor and an int64 shape (host shape math inside the body)
    "two_outputs": lambda: case([nd("SplitToSequence", ["x", "sp"], ["s"], axis=1),
                                 smap(["s"], ["o", "sh"], body([helper.make_node("Relu", ["a"], ["r"]),
                                                                helper.make_node("Shape", ["a"], ["q"])],
                                                               ["a"], ["r", ("q", T.INT64)])),
                                 cat("o", "y", 1), cat("sh", "shapes", 0, 1)],
                                [X34], [Y, ("shapes", T.INT64, None)], {"x": x34}, inits={"sp": i64(1, 2, 1)}),
    # the body reads an outer value computed in the group and its own initializer
    "outer_and_body_constant": lambda: case(
        [nd("Neg", ["x"], ["w"]), SPLIT_X,
         smap(["s"], ["o"], body([helper.make_node("Mul", ["a", "w"], ["m"]), helper.make_node("Add", ["m", "k"], ["r"])],
                                 ["a"], ["r"], {"k": np.float32(0.5)})), cat("o", "y")],
        [X34], [Y], {"x": x34}),
    # uneven chunks: every iteration sees a different shape
    "uneven_chunks": lambda: case([nd("SplitToSequence", ["x", "sp"], ["s"], axis=0),
                                   smap(["s"], ["o"], body([helper.make_node("Transpose", ["a"], ["r"])], ["a"], ["r"])),
                                   cat("o", "y", 1)],
                                  [X34], [Y], {"x": x34}, inits={"sp": i64(2, 1)}),
    # a nested If in the body (its condition read on the host per element)
    "nested_if": lambda: case([SPLIT_X, smap(["s"], ["o"], if_body()), cat("o", "y")], [X34], [Y], {"x": x34}),
    # chained maps, then the second map's sequence is read back by SequenceAt
    "chained": lambda: case([SPLIT_X, smap(["s"], ["o1"], RELU, "SequenceMap_o1"),
                             smap(["o1", "t"], ["o2"], ADD, "SequenceMap_o2"), cat("o2", "y"),
                             nd("SequenceAt", ["o2", "last"], ["y2"])],
                            [X34, ("t", T.FLOAT, [1, 4])], [Y, ("y2", T.FLOAT, None)],
                            {"x": x34, "t": arr((1, 4), seed=5)}, inits={"last": i64(-1)}),
    # scalar host outputs (Size, and Shape -> ReduceProd) stay scalars in the output sequences
    "scalar_host_outputs": lambda: case([nd("SplitToSequence", ["x", "sp"], ["s"], axis=1),
                                         smap(["s"], ["o1", "o2"], body([helper.make_node("Size", ["a"], ["q"]),
                                                                         helper.make_node("Shape", ["a"], ["sh"]),
                                                                         helper.make_node("ReduceProd", ["sh"], ["p"],
                                                                                          keepdims=0)],
                                                                        ["a"], [("q", T.INT64), ("p", T.INT64)])),
                                         cat("o1", "y", 0, 1), cat("o2", "y2", 0, 1)],
                                        [X34], [("y", T.INT64, None), ("y2", T.INT64, None)], {"x": x34},
                                        inits={"sp": i64(3, 1)}),
    # sequences inside the body: each row split into pairs, reversed by SequenceInsert at 0, concatenated back
    "sequence_inside_body": lambda: case(
        [SPLIT_X, smap(["s"], ["o"], body([helper.make_node("SplitToSequence", ["a", "two"], ["p"], axis=1),
                                           helper.make_node("SequenceAt", ["p", "one"], ["p1"]),
                                           helper.make_node("SequenceErase", ["p", "one"], ["p0"]),
                                           helper.make_node("SequenceInsert", ["p0", "p1", "zero"], ["q"]),
                                           helper.make_node("ConcatFromSequence", ["q"], ["r"], axis=1)],
                                          ["a"], ["r"], {"two": i64(2), "one": i64(1), "zero": i64(0)})),
         cat("o", "y")], [X34], [Y], {"x": x34}),
    # mixed shapes from SequenceConstruct, the body extracts each shape
    "extract_shapes": lambda: case([nd("SequenceConstruct", ["x", "x2"], ["s"]),
                                    smap(["s"], ["o"], body([helper.make_node("Shape", ["a"], ["q"])], ["a"],
                                                            [("q", T.INT64)])), cat("o", "y", 0, 1)],
                                   [X34, ("x2", T.FLOAT, [2, 4])], [("y", T.INT64, None)],
                                   {"x": x34, "x2": x24}),
    # a body output that is its input (no node) and one that is the additional tensor
    "pass_through": lambda: case([SPLIT_X, smap(["s", "t"], ["o1", "o2"], body([], ["a", "b"], ["a", "b"])),
                                  cat("o1", "y"), cat("o2", "y2", 0, 1)],
                                 [X34, ("t", T.FLOAT, [2])], [Y, ("y2", T.FLOAT, None)],
                                 {"x": x34, "t": arr((2,), seed=6)}),
    # an empty input sequence: empty output sequences (SequenceLength 0)
    "empty": lambda: case([SPLIT_X, smap(["s", "t"], ["o"], ADD), nd("SequenceLength", ["o"], ["n"])],
                          [("x", T.FLOAT, [0, 4]), ("t", T.FLOAT, [4])], [("n", T.INT64, [])],
                          {"x": np.zeros((0, 4), np.float32), "t": arr((4,))}),
    # an empty input 0 with a non-empty additional sequence
    "empty_first_nonempty_additional": lambda: case(
        [SPLIT_X, SPLIT_Z, smap(["s", "sz"], ["o"], ADD), nd("SequenceLength", ["o"], ["n"])],
        [("x", T.FLOAT, [0, 4]), Z], [("n", T.INT64, [])], {"x": np.zeros((0, 4), np.float32), "z": arr((2, 4))}),
}


@pytest.mark.parametrize("opset", [17, 18, 21])
@pytest.mark.parametrize("name", list(SMAP))
def test_sequence_map(name, opset):
    nodes, inputs, outputs, feeds, _, inits = SMAP[name]()
    s = check_against_cpu(make_model(nodes, inputs, outputs, inits, opset=opset), [feeds])
    assert "SequenceMap" in assignment(s)[EP], assignment(s)


SMAP_TYPES = {"int32": (T.INT32, np.int32), "int64": (T.INT64, np.int64), "float16": (T.FLOAT16, np.float16),
              "float64": (T.DOUBLE, np.float64)}


@pytest.mark.parametrize("name", list(SMAP_TYPES))
def test_sequence_map_dtypes(name):
    et, t = SMAP_TYPES[name]
    b = body([helper.make_node("Mul", ["a", "b"], ["c"])], [("a", et), ("b", et)], [("c", et)])
    nodes = [nd("SequenceConstruct", ["x", "x2"], ["s"]), smap(["s", "t"], ["o"], b), cat("o", "y")]
    feeds = {"x": arr((2, 3), t), "x2": arr((1, 3), t, seed=1), "t": arr((3,), t, seed=2)}
    s = check_against_cpu(make_model(nodes, [("x", et, [2, 3]), ("x2", et, [1, 3]), ("t", et, [3])], [("y", et, None)],
                                     opset=18), [feeds])
    assert "SequenceMap" in assignment(s)[EP], assignment(s)


def test_sequence_map_shorter_additional_sequence_names_node():
    """Input 0 holds more elements than an additional sequence: ORT's SequenceAt fails; we name the node."""
    nodes, inputs, outputs, _, _, inits = SMAP["add_two_sequences"]()
    model = make_model(nodes, inputs, outputs, inits, opset=18)
    feeds = {"x": x34, "z": arr((2, 4), seed=3)}
    with pytest.raises(Exception):
        session(model, "CPUExecutionProvider", record=False).run(None, feeds)
    s = session(model)
    assert not unclaimed_ops(s), assignment(s)
    with pytest.raises(Exception, match=r"SequenceMap_o.*additional input 1 .* 2 tensor\(s\), shorter"):
        s.run(None, feeds)


def test_sequence_map_body_error_names_both_nodes():
    """A body node failing at run time (Reshape to a size the element does not have) names the map and the node."""
    b = body([helper.make_node("Reshape", ["a", "shp"], ["r"], name="body_reshape")], ["a"], ["r"],
             {"shp": i64(3, 3)})
    model = make_model([SPLIT_X, smap(["s"], ["o"], b), cat("o", "y")], [X34], [Y], opset=18)
    with pytest.raises(Exception):
        session(model, "CPUExecutionProvider", record=False).run(None, {"x": x34})
    s = session(model)
    assert not unclaimed_ops(s), assignment(s)
    with pytest.raises(Exception, match=r"SequenceMap_o.*body_reshape"):
        s.run(None, {"x": x34})


def _any_reason(op):
    """The reason a report of this session leaves ``op`` on the CPU EP (ORT inlines a refused SequenceMap into a
    Loop, so the newest reports no longer hold it)."""
    for rep in reversed(ortmlx.partition_reports()):
        for u in rep.unclaimed:
            if u.op == op:
                return u.reason
    raise AssertionError(f"no report leaves {op} on the CPU EP")


def test_sequence_map_graph_input_stays_on_cpu():
    model = make_model([smap(["s"], ["o"], RELU), cat("o", "y")], [seq_vi("s", T.FLOAT)], [Y], opset=18)
    s = _cpu_equal(model, {"s": [arr((2, 3)), arr((1, 3), seed=1)]})
    assert "SequenceMap" not in assignment(s).get(EP, {}), assignment(s)
    assert "graph input or output" in _any_reason("SequenceMap")


def test_sequence_map_graph_output_stays_on_cpu():
    model = make_model([SPLIT_X, smap(["s"], ["o"], RELU), cat("o", "y")], [X34], [Y, seq_vi("o", T.FLOAT)], opset=18)
    s = _cpu_equal(model, {"x": x34})
    assert "SequenceMap" not in assignment(s).get(EP, {}), assignment(s)
    assert "graph input or output" in _any_reason("SequenceMap")


def test_sequence_map_unclaimable_body_stays_on_cpu():
    """A body node MLX cannot take (Relu, disabled here) keeps the map, and the sequences around it, on the CPU EP."""
    model = make_model([nd("Neg", ["x"], ["x1"]), nd("SplitToSequence", ["x1"], ["s"], axis=0),
                        smap(["s"], ["o"], RELU), cat("o", "y")], [X34], [Y], opset=18)
    s = _cpu_equal(model, {"x": x34}, options={"disable_ops": "Relu"})
    assert "SequenceMap" not in assignment(s).get(EP, {}) and "Neg" in assignment(s)[EP], assignment(s)
    assert "body" in _any_reason("SequenceMap") and "disabled" in _any_reason("SequenceMap")


# ---------------------------------------------------------------------------- sequences inside control flow
def loop_body(nodes, inputs, outputs, inits=None):
    """A Loop body: (iteration, cond) then the carried values; inputs/outputs are (name, type proto or elem type)."""
    def v(n, t):
        return helper.make_value_info(n, t) if isinstance(t, onnx.TypeProto) else tvi(n, t, None)
    return helper.make_graph(nodes, "loop_body", [v(*i) for i in inputs], [v(*o) for o in outputs],
                             [onnx.numpy_helper.from_array(np.asarray(v_), k) for k, v_ in (inits or {}).items()])


SEQ_F = helper.make_sequence_type_proto(helper.make_tensor_type_proto(T.FLOAT, None))
LOOP_IO = [("i", helper.make_tensor_type_proto(T.INT64, [])), ("c", helper.make_tensor_type_proto(T.BOOL, []))]


def appending_loop(n_trip=3, scan=False):
    """SequenceEmpty -> Loop(M): each iteration appends x * i to the carried sequence (and keeps a running sum;
    with ``scan``, also scans out i * 2) -> ConcatFromSequence / SequenceLength."""
    b = loop_body([helper.make_node("Cast", ["i"], ["fi"], to=T.FLOAT), helper.make_node("Mul", ["x", "fi"], ["xi"]),
                   helper.make_node("SequenceInsert", ["sin", "xi"], ["sout"]),
                   helper.make_node("Add", ["acc", "xi"], ["acc2"]), helper.make_node("Identity", ["c"], ["co"])]
                  + ([helper.make_node("Add", ["i", "i"], ["i2"])] if scan else []),
                  LOOP_IO + [("sin", SEQ_F), ("acc", T.FLOAT)],
                  [("co", T.BOOL), ("sout", SEQ_F), ("acc2", T.FLOAT)] + ([("i2", T.INT64)] if scan else []))
    nodes = [nd("SequenceEmpty", [], ["s0"]),
             nd("Loop", ["M", "cond", "s0", "zero_f"], ["s", "sum"] + (["scan"] if scan else []), body=b),
             nd("SequenceLength", ["s"], ["n"]), nd("SequenceInsert", ["s", "x"], ["s_"]),
             nd("ConcatFromSequence", ["s_"], ["y"], axis=0)]
    outs = [Y, ("n", T.INT64, []), ("sum", T.FLOAT, None)] + ([("scan", T.INT64, None)] if scan else [])
    return make_model(nodes, [X34, ("M", T.INT64, [])], outs,
                      {"cond": np.array(True), "zero_f": np.zeros((3, 4), np.float32)}, opset=18)


@pytest.mark.parametrize("trip,scan", [(3, False), (0, False), (20, False), (2, True)],
                         ids=["three", "zero_iterations", "twenty", "with_scan_output"])
def test_loop_carried_sequence(trip, scan):
    run = check_against_cpu(appending_loop(scan=scan), [{"x": x34, "M": i64(trip)}])
    assert "Loop" in assignment(run)[EP], assignment(run)


def test_loop_reads_outer_sequence_and_stops_on_its_length():
    """The body reads an outer sequence (SequenceAt by iteration) and stops when the carried one is long enough."""
    b = loop_body([helper.make_node("SequenceAt", ["s", "i"], ["e"]), helper.make_node("Relu", ["e"], ["r"]),
                   helper.make_node("SequenceInsert", ["sin", "r"], ["sout"]),
                   helper.make_node("SequenceLength", ["sout"], ["ln"]), helper.make_node("Less", ["ln", "two"], ["co"])],
                  LOOP_IO + [("sin", SEQ_F)], [("co", T.BOOL), ("sout", SEQ_F)], {"two": i64(2)})
    nodes = [nd("SplitToSequence", ["x"], ["s"], axis=0), nd("SequenceEmpty", [], ["s0"]),
             nd("Loop", ["n", "cond", "s0"], ["o"], body=b), nd("SequenceLength", ["s"], ["n"]),
             nd("ConcatFromSequence", ["o"], ["y"], axis=0)]
    model = make_model(nodes, [X34], [Y], {"cond": np.array(True)}, opset=18)
    run = check_against_cpu(model, [{"x": x34}])
    assert "Loop" in assignment(run)[EP], assignment(run)


def test_sequence_map_inlined_by_ort_stays_on_cpu():
    """A SequenceMap left to ORT (disabled here) is inlined into the spec's function body (a Loop carrying
    sequences) only after the CPU EP took the nodes around it: everything stays on the CPU EP, right answers."""
    nodes, inputs, outputs, feeds, _, inits = SMAP["add_two_sequences"]()
    s = _cpu_equal(make_model(nodes, inputs, outputs, inits, opset=18), feeds, options={"disable_ops": "SequenceMap"})
    assert EP not in assignment(s), assignment(s)


def test_loop_carried_sequence_graph_output_stays_on_cpu():
    """A carried sequence that is a graph output keeps the Loop (and its producer) on the CPU EP."""
    model = appending_loop()
    model.graph.output.append(seq_vi("s", T.FLOAT))
    s = _cpu_equal(model, {"x": x34, "M": i64(2)})
    assert {"Loop", "SequenceEmpty"} <= set(unclaimed_ops(s)), assignment(s)
    assert "graph input or output" in _reasons("Loop")[0]


def test_loop_carried_optional_refused():
    """An optional carried value is not handled: the Loop stays on the CPU EP, with ORT's answer."""
    opt_t = helper.make_optional_type_proto(helper.make_tensor_type_proto(T.FLOAT, None))
    b = loop_body([helper.make_node("Identity", ["oin"], ["oout"]), helper.make_node("Identity", ["c"], ["co"])],
                  LOOP_IO + [("oin", opt_t)], [("co", T.BOOL), ("oout", opt_t)])
    nodes = [nd("Optional", ["x"], ["o0"]), nd("Loop", ["M", "", "o0"], ["o"], body=b),
             nd("OptionalGetElement", ["o"], ["y"])]
    model = make_model(nodes, [X34], [Y], {"M": i64(2)}, opset=18)
    s = _cpu_equal(model, {"x": x34})
    assert "Loop" in unclaimed_ops(s), assignment(s)
    assert "optional" in _any_reason("Loop")


def test_if_with_sequence_output_refused():
    """If takes no sequence outputs (its branches would return them): left to the CPU EP, with ORT's answer."""
    branch = lambda name, ax: helper.make_graph(  # noqa: E731
        [helper.make_node("SplitToSequence", ["x"], [name], axis=ax)], name, [], [helper.make_value_info(name, SEQ_F)])
    nodes = [nd("ReduceSum", ["x"], ["sm"], keepdims=0), nd("Greater", ["sm", "zf"], ["c"]),
             nd("If", ["c"], ["s"], then_branch=branch("t", 0), else_branch=branch("e", 1)),
             nd("ConcatFromSequence", ["s"], ["y"], axis=0, new_axis=1)]
    model = make_model(nodes, [X34], [Y], {"zf": np.float32(0)}, opset=18)
    s = _cpu_equal(model, {"x": x34})
    assert "If" in unclaimed_ops(s) and "ReduceSum" in assignment(s)[EP], assignment(s)
    assert "sequence" in _any_reason("If")


def test_optional_inside_loop_body():
    """An optional made and read inside a Loop body (never a body input or output) runs with the Loop on MLX."""
    b = loop_body([helper.make_node("Optional", ["x"], ["op"]), helper.make_node("OptionalGetElement", ["op"], ["g"]),
                   helper.make_node("OptionalHasElement", ["op"], ["hs"]), helper.make_node("Cast", ["hs"], ["hf"], to=T.FLOAT),
                   helper.make_node("Mul", ["g", "hf"], ["gm"]), helper.make_node("Add", ["acc", "gm"], ["acc2"]),
                   helper.make_node("Identity", ["c"], ["co"])],
                  LOOP_IO + [("acc", T.FLOAT)], [("co", T.BOOL), ("acc2", T.FLOAT)])
    model = make_model([nd("Loop", ["M", "", "zero_f"], ["y"], body=b)], [X34], [Y],
                       {"M": i64(3), "zero_f": np.zeros((3, 4), np.float32)}, opset=18)
    run = check_against_cpu(model, [{"x": x34}])
    assert "Loop" in assignment(run)[EP], assignment(run)


# ---------------------------------------------------------------------------- the ONNX suite's SequenceMap cases
SUITE_SMAP = ["identity_1_sequence", "identity_2_sequences", "identity_1_sequence_1_tensor", "add_2_sequences",
              "add_1_sequence_1_tensor", "extract_shapes"]


@pytest.fixture(scope="module")
def smap_suite():
    """The ONNX backend suite's SequenceMap cases (name -> TestCase), plain and expanded (a Loop carrying sequences)."""
    import warnings
    from onnx.backend.test.loader import load_model_tests
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # the suite's generators divide by zero on purpose
        return {c.name: c for c in load_model_tests(kind="node") if c.name.startswith("test_sequence_map")}


def inside(model, inputs):
    """The suite's graph with its sequences kept inside: every sequence input built by SequenceConstruct from one
    tensor input per element, every element of an output sequence read back by SequenceAt. Returns model, feeds."""
    g, nodes, tail, new_in, outs, feeds, inits = model.graph, [], [], [], [], {}, list(model.graph.initializer)
    n = 0
    for v, val in zip(g.input, inputs):
        if not v.type.HasField("sequence_type"):
            new_in.append(v)
            feeds[v.name] = np.asarray(val)
            continue
        et, n = v.type.sequence_type.elem_type.tensor_type.elem_type, len(val)
        names = [f"{v.name}_{k}" for k in range(n)]
        new_in += [tvi(e, et) for e in names]
        feeds.update(zip(names, val))
        nodes.append(helper.make_node("SequenceConstruct", names, [v.name]))
    for v in g.output:
        et = v.type.sequence_type.elem_type.tensor_type.elem_type
        for k in range(n):
            inits.append(onnx.numpy_helper.from_array(i64(k), f"{v.name}_at{k}"))
            tail.append(helper.make_node("SequenceAt", [v.name, f"{v.name}_at{k}"], [f"{v.name}_{k}"]))
            outs.append(tvi(f"{v.name}_{k}", et))
    graph = helper.make_graph(nodes + list(g.node) + tail, "inside", new_in, outs, inits)
    return helper.make_model(graph, opset_imports=model.opset_import, ir_version=10), feeds


@pytest.mark.parametrize("expanded", [False, True], ids=["node", "expanded_loop"])
@pytest.mark.parametrize("name", SUITE_SMAP)
def test_sequence_map_onnx_suite_inside(smap_suite, name, expanded):
    """The suite's own cases take sequence graph inputs/outputs (left to the CPU EP); with the sequences kept
    inside, SequenceMap (and the function body ORT would run: a Loop carrying sequences) is claimed whole."""
    c = smap_suite[f"test_sequence_map_{name}" + ("_expanded" if expanded else "")]
    model, feeds = inside(c.model, c.data_sets[0][0])
    s = check_against_cpu(model, [feeds])
    assert ("Loop" if expanded else "SequenceMap") in assignment(s)[EP], assignment(s)
