"""Property test: random small graphs from the registered ops, MLX EP == CPU EP (fixed CI budget).

The long run is ``python scripts/fuzz.py``; its last results are in docs/reliability.md.
Differences from the CPU EP where its answer is not the one to give are listed in ``fuzz.KNOWN_BUGS`` (each
tested against its reference in tests/ops/) and not generated here; scripts/fuzz.py still generates them.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from onnx import TensorProto as T
from onnx import helper as h

from ortmlx import fuzz
from ortmlx.kernels.registry import REGISTRY
from ortmlx.testing import make_model

BUDGET = 300
SETTINGS = settings(max_examples=BUDGET, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


def ops():
    return fuzz.fuzzable_ops()


def test_random_graphs_mlx_equals_cpu():
    """Then the property was not vacuous: most cases had a reference and ran nodes on MLX (one test, so that
    pytest-xdist cannot split the tally from the cases)."""
    tally: Counter = Counter()

    @SETTINGS
    @given(case=fuzz.cases(ops(), avoid=fuzz.KNOWN_BUGS))
    def prop(case):
        out = fuzz.check_case(case)
        tally[out.status] += 1
        tally["nodes"] += out.nodes
        tally["claimed"] += out.claimed
    prop()
    assert tally["ok"] >= BUDGET // 2, tally
    assert tally["claimed"] >= tally["nodes"] // 2, tally


def test_generator_covers_many_registered_ops():
    assert len(ops()) >= 10, ops()


def test_checker_catches_a_wrong_translator(monkeypatch):
    """Break Neg on purpose: check_case must report the mismatch (the property can fail)."""
    lst = REGISTRY._ops[("", "Neg")]
    broken = [dataclasses.replace(d, fn=lambda X: X) for d in lst]          # identity instead of negation
    monkeypatch.setitem(REGISTRY._ops, ("", "Neg"), broken)
    m = make_model([h.make_node("Neg", ["X"], ["Y"])], [("X", T.FLOAT, [3])], [("Y", T.FLOAT, [3])])
    case = fuzz.Case(m, {"X": np.array([1, -2, 3], np.float32)}, ["Neg"])
    with pytest.raises(fuzz.FuzzFailure, match="output Y"):
        fuzz.check_case(case)


def test_checker_reports_mlx_only_errors(monkeypatch):
    lst = REGISTRY._ops[("", "Neg")]

    def boom(X):
        raise ValueError("translator exploded")
    monkeypatch.setitem(REGISTRY._ops, ("", "Neg"), [dataclasses.replace(d, fn=boom) for d in lst])
    m = make_model([h.make_node("Neg", ["X"], ["Y"])], [("X", T.FLOAT, [3])], [("Y", T.FLOAT, [3])])
    case = fuzz.Case(m, {"X": np.array([1, -2, 3], np.float32)}, ["Neg"])
    with pytest.raises(fuzz.FuzzFailure, match="MLX EP failed where the CPU EP succeeded.*translator exploded"):
        fuzz.check_case(case)


@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(case=fuzz.cases(["ReduceProd", "Sin", "Cos", "Tan", "Acos", "Asin", "Acosh", "Atanh"]))
def test_periodic_and_edged_ops_read_exact_values_only(case):
    """Sin/Cos/Tan of a computed value amplify its last-bit rounding by its magnitude (a ReduceProd of 1e5), and
    Acos/Asin/Acosh/Atanh turn it into NaN at their domain's edge: the generator gives them only graph inputs and
    constants here, where every other producer is inexact."""
    g = case.model.graph
    raw = {i.name for i in g.input} | {t.name for t in g.initializer}
    for n in g.node:
        if n.op_type in fuzz.PERIODIC | fuzz.EDGED:
            assert n.input[0] in raw, f"{n.op_type} reads {n.input[0]}, computed: {case}"


@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(case=fuzz.cases(["MeanVarianceNormalization", "Softmax", "ReduceLogSum"]))
def test_log_sum_reads_exact_values_only(case):
    """ReduceLogSum of computed values that cancel (a normalization's, summing to +-3e-8) is the log of a rounding
    residue: the generator gives it exact values only (here only graph inputs and constants are)."""
    g = case.model.graph
    raw = {i.name for i in g.input} | {t.name for t in g.initializer}
    seen = [n for n in g.node if n.op_type == "ReduceLogSum"]
    for n in seen:
        assert n.input[0] in raw, f"ReduceLogSum reads {n.input[0]}, computed: {case}"


COMPILED_BUDGET = 100


def test_random_graphs_compiled_mlx_equals_cpu():
    """Six calls a session, each checked: the second traces and verifies a compiled closure, the later ones are
    answered by it or by its replay (build_behind off: traced on the calling thread); the fourth and sixth on new
    values of the same shapes (``vary``). Then: compiled calls did happen, and varied ones."""
    import ortmlx.compiled as C
    tally: Counter = Counter()

    @settings(max_examples=COMPILED_BUDGET, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(case=fuzz.cases(ops(), avoid=fuzz.KNOWN_BUGS))
    def prop(case):
        with C.capture() as rs:
            out = fuzz.check_case(case, {"tuning": "build_behind=0"}, calls=6, vary=True)
        tally[out.status] += 1
        tally["varied"] += out.info.get("varied", 0)
        tally["compiled calls"] += sum(p.counters.get("compiled_calls", 0) for r in rs for p in r.parts())
    prop()
    assert tally["ok"] >= COMPILED_BUDGET // 2 and tally["compiled calls"] >= COMPILED_BUDGET // 2, tally
    assert tally["varied"] >= COMPILED_BUDGET // 2, tally


def _neg_case_with_mlx_answers(monkeypatch, answer):
    """A Neg case whose MLX EP sessions answer ``answer(got, answers)`` (their real answer, and every real answer
    of the session so far, this one last); the CPU EP's are left as they are."""
    from ortmlx import testing
    real = testing.session

    class StandIn:
        def __init__(self, s):
            self.s, self.answers = s, []

        def run(self, names, feeds):
            got = self.s.run(names, feeds)
            self.answers.append(got)
            return answer(got, self.answers)

        def __getattr__(self, name):
            return getattr(self.s, name)

    def session(blob, provider=None, *a, **k):
        s = real(blob, provider, *a, **k) if provider else real(blob, *a, **k)
        return s if provider == "CPUExecutionProvider" else StandIn(s)
    monkeypatch.setattr(testing, "session", session)
    m = make_model([h.make_node("Neg", ["X"], ["Y"])], [("X", T.FLOAT, [3])], [("Y", T.FLOAT, [3])])
    return fuzz.Case(m, {"X": np.array([1, -2, 3], np.float32)}, ["Neg"])


def test_group_whose_output_no_one_reads():
    """Found by ``scripts/fuzz.py --calls 6``: ORT keeps a Compress whose output is unused, so the group has no
    outputs; its replayed calls (from the fifth on) asked ORT for none and failed. Every call answers now."""
    m = make_model([h.make_node("Compress", ["x", "c"], ["unused"], axis=-1),
                    h.make_node("ConstantOfShape", ["s"], ["y"], value=h.make_tensor("v", T.FLOAT, [1], [-3.0]))],
                   [("x", T.FLOAT, [1])], [("y", T.FLOAT, None)],
                   {"c": np.zeros(0, np.bool_), "s": np.zeros(0, np.int64)})
    case = fuzz.Case(m, {"x": np.array([0.5], np.float32)}, ["Compress", "ConstantOfShape"])
    assert fuzz.check_case(case, calls=8).status == "ok"


def test_checker_varies_feeds(monkeypatch):
    """A session that answers every call with its first answer (a closure that baked its first values): with
    ``vary`` check_case finds it at the first varied call; without, it cannot."""
    def stuck(got, answers):
        return answers[0]
    case = _neg_case_with_mlx_answers(monkeypatch, stuck)
    assert fuzz.check_case(case, calls=6).status == "ok"
    with pytest.raises(fuzz.FuzzFailure, match=r"call 4 \(varied feeds\), output Y"):
        fuzz.check_case(case, calls=6, vary=True)


def test_varied_feeds_are_new_arrays_of_the_same_kind():
    """Every varied feed is an array of the feed's shape and type (a zero-dimensional one too: ORT's Python API
    refuses a NumPy scalar), with other values where the feed has two different ones, or one element."""
    feeds = {"a": np.array(1.5, np.float16), "b": np.array(True), "c": np.array([-3], np.int64),
             "d": np.arange(6, dtype=np.float32).reshape(2, 3), "e": np.zeros((0, 2), np.int32)}
    got = fuzz.varied_feeds(feeds, 4)
    for k, v in feeds.items():
        assert type(got[k]) is np.ndarray and got[k].shape == v.shape and got[k].dtype == v.dtype, k
    assert [got[k].tolist() for k in "abc"] == [-1.5, False, [-4]]
    assert sorted(got["d"].ravel().tolist()) == list(range(6)) and not np.array_equal(got["d"], feeds["d"])


def test_half_cases_are_checked_node_by_node():
    """A float16 Tanh -> Acos where tanh saturates: ORT's CPU EP in one session computes the chain in float32 (its
    tanh gives +-1.0000001 there, its Acos NaN); node by node each output is a float16 value, as the MLX EP's."""
    m = make_model([h.make_node("Tanh", ["x"], ["t"]), h.make_node("Acos", ["t"], ["y"])], [("x", T.FLOAT, [4])],
                   [("y", T.FLOAT, None)])
    half = fuzz.half_case(fuzz.Case(m, {"x": np.array([8.86, 8.94, -8.86, 2.0], np.float32)}, ["Tanh", "Acos"]))
    assert half.feeds["x"].dtype == np.float16
    np.testing.assert_allclose(half.reference(half.feeds)[0].astype(np.float32), [0, 0, np.pi, 0.2695], atol=2e-3)
    assert fuzz.check_case(half, calls=3).status == "ok"


def test_checker_checks_every_call(monkeypatch):
    """A session whose second answer is wrong: check_case with calls=3 names that call."""
    def flaky(got, answers):
        return [g + 1 for g in got] if len(answers) == 2 else got
    case = _neg_case_with_mlx_answers(monkeypatch, flaky)
    assert fuzz.check_case(case, calls=1).status == "ok"
    with pytest.raises(fuzz.FuzzFailure, match="call 2, output Y"):
        fuzz.check_case(case, calls=3)
