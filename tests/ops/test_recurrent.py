"""RNN, GRU, LSTM against ORT's CPU EP (float32, rtol 1e-4 atol 1e-5)."""
import numpy as np
import pytest
from onnx import TensorProto as T, helper

from _nnutil import rand, stays_on_cpu
from ortmlx.testing import assert_close, check_against_cpu, make_model, session, unclaimed_ops

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
SEQ, BATCH, IN, H = 5, 3, 4, 6

CASES = [  # (op, attrs, optional inputs (B, seq_lens, init_h, init_c, P), outputs, opset)
    ("RNN", {}, "", "Y,Y_h", 21),
    ("RNN", {"direction": "reverse"}, "B", "Y,Y_h", 21),
    ("RNN", {"direction": "bidirectional"}, "B,lens,h0", "Y,Y_h", 21),
    ("RNN", {"activations": ["Relu"], "clip": 0.7}, "B", "Y,Y_h", 13),
    ("RNN", {"activations": ["LeakyRelu", "HardSigmoid"], "activation_alpha": [0.3, 0.4],
             "activation_beta": [0.6], "direction": "bidirectional"}, "B,h0", "Y,Y_h", 21),
    ("GRU", {}, "", "Y,Y_h", 21),
    ("GRU", {"linear_before_reset": 1}, "B,h0", "Y,Y_h", 21),
    ("GRU", {"direction": "bidirectional", "linear_before_reset": 1}, "B,lens", "Y,Y_h", 21),
    ("GRU", {"direction": "reverse", "clip": 0.5}, "B,lens,h0", "Y,Y_h", 21),
    ("GRU", {"direction": "bidirectional"}, "B,h0", "Y,Y_h", 21),
    ("GRU", {"direction": "bidirectional", "activations": ["Sigmoid", "Tanh", "HardSigmoid", "Tanh"],
             "activation_alpha": [0.3], "activation_beta": [0.4]}, "lens", "Y,Y_h", 21),
    ("GRU", {"activations": ["HardSigmoid", "Softsign"], "activation_alpha": [0.3], "activation_beta": [0.4]},
     "B", ",Y_h", 21),
    ("LSTM", {}, "", "Y,Y_h,Y_c", 21),
    ("LSTM", {}, "B,lens,h0,c0,P", "Y,Y_h,Y_c", 21),
    ("LSTM", {"direction": "reverse", "input_forget": 1}, "B,lens,h0,c0", "Y,Y_h,Y_c", 21),
    ("LSTM", {"direction": "bidirectional", "clip": 0.6}, "B,lens,h0,c0,P", "Y,Y_h,Y_c", 21),
    ("LSTM", {"direction": "bidirectional"}, "", "Y,Y_h,Y_c", 21),
    ("LSTM", {"activations": ["Sigmoid", "Elu", "ScaledTanh"], "activation_alpha": [0.8, 0.9],
              "activation_beta": [1.1]}, "B", ",,Y_c", 21),
    ("LSTM", {}, "B", ",Y_h", 7),
]


def _model(op, attrs, opt, outs, opset, seq=SEQ):
    d = 2 if attrs.get("direction") == "bidirectional" else 1
    g = GATES[op]
    layout = attrs.get("layout", 0)
    opt = set(opt.split(",")) - {""}
    x_shape = (BATCH, seq, IN) if layout else (seq, BATCH, IN)
    s_shape = (BATCH, d, H) if layout else (d, BATCH, H)
    ins = {"X": (T.FLOAT, x_shape), "W": (T.FLOAT, (d, g * H, IN)), "R": (T.FLOAT, (d, g * H, H)),
           "B": (T.FLOAT, (d, 2 * g * H)), "lens": (T.INT32, (BATCH,)), "h0": (T.FLOAT, s_shape),
           "c0": (T.FLOAT, s_shape), "P": (T.FLOAT, (d, 3 * H))}
    order = ["X", "W", "R", "B", "lens", "h0"] + (["c0", "P"] if op == "LSTM" else [])
    names = [n if n in ("X", "W", "R") or n in opt else "" for n in order]
    while not names[-1]:
        names.pop()
    out_names = outs.split(",")
    node = helper.make_node(op, names, out_names, hidden_size=H, **attrs)
    gin = [(n, *ins[n]) for n in names if n]
    feeds = {n: rand(ins[n][1], seed=k, lo=-0.8, hi=0.8) for k, n in enumerate(names) if n and n != "lens"}
    if "lens" in names:
        feeds["lens"] = np.array([seq, 2, 1][:BATCH], np.int32)
    m = make_model([node], gin, [(o, T.FLOAT, None) for o in out_names if o], opset=opset)
    return m, feeds


