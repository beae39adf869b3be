"""Custom CUDA kernels (``mx.fast.cuda_kernel``) for the GPU decode step on MLX's CUDA backend.

A decode token of an LLM is a few hundred small kernels; on MLX's CUDA backend the host cost of
encoding and launching each one (a CUDA graph node, ~5-18 us) outweighs its arithmetic. These
kernels replace chains of MLX ops with one launch each, computing the same values:

- ``decode_attention``: one query row (S == 1) of GroupQueryAttention over a KV buffer: scores,
  mask, softmax and the weighted sum of values in float32, as ``gqa_core`` does with seven MLX
  kernels (casts of K and V, two float32 matmuls, scale and mask, softmax, the final cast).
- ``gather_bytes``: many small arrays' bytes into one uint8 array (a ``concatenate`` of N arrays
  is N copy kernels).

Used only where ``enabled()`` says so: a build of a Program that asked for them
(``consts.build_scope(cuda_kernels=True)``), running on the GPU of MLX's CUDA backend.
"""
from __future__ import annotations

import functools
import hashlib

import mlx.core as mx
import numpy as np

from . import consts

#: warps per block of ``decode_attention`` (each strides over the keys)
ATTN_WARPS = 4
#: largest head size ``decode_attention`` takes (registers per lane: HEAD / 32 floats)
ATTN_MAX_HEAD = 256
_ATTN_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


@functools.lru_cache(maxsize=1)
def cuda_backend() -> bool:
    """Whether MLX runs its GPU through CUDA here."""
    try:
        return bool(mx.cuda.is_available())
    except Exception:  # noqa: BLE001 - an MLX without the cuda module
        return False


def enabled() -> bool:
    """Whether the build in progress may use these kernels (asked for, and on a CUDA GPU)."""
    return consts.build_flag("cuda_kernels") and cuda_backend() and mx.default_device() == mx.gpu


def _f32_literal(x: float) -> str:
    """A CUDA float literal of exactly ``float32(x)`` (hexadecimal: no decimal rounding)."""
    v = float(np.float32(x))
    if not np.isfinite(v):
        raise ValueError(f"constant {x} is not finite in float32")
    return v.hex() + "f"


_ATTN_SOURCE = r"""
    // block: one (batch row b, query head n); warp w takes keys lo+w, lo+w+WARPS, ...; lane l the
    // features l, l+32, ... of a row. Scores and the softmax are float32; online softmax per warp,
    // merged across warps at the end.
    constexpr int PER = (HEAD + 31) / 32;
    const int blk = blockIdx.x;
    const int b = blk / NH;
    const int n = blk - b * NH;
    const int kvh = n / (NH / NKV);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int ql = past_len[b];
    const int tl = total_len[b];
    int hi = ql < tl - 1 ? ql : tl - 1;
    if (hi > KV - 1) hi = KV - 1;
    int lo = 0;
    if (WINDOW > 0 && ql - WINDOW + 1 > lo) lo = ql - WINDOW + 1;
    const T* qrow = q + ((size_t)b * QH + n) * HEAD;
    float qv[PER];
    float acc[PER];
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int d = lane + 32 * i;
        qv[i] = d < HEAD ? static_cast<float>(qrow[d]) : 0.0f;
        acc[i] = 0.0f;
    }
    const size_t base = ((size_t)b * NKV + kvh) * (size_t)KV * HEAD;
    float m = NEG_INF;
    float l = 0.0f;
    for (int t = lo + warp; t <= hi; t += WARPS) {
        const T* kr = k + base + (size_t)t * HEAD;
        float part = 0.0f;
        #pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int d = lane + 32 * i;
            if (d < HEAD) part += qv[i] * static_cast<float>(kr[d]);
        }
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
        float sc = part * ALPHA;
        if (SOFTCAP > 0.0f) sc = SOFTCAP * tanhf(sc / SOFTCAP_DIV);
        const float mn = fmaxf(m, sc);
        const float corr = expf(m - mn);
        const float p = expf(sc - mn);
        l = l * corr + p;
        const T* vr = v + base + (size_t)t * HEAD;
        #pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int d = lane + 32 * i;
            if (d < HEAD) acc[i] = acc[i] * corr + p * static_cast<float>(vr[d]);
        }
        m = mn;
    }
    __shared__ float sm_m[WARPS];
    __shared__ float sm_l[WARPS];
    __shared__ float sm_acc[WARPS][HEAD];
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int d = lane + 32 * i;
        if (d < HEAD) sm_acc[warp][d] = acc[i];
    }
    __syncthreads();
    float mx_all = NEG_INF;
    for (int w = 0; w < WARPS; ++w) mx_all = fmaxf(mx_all, sm_m[w]);
    float sk = 0.0f;
    if (HAS_SINK) {
        sk = static_cast<float>(sink[n]);
        mx_all = fmaxf(mx_all, sk);
    }
    float den = 0.0f;
    float scale_w[WARPS];
    for (int w = 0; w < WARPS; ++w) {
        scale_w[w] = sm_l[w] > 0.0f ? expf(sm_m[w] - mx_all) : 0.0f;
        den += sm_l[w] * scale_w[w];
    }
    if (HAS_SINK) den += expf(sk - mx_all);
    T* orow = out + ((size_t)b * NH + n) * HEAD;
    for (int d = threadIdx.x; d < HEAD; d += blockDim.x) {
        float num = 0.0f;
        for (int w = 0; w < WARPS; ++w) num += sm_acc[w][d] * scale_w[w];
        orow[d] = static_cast<T>(num / den);
    }
"""


