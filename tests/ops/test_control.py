"""Control flow vs the CPU EP: If, Loop, Scan (bodies run as nested programs on MLX)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper as h

import ortmlx
from ortmlx import compiled
from ortmlx.testing import assignment, check_against_cpu, make_model, session, unclaimed_ops

F = T.FLOAT
vi = h.make_tensor_value_info
RNG = np.random.default_rng(7)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def graph(nodes, name, inputs, outputs, inits=None):
    """A body graph; inputs/outputs are (name, type, shape)."""
    return h.make_graph(nodes, name, [vi(*i) for i in inputs], [vi(*o) for o in outputs],
                        [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])


def reason_for(op: str) -> str:
    """The newest partition report's reason for leaving ``op`` on the CPU EP."""
    for rep in reversed(ortmlx.partition_reports()):
        for u in rep.unclaimed:
            if u.op == op:
                return u.reason
    raise AssertionError(f"no report leaves {op} on the CPU EP")


# ----------------------------------------------------------------------------- If

def if_outer_refs():
    """Branches read a value computed in the group (x), a graph input (y) and an initializer (w)."""
    then_b = graph([h.make_node("Add", ["x", "w"], ["t"])], "then", [], [("t", F, [2, 3])])
    else_b = graph([h.make_node("Mul", ["x", "y"], ["e"])], "else", [], [("e", F, [2, 3])])
    m = make_model([h.make_node("Relu", ["x0"], ["x"]),
                    h.make_node("If", ["c"], ["o"], then_branch=then_b, else_branch=else_b)],
                   [("c", T.BOOL, []), ("x0", F, [2, 3]), ("y", F, [2, 3])], [("o", F, [2, 3])],
                   initializers={"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, opset=16)
    return m, [{"c": np.array(c), "x0": f32(2, 3), "y": f32(2, 3)} for c in (True, False)]


def if_shapes_differ():
    """then: (2, 3); else: a reduction of shape (3,) plus a branch-local constant (If-11 allows it)."""
    then_b = graph([h.make_node("Identity", ["x"], ["t"]), h.make_node("Shape", ["x"], ["ts"])], "then", [],
                   [("t", F, None), ("ts", T.INT64, None)])
    else_b = graph([h.make_node("ReduceSum", ["x", "ax"], ["e"], keepdims=0), h.make_node("Shape", ["e"], ["es"])],
                   "else", [], [("e", F, None), ("es", T.INT64, None)], {"ax": np.array([0], np.int64)})
    m = make_model([h.make_node("If", ["c"], ["o", "s"], then_branch=then_b, else_branch=else_b)],
                   [("c", T.BOOL, [1]), ("x", F, [2, 3])], [("o", F, None), ("s", T.INT64, None)], opset=13)
    return m, [{"c": np.array([c]), "x": f32(2, 3)} for c in (True, False)]


def if_cond_on_device():
    """cond computed by claimed nodes (a host sync), result feeding further MLX ops."""
    then_b = graph([h.make_node("Sub", ["x", "one"], ["t"])], "then", [], [("t", F, [4])], {"one": np.float32(1)})
    else_b = graph([h.make_node("Neg", ["x"], ["e"])], "else", [], [("e", F, [4])])
    m = make_model([h.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
                    h.make_node("Greater", ["s", "zero"], ["c"]),
                    h.make_node("If", ["c"], ["o"], then_branch=then_b, else_branch=else_b),
                    h.make_node("Mul", ["o", "x"], ["z"])],
                   [("x", F, [4])], [("z", F, [4])], initializers={"zero": np.float32(0)}, opset=21)
    return m, [{"x": np.array([1, 2, -1, 0.5], np.float32)}, {"x": np.array([-1, -2, 1, 0.5], np.float32)}]


def if_nested():
    """An If inside a branch, its inner branches reading the outermost scope."""
    inner_t = graph([h.make_node("Add", ["x", "x"], ["it"])], "it", [], [("it", F, [3])])
    inner_e = graph([h.make_node("Abs", ["x"], ["ie"])], "ie", [], [("ie", F, [3])])
    then_b = graph([h.make_node("If", ["c2"], ["t"], then_branch=inner_t, else_branch=inner_e)], "then", [],
                   [("t", F, [3])])
    else_b = graph([h.make_node("Sigmoid", ["x"], ["e"])], "else", [], [("e", F, [3])])
    m = make_model([h.make_node("If", ["c1"], ["o"], then_branch=then_b, else_branch=else_b)],
                   [("c1", T.BOOL, []), ("c2", T.BOOL, []), ("x", F, [3])], [("o", F, [3])], opset=21)
    return m, [{"c1": np.array(a), "c2": np.array(b), "x": f32(3)} for a in (True, False) for b in (True, False)]


def if_passthrough():
    """One branch returns an outer value through Identity (ORT requires it), the other a branch constant."""
    then_b = graph([h.make_node("Identity", ["x"], ["t"])], "then", [], [("t", F, [2])])
    else_b = graph([], "else", [], [("k", F, [2])], {"k": np.array([5, 6], np.float32)})
    m = make_model([h.make_node("If", ["c"], ["o"], then_branch=then_b, else_branch=else_b)],
                   [("c", T.BOOL, []), ("x", F, [2])], [("o", F, [2])], opset=16)
    return m, [{"c": np.array(c), "x": f32(2)} for c in (True, False)]


def if_outer_ref_from_cpu_node():
    """A branch reads a value computed by a node left to the CPU EP (TopK sorted=0, refused) from a claimed
    one (Relu): the If must not share Relu's group (that would be a cycle through the CPU EP)."""
    then_b = graph([h.make_node("Add", ["p", "a"], ["t"])], "then", [], [("t", F, [1, 1, 4, 4])])
    else_b = graph([h.make_node("Sub", ["p", "a"], ["e"])], "else", [], [("e", F, [1, 1, 4, 4])])
    m = make_model([h.make_node("Relu", ["x"], ["a"]),
                    h.make_node("TopK", ["a", "k"], ["p", "pi"], axis=-1, sorted=0),
                    h.make_node("If", ["c"], ["o"], then_branch=then_b, else_branch=else_b)],
                   [("c", T.BOOL, []), ("x", F, [1, 1, 4, 4])], [("o", F, [1, 1, 4, 4])],
                   {"k": np.array([4], np.int64)}, opset=16)
    return m, [{"c": np.array(c), "x": f32(1, 1, 4, 4)} for c in (True, False)]


IF_CASES = {
    "passthrough": if_passthrough,
    "outer_refs": if_outer_refs,
    "shapes_differ": if_shapes_differ,
    "cond_on_device": if_cond_on_device,
    "nested": if_nested,
}


@pytest.mark.parametrize("case", list(IF_CASES))
def test_if(case):
    model, feeds = IF_CASES[case]()
    s = check_against_cpu(model, feeds)
    assert assignment(s)["MLXExecutionProvider"]["If"] == 1


def test_if_outer_ref_from_cpu_node():
    model, feeds = if_outer_ref_from_cpu_node()
    s = check_against_cpu(model, feeds, all_on_mlx=False)
    assert assignment(s)["MLXExecutionProvider"]["If"] == 1
    assert unclaimed_ops(s) == {"TopK": 1}
    rep = ortmlx.partition_reports()[-1]
    assert len(rep.groups) == 2, rep.format()


def test_if_result_feeds_one_group():
    """Relu -> If -> Neg is one fused group, and control flow keeps it off the compiled path."""
    model, feeds = if_outer_refs()
    g = model.graph
    g.node.append(h.make_node("Neg", ["o"], ["z"]))
    g.output[0].CopyFrom(vi("z", F, [2, 3]))
    with compiled.capture() as runners:
        check_against_cpu(model, feeds)
    rep = ortmlx.partition_reports()[-1]
    assert len(rep.groups) == 1 and rep.n_claimed == 3, rep.format()
    assert any("If" in s and "eagerly" in s for s in rep.syncs), rep.syncs
    bodies = [r for r in ortmlx.partition_reports()[-3:-1]]
    assert sorted(r.graph for r in bodies) == ["else", "then"]
    assert all(r.absorbed_by.startswith("If") and r.n_claimed == r.n_nodes and not r.unclaimed for r in bodies)
    assert runners == [], "a group with control flow must run eagerly, never traced"


def test_if_cond_with_two_elements_fails_like_cpu():
    model, _ = if_outer_refs()
    model.graph.input[0].CopyFrom(vi("c", T.BOOL, [2]))
    feeds = {"c": np.array([True, False]), "x0": f32(2, 3), "y": f32(2, 3)}
    with pytest.raises(Exception):
        session(model, "CPUExecutionProvider", record=False).run(None, feeds)
    s = session(model)
    assert not unclaimed_ops(s), assignment(s)
    with pytest.raises(Exception, match="If"):
        s.run(None, feeds)


# ----------------------------------------------------------------------------- Loop

def loop_model(m_in: str, c_in: str, cond_out, scan: bool = True, opset: int = 16, shape=(2,)):
    """Loop over x (``shape``, fed as (2,)): x += w each iteration; scan output x * i; body condition ``cond_out``.

    ``cond_out``: "pass" (Identity of the condition input) or "less" (sum(x) < lim).
    """
    nodes = [h.make_node("Add", ["x_in", "w"], ["x_out"]),
             h.make_node("Cast", ["i"], ["fi"], to=F),
             h.make_node("Mul", ["x_out", "fi"], ["sc"])]
    if cond_out == "pass":
        nodes.append(h.make_node("Identity", ["c_in"], ["c_out"]))
    else:
        nodes += [h.make_node("ReduceSum", ["x_out"], ["s"], keepdims=0), h.make_node("Less", ["s", "lim"], ["c_out"])]
    shape = list(shape)
    outs = [("c_out", T.BOOL, []), ("x_out", F, shape)] + ([("sc", F, shape)] if scan else [])
    body = graph(nodes, "body", [("i", T.INT64, []), ("c_in", T.BOOL, []), ("x_in", F, shape)], outs)
    node = h.make_node("Loop", [m_in, c_in, "x0"], ["y", "ys"] if scan else ["y"], body=body)
    ins = [("x0", F, shape), ("w", F, shape), ("lim", F, [])]
    ins += [("M", T.INT64, [])] if m_in else []
    ins += [("c", T.BOOL, [])] if c_in else []
    return make_model([node], ins, [("y", F, shape)] + ([("ys", F, None)] if scan else []), opset=opset)


def loop_feeds(pairs):
    out = []
    for m, c in pairs:
        f = {"x0": np.zeros(2, np.float32), "w": np.array([1, 2], np.float32), "lim": np.array(20, np.float32)}
        if m is not None:
            f["M"] = np.array(m, np.int64)
        if c is not None:
            f["c"] = np.array(c)
        out.append(f)
    return out


def loop_grow():
    """A loop-carried value that grows every iteration (Concat), reading an outer value."""
    body = graph([h.make_node("Concat", ["x_in", "w"], ["x_out"], axis=0),
                  h.make_node("Identity", ["c_in"], ["c_out"])], "body",
                 [("i", T.INT64, []), ("c_in", T.BOOL, []), ("x_in", F, None)],
                 [("c_out", T.BOOL, []), ("x_out", F, None)])
    m = make_model([h.make_node("Loop", ["M", "", "x0"], ["y"], body=body)],
                   [("M", T.INT64, []), ("x0", F, [1]), ("w", F, [2])], [("y", F, None)], opset=13)
    return m, [{"M": np.array(k, np.int64), "x0": f32(1), "w": f32(2)} for k in (0, 3)]


def loop_nested_if():
    """An If inside the loop body choosing by the iteration number's parity."""
    then_b = graph([h.make_node("Add", ["x_in", "w"], ["t"])], "then", [], [("t", F, [2])])
    else_b = graph([h.make_node("Sub", ["x_in", "w"], ["e"])], "else", [], [("e", F, [2])])
    body = graph([h.make_node("Mod", ["i", "two"], ["r"]), h.make_node("Equal", ["r", "zero"], ["even"]),
                  h.make_node("If", ["even"], ["x_out"], then_branch=then_b, else_branch=else_b),
                  h.make_node("Identity", ["c_in"], ["c_out"])], "body",
                 [("i", T.INT64, []), ("c_in", T.BOOL, []), ("x_in", F, [2])],
                 [("c_out", T.BOOL, []), ("x_out", F, [2])],
                 {"two": np.array(2, np.int64), "zero": np.array(0, np.int64)})
    m = make_model([h.make_node("Loop", ["M", "", "x0"], ["y"], body=body)],
                   [("M", T.INT64, []), ("x0", F, [2]), ("w", F, [2])], [("y", F, [2])], opset=21)
    return m, [{"M": np.array(5, np.int64), "x0": f32(2), "w": f32(2)}]


def loop_int_counter():
    """An int64 counter carried next to a float value, the trip count read from a shape (host math)."""
    body = graph([h.make_node("Add", ["n_in", "one"], ["n_out"]),
                  h.make_node("Cast", ["n_out"], ["fn"], to=F),
                  h.make_node("Mul", ["x_in", "fn"], ["x_out"]),
                  h.make_node("Identity", ["c_in"], ["c_out"])], "body",
                 [("i", T.INT64, []), ("c_in", T.BOOL, []), ("n_in", T.INT64, []), ("x_in", F, [3])],
                 [("c_out", T.BOOL, []), ("n_out", T.INT64, []), ("x_out", F, [3])], {"one": np.array(1, np.int64)})
    m = make_model([h.make_node("Shape", ["x"], ["sh"]),
                    h.make_node("ReduceProd", ["sh"], ["M"], keepdims=0),
                    h.make_node("Loop", ["M", "", "n0", "x"], ["n", "y"], body=body)],
                   [("n0", T.INT64, []), ("x", F, [3])], [("n", T.INT64, []), ("y", F, [3])], opset=16)
    return m, [{"n0": np.array(2, np.int64), "x": f32(3)}]


def loop_scan_inside():
    """A Scan inside the loop body: each iteration adds the running sums of the rows of w to x."""
    sbody = graph([h.make_node("Add", ["s_in", "r"], ["s_out"]), h.make_node("Identity", ["s_out"], ["y"])],
                  "sbody", [("s_in", F, [2]), ("r", F, [2])], [("s_out", F, [2]), ("y", F, [2])])
    body = graph([h.make_node("Scan", ["x_in", "w"], ["x_out", "rows"], body=sbody, num_scan_inputs=1),
                  h.make_node("Identity", ["c_in"], ["c_out"])], "body",
                 [("i", T.INT64, []), ("c_in", T.BOOL, []), ("x_in", F, [2])],
                 [("c_out", T.BOOL, []), ("x_out", F, [2]), ("rows", F, [3, 2])])
    m = make_model([h.make_node("Loop", ["M", "", "x0"], ["y", "ys"], body=body)],
                   [("M", T.INT64, []), ("x0", F, [2]), ("w", F, [3, 2])], [("y", F, [2]), ("ys", F, None)],
                   opset=16)
    return m, [{"M": np.array(3, np.int64), "x0": f32(2), "w": f32(3, 2)}]


def loop_dtypes():
    """int32 and float16 loop-carried values, a float16 scan output, a bool condition from int32 math."""
    body = graph([h.make_node("Add", ["n_in", "k"], ["n_out"]),
                  h.make_node("Mul", ["x_in", "half"], ["x_out"]),
                  h.make_node("Less", ["n_out", "stop"], ["c_out"])], "body",
                 [("i", T.INT64, []), ("c_in", T.BOOL, []), ("n_in", T.INT32, []), ("x_in", T.FLOAT16, [3])],
                 [("c_out", T.BOOL, []), ("n_out", T.INT32, []), ("x_out", T.FLOAT16, [3]), ("x_in", T.FLOAT16, [3])],
                 {"k": np.array(3, np.int32), "half": np.array(0.5, np.float16)})
    m = make_model([h.make_node("Loop", ["M", "c", "n0", "x0"], ["n", "y", "ys"], body=body)],
                   [("M", T.INT64, []), ("c", T.BOOL, []), ("n0", T.INT32, []), ("x0", T.FLOAT16, [3]),
                    ("stop", T.INT32, [])],
                   [("n", T.INT32, []), ("y", T.FLOAT16, [3]), ("ys", T.FLOAT16, None)], opset=16)
    return m, [{"M": np.array(10, np.int64), "c": np.array(True), "n0": np.array(1, np.int32),
                "x0": np.array([1, -3, 7], np.float16), "stop": np.array(s, np.int32)} for s in (11, 100)]


LOOP_CASES = {
    "int_counter": loop_int_counter,
    "dtypes": loop_dtypes,
    "scan_inside": loop_scan_inside,
    "trip_count_only": lambda: (loop_model("M", "", "pass"), loop_feeds([(4, None), (1, None)])),
    "cond_only": lambda: (loop_model("", "c", "less"), loop_feeds([(None, True)])),
    "trip_count_and_cond": lambda: (loop_model("M", "c", "less"), loop_feeds([(3, True), (50, True)])),
    "carried_only": lambda: (loop_model("M", "c", "less", scan=False), loop_feeds([(5, True)])),
    "zero_iterations_trip": lambda: (loop_model("M", "c", "less"), loop_feeds([(0, True), (-2, True)])),
    "zero_iterations_cond": lambda: (loop_model("M", "c", "less"), loop_feeds([(5, False)])),
    # ORT's empty scan output takes symbolic dims as 0: (0, 0), not (0, 2)
    "zero_iterations_symbolic": lambda: (loop_model("M", "", "pass", shape=("N",)), loop_feeds([(0, None), (2, None)])),
    "opset11": lambda: (loop_model("M", "c", "less", opset=11), loop_feeds([(4, True)])),
    "grows": loop_grow,
    "nested_if": loop_nested_if,
}


@pytest.mark.parametrize("case", list(LOOP_CASES))
def test_loop(case):
    model, feeds = LOOP_CASES[case]()
    s = check_against_cpu(model, feeds)
    assert assignment(s)["MLXExecutionProvider"]["Loop"] == 1


# ----------------------------------------------------------------------------- Scan

def scan_model(n_state=1, n_scan=1, opset=16, **attrs):
    """Scan: states s_k += x_k slice (summed over its last axis when ranks differ), scan outputs s_k * 2."""
    nodes, b_in, b_out, scan_out = [], [], [], []
    for k in range(n_state):
        b_in.append((f"s{k}_in", F, [3]))
    for k in range(n_scan):
        b_in.append((f"x{k}", F, [3]))
    for k in range(n_state):
        nodes.append(h.make_node("Add", [f"s{k}_in", f"x{k % n_scan}"], [f"s{k}_out"]))
        b_out.append((f"s{k}_out", F, [3]))
    for k in range(n_state):
        nodes.append(h.make_node("Mul", [f"s{k}_out", "two"], [f"y{k}"]))
        scan_out.append((f"y{k}", F, [3]))
    body = graph(nodes, "body", b_in, b_out + scan_out, {"two": np.float32(2)})
    ins = [f"s{k}" for k in range(n_state)] + [f"xs{k}" for k in range(n_scan)]
    outs = [f"sf{k}" for k in range(n_state)] + [f"ys{k}" for k in range(n_state)]
    node = h.make_node("Scan", ins, outs, body=body, num_scan_inputs=n_scan, **attrs)
    axes = attrs.get("scan_input_axes", [0] * n_scan)
    shapes = [[4, 3] if a in (0, -2) else [3, 4] for a in axes]
    m = make_model([node], [(f"s{k}", F, [3]) for k in range(n_state)] + [(f"xs{k}", F, s) for k, s in
                                                                            enumerate(shapes)],
                   [(o, F, None) for o in outs], opset=opset)
    feeds = {**{f"s{k}": f32(3) for k in range(n_state)}, **{f"xs{k}": f32(*s) for k, s in enumerate(shapes)}}
    return m, [feeds]


def scan_scalar_host_output():
    """Scan outputs computed on the host per slice: Size (0-d) and Shape (1-d) stack to (n,) and (n, 1)."""
    body = graph([h.make_node("Add", ["s_in", "x"], ["s_out"]), h.make_node("Size", ["x"], ["n"]),
                  h.make_node("Shape", ["x"], ["sh"])], "body",
                 [("s_in", F, [3]), ("x", F, [3])], [("s_out", F, [3]), ("n", T.INT64, []), ("sh", T.INT64, [1])])
    node = h.make_node("Scan", ["s", "xs"], ["sf", "ns", "shs"], body=body, num_scan_inputs=1)
    m = make_model([node], [("s", F, [3]), ("xs", F, [4, 3])],
                   [("sf", F, None), ("ns", T.INT64, None), ("shs", T.INT64, None)], opset=16)
    return m, [{"s": f32(3), "xs": f32(4, 3)}]


SCAN_CASES = {
    "sum": lambda: scan_model(),
    "scalar_host_output": scan_scalar_host_output,
    "opset9": lambda: scan_model(opset=9),
    "input_axis_reverse": lambda: scan_model(scan_input_axes=[1], scan_input_directions=[1]),
    "output_axis_reverse": lambda: scan_model(scan_output_axes=[1], scan_output_directions=[1]),
    "negative_axes": lambda: scan_model(n_state=2, n_scan=2, scan_input_axes=[-1, 0], scan_output_axes=[-1, -2],
                                        scan_input_directions=[0, 1], scan_output_directions=[1, 0]),
    "two_states": lambda: scan_model(n_state=2, n_scan=1, opset=11),
}


@pytest.mark.parametrize("case", list(SCAN_CASES))
def test_scan(case):
    model, feeds = SCAN_CASES[case]()
    s = check_against_cpu(model, feeds)
    assert assignment(s)["MLXExecutionProvider"]["Scan"] == 1


def test_scan_zero_length_fails_like_cpu():
    model, feeds = scan_model()
    model.graph.input[1].CopyFrom(vi("xs0", F, ["L", 3]))
    feeds = {"s0": f32(3), "xs0": np.zeros((0, 3), np.float32)}
    with pytest.raises(Exception):
        session(model, "CPUExecutionProvider", record=False).run(None, feeds)
    s = session(model)
    assert not unclaimed_ops(s), assignment(s)
    with pytest.raises(Exception, match="Scan"):
        s.run(None, feeds)


# ----------------------------------------------------------------------------- refused

def if_unsupported_body_op():
    """MaxRoiPool reads its rois on the host; inside a body they are a device value, so the If stays on the CPU EP."""
    then_b = graph([h.make_node("MaxRoiPool", ["x", "rois"], ["t"], pooled_shape=[2, 2])], "then", [],
                   [("t", F, [1, 1, 2, 2])])
    else_b = graph([h.make_node("MaxPool", ["x"], ["e"], kernel_shape=[2, 2], strides=[2, 2])], "else", [],
                   [("e", F, [1, 1, 2, 2])])
    m = make_model([h.make_node("If", ["c"], ["o"], then_branch=then_b, else_branch=else_b)],
                   [("c", T.BOOL, []), ("x", F, [1, 1, 4, 4]), ("rois", F, [1, 5])], [("o", F, [1, 1, 2, 2])],
                   opset=16)
    rois = np.array([[0, 0, 0, 3, 3]], np.float32)
    return m, [{"c": np.array(c), "x": f32(1, 1, 4, 4), "rois": rois} for c in (True, False)], \
        "then_branch body: MaxRoiPool"


def scan_opset8():
    """Opset-8 Scan (batch axis, sequence_lens) has no translator."""
    body = graph([h.make_node("Add", ["s_in", "x"], ["s_out"]), h.make_node("Identity", ["s_out"], ["y"])], "body",
                 [("s_in", F, [2]), ("x", F, [2])], [("s_out", F, [2]), ("y", F, [2])])
    m = make_model([h.make_node("Scan", ["", "s", "xs"], ["sf", "ys"], body=body, num_scan_inputs=1)],
                   [("s", F, [1, 2]), ("xs", F, [1, 3, 2])], [("sf", F, [1, 2]), ("ys", F, [1, 3, 2])], opset=8)
    return m, [{"s": f32(1, 2), "xs": f32(1, 3, 2)}], "since_version 8"


def scan_unknown_rank_axis():
    """scan_input_axes on an input of unknown rank: the axis cannot be checked at claim time."""
    m, feeds = scan_model(scan_input_axes=[1])
    m.graph.input[1].CopyFrom(h.make_tensor_value_info("xs0", F, None))
    return m, feeds, "unknown rank"


def loop_scan_output_unknown_rank():
    """A scan output of unknown rank (a Reshape to a shape of unknown length): a zero-iteration loop's
    output shape cannot be known."""
    body = graph([h.make_node("Add", ["x_in", "w"], ["x_out"]), h.make_node("Reshape", ["x_out", "shp"], ["sc"]),
                  h.make_node("Identity", ["c_in"], ["c_out"])], "body",
                 [("i", T.INT64, []), ("c_in", T.BOOL, []), ("x_in", F, [2])],
                 [("c_out", T.BOOL, []), ("x_out", F, [2]), ("sc", F, None)])
    m = make_model([h.make_node("Loop", ["M", "", "x0"], ["y", "ys"], body=body)],
                   [("M", T.INT64, []), ("x0", F, [2]), ("w", F, [2]), ("shp", T.INT64, ["K"])],
                   [("y", F, [2]), ("ys", F, None)], opset=16)
    feeds = [{"M": np.array(k, np.int64), "x0": f32(2), "w": f32(2), "shp": np.array([1, 2], np.int64)}
             for k in (0, 2)]
    return m, feeds, "unknown rank"


REFUSED = {
    "scan_unknown_rank_axis": scan_unknown_rank_axis,
    "loop_scan_output_unknown_rank": loop_scan_output_unknown_rank,
    "if_unsupported_body_op": if_unsupported_body_op,
    "loop_cond_omitted_body_computes_it": lambda: (loop_model("M", "", "less"), loop_feeds([(5, None)]),
                                                   "cond input omitted"),
    "loop_no_trip_count_no_cond": lambda: (loop_model("", "", "less"), loop_feeds([(None, None)]),
                                           "neither trip count M nor cond"),
    "scan_opset8": scan_opset8,
    # cond False: ORT runs no iteration; with cond True it would never end on either EP
    "loop_never_ends": lambda: (loop_model("", "c", "pass"), loop_feeds([(None, False)]), "never ends"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused(case):
    """The control-flow node stays on the CPU EP with a reason, and the session answers like the CPU EP."""
    model, feeds, why = REFUSED[case]()
    op = model.graph.node[0].op_type
    s = session(model)
    assert op in unclaimed_ops(s), assignment(s)
    assert why in reason_for(op)
    cpu = session(model, "CPUExecutionProvider", record=False)
    for f in feeds:
        for g, w in zip(s.run(None, f), cpu.run(None, f)):
            np.testing.assert_array_equal(g, w)


def test_body_error_names_both_nodes():
    """A body node failing at run time (a Reshape to a shape the data cannot take) names the Loop and the node."""
    body = graph([h.make_node("Reshape", ["x_in", "shp"], ["x_out"], name="bad_reshape"),
                  h.make_node("Identity", ["c_in"], ["c_out"])], "body",
                 [("i", T.INT64, []), ("c_in", T.BOOL, []), ("x_in", F, None)],
                 [("c_out", T.BOOL, []), ("x_out", F, None)])
    m = make_model([h.make_node("Loop", ["M", "", "x0"], ["y"], body=body, name="the_loop")],
                   [("M", T.INT64, []), ("x0", F, [6]), ("shp", T.INT64, [2])], [("y", F, None)], opset=16)
    feeds = {"M": np.array(2, np.int64), "x0": f32(6), "shp": np.array([4, 2], np.int64)}
    with pytest.raises(Exception):
        session(m, "CPUExecutionProvider", record=False).run(None, feeds)
    s = session(m)
    assert not unclaimed_ops(s), assignment(s)
    with pytest.raises(Exception, match="the_loop.*bad_reshape"):
        s.run(None, feeds)
