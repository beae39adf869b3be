"""The plugin EP itself: registration, options, partitioning, errors, threads, exit."""
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import ortmlx
from ortmlx.testing import assignment, check_against_cpu, make_model, session


def chain_model():
    """X -> Add -> Mul -> Relu -> Y, with a side branch Add -> Sub -> Mul (leave/re-enter shape)."""
    nodes = [h.make_node("Add", ["X", "X"], ["a"], name="add"),
             h.make_node("Sub", ["a", "X"], ["s"], name="sub"),
             h.make_node("Mul", ["a", "s"], ["m"], name="mul"),
             h.make_node("Relu", ["m"], ["Y"], name="relu")]
    return make_model(nodes, [("X", T.FLOAT, ["N", 4])], [("Y", T.FLOAT, ["N", 4])])


def test_register_is_idempotent_and_returns_the_library():
    p1 = ortmlx.register(genai=False)
    p2 = ortmlx.register(genai=False)
    assert p1 == p2 and os.path.exists(p1)
    assert "MLXExecutionProvider" in {d.ep_name for d in ort.get_ep_devices()}


def test_providers_and_cpu_device_metadata():
    s = session(chain_model())
    assert s.get_providers() == ["MLXExecutionProvider", "CPUExecutionProvider"]
    kinds = {d.ep_metadata.get("mlx_device") for d in ort.get_ep_devices() if d.ep_name == "MLXExecutionProvider"}
    assert "cpu" in kinds


def test_device_cpu_option():
    check_against_cpu(chain_model(), [{"X": np.ones((2, 4), np.float32)}], options={"device": "cpu"})
    assert ortmlx.partition_reports()[-1].device == "cpu"


def test_partition_splits_where_a_path_leaves_and_reenters():
    """Sub stays on CPU: {add} and {mul, relu} must be separate groups, and the answer right."""
    model = chain_model()
    s = check_against_cpu(model, [{"X": np.arange(8, dtype=np.float32).reshape(2, 4) - 3}],
                          all_on_mlx=False, options={"disable_ops": "Sub"})
    rep = ortmlx.partition_reports()[-1]
    assert [u.op for u in rep.unclaimed] == ["Sub"]
    assert "disabled" in rep.unclaimed[0].reason
    assert len(rep.groups) == 2 and sorted(map(len, rep.groups)) == [1, 2]
    a = assignment(s)
    assert a["CPUExecutionProvider"]["Sub"] == 1 and a["MLXExecutionProvider"]["Mul"] == 1


def test_report_names_unsupported_ops_and_dtypes():
    nodes = [h.make_node("Add", ["X", "X"], ["a"], name="add"),
             h.make_node("Cast", ["a"], ["c"], to=T.STRING, name="to_string"),
             h.make_node("Cast", ["c"], ["Y"], to=T.FLOAT, name="back")]
    model = make_model(nodes, [("X", T.FLOAT, [2])], [("Y", T.FLOAT, [2])])
    check_against_cpu(model, [{"X": np.array([1.5, -2], np.float32)}], all_on_mlx=False)
    rep = ortmlx.partition_reports()[-1]
    names = {u.node: u.reason for u in rep.unclaimed}
    assert set(names) == {"to_string", "back"}
    assert all("string" in r for r in names.values()), names


