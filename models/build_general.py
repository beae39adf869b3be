"""Build the general-model benchmark set locally: random weights, onnx.helper only (no torch, no downloads).

    python models/build_general.py                          # every model and op case, preset "small"
    python models/build_general.py --preset full             # the GPU host's sizes (224x224 CNNs, BERT-base)
    python models/build_general.py --preset tiny --models resnet18,bert --force
    python models/build_general.py --list

Models (fp32, batch dim "N" dynamic, opset 17):
  resnet18, resnet50   torchvision-shaped (7x7 stem, BatchNormalization, residual blocks, GAP, Gemm)
  mobilenetv2          inverted residuals: depthwise convs, ReLU6 (Clip), HardSwish, squeeze-excite (HardSigmoid)
  unet                 conv/BN/ReLU pairs, MaxPool, ConvTranspose, Resize (nearest and linear), Concat skips
  conformer            Conv2d subsampling, blocks of FFN (Swish) / MHA (Softmax) / conv module (GLU, depthwise
                       Conv1d, BatchNormalization, Swish) / LayerNormalization, LogSoftmax head
  bert                 BERT-shaped encoder: Gather embeddings, attention mask glue, MatMul+Add, Softmax attention,
                       LayerNormalization, erf GELU, a Tanh pooler (Gemm)
  lstm_speech          2-layer bidirectional LSTM over [T, N, 80] features, LogSoftmax head
  gru_speech           2-layer GRU (linear_before_reset=1, as torch exports), LogSoftmax head
  add_1x4, conv_1node  one-node models: the per-call floor
Op cases (``op_*``): one node each (or two inputs), for the per-op-family micro benchmark.

Output: models/out/general/<preset>/<name>.onnx (a cached build is reused when its recipe and preset match;
--force rebuilds). Each model carries ``ortmlx.bench`` metadata (JSON) saying how to make its inputs and the
answer tolerance (``feeds`` below reads it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_ROOT = os.path.join(HERE, "out", "general")
#: bump when a recipe changes so cached builds are redone
RECIPE = 2
OPSET = 17
IR_VERSION = 10          # onnxruntime 1.31 loads IR <= 13; onnx 1.23's helper writes newer by default
META_KEY = "ortmlx.bench"
PRESETS = ("tiny", "small", "full")
#: the answer tolerance of every model unless its recipe says otherwise (fp32)
RTOL, ATOL = 1e-4, 1e-5


class G:
    """A graph under construction: unique names, random initializers, nodes."""

    def __init__(self, name: str, seed: int = 0):
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits: dict[str, np.ndarray] = {}
        self.inputs: list = []
        self.outputs: list = []
        self.k = 0

    def uid(self, p: str) -> str:
        self.k += 1
        return f"{p}_{self.k}"

    def const(self, arr, p: str = "c") -> str:
        n = self.uid(p)
        self.inits[n] = np.asarray(arr)
        return n

    def randn(self, shape, std: float, p: str = "w") -> str:
        return self.const((self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std)), p)

    def uniform(self, shape, lo: float, hi: float, p: str = "w") -> str:
        return self.const(self.rng.uniform(lo, hi, shape).astype(np.float32), p)

    def op(self, op_type: str, inputs, n_out: int = 1, p: str | None = None, **attrs):
        outs = [self.uid(p or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.uid(op_type), **attrs))
        return outs[0] if n_out == 1 else outs

    def input(self, name: str, elem, shape) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, x: str, name: str, elem=T.FLOAT, shape=None) -> None:
        self.nodes.append(helper.make_node("Identity", [x], [name], name=self.uid("out")))
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def model(self, meta: dict) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs,
                                  [numpy_helper.from_array(v, k) for k, v in self.inits.items()])
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="ortmlx models/build_general.py")
        helper.set_model_props(m, {META_KEY: json.dumps(meta)})
        return m

    # ------------------------------------------------------------------ layers
    def conv(self, x, cin, cout, k, s=1, p=None, g=1, bias=True, d=1, gain=2.0):
        """2-D conv (k an int or a pair), He-initialised (fan-in cin/g*kh*kw)."""
        kh, kw = (k, k) if isinstance(k, int) else k
        p = ((kh - 1) * d // 2, (kw - 1) * d // 2) if p is None else ((p, p) if isinstance(p, int) else p)
        w = self.randn((cout, cin // g, kh, kw), math.sqrt(gain / (cin // g * kh * kw)))
        ins = [x, w] + ([self.randn((cout,), 0.02, "b")] if bias else [])
        return self.op("Conv", ins, kernel_shape=[kh, kw], strides=[s, s], pads=[p[0], p[1], p[0], p[1]],
                       group=g, dilations=[d, d])

    def conv1d(self, x, cin, cout, k, g=1, bias=True, gain=2.0):
        w = self.randn((cout, cin // g, k), math.sqrt(gain / (cin // g * k)))
        ins = [x, w] + ([self.randn((cout,), 0.02, "b")] if bias else [])
        return self.op("Conv", ins, kernel_shape=[k], strides=[1], pads=[(k - 1) // 2, (k - 1) // 2], group=g)

    def bn(self, x, c, gamma=(0.8, 1.2)):
        scale = self.uniform((c,), *gamma, "bn_s")
        bias = self.randn((c,), 0.05, "bn_b")
        mean = self.randn((c,), 0.05, "bn_m")
        var = self.uniform((c,), 0.8, 1.2, "bn_v")
        return self.op("BatchNormalization", [x, scale, bias, mean, var], epsilon=1e-5)

    def relu(self, x):
        return self.op("Relu", [x])

    def relu6(self, x):
        return self.op("Clip", [x, self.const(np.float32(0), "lo"), self.const(np.float32(6), "hi")])

    def swish(self, x):
        return self.op("Mul", [x, self.op("Sigmoid", [x])])

    def linear(self, x, din, dout, bias=True, gain=1.0):
        """``x @ W + b`` as torch exports a Linear on a 3-D input (MatMul then Add)."""
        y = self.op("MatMul", [x, self.randn((din, dout), math.sqrt(gain / din))])
        return self.op("Add", [y, self.randn((dout,), 0.02, "b")]) if bias else y

    def gemm(self, x, din, dout):
        """A 2-D Linear as torch exports it (Gemm, transB=1)."""
        return self.op("Gemm", [x, self.randn((dout, din), math.sqrt(1.0 / din)), self.randn((dout,), 0.02, "b")],
                       transB=1)

    def classify(self, x, c, classes=1000) -> None:
        """The CNN head: global average pool, Flatten, a Gemm to ``classes``; the output ``logits``."""
        x = self.op("Flatten", [self.op("GlobalAveragePool", [x])], axis=1)
        self.output(self.gemm(x, c, classes), "logits", shape=["N", classes])

    def layernorm(self, x, c):
        return self.op("LayerNormalization", [x, self.uniform((c,), 0.9, 1.1, "ln_s"), self.randn((c,), 0.02, "ln_b")],
                       axis=-1, epsilon=1e-5)

    def shape(self, vals) -> str:
        return self.const(np.array(vals, np.int64), "shape")


# --------------------------------------------------------------------------- models
def _meta(inputs: dict, tol=None, why: str = "", **extra) -> dict:
    """``inputs``: name -> {"kind": normal|ids|mask, ...}; ``tol``: (rtol, atol) where the default does not fit."""
    rtol, atol = tol or (RTOL, ATOL)
    return {"recipe": RECIPE, "inputs": inputs, "rtol": rtol, "atol": atol, "tol_why": why, **extra}


def resnet(depth: int, preset: str) -> onnx.ModelProto:
    res = {"tiny": 32, "small": 64, "full": 224}[preset]
    width = {"tiny": 8, "small": 32, "full": 64}[preset]
    blocks, bottleneck = {18: ([2, 2, 2, 2], False), 50: ([3, 4, 6, 3], True)}[depth]
    if preset == "tiny":
        blocks = [1, 1, 1, 1]
    g = G(f"resnet{depth}", seed=depth)
    x = g.input("pixel_values", T.FLOAT, ["N", 3, res, res])
    x = g.relu(g.bn(g.conv(x, 3, width, 7, s=2, p=3, bias=False), width))
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin, exp = width, 4 if bottleneck else 1
    for stage, n in enumerate(blocks):
        planes = width * 2 ** stage
        for b in range(n):
            s = 2 if (b == 0 and stage > 0) else 1
            cout = planes * exp
            if bottleneck:
                y = g.relu(g.bn(g.conv(x, cin, planes, 1, bias=False), planes))
                y = g.relu(g.bn(g.conv(y, planes, planes, 3, s=s, bias=False), planes))      # v1.5: stride on 3x3
                y = g.bn(g.conv(y, planes, cout, 1, bias=False), cout, gamma=(0.2, 0.4))
            else:
                y = g.relu(g.bn(g.conv(x, cin, planes, 3, s=s, bias=False), planes))
                y = g.bn(g.conv(y, planes, cout, 3, bias=False), cout, gamma=(0.2, 0.4))
            sc = x if (s == 1 and cin == cout) else g.bn(g.conv(x, cin, cout, 1, s=s, bias=False), cout)
            x = g.relu(g.op("Add", [y, sc]))
            cin = cout
    g.classify(x, cin)
    return g.model(_meta({"pixel_values": {"kind": "normal"}}))


def mobilenetv2(preset: str) -> onnx.ModelProto:
    res = {"tiny": 32, "small": 96, "full": 224}[preset]
    mult = {"tiny": 0.25, "small": 0.5, "full": 1.0}[preset]
    cfg = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
    if preset == "tiny":
        cfg = [(t, c, 1, s) for t, c, _, s in cfg]

    def ch(c):
        return max(8, int(c * mult + 4) // 8 * 8)

    g = G("mobilenetv2", seed=2)
    x = g.input("pixel_values", T.FLOAT, ["N", 3, res, res])
    cin = ch(32)
    x = g.relu6(g.bn(g.conv(x, 3, cin, 3, s=2, bias=False), cin))
    for t, c, n, s in cfg:
        cout = ch(c)
        late = c >= 96                                  # MobileNetV3-style: HardSwish (and squeeze-excite) late
        act = (lambda v: g.op("HardSwish", [v])) if late else g.relu6
        for i in range(n):
            hid = cin * t
            y = x
            if t != 1:
                y = act(g.bn(g.conv(y, cin, hid, 1, bias=False), hid))
            y = act(g.bn(g.conv(y, hid, hid, 3, s=s if i == 0 else 1, g=hid, bias=False), hid))      # depthwise
            if c == 160:                                # squeeze-excite
                se = g.op("GlobalAveragePool", [y])
                se = g.relu(g.conv(se, hid, max(8, hid // 4), 1))
                se = g.op("HardSigmoid", [g.conv(se, max(8, hid // 4), hid, 1, gain=1.0)], alpha=1 / 6, beta=0.5)
                y = g.op("Mul", [y, se])
            y = g.bn(g.conv(y, hid, cout, 1, bias=False), cout, gamma=(0.3, 0.5))
            x = g.op("Add", [x, y]) if (s == 1 or i > 0) and cin == cout else y
            cin = cout
    last = 1280 if preset == "full" else ch(1280)
    x = g.op("HardSwish", [g.bn(g.conv(x, cin, last, 1, bias=False), last)])
    g.classify(x, last)
    return g.model(_meta({"pixel_values": {"kind": "normal"}}))


def unet(preset: str) -> onnx.ModelProto:
    res = {"tiny": 32, "small": 128, "full": 256}[preset]
    c = {"tiny": 4, "small": 16, "full": 32}[preset]
    g = G("unet", seed=3)

    def double(x, cin, cout):
        x = g.relu(g.bn(g.conv(x, cin, cout, 3, bias=False), cout))
        return g.relu(g.bn(g.conv(x, cout, cout, 3, bias=False), cout))

    def pool(x):
        return g.op("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])

    def resize(x, mode):
        roi, scales = g.const(np.zeros(0, np.float32), "roi"), g.const(np.array([1, 1, 2, 2], np.float32), "scales")
        if mode == "nearest":
            return g.op("Resize", [x, roi, scales], mode="nearest", coordinate_transformation_mode="asymmetric",
                        nearest_mode="floor")
        return g.op("Resize", [x, roi, scales], mode="linear", coordinate_transformation_mode="half_pixel")

    x = g.input("image", T.FLOAT, ["N", 3, res, res])
    e1 = double(x, 3, c)
    e2 = double(pool(e1), c, 2 * c)
    e3 = double(pool(e2), 2 * c, 4 * c)
    b = double(pool(e3), 4 * c, 8 * c)
    w = g.randn((8 * c, 4 * c, 2, 2), math.sqrt(1.0 / (8 * c)))
    u3 = g.op("ConvTranspose", [b, w, g.randn((4 * c,), 0.02, "b")], kernel_shape=[2, 2], strides=[2, 2])
    d3 = double(g.op("Concat", [u3, e3], axis=1), 8 * c, 4 * c)
    u2 = g.conv(resize(d3, "nearest"), 4 * c, 2 * c, 1)
    d2 = double(g.op("Concat", [u2, e2], axis=1), 4 * c, 2 * c)
    u1 = g.conv(resize(d2, "linear"), 2 * c, c, 1)
    d1 = double(g.op("Concat", [u1, e1], axis=1), 2 * c, c)
    g.output(g.op("Sigmoid", [g.conv(d1, c, 2, 1, gain=1.0)]), "mask", shape=["N", 2, res, res])
    return g.model(_meta({"image": {"kind": "normal"}}))


def _mha(g: G, x, d: int, heads: int, mask=None):
    """Multi-head self-attention on [N, T, d] as exporters write it (reshape/transpose, MatMul, Softmax)."""
    dk = d // heads
    q, k, v = (g.linear(x, d, d) for _ in range(3))
    split = g.shape([0, 0, heads, dk])
    q = g.op("Transpose", [g.op("Reshape", [q, split])], perm=[0, 2, 1, 3])        # [N, h, T, dk]
    k = g.op("Transpose", [g.op("Reshape", [k, split])], perm=[0, 2, 3, 1])        # [N, h, dk, T]
    v = g.op("Transpose", [g.op("Reshape", [v, split])], perm=[0, 2, 1, 3])
    s = g.op("Div", [g.op("MatMul", [q, k]), g.const(np.float32(math.sqrt(dk)), "scale")])
    if mask is not None:
        s = g.op("Add", [s, mask])
    a = g.op("MatMul", [g.op("Softmax", [s], axis=-1), v])
    a = g.op("Reshape", [g.op("Transpose", [a], perm=[0, 2, 1, 3]), g.shape([0, 0, d])])
    return g.linear(a, d, d)


def conformer(preset: str) -> onnx.ModelProto:
    frames = {"tiny": 32, "small": 200, "full": 400}[preset]
    d, heads, layers, kernel = {"tiny": (32, 2, 1, 7), "small": (144, 4, 2, 15), "full": (256, 4, 4, 15)}[preset]
    feat, sub = 80, 32 if preset != "tiny" else 8
    vocab = 256
    g = G("conformer", seed=4)
    x = g.input("features", T.FLOAT, ["N", frames, feat])
    # Conv2d subsampling (x4 in time and frequency), then a Linear to d
    y = g.op("Unsqueeze", [x, g.shape([1])])                                    # [N, 1, T, F]
    y = g.relu(g.conv(y, 1, sub, 3, s=2, p=0))
    y = g.relu(g.conv(y, sub, sub, 3, s=2, p=0))
    t4, f4 = (frames - 3) // 2 + 1, (feat - 3) // 2 + 1
    t4, f4 = (t4 - 3) // 2 + 1, (f4 - 3) // 2 + 1
    y = g.op("Reshape", [g.op("Transpose", [y], perm=[0, 2, 1, 3]), g.shape([0, 0, -1])])     # [N, T', C*F']
    x = g.linear(y, sub * f4, d)

    def ffn(x):
        y = g.linear(g.swish(g.linear(g.layernorm(x, d), d, 4 * d)), 4 * d, d)
        return g.op("Add", [x, g.op("Mul", [y, g.const(np.float32(0.5), "half")])])

    for _ in range(layers):
        x = ffn(x)
        x = g.op("Add", [x, _mha(g, g.layernorm(x, d), d, heads)])
        # conv module: pointwise -> GLU -> depthwise -> BN -> Swish -> pointwise
        y = g.op("Transpose", [g.layernorm(x, d)], perm=[0, 2, 1])             # [N, d, T]
        y = g.conv1d(y, d, 2 * d, 1, gain=1.0)
        a, b = g.op("Split", [y, g.shape([d, d])], n_out=2, axis=1)
        y = g.op("Mul", [a, g.op("Sigmoid", [b])])
        y = g.swish(g.bn(g.conv1d(y, d, d, kernel, g=d, bias=False), d))
        y = g.conv1d(y, d, d, 1, gain=1.0)
        x = g.op("Add", [x, g.op("Transpose", [y], perm=[0, 2, 1])])
        x = g.layernorm(ffn(x), d)
    g.output(g.op("LogSoftmax", [g.linear(x, d, vocab)], axis=-1), "log_probs", shape=["N", t4, vocab])
    return g.model(_meta({"features": {"kind": "normal"}}))


def bert(preset: str) -> onnx.ModelProto:
    seq, hidden, layers, heads, vocab = {"tiny": (16, 32, 1, 2, 128), "small": (64, 768, 2, 12, 8192),
                                         "full": (128, 768, 12, 12, 30522)}[preset]
    ff = 4 * hidden
    g = G("bert", seed=5)
    ids = g.input("input_ids", T.INT64, ["N", seq])
    am = g.input("attention_mask", T.INT64, ["N", seq])
    x = g.op("Gather", [g.randn((vocab, hidden), 0.5, "word_emb"), ids], axis=0)
    x = g.op("Add", [x, g.randn((seq, hidden), 0.5, "pos_emb")])
    x = g.op("Add", [x, g.randn((hidden,), 0.5, "type_emb")])
    x = g.layernorm(x, hidden)
    m = g.op("Cast", [g.op("Unsqueeze", [am, g.shape([1, 2])])], to=T.FLOAT)     # [N, 1, 1, S]
    mask = g.op("Mul", [g.op("Sub", [g.const(np.float32(1), "one"), m]), g.const(np.float32(-10000.0), "neg")])
    sqrt2, half, one = (g.const(np.float32(v), n) for v, n in ((math.sqrt(2), "sqrt2"), (0.5, "half"), (1.0, "one")))
    for _ in range(layers):
        x = g.layernorm(g.op("Add", [x, _mha(g, x, hidden, heads, mask)]), hidden)
        y = g.linear(x, hidden, ff)
        y = g.op("Mul", [g.op("Mul", [y, g.op("Add", [g.op("Erf", [g.op("Div", [y, sqrt2])]), one])]), half])
        x = g.layernorm(g.op("Add", [x, g.linear(y, ff, hidden)]), hidden)
    g.output(x, "last_hidden_state", shape=["N", seq, hidden])
    cls = g.op("Gather", [x, g.const(np.array(0, np.int64), "zero")], axis=1)
    g.output(g.op("Tanh", [g.gemm(cls, hidden, hidden)]), "pooler_output", shape=["N", hidden])
    return g.model(_meta({"input_ids": {"kind": "ids", "high": vocab}, "attention_mask": {"kind": "mask"}}))


def _rnn_weights(g: G, kind: str, din: int, h: int, dirs: int):
    gates = 4 if kind == "LSTM" else 3
    s = 1.0 / math.sqrt(h)
    return [g.uniform((dirs, gates * h, din), -s, s, "W"), g.uniform((dirs, gates * h, h), -s, s, "R"),
            g.uniform((dirs, 2 * gates * h), -s, s, "B")]


def speech_rnn(kind: str, preset: str) -> onnx.ModelProto:
    frames, h, layers = {"tiny": (16, 16, 1), "small": (100, 128, 2), "full": (200, 256, 2)}[preset]
    feat, vocab = 80, 32
    bidir = kind == "LSTM"
    dirs = 2 if bidir else 1
    g = G(f"{kind.lower()}_speech", seed=6 if bidir else 7)
    x = g.input("features", T.FLOAT, ["N", frames, feat])
    y = g.op("Transpose", [x], perm=[1, 0, 2])                                  # [T, N, F]
    din = feat
    for _ in range(layers):
        attrs = {"hidden_size": h, "direction": "bidirectional" if bidir else "forward"}
        if kind == "GRU":
            attrs["linear_before_reset"] = 1
        out = g.op(kind, [y, *_rnn_weights(g, kind, din, h, dirs)], n_out=1, **attrs)     # Y: [T, dirs, N, h]
        y = g.op("Reshape", [g.op("Transpose", [out], perm=[0, 2, 1, 3]), g.shape([0, 0, -1])])    # [T, N, dirs*h]
        din = dirs * h
    y = g.op("Transpose", [y], perm=[1, 0, 2])                                  # [N, T, dirs*h]
    g.output(g.op("LogSoftmax", [g.linear(y, din, vocab)], axis=-1), "log_probs", shape=["N", frames, vocab])
    return g.model(_meta({"features": {"kind": "normal"}}))


def add_1x4(preset: str) -> onnx.ModelProto:
    g = G("add_1x4")
    x = g.input("x", T.FLOAT, ["N", 4])
    g.outputs.append(helper.make_tensor_value_info("y", T.FLOAT, ["N", 4]))
    g.nodes.append(helper.make_node("Add", [x, x], ["y"], name="add"))
    return g.model(_meta({"x": {"kind": "normal"}}))


def conv_1node(preset: str) -> onnx.ModelProto:
    c, res = {"tiny": (4, 8), "small": (16, 32), "full": (16, 32)}[preset]
    g = G("conv_1node", seed=8)
    x = g.input("x", T.FLOAT, ["N", c, res, res])
    w, b = g.randn((c, c, 3, 3), math.sqrt(2 / (9 * c))), g.randn((c,), 0.02, "b")
    g.outputs.append(helper.make_tensor_value_info("y", T.FLOAT, ["N", c, res, res]))
    g.nodes.append(helper.make_node("Conv", [x, w, b], ["y"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
    return g.model(_meta({"x": {"kind": "normal"}}))


# --------------------------------------------------------------------------- one-op cases
def _one(name: str, op_type: str, in_shapes, out_shape, weights=(), **attrs):
    """A one-node model: ``in_shapes`` (name -> shape with "N", or preset -> that) are its graph inputs, then
    ``weights`` (``(G, preset) -> [initializer names]``) its remaining inputs in order."""
    def make(preset: str) -> onnx.ModelProto:
        g = G(name, seed=9)
        shapes = in_shapes(preset) if callable(in_shapes) else in_shapes
        ins = []
        for n, shp in shapes.items():
            ins.append(g.input(n, T.FLOAT, shp))
        ws = weights(g, preset) if callable(weights) else list(weights)
        out = out_shape(preset) if callable(out_shape) else out_shape
        g.outputs.append(helper.make_tensor_value_info("y", T.FLOAT, out))
        g.nodes.append(helper.make_node(op_type, ins + ws, ["y"], name=op_type.lower(), **attrs))
        return g.model(_meta({n: {"kind": "normal"} for n in shapes}, family=op_type))
    make.__name__ = name
    return make


def _s(preset: str, small, full, tiny=None):
    return {"tiny": tiny if tiny is not None else small, "small": small, "full": full}[preset]


def _conv_case(name, cin, cout, k, res, s=1, group=1):
    def shapes(p):
        r = _s(p, max(8, res // 2), res, 8)
        return {"x": ["N", cin, r, r]}

    def w(g, p):
        return [g.randn((cout, cin // group, k, k), math.sqrt(2 / (cin // group * k * k))), g.randn((cout,), 0.02, "b")]

    def out(p):
        r = _s(p, max(8, res // 2), res, 8)
        return ["N", cout, (r + 2 * (k // 2) - k) // s + 1, (r + 2 * (k // 2) - k) // s + 1]
    return _one(name, "Conv", shapes, out, w, kernel_shape=[k, k], strides=[s, s], pads=[k // 2] * 4, group=group)


def _rnn_case(kind: str):
    name = f"op_{kind.lower()}"

    def shapes(p):
        return {"x": [_s(p, 50, 100, 8), "N", 80]}

    def w(g, p):
        return _rnn_weights(g, kind, 80, _s(p, 128, 256, 16), 1)

    def out(p):
        return [_s(p, 50, 100, 8), 1, "N", _s(p, 128, 256, 16)]

    def make(preset):
        g = G(name, seed=10)
        x = g.input("x", T.FLOAT, shapes(preset)["x"])
        attrs = {"hidden_size": _s(preset, 128, 256, 16)}
        if kind == "GRU":
            attrs["linear_before_reset"] = 1
        g.outputs.append(helper.make_tensor_value_info("y", T.FLOAT, out(preset)))
        g.nodes.append(helper.make_node(kind, [x, *w(g, preset)], ["y"], name=kind.lower(), **attrs))
        return g.model(_meta({"x": {"kind": "normal"}}, family=kind))
    make.__name__ = name
    return make


def _pool_case(name, op_type, c, res, k, s, pads=0):
    def shapes(p):
        return {"x": ["N", c, _s(p, res // 2, res, 8), _s(p, res // 2, res, 8)]}

    def out(p):
        r = _s(p, res // 2, res, 8)
        o = (r + 2 * pads - k) // s + 1
        return ["N", c, o, o]
    return _one(name, op_type, shapes, out, (), kernel_shape=[k, k], strides=[s, s], pads=[pads] * 4)


def _resize_case(name, mode, c, res):
    def shapes(p):
        return {"x": ["N", c, _s(p, res // 2, res, 8), _s(p, res // 2, res, 8)]}

    def w(g, p):
        return [g.const(np.zeros(0, np.float32), "roi"), g.const(np.array([1, 1, 2, 2], np.float32), "scales")]

    def out(p):
        r = _s(p, res // 2, res, 8)
        return ["N", c, 2 * r, 2 * r]
    attrs = ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
             if mode == "nearest" else {"mode": "linear", "coordinate_transformation_mode": "half_pixel"})
    return _one(name, "Resize", shapes, out, w, **attrs)


def _matmul_case(name, m, k, n):
    def shapes(p):
        return {"x": ["N", _s(p, m // 2, m, 4), k]}

    def w(g, p):
        return [g.randn((k, n), math.sqrt(1 / k))]
    return _one(name, "MatMul", shapes, lambda p: ["N", _s(p, m // 2, m, 4), n], w)


def _bmm_case(name, heads, s, dk):
    def shapes(p):
        ss = _s(p, s // 2, s, 4)
        return {"a": ["N", heads, ss, dk], "b": ["N", heads, dk, ss]}
    return _one(name, "MatMul", shapes, lambda p: ["N", heads, _s(p, s // 2, s, 4), _s(p, s // 2, s, 4)])


def _convt_case(name, cin, cout, res):
    def shapes(p):
        return {"x": ["N", cin, _s(p, res // 2, res, 8), _s(p, res // 2, res, 8)]}

    def w(g, p):
        return [g.randn((cin, cout, 2, 2), math.sqrt(1 / cin)), g.randn((cout,), 0.02, "b")]

    def out(p):
        r = _s(p, res // 2, res, 8)
        return ["N", cout, 2 * r, 2 * r]
    return _one(name, "ConvTranspose", shapes, out, w, kernel_shape=[2, 2], strides=[2, 2])


def _ln_case(name, s, c):
    def shapes(p):
        return {"x": ["N", _s(p, s // 2, s, 4), c]}

    def w(g, p):
        return [g.uniform((c,), 0.9, 1.1, "ln_s"), g.randn((c,), 0.02, "ln_b")]
    return _one(name, "LayerNormalization", shapes, lambda p: ["N", _s(p, s // 2, s, 4), c], w, axis=-1,
                epsilon=1e-5)


def _softmax_case(name, heads, s):
    def shapes(p):
        ss = _s(p, s // 2, s, 4)
        return {"x": ["N", heads, ss, ss]}
    return _one(name, "Softmax", shapes, lambda p: ["N", heads, _s(p, s // 2, s, 4), _s(p, s // 2, s, 4)], axis=-1)


#: name -> builder(preset) -> ModelProto
MODELS = {
    "add_1x4": add_1x4,
    "conv_1node": conv_1node,
    "resnet18": lambda p: resnet(18, p),
    "resnet50": lambda p: resnet(50, p),
    "mobilenetv2": mobilenetv2,
    "unet": unet,
    "conformer": conformer,
    "bert": bert,
    "lstm_speech": lambda p: speech_rnn("LSTM", p),
    "gru_speech": lambda p: speech_rnn("GRU", p),
}
#: the one-node models whose per-call time is the EP's floor
FLOOR_MODELS = ("add_1x4", "conv_1node")

OPS = {
    "op_conv3x3_c64_r56": _conv_case("op_conv3x3_c64_r56", 64, 64, 3, 56),
    "op_conv3x3_c256_r14": _conv_case("op_conv3x3_c256_r14", 256, 256, 3, 14),
    "op_conv7x7s2_stem_r224": _conv_case("op_conv7x7s2_stem_r224", 3, 64, 7, 224, s=2),
    "op_conv1x1_c256to64_r56": _conv_case("op_conv1x1_c256to64_r56", 256, 64, 1, 56),
    "op_dwconv3x3_c144_r56": _conv_case("op_dwconv3x3_c144_r56", 144, 144, 3, 56, group=144),
    "op_dwconv3x3s2_c96_r112": _conv_case("op_dwconv3x3s2_c96_r112", 96, 96, 3, 112, s=2, group=96),
    "op_convtranspose2x2_c64_r64": _convt_case("op_convtranspose2x2_c64_r64", 64, 32, 64),
    "op_maxpool3x3s2_c64_r112": _pool_case("op_maxpool3x3s2_c64_r112", "MaxPool", 64, 112, 3, 2, 1),
    "op_avgpool2x2_c64_r56": _pool_case("op_avgpool2x2_c64_r56", "AveragePool", 64, 56, 2, 2),
    "op_globalavgpool_c512_r14": _one("op_globalavgpool_c512_r14", "GlobalAveragePool",
                                      lambda p: {"x": ["N", 512, _s(p, 7, 14, 4), _s(p, 7, 14, 4)]},
                                      ["N", 512, 1, 1]),
    "op_resize_nearest2x_c64_r64": _resize_case("op_resize_nearest2x_c64_r64", "nearest", 64, 64),
    "op_resize_linear2x_c64_r64": _resize_case("op_resize_linear2x_c64_r64", "linear", 64, 64),
    "op_lstm": _rnn_case("LSTM"),
    "op_gru": _rnn_case("GRU"),
    "op_layernorm_s128_c768": _ln_case("op_layernorm_s128_c768", 128, 768),
    "op_softmax_h12_s128": _softmax_case("op_softmax_h12_s128", 12, 128),
    "op_matmul_s128_768x3072": _matmul_case("op_matmul_s128_768x3072", 128, 768, 3072),
    "op_bmm_h12_s128_d64": _bmm_case("op_bmm_h12_s128_d64", 12, 128, 64),
}
ALL = {**MODELS, **OPS}


# --------------------------------------------------------------------------- building, inputs
def path(name: str, preset: str, root: str = OUT_ROOT) -> str:
    return os.path.join(root, preset, f"{name}.onnx")


def meta(model) -> dict:
    m = model if isinstance(model, onnx.ModelProto) else onnx.load(model, load_external_data=False)
    for p in m.metadata_props:
        if p.key == META_KEY:
            return json.loads(p.value)
    raise KeyError(f"{META_KEY} metadata missing (not built by models/build_general.py)")


def _cached(p: str, preset: str) -> bool:
    if not os.path.exists(p):
        return False
    try:
        m = meta(p)
    except Exception:  # noqa: BLE001 - an unreadable or foreign file is rebuilt
        return False
    return m.get("recipe") == RECIPE and m.get("preset") == preset


def build(name: str, preset: str = "small", root: str = OUT_ROOT, force: bool = False) -> str:
    """The model's path, built (and checked by onnx.checker) unless a build of this recipe and preset exists."""
    if name not in ALL:
        raise KeyError(f"unknown model {name!r}; models: {', '.join(ALL)}")
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    p = path(name, preset, root)
    if not force and _cached(p, preset):
        return p
    m = ALL[name](preset)
    md = meta(m)
    md["preset"] = preset
    md["params"] = int(sum(int(np.prod(t.dims)) for t in m.graph.initializer))
    helper.set_model_props(m, {META_KEY: json.dumps(md)})
    onnx.checker.check_model(m, full_check=True)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    tmp = f"{p}.{os.getpid()}.tmp"
    onnx.save(m, tmp)
    os.replace(tmp, p)
    return p


