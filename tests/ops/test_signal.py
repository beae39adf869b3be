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
