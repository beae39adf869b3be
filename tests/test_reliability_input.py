"""Issue 5, bad input: a clear error or the right answer, never a crash, hang or garbage."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from ortmlx.testing import assert_close, make_model, session, unclaimed_ops


def both(m):
    return session(m), session(m, "CPUExecutionProvider", record=False)


def same(m, feeds_list, all_on_mlx=True):
    s, c = both(m)
    if all_on_mlx:
        assert not unclaimed_ops(s), unclaimed_ops(s)
    for feeds in feeds_list:
        for g, w in zip(s.run(None, feeds), c.run(None, feeds)):
            assert_close(g, w, what=str({k: v.shape for k, v in feeds.items()}))
    return s


def add_relu(decl_a, decl_b, t=T.FLOAT):
    nodes = [h.make_node("Add", ["A", "B"], ["S"], name="add"), h.make_node("Relu", ["S"], ["Y"], name="relu")]
    return make_model(nodes, [h.make_tensor_value_info("A", t, decl_a), h.make_tensor_value_info("B", t, decl_b)],
                      [h.make_tensor_value_info("Y", t, None)])


def f32(*shape, lo=-2, hi=2, seed=0):
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32)


def test_dynamic_rank_inputs_every_rank_and_broadcast():
    m = add_relu(None, None)                         # no shape at all: rank unknown until run time
    cases = [((2, 3), (3,)), ((), ()), ((4,), ()), ((1, 1, 1, 1, 1, 1, 1, 1), (2,) * 8), ((3, 1, 2), (1, 4, 1)),
             ((2, 3), (2, 3))]
    same(m, [{"A": f32(*a), "B": f32(*b, seed=1)} for a, b in cases])


def test_symbolic_dims_change_between_runs():
    m = add_relu(["n", "k"], ["k"])
    same(m, [{"A": f32(n, k), "B": f32(k, seed=2)} for n, k in [(1, 1), (5, 3), (2, 7), (1, 3)]])


@pytest.mark.parametrize("a,b", [((0,), (0,)), ((0, 3), (1, 3)), ((2, 0, 4), (4,)), ((0,), (1,)), ((3, 0), (3, 1))])
def test_empty_tensors_and_zero_size_dims(a, b):
    same(add_relu(None, None), [{"A": f32(*a), "B": f32(*b)}])


def test_zero_size_through_a_whole_group_with_constants():
    nodes = [h.make_node("Mul", ["X", "W"], ["a"]), h.make_node("Add", ["a", "W"], ["b"]),
             h.make_node("Transpose", ["b"], ["Y"], perm=[1, 0])]
    m = make_model(nodes, [("X", T.FLOAT, ["n", 4])], [("Y", T.FLOAT, [4, "n"])],
                   initializers={"W": np.arange(4, dtype=np.float32)})
    same(m, [{"X": f32(0, 4)}, {"X": f32(3, 4)}, {"X": f32(0, 4)}])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_inf_and_signed_zero_propagate_like_cpu(dtype):
    t = {np.float32: T.FLOAT, np.float64: T.DOUBLE}[dtype]
    nodes = [h.make_node("Mul", ["A", "B"], ["m"]), h.make_node("Add", ["m", "A"], ["s"]),
             h.make_node("Relu", ["s"], ["r"]), h.make_node("Max", ["r", "B"], ["Y"]),
             h.make_node("Div", ["A", "B"], ["Q"])]
    m = make_model(nodes, [("A", t, [8]), ("B", t, [8])], [("Y", t, [8]), ("Q", t, [8]), ("s", t, [8])])
    a = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, np.inf, 3.0], dtype)
    b = np.array([1.0, 0.0, 2.0, np.nan, -np.inf, 0.0, -np.inf, -0.0], dtype)
    s = same(m, [{"A": a, "B": b}, {"A": b, "B": a}])
    q = s.run(None, {"A": a, "B": b})[1]
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(np.signbit(q), np.signbit(a / b))      # -0.0 and signed infinities kept


def test_unsupported_dtype_stays_on_cpu_with_reason_and_right_answer():
    """A string tensor: MLX cannot hold it, so Shape of it stays on the CPU EP, with the reason."""
    nodes = [h.make_node("Shape", ["S"], ["shp"], name="shape_of_strings"),
             h.make_node("Add", ["shp", "shp"], ["Y"], name="add_ints")]
    m = make_model(nodes, [("S", T.STRING, ["n", 2])], [("Y", T.INT64, [2])])
    s, c = both(m)
    from ortmlx import partition_reports
    rep = partition_reports()[-1]
    reasons = {u.node: u.reason for u in rep.unclaimed}
    assert "shape_of_strings" in reasons and "string" in reasons["shape_of_strings"]
    feeds = {"S": np.array([["a", "b"], ["c", "d"], ["e", "f"]], dtype=object)}
    np.testing.assert_array_equal(s.run(None, feeds)[0], c.run(None, feeds)[0])
    np.testing.assert_array_equal(s.run(None, feeds)[0], [6, 4])


def test_runtime_rank_and_dtype_differing_from_the_graph_are_clear_errors():
    s = session(add_relu([2, 3], [3]))
    good = {"A": f32(2, 3), "B": f32(3)}
    with pytest.raises(Exception, match="(?i)rank|dimension|shape"):
        s.run(None, {"A": f32(2, 3, 1), "B": f32(3)})
    with pytest.raises(Exception, match="(?i)type"):
        s.run(None, {"A": f32(2, 3).astype(np.float64), "B": f32(3)})
    with pytest.raises(Exception, match="(?i)dimension|shape"):
        s.run(None, {"A": f32(2, 4), "B": f32(3)})
    assert_close(s.run(None, good)[0], np.maximum(good["A"] + good["B"], 0))


def test_rank_above_the_abi_limit_is_a_clear_error():
    s = session(add_relu(None, None))
    a = np.ones((1,) * 17, np.float32)
    with pytest.raises(Exception, match="rank"):
        s.run(None, {"A": a, "B": a})
    assert_close(s.run(None, {"A": f32(2), "B": f32(2)})[0], np.maximum(f32(2) * 2, 0))


def test_integer_edge_values_match_cpu():
    nodes = [h.make_node("Add", ["A", "B"], ["s"]), h.make_node("Sub", ["A", "B"], ["d"]),
             h.make_node("Mul", ["A", "B"], ["p"]), h.make_node("Div", ["A", "C"], ["q"]),
             h.make_node("Mod", ["A", "C"], ["r"])]
    for t, npt in ((T.INT32, np.int32), (T.INT64, np.int64)):
        m = make_model(nodes, [("A", t, [6]), ("B", t, [6]), ("C", t, [6])],
                       [(o, t, [6]) for o in "sdpqr"])
        info = np.iinfo(npt)
        a = np.array([info.max, info.min, -7, 7, -1, 0], npt)
        b = np.array([1, -1, 3, -3, info.max, info.min], npt)      # wraps around like the CPU EP
        c = np.array([2, 3, -2, 2, 7, -5], npt)
        s = same(m, [{"A": a, "B": b, "C": c}], all_on_mlx=False)
        assert not {"Add", "Sub", "Mul"} & set(unclaimed_ops(s)), unclaimed_ops(s)   # Div/Mod: owner's call


HUGE = textwrap.dedent("""
    import numpy as np
    from onnx import TensorProto as T, helper as h
    from ortmlx.testing import make_model, session
    nodes = [h.make_node("Add", ["A", "B"], ["S"], name="huge_add"), h.make_node("Relu", ["S"], ["Y"])]
    m = make_model(nodes, [("A", T.FLOAT, ["n", 1]), ("B", T.FLOAT, [1, "m"])], [("Y", T.FLOAT, ["n", "m"])])
    s = session(m)
    for k in range(1, 12):           # warm: the compiled path has traced and trusts a closure by now
        s.run(None, {"A": np.ones((k, 1), np.float32), "B": np.ones((1, k + 1), np.float32)})
    n = 300_000                      # 300k x 300k float32: 335 GiB
    try:
        s.run(None, {"A": np.ones((n, 1), np.float32), "B": np.ones((1, n), np.float32)})
        print("NO ERROR")
    except Exception as e:
        print("ERROR:", str(e).splitlines()[0][:2000])
    y = s.run(None, {"A": np.ones((2, 1), np.float32), "B": np.ones((1, 3), np.float32)})[0]
    print("AFTER:", y.tolist())
""")


def test_huge_shape_is_a_clear_error_not_a_crash():
    """MLX's CPU allocator segfaults when malloc fails; the interpreter refuses oversized values first."""
    out = subprocess.run([sys.executable, "-c", HUGE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR:" in out.stdout and "huge_add" in out.stdout and "GiB" in out.stdout, out.stdout
    assert "AFTER: [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]" in out.stdout
