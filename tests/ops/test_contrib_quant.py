"""MatMulNBits and GatherBlockQuantized vs ORT's CPU EP."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortmlx.testing import check_against_cpu, make_model, session, unclaimed_ops

MS = {"com.microsoft": 1}
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
NP = {F32: np.float32, F16: np.float16}
#: ORT (MLAS, blockwise) and MLX sum K products in different orders
TOL = {F32: dict(rtol=1e-4, atol=1e-4), F16: dict(rtol=1e-3, atol=1e-3)}   # fp16: float32 math, one rounding


def nbits_model(t, K, N, bits, bs, *, zp=None, bias=False, a_shape=("M", None), accuracy_level=None, seed=0):
    """zp: None, 'u8' (packed uint8) or 'float'."""
    r = np.random.default_rng(seed)
    kb = -(-K // bs)
    blob = bs * bits // 8
    inits = {"B": r.integers(0, 256, (N, kb, blob), dtype=np.uint8),
             "scales": (r.standard_normal(N * kb) * 0.05).astype(NP[t])}
    ins = ["A", "B", "scales"]
    if zp == "u8":
        inits["zp"] = r.integers(0, 256, N * (-(-kb * bits // 8)), dtype=np.uint8)
    elif zp == "float":
        inits["zp"] = (r.standard_normal(N * kb) * 2 + (1 << (bits - 1))).astype(NP[t])
    ins.append("zp" if zp else "")
    if bias:
        ins += ["", "bias"]
        inits["bias"] = r.standard_normal(N).astype(NP[t])
    attrs = dict(K=K, N=N, bits=bits, block_size=bs)
    if accuracy_level is not None:
        attrs["accuracy_level"] = accuracy_level
    node = helper.make_node("MatMulNBits", ins, ["Y"], domain="com.microsoft", **attrs)
    shape = [d if d is not None else K for d in a_shape]
    return make_model([node], [("A", t, shape)], [("Y", t, None)], inits, extra_opsets=MS)


# (id, dtype, K, N, bits, block_size, kwargs, A shapes)
NBITS_CASES = [
    ("int4_bs32", F32, 64, 24, 4, 32, {}, [(3, 64), (1, 64)]),
    ("int4_bs16_dequant_path", F32, 64, 8, 4, 16, {}, [(2, 64)]),
    ("int4_bs64_zp_u8", F32, 128, 16, 4, 64, dict(zp="u8"), [(5, 128)]),
    ("int4_bs128_zp_odd_blocks", F32, 384, 8, 4, 128, dict(zp="u8"), [(2, 384)]),
    ("int4_bs256_dequant_path", F32, 256, 8, 4, 256, dict(zp="u8"), [(2, 256)]),
    ("int4_k_not_multiple", F32, 80, 8, 4, 32, dict(zp="u8", bias=True), [(3, 80)]),
    ("int4_zp_float", F32, 64, 8, 4, 32, dict(zp="float"), [(2, 64)]),
    ("int4_bias_3d", F32, 64, 8, 4, 32, dict(bias=True, a_shape=("B", "S", None)), [(2, 3, 64)]),
    ("int2_bs32", F32, 64, 16, 2, 32, {}, [(3, 64)]),
    ("int2_bs16_zp_k_odd", F32, 80, 8, 2, 16, dict(zp="u8", bias=True), [(2, 80)]),
    ("int2_bs64_zp", F32, 128, 8, 2, 64, dict(zp="u8"), [(2, 128)]),
    ("int8_bs32", F32, 64, 16, 8, 32, {}, [(3, 64)]),
    ("int8_bs128_zp", F32, 256, 8, 8, 128, dict(zp="u8", bias=True), [(4, 256)]),
    ("int8_bs16_zp_k_odd", F32, 40, 8, 8, 16, dict(zp="u8"), [(2, 40)]),
    ("int4_acc_level0", F32, 64, 8, 4, 32, dict(accuracy_level=0), [(2, 64)]),
    ("fp16_int4", F16, 64, 16, 4, 32, dict(zp="u8", bias=True), [(3, 64)]),
    ("fp16_int8", F16, 64, 16, 8, 64, {}, [(3, 64)]),
]


@pytest.mark.parametrize("case", NBITS_CASES, ids=[c[0] for c in NBITS_CASES])
def test_matmul_nbits(case):
    _, t, K, N, bits, bs, kw, shapes = case
    model = nbits_model(t, K, N, bits, bs, **kw)
    r = np.random.default_rng(1)
    feeds = [{"A": r.standard_normal(s).astype(NP[t])} for s in shapes]
    check_against_cpu(model, feeds, **TOL[t])


def test_matmul_nbits_int8_float_zp_refused():
    """ORT's CPU kernel cannot run 8-bit with float zero points: we refuse it too."""
    s = session(nbits_model(F32, 64, 8, 8, 32, zp="float"))
    assert unclaimed_ops(s) == {"MatMulNBits": 1}


