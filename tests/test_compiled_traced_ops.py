"""Trace-friendly translators of ortmlx/compiled/decode_ops.py on small graphs: MatMulNBits with
prepacked weights and RotaryEmbedding with positions as data replay compiled, match the CPU EP,
and a failed in-graph guard answers from eager (which raises eager's error)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

import ortmlx.compiled as C
from ortmlx.testing import assert_close, make_model, session

RNG = np.random.default_rng(7)


def compiled_session(model, options=None):
    with C.capture() as rs:
        s = session(model, options=options)
    return s, list(rs)


def parts(rs):
    return [p for r in rs for p in (r.parts() if hasattr(r, "parts") else [r])]


def mnb_model(K=64, N=32, bs=32, bits=4, t=T.FLOAT):
    kb = K // bs
    B = RNG.integers(0, 256, (N, kb, bs * bits // 8), dtype=np.uint8)
    scales = ((RNG.random(N * kb) + 0.5) * 0.05).astype(np.float16 if t == T.FLOAT16 else np.float32)
    zp = RNG.integers(0, 256, (N * (-(-kb * bits // 8)),), dtype=np.uint8)
    node = helper.make_node("MatMulNBits", ["a", "B", "scales", "zp"], ["h"], domain="com.microsoft",
                            K=K, N=N, block_size=bs, bits=bits, accuracy_level=0)
    relu = helper.make_node("Relu", ["h"], ["y"])
    return make_model([node, relu], [("a", t, ["M", K])], [("y", t, ["M", N])],
                      {"B": B, "scales": scales, "zp": zp}, opset=17, extra_opsets={"com.microsoft": 1})


@pytest.mark.parametrize("dense,fn,short", [("0", "matmul_nbits_packed", False), ("1", "matmul_dense_nbits", False),
                                            ("1", "matmul_nbits_packed", True)],
                         ids=["prepacked", "dense-float32", "dense-but-memory-short"])
def test_matmul_nbits_prepacked_replays_and_matches_cpu(dense, fn, short, monkeypatch):
    """The quantized form prepacked for mx.quantized_matmul (GPUs), or the weight dequantized to float32 at
    load (the CPU's default, ``dense_nbits``, unless the copies would crowd MLX's memory): traced once,
    replayed, the CPU EP's answers."""
    if short:
        from ortmlx.kernels import interpreter
        monkeypatch.setattr(interpreter, "MAX_VALUE_BYTES", 1024)
    m = mnb_model()
    s, rs = compiled_session(m, {"tuning": f"dense_nbits={dense}"})
    cpu = session(m, "CPUExecutionProvider", record=False)
    (r,) = rs
    step = next(st for st in r.trace_program.steps if st.node.op_type == "MatMulNBits")
    assert step.opdef.fn.__name__ == fn
    for _ in range(4):          # eager, traced and verified, then replayed twice
        f = {"a": RNG.standard_normal((5, 64)).astype(np.float32)}
        assert_close(s.run(None, f)[0], cpu.run(None, f)[0], what="mlx vs cpu")
    assert r.trace_counts() == [1] and r.counters["compiled_calls"] == 2, r.counters
    assert r.counters["poisoned_closures"] == 0


@pytest.mark.parametrize("half", [0, 1])
def test_matmul_nbits_half_products_stay_half_only_when_asked(half, monkeypatch):
    """tuning ``half_nbits``: a float16 MatMulNBits runs mx.quantized_matmul on float16 activations and
    scales (eager and prepacked-traced alike); by default on float32 ones. Either way the CPU EP's answer
    (float32 math, one rounding) within float16 accumulation's error: outputs ~3, partial sums of 64
    products rounded at 2^-11 -> atol 5e-2 (a wrong zero point or scale is off by ~1)."""
    import mlx.core as mx
    real, seen = mx.quantized_matmul, []

    def spy(x, w, scales=None, biases=None, **kw):
        seen.append((x.dtype, scales.dtype))
        return real(x, w, scales, biases, **kw)
    monkeypatch.setattr(mx, "quantized_matmul", spy)
    m = mnb_model(t=T.FLOAT16)
    s, rs = compiled_session(m, {"tuning": f"dense_nbits=0,half_nbits={half}"})
    cpu = session(m, "CPUExecutionProvider", record=False)
    (r,) = rs
    for _ in range(4):          # eager, traced and verified, then replayed twice
        f = {"a": RNG.standard_normal((5, 64)).astype(np.float16)}
        assert_close(s.run(None, f)[0], cpu.run(None, f)[0], rtol=1e-2, atol=5e-2 if half else 2e-3,
                     what="mlx vs cpu")
    assert r.trace_counts() == [1] and r.counters["compiled_calls"] == 2, r.counters
    want = (mx.float16, mx.float16) if half else (mx.float32, mx.float32)
    assert seen and set(seen) == {want}, seen


