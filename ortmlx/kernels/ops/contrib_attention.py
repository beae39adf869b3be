"""com.microsoft attention ops: GroupQueryAttention, MultiHeadAttention, RotaryEmbedding.

Semantics follow ORT's CPU kernels (contrib_ops/cpu/bert). The cores (``gqa_core``,
``apply_rotary``, ``rotary_tables``) are pure functions of MLX arrays plus Python
ints/flags: no host reads, no data-dependent shapes, no slicing, so they can be traced.
"""
from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from .. import build, consts, cuda_kernels
from .. import dtypes as dt
from ..registry import MS, register

#: ORT's CPU kernels have float and float16; bfloat16 is tested against them in float32
_FLOATS = {dt.FLOAT, dt.FLOAT16, dt.BFLOAT16}


# ---------------------------------------------------------------------------- rotary
def rotary_tables(cos_cache, sin_cache, positions, head_size: int, interleaved: bool):
    """cos/sin per head-dim element for ``positions`` (any int shape P): (*P, head_size) each.

    The sin table carries the sign of the rotation, so ``x*cos + x[perm]*sin`` is the
    rotated value on the first ``rotary_dim`` features. Beyond rotary_dim: cos 1, sin 0.
    Tables are float32 (the cache values, exactly), as ``apply_rotary`` computes.
    """
    half = cos_cache.shape[-1]
    sign = _rotary_sign(head_size, 2 * half, interleaved)
    pos = positions.astype(mx.int32) if cos_cache.shape[0] < 2**31 else positions
    c = _spread_cols(cuda_kernels.take(cos_cache, pos, 0), head_size, interleaved).astype(mx.float32)
    s = _spread_cols(cuda_kernels.take(sin_cache, pos, 0), head_size, interleaved).astype(mx.float32)
    return c, s * sign


