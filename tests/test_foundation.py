"""Issue 2: whole small models on MLX, equal to the CPU EP over several shapes on one session."""
import numpy as np
import pytest

from ortmlx.testing import check_against_cpu

from models_basic import cnn, mlp, transformer_block

rng = np.random.default_rng(1)


def feeds(name, shapes):
    return [{name: rng.standard_normal(s).astype(np.float32)} for s in shapes]


CASES = {
    "mlp": (mlp, "X", [(1, 16), (5, 16), (0, 16), (33, 16)]),
    "cnn": (cnn, "X", [(1, 3, 16, 16), (2, 3, 16, 16), (0, 3, 16, 16)]),
    "transformer_block": (transformer_block, "X", [(1, 7, 32), (2, 3, 32), (0, 5, 32), (3, 1, 32)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_model_all_on_mlx_and_equal(case):
    build, name, shapes = CASES[case]
    check_against_cpu(build(), feeds(name, shapes), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- the check on a device without float64
def _relu_then_cast(t_in):
    """Relu on ``t_in``, then a Cast to float32 and an Add in float32."""
    from onnx import TensorProto as T
    from onnx import helper

    from ortmlx.testing import make_model
    return make_model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Cast", ["r"], ["c"], to=T.FLOAT),
                       helper.make_node("Add", ["c", "c"], ["y"])], [("x", t_in, [2, 3])], [("y", T.FLOAT, [2, 3])])


def test_type_refused_names_the_nodes_a_gpu_cannot_hold():
    from collections import Counter

    from onnx import TensorProto as T

    from ortmlx.testing import type_refused
    m = _relu_then_cast(T.DOUBLE)
    assert type_refused(m, "cpu") == Counter()
    assert type_refused(m, "gpu") == Counter({"Relu": 1, "Cast": 1})       # the Add is float32 only
    assert type_refused(m.SerializeToString(), "gpu") == Counter({"Relu": 1, "Cast": 1})
    assert type_refused(_relu_then_cast(T.FLOAT), "gpu") == Counter()


def _as_if_on(device, monkeypatch):
    """The newest partition report says ``device`` (what a session on a GPU records), for the check below."""
    import dataclasses

    import ortmlx
    from ortmlx import testing
    real = ortmlx.partition_reports

    def reports():
        reps = real()
        if reps:
            reps[-1] = dataclasses.replace(reps[-1], device=device)
        return reps
    monkeypatch.setattr(ortmlx, "partition_reports", reports)
    return testing


def test_check_on_a_gpu_expects_exactly_the_type_refused_nodes_off_mlx(monkeypatch):
    """On a device without float64 the check wants the float64 nodes left to the CPU EP (here made so with
    ``disable_ops``, the report saying 'gpu'), no more and no fewer; on the CPU every node on MLX."""
    from onnx import TensorProto as T
    testing = _as_if_on("gpu", monkeypatch)
    m = _relu_then_cast(T.DOUBLE)
    feeds = [{"x": rng.standard_normal((2, 3))}]
    testing.check_against_cpu(m, feeds, options={"disable_ops": "Relu,Cast"})         # exactly those: passes
    with pytest.raises(AssertionError, match="expected"):
        testing.check_against_cpu(m, feeds)                                            # claimed on a 'gpu': fails
    with pytest.raises(AssertionError, match="expected"):
        testing.check_against_cpu(m, feeds, options={"disable_ops": "Relu,Cast,Add"})  # one more left: fails
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="nodes left off MLX"):
        testing.check_against_cpu(m, feeds, options={"disable_ops": "Relu,Cast"})     # on the CPU: all on MLX
    testing.check_against_cpu(m, feeds)