def rope_model(rows=16, S=3):
    cos = np.cos(np.outer(np.arange(rows), 1.0 / 10000 ** (np.arange(8) / 8))).astype(np.float32)
    sin = np.sin(np.outer(np.arange(rows), 1.0 / 10000 ** (np.arange(8) / 8))).astype(np.float32)
    node = helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], domain="com.microsoft",
                            num_heads=4)
    return make_model([node], [("x", T.FLOAT, ["batch_size", S, 64]), ("pos", T.INT64, ["batch_size", S])],
                      [("y", T.FLOAT, ["batch_size", S, 64])], {"cos": cos, "sin": sin},
                      opset=17, extra_opsets={"com.microsoft": 1})


def test_rotary_positions_as_data_replay_and_guard():
    m = rope_model()
    s, rs = compiled_session(m)
    ref = session(m, options={"no_compile": "1"})
    cpu = session(m, "CPUExecutionProvider", record=False)
    x = RNG.standard_normal((1, 3, 64)).astype(np.float32)
    for start in (0, 2, 4, 9, 13):      # the shape's first call is eager, its second traces and verifies
        f = {"x": x, "pos": np.arange(start, start + 3, dtype=np.int64).reshape(1, 3)}
        assert_close(s.run(None, f)[0], cpu.run(None, f)[0], what="mlx vs cpu")
    (p,) = [p for p in parts(rs) if p.trace_counts()]
    assert p.trace_counts() == [1] and p.counters["compiled_calls"] == 3, p.counters
    bad = {"x": x, "pos": np.array([[14, 15, 16]], np.int64)}      # row 16 is past the 16-row cache
    with pytest.raises(Exception, match="rotary cache"):
        ref.run(None, bad)
    with pytest.raises(Exception, match="rotary cache"):
        s.run(None, bad)
    assert p.counters["guard_fails"] == 1 and p.counters["poisoned_closures"] == 0, p.counters


def gqa_decode_model(n=4, kvn=2, h=16):
    """GroupQueryAttention with genai's dim names (the decode closure's shape) and its own present outputs."""
    f = T.FLOAT
    node = helper.make_node("GroupQueryAttention", ["query", "key", "value", "past_key", "past_value", "seqlens_k",
                                                    "total_sequence_length"],
                            ["output", "present_key", "present_value"], domain="com.microsoft",
                            num_heads=n, kv_num_heads=kvn)
    ins = [("query", f, ["batch_size", "sequence_length", n * h]),
           ("key", f, ["batch_size", "sequence_length", kvn * h]),
           ("value", f, ["batch_size", "sequence_length", kvn * h]),
           ("past_key", f, ["batch_size", kvn, "past_sequence_length", h]),
           ("past_value", f, ["batch_size", kvn, "past_sequence_length", h]),
           ("seqlens_k", T.INT32, ["batch_size"]), ("total_sequence_length", T.INT32, [])]
    outs = [("output", f, None), ("present_key", f, None), ("present_value", f, None)]
    return make_model([node], ins, outs, extra_opsets={"com.microsoft": 1})


def test_decode_present_in_its_own_buffer_is_ort_s():
    """The decode closure writes the new K/V row in place (rows past it stay the past's, as in a shared
    buffer). Given separate present buffers, ORT's kernel leaves those rows zero: Compute zeroes them,
    so every call equals the CPU EP, also after the closure is trusted on a past whose tail was zero."""
    n, kvn, h, P = 4, 2, 16, 12
    m = gqa_decode_model(n, kvn, h)
    s, rs = compiled_session(m)
    cpu = session(m, "CPUExecutionProvider", record=False)
    for k, seqlen in enumerate([3, 4, 5, 6, 7, 3, 9]):
        past = RNG.standard_normal((2, 1, kvn, P, h)).astype(np.float32)
        if k < 2:
            past[..., seqlen:, :] = 0.0                    # the calls that verify the closure see a zero tail
        feed = {"query": RNG.standard_normal((1, 1, n * h)).astype(np.float32),
                "key": RNG.standard_normal((1, 1, kvn * h)).astype(np.float32),
                "value": RNG.standard_normal((1, 1, kvn * h)).astype(np.float32),
                "past_key": past[0], "past_value": past[1],
                "seqlens_k": np.array([seqlen], np.int32), "total_sequence_length": np.array(seqlen + 1, np.int32)}
        for name, g, w in zip(("output", "present_key", "present_value"), s.run(None, feed), cpu.run(None, feed)):
            assert_close(g, w, what=f"call {k} {name}")
    decode = [p for p in parts(rs) if p.label == "decode"]
    assert decode and decode[0].counters["compiled_calls"] >= 4, [p.counters for p in parts(rs)]


