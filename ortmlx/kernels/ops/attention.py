"""ai.onnx Attention (opset 23, 24): MHA / GQA / MQA, 3-D or 4-D inputs, past/present KV cache,
bool or float attn_mask, causal masking (bottom-right aligned by the cache offset), softcap,
the optional qk_matmul_output, and (24) nonpad_kv_seqlen.

Scores, softmax and the weighted sum run in float32 for half inputs, as ORT's CPU kernel does.
"""
from __future__ import annotations

import math

import mlx.core as mx

from .. import consts
from .. import dtypes as dt
from ..registry import register

#: bf16: ORT's CPU EP has no kernel; checked against float32 math on bf16-rounded inputs (tests)
ATTN_TYPES = frozenset({dt.FLOAT, dt.FLOAT16, dt.BFLOAT16})


def _out(view, i):
    return i < len(view.node.outputs) and bool(view.node.outputs[i])


def _attn_check(view):
    t = view.dtype(0)
    for i in (1, 2, 4, 5):
        if view.has(i) and view.dtype(i) != t:
            return f"input {i} is {dt.name(view.dtype(i))}, Q is {dt.name(t)}"
    if view.has(3) and view.dtype(3) not in (t, dt.BOOL):
        return f"attn_mask is {dt.name(view.dtype(3))}"
    if view.has(4) != view.has(5):
        return "past_key and past_value must come together"
    mode = view.attrs.get("qk_matmul_output_mode", 0)
    if mode not in (0, 1, 2, 3):
        return f"qk_matmul_output_mode {mode}"
    sp = view.attrs.get("softmax_precision")
    if sp is not None and sp != dt.FLOAT:
        return f"softmax_precision {dt.name(sp)} (only float32 softmax is implemented)"
    r = view.rank(0)
    if r is not None and r not in (3, 4):
        return f"Q rank {r}"
    if r == 3 and (view.attrs.get("q_num_heads") is None or view.attrs.get("kv_num_heads") is None):
        return "3-D inputs need q_num_heads and kv_num_heads"
    if view.has(3):
        ms = view.shape(3)
        ks = view.shape(1)
        if ms is None or ks is None:
            return "attn_mask or K shape unknown: a shorter mask would need -inf padding"
        past = view.shape(4)[2] if view.has(4) and view.shape(4) is not None else 0
        kv = ks[2] if len(ks) == 4 else ks[1]
        if not isinstance(ms[-1], int) or not isinstance(kv, int) or not isinstance(past, int) \
                or ms[-1] != past + kv:
            return f"attn_mask last dim {ms[-1]} is not the total sequence length {past}+{kv} (padding not done)"
    if view.n_inputs > 6 and view.has(6):
        if view.has(4) or _out(view, 1):
            return "nonpad_kv_seqlen with a past/present cache"
    return None