def _attn_header(alpha: float, softcap: float) -> str:
    """The kernel's float constants (the scale, the softcap; SOFTCAP_DIV keeps the unused division finite)."""
    return ("#define NEG_INF __int_as_float(0xff800000)\n"
            f"constexpr float ALPHA = {_f32_literal(alpha)};\n"
            f"constexpr float SOFTCAP = {_f32_literal(softcap)};\n"
            "constexpr float SOFTCAP_DIV = SOFTCAP > 0.0f ? SOFTCAP : 1.0f;\n")


@functools.lru_cache(maxsize=64)
def _attn_kernel(alpha: float, softcap: float):
    head = _attn_header(alpha, softcap)
    tag = hashlib.sha1((head + _ATTN_SOURCE).encode()).hexdigest()[:12]
    return mx.fast.cuda_kernel(name=f"ortmlx_decode_attention_{tag}",
                               input_names=["q", "k", "v", "past_len", "total_len", "sink"],
                               output_names=["out"], source=_ATTN_SOURCE, header=head)


def decode_attention_reason(q, k, v, num_heads: int, kv_num_heads: int, attention_bias=None) -> str | None:
    """Why ``decode_attention`` does not cover this case (None: it does)."""
    if attention_bias is not None:
        return "attention_bias"
    if q.dtype not in _ATTN_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes q {q.dtype} k {k.dtype} v {v.dtype}"
    if q.ndim != 4 or q.shape[2] != 1 or k.ndim != 4 or v.shape != k.shape:
        return f"shapes q {q.shape} k {k.shape} v {v.shape}"
    b, qh, _, h = q.shape
    if k.shape[0] != b or k.shape[1] != kv_num_heads or k.shape[3] != h or qh < num_heads:
        return f"shapes q {q.shape} k {k.shape}"
    if h > ATTN_MAX_HEAD or num_heads % kv_num_heads:
        return f"head size {h} / heads {num_heads}:{kv_num_heads}"
    if k.shape[2] >= 2**31 or b * num_heads >= 2**31:
        return "too large"
    return None


def decode_attention(q, k, v, past_len, total_len, *, num_heads: int, kv_num_heads: int, alpha: float,
                     softcap: float = 0.0, local_window_size: int = -1, sink=None):
    """GroupQueryAttention of one query row per batch row, as ``gqa_core`` computes it.

    q (B, QH, 1, H): the first ``num_heads`` heads are the queries (QH > num_heads: packed QKV's
    rotated query and key heads); k, v (B, Nkv, T, H) the present buffers; past_len, total_len (B,)
    int32: query b sits at past_len[b] and sees keys t <= past_len[b], t < total_len[b] (and
    t > past_len[b] - w with a local window w > 0). Scores ``(q . k) * alpha`` (then softcap),
    softmax with the optional per-head ``sink`` logit, weighted values: float32, rounded once to
    q's type. Returns (B, num_heads, H).
    """
    b, qh, _, h = q.shape
    # template ints must be >= 0: MLX puts them into the kernel's name (no window: 0)
    sink_arr = mx.zeros((1,), mx.float32) if sink is None else sink.astype(mx.float32)
    kernel = _attn_kernel(float(alpha), float(softcap))
    threads = 32 * ATTN_WARPS
    (out,) = kernel(
        inputs=[q, k, v, past_len.astype(mx.int32), total_len.astype(mx.int32), sink_arr],
        template=[("T", q.dtype), ("NH", num_heads), ("NKV", kv_num_heads), ("HEAD", h), ("QH", qh),
                  ("KV", k.shape[2]), ("WARPS", ATTN_WARPS), ("WINDOW", max(int(local_window_size), 0)),
                  ("HAS_SINK", sink is not None)],
        grid=(b * num_heads * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(b, num_heads, h)], output_dtypes=[q.dtype])
    return out


def _gather_source(sizes: list[int], offsets: list[int]) -> str:
    cases = "\n".join(f"        case {i}: src = reinterpret_cast<const uint8_t*>(in{i}); nbytes = {n}; "
                      f"off = {o}; break;" for i, (n, o) in enumerate(zip(sizes, offsets)))
    return ("    const uint8_t* src = nullptr;\n    size_t nbytes = 0, off = 0;\n"
            f"    switch (blockIdx.x) {{\n{cases}\n        default: return;\n    }}\n"
            "    for (size_t j = threadIdx.x; j < nbytes; j += blockDim.x) out[off + j] = src[j];\n")


@functools.lru_cache(maxsize=64)
def _gather_kernel(sizes: tuple[int, ...]):
    offsets = list(np.cumsum((0,) + sizes[:-1]).tolist())
    src = _gather_source(list(sizes), offsets)
    tag = hashlib.sha1(src.encode()).hexdigest()[:12]
    return mx.fast.cuda_kernel(name=f"ortmlx_gather_bytes_{tag}", input_names=[f"in{i}" for i in range(len(sizes))],
                               output_names=["out"], source=src)


#: most arrays one ``gather_bytes`` kernel takes (a kernel's parameters are limited to 32 KB)
GATHER_MAX = 512


def gather_bytes(arrays: list) -> mx.array:
    """The bytes of ``arrays`` (row-major, one after another) as one uint8 array: one kernel."""
    if not arrays or len(arrays) > GATHER_MAX:
        raise ValueError(f"gather_bytes takes 1..{GATHER_MAX} arrays, got {len(arrays)}")
    sizes = tuple(int(a.nbytes) for a in arrays)
    if min(sizes) == 0:
        raise ValueError("gather_bytes: an empty array")
    (out,) = _gather_kernel(sizes)(inputs=list(arrays), grid=(len(arrays) * 128, 1, 1), threadgroup=(128, 1, 1),
                                   output_shapes=[(sum(sizes),)], output_dtypes=[mx.uint8])
    return out
