"""Signal ops against ORT's CPU EP: DFT (float32; atol 2e-6 * n: ORT's own float32 DFT, a direct sum
for lengths that are not powers of two, is that far from exact), Hann/Hamming/Blackman windows."""
import numpy as np
import pytest
from onnx import TensorProto as T, helper

from _nnutil import check, stays_on_cpu
from ortmlx.testing import check_against_cpu, make_model

CASES = [  # (op, size, periodic, output_datatype)
    ("HannWindow", 10, 1, T.FLOAT), ("HannWindow", 10, 0, T.FLOAT), ("HannWindow", 1, 1, T.FLOAT),
    ("HannWindow", 0, 1, T.FLOAT), ("HannWindow", 7, 0, T.FLOAT16),
    ("HammingWindow", 10, 1, T.FLOAT), ("HammingWindow", 9, 0, T.FLOAT), ("HammingWindow", 16, 1, T.FLOAT16),
    ("BlackmanWindow", 10, 1, T.FLOAT), ("BlackmanWindow", 11, 0, T.FLOAT), ("BlackmanWindow", 32, 1, T.FLOAT16),
]


def _model(op, periodic, t, size_as_input=True):
    node = helper.make_node(op, ["n"], ["w"], periodic=periodic, output_datatype=t)
    return make_model([node], [("n", T.INT64, ())], [("w", t, None)], opset=17)


@pytest.mark.parametrize("op,size,periodic,t", CASES)
def test_window(op, size, periodic, t):
    check(_model(op, periodic, t), {"n": np.array(size, np.int64)}, t)


@pytest.mark.parametrize("t", [T.INT32, T.DOUBLE])
def test_output_type_refused(t):
    # integer: truncation near integers; float64: ORT computes it from float32 coefficients
    stays_on_cpu(_model("HammingWindow", 0, t), {"n": np.array(9, np.int64)}, "HammingWindow")


DFT = [  # (input shape, opset, attrs, dft_length, axis input (opset 20))
    ((2, 16, 1), 17, {}, None, None),
    ((3, 10, 1), 17, {"onesided": 1}, None, None),
    ((3, 10, 6, 2), 17, {"axis": 2}, 7, None),
    ((2, 9, 2), 17, {"inverse": 1}, None, None),
    ((4, 100, 1), 17, {}, 128, None),
    ((2, 12, 5, 2), 20, {"inverse": 1}, 12, None),
    ((2, 60, 1), 20, {"onesided": 1}, 50, None),
    ((2, 8, 6, 1), 20, {}, None, 1),
    ((2, 8, 6, 2), 20, {"inverse": 1}, None, -3),
]


@pytest.mark.parametrize("shape,opset,attrs,n,axis", DFT)
def test_dft(shape, opset, attrs, n, axis):
    ins = ["x", "n" if n else "", "a" if axis is not None else ""]
    while not ins[-1]:
        ins.pop()
    inits = {}
    if n:
        inits["n"] = np.array(n, np.int64)
    if axis is not None:
        inits["a"] = np.array(axis, np.int64)
    node = helper.make_node("DFT", ins, ["y"], **attrs)
    m = make_model([node], [("x", T.FLOAT, shape)], [("y", T.FLOAT, None)], inits, opset=opset)
    a = attrs.get("axis", 1) if opset < 20 else (-2 if axis is None else axis)
    length = n or shape[a]
    x = np.random.default_rng(0).uniform(-1, 1, shape).astype(np.float32)
    check_against_cpu(m, [{"x": x}], rtol=1e-4, atol=2e-6 * length)



STFT = [  # (signal shape, frame_step, window length or None, frame_length or None, onesided)
    ((2, 64, 1), 8, 16, None, 1),
    ((1, 100, 1), 10, 20, 20, 1),
    ((2, 50, 1), 7, None, 12, 1),
    ((1, 40, 2), 5, 10, None, 0),
    ((2, 33, 1), 4, 8, 8, 0),
]


@pytest.mark.parametrize("shape,step,wlen,flen,onesided", STFT)
def test_stft(shape, step, wlen, flen, onesided):
    ins, gin, inits = ["x", "s"], [("x", T.FLOAT, shape)], {"s": np.array(step, np.int64)}
    ins.append("w" if wlen else "")
    if wlen:
        gin.append(("w", T.FLOAT, (wlen,)))
    if flen:
        ins.append("n")
        inits["n"] = np.array(flen, np.int64)
    node = helper.make_node("STFT", ins, ["y"], onesided=onesided)
    m = make_model([node], gin, [("y", T.FLOAT, None)], inits, opset=17)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.uniform(-1, 1, shape).astype(np.float32)}
    if wlen:
        feeds["w"] = rng.uniform(0, 1, (wlen,)).astype(np.float32)
    check_against_cpu(m, [feeds], rtol=1e-4, atol=2e-6 * (flen or wlen))


