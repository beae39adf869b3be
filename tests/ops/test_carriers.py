"""Carrier types (float8, int4/uint4, int2/uint2): Cast/CastLike bit-exact against ORT's CPU EP.

Inputs and outputs of these types cross ORT's Python binding as OrtValues holding ORT's raw storage
(float8 bytes; 4-/2-bit values packed low bits first), so every comparison here is of raw bytes:
NaN payloads, signed zeros and packing included.
"""
from __future__ import annotations

import ctypes

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper

from ortmlx import testing
from ortmlx.kernels import dtypes as dt

OPSET = 25                      # Cast-25 / CastLike-25 take the 2-bit types
F8 = [T.FLOAT8E4M3FN, T.FLOAT8E4M3FNUZ, T.FLOAT8E5M2, T.FLOAT8E5M2FNUZ]
# ONNX numbers (models) -> bits, signed; ORT's C enum numbers the 2-bit types one lower (dtypes.py)
SUB = {T.UINT4: (4, False), T.INT4: (4, True), T.UINT2: (2, False), T.INT2: (2, True)}
NP = {T.FLOAT: np.float32, T.FLOAT16: np.float16, T.INT8: np.int8, T.UINT8: np.uint8, T.INT16: np.int16,
      T.INT32: np.int32, T.INT64: np.int64, T.UINT16: np.uint16, T.UINT32: np.uint32, T.UINT64: np.uint64}


def _nbytes(t: int, n: int) -> int:
    bits = SUB[t][0] if t in SUB else 8
    return (n * bits + 7) // 8


def _value(t: int, data, n: int | None = None, shape=None) -> ort.OrtValue:
    """An OrtValue of element type ``t``: numpy data for numpy types, raw storage bytes for carriers."""
    if t in NP:
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(data, NP[t]))
    raw = np.ascontiguousarray(data, np.uint8).tobytes()
    v = ort.OrtValue.ortvalue_from_shape_and_type(list(shape) if shape is not None else [n], t)
    assert v.tensor_size_in_bytes() == len(raw) == _nbytes(t, n)
    if raw:
        ctypes.memmove(v.data_ptr(), raw, len(raw))
    return v


def _raw(v: ort.OrtValue) -> bytes:
    n = v.tensor_size_in_bytes()
    return ctypes.string_at(v.data_ptr(), n) if n else b""


