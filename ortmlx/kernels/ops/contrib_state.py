"""com.microsoft ops with a carried state, as genai's builder emits them for hybrid models:
CausalConvWithState (LFM2's short convolutions; Qwen3.5 / Mamba's preprocessing).

CausalConvWithState (ndim 1): a causal depthwise convolution over the virtual input
concat(past_state, input) along the last axis; output position t of channel c is
sum_j weight[c, 0, j] * virtual[c, t + j * dilation] (+ bias[c]), then the activation (SiLU/Swish or
none); present_state is the virtual input's last (k - 1) * dilation positions. No past_state: zeros.
channels_last = 1 is the same with (B, L, C) activations and (B, state_length, C) states. Half inputs
compute in float32 and round once. Pure MLX ops of the shapes (taps gathered with ``take``): traceable.
"""
from __future__ import annotations

import mlx.core as mx

from .. import consts
from .. import dtypes as dt
from ..registry import MS, register

_TYPES = {dt.FLOAT, dt.FLOAT16, dt.BFLOAT16}


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _ccs_check(v) -> str | None:
    a = v.attrs
    if v.dtype(0) not in _TYPES:
        return f"dtype {dt.name(v.dtype(0))} (float, float16, bfloat16 only)"
    if a.get("ndim", 1) != 1:
        return f"ndim={a.get('ndim', 1)} (1D only)"
    if a.get("state_window", 0) != 0:
        return f"state_window={a['state_window']} not supported"
    if a.get("dilation", 1) < 1:
        return f"dilation={a['dilation']}"
    if _s(a.get("activation", "none")) not in ("none", "silu", "swish"):
        return f"activation={_s(a['activation'])!r}"
    if v.rank(0) not in (None, 3):
        return f"input rank {v.rank(0)} (3D only)"
    if v.rank(1) not in (None, 3):
        return f"weight rank {v.rank(1)} (channels, 1, k) only"
    for i in (1, 2, 3):
        if v.has(i) and v.dtype(i) != v.dtype(0):
            return f"input {i} is {dt.name(v.dtype(i))}, input {dt.name(v.dtype(0))}"
    return None


def causal_conv_with_state(x, weight, bias, past, *, dilation: int = 1, activation: str = "none"):
    """(output, present_state) of channels-first x (B, C, L) with past (B, C, (k - 1) * dilation) or None."""
    b, c, n = x.shape
    if weight.ndim != 3 or weight.shape[:2] != (c, 1):
        raise ValueError(f"weight shape {weight.shape}, expected ({c}, 1, k)")
    k = weight.shape[2]
    ls = (k - 1) * dilation
    if past is None:
        past = consts.zeros((b, c, ls), x.dtype) if ls else None
    elif past.shape != (b, c, ls):
        raise ValueError(f"past_state shape {past.shape}, expected ({b}, {c}, {ls})")
    if bias is not None and bias.shape != (c,):
        raise ValueError(f"bias shape {bias.shape}, expected ({c},)")
    virt = x if past is None else mx.concatenate([past.astype(x.dtype), x], axis=2)      # (B, C, ls + L)
    taps = (consts.arange(k) * dilation).reshape(k, 1) + consts.arange(n).reshape(1, n)   # (k, L)
    win = mx.take(virt, taps.reshape(-1), axis=2).reshape(b, c, k, n).astype(mx.float32)
    w = weight.reshape(c, k).astype(mx.float32)
    y = mx.sum(win * w.reshape(1, c, k, 1), axis=2)
    if bias is not None:
        y = y + bias.astype(mx.float32).reshape(1, c, 1)
    if activation in ("silu", "swish"):
        y = y * mx.sigmoid(y)
    if ls:
        present = mx.take(virt, consts.arange(ls) + n, axis=2)
    else:
        present = consts.zeros((b, c, 0), x.dtype)
    return y.astype(x.dtype), present


@register("CausalConvWithState", 1, domain=MS, check=_ccs_check)
def causal_conv_with_state_op(input, weight, bias=None, past_state=None, *, ndim=1, activation="none", dilation=1,
                              state_window=0, channels_last=0):
    """CausalConvWithState (com.microsoft), ndim 1; outputs (output, present_state)."""
    act = _s(activation)
    if channels_last:
        b, n = input.shape[:2]
        x = input.reshape(b, n, -1).transpose(0, 2, 1)
        p = None if past_state is None else past_state.reshape(b, past_state.shape[1], -1).transpose(0, 2, 1)
        y, pres = causal_conv_with_state(x, weight, bias, p, dilation=dilation, activation=act)
        return (y.transpose(0, 2, 1).reshape(input.shape),
                pres.transpose(0, 2, 1).reshape((b, pres.shape[2]) + tuple(input.shape[2:])))
    return causal_conv_with_state(input, weight, bias, past_state, dilation=dilation, activation=act)