# ---------------------------------------------------------------- MelWeightMatrix: byte-exact vs the CPU EP
MEL = [  # (num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz)
    (8, 16, 8192, 0.0, 4096.0), (40, 512, 16000, 20.0, 7600.0), (80, 400, 16000, 0.0, 8000.0),
    (64, 2048, 44100, 125.0, 7500.0), (13, 257, 22050, 300.0, 3000.0), (3, 8, 8000, 0.0, 3000.0),
    (0, 64, 8000, 0.0, 4000.0), (128, 1024, 48000, 0.0, 24000.0),
]
MEL_OUT = [T.FLOAT, T.DOUBLE, T.INT32, T.UINT8, T.INT64]


def _mel_model(out_t, int_t=T.INT64, name="mel", consts=None):
    node = helper.make_node("MelWeightMatrix", ["n", "d", "s", "l", "u"], ["y"], name=name, output_datatype=out_t)
    consts = consts or {}
    ins = [(k, t, ()) for k, t in (("n", int_t), ("d", int_t), ("s", int_t), ("l", T.FLOAT), ("u", T.FLOAT))
           if k not in consts]
    return make_model([node], ins, [("y", out_t, None)], consts, opset=17)


def _mel_feeds(case, int_t=T.INT64):
    it = np.int64 if int_t == T.INT64 else np.int32
    n, d, s, lo, hi = case
    return {"n": np.array(n, it), "d": np.array(d, it), "s": np.array(s, it), "l": np.array(lo, np.float32),
            "u": np.array(hi, np.float32)}


def _exact(model, feeds_list):
    from ortmlx.testing import session, unclaimed_ops
    s = session(model)
    assert not unclaimed_ops(s), f"left off MLX: {dict(unclaimed_ops(s))}"
    cpu = session(model, "CPUExecutionProvider", record=False)
    for f in feeds_list:
        g, w = s.run(None, f)[0], cpu.run(None, f)[0]
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=str(f))


@pytest.mark.parametrize("out_t", MEL_OUT)
def test_mel_weight_matrix(out_t):
    _exact(_mel_model(out_t), [_mel_feeds(c) for c in MEL])
    _exact(_mel_model(out_t, T.INT32), [_mel_feeds(c, T.INT32) for c in MEL[:3]])


def test_mel_weight_matrix_random_sweep():
    """200 random parameter sets (fixed seed), float32 output: every edge floors like ORT's kernel."""
    rng = np.random.default_rng(17)
    feeds = []
    for _ in range(200):
        d, sr = int(rng.integers(8, 2049)), int(rng.choice([8000, 11025, 16000, 22050, 44100, 48000]))
        lo = float(rng.uniform(0, 400))
        feeds.append(_mel_feeds((int(rng.integers(1, 100)), d, sr, lo, float(rng.uniform(lo + 50, sr / 2 - 1)))))
    _exact(_mel_model(T.FLOAT), feeds)


def test_mel_weight_matrix_constant_inputs():
    c = MEL[1]
    consts = {"n": np.array(c[0], np.int64), "d": np.array(c[1], np.int64), "s": np.array(c[2], np.int64),
              "l": np.array(c[3], np.float32), "u": np.array(c[4], np.float32)}
    nodes = [helper.make_node("MelWeightMatrix", ["n", "d", "s", "l", "u"], ["w"]),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    m = make_model(nodes, [("x", T.FLOAT, (3, 257))], [("y", T.FLOAT, None)], consts, opset=17)
    check_against_cpu(m, [{"x": np.random.default_rng(0).uniform(0, 1, (3, 257)).astype(np.float32)}])


@pytest.mark.parametrize("case", [(8, 16, 8192, 0.0, 5000.0), (8, 16, 8192, -700.0, 4000.0), (4, 15, 8000, 0.0, 4000.0)],
                         ids=["upper_out_of_range", "lower_negative", "odd_dft_nyquist"])
def test_mel_weight_matrix_errors(case):
    """ORT's kernel rejects edges out of range; so do we, naming the node."""
    from ortmlx.testing import session, unclaimed_ops
    m = _mel_model(T.FLOAT, name="mel_err")
    with pytest.raises(Exception):
        session(m, "CPUExecutionProvider", record=False).run(None, _mel_feeds(case))
    s = session(m)
    assert not unclaimed_ops(s)
    with pytest.raises(Exception, match="mel_err"):
        s.run(None, _mel_feeds(case))


@pytest.mark.parametrize("out_t", [T.FLOAT16, T.BFLOAT16])
def test_mel_weight_matrix_half_refused(out_t):
    """ORT's CPU kernel has no float16/bfloat16 output: nothing to verify against."""
    from _ewutil import refusal
    assert "no ORT CPU kernel" in refusal(_mel_model(out_t), "MelWeightMatrix")
