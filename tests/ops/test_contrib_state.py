"""com.microsoft CausalConvWithState (LFM2's short convolution) vs ORT's CPU EP."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from ortmlx.testing import check_against_cpu, make_model, session, unclaimed_ops

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
NP = {F32: np.float32, F16: np.float16}
TOL = {F32: dict(rtol=1e-4, atol=1e-5), F16: dict(rtol=1e-3, atol=1e-3)}   # float32 math, one rounding


def ccs_model(t, c, k, *, dilation=1, activation="none", bias=True, past=True, channels_last=0, **attrs):
    ls = (k - 1) * dilation
    r = np.random.default_rng(0)
    inits = {"w": r.standard_normal((c, 1, k)).astype(NP[t])}
    if bias:
        inits["b"] = r.standard_normal(c).astype(NP[t])
    if dilation != 1:
        attrs["dilation"] = dilation
    if channels_last:
        attrs["channels_last"] = 1
    node = helper.make_node("CausalConvWithState", ["x", "w", "b" if bias else "", "p" if past else ""], ["y", "s"],
                            domain="com.microsoft", activation=activation, **attrs)
    xs = ["B", "L", c] if channels_last else ["B", c, "L"]
    inputs = [("x", t, xs)] + ([("p", t, ["B", ls, c] if channels_last else ["B", c, ls])] if past else [])
    return make_model([node], inputs, [("y", t, None), ("s", t, None)], inits, extra_opsets={"com.microsoft": 1})


def ccs_feeds(t, c, k, b, n, *, dilation=1, past=True, channels_last=0, seed=0):
    r = np.random.default_rng(seed)
    ls = (k - 1) * dilation
    f = {"x": r.standard_normal((b, n, c) if channels_last else (b, c, n)).astype(NP[t])}
    if past:
        f["p"] = r.standard_normal((b, ls, c) if channels_last else (b, c, ls)).astype(NP[t])
    return f


# (id, dtype, channels, kernel, model kwargs, [(batch, length)])
CASES = [
    ("lfm2_prefill_decode", F32, 64, 3, {}, [(1, 7), (1, 1), (2, 1)]),
    ("silu_bias", F32, 8, 4, dict(activation="silu"), [(2, 5), (2, 1)]),
    ("swish_dilation2", F32, 8, 3, dict(activation="swish", dilation=2), [(2, 6), (1, 1)]),
    ("no_past_no_bias", F32, 4, 3, dict(past=False, bias=False), [(2, 4), (1, 1)]),
    ("channels_last", F32, 6, 3, dict(channels_last=1, activation="silu"), [(2, 5), (1, 1)]),
    ("fp16", F16, 16, 3, dict(activation="silu"), [(2, 5), (2, 1)]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_causal_conv_with_state(case):
    _, t, c, k, mk, runs = case
    model = ccs_model(t, c, k, **mk)
    fk = {x: mk[x] for x in ("dilation", "past", "channels_last") if x in mk}
    check_against_cpu(model, [ccs_feeds(t, c, k, b, n, seed=i, **fk) for i, (b, n) in enumerate(runs)], **TOL[t])


def test_causal_conv_state_carries_over_steps():
    """Decode token by token, each step's present_state the next past_state: equal to the CPU EP throughout."""
    model = ccs_model(F32, 8, 3, activation="silu")
    ms, cs = session(model), session(model, "CPUExecutionProvider", record=False)
    r = np.random.default_rng(4)
    pm = pc = np.zeros((1, 8, 2), np.float32)
    for _ in range(10):
        x = r.standard_normal((1, 8, 1)).astype(np.float32)
        ym, pm = ms.run(None, {"x": x, "p": pm})
        yc, pc = cs.run(None, {"x": x, "p": pc})
        np.testing.assert_allclose(ym, yc, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(pm, pc, rtol=0, atol=0)


def test_state_window_refused():
    model = ccs_model(F32, 8, 3, state_window=2)
    try:
        s = session(model)
        assert unclaimed_ops(s) == {"CausalConvWithState": 1}
    except Exception:  # noqa: BLE001 - the CPU EP's own shape checks on what it was left
        import ortmlx
        rep = ortmlx.partition_reports()[-1]
        assert [u.op for u in rep.unclaimed] == ["com.microsoft.CausalConvWithState"], rep.format()