def gqa_two_layer_model(n=4, kvn=2, h=16):
    """Two decode GroupQueryAttention layers on one seqlens_k / total_sequence_length (as genai's)."""
    f = T.FLOAT
    nodes, ins, outs = [], [("query", f, ["batch_size", "sequence_length", n * h]),
                            ("key", f, ["batch_size", "sequence_length", kvn * h]),
                            ("value", f, ["batch_size", "sequence_length", kvn * h]),
                            ("seqlens_k", T.INT32, ["batch_size"]), ("total_sequence_length", T.INT32, [])], []
    q = "query"
    for layer in range(2):
        pk, pv = f"past_key_{layer}", f"past_value_{layer}"
        ins += [(pk, f, ["batch_size", kvn, "past_sequence_length", h]),
                (pv, f, ["batch_size", kvn, "past_sequence_length", h])]
        nodes.append(helper.make_node("GroupQueryAttention", [q, "key", "value", pk, pv, "seqlens_k",
                                                              "total_sequence_length"],
                                      [f"o{layer}", f"present_key_{layer}", f"present_value_{layer}"],
                                      domain="com.microsoft", num_heads=n, kv_num_heads=kvn))
        outs += [(f"present_key_{layer}", f, None), (f"present_value_{layer}", f, None)]
        q = f"o{layer}"
    return make_model(nodes, ins, [("o1", f, None)] + outs, extra_opsets={"com.microsoft": 1})


def test_layers_share_one_guard_and_a_false_one_answers_eagerly(monkeypatch):
    """Every decode layer's guard on the same seqlens_k is one object: the closure ands it once
    (one fused kernel with the other one-element guards). A step outside the buffer fails it:
    that call answers from eager, the closure stays trusted."""
    from ortmlx.compiled import trace
    seen = []
    real = trace._guard_value
    monkeypatch.setattr(trace, "_guard_value", lambda guards, shapeless: seen.append(len(guards)) or
                        real(guards, shapeless))
    n, kvn, h, P = 4, 2, 16, 12
    m = gqa_two_layer_model(n, kvn, h)
    s, rs = compiled_session(m)
    ref = session(m, options={"no_compile": "1"})
    cpu = session(m, "CPUExecutionProvider", record=False)

    def feed(seqlen, total):
        f = {"query": RNG.standard_normal((1, 1, n * h)).astype(np.float32),
             "key": RNG.standard_normal((1, 1, kvn * h)).astype(np.float32),
             "value": RNG.standard_normal((1, 1, kvn * h)).astype(np.float32),
             "seqlens_k": np.array([seqlen], np.int32), "total_sequence_length": np.array(total, np.int32)}
        for layer in range(2):
            for kind in ("key", "value"):
                past = RNG.standard_normal((1, kvn, P, h)).astype(np.float32)
                past[..., seqlen:, :] = 0.0     # separate presents: ORT's rows past the new one are zero
                f[f"past_{kind}_{layer}"] = past
        return f
    for seqlen in (3, 4, 5, 6, 7):
        f = feed(seqlen, seqlen + 1)
        for k, (g, w) in enumerate(zip(s.run(None, f), cpu.run(None, f))):
            assert_close(g, w, what=f"seqlen {seqlen} output {k}")
    (p,) = [p for p in parts(rs) if p.label == "decode"]
    assert p.counters["compiled_calls"] >= 3 and p.counters["guard_fails"] == 0, p.counters
    assert seen == [1], seen                    # two layers, one guard
    bad = feed(P, P + 1)                        # total P + 1 > the buffer's P rows: eager's answer, not the trace's
    for k, (g, w) in enumerate(zip(s.run(None, bad), ref.run(None, bad))):
        np.testing.assert_array_equal(g, w, err_msg=f"guarded call output {k}")
    assert p.counters["guard_fails"] == 1 and p.counters["poisoned_closures"] == 0, p.counters
    f = feed(8, 9)
    for k, (g, w) in enumerate(zip(s.run(None, f), cpu.run(None, f))):
        assert_close(g, w, what=f"after the guard, output {k}")


def test_guard_value_ands_every_guard():
    """``trace._guard_value``: false when any guard has a false element, one-element guards and
    larger ones mixed, and in a shapeless trace (each reduced there)."""
    import mlx.core as mx
    from ortmlx.compiled.trace import _guard_value
    t1, f1 = mx.array([True]), mx.array([[False]])
    big_t, big_f = mx.array([True, True, True]), mx.array([True, False, True])
    cases = [([t1], True), ([f1], False), ([t1, mx.array(True)], True), ([t1, f1, t1], False),
             ([big_t, t1], True), ([big_f, t1], False), ([t1, big_t, f1], False), ([big_t, big_f], False)]
    for shapeless in (False, True):
        for guards, want in cases:
            got = _guard_value(guards, shapeless)
            assert got.size == 1 and bool(got.item()) is want, (shapeless, guards, want)