def _pack(vals, t: int) -> np.ndarray:
    """Reference packing (independent of ortmlx's): element i at bit (i % k) * bits of byte i // k."""
    bits = SUB[t][0]
    k = 8 // bits
    u = [int(v) & ((1 << bits) - 1) for v in vals]
    out = np.zeros(_nbytes(t, len(u)), np.uint8)
    for i, x in enumerate(u):
        out[i // k] |= x << ((i % k) * bits)
    return out


def check_exact(model, feeds: dict):
    """All nodes on MLX (check_against_cpu) and every output byte-identical to ORT's CPU EP."""
    mlx_s = testing.check_against_cpu(model, [])
    cpu_s = testing.session(model, "CPUExecutionProvider", record=False)
    got = mlx_s.run_with_ort_values(None, feeds)
    want = cpu_s.run_with_ort_values(None, feeds)
    types = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    for g, w, o in zip(got, want, mlx_s.get_outputs()):
        assert g.shape() == w.shape(), o.name
        gb, wb = np.frombuffer(_raw(g), np.uint8).copy(), np.frombuffer(_raw(w), np.uint8).copy()
        t, n = types[o.name], int(np.prod(g.shape()))
        if t in SUB and gb.size and gb.size == wb.size and n % (8 // SUB[t][0]):
            # the unused high bits of the last byte are padding ORT's CPU kernels leave unwritten
            keep = np.uint8((1 << (n % (8 // SUB[t][0]) * SUB[t][0])) - 1)
            gb[-1] &= keep
            wb[-1] &= keep
        bad = np.flatnonzero(gb != wb) if gb.size == wb.size else None
        assert bad is not None and bad.size == 0, \
            f"{o.name}: {gb.size} vs {wb.size} bytes; first differing bytes at {bad[:8] if bad is not None else '-'}"
    return got


def _cast_model(src: int, to: int, n: int, like: bool = False, **attrs):
    if like:
        node = helper.make_node("CastLike", ["x", "like"], ["y"], **attrs)
        ins = [("x", src, [n]), ("like", to, [1])]
    else:
        node = helper.make_node("Cast", ["x"], ["y"], to=to, **attrs)
        ins = [("x", src, [n])]
    return testing.make_model([node], ins, [("y", to, [n])], opset=OPSET)


def _like_feed(to: int) -> ort.OrtValue:
    return _value(to, np.zeros(1)) if to in NP else _value(to, np.zeros(_nbytes(to, 1)), 1)


def _run_cast(src, to, data, n, like=False, **attrs):
    feeds = {"x": _value(src, data, n) if src not in NP else _value(src, data)}
    if like:
        feeds["like"] = _like_feed(to)
    return check_exact(_cast_model(src, to, n, like, **attrs), feeds)


# ----------------------------------------------------------------------------- float8
@pytest.mark.parametrize("like", [False, True])
@pytest.mark.parametrize("to", [T.FLOAT, T.FLOAT16])
@pytest.mark.parametrize("f8", F8)
def test_float8_decode_all_codes(f8, to, like):
    _run_cast(f8, to, np.arange(256, dtype=np.uint8), 256, like)


def _f32_sweep() -> np.ndarray:
    """Every exponent x mantissas around each rounding boundary, both signs, plus all float16 values."""
    hi = np.arange(64, dtype=np.uint32) << 17                  # top 6 mantissa bits, every pattern
    lo = np.array([0, 1, 2, 0x7FFF, 0x8000, 0x10000, 0x1FFFF, 0x18000, 0x0FFFF], np.uint32)
    m = (hi[:, None] | lo[None, :]).ravel()
    # the round bit of every format/subnormal position set alone, with sticky, and with the lsb
    for r in range(17, 23):
        m = np.concatenate([m, np.array([1 << r, (1 << r) | 1, (1 << r) | (1 << (r + 1)),
                                         (1 << (r + 1)) - 1, (3 << r) if r < 22 else 1 << r], np.uint32)])
    e = np.arange(256, dtype=np.uint32) << 23
    bits = (e[:, None] | m[None, :]).ravel()
    bits = np.concatenate([bits, bits | 0x80000000])
    f16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    return np.concatenate([bits.view(np.float32), f16])


@pytest.mark.parametrize("saturate", [1, 0])
@pytest.mark.parametrize("f8", F8)
def test_float32_to_float8_sweep(f8, saturate):
    x = _f32_sweep()
    _run_cast(T.FLOAT, f8, x, x.size, saturate=saturate)


@pytest.mark.parametrize("saturate", [1, 0])
@pytest.mark.parametrize("f8", F8)
def test_float16_to_float8_all_values(f8, saturate):
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    _run_cast(T.FLOAT16, f8, x, x.size, like=True, saturate=saturate)


def test_float8_roundtrip_inside_a_group():
    """float -> float8 -> float within one MLX group: the carrier never crosses the boundary."""
    nodes = [helper.make_node("Cast", ["x"], ["q"], to=T.FLOAT8E4M3FN, saturate=0),
             helper.make_node("Cast", ["q"], ["y"], to=T.FLOAT)]
    model = testing.make_model(nodes, [("x", T.FLOAT, [7])], [("y", T.FLOAT, [7])], opset=OPSET)
    x = np.array([0.3, -1e-3, 448, 465, 1e6, np.nan, -np.inf], np.float32)
    check_exact(model, {"x": _value(T.FLOAT, x)})


# ----------------------------------------------------------------------------- int4 / int2
def _float_probe() -> np.ndarray:
    q = np.arange(-80, 80.25, 0.25, dtype=np.float32)
    special = [0.49999997, -0.49999997, 0.5000001, 1e3 + 0.6, -1e3 - 0.5, 2 ** 24 + 2, 2 ** 26 + 8, 2 ** 27,
               -2 ** 27 - 16, 2 ** 31, -2 ** 31, 3e9, 1e10, -1e10, 3.4e38, np.nan, -np.nan, np.inf, -np.inf,
               1e-40, -0.0]
    return np.concatenate([q, np.array(special, np.float32)])


@pytest.mark.parametrize("to", list(SUB))
@pytest.mark.parametrize("src", [T.FLOAT, T.FLOAT16])
def test_float_to_subbyte(src, to):
    x = _float_probe() if src == T.FLOAT else np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    x = x.astype(NP[src])[: x.size - (x.size % 2 == 0)]          # an odd count: the last byte is half used
    got = _run_cast(src, to, x, x.size)
    assert len(_raw(got[0])) == _nbytes(to, x.size)


@pytest.mark.parametrize("to", list(SUB))
@pytest.mark.parametrize("src", [T.INT8, T.UINT8, T.INT32, T.INT64, T.UINT16])
def test_int_to_subbyte(src, to):
    info = np.iinfo(NP[src])
    x = np.concatenate([np.arange(-300, 301), [info.min, info.max, info.min + 7, info.max - 5]])
    x = x[(x >= info.min) & (x <= info.max)].astype(NP[src])
    _run_cast(src, to, x, x.size, like=src == T.INT32)


@pytest.mark.parametrize("to", [T.FLOAT, T.FLOAT16, T.INT8, T.UINT8, T.INT32, T.INT64, T.UINT16])
@pytest.mark.parametrize("src", list(SUB))
def test_subbyte_to(src, to):
    bits, signed = SUB[src]
    vals = np.arange(-(1 << (bits - 1)) if signed else 0, (1 << (bits - 1)) if signed else 1 << bits)
    vals = np.concatenate([vals, vals[::-1], vals[:1]])           # every value at every bit position
    _run_cast(src, to, _pack(vals, src), vals.size, like=to == T.FLOAT)


def test_unpack_matches_reference_packing():
    """What the EP unpacks is what ORT stored: Cast(int4 -> int8) of a known packing gives its values."""
    vals = np.array([-8, 7, -1, 0, 3, -3, 5], np.int8)
    got = _run_cast(T.INT4, T.INT8, _pack(vals, T.INT4), vals.size)
    assert np.array_equal(np.frombuffer(_raw(got[0]), np.int8), vals)


def test_subbyte_pack_roundtrip_helpers():
    for t, (bits, signed) in SUB.items():
        et = {T.UINT2: dt.UINT2, T.INT2: dt.INT2}.get(t, t)       # ORT's enum for the 2-bit types
        lo = -(1 << (bits - 1)) if signed else 0
        for n in range(0, 10):
            a = ((np.arange(n) * 3) % (1 << bits) + lo).astype(dt.CARRIERS[et])
            packed = dt.pack_carrier(a, et)
            assert np.array_equal(packed, _pack(a, t))
            assert np.array_equal(dt.unpack_carrier(packed.tobytes(), et, n), a)


def test_constant_initializers_of_carrier_types():
    """int4 and float8 constant initializers are read (unpacked) by the EP itself."""
    w4 = helper.make_tensor("w4", T.INT4, [5], [-8, 7, -1, 0, 3])
    w8 = helper.make_tensor("w8", T.FLOAT8E5M2, [4], [1.5, -0.25, 57344.0, -3.0])
    nodes = [helper.make_node("Cast", ["w4"], ["a"], to=T.FLOAT), helper.make_node("Add", ["a", "x"], ["y"]),
             helper.make_node("Cast", ["w8"], ["b"], to=T.FLOAT), helper.make_node("Add", ["b", "z"], ["u"])]
    model = testing.make_model(nodes, [("x", T.FLOAT, [5]), ("z", T.FLOAT, [4])],
                               [("y", T.FLOAT, [5]), ("u", T.FLOAT, [4])], [w4, w8], opset=OPSET)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL      # keep the Casts
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    s = testing.session(model, sess_options=so)
    assert not testing.unclaimed_ops(s), testing.unclaimed_ops(s)
    x, z = np.arange(5, dtype=np.float32), np.zeros(4, np.float32)
    y, u = s.run(None, {"x": x, "z": z})
    assert np.array_equal(y, np.array([-8, 7, -1, 0, 3], np.float32) + x)
    assert np.array_equal(u, np.array([1.5, -0.25, 57344.0, -3.0], np.float32))


# ----------------------------------------------------------------------------- refused
@pytest.mark.parametrize("src,to", [(T.FLOAT8E4M3FN, T.INT32), (T.INT32, T.FLOAT8E5M2), (T.INT4, T.UINT4),
                                    (T.DOUBLE, T.INT4), (T.FLOAT8E4M3FN, T.FLOAT8E5M2)])
def test_unhandled_carrier_casts_stay_on_cpu(src, to):
    s = testing.session(_cast_model(src, to, 4))
    assert testing.unclaimed_ops(s) == {"Cast": 1}


def test_carriers_refused_by_ops_that_do_not_opt_in():
    nodes = [helper.make_node("Shape", ["x"], ["y"])]
    model = testing.make_model(nodes, [("x", T.FLOAT8E4M3FN, ["n"])], [("y", T.INT64, [1])], opset=OPSET)
    s = testing.session(model)
    assert testing.unclaimed_ops(s) == {"Shape": 1}
    feeds = {"x": _value(T.FLOAT8E4M3FN, np.array([1, 0x7F, 0xFF], np.uint8), 3)}
    assert s.run(None, feeds)[0].tolist() == [3]


# ----------------------------------------------------------------------------- layout ops
@pytest.mark.parametrize("t", F8 + list(SUB))
def test_layout_ops_move_carriers(t):
    """Identity/Transpose/Reshape only move carrier elements (ORT 1.31's CPU EP has Identity and
    Reshape kernels for float8 only, Transpose for float8 and the 4-bit/2-bit types)."""
    shape = [3, 1, 5]
    if t in F8:
        nodes = [helper.make_node("Identity", ["x"], ["a"]),
                 helper.make_node("Transpose", ["a"], ["b"], perm=[2, 1, 0]),
                 helper.make_node("Reshape", ["b", "shp"], ["y"])]
        inits = [onnx.numpy_helper.from_array(np.array([5, 3], np.int64), "shp")]
        outs = [("y", t, [5, 3]), ("b", t, [5, 1, 3])]
    else:
        nodes = [helper.make_node("Transpose", ["x"], ["b"], perm=[2, 1, 0])]
        inits, outs = [], [("b", t, [5, 1, 3])]
    model = testing.make_model(nodes, [("x", t, shape)], outs, inits, opset=OPSET if t in (T.INT2, T.UINT2) else 21)
    n = 15
    if t in SUB:
        bits, signed = SUB[t]
        vals = (np.arange(n) % (1 << bits)) - ((1 << (bits - 1)) if signed else 0)
        data = _pack(vals, t)
    else:
        data = np.arange(0, 256, 17, dtype=np.uint8)[:n]
    check_exact(model, {"x": _value(t, data, n, shape)})


# ----------------------------------------------------------------------------- Q/DQ with int4/uint4
def _qdq_params(q: int, shape, axis, block):
    """scale / zero-point shapes for per-tensor (axis None), per-axis or blocked layouts."""
    if axis is None:
        return []
    if block:
        return [-(-d // block) if k == axis else d for k, d in enumerate(shape)]
    return [shape[axis]]


LAYOUTS = [(None, 0), (1, 0), (0, 0), (1, 2), (0, 4)]


@pytest.mark.parametrize("q", [T.INT4, T.UINT4])
def test_quantize_linear_4bit_refused(q):
    """ORT's 4-bit QuantizeLinear sends inf/NaN/huge x/scale to min or max depending on the layout and
    zero point (e.g. per-tensor inf -> max, per-axis with one element per channel -> min): refused."""
    inits = [onnx.numpy_helper.from_array(np.float32(0.5), "s"), helper.make_tensor("zp", q, [], [1])]
    model = testing.make_model([helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["y"])],
                               [("x", T.FLOAT, [4])], [("y", q, [4])], inits, opset=21)
    s = testing.session(model)
    assert testing.unclaimed_ops(s) == {"QuantizeLinear": 1}


@pytest.mark.parametrize("out", [T.FLOAT, T.FLOAT16])
@pytest.mark.parametrize("axis,block", LAYOUTS)
@pytest.mark.parametrize("q", [T.INT4, T.UINT4])
def test_dequantize_linear_4bit(q, axis, block, out):
    rng = np.random.default_rng(3)
    shape = [5, 6]
    ps = _qdq_params(q, shape, axis, block)
    n_p = int(np.prod(ps)) if ps else 1
    bits, signed = SUB[q]
    lo, hi = (-8, 8) if signed else (0, 16)
    x = rng.integers(lo, hi, 30)
    zp = rng.integers(lo, hi, n_p)
    scale = rng.normal(0, 1, n_p).astype(NP[out]).reshape(ps)
    attrs = {} if axis is None else {"axis": axis}
    if block:
        attrs["block_size"] = block
    node = helper.make_node("DequantizeLinear", ["x", "s", "zp"], ["y"], **attrs)
    inits = [onnx.numpy_helper.from_array(scale, "s"), helper.make_tensor("zp", q, ps, zp.tolist())]
    model = testing.make_model([node], [("x", q, shape)], [("y", out, shape)], inits, opset=21)
    check_exact(model, {"x": _value(q, _pack(x, q), 30, shape)})


# ----------------------------------------------------------------------------- Q/DQ with float8
@pytest.mark.parametrize("zp", [False, True])
@pytest.mark.parametrize("saturate", [1, 0])
@pytest.mark.parametrize("axis,block", [(None, 0), (1, 0), (0, 4)])
@pytest.mark.parametrize("f8", F8)
def test_quantize_linear_float8(f8, axis, block, saturate, zp):
    shape = [6, 40]
    ps = _qdq_params(f8, shape, axis, block)
    n_p = int(np.prod(ps)) if ps else 1
    rng = np.random.default_rng(5)
    scale = rng.choice(np.array([0.5, 3.0, 1e-3, 7.0], np.float32), n_p).reshape(ps)
    x = np.concatenate([_f32_sweep()[::1097][:200],
                        np.array([0, -0.0, 1e6, -1e6, np.nan, np.inf, -np.inf, 464, 480, 57344, 61440], np.float32)])
    x = np.resize(x, 240).astype(np.float32).reshape(shape)
    attrs = {"saturate": saturate} if axis is None else {"axis": axis, "saturate": saturate}
    if block:
        attrs["block_size"] = block
    inits = [onnx.numpy_helper.from_array(scale, "s")]
    ins = ["x", "s"]
    if zp:
        inits.append(helper.make_tensor("zp", f8, ps, np.zeros(n_p).tolist()))
        ins.append("zp")
    else:
        attrs["output_dtype"] = f8
    model = testing.make_model([helper.make_node("QuantizeLinear", ins, ["y"], **attrs)], [("x", T.FLOAT, shape)],
                               [("y", f8, shape)], inits, opset=21)
    check_exact(model, {"x": _value(T.FLOAT, x)})


@pytest.mark.parametrize("out", [T.FLOAT])
@pytest.mark.parametrize("axis,block", [(None, 0), (1, 0), (1, 64)])
@pytest.mark.parametrize("f8", F8)
def test_dequantize_linear_float8(f8, axis, block, out):
    shape = [2, 256]
    ps = _qdq_params(f8, shape, axis, block)
    n_p = int(np.prod(ps)) if ps else 1
    scale = np.random.default_rng(1).choice(np.array([0.5, 3.0, 1e-3, 300.0], np.float32), n_p)
    attrs = {} if axis is None else {"axis": axis}
    if block:
        attrs["block_size"] = block
    inits = [onnx.numpy_helper.from_array(scale.astype(NP[out]).reshape(ps), "s")]
    model = testing.make_model([helper.make_node("DequantizeLinear", ["x", "s"], ["y"], **attrs)],
                               [("x", f8, shape)], [("y", out, shape)], inits, opset=21)
    codes = np.concatenate([np.arange(256), np.arange(255, -1, -1)]).astype(np.uint8)
    check_exact(model, {"x": _value(f8, codes, 512, shape)})


@pytest.mark.parametrize("f8", F8)
def test_float8_dequantize_to_float16_refused(f8):
    """ORT's CPU EP rounds some float8 * float16-scale products differently: refused, and right."""
    inits = [onnx.numpy_helper.from_array(np.array([0.5, 3.0], np.float16), "s")]
    model = testing.make_model([helper.make_node("DequantizeLinear", ["x", "s"], ["y"], axis=0)],
                               [("x", f8, [2, 256])], [("y", T.FLOAT16, [2, 256])], inits, opset=21)
    s = testing.session(model)
    assert testing.unclaimed_ops(s) == {"DequantizeLinear": 1}


def test_float8_nonzero_zero_point_refused():
    inits = [onnx.numpy_helper.from_array(np.float32(2.0), "s"), helper.make_tensor("zp", T.FLOAT8E4M3FN, [], [1.0])]
    model = testing.make_model([helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["y"])],
                               [("x", T.FLOAT, [4])], [("y", T.FLOAT8E4M3FN, [4])], inits, opset=21)
    assert testing.unclaimed_ops(testing.session(model)) == {"QuantizeLinear": 1}


@pytest.mark.parametrize("q", F8)
def test_quantize_linear_float16_input(q):
    """float16 x and scale: ORT computes x / scale in float32 for these outputs too."""
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(256, 256)
    scale = np.array([0.5, 3.0, 1e-3, 7.0] * 64, np.float16)
    attrs = {"axis": 1}
    if q in F8:
        attrs["output_dtype"] = q
        inits, ins = [onnx.numpy_helper.from_array(scale, "s")], ["x", "s"]
    else:
        inits = [onnx.numpy_helper.from_array(scale, "s"), helper.make_tensor("zp", q, [256], [1] * 256)]
        ins = ["x", "s", "zp"]
    model = testing.make_model([helper.make_node("QuantizeLinear", ins, ["y"], **attrs)],
                               [("x", T.FLOAT16, [256, 256])], [("y", q, [256, 256])], inits, opset=21)
    check_exact(model, {"x": _value(T.FLOAT16, x)})


@pytest.mark.parametrize("q", [T.INT8, T.UINT8, T.INT16, T.UINT16])
@pytest.mark.parametrize("xt", [T.FLOAT, T.FLOAT16])
def test_quantize_linear_nan_inf_huge(xt, q):
    """NaN -> the minimum; from float16 also inf and x / scale beyond int32 (ORT's CPU kernels)."""
    x = np.array([np.inf, -np.inf, np.nan, -np.nan, 6e4, -6e4, 65504, -65504, 3.5, -2.5, 0, 1e-3],
                 NP[xt]).repeat(3)
    scale = np.tile(np.array([1.0, 1e-5, 3e-4], NP[xt]), 12)
    for zp in ([1] * 36, [0, 1, 0, 0, 2, 0] * 6):
        inits = [onnx.numpy_helper.from_array(scale, "s"), helper.make_tensor("zp", q, [36], zp)]
        model = testing.make_model([helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["y"], axis=0)],
                                   [("x", xt, [36])], [("y", q, [36])], inits, opset=21)
        check_exact(model, {"x": _value(xt, x)})
    x2 = x.reshape(12, 3)          # per tensor, zero point 0 and 1
    for zp in (0, 1):
        inits = [onnx.numpy_helper.from_array(np.array(3e-4, NP[xt]), "s"), helper.make_tensor("zp", q, [], [zp])]
        model = testing.make_model([helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["y"])],
                                   [("x", xt, [12, 3])], [("y", q, [12, 3])], inits, opset=21)
        check_exact(model, {"x": _value(xt, x2)})