def test_cli_check_prints_the_report(tmp_path):
    p = tmp_path / "m.onnx"
    p.write_bytes(chain_model().SerializeToString())
    out = subprocess.run([sys.executable, "-m", "ortmlx", "check", str(p)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "4/4 nodes on MLX" in out.stdout


def test_error_in_compute_names_node_and_session_survives():
    s = session(chain_model(), options={"tuning": "fault=compute"})
    with pytest.raises(Exception) as ei:
        s.run(None, {"X": np.ones((1, 4), np.float32)})
    msg = str(ei.value)
    assert "MLXExecutionProvider" in msg and "injected fault" in msg and "node" in msg
    good = session(chain_model())
    np.testing.assert_allclose(good.run(None, {"X": np.ones((1, 4), np.float32)})[0], np.full((1, 4), 2.0))


def test_runtime_dtype_mismatch_is_a_clear_error():
    nodes = [h.make_node("Add", ["X", "X"], ["Y"], name="add")]
    model = make_model(nodes, [("X", T.FLOAT, [2])], [("Y", T.FLOAT, [2])])
    s = session(model)
    with pytest.raises(Exception, match="INVALID_ARGUMENT|Unexpected input data type"):
        s.run(None, {"X": np.ones(2, np.int64)})
    np.testing.assert_array_equal(s.run(None, {"X": np.ones(2, np.float32)})[0], [2, 2])


def test_eight_threads_two_hundred_runs_identical():
    s = session(chain_model(), record=False)
    cpu = session(chain_model(), "CPUExecutionProvider", record=False)
    xs = [np.random.default_rng(i).standard_normal((3, 4)).astype(np.float32) for i in range(8)]
    want = [cpu.run(None, {"X": x})[0] for x in xs]
    bad = []

    def work(i):
        for _ in range(200):
            got = s.run(None, {"X": xs[i]})[0]
            if not np.array_equal(got, want[i]):
                bad.append(i)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in ts)
    assert bad == []


def test_ort_parallel_execution_mode():
    nodes = [h.make_node("Add", ["X", "X"], ["a"]), h.make_node("Mul", ["X", "X"], ["b"]),
             h.make_node("Sub", ["a", "b"], ["c"]), h.make_node("Relu", ["c"], ["Y"])]
    model = make_model(nodes, [("X", T.FLOAT, ["N", 4])], [("Y", T.FLOAT, ["N", 4])])
    so = ort.SessionOptions()
    so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    so.inter_op_num_threads = 4
    s = session(model, options={"disable_ops": "Mul"}, sess_options=so)
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    want = np.maximum(2 * x - x * x, 0)
    for _ in range(50):
        np.testing.assert_allclose(s.run(None, {"X": x})[0], want, rtol=1e-6)


def test_interpreter_exit_after_worker_threads_is_clean(tmp_path):
    p = tmp_path / "m.onnx"
    p.write_bytes(chain_model().SerializeToString())
    code = textwrap.dedent(f"""
        import threading, numpy as np, onnxruntime as ort, ortmlx
        ortmlx.register(genai=False)
        s = ort.InferenceSession({str(p)!r}, providers=["MLXExecutionProvider"])
        def work():
            for _ in range(20):
                s.run(None, {{"X": np.ones((2, 4), np.float32)}})
        ts = [threading.Thread(target=work) for _ in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
        print("done")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "done"


def test_control_flow_bodies_stay_on_ort_and_answer_right():
    """Nodes inside If/Loop bodies are never fused alone (ORT rejects fused nodes in some inlined bodies):
    with the If itself left to the CPU EP (disable_ops), its supported body nodes stay there too."""
    then_g = h.make_graph([h.make_node("Add", ["X", "X"], ["t"], name="then_add"), h.make_node("Relu", ["t"], ["o"])],
                          "then", [], [h.make_tensor_value_info("o", T.FLOAT, [2])])
    else_g = h.make_graph([h.make_node("Mul", ["X", "X"], ["o2"], name="else_mul")], "else", [],
                          [h.make_tensor_value_info("o2", T.FLOAT, [2])])
    nodes = [h.make_node("ReduceSum", ["X"], ["s"], keepdims=0), h.make_node("Greater", ["s", "z"], ["c"]),
             h.make_node("If", ["c"], ["Y"], then_branch=then_g, else_branch=else_g)]
    model = make_model(nodes, [("X", T.FLOAT, [2])], [("Y", T.FLOAT, [2])], {"z": np.array(0, np.float32)})
    check_against_cpu(model, [{"X": np.array([1, -3], np.float32)}, {"X": np.array([1, 3], np.float32)}],
                      all_on_mlx=False, options={"disable_ops": "If"})
    bodies = [r for r in ortmlx.partition_reports()[-3:] if r.graph in ("then", "else")]
    assert len(bodies) == 2 and all(r.n_claimed == 0 for r in bodies)
    assert all("control-flow subgraph" in u.reason for r in bodies for u in r.unclaimed)


# the same buffer passed again: (what the next run passes for X0, why the view cached for it must (not) be kept)
SAME_ADDRESS_RUNS = [
    ("same shape, new content", lambda base: base[:8].reshape(2, 4), "views see the buffer's current bytes"),
    ("same address, other shape", lambda base: base[:8].reshape(4, 2), "another shape: a new view"),
    ("same address, fewer elements", lambda base: base[:4].reshape(1, 4), "a prefix: a new view"),
    ("same address, more elements", lambda base: base[:16].reshape(4, 4), "a longer buffer: a new view"),
]


@pytest.mark.parametrize("n", [1, 9])
@pytest.mark.parametrize("case", [c[0] for c in SAME_ADDRESS_RUNS])
def test_inputs_at_a_kept_address_are_read_again(case, n):
    """The gather keeps the view of an input whose address, rank, dims and type did not change
    (``ortmlx_same_inputs``; a group of one input as of many); one at the same address with other dims, or
    rewritten in place, answers as the CPU EP does."""
    make_x0, why = next((f, w) for c, f, w in SAME_ADDRESS_RUNS if c == case)
    nodes = [h.make_node("Sum", [f"X{i}" for i in range(n)], ["Y"])]
    m = make_model(nodes, [(f"X{i}", T.FLOAT, ["a", "b"]) for i in range(n)], [("Y", T.FLOAT, None)])
    mlx, cpu = session(m), session(m, "CPUExecutionProvider", record=False)
    rng = np.random.default_rng(5)
    base = rng.standard_normal(16).astype(np.float32)
    rest = {f"X{i}": rng.standard_normal((1, 1)).astype(np.float32) for i in range(1, n)}
    first = {"X0": base[:8].reshape(2, 4), **rest}
    np.testing.assert_allclose(mlx.run(None, first)[0], cpu.run(None, first)[0], rtol=1e-6, atol=1e-6)
    base[:] = rng.standard_normal(16).astype(np.float32)     # rewritten in place: the same address
    again = {"X0": make_x0(base), **rest}
    assert again["X0"].__array_interface__["data"][0] == first["X0"].__array_interface__["data"][0]
    got, want = mlx.run(None, again)[0], cpu.run(None, again)[0]
    assert got.shape == want.shape, why
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=why)