@pytest.mark.parametrize("bits", [4, 8])
def test_matmul_nbits_accuracy_level4(bits):
    """Level 4: ORT's CPU quantizes A to int8 per block; we compute in float. Stated tolerance:
    |MLX - CPU| <= 1% of max|Y| (the int8 rounding of A, <= max|A_block|/254 per element)."""
    model = nbits_model(F32, 128, 16, bits, 32, zp="u8", accuracy_level=4)
    a = np.random.default_rng(1).standard_normal((4, 128)).astype(np.float32)
    ms = session(model)
    assert not unclaimed_ops(ms)
    got = ms.run(None, {"A": a})[0]
    want = session(model, "CPUExecutionProvider", record=False).run(None, {"A": a})[0]
    exact = session(nbits_model(F32, 128, 16, bits, 32, zp="u8", accuracy_level=0),
                    "CPUExecutionProvider", record=False).run(None, {"A": a})[0]
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


def gbq_model(st, rows, cols, bits, bs, idx_shape, *, zp=False, gather_axis=0, quantize_axis=1,
              lead=(), itype=TensorProto.INT64, seed=0):
    r = np.random.default_rng(seed)
    kb = -(-cols // bs)
    shape = tuple(lead) + (rows, cols * bits // 8)
    inits = {"data": r.integers(0, 256, shape, dtype=np.uint8),
             "scales": (r.standard_normal(tuple(lead) + (rows, kb)) * 0.1).astype(NP[st])}
    ins = ["data", "indices", "scales"]
    if zp:
        inits["zp"] = r.integers(0, 256, tuple(lead) + (rows, -(-kb * bits // 8)), dtype=np.uint8)
        ins.append("zp")
    node = helper.make_node("GatherBlockQuantized", ins, ["out"], domain="com.microsoft", bits=bits,
                            block_size=bs, gather_axis=gather_axis, quantize_axis=quantize_axis)
    return make_model([node], [("indices", itype, idx_shape)], [("out", st, None)], inits, extra_opsets=MS)


# (id, scale dtype, rows, cols, bits, block, indices, kwargs)
GBQ_CASES = [
    ("int4_bs32", F32, 10, 64, 4, 32, [[1, 4, 9]], {}),
    ("int4_zp", F32, 10, 64, 4, 16, [0, 9, 3, 3], dict(zp=True)),
    ("int4_zp_odd_blocks", F32, 6, 96, 4, 32, [5, 0], dict(zp=True)),
    ("int8_zp", F32, 10, 64, 8, 32, [[2], [7]], dict(zp=True)),
    ("int8_bs128", F32, 5, 256, 8, 128, [4, 1], {}),
    ("int4_cols_not_multiple", F32, 5, 48, 4, 32, [4, 1], dict(zp=True)),
    ("int32_indices", F32, 8, 64, 4, 32, [7, 0], dict(itype=TensorProto.INT32)),
    ("negative_indices", F32, 8, 64, 4, 32, [-1, -8, 3], {}),
    ("fp16", F16, 10, 64, 4, 32, [[1, 4, 9]], dict(zp=True)),
    ("rank3", F32, 6, 64, 4, 32, [[2, 0]], dict(lead=(3,), quantize_axis=2, zp=True)),
]


@pytest.mark.parametrize("case", GBQ_CASES, ids=[c[0] for c in GBQ_CASES])
def test_gather_block_quantized(case):
    _, st, rows, cols, bits, bs, idx, kw = case
    idx = np.asarray(idx)
    itype = kw.get("itype", TensorProto.INT64)
    model = gbq_model(st, rows, cols, bits, bs, list(idx.shape), **kw)
    feeds = [{"indices": idx.astype(np.int32 if itype == TensorProto.INT32 else np.int64)}]
    check_against_cpu(model, feeds, rtol=1e-6, atol=1e-7)


def test_gather_block_quantized_bad_index_is_clear_error():
    model = gbq_model(F32, 8, 64, 4, 32, [2])
    with pytest.raises(Exception, match="out of range"):
        session(model).run(None, {"indices": np.array([1, 8], np.int64)})


def test_matmul_nbits_g_idx_refused_stays_on_cpu():
    """g_idx (act-order) is refused even when trivial: the node stays on CPU, answer right."""
    model = nbits_model(F32, 64, 8, 4, 32, zp="u8")
    node = model.graph.node[0]
    del node.input[:]
    node.input.extend(["A", "B", "scales", "zp", "g_idx"])
    model.graph.initializer.append(numpy_helper.from_array((np.arange(64) // 32).astype(np.int32), "g_idx"))
    assert unclaimed_ops(session(model)) == {"MatMulNBits": 1}
    a = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    check_against_cpu(model, [{"A": a}], all_on_mlx=False)


@pytest.mark.parametrize("case", [c for c in NBITS_CASES if c[0] in ("int4_bs32", "int4_k_not_multiple", "int8_bs128_zp")],
                         ids=lambda c: c[0])
def test_matmul_nbits_bf16(case):
    """No bf16 kernel on ORT's CPU: bf16 on MLX vs float32 on CPU with bf16-rounded A, scales and
    bias. Stated tolerance: float32 math, one bf16 rounding of Y (2^-8 relative) -> rtol 1e-2."""
    from _contrib_bf16 import check_bf16_vs_fp32
    _, _, K, N, bits, bs, kw, shapes = case
    model = nbits_model(F32, K, N, bits, bs, **kw)
    r = np.random.default_rng(1)
    check_bf16_vs_fp32(model, [{"A": r.standard_normal(s).astype(np.float32)} for s in shapes], rtol=1e-2, atol=1e-2)
