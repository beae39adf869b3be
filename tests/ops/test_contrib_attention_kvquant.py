"""GroupQueryAttention with a quantized KV cache (kv_cache_bit_width 8: int8; 4: uint8, two values a byte)
vs ORT's CPU EP, which runs those (float8 caches it does not: refused).

Measured there: new K/V rows (after the rotary) are stored as clamp(rint(x * (1 / scale))), round half to
even (4-bit: value + 8 in a nibble, low first), attention reads the dequantized cache q * scale, past rows are
kept as they are. The presents must be equal byte for byte; outputs within float32 rounding. Each case feeds
the presents back as the next step's past (prefill, decodes, a chunk), the dims named as genai's models name
them, so the decode steps run through the compiled decode closure."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from test_contrib_attention import _cos_sin

import ortmlx
import ortmlx.compiled as C
from ortmlx.testing import assert_close, make_model, session, unclaimed_ops

F32 = TensorProto.FLOAT


def kvq_model(n, kvn, h, bits, qt, *, rotary=False, packed=False, scale_values=None, cache_type=None):
    ct = cache_type or (TensorProto.INT8 if bits == 8 else TensorProto.UINT8)
    hp = h if bits == 8 else h // 2
    ins = ["query", "" if packed else "key", "" if packed else "value", "past_key", "past_value", "seqlens_k",
           "total_sequence_length", "cos" if rotary else "", "sin" if rotary else "", "", "", "", "ks", "vs"]
    attrs = dict(num_heads=n, kv_num_heads=kvn, kv_cache_bit_width=bits, k_quant_type=qt, v_quant_type=qt)
    if rotary:
        attrs["do_rotary"] = 1
    node = helper.make_node("GroupQueryAttention", ins, ["o", "present_key", "present_value"], domain="com.microsoft",
                            **attrs)
    r = np.random.default_rng(1)

    def scale():
        if scale_values is not None:
            return np.asarray(scale_values, np.float32)
        if qt == "PER_TENSOR":
            return np.array([0.05], np.float32)
        return (0.02 + 0.05 * r.random((1, kvn, 1, h))).astype(np.float32)
    inits = {"ks": scale(), "vs": scale()}
    if rotary:
        c, s = _cos_sin(64, h)
        inits.update(cos=c, sin=s)
    qw = (n + 2 * kvn) * h if packed else n * h
    inputs = [("query", F32, ["batch_size", "sequence_length", qw])]
    if not packed:
        inputs += [("key", F32, ["batch_size", "sequence_length", kvn * h]),
                   ("value", F32, ["batch_size", "sequence_length", kvn * h])]
    inputs += [("past_key", ct, ["batch_size", kvn, "max_length", hp]), ("past_value", ct, ["batch_size", kvn, "max_length", hp]),
               ("seqlens_k", TensorProto.INT32, ["batch_size"]), ("total_sequence_length", TensorProto.INT32, [])]
    return make_model([node], inputs, [("o", F32, None), ("present_key", ct, None), ("present_value", ct, None)],
                      inits, extra_opsets={"com.microsoft": 1})


CASES = [("int8_tensor", 2, 1, 16, 8, "PER_TENSOR", {}), ("int8_channel_rotary", 4, 2, 16, 8, "PER_CHANNEL",
                                                               dict(rotary=True)),
         ("int4_channel_rotary", 4, 2, 16, 4, "PER_CHANNEL", dict(rotary=True)),
         ("int4_tensor_packed", 2, 1, 16, 4, "PER_TENSOR", dict(packed=True))]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gqa_quantized_kv_cache(case):
    _, n, kvn, h, bits, qt, kw = case
    model = kvq_model(n, kvn, h, bits, qt, **kw)
    with C.capture() as rs:
        ms = session(model)
    cs = session(model, "CPUExecutionProvider", record=False)
    assert not unclaimed_ops(ms), dict(unclaimed_ops(ms))
    hp = h if bits == 8 else h // 2
    npt = np.int8 if bits == 8 else np.uint8
    pm = pc = (np.zeros((1, kvn, 16, hp), npt), np.zeros((1, kvn, 16, hp), npt))
    r = np.random.default_rng(0)
    t = 0
    for step, s in enumerate([5, 1, 1, 1, 1, 3, 1]):
        t += s
        qw = (n + 2 * kvn) * h if kw.get("packed") else n * h
        f = {"query": (r.standard_normal((1, s, qw)) * 0.5).astype(np.float32),
             "seqlens_k": np.array([t - 1], np.int32), "total_sequence_length": np.array(t, np.int32)}
        if not kw.get("packed"):
            f["key"] = (r.standard_normal((1, s, kvn * h)) * 0.3).astype(np.float32)
            f["value"] = (r.standard_normal((1, s, kvn * h)) * 0.3).astype(np.float32)
        gm = ms.run(None, {**f, "past_key": pm[0], "past_value": pm[1]})
        gc = cs.run(None, {**f, "past_key": pc[0], "past_value": pc[1]})
        assert_close(gm[0], gc[0], rtol=1e-4, atol=1e-5, what=f"step {step} output")
        np.testing.assert_array_equal(gm[1], gc[1], err_msg=f"step {step} present_key")
        np.testing.assert_array_equal(gm[2], gc[2], err_msg=f"step {step} present_value")
        pm, pc = (gm[1], gm[2]), (gc[1], gc[2])
    (att,) = [x for x in rs if hasattr(x, "decode")]
    c = att.decode.counters
    assert att.decode.trace_counts() == [1] and c["compiled_calls"] >= 3 and c["poisoned_closures"] == 0, c


def test_quantize_round_half_even_times_inverse_scale():
    """Values at exact ties of x * (1 / scale) and where x / scale rounds differently: ORT multiplies by the
    float32 inverse and rounds half to even; the present's bytes must match."""
    s = np.float32(0.037)
    inv = np.float32(1) / s
    base = (np.arange(-100, 100) + 0.5).astype(np.float32) * s
    picks = [x for x in base if np.rint(x / s) != np.rint(x * inv)][:8]
    ties = (np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 4.5], np.float32) * np.float32(0.25)).tolist()
    key = np.array(picks + ties, np.float32)[:16].reshape(1, 1, 16)
    assert key.size == 16
    for model in (kvq_model(2, 1, 16, 8, "PER_TENSOR", scale_values=[0.037]),):
        f = {"query": np.ones((1, 1, 32), np.float32), "key": key, "value": key,
             "past_key": np.zeros((1, 1, 4, 16), np.int8), "past_value": np.zeros((1, 1, 4, 16), np.int8),
             "seqlens_k": np.array([0], np.int32), "total_sequence_length": np.array(1, np.int32)}
        got, want = session(model).run(None, f), session(model, "CPUExecutionProvider", record=False).run(None, f)
        np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("kw,reason", [
    (dict(cache_type=TensorProto.FLOAT8E4M3FN), "float8e4m3fn"),   # float8 cache: ORT's CPU EP has no kernel
    (dict(scale_values=[0.0]), "non-positive"),
])
def test_quantized_kv_cache_refused(kw, reason):
    model = kvq_model(2, 1, 16, 8, "PER_TENSOR", **kw)
    try:
        session(model)
    except Exception:  # noqa: BLE001 - the CPU EP may reject what it was left
        pass
    rep = ortmlx.partition_reports()[-1]
    assert [u.op for u in rep.unclaimed] == ["com.microsoft.GroupQueryAttention"], rep.format()
    assert reason in rep.unclaimed[0].reason, rep.unclaimed[0].reason
