"""Elementwise arithmetic (binary ops broadcast numpy-style, as ONNX does from opset 7)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ..registry import register


@register("Add", 7, host=np.add)
def add(A, B):
    return mx.add(A, B)


@register("Sub", 7, host=np.subtract)
def sub(A, B):
    return mx.subtract(A, B)


@register("Mul", 7, host=np.multiply)
def mul(A, B):
    return mx.multiply(A, B)


@register("Relu", 6)
def relu(X):
    return mx.maximum(X, mx.array(0, X.dtype))
