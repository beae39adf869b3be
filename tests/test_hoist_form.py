"""The hoisted integer work's closed NumPy form (``ortmlx/compiled/hoist_form.py``): the same values,
shapes and types as the generic host runner (``Program.host_runner``), on a table of programs; the
programs it does not cover get no form; the check switches a differing form off."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T

from ortmlx.compiled import core, hoist_form
from ortmlx.kernels.interpreter import Program
from ortmlx.ir import Graph, Node, ValueInfo

MASK = "attention_mask"


def _program(nodes, consts, types, outs, in_type=T.INT64):
    """A Program of ``nodes`` over one input ``attention_mask`` (``in_type``)."""
    values = {MASK: ValueInfo(MASK, in_type)}
    values.update({n: ValueInfo(n, t) for n, t in types.items()})
    values.update({n: ValueInfo(n, T.INT64 if v.dtype == np.int64 else T.INT32) for n, v in consts.items()})
    return Program(Graph(nodes, [MASK], outs, values, consts, "g"))


def _genai_mask(sub_const=np.array([1], np.int64), axes=np.array([1], np.int64), keepdims=0, index=np.array(1)):
    """genai's attention-mask reformat: total length (Shape, Gather, Cast) and seqlens_k (ReduceSum, Sub, Cast)."""
    nodes = [Node("shape", "Shape", "", 21, [MASK], ["s"], {"start": 0}),
             Node("gather", "Gather", "", 13, ["s", "idx"], ["g"], {"axis": 0}),
             Node("cast_g", "Cast", "", 21, ["g"], ["total"], {"saturate": 1, "to": T.INT32}),
             Node("sum", "ReduceSum", "", 13, [MASK, "axes"], ["r"], {"noop_with_empty_axes": 0, "keepdims": keepdims}),
             Node("sub", "Sub", "", 14, ["r", "one"], ["d"]),
             Node("cast_d", "Cast", "", 21, ["d"], ["seqlens"], {"saturate": 1, "to": T.INT32})]
    consts = {"idx": index, "axes": axes, "one": sub_const}
    types = {"s": T.INT64, "g": T.INT64, "total": T.INT32, "r": T.INT64, "d": T.INT64, "seqlens": T.INT32}
    return _program(nodes, consts, types, ["total", "seqlens"])


def _one(op, attrs, consts, out_type=T.INT64, in_type=T.INT64, extra=()):
    nodes = [Node("n", op, "", 14, [MASK, *extra], ["y"], attrs)]
    return _program(nodes, consts, {"y": out_type}, ["y"], in_type)


COVERED = {
    "genai mask": lambda: _genai_mask(),
    "genai mask keepdims": lambda: _genai_mask(keepdims=1),
    "index as [1]": lambda: _genai_mask(index=np.array([1])),
    "negative index": lambda: _genai_mask(index=np.array(-1)),
    "negative axis": lambda: _genai_mask(axes=np.array([-1], np.int64)),
    "scalar sub": lambda: _genai_mask(sub_const=np.array(3, np.int64)),
    "shape start/end": lambda: _one("Shape", {"start": 1, "end": 2}, {}),
    "add const": lambda: _one("Add", {}, {"c": np.array([[5]], np.int64)}, extra=["c"]),
    "cast int32 to int8 (wraps)": lambda: _one("Cast", {"to": T.INT8, "saturate": 1}, {}, T.INT8, T.INT32),
    "reduce both axes": lambda: _one("ReduceSum", {"keepdims": 1}, {"ax": np.array([0, 1], np.int64)},
                                     extra=["ax"]),
}

NOT_COVERED = {
    "Shape of a float input": lambda: _one("Shape", {}, {}, in_type=T.FLOAT),
    "Gather along axis 1": lambda: _program([Node("shape", "Shape", "", 21, [MASK], ["s"]),
                                             Node("g", "Gather", "", 13, ["s", "i"], ["y"], {"axis": 1})],
                                            {"i": np.array(0)}, {"s": T.INT64, "y": T.INT64}, ["y"]),
    "Sub with the constant first": lambda: _program([Node("n", "Sub", "", 14, ["c", MASK], ["y"])],
                                                    {"c": np.array([1], np.int64)}, {"y": T.INT64}, ["y"]),
    "Sub of two inputs": lambda: _program([Node("n", "Sub", "", 14, [MASK, MASK], ["y"])], {}, {"y": T.INT64}, ["y"]),
    "ReduceSum with empty axes as a no-op": lambda: _one("ReduceSum", {"noop_with_empty_axes": 1},
                                                         {"ax": np.array([1], np.int64)}, extra=["ax"]),
    "Mul (not in the table)": lambda: _one("Mul", {}, {"c": np.array([2], np.int64)}, extra=["c"]),
    "Cast to float": lambda: _one("Cast", {"to": T.FLOAT, "saturate": 1}, {}, T.FLOAT),
}

MASKS = [np.ones((1, 7), np.int64), np.array([[0, 0, 1, 1, 1]], np.int64), np.ones((2, 3), np.int64),
         np.ones((1, 1), np.int64)]


@pytest.mark.parametrize("case", sorted(COVERED))
def test_closed_form_equals_the_generic_runner(case):
    prog = COVERED[case]()
    generic = prog.host_runner(core._HOIST_HOST)
    fast = hoist_form.closed_form(prog)
    assert generic is not None and fast is not None
    in_type = np.int32 if "int32" in case else np.int64
    for m in MASKS:
        m = (m * 200).astype(in_type) if "wraps" in case else m.astype(in_type)
        want, got = generic([m]), fast([m])
        assert want is not None and got is not None
        for n in prog.outputs:
            w, g = np.asarray(want[n]), got[n]
            assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w), (case, n, g, w)


@pytest.mark.parametrize("case", sorted(NOT_COVERED))
def test_programs_outside_the_table_get_no_form(case):
    assert hoist_form.closed_form(NOT_COVERED[case]()) is None


def test_inputs_the_form_cannot_take_go_to_the_generic_runner():
    fast = hoist_form.closed_form(_genai_mask(index=np.array(5)))
    assert fast([np.ones((1, 7), np.int64)]) is None            # index 5 of a rank-2 shape: the build's error
    fast = hoist_form.closed_form(_genai_mask())
    assert fast([np.ones((1, 5000), np.int64)]) is None         # over HOST_MAX_ELEMS
    assert fast([np.ones((1, 5), np.float32)]) is None          # not integers
    assert fast([]) is None


def test_check_switches_a_differing_form_off():
    prog = _genai_mask()
    generic = prog.host_runner(core._HOIST_HOST)
    fast = hoist_form.closed_form(prog)
    said = []

    def wrong(inputs):
        env = fast(inputs)
        env["seqlens"] = env["seqlens"] + 1
        return env
    run = hoist_form.checked(wrong, generic, ["total", "seqlens"], said.append)
    m = np.ones((1, 6), np.int64)
    for _ in range(4):
        assert run([m])["seqlens"].tolist() == [5]                # the generic answer, always
    assert len(said) == 1 and "seqlens" in said[0]

    calls = []
    run = hoist_form.checked(lambda i: calls.append("fast") or fast(i), generic, ["total", "seqlens"], said.append)
    for _ in range(hoist_form.CHECK_CALLS + 3):
        assert run([m])["seqlens"].tolist() == [5]
    assert calls == ["fast"] * (hoist_form.CHECK_CALLS + 3) and len(said) == 1   # checked calls ran both
