"""Small models built with onnx.helper for the foundation tests: MLP, CNN, transformer block."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto as T
from onnx import helper as h

from ortmlx.testing import make_model

rng = np.random.default_rng(0)


def w(*shape, scale=0.2):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def mlp():
    nodes = [h.make_node("MatMul", ["X", "W1"], ["m1"]), h.make_node("Add", ["m1", "B1"], ["a1"]),
             h.make_node("Relu", ["a1"], ["r1"]),
             h.make_node("Gemm", ["r1", "W2", "B2"], ["g2"], transB=1),
             h.make_node("Sigmoid", ["g2"], ["s2"]),
             h.make_node("MatMul", ["s2", "W3"], ["m3"]),
             h.make_node("Softmax", ["m3"], ["Y"], axis=-1)]
    inits = {"W1": w(16, 32), "B1": w(32), "W2": w(24, 32), "B2": w(24), "W3": w(24, 8)}
    return make_model(nodes, [("X", T.FLOAT, ["N", 16])], [("Y", T.FLOAT, ["N", 8])], inits)


def cnn():
    nodes = [h.make_node("Conv", ["X", "C1", "CB1"], ["c1"], pads=[1, 1, 1, 1], strides=[1, 1]),
             h.make_node("BatchNormalization", ["c1", "s", "b", "mu", "var"], ["bn"], epsilon=1e-5),
             h.make_node("Relu", ["bn"], ["r1"]),
             h.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             h.make_node("Conv", ["p1", "C2"], ["c2"], pads=[1, 1, 1, 1], group=2),
             h.make_node("Relu", ["c2"], ["r2"]),
             h.make_node("AveragePool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
             h.make_node("GlobalAveragePool", ["p2"], ["gp"]),
             h.make_node("Flatten", ["gp"], ["f"], axis=1),
             h.make_node("Gemm", ["f", "FW", "FB"], ["Y"])]
    inits = {"C1": w(8, 3, 3, 3), "CB1": w(8), "s": np.abs(w(8)) + 0.5, "b": w(8), "mu": w(8),
             "var": np.abs(w(8)) + 0.5, "C2": w(8, 4, 3, 3), "FW": w(8, 5), "FB": w(5)}
    return make_model(nodes, [("X", T.FLOAT, ["N", 3, 16, 16])], [("Y", T.FLOAT, ["N", 5])], inits)


def transformer_block(d=32, heads=4, ff=64):
    hd = d // heads
    nodes = [
        h.make_node("LayerNormalization", ["X", "g1", "b1"], ["ln1"], axis=-1, epsilon=1e-5),
        h.make_node("MatMul", ["ln1", "Wqkv"], ["qkv"]),
        h.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=-1),
        h.make_node("Reshape", ["q", "hshape"], ["q4"]), h.make_node("Reshape", ["k", "hshape"], ["k4"]),
        h.make_node("Reshape", ["v", "hshape"], ["v4"]),
        h.make_node("Transpose", ["q4"], ["qt"], perm=[0, 2, 1, 3]),
        h.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
        h.make_node("Transpose", ["v4"], ["vt"], perm=[0, 2, 1, 3]),
        h.make_node("MatMul", ["qt", "kt"], ["sc"]), h.make_node("Mul", ["sc", "scale"], ["scs"]),
        h.make_node("Softmax", ["scs"], ["pr"], axis=-1),
        h.make_node("MatMul", ["pr", "vt"], ["ctx"]),
        h.make_node("Transpose", ["ctx"], ["ctxt"], perm=[0, 2, 1, 3]),
        h.make_node("Shape", ["X"], ["xs"]),
        h.make_node("Reshape", ["ctxt", "xs"], ["ctx3"]),
        h.make_node("MatMul", ["ctx3", "Wo"], ["o"]), h.make_node("Add", ["o", "X"], ["res1"]),
        h.make_node("LayerNormalization", ["res1", "g2", "b2"], ["ln2"], axis=-1, epsilon=1e-5),
        h.make_node("MatMul", ["ln2", "W1"], ["f1"]), h.make_node("Add", ["f1", "fb1"], ["f1b"]),
        h.make_node("Div", ["f1b", "sqrt2"], ["gd"]), h.make_node("Erf", ["gd"], ["ge"]),
        h.make_node("Add", ["ge", "one"], ["gp"]), h.make_node("Mul", ["f1b", "gp"], ["gm"]),
        h.make_node("Mul", ["gm", "half"], ["gelu"]),
        h.make_node("MatMul", ["gelu", "W2"], ["f2"]), h.make_node("Add", ["f2", "res1"], ["Y"]),
    ]
    inits = {"g1": 1 + w(d), "b1": w(d), "Wqkv": w(d, 3 * d), "split": np.array([d, d, d], np.int64),
             "hshape": np.array([0, 0, heads, hd], np.int64), "scale": np.array(1 / np.sqrt(hd), np.float32),
             "Wo": w(d, d), "g2": 1 + w(d), "b2": w(d), "W1": w(d, ff), "fb1": w(ff),
             "sqrt2": np.array(np.sqrt(2), np.float32), "one": np.array(1, np.float32),
             "half": np.array(0.5, np.float32), "W2": w(ff, d)}
    return make_model(nodes, [("X", T.FLOAT, ["B", "S", d])], [("Y", T.FLOAT, ["B", "S", d])], inits)
