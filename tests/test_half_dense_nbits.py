"""Half-precision MatMulNBits as plain MatMuls over weights dequantized once (``merge.nbits_as_matmuls``,
tuning ``half_dense_nbits``; on by default on a GPU with the custom kernels): which nodes it takes, the weight
it makes, and the answers against ORT's CPU EP."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from ortmlx import compiled as C
from ortmlx import ir
from ortmlx.kernels import merge
from ortmlx.kernels import dtypes as dt
from ortmlx.testing import check_against_cpu, make_model

F16 = TensorProto.FLOAT16
ON = {"tuning": "half_dense_nbits=1"}


def _packed(rng, N, K, bits, bs):
    kb = -(-K // bs)
    return rng.integers(0, 256, (N, kb, bs * bits // 8), dtype=np.uint8), kb


def _reference_weight(B, scales, zp, K, N, bits, bs) -> np.ndarray:
    """(K, N) float16 of ((q - zero point) * scale), in float64 then rounded once: ORT's layout read plainly
    (values low bits first, one zero point per block packed like the values, 2^(bits-1) without them)."""
    kb = B.shape[1]
    per = 8 // bits
    q = np.stack([(B >> (bits * j)) & ((1 << bits) - 1) for j in range(per)], axis=-1).reshape(N, kb, -1)
    if zp is None:
        z = np.full((N, kb), 1 << (bits - 1))
    else:
        zq = np.stack([(zp.reshape(N, -1) >> (bits * j)) & ((1 << bits) - 1) for j in range(per)], -1)
        z = zq.reshape(N, -1)[:, :kb]
    w = (q.astype(np.int64) - z[..., None].astype(np.int64)) * scales.astype(np.float64).reshape(N, kb, 1)
    return w.reshape(N, -1)[:, :K].T.astype(np.float16)


def _graph(K, N, bits, bs, *, zp=False, a_type=dt.FLOAT16, bias=False, shared=False, seed=0):
    rng = np.random.default_rng(seed)
    B, kb = _packed(rng, N, K, bits, bs)
    consts = {"B": B, "s": (rng.standard_normal(N * kb) * 0.05).astype(np.float16)}
    ins = ["A", "B", "s", ""]
    if zp:
        consts["z"] = rng.integers(0, 256, N * (-(-kb * bits // 8)), dtype=np.uint8)
        ins[3] = "z"
    if bias:
        consts["bias"] = rng.standard_normal(N).astype(np.float16)
        ins += ["", "bias"]
    nodes = [ir.Node("mm", "MatMulNBits", "com.microsoft", 1, ins, ["Y"],
                     {"K": K, "N": N, "bits": bits, "block_size": bs})]
    outs = ["Y"]
    if shared:          # a tied embedding reads the same packed weight
        nodes.append(ir.Node("emb", "GatherBlockQuantized", "com.microsoft", 1, ["B", "ids", "s"], ["E"],
                             {"bits": bits, "block_size": bs}))
        outs.append("E")
    values = {"A": ir.ValueInfo("A", a_type, (2, K)), "Y": ir.ValueInfo("Y", a_type, (2, N))}
    return ir.Graph(nodes, ["A"] + (["ids"] if shared else []), outs, values, consts, "g")


@pytest.mark.parametrize("bits,bs,K,zp", [(4, 32, 64, False), (4, 32, 80, True), (4, 16, 40, True), (4, 64, 128, True)])
def test_weight_is_the_dequantized_one(bits, bs, K, zp):
    N = 24
    g = _graph(K, N, bits, bs, zp=zp)
    new = merge.nbits_as_matmuls(g)
    (node,) = new.nodes
    assert (node.op_type, node.domain, node.outputs) == ("MatMul", "", ["Y"])
    w = new.constants[node.inputs[1]]
    assert w.dtype == np.float16 and w.shape == (K, N) and new.values[node.inputs[1]].dtype == dt.FLOAT16
    want = _reference_weight(g.constants["B"], g.constants["s"], g.constants.get("z"), K, N, bits, bs)
    np.testing.assert_array_equal(w, want)
    assert "B" not in new.constants and "s" not in new.constants        # read by nothing else: not kept
    assert g.nodes[0].op_type == "MatMulNBits" and "B" in g.constants   # the original is untouched


def test_what_it_leaves():
    """float32 A, a bias input, 8 or 2 bits (a float16 weight would round their products more than ORT's CPU EP),
    weights over the cap: left as they are; a packed weight another node reads stays."""
    assert merge.nbits_as_matmuls(_graph(64, 8, 4, 32, a_type=dt.FLOAT)) is None
    assert merge.nbits_as_matmuls(_graph(64, 8, 8, 32)) is None and merge.nbits_as_matmuls(_graph(64, 8, 2, 32)) is None
    assert merge.nbits_as_matmuls(_graph(64, 8, 4, 32, bias=True)) is None
    assert merge.nbits_as_matmuls(_graph(64, 8, 4, 32), cap=2 * 64 * 8 - 1) is None
    assert merge.nbits_as_matmuls(_graph(64, 8, 4, 32), cap=2 * 64 * 8) is not None
    new = merge.nbits_as_matmuls(_graph(64, 8, 4, 32, shared=True))
    assert [n.op_type for n in new.nodes] == ["MatMul", "GatherBlockQuantized"]
    assert "B" in new.constants and "s" in new.constants


def _model(K, N, bits, bs, zp):
    rng = np.random.default_rng(3)
    B, kb = _packed(rng, N, K, bits, bs)
    inits = {"B": B, "s": (rng.standard_normal(N * kb) * 0.05).astype(np.float16)}
    ins = ["A", "B", "s"]
    if zp:
        inits["z"] = rng.integers(0, 256, N * (-(-kb * bits // 8)), dtype=np.uint8)
        ins.append("z")
    node = helper.make_node("MatMulNBits", ins, ["Y"], domain="com.microsoft", K=K, N=N, bits=bits, block_size=bs)
    return make_model([node], [("A", F16, ["M", K])], [("Y", F16, None)], inits, extra_opsets={"com.microsoft": 1})


@pytest.mark.parametrize("bits,bs,K,zp", [(4, 32, 64, True), (4, 16, 80, False), (4, 128, 256, True)])
def test_session_answers_as_the_cpu_ep(bits, bs, K, zp):
    """Through ORT: the group's program holds a MatMul (not MatMulNBits) and answers within float16's rounding
    of ORT's CPU EP (float32 sums, one rounding of Y; the weight rounded to float16 once more)."""
    r = np.random.default_rng(1)
    with C.capture() as rs:
        check_against_cpu(_model(K, 24, bits, bs, zp), [{"A": r.standard_normal((3, K)).astype(np.float16)},
                                                        {"A": r.standard_normal((1, K)).astype(np.float16)}],
                          rtol=2e-3, atol=2e-3, options=ON)
    ops = {st.node.op_type for run in rs for st in run.program.steps}
    assert ops == {"MatMul"}, ops
    # the weight lives on the device; its host copy was let go after the build
    made = {k: v for run in rs for k, v in run.program.graph.constants.items() if k.endswith("::half")}
    assert made and all(v.size == 0 for v in made.values()), {k: v.shape for k, v in made.items()}
    assert all(run.program.constants[k].shape == (K, 24) for run in rs for k in made)


def test_default_on_a_gpu_only():
    from ortmlx.kernels.passes import BuildConfig
    from ortmlx.tuning import Tuning
    assert BuildConfig.for_device("gpu").half_dense_nbits
    assert not BuildConfig.for_device("gpu", Tuning(cuda_kernels=False)).half_dense_nbits
    assert not BuildConfig.for_device("cpu").half_dense_nbits
    assert not BuildConfig.for_device("gpu", Tuning(half_dense_nbits=False)).half_dense_nbits


def test_bfloat16_weight_travels_as_bits():
    """bf16 A and scales (bits in uint16, as the graph holds bf16 constants): the weight is the bf16 of the same
    values, held as its bits and typed BFLOAT16."""
    import mlx.core as mx
    g = _graph(64, 8, 4, 32, zp=True, a_type=dt.BFLOAT16)
    s16 = np.asarray(mx.array(g.constants["s"].astype(np.float32)).astype(mx.bfloat16).view(mx.uint16))
    g.constants["s"] = s16
    new = merge.nbits_as_matmuls(g)
    name = new.nodes[0].inputs[1]
    w = new.constants[name]
    assert w.dtype == np.uint16 and new.values[name].dtype == dt.BFLOAT16
    scales = np.asarray(mx.array(s16).view(mx.bfloat16).astype(mx.float32))
    kb = g.constants["B"].shape[1]
    q = np.stack([(g.constants["B"] >> (4 * j)) & 15 for j in range(2)], -1).reshape(8, kb, -1).astype(np.int64)
    z = np.stack([(g.constants["z"].reshape(8, -1) >> (4 * j)) & 15 for j in range(2)], -1).reshape(8, -1)[:, :kb]
    f32 = ((q - z[..., None]) * scales.reshape(8, kb, 1)).reshape(8, -1).T.astype(np.float32)    # exact in float32
    np.testing.assert_array_equal(w, np.asarray(mx.array(f32).astype(mx.bfloat16).view(mx.uint16)))