def _spread_cols(rows, head_size: int, interleaved: bool):
    """``rows`` (*P, half) -> (*P, head_size): each cache column twice, side by side (``[c, c]``) or interleaved
    (``c0 c0 c1 c1 ...``), then column 0 up to ``head_size`` (unused past the rotary dims); by copies, where a
    gather was one more JIT kernel for a new host to build (a shapeless trace keeps the gather: MLX cannot
    trace a slice or reshape shapeless)."""
    half = rows.shape[-1]
    if build.shapeless():
        i = np.arange(head_size)
        col = np.where(i < 2 * half, (i // 2) if interleaved else (i % half), 0).astype(np.int32)
        return mx.take(rows, mx.array(col), axis=-1)
    lead = rows.shape[:-1]
    if interleaved:
        rot = mx.broadcast_to(rows[..., None], lead + (half, 2)).reshape(lead + (2 * half,))
    else:
        rot = mx.concatenate([rows, rows], axis=-1)
    if head_size == 2 * half:
        return rot
    return mx.concatenate([rot, mx.broadcast_to(rows[..., :1], lead + (head_size - 2 * half,))], axis=-1)


@functools.lru_cache(maxsize=64)
def _rotary_sign(head_size: int, rotary_dim: int, interleaved: bool) -> mx.array:
    """The sign of each head-dim element's sin term: made once per layout."""
    i = np.arange(head_size)
    if interleaved:
        sign = np.where(i % 2 == 0, -1.0, 1.0)
    else:
        sign = np.where(i < rotary_dim // 2, -1.0, 1.0)
    return mx.array(sign, mx.float32)


def _rotary_perm(head_size: int, rotary_dim: int, interleaved: bool) -> np.ndarray:
    """The partner index of each feature in the rotation (identity beyond rotary_dim)."""
    i = np.arange(head_size)
    half = rotary_dim // 2
    if interleaved:
        p = i ^ 1
    else:
        p = np.where(i < half, i + half, i - half)
    return np.where(i < rotary_dim, p, i).astype(np.int32)


def apply_rotary(x, cos, sin, rotary_dim: int, interleaved: bool):
    """Rotate the first ``rotary_dim`` features of x (..., H); cos/sin broadcast to x.
    Half inputs compute in float32 and round once."""
    h = x.shape[-1]
    f32 = mx.float32
    partner = _partner(x, rotary_dim, interleaved)      # in x's own type: the casts below fuse
    rot = (x.astype(f32) * cos.astype(f32) + partner.astype(f32) * sin.astype(f32)).astype(x.dtype)
    if rotary_dim == h:
        return rot
    return mx.where(_rotary_keep(h, rotary_dim), x, rot)


def _partner(x, rotary_dim: int, interleaved: bool):
    """``x`` at ``_rotary_perm``'s features (each feature's partner in the rotation; itself past ``rotary_dim``),
    by slices and copies, where a gather was one more JIT kernel for a new host to build."""
    h, half = x.shape[-1], rotary_dim // 2
    if build.shapeless():                   # (MLX cannot trace a slice or reshape shapeless)
        return mx.take(x, mx.array(_rotary_perm(h, rotary_dim, interleaved)), axis=-1)
    if interleaved:
        pairs = x[..., :rotary_dim].reshape(x.shape[:-1] + (half, 2))
        rot = mx.concatenate([pairs[..., 1:], pairs[..., :1]], axis=-1).reshape(x.shape[:-1] + (rotary_dim,))
    else:
        rot = mx.concatenate([x[..., half:rotary_dim], x[..., :half]], axis=-1)
    return rot if rotary_dim == h else mx.concatenate([rot, x[..., rotary_dim:]], axis=-1)


@functools.lru_cache(maxsize=64)
def _rotary_keep(h: int, rotary_dim: int) -> mx.array:
    """The features kept as they are (past ``rotary_dim``): made once per layout."""
    return mx.array(np.arange(h) >= rotary_dim)


# ---------------------------------------------------------------------------- GQA
def _bnsh(x, n: int):
    b, s, hidden = x.shape
    return x.reshape(b, s, n, hidden // n).transpose(0, 2, 1, 3)


def _present(past, new, past_len, total: int, in_place: bool = False, first: bool = False, valid=None):
    """KV cache after appending ``new`` (B,Nkv,S,H) at row ``past_len[b]`` of each batch row.

    Rows below past_len come from ``past`` (None: none), rows past_len..past_len+S-1 from
    ``new``, the rest are zero; ``total`` rows (ORT: max(total_sequence_length, past length)).
    ``in_place`` (S == 1, a past of ``total`` rows): every other row is the past's, as ORT's
    kernel leaves a shared buffer (rows past the new one are never read). ``first`` (a first
    prompt: past_len 0): ``new`` padded with zero rows, so no fused kernel holds S as a constant
    (MLX builds one per constant: a bucketed prefill would build two at every new bucket). ``valid`` ((B,) int32,
    first prompts): rows at or past it are zero too (a padded prompt's). The zeros are a device constant: MLX's
    own fill value would be a pooled scalar every thread reads (``consts.roomy``).
    """
    b, n, s, h = new.shape
    if first and not in_place:
        zero = consts.zeros((), new.dtype)
        if valid is not None:
            new = mx.where(consts.arange(s).reshape(1, 1, s, 1) < valid.reshape(b, 1, 1, 1), new, zero)
        return mx.pad(new, [(0, 0), (0, 0), (0, total - s), (0, 0)], constant_values=zero) if total > s else new
    pl = past_len.reshape(b, 1, 1, 1)
    if in_place:
        if s != 1 or past is None or past.shape[2] != total:
            raise ValueError(f"in-place present needs S == 1 and a past of {total} rows")
        # one row scattered into a copy of the buffer (a select over every row cost 3x on MLX's CPU backend); the
        # row clipped into the buffer, so a traced call its guard rejects writes nothing outside it
        row = mx.broadcast_to(mx.clip(pl, 0, total - 1).astype(mx.int32), (b, n, 1, h))
        return mx.put_along_axis(past, row, new.astype(past.dtype), axis=2)
    t = consts.arange(total).reshape(1, 1, total, 1)
    zeros = consts.zeros((1,), new.dtype)
    if s == 1:                                 # decode: the one new row sits at past_len (no gather)
        out = mx.where(t == pl, new, zeros)
    else:
        idx = t - pl
        in_new = (idx >= 0) & (idx < s)
        gathered = mx.take_along_axis(new, mx.broadcast_to(mx.clip(idx, 0, s - 1), (b, n, total, 1)), axis=2)
        out = mx.where(in_new, gathered, zeros)
    if past is not None:
        p = past.shape[2]                      # callers give total >= p
        if p < total:
            past = mx.concatenate([past, mx.zeros((b, n, total - p, h), past.dtype)], axis=2)
        out = mx.where(t < pl, past, out)
    return out


def gqa_mask(past_len, total_len, seq_len: int, kv_len: int, local_window_size: int = -1):
    """Boolean (B,1,S,T) mask: query s of row b sits at past_len[b]+s and sees keys
    t <= its position, t < total_len[b], and (local window w > 0) t > position - w: w keys,
    itself included (what ORT 1.31's CPU kernel does)."""
    b = past_len.shape[0]
    q_pos = past_len.reshape(b, 1, 1, 1) + consts.arange(seq_len).reshape(1, 1, seq_len, 1)
    t = consts.arange(kv_len).reshape(1, 1, 1, kv_len)
    m = (t <= q_pos) & (t < total_len.reshape(b, 1, 1, 1))
    if local_window_size > 0:
        m = m & (t > q_pos - local_window_size)
    return m


def attention_probs_softmax(scores, mask, sink=None):
    """Softmax over the last axis in float32 of masked scores; ``sink`` (N,) adds one
    extra logit per head to the denominator (smooth softmax: sink 0)."""
    neg = mx.array(-np.inf, mx.float32)
    scores = mx.where(mask, scores, neg)
    if sink is None:
        return mx.softmax(scores, axis=-1)      # one kernel; every row has a visible key
    sk = sink.astype(mx.float32).reshape(1, -1, 1, 1)
    m = mx.maximum(mx.max(scores, axis=-1, keepdims=True), sk)
    e = mx.exp(scores - m)
    return e / (mx.sum(e, axis=-1, keepdims=True) + mx.exp(sk - m))


def softmax_sink(head_sink, smooth_softmax: int, num_heads: int):
    """The extra per-head softmax logit: ``head_sink`` (N,), zeros for smooth softmax, else None."""
    if head_sink is not None:
        if head_sink.shape != (num_heads,):
            raise ValueError(f"head_sink shape {head_sink.shape}, expected ({num_heads},)")
        return head_sink
    return consts.zeros((num_heads,), mx.float32) if smooth_softmax == 1 else None


_HALVES = (mx.float16, mx.bfloat16)


def fused_prompt_reason(q, k, softcap: float, attention_bias) -> str | None:
    """Why a prompt's attention does not run as MLX's fused kernel (None: it does): half precision, a head size
    that is a multiple of 8 up to 128 (cuDNN's), no softcap or bias (the kernel has neither)."""
    h = q.shape[-1]
    if q.dtype not in _HALVES or k.dtype != q.dtype:
        return "not half precision"
    if h % 8 or h > 128:
        return f"head size {h}"
    if softcap > 0.0 or attention_bias is not None:
        return "softcap or attention bias"
    return None


def prompt_attention(q, k, v, qf, seqlens_k, past_len, total_len, *, alpha: float, softcap: float,
                     local_window_size: int, sink, attention_bias, causal: bool = False):
    """A first prompt's attention over its own keys: q (B,N,S,H), k, v (B,Nkv,S,H) after rotation; ``qf``: q in
    float32. Row b's query s sees keys t <= s, t < total_len[b] (and the local window) as ORT's CPU kernel.

    softmax(q k^T * alpha) v: MLX's fused kernel (``mx.fast.scaled_dot_product_attention``: cuDNN's on CUDA, the
    softmax in float32) where the build allows it for S tokens (``build.fused_attention``: a GPU, from
    ``FUSED_ATTENTION_MIN``) and ``fused_prompt_reason`` has none, else scores, softmax and P @ V in float32: on
    MLX's CUDA backend one custom kernel (``cuda_kernels.prompt_attention``, ``build.prompt_kernel``), else MLX ops.
    ``causal``: the caller keeps no query row s >= total_len[b] (there are none, or it drops them), so with no
    local window narrower than S (and no sink) the mask is plain causal, which the fused kernel takes as a flag."""
    b, n, s, h = q.shape
    kvn = k.shape[1]

    def mask():
        return build.memo(("gqa_mask", id(seqlens_k), True, b, s, s, local_window_size),
                          lambda: gqa_mask(past_len, total_len, s, s, local_window_size))
    if build.fused_attention(s) and fused_prompt_reason(q, k, softcap, attention_bias) is None:
        sinks = None if sink is None else sink.astype(q.dtype)
        # (with sinks the mask stays an array: the form run on GPUs before the flag; not tried with both there)
        plain = causal and sinks is None and not 0 < local_window_size < s
        p = 1 << max(s - 1, 0).bit_length()
        if plain and not build.tracing() and p > s:
            # an eager prompt runs at its bucket's power-of-two length: MLX builds a cuDNN graph for every new
            # shape (tens to hundreds of ms); causally no kept row sees a padded key, and padded rows drop below
            widths = [(0, 0), (0, 0), (0, p - s), (0, 0)]
            q, k, v = (mx.pad(x, widths) for x in (q, k, v))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=alpha, mask="causal" if plain else mask(),
                                                   sinks=sinks)
        if out.shape[2] > s:
            out = out[:, :, :s]
        return out.transpose(0, 2, 1, 3).reshape(b, s, n * h)
    if cuda_kernels.enabled() and build.prompt_kernel() and \
            cuda_kernels.prompt_attention_reason(q, k, v, n, kvn, attention_bias) is None:
        # the float32 ops' arithmetic in one launch (they are eight kernels, two of them cuBLAS products)
        return cuda_kernels.prompt_attention(q, k, v, total_len, alpha=alpha, softcap=softcap,
                                             local_window_size=local_window_size, sink=sink, drop_past=causal)
    group = n // kvn
    scores = (qf.reshape(b, kvn, group * s, h) @ k.astype(mx.float32).swapaxes(-1, -2)).reshape(b, n, s, s) * alpha
    if softcap > 0.0:
        scores = softcap * mx.tanh(scores / softcap)
    if attention_bias is not None:          # (B|1, N|1, S, total_sequence_length == S)
        scores = scores + attention_bias.astype(mx.float32)[..., :s]
    probs = attention_probs_softmax(scores, mask(), sink)
    out = probs.reshape(b, kvn, group * s, s) @ v.astype(mx.float32)
    return out.reshape(b, n, s, h).transpose(0, 2, 1, 3).reshape(b, s, n * h).astype(q.dtype)


def split_qkv(qkv, num_heads: int, kv_num_heads: int, qkv_bias=None):
    """A packed (B,S,(N+2Nkv)*H) query as q, k, v (slices); ``qkv_bias`` (an Add folded into the node) is
    added first, in the query's type."""
    b, s, hidden = qkv.shape
    heads = num_heads + 2 * kv_num_heads
    h = hidden // heads
    if h * heads != hidden:
        raise ValueError(f"packed QKV hidden {hidden} not divisible into {num_heads}+2*{kv_num_heads} heads")
    if qkv_bias is not None:
        if qkv_bias.shape != (hidden,):
            raise ValueError(f"qkv_bias {qkv_bias.shape} needs a packed QKV of {hidden} features")
        qkv = qkv + qkv_bias
    x = qkv.reshape(b, s, heads, h)
    return (x[:, :, :num_heads].reshape(b, s, num_heads * h),
            x[:, :, num_heads:num_heads + kv_num_heads].reshape(b, s, kv_num_heads * h),
            x[:, :, num_heads + kv_num_heads:].reshape(b, s, kv_num_heads * h))


def head_rms_norm(x, weight, epsilon: float, n: int):
    """The per-head RMS norm GroupQueryAttention applies to Q and K with ``q/k_norm_weight`` (before any
    rotary): x (B,S,n*H) normed over each head's H features in float32, times ``weight`` (H,), rounded
    to x's type. That is the Reshape -> SimplifiedLayerNormalization -> Reshape the builder fuses into
    the inputs (ORT's CPU EP refuses the inputs, so tests compare with that decomposed graph)."""
    b, s, hidden = x.shape
    h = hidden // n
    if h * n != hidden or weight.shape != (h,):
        raise ValueError(f"norm weight {weight.shape} does not fit {n} heads of a {hidden}-wide input")
    y = mx.fast.rms_norm(x.reshape(b, s, n, h).astype(mx.float32), weight.astype(mx.float32), epsilon)
    return y.astype(x.dtype).reshape(b, s, hidden)


def window_resident(t, capacity: int, window: int):
    """Rows of a windowed KV cache (``sliding_window_cache=1``) resident after ``t`` tokens (int array):
    L(T) = T while T <= C, else T - G * ceil((T - C) / G) with G = C - W + 1 (ORT's contract)."""
    g = capacity - window + 1
    return mx.where(t <= capacity, t, t - g * ((t - capacity + g - 1) // g))


def gqa_window_core(q, k, v, past_key, past_value, seqlens_k, *, num_heads: int, kv_num_heads: int, window: int,
                    scale: float = 0.0, softcap: float = 0.0, cos_cache=None, sin_cache=None,
                    rotary_interleaved: bool = False, sink=None):
    """GroupQueryAttention over a windowed KV cache (``sliding_window_cache=1``), as ORT's CPU kernel
    computes it; pure MLX ops of the shapes only (traceable, shapeless too).

    past_key/value (B,Nkv,C,H) hold, for row b, the L(T - S) most recent positions at rows [0, L(T - S)),
    T = seqlens_k[b] + 1 (every row has T >= S: no first-prompt special case). The new S rows sit at
    positions T - S .. T - 1; a query at position p sees keys p - W < t <= p. present rows [0, L(T)) hold
    the L(T) most recent positions; rows [L(T), C) (unspecified by the op) keep the past's. Scores are
    computed over the C past rows plus the S new rows, unresident ones masked.
    Returns (out (B,S,N*H), present_key, present_value)."""
    b, s = q.shape[:2]
    h = q.shape[2] // num_heads
    cap = past_key.shape[2]
    t_all = seqlens_k.reshape(-1).astype(mx.int32) + 1                       # (B,)
    tp = t_all - s
    lp = window_resident(tp, cap, window)
    q, k, v = _bnsh(q, num_heads), _bnsh(k, kv_num_heads), _bnsh(v, kv_num_heads)
    qpos = tp.reshape(b, 1) + consts.arange(s).reshape(1, s)                 # (B,S) absolute positions
    if cos_cache is not None:
        c, sn = rotary_tables(cos_cache, sin_cache, qpos, h, rotary_interleaved)
        c, sn = c.reshape(b, 1, s, h), sn.reshape(b, 1, s, h)
        rd = 2 * cos_cache.shape[-1]
        q = apply_rotary(q, c, sn, rd, rotary_interleaved)
        k = apply_rotary(k, c, sn, rd, rotary_interleaved)
    keys = mx.concatenate([past_key, k.astype(past_key.dtype)], axis=2)       # (B,Nkv,C+S,H)
    vals = mx.concatenate([past_value, v.astype(past_value.dtype)], axis=2)
    r = consts.arange(cap + s).reshape(1, cap + s)
    lp2, tp2 = lp.reshape(b, 1), tp.reshape(b, 1)
    kpos = mx.where(r < cap, tp2 - lp2 + r, tp2 + r - cap)                   # (B,C+S)
    kvalid = (r >= cap) | (r < lp2)
    kp, qp = kpos.reshape(b, 1, 1, cap + s), qpos.reshape(b, 1, s, 1)
    mask = kvalid.reshape(b, 1, 1, cap + s) & (kp <= qp) & (kp > qp - window)
    alpha = scale if scale != 0.0 else 1.0 / math.sqrt(h)
    group = num_heads // kv_num_heads
    qf = q.astype(mx.float32).reshape(b, kv_num_heads, group * s, h)
    scores = (qf @ keys.astype(mx.float32).swapaxes(-1, -2)).reshape(b, num_heads, s, cap + s) * alpha
    if softcap > 0.0:
        scores = softcap * mx.tanh(scores / softcap)
    probs = attention_probs_softmax(scores, mask, sink)
    out = probs.reshape(b, kv_num_heads, group * s, cap + s) @ vals.astype(mx.float32)
    out = out.reshape(b, num_heads, s, h).transpose(0, 2, 1, 3).reshape(b, s, num_heads * h)
    lt = window_resident(t_all, cap, window).reshape(b, 1)
    i = consts.arange(cap).reshape(1, cap)
    j = lp2 + s - lt + i                                                      # index into past[:lp] ++ new
    src = mx.where(i < lt, mx.where(j < lp2, j, cap + j - lp2), i)
    src = mx.broadcast_to(src.reshape(b, 1, cap, 1), (b, kv_num_heads, cap, h))
    pk = mx.take_along_axis(keys, src, axis=2)
    pv = mx.take_along_axis(vals, src, axis=2)
    return out.astype(q.dtype), pk, pv


class KVQuant:
    """A quantized KV cache as ORT's CPU kernel keeps it (``kv_cache_bit_width`` 8: int8 values; 4: uint8
    bytes of two values, low nibble first, each value + 8): q = clamp(rint(x * (1 / scale)), range), round
    half to even, and x = q * scale. Scales (float32) broadcast over (B, Nkv, T, H): per tensor (1,) or per
    channel (1, Nkv, 1, H)."""

    def __init__(self, bits: int, k_scale, v_scale):
        if bits not in (4, 8):
            raise ValueError(f"kv_cache_bit_width={bits!r} (4 or 8)")
        self.bits = bits
        self.k_scale, self.v_scale = k_scale.astype(mx.float32), v_scale.astype(mx.float32)

    @staticmethod
    def _scale(s):
        return s.reshape(()) if s.size == 1 else s.reshape(1, s.shape[-3], 1, s.shape[-1])

    def _quantize(self, x, s):
        s = self._scale(s)
        lo, hi = (-128, 127) if self.bits == 8 else (-8, 7)
        q = mx.clip(mx.round(x.astype(mx.float32) * (1.0 / s)), lo, hi)
        if self.bits == 8:
            return q.astype(mx.int8)
        u = (q + 8).astype(mx.uint8)
        return u[..., 0::2] | (u[..., 1::2] << mx.array(4, mx.uint8))

    def _dequantize(self, q, s):
        s = self._scale(s)
        if self.bits == 8:
            return q.astype(mx.float32) * s
        lo, hi = q & mx.array(15, mx.uint8), q >> mx.array(4, mx.uint8)
        vals = mx.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], 2 * q.shape[-1]).astype(mx.float32) - 8.0
        return vals * s

    def quantize_k(self, x):
        return self._quantize(x, self.k_scale)

    def quantize_v(self, x):
        return self._quantize(x, self.v_scale)

    def dequantize_k(self, q):
        return self._dequantize(q, self.k_scale)

    def dequantize_v(self, q):
        return self._dequantize(q, self.v_scale)


def gqa_core(q, k, v, past_key, past_value, seqlens_k, *, total_sequence_length: int, num_heads: int,
             kv_num_heads: int, first_prompt: bool, scale: float = 0.0, softcap: float = 0.0,
             local_window_size: int = -1, cos_cache=None, sin_cache=None, position_ids=None,
             rotary_interleaved: bool = False, attention_bias=None, sink=None, in_place: bool = False,
             packed: bool = False, qkv_bias=None, kv_quant=None, causal_prompt: bool = False, prompt_valid=None,
             new_rows: bool = False):
    """GroupQueryAttention on MLX arrays, as ORT's CPU kernel computes it.

    q (B,S,N*H); k, v (B,S,Nkv*H); or ``packed``: q is the packed QKV ((B,S,(N+2*Nkv)*H) or its
    (B,S,N+2*Nkv,H) view) and k, v are None (the query and key heads are rotated together: one gather
    and one fused kernel, the same arithmetic per element). past_key/value (B,Nkv,P,H) or None; seqlens_k (B,) int32
    = total length - 1 per row. ``first_prompt`` (S == total_sequence_length): no past is
    read and query s sits at position s. Otherwise row b's past length is seqlens_k[b]+1-S.
    ``sink``: (N,) extra softmax logit (smooth softmax: zeros). Returns (out, present_k, present_v);
    ``in_place`` (decode into a shared buffer, see ``_present``) adds the new K and V rows
    (B,Nkv,S,H): the only rows where the presents differ from the pasts. ``qkv_bias`` ((N+2*Nkv)*H,),
    packed only: added to the packed QKV first (in its type, as the Add node it replaces).
    ``kv_quant`` (a quantized KV cache, ``KVQuant``): past_key/value hold the quantized cache; the new rows
    are quantized into the presents and attention reads the dequantized presents (as ORT's CPU kernel).
    ``causal_prompt``: a first prompt's rows past its total length are absent or dropped (``prompt_attention``'s
    ``causal``). ``prompt_valid`` ((B,) int32, a first prompt padded past its length): present rows at or past it
    are zero, as for the unpadded prompt. ``new_rows`` (first prompts): the presents' first S rows come back too,
    as ``in_place``'s new rows do (as arrays of their own where the prompt's kernel makes them).
    """
    if new_rows and not first_prompt:
        raise ValueError("new_rows is for first prompts")
    nq = num_heads + kv_num_heads
    flat = q
    if packed and q.ndim == 3:
        # (B,S,N+2Nkv,H) for the MLX path; the one-kernel decode row reads the flat rows (no reshape node)
        heads = num_heads + 2 * kv_num_heads
        q = q.reshape(q.shape[0], q.shape[1], heads, q.shape[2] // heads)
    if qkv_bias is not None:
        if not packed or qkv_bias.shape != (q.shape[2] * q.shape[3],):
            raise ValueError(f"qkv_bias {qkv_bias.shape} needs a packed QKV of {q.shape[2:]} heads x size")
    b, s = q.shape[:2]
    h = q.shape[3] if packed else q.shape[2] // num_heads
    seqlens = seqlens_k.astype(mx.int32)

    def first_rows(out, pk, pv):            # ``new_rows``: the presents' first S rows too (views)
        return (out, pk, pv, pk[:, :, :s], pv[:, :, :s]) if new_rows else (out, pk, pv)

    def lengths():          # read by every layer's kernels: made once a build, out of MLX's pool of small arrays
        # a padded first prompt's valid length is this very length (seqlens_k + 1), made once already
        total = prompt_valid if prompt_valid is not None else consts.unpooled(lambda x: x + 1, seqlens)
        past = consts.zeros((b,), mx.int32) if first_prompt else consts.unpooled(lambda x: x + (1 - s), seqlens)
        return total, past
    total_len, past_len = build.memo(("gqa_lengths", id(seqlens_k), first_prompt, b, s), lengths)
    alpha = scale if scale != 0.0 else 1.0 / math.sqrt(h)

    def tables():
        if position_ids is not None and first_prompt:      # ORT reads only the first id, then +s
            pos = position_ids.reshape(-1)[:1].reshape(1, 1) + consts.arange(s, position_ids.dtype).reshape(1, s)
            pos = mx.broadcast_to(pos, (b, s))
        elif position_ids is not None:
            pos = position_ids
        else:
            pos = past_len.reshape(b, 1) + consts.arange(s).reshape(1, s)
        c, sn = rotary_tables(cos_cache, sin_cache, pos, h, rotary_interleaved)
        return c.reshape(b, 1, s, h), sn.reshape(b, 1, s, h)
    # every layer reads the same rows: made once per build
    table_key = ("gqa_rotary", id(cos_cache), id(sin_cache), id(seqlens_k), id(position_ids), first_prompt, b, s, h,
                 rotary_interleaved)
    rd = 2 * cos_cache.shape[-1] if cos_cache is not None else 0
    if s == 1 and in_place and kv_quant is None and cuda_kernels.enabled() and past_key is not None and \
            past_key.shape[2] == max(total_sequence_length, past_key.shape[2]) and \
            cuda_kernels.decode_rope_attention_reason(flat, k, v, past_key, past_value, num_heads, kv_num_heads, rd,
                                                      attention_bias) is None:
        # rotation, the presents and the attention of the decode row in one kernel
        c = sn = None
        if build.row_products() and cuda_kernels.decode_setup_reason(seqlens, position_ids, cos_cache, sin_cache,
                                                                     b, h) is None:
            # its lengths and rotary rows by a kernel of ours too: a step of our kernels only (cuda_replay)
            past_len, total_len, c, sn = build.memo(
                ("gqa_setup",) + table_key[1:],
                lambda: cuda_kernels.decode_setup(seqlens, position_ids, cos_cache, sin_cache, h, rotary_interleaved))
        elif cos_cache is not None:
            c, sn = build.memo(table_key, tables)
            c, sn = c.reshape(b, h), sn.reshape(b, h)
        out, pk, pv, k_new, v_new = cuda_kernels.decode_rope_attention(
            flat, k, v, c, sn, past_key, past_value, past_len, total_len, num_heads=num_heads,
            kv_num_heads=kv_num_heads, rot_dim=rd, interleaved=rotary_interleaved, alpha=alpha, softcap=softcap,
            local_window_size=local_window_size, sink=sink, qkv_bias=qkv_bias)
        return out, pk, pv, k_new, v_new
    present_len = max(total_sequence_length, past_key.shape[2] if past_key is not None else 0)
    if first_prompt and s > 1 and packed and kv_quant is None and not in_place and cuda_kernels.enabled() and \
            build.prompt_rope() and \
            cuda_kernels.prompt_rope_reason(flat, num_heads, kv_num_heads, rd, present_len) is None:
        # the rotation, the queries' transpose and both presents in one kernel; attention reads the new rows
        c = sn = None
        if cos_cache is not None:
            c, sn = build.memo(table_key, tables)
            c, sn = c.reshape(b, s, h), sn.reshape(b, s, h)
        q, pk, pv, k_rows, v_rows = cuda_kernels.prompt_rope(
            flat, c, sn, prompt_valid, present_len, num_heads=num_heads, kv_num_heads=kv_num_heads, rot_dim=rd,
            interleaved=rotary_interleaved, qkv_bias=qkv_bias)
        out = prompt_attention(q, k_rows, v_rows, q.astype(mx.float32), seqlens_k, past_len, total_len,
                               alpha=alpha, softcap=softcap, local_window_size=local_window_size, sink=sink,
                               attention_bias=attention_bias, causal=causal_prompt)
        return (out, pk, pv, k_rows, v_rows) if new_rows else (out, pk, pv)
    if qkv_bias is not None:
        q = q + qkv_bias.reshape(q.shape[2:])
    if packed:
        x = q.transpose(0, 2, 1, 3)                     # (B, N+2Nkv, S, H): views for S == 1
        qk, v = x[:, :nq], x[:, nq:]
    else:
        q, k, v = _bnsh(q, num_heads), _bnsh(k, kv_num_heads), _bnsh(v, kv_num_heads)
    if cos_cache is not None:
        c, sn = build.memo(table_key, tables)
        if packed:
            qk = apply_rotary(qk, c, sn, rd, rotary_interleaved)
        else:
            q = apply_rotary(q, c, sn, rd, rotary_interleaved)
            k = apply_rotary(k, c, sn, rd, rotary_interleaved)
    if packed:
        # the float32 copy is taken before the split, so it stays in the rotation's fused kernel
        qf = qk.astype(mx.float32)[:, :num_heads]
        q, k = qk[:, :num_heads], qk[:, num_heads:]
    else:
        qf = q.astype(mx.float32)
    if kv_quant is not None:          # the cache holds quantized rows; attention reads them dequantized
        k, v = kv_quant.quantize_k(k), kv_quant.quantize_v(v)
    pk = _present(past_key, k, past_len, present_len, in_place, first_prompt, prompt_valid)
    pv = _present(past_value, v, past_len, present_len, in_place, first_prompt, prompt_valid)
    pkf, pvf = (pk, pv) if kv_quant is None else (kv_quant.dequantize_k(pk), kv_quant.dequantize_v(pv))
    if s == 1 and kv_quant is None and cuda_kernels.enabled():
        qsrc = qk if packed else q
        if cuda_kernels.decode_attention_reason(qsrc, pk, pv, num_heads, kv_num_heads, attention_bias) is None:
            out = cuda_kernels.decode_attention(qsrc, pk, pv, past_len, total_len, num_heads=num_heads,
                                                kv_num_heads=kv_num_heads, alpha=alpha, softcap=softcap,
                                                local_window_size=local_window_size, sink=sink)
            out = out.reshape(b, 1, num_heads * h)
            return (out, pk, pv, k, v) if in_place else first_rows(out, pk, pv)
    if first_prompt and s > 1 and kv_quant is None:
        # a first prompt sees only its own S keys: no scores over the rest of the KV buffer
        out = prompt_attention(q, k, v, qf, seqlens_k, past_len, total_len, alpha=alpha, softcap=softcap,
                               local_window_size=local_window_size, sink=sink, attention_bias=attention_bias,
                               causal=causal_prompt)
        return (out, pk, pv, k, v) if in_place else first_rows(out, pk, pv)
    mask = build.memo(("gqa_mask", id(seqlens_k), first_prompt, b, s, present_len, local_window_size),
                       lambda: gqa_mask(past_len, total_len, s, present_len, local_window_size))
    group = num_heads // kv_num_heads
    qf = qf.reshape(b, kv_num_heads, group * s, h)
    scores = (qf @ pkf.astype(mx.float32).swapaxes(-1, -2)).reshape(b, num_heads, s, present_len) * alpha
    if softcap > 0.0:
        scores = softcap * mx.tanh(scores / softcap)
    if attention_bias is not None:          # (B|1, N|1, S, total_sequence_length)
        bias = attention_bias.astype(mx.float32)
        extra = present_len - bias.shape[-1]
        if extra > 0:                         # columns past total_sequence_length are masked anyway
            bias = mx.concatenate([bias, mx.zeros(bias.shape[:-1] + (extra,), mx.float32)], axis=-1)
        scores = scores + bias
    probs = attention_probs_softmax(scores, mask, sink)
    out = probs.reshape(b, kv_num_heads, group * s, present_len) @ pvf.astype(mx.float32)
    out = out.reshape(b, num_heads, s, h).transpose(0, 2, 1, 3).reshape(b, s, num_heads * h)
    if in_place:
        return out.astype(q.dtype), pk, pv, k, v
    return first_rows(out.astype(q.dtype), pk, pv)


def _qt(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _kv_quant_check(v) -> str | None:
    """A quantized KV cache is claimed where ORT's CPU EP runs it: float32 queries, int8 (8 bits) or uint8
    (4 bits, two a byte) caches, per-tensor or per-channel constant positive float32 scales for both K and V."""
    a = v.attrs
    t = v.dtype(0)
    bits = a.get("kv_cache_bit_width", 0)
    kq, vq = _qt(a.get("k_quant_type", "NONE")), _qt(a.get("v_quant_type", "NONE"))
    quant = bits != 0 or kq != "NONE" or vq != "NONE" or v.has(12) or v.has(13)
    if not quant:
        for i in (3, 4):
            if v.has(i) and v.dtype(i) != t:
                return f"KV cache dtype {dt.name(v.dtype(i))} differs from the query's without quantization attributes"
        return None
    if kq not in ("PER_TENSOR", "PER_CHANNEL") or vq not in ("PER_TENSOR", "PER_CHANNEL"):
        return f"quantized KV cache with k_quant_type={kq!r}, v_quant_type={vq!r} (both PER_TENSOR/PER_CHANNEL only)"
    if kq != vq:
        return f"k_quant_type={kq!r} differs from v_quant_type={vq!r} (ORT's CPU kernel rejects it)"
    want = {8: dt.INT8, 4: dt.UINT8}.get(bits)
    if want is None:
        return f"kv_cache_bit_width={bits} (8 and 4 only)"
    if t != dt.FLOAT:
        return f"quantized KV cache with {dt.name(t)} queries (float32 only: what ORT's CPU EP runs)"
    if not (v.has(3) and v.has(4)):
        return "quantized KV cache without past_key/past_value"
    for i in (3, 4):
        if v.dtype(i) != want:
            return f"{bits}-bit KV cache of dtype {dt.name(v.dtype(i))} (expected {dt.name(want)})"
    if a.get("sliding_window_cache", 0):
        return "quantized KV cache with sliding_window_cache=1 not supported"
    for i, what, qt in ((12, "k_scale", kq), (13, "v_scale", vq)):
        if not v.has(i) or v.dtype(i) != dt.FLOAT:
            return f"quantized KV cache needs a float32 {what}"
        c = v.const(i)
        if c is None:
            return f"{what} is not a constant initializer"
        if not np.all(np.isfinite(c)) or not np.all(c > np.finfo(np.float32).tiny):
            return f"{what} has non-positive or non-finite values"
        if (qt == "PER_TENSOR" and c.size != 1) or (qt == "PER_CHANNEL" and c.ndim != 4):
            return f"{what} shape {c.shape} for {qt}"
    return None


def _gqa_check(v) -> str | None:
    a = v.attrs
    t = v.dtype(0)
    if t not in _FLOATS:
        return f"dtype {dt.name(t)} (float, float16, bfloat16 only)"
    r = _kv_quant_check(v)
    if r:
        return r
    if v.has(14) != v.has(15):
        return "q_norm_weight and k_norm_weight must both be given"
    for i in (14, 15):
        if v.has(i) and v.dtype(i) != t:
            return f"input {i} (q/k norm weight) is {dt.name(v.dtype(i))}, query {dt.name(t)}"
        if v.has(i) and v.rank(i) not in (None, 1):
            return f"input {i} (q/k norm weight) rank {v.rank(i)} (1D only)"
    if len(v.node.outputs) > 3 and v.node.outputs[3]:
        return "output_qk not supported"
    if a.get("qk_output", 0) != 0:
        return f"qk_output={a['qk_output']} not supported"
    swc = a.get("sliding_window_cache", 0)
    if swc not in (0, 1):
        return f"sliding_window_cache={swc}"
    if swc == 1:
        if a.get("local_window_size", -1) <= 0:
            return "sliding_window_cache=1 needs local_window_size > 0 (ORT rejects it)"
        if not (v.has(3) and v.has(4)):
            return "sliding_window_cache=1 needs past_key and past_value (ORT rejects it)"
        for i, what in ((9, "position_ids"), (10, "attention_bias")):
            if v.has(i):
                return f"input {what} with sliding_window_cache=1 not supported"
    if a.get("causal", 1) != 1:
        return f"causal={a['causal']} not supported"
    nh, kvh = a["num_heads"], a["kv_num_heads"]
    if nh <= 0 or kvh <= 0 or nh % kvh:
        return f"num_heads={nh} not a positive multiple of kv_num_heads={kvh}"
    if v.has(1) != v.has(2):
        return "key and value must both be given or both omitted (packed QKV)"
    if v.has(3) != v.has(4):
        return "past_key and past_value must both be given"
    for i in (0, 1, 2):
        if v.has(i) and v.rank(i) not in (None, 3):
            return f"input {i} rank {v.rank(i)} (BSNH 3D only)"
    if v.has(1):
        sq, sk = v.shape(0), v.shape(1)
        if sq and sk and isinstance(sq[1], int) and isinstance(sk[1], int) and sq[1] != sk[1]:
            return "key sequence length differs from query's (shared/cross KV) not supported"
    if a.get("do_rotary", 0):
        if not (v.has(7) and v.has(8)):
            return "do_rotary=1 needs cos_cache and sin_cache"
    if a.get("smooth_softmax", -1) not in (-1, 0, 1):
        return f"smooth_softmax={a['smooth_softmax']}"
    lws = a.get("local_window_size", -1)
    if lws == 0 or lws < -1:
        return f"local_window_size={lws} not supported"
    return None


def validate_window(seqlens: np.ndarray, b: int, s: int, total: int, capacity: int, window: int,
                    cache_rows: int | None) -> None:
    """ORT's run-time checks of a windowed-KV-cache GroupQueryAttention (each raises there too)."""
    if seqlens.size != b:
        raise ValueError(f"seqlens_k has {seqlens.size} elements, expected ({b},)")
    if capacity < window:
        raise ValueError(f"sliding_window_cache: KV cache capacity ({capacity}) must be at least "
                         f"local_window_size ({window})")
    if s > 1 and b > 1 and s != total:
        raise ValueError(f"batch_size must be 1 when sequence_length > 1 and past context is given (B={b}, S={s})")
    for i, sl in enumerate(seqlens):
        if sl + 1 < s:
            raise ValueError(f"seqlens_k[{i}] = {sl} is too small for sequence_length {s}")
    if cache_rows is not None and int(seqlens.max()) >= cache_rows:
        raise ValueError(f"position {int(seqlens.max())} is beyond the rotary cache ({cache_rows} rows)")


def _int_scalar(x, what: str) -> int:
    a = np.asarray(x).reshape(-1)
    if a.size != 1:
        raise ValueError(f"{what} must have one element, got shape {np.asarray(x).shape}")
    return int(a[0])


def _host_ints(x) -> np.ndarray:
    """Host copy of a small integer input (evaluates it in eager mode)."""
    return np.array(x if isinstance(x, np.ndarray) else dt.to_numpy(x))


def _validate_gqa(seqlens: np.ndarray, b: int, s: int, total: int, past_len_cap: int, present_len: int,
                  first_prompt: bool, cache_rows: int | None, positions_max: int | None):
    if seqlens.shape != (b,) and seqlens.size != b:
        raise ValueError(f"seqlens_k has shape {seqlens.shape}, expected ({b},)")
    if s > total and s > 1:
        raise ValueError(f"total_sequence_length {total} is less than the query sequence length {s}")
    if not first_prompt and s > 1 and b > 1:
        raise ValueError(f"batch_size must be 1 when sequence_length > 1 and past context is given (B={b}, S={s})")
    for i, sl in enumerate(seqlens.reshape(-1)):
        if sl < 0 or sl >= present_len:
            raise ValueError(f"seqlens_k[{i}] = {sl} is out of range [0, {present_len})")
        if not first_prompt and sl + 1 < s:
            raise ValueError(f"seqlens_k[{i}] = {sl} is too small for sequence_length {s}")
        if not first_prompt and sl + 1 - s > past_len_cap:
            raise ValueError(f"seqlens_k[{i}] = {sl} needs {sl + 1 - s} past rows, past has {past_len_cap}")
    if cache_rows is not None and positions_max is not None and positions_max >= cache_rows:
        raise ValueError(f"position {positions_max} is beyond the rotary cache ({cache_rows} rows)")


@register("GroupQueryAttention", 1, domain=MS, const=(6,), check=_gqa_check)
def group_query_attention(query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
                          total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None,
                          attention_bias=None, head_sink=None, k_scale=None, v_scale=None,
                          q_norm_weight=None, k_norm_weight=None, qkv_bias=None, *, num_heads, kv_num_heads, scale=0.0,
                          softcap=0.0, do_rotary=0, rotary_interleaved=0, local_window_size=-1,
                          smooth_softmax=-1, causal=1, qk_output=0, kv_cache_bit_width=0,
                          k_quant_type="NONE", v_quant_type="NONE", sliding_window_cache=0,
                          qk_norm_epsilon=1e-6):
    """GroupQueryAttention (com.microsoft, ORT CPU semantics); outputs (output, present_key, present_value).

    ``qkv_bias`` (not an ONNX input): the bias of an Add that fed a packed ``query`` and was folded into
    this node (``merge.qkv_bias_folds``); it is added here, in query's type, as that Add did."""
    if query.ndim != 3:
        raise ValueError(f"query must be 3D (B,S,hidden), got shape {query.shape}")
    b, s, hidden = query.shape
    if key is None:
        h = hidden // (num_heads + 2 * kv_num_heads)
        if h * (num_heads + 2 * kv_num_heads) != hidden:
            raise ValueError(f"packed QKV hidden {hidden} not divisible into {num_heads}+2*{kv_num_heads} heads")
    else:
        h = hidden // num_heads
        if h * num_heads != hidden or key.shape != (b, s, kv_num_heads * h) or value.shape != key.shape:
            raise ValueError(f"query {query.shape}, key {key.shape}, value {value.shape} do not fit "
                             f"num_heads={num_heads}, kv_num_heads={kv_num_heads}")
    total = _int_scalar(total_sequence_length, "total_sequence_length")
    p = 0
    kvq = KVQuant(kv_cache_bit_width, k_scale, v_scale) if kv_cache_bit_width else None
    if past_key is not None:
        want = (b, kv_num_heads, past_key.shape[2], h if kvq is None or kvq.bits == 8 else h // 2)
        if past_key.shape != want or past_value.shape != want:
            raise ValueError(f"past_key {past_key.shape} / past_value {past_value.shape}, expected {want}")
        p = past_key.shape[2]
    if kvq is not None:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc.size != 1 and tuple(sc.shape) != (1, kv_num_heads, 1, h):
                raise ValueError(f"{name} shape {sc.shape}, expected (1,) or (1, {kv_num_heads}, 1, {h})")
    if q_norm_weight is not None:
        if key is None:
            query, key, value = split_qkv(query, num_heads, kv_num_heads, qkv_bias)
            qkv_bias = None
        query = head_rms_norm(query, q_norm_weight, qk_norm_epsilon, num_heads)
        key = head_rms_norm(key, k_norm_weight, qk_norm_epsilon, kv_num_heads)
    if do_rotary and (h % 16 or cos_cache.shape[-1] * 2 > h or cos_cache.shape[-1] % 8):
        raise ValueError(f"rotary needs head_size % 16 == 0 and cos_cache dim 1 <= head_size/2, a multiple of 8; "
                         f"got head_size {h}, cos_cache {cos_cache.shape}")
    if sliding_window_cache:
        seqlens = _host_ints(seqlens_k).reshape(-1)
        validate_window(seqlens, b, s, total, p, local_window_size, cos_cache.shape[0] if do_rotary else None)
        if key is None:
            query, key, value = split_qkv(query, num_heads, kv_num_heads, qkv_bias)
        return gqa_window_core(query, key, value, past_key, past_value, seqlens_k, num_heads=num_heads,
                               kv_num_heads=kv_num_heads, window=local_window_size, scale=scale, softcap=softcap,
                               cos_cache=cos_cache if do_rotary else None, sin_cache=sin_cache if do_rotary else None,
                               rotary_interleaved=bool(rotary_interleaved),
                               sink=softmax_sink(head_sink, smooth_softmax, num_heads))
    first_prompt = s == total
    present_len = max(total, p)
    seqlens = _host_ints(seqlens_k).reshape(-1)
    pos_max = None
    if do_rotary:
        pos_max = int(seqlens.max()) if not first_prompt else s - 1
        if position_ids is not None:
            pid = _host_ints(position_ids)
            if pid.shape != (b, s):
                raise ValueError(f"position_ids shape {pid.shape}, expected ({b}, {s})")
            pos_max = int(pid.reshape(-1)[0]) + s - 1 if first_prompt else int(pid.max())
            if (pid.reshape(-1)[0] if first_prompt else pid.min()) < 0:
                raise ValueError("position_ids must be non-negative")
    _validate_gqa(seqlens, b, s, total, p, present_len, first_prompt,
                  cos_cache.shape[0] if do_rotary else None, pos_max)
    if attention_bias is not None:
        ab = attention_bias.shape
        if len(ab) != 4 or ab[0] not in (1, b) or ab[1] not in (1, num_heads) or ab[2] != s or ab[3] != total:
            raise ValueError(f"attention_bias shape {ab}, expected (1|{b}, 1|{num_heads}, {s}, {total})")
    sink = softmax_sink(head_sink, smooth_softmax, num_heads)
    return gqa_core(query, key, value, past_key, past_value, seqlens_k, total_sequence_length=total,
                    num_heads=num_heads, kv_num_heads=kv_num_heads, first_prompt=first_prompt, scale=scale,
                    softcap=softcap, local_window_size=local_window_size,
                    cos_cache=cos_cache if do_rotary else None, sin_cache=sin_cache if do_rotary else None,
                    rotary_interleaved=bool(rotary_interleaved), position_ids=position_ids, attention_bias=attention_bias, sink=sink,
                    packed=key is None, qkv_bias=qkv_bias, kv_quant=kvq,
                    causal_prompt=first_prompt and bool((seqlens + 1 == s).all()))


# ---------------------------------------------------------------------------- RotaryEmbedding
def _rope_check(v) -> str | None:
    a = v.attrs
    if v.dtype(0) not in _FLOATS:
        return f"dtype {dt.name(v.dtype(0))} (float, float16, bfloat16 only)"
    if a.get("is_packed_batching", 0):
        return "is_packed_batching=1 not supported"
    if a.get("scale", 1.0) != 1.0:
        return f"scale={a['scale']} not supported"
    if v.rank(0) not in (3, 4):
        return f"input rank {v.rank(0)} (3D or 4D only)"
    if v.rank(2) not in (None, 2):
        return f"cos_cache rank {v.rank(2)} (2D only)"
    if a.get("rotary_embedding_dim", 0) > 0 and v.rank(0) == 3 and a.get("num_heads", 0) <= 0:
        return "rotary_embedding_dim without num_heads"
    return None


def _rope_positions(position_ids, b: int, s: int, max_pos: int):
    """(B,S) positions: a one-element position_ids is a start offset, else it is (B,S)."""
    pid = _host_ints(position_ids)
    if pid.size == 1:
        start = int(pid.reshape(-1)[0])
        if start < 0 or start + s > max_pos:
            raise ValueError(f"positions {start}..{start + s - 1} outside the rotary cache ({max_pos} rows)")
        pos = consts.arange(s).reshape(1, s) + start
        return mx.broadcast_to(pos, (b, s))
    if pid.shape != (b, s):
        raise ValueError(f"position_ids shape {pid.shape}, expected (1,) or ({b}, {s})")
    if pid.min() < 0 or pid.max() >= max_pos:
        raise ValueError(f"position_ids outside [0, {max_pos}) of the rotary cache")
    return position_ids


def rope_layout(input, cos_cache, sin_cache, num_heads: int, rotary_embedding_dim: int):
    """RotaryEmbedding's input as (B,N,S,H) plus (b, n, s, h, rotary dim); validates the cache against the rotary dim."""
    half = cos_cache.shape[-1]
    rd = rotary_embedding_dim if rotary_embedding_dim > 0 else 2 * half
    if rd != 2 * half or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos_cache {cos_cache.shape} / sin_cache {sin_cache.shape} do not fit rotary dim {rd}")
    if input.ndim == 4:
        b, n, s, h = input.shape
        x = input
    else:
        b, s, hidden = input.shape
        n = num_heads if num_heads > 0 else hidden // rd
        h = hidden // n
        if n * h != hidden:
            raise ValueError(f"hidden size {hidden} not divisible by num_heads {n}")
        x = input.reshape(b, s, n, h).transpose(0, 2, 1, 3)
    if rd > h:
        raise ValueError(f"rotary dim {rd} exceeds head size {h}")
    return x, b, n, s, h, rd


@register("RotaryEmbedding", 1, domain=MS, check=_rope_check)
def rotary_embedding(input, position_ids, cos_cache, sin_cache, *, interleaved=0, is_packed_batching=0,
                     num_heads=0, rotary_embedding_dim=0, scale=1.0):
    """Rotary position embedding of (B,S,N*H) or (B,N,S,H) input with cos/sin cache rows by position."""
    x, b, n, s, h, rd = rope_layout(input, cos_cache, sin_cache, num_heads, rotary_embedding_dim)
    pos = _rope_positions(position_ids, b, s, cos_cache.shape[0])
    c, sn = rotary_tables(cos_cache, sin_cache, pos, h, bool(interleaved))
    y = apply_rotary(x, c.reshape(b, 1, s, h), sn.reshape(b, 1, s, h),
                     rd, bool(interleaved))
    if input.ndim == 4:
        return y
    return y.transpose(0, 2, 1, 3).reshape(b, s, n * h)


# ---------------------------------------------------------------------------- MultiHeadAttention
def _mha_check(v) -> str | None:
    a = v.attrs
    if v.dtype(0) not in _FLOATS:
        return f"dtype {dt.name(v.dtype(0))} (float, float16, bfloat16 only)"
    if not (v.has(1) and v.has(2)):
        return "packed QKV/KV (key or value omitted) not supported"
    for i in (0, 1, 2):
        if v.rank(i) not in (None, 3):
            return f"input {i} rank {v.rank(i)} (3D BSD query/key/value only)"
    for i, what in ((4, "key_padding_mask"), (8, "past_sequence_length"), (9, "cache_indirection")):
        if v.has(i):
            return f"input {what} not supported"
    if v.has(6) != v.has(7):
        return "past_key and past_value must both be given"
    if len(v.node.outputs) > 3 and v.node.outputs[3]:
        return "qk output not supported"
    if a["num_heads"] <= 0:
        return f"num_heads={a['num_heads']}"
    if a.get("unidirectional", 0) not in (0, 1):
        return f"unidirectional={a['unidirectional']}"
    ab = v.shape(5)
    if ab is not None and len(ab) != 4:
        return f"attention_bias rank {len(ab)} (4D only)"
    return None


@register("MultiHeadAttention", 1, domain=MS, check=_mha_check)
def multi_head_attention(query, key=None, value=None, bias=None, key_padding_mask=None, attention_bias=None,
                         past_key=None, past_value=None, past_sequence_length=None, cache_indirection=None, *,
                         num_heads, scale=0.0, mask_filter_value=-10000.0, unidirectional=0, ctx):
    """softmax(Q K^T * scale + attention_bias [causal]) V with optional past (present = concat)."""
    b, s, d = query.shape
    _, l, dk = key.shape
    dv = value.shape[-1]
    if key.shape[0] != b or value.shape[:2] != key.shape[:2] or dk != d or d % num_heads or dv % num_heads:
        raise ValueError(f"query {query.shape}, key {key.shape}, value {value.shape} do not fit num_heads={num_heads}")
    if bias is not None:
        if bias.shape != (2 * d + dv,):
            raise ValueError(f"bias shape {bias.shape}, expected ({2 * d + dv},)")
        query, key, value = query + bias[:d], key + bias[d:2 * d], value + bias[2 * d:]
    h, hv = d // num_heads, dv // num_heads
    q, k, vv = _bnsh(query, num_heads), _bnsh(key, num_heads), _bnsh(value, num_heads)
    if past_key is not None:
        if past_key.shape[:2] != (b, num_heads) or past_key.shape[3] != h or \
                past_value.shape != past_key.shape[:3] + (hv,):
            raise ValueError(f"past_key {past_key.shape} / past_value {past_value.shape} do not fit")
        k = mx.concatenate([past_key, k], axis=2)
        vv = mx.concatenate([past_value, vv], axis=2)
    t = k.shape[2]
    alpha = scale if scale != 0.0 else 1.0 / math.sqrt(h)
    scores = (q.astype(mx.float32) @ k.astype(mx.float32).swapaxes(-1, -2)) * alpha
    if attention_bias is not None:
        ab = attention_bias.shape
        if len(ab) != 4 or ab[0] not in (1, b) or ab[1] not in (1, num_heads) or ab[2] != s or ab[3] != t:
            raise ValueError(f"attention_bias shape {ab}, expected (1|{b}, 1|{num_heads}, {s}, {t})")
        scores = scores + attention_bias.astype(mx.float32)
    if unidirectional:
        past = t - s
        qpos = consts.arange(s).reshape(s, 1) + past
        scores = mx.where(consts.arange(t).reshape(1, t) <= qpos, scores,
                          mx.array(mask_filter_value, mx.float32))
    probs = mx.softmax(scores, axis=-1)
    out = (probs @ vv.astype(mx.float32)).transpose(0, 2, 1, 3).reshape(b, s, num_heads * hv).astype(query.dtype)
    return (out, k, vv)[:max(ctx.n_outputs, 1)]


# ---------------------------------------------------------------------------- ONNX RotaryEmbedding-23
def _rope23_check(v) -> str | None:
    if v.dtype(0) not in _FLOATS:
        return f"dtype {dt.name(v.dtype(0))} (float, float16, bfloat16 only)"
    if v.rank(0) not in (3, 4):
        return f"input rank {v.rank(0)} (3D or 4D only)"
    want = 2 if v.has(3) else 3
    if v.rank(1) not in (None, want):
        return f"cos_cache rank {v.rank(1)} (expected {want}D {'with' if v.has(3) else 'without'} position_ids)"
    if v.rank(0) == 3 and v.attrs.get("num_heads", 0) <= 0:
        return "3D input needs num_heads"
    return None


@register("RotaryEmbedding", 23, check=_rope23_check)
def rotary_embedding_23(X, cos_cache, sin_cache, position_ids=None, *, interleaved=0, num_heads=0,
                        rotary_embedding_dim=0):
    """ONNX RotaryEmbedding: X (B,N,S,H) or (B,S,N*H); cos/sin (P, rd/2) gathered by position_ids,
    or (B, S, rd/2) already per position."""
    if X.ndim == 4:
        b, n, s, h = X.shape
        x = X
    else:
        b, s, hidden = X.shape
        n, h = num_heads, hidden // num_heads
        if n * h != hidden:
            raise ValueError(f"hidden size {hidden} not divisible by num_heads {n}")
        x = X.reshape(b, s, n, h).transpose(0, 2, 1, 3)
    half = cos_cache.shape[-1]
    rd = rotary_embedding_dim if rotary_embedding_dim > 0 else h
    if rd != 2 * half or rd > h or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos_cache {cos_cache.shape} / sin_cache {sin_cache.shape} do not fit rotary dim {rd}, "
                         f"head size {h}")
    if position_ids is not None:
        pos = _rope_positions(position_ids, b, s, cos_cache.shape[0]) if position_ids.size != 1 else None
        if pos is None:
            raise ValueError(f"position_ids shape {position_ids.shape}, expected ({b}, {s})")
        c, sn = rotary_tables(cos_cache, sin_cache, pos, h, bool(interleaved))
    else:
        if cos_cache.shape[:2] != (b, s):
            raise ValueError(f"cos_cache shape {cos_cache.shape}, expected ({b}, {s}, {half}) without position_ids")
        pos = mx.broadcast_to(consts.arange(s).reshape(1, s), (b, s))
        c, sn = rotary_tables(cos_cache.reshape(b * s, half), sin_cache.reshape(b * s, half),
                              pos + consts.arange(b).reshape(b, 1) * s, h, bool(interleaved))
    y = apply_rotary(x, c.reshape(b, 1, s, h), sn.reshape(b, 1, s, h),
                     rd, bool(interleaved))
    if X.ndim == 4:
        return y
    return y.transpose(0, 2, 1, 3).reshape(b, s, n * h)
