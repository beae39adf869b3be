"""CI gate: the ONNX backend node suite through the MLX EP (scripts/conformance.py).

Fails on any case where MLX's claim makes a case fail that ORT's CPU EP passes
(mismatch, MLX load error, crash, timeout), unless the case is a known gap with a
reason in scripts/conformance_known.py; those show up as xfail, and a known gap
that now passes fails (remove it from the list).

The whole suite (1,884 cases, 2 workers) takes a few minutes on 2 cores;
ORTMLX_CONFORMANCE_WORKERS overrides the worker count.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


conf = _load("ortmlx_conformance", os.path.join(ROOT, "scripts", "conformance.py"))
KNOWN = conf.known_gaps()

# Regression floor: fully-claimed-and-passing cases. A broken registry (everything left
# on CPU) passes the mismatch gate trivially; this catches it. Raise it as coverage grows.
MIN_FULL_PASS = 1200      # 1284 measured on 2026-11-29 (onnx 1.23.2, onnxruntime 1.31.1, mlx 0.32.4)


@pytest.fixture(scope="module")
def suite():
    workers = int(os.environ.get("ORTMLX_CONFORMANCE_WORKERS", "2"))
    results, totals, wall = conf.run_suite(workers=workers, timeout=120.0)
    print(f"\nconformance: {wall:.0f} s, totals {totals}")
    return {r["name"]: r for r in results}, totals


def _describe(r: dict) -> str:
    m = r.get("mlx") or {}
    return (f"{r['name']} ({r['op']}): {r['status']}; failing MLX op(s) {m.get('blame')}; "
            f"{m.get('error', '')[:300]}")


def test_suite_loaded(suite):
    results, totals = suite
    # onnx 1.23.2 generates 1,884 node cases; other onnx versions differ, but never by much
    assert totals["cases"] > 1000, totals
    assert totals["cpu_pass"] > 0.5 * totals["cases"], totals


def test_no_unexpected_failures(suite):
    results, _ = suite
    bad = [r for r in results.values() if r["status"] in conf.FAILING and r["name"] not in KNOWN]
    assert not bad, f"{len(bad)} case(s) where MLX's claim breaks a case the CPU EP passes:\n" + \
        "\n".join(_describe(r) for r in bad)


@pytest.mark.parametrize("name", sorted(KNOWN) or [pytest.param(
    None, marks=pytest.mark.skip(reason="no known gaps listed in scripts/conformance_known.py"))])
def test_known_gap(suite, name):
    results, _ = suite
    r = results.get(name)
    if r is None:
        recorded, installed = conf.known_gaps_onnx(), conf.versions()["onnx"]
        if recorded and recorded != installed:
            pytest.skip(f"known gap {name!r} was recorded with onnx {recorded}; onnx {installed} does not generate it")
        pytest.fail(f"known gap {name!r} is not a case of onnx {installed}: remove it")
    if r["status"] in conf.FAILING:
        pytest.xfail(f"{KNOWN[name][:120]} [{_describe(r)[:200]}]")
    pytest.fail(f"known gap {name!r} no longer fails ({r['status']}): remove it from scripts/conformance_known.py")


def test_coverage_floor(suite):
    _, totals = suite
    assert totals["full_pass"] >= MIN_FULL_PASS, totals


# --------------------------------------------------------------------------- the runner itself

@functools.lru_cache(maxsize=None)
def _cases(pattern: str):
    cs = conf.load_cases(pattern)
    assert cs, pattern
    return cs


def test_runner_survives_crash_and_hang():
    good = _cases(r"^test_abs$")[0]
    crash = {**good, "name": "selftest_crash", "_selftest": {"crash": True}}
    hang = {**good, "name": "selftest_hang", "_selftest": {"hang": 60}}
    res = conf.run_cases([good, crash, hang, good], workers=2, timeout=10.0)
    st = [r["status"] for r in res]
    assert st[1] == "mlx_crash" and st[2] == "mlx_timeout", st
    assert st[0] == st[3] and st[0] in conf.PASSING, st
    assert "crash" in res[1]["mlx"]["error"] and "timeout" in res[2]["mlx"]["error"]
    assert res[1]["cpu"]["pass"] and res[2]["cpu"]["pass"], res      # the hooks hit the MLX phase only


def test_runner_catches_wrong_answer():
    """A translator made to answer wrongly must show up as a mismatch, blamed on its op."""
    case = _cases(r"^test_abs$")[0]
    res = conf.run_cases([{**case, "_selftest": {"break_op": "Abs"}}], workers=1, timeout=60.0)[0]
    assert res["status"] == "mismatch", res
    assert res["mlx"]["blame"] == ["Abs"], res


@pytest.mark.parametrize("rec,status", [
    ({"cpu": {"loads": False}, "mlx": {"loads": False}}, "ort_cannot_load"),
    ({"cpu": {"loads": True, "pass": True}, "mlx": {"loads": True, "pass": True, "n_mlx": 2, "n_other": 0}},
     "full_pass"),
    ({"cpu": {"loads": True, "pass": True}, "mlx": {"loads": True, "pass": True, "n_mlx": 1, "n_other": 1}},
     "partial_pass"),
    ({"cpu": {"loads": True, "pass": True}, "mlx": {"loads": True, "pass": True, "n_mlx": 0, "n_other": 1}},
     "not_claimed"),
    ({"cpu": {"loads": True, "pass": True}, "mlx": {"loads": True, "pass": True, "n_mlx": 0, "n_other": 0}},
     "folded"),
    ({"cpu": {"loads": True, "pass": True}, "mlx": {"loads": True, "pass": False, "n_mlx": 0, "n_other": 1}},
     "unclaimed_fail"),
    ({"cpu": {"loads": True, "pass": True}, "mlx": {"loads": True, "pass": False, "n_mlx": 1, "n_other": 0}},
     "mismatch"),
    ({"cpu": {"loads": True, "pass": True}, "mlx": {"loads": False, "pass": False}}, "mlx_load_error"),
    ({"cpu": {"loads": True, "pass": False}, "mlx": {"loads": True, "pass": True, "n_mlx": 1, "n_other": 0}},
     "mlx_only_pass"),
    ({"cpu": {"loads": True, "pass": False}, "mlx": {"loads": True, "pass": False, "n_mlx": 1, "n_other": 0}},
     "cpu_fail"),
    ({"cpu": {"loads": True, "pass": True}, "mlx": {"crash": True}}, "mlx_crash"),
])
def test_classify(rec, status):
    assert conf.classify(dict(rec)) == status