def feeds(model_path: str, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for ``batch`` rows: the graph inputs' shapes with "N" replaced, values as the metadata says."""
    m = onnx.load(model_path, load_external_data=False)
    md = meta(m)
    rng = np.random.default_rng(seed)
    out = {}
    for vi in m.graph.input:
        spec = md["inputs"].get(vi.name, {"kind": "normal"})
        shape = [batch if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]
        kind = spec["kind"]
        if kind == "ids":
            out[vi.name] = rng.integers(0, spec["high"], shape, dtype=np.int64)
        elif kind == "mask":
            a = np.ones(shape, np.int64)
            for r in range(shape[0]):                 # row r: its last (r * 3) % (S // 2) positions padded
                pad = (r * 3) % max(1, shape[1] // 2)
                if pad:
                    a[r, -pad:] = 0
            out[vi.name] = a
        else:
            out[vi.name] = rng.standard_normal(shape, dtype=np.float32)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=PRESETS)
    ap.add_argument("--models", default="all", help="comma-separated names, 'models', 'ops' or 'all' (default)")
    ap.add_argument("--out", default=OUT_ROOT)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        for n in ALL:
            print(n)
        return 0
    names = select(args.models)
    for n in names:
        t0 = time.perf_counter()
        p = build(n, args.preset, args.out, args.force)
        m = onnx.load(p, load_external_data=False)
        print(f"{p}: {len(m.graph.node)} nodes, {meta(m)['params'] / 1e6:.2f} M params, "
              f"{os.path.getsize(p) / 2**20:.1f} MiB ({time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


def select(spec: str) -> list[str]:
    """Names from a comma-separated list; 'all', 'models', 'ops', 'floor' expand, and a name's prefix (with or
    without ``op_``) picks every case it starts (``conv`` -> every op_conv* case, ``resnet`` -> both ResNets)."""
    out: list[str] = []
    for part in (s.strip() for s in spec.split(",")):
        if not part:
            continue
        group = {"all": list(ALL), "models": list(MODELS), "ops": list(OPS), "floor": list(FLOOR_MODELS)}.get(part)
        if group is None:
            group = [part] if part in ALL else [n for n in ALL if n.startswith((part, f"op_{part}"))]
            if not group:
                raise SystemExit(f"unknown model {part!r}; models: {', '.join(ALL)}")
        out += [n for n in group if n not in out]
    return out


if __name__ == "__main__":
    sys.exit(main())