@pytest.mark.parametrize("op,attrs,opt,outs,opset", CASES)
def test_recurrent(op, attrs, opt, outs, opset):
    m, feeds = _model(op, attrs, opt, outs, opset)
    other = {k: (v[::-1].copy() if k != "lens" else np.array([1, SEQ, 3], np.int32)) for k, v in feeds.items()}
    check_against_cpu(m, [feeds, other])          # second feed: other data and sequence lengths, same session


LAYOUT1 = [  # ORT's CPU EP refuses layout=1: compared with its layout-0 answer on transposed tensors
    ("RNN", {"layout": 1}, "B,h0", "Y,Y_h"),
    ("GRU", {"layout": 1, "direction": "bidirectional"}, "B,lens,h0", "Y,Y_h"),
    ("LSTM", {"layout": 1, "direction": "bidirectional"}, "B,lens,h0,c0,P", "Y,Y_h,Y_c"),
]


@pytest.mark.parametrize("op,attrs,opt,outs", LAYOUT1)
def test_layout1(op, attrs, opt, outs):
    m1, feeds1 = _model(op, attrs, opt, outs, 21)
    m0, feeds0 = _model(op, {k: v for k, v in attrs.items() if k != "layout"}, opt, outs, 21)
    s = session(m1)
    assert not unclaimed_ops(s), unclaimed_ops(s)
    got = s.run(None, feeds1)
    feeds0 = dict(feeds1, X=feeds1["X"].transpose(1, 0, 2))
    for k in ("h0", "c0"):
        if k in feeds1:
            feeds0[k] = feeds1[k].transpose(1, 0, 2)
    want = session(m0, "CPUExecutionProvider", record=False).run(None, feeds0)
    for name, g, w in zip([o for o in outs.split(",") if o], got, want):
        w = w.transpose(2, 0, 1, 3) if name == "Y" else w.transpose(1, 0, 2)
        assert_close(g, w, 1e-4, 1e-5, what=name)


@pytest.mark.parametrize("bad", [0, SEQ + 1])
def test_bad_sequence_lens_is_an_error(bad):
    m, feeds = _model("GRU", {}, "B,lens", "Y,Y_h", 21)
    feeds["lens"][1] = bad
    with pytest.raises(Exception, match="sequence_lens"):
        session(m).run(None, feeds)


def test_missing_activation_params_refused():
    # LeakyRelu without activation_alpha: ORT uses a per-function default we do not reproduce
    m, feeds = _model("RNN", {"activations": ["LeakyRelu"]}, "B", "Y,Y_h", 21)
    stays_on_cpu(m, feeds, "RNN")


def test_float64_refused():
    node = helper.make_node("GRU", ["X", "W", "R"], ["Y"], hidden_size=2)
    m = make_model([node], [("X", T.DOUBLE, (3, 1, 2)), ("W", T.DOUBLE, (1, 6, 2)), ("R", T.DOUBLE, (1, 6, 2))],
                   [("Y", T.DOUBLE, None)])
    feeds = {"X": rand((3, 1, 2), T.DOUBLE), "W": rand((1, 6, 2), T.DOUBLE, 1), "R": rand((1, 6, 2), T.DOUBLE, 2)}
    # ORT's CPU EP has no float64 GRU either: the session loads, the node is not ours, running it fails in ORT
    s = session(m)
    assert "GRU" in unclaimed_ops(s)
    with pytest.raises(Exception, match="double"):
        s.run(None, feeds)
