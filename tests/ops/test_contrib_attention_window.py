"""GroupQueryAttention's windowed KV cache (sliding_window_cache=1) and q/k norm inputs vs ORT's CPU EP.

Windowed cache: ORT's contract leaves present rows [L(T), C) unspecified, so presents are compared on the
resident rows [0, L(T)) of each batch row (L as the spec defines it, checked here against a NumPy model
of the contract too); outputs are compared whole.
q/k norms: ORT's CPU EP refuses q_norm_weight / k_norm_weight, so the reference is the graph the builder
fused them from (Reshape -> SimplifiedLayerNormalization -> Reshape on Q and K, then the GQA) on the CPU EP.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from test_contrib_attention import F16, F32, NP, TOL, _cos_sin, gqa_feeds, gqa_model

from ortmlx.testing import assert_close, make_model, session, unclaimed_ops

MS = {"com.microsoft": 1}


def resident(t: int, cap: int, w: int) -> int:
    """L(T): rows of a windowed KV cache resident after T tokens (ORT's GroupQueryAttention contract)."""
    if t <= cap:
        return t
    g = cap - w + 1
    return t - g * (-(-(t - cap) // g))


def test_resident_formula():
    """The contract's own bounds: min(T, W) <= L(T) <= min(T, C), and L grows by one a token between
    evictions of G = C - W + 1 positions."""
    for cap, w in ((4, 4), (6, 4), (9, 3)):
        g = cap - w + 1
        prev = 0
        for t in range(1, 40):
            lt = resident(t, cap, w)
            assert min(t, w) <= lt <= min(t, cap)
            assert lt == prev + 1 or lt == prev + 1 - g
            prev = lt


def compare_window(model, feeds_list, w, tol):
    ms = session(model)
    cs = session(model, "CPUExecutionProvider", record=False)
    assert not unclaimed_ops(ms), dict(unclaimed_ops(ms))
    for k, f in enumerate(feeds_list):
        got, want = ms.run(None, f), cs.run(None, f)
        cap = f["past_key"].shape[2]
        assert got[1].shape == want[1].shape == f["past_key"].shape
        assert_close(got[0], want[0], **tol, what=f"feed {k} output")
        for b, sl in enumerate(f["seqlens_k"]):
            lt = resident(int(sl) + 1, cap, w)
            for j, what in ((1, "present_key"), (2, "present_value")):
                assert_close(got[j][b, :, :lt], want[j][b, :, :lt], **tol, what=f"feed {k} {what} row {b}")
    return ms


# (id, dtype, n, kvn, h, window, capacity, attrs, model kwargs, [(b, s, seqlens, total)])
WINDOW_RUNS = [(1, 3, [2], 3), (1, 9, [8], 9), (1, 1, [3], 4), (1, 1, [4], 5), (1, 1, [6], 7), (1, 1, [9], 10),
               (1, 3, [9], 10), (2, 1, [9, 5], 10), (1, 7, [12], 13), (2, 1, [0, 7], 8), (2, 3, [2, 2], 3)]
WINDOW_CASES = [
    ("c_eq_w", F32, 2, 1, 8, 4, 4, {}, {}, WINDOW_RUNS),
    ("slack", F32, 2, 1, 8, 4, 6, {}, {}, WINDOW_RUNS),
    ("rotary_softcap", F32, 4, 2, 16, 5, 7, dict(softcap=3.0), dict(rotary_dim=16), WINDOW_RUNS),
    ("packed_rotary_smooth", F32, 4, 2, 16, 3, 5, dict(smooth_softmax=1), dict(rotary_dim=16, packed=True),
     WINDOW_RUNS),
    ("interleaved_scale", F32, 4, 1, 16, 6, 6, dict(rotary_interleaved=1, scale=0.3), dict(rotary_dim=16),
     WINDOW_RUNS),
    ("fp16_rotary", F16, 4, 2, 16, 4, 6, {}, dict(rotary_dim=16), WINDOW_RUNS),
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=[c[0] for c in WINDOW_CASES])
def test_gqa_window(case):
    _, t, n, kvn, h, w, cap, attrs, mk, runs = case
    model = gqa_model(t, n, kvn, h, local_window_size=w, sliding_window_cache=1, **mk, **attrs)
    feeds = [gqa_feeds(t, n, kvn, h, b, s, cap, sl, tot, packed=mk.get("packed", False), seed=i)
             for i, (b, s, sl, tot) in enumerate(runs)]
    compare_window(model, feeds, w, TOL[t])


def test_gqa_window_head_sink():
    """gpt-oss's layout: a windowed layer with per-head sinks."""
    n, kvn, h, w, cap = 4, 2, 16, 4, 4
    model = gqa_model(F32, n, kvn, h, rotary_dim=16, local_window_size=w, sliding_window_cache=1,
                      extra_inputs=[("head_sink", F32, [n])])
    feeds = [gqa_feeds(F32, n, kvn, h, b, s, cap, sl, tot, seed=i, sink=True)
             for i, (b, s, sl, tot) in enumerate(WINDOW_RUNS)]
    compare_window(model, feeds, w, TOL[F32])


def test_gqa_window_eviction_over_a_generation():
    """Feed each step's present back as the next past (what genai does): 30 single-token steps after a
    5-token prompt, outputs equal to the CPU EP's step by step (each EP on its own presents)."""
    n, kvn, h, w, cap = 2, 1, 16, 4, 6
    model = gqa_model(F32, n, kvn, h, rotary_dim=16, local_window_size=w, sliding_window_cache=1)
    ms = session(model)
    cs = session(model, "CPUExecutionProvider", record=False)
    f = gqa_feeds(F32, n, kvn, h, 1, 5, cap, [4], 5, seed=3)
    pm = pc = (f["past_key"], f["past_value"])
    r = np.random.default_rng(9)
    for step in range(31):
        if step:
            t = 5 + step
            f = {"query": r.standard_normal((1, 1, n * h)).astype(np.float32),
                 "key": r.standard_normal((1, 1, kvn * h)).astype(np.float32),
                 "value": r.standard_normal((1, 1, kvn * h)).astype(np.float32),
                 "seqlens_k": np.array([t - 1], np.int32), "total_sequence_length": np.array(t, np.int32)}
        gm = ms.run(None, {**f, "past_key": pm[0], "past_value": pm[1]})
        gc = cs.run(None, {**f, "past_key": pc[0], "past_value": pc[1]})
        assert_close(gm[0], gc[0], **TOL[F32], what=f"step {step} output")
        pm, pc = (gm[1], gm[2]), (gc[1], gc[2])


@pytest.mark.parametrize("case,match", [
    (dict(b=1, s=4, seqlens=[2], total=4), "too small for sequence_length"),
    (dict(b=2, s=2, seqlens=[7, 3], total=8), "batch_size must be 1"),
])
def test_gqa_window_errors_like_cpu(case, match):
    """ORT's run-time checks raise on MLX too (never a silent answer)."""
    model = gqa_model(F32, 2, 1, 8, local_window_size=4, sliding_window_cache=1)
    f = gqa_feeds(F32, 2, 1, 8, case["b"], case["s"], 4, case["seqlens"], case["total"])
    for s in (session(model), session(model, "CPUExecutionProvider", record=False)):
        with pytest.raises(Exception, match=match):
            s.run(None, f)


def test_gqa_window_capacity_below_window_is_an_error():
    model = gqa_model(F32, 2, 1, 8, local_window_size=8, sliding_window_cache=1)
    f = gqa_feeds(F32, 2, 1, 8, 1, 1, 4, [5], 6)
    for s in (session(model), session(model, "CPUExecutionProvider", record=False)):
        with pytest.raises(Exception, match="capacity"):
            s.run(None, f)


@pytest.mark.parametrize("attrs,extra,reason", [
    # ORT's CPU kernel rejects it when the session is made (so the session fails, as on the CPU EP)
    (dict(local_window_size=-1), (), "needs local_window_size > 0"),
    # attention_bias indexed by absolute columns: not claimed (the CPU EP runs it)
    (dict(local_window_size=4), (("attention_bias", F32, [1, 1, 1, 6]),), "attention_bias"),
])
def test_gqa_window_refused(attrs, extra, reason):
    import ortmlx
    model = gqa_model(F32, 2, 1, 8, sliding_window_cache=1, extra_inputs=extra, **attrs)
    try:
        session(model)
    except Exception:  # noqa: BLE001 - the CPU EP's own rejection of the node it was left
        pass
    rep = ortmlx.partition_reports()[-1]
    assert [(u.op, reason in u.reason) for u in rep.unclaimed] == [("com.microsoft.GroupQueryAttention", True)], \
        rep.format()


# ------------------------------------------------------------------------------ q/k norms
def _norm_models(t, n, kvn, h, eps, *, packed=False, rotary=True, window=None):
    """(GQA with q/k_norm_weight inputs, the decomposed reference graph), same initializers."""
    r = np.random.default_rng(5)
    qw = (1.0 + 0.3 * r.standard_normal(h)).astype(NP[t])
    kw = (1.0 + 0.3 * r.standard_normal(h)).astype(NP[t])
    c, s = _cos_sin(64, h)
    inits = {"qw": qw, "kw": kw}
    attrs = dict(num_heads=n, kv_num_heads=kvn)
    if rotary:
        inits.update(cos=c.astype(NP[t]), sin=s.astype(NP[t]))
        attrs["do_rotary"] = 1
    if window:
        attrs.update(local_window_size=window, sliding_window_cache=1)
    q_width = (n + 2 * kvn) * h if packed else n * h
    inputs = [("query", t, ["B", "S", q_width])]
    if not packed:
        inputs += [("key", t, ["B", "S", kvn * h]), ("value", t, ["B", "S", kvn * h])]
    inputs += [("past_key", t, ["B", kvn, "P", h]), ("past_value", t, ["B", kvn, "P", h]),
               ("seqlens_k", TensorProto.INT32, ["B"]), ("total_sequence_length", TensorProto.INT32, [])]
    rot = ["cos", "sin"] if rotary else ["", ""]
    outputs = [("output", t, None), ("present_key", t, None), ("present_value", t, None)]
    fused_in = ["query", "" if packed else "key", "" if packed else "value", "past_key", "past_value", "seqlens_k",
                "total_sequence_length", *rot, "", "", "", "", "", "qw", "kw"]
    fused = helper.make_node("GroupQueryAttention", fused_in, ["output", "present_key", "present_value"],
                             domain="com.microsoft", qk_norm_epsilon=eps, **attrs)
    fused_m = make_model([fused], inputs, outputs, inits, extra_opsets=MS)
    nodes = []
    q, k, v = "query", "key", "value"
    if packed:
        inits["split"] = np.array([n * h, kvn * h, kvn * h], np.int64)
        nodes.append(helper.make_node("Split", ["query", "split"], ["q0", "k0", "v0"], axis=-1))
        q, k, v = "q0", "k0", "v0"
    inits["heads"] = np.array([0, 0, -1, h], np.int64)
    inits["flat"] = np.array([0, 0, -1], np.int64)
    for x, wname, out in ((q, "qw", "qn"), (k, "kw", "kn")):
        nodes += [helper.make_node("Reshape", [x, "heads"], [out + "4"]),
                  helper.make_node("SimplifiedLayerNormalization", [out + "4", wname], [out + "4n"], axis=-1,
                                   epsilon=eps),
                  helper.make_node("Reshape", [out + "4n", "flat"], [out])]
    ref_in = ["qn", "kn", v, "past_key", "past_value", "seqlens_k", "total_sequence_length", *rot]
    nodes.append(helper.make_node("GroupQueryAttention", ref_in, ["output", "present_key", "present_value"],
                                  domain="com.microsoft", **attrs))
    ref_m = make_model(nodes, inputs, outputs, inits, extra_opsets=MS)
    return fused_m, ref_m


# (id, dtype, n, kvn, h, eps, kwargs, [(b, s, past capacity, seqlens, total)])
NORM_CASES = [
    ("prefill_decode", F32, 4, 2, 16, 1e-6, {}, [(1, 5, 8, [4], 5), (2, 1, 8, [6, 3], 7)]),
    ("packed", F32, 4, 2, 16, 1e-5, dict(packed=True), [(1, 5, 8, [4], 5), (2, 1, 8, [6, 3], 7)]),
    ("no_rotary", F32, 2, 1, 16, 1e-6, dict(rotary=False), [(1, 4, 6, [3], 4), (1, 1, 6, [4], 5)]),
    ("windowed", F32, 4, 2, 16, 1e-6, dict(window=4), [(1, 6, 4, [5], 6), (1, 1, 4, [6], 7)]),
    ("fp16", F16, 4, 2, 16, 1e-6, {}, [(1, 5, 8, [4], 5), (2, 1, 8, [6, 3], 7)]),
]


@pytest.mark.parametrize("case", NORM_CASES, ids=[c[0] for c in NORM_CASES])
def test_gqa_qk_norm_vs_decomposed(case):
    _, t, n, kvn, h, eps, kw, runs = case
    fused, ref = _norm_models(t, n, kvn, h, eps, **kw)
    ms = session(fused)
    assert not unclaimed_ops(ms), dict(unclaimed_ops(ms))
    cs = session(ref, "CPUExecutionProvider", record=False)
    for i, (b, s, cap, sl, tot) in enumerate(runs):
        f = gqa_feeds(t, n, kvn, h, b, s, cap, sl, tot, packed=kw.get("packed", False), seed=i)
        got, want = ms.run(None, f), cs.run(None, f)
        assert_close(got[0], want[0], **TOL[t], what=f"run {i} output")
        for b_ in range(b):
            rows = resident(sl[b_] + 1, cap, kw["window"]) if kw.get("window") else sl[b_] + 1
            for j in (1, 2):
                assert_close(got[j][b_, :, :rows], want[j][b_, :, :rows], **TOL[t], what=f"run {i} present {j}")


def test_gqa_qk_norm_cpu_ep_refuses_it():
    """Why the reference is the decomposed graph: ORT's CPU EP rejects the fused inputs at run time."""
    fused, _ = _norm_models(F32, 2, 1, 16, 1e-6)
    f = gqa_feeds(F32, 2, 1, 16, 1, 2, 4, [1], 2)
    with pytest.raises(Exception, match="q_norm_weight"):
        session(fused, "CPUExecutionProvider", record=False).run(None, f)


def test_gqa_q_norm_without_k_norm_refused():
    fused, _ = _norm_models(F32, 2, 1, 16, 1e-6)
    node = fused.graph.node[0]
    node.input[15] = ""
    assert unclaimed_ops(session(fused)) == {"GroupQueryAttention": 1}