def _heads(x, n):
    """(B, S, n*D) -> (B, n, S, D)."""
    b, s, h = x.shape
    if h % n:
        raise ValueError(f"hidden size {h} is not a multiple of {n} heads")
    return x.reshape(b, s, n, h // n).transpose(0, 2, 1, 3)


def attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, *, is_causal=0,
              kv_num_heads=None, q_num_heads=None, qk_matmul_output_mode=0, scale=None, softcap=0.0,
              softmax_precision=None, n_outputs=1):
    three_d = Q.ndim == 3
    if Q.shape[0] == 0:
        raise ValueError("batch size 0 (ORT's CPU kernel rejects it too)")
    if three_d:
        if q_num_heads is None or kv_num_heads is None:
            raise ValueError("3-D Attention inputs need q_num_heads and kv_num_heads")
        q, k, v = _heads(Q, q_num_heads), _heads(K, kv_num_heads), _heads(V, kv_num_heads)
    else:
        q, k, v = Q, K, V
    if past_key is not None:
        k = mx.concatenate([past_key, k], axis=2)
        v = mx.concatenate([past_value, v], axis=2)
    present_k, present_v = k, v
    past_len = past_key.shape[2] if past_key is not None else 0
    b, hq, sq, d = q.shape
    hkv, total = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"q heads {hq} not a multiple of kv heads {hkv}")
    sc = scale if scale is not None else 1.0 / math.sqrt(d)
    if (q.dtype == mx.float32 and not softcap and n_outputs < 4 and attn_mask is None
            and nonpad_kv_seqlen is None and (not is_causal or total - past_len == sq) and b * sq * total):
        # the fused kernel matches here: no mask (or MLX's lower-right causal == offset past_len), fp32
        y = mx.fast.scaled_dot_product_attention(q, k, v, scale=sc, mask="causal" if is_causal else None)
        if three_d:
            y = y.transpose(0, 2, 1, 3).reshape(b, sq, -1)
        return (y, present_k, present_v) if n_outputs > 1 else y
    acc = mx.float32
    qf, kf, vf = q.astype(acc), k.astype(acc), v.astype(acc)
    if hq != hkv:
        kf = mx.repeat(kf, hq // hkv, axis=1)
        vf = mx.repeat(vf, hq // hkv, axis=1)
    s = mx.matmul(qf, kf.swapaxes(-1, -2)) * mx.array(sc, acc)
    qk0 = s
    if softcap and softcap > 0:
        s = mx.array(softcap, acc) * mx.tanh(s / mx.array(softcap, acc))
    qk1 = s
    allowed = None                                         # bool (.., sq, total): key may be attended
    if attn_mask is not None:
        if attn_mask.dtype == mx.bool_:
            allowed = attn_mask
        else:
            s = s + attn_mask.astype(acc)
    if is_causal:
        qi = consts.arange(sq).reshape(sq, 1)
        kj = consts.arange(total).reshape(1, total)
        if nonpad_kv_seqlen is not None and past_key is None:
            off = (nonpad_kv_seqlen.astype(mx.int32) - sq).reshape(b, 1, 1, 1)
            causal = kj <= qi + off
        else:
            causal = kj <= qi + past_len
        allowed = causal if allowed is None else mx.logical_and(allowed, causal)
    if nonpad_kv_seqlen is not None:
        valid = consts.arange(total).reshape(1, 1, 1, total) < nonpad_kv_seqlen.astype(mx.int32).reshape(b, 1, 1, 1)
        allowed = valid if allowed is None else mx.logical_and(allowed, valid)
    if allowed is not None:
        s = mx.where(allowed, s, mx.array(-float("inf"), acc))
    qk2 = s
    m = mx.max(s, axis=-1, keepdims=True)
    m = mx.where(mx.isinf(m) & (m < 0), mx.zeros_like(m), m)    # fully masked rows: no NaN from -inf - -inf
    e = mx.exp(s - m)
    den = mx.sum(e, axis=-1, keepdims=True)
    p = e / mx.where(den == 0, mx.ones_like(den), den)
    y = mx.matmul(p, vf).astype(Q.dtype)
    if three_d:
        y = y.transpose(0, 2, 1, 3).reshape(b, sq, -1)
    outs = [y]
    if n_outputs > 1:
        outs += [present_k, present_v]
    if n_outputs > 3:
        qk = (qk0, qk1, qk2, p)[qk_matmul_output_mode]
        outs.append(qk.astype(Q.dtype))
    return tuple(outs) if len(outs) > 1 else y


@register("Attention", 23, dtypes=ATTN_TYPES, check=_attn_check)
def attention_23(Q, K, V, attn_mask=None, past_key=None, past_value=None, *, is_causal=0, kv_num_heads=None,
                 q_num_heads=None, qk_matmul_output_mode=0, scale=None, softcap=0.0, softmax_precision=None, ctx):
    """Scaled dot-product attention (see the module docstring)."""
    return attention(Q, K, V, attn_mask, past_key, past_value, None, is_causal=is_causal, kv_num_heads=kv_num_heads,
                     q_num_heads=q_num_heads, qk_matmul_output_mode=qk_matmul_output_mode, scale=scale,
                     softcap=softcap, softmax_precision=softmax_precision, n_outputs=ctx.n_outputs)


@register("Attention", 24, dtypes=ATTN_TYPES, check=_attn_check)
def attention_24(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, *, is_causal=0,
                 kv_num_heads=None, q_num_heads=None, qk_matmul_output_mode=0, scale=None, softcap=0.0,
                 softmax_precision=None, ctx):
    """Opset 24: adds nonpad_kv_seqlen (external cache; bottom-right causal offset per batch)."""
    return attention(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, is_causal=is_causal,
                     kv_num_heads=kv_num_heads, q_num_heads=q_num_heads,
                     qk_matmul_output_mode=qk_matmul_output_mode, scale=scale, softcap=softcap,
                     softmax_precision=softmax_precision, n_outputs=ctx.n_outputs)
