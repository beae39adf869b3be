"""Custom CUDA kernels (``mx.fast.cuda_kernel``) for the GPU decode step (and short prompts) on MLX's CUDA backend.

A decode token of an LLM is a few hundred small kernels; on MLX's CUDA backend the host cost of
encoding and launching each one (a CUDA graph node, ~5-18 us) outweighs its arithmetic. These
kernels replace chains of MLX ops with one launch each, computing the same values:

- ``decode_rope_attention``: one query row (S == 1) of GroupQueryAttention written into a shared KV
  buffer: the packed QKV's bias (when its Add was folded in), the query and key rotation, both
  presents with the new row, the new rows themselves (row hints), and the attention: twelve MLX
  kernels in ``gqa_core`` (partner gather, rotation, two present updates, then the attention's seven).
- ``decode_attention``: the attention alone for other decode rows (first prompt, separate buffers):
  scores, mask, softmax and the weighted sum of values in float32, as ``gqa_core`` does with seven MLX
  kernels (casts of K and V, two float32 matmuls, scale and mask, softmax, the final cast).
- ``prompt_attention``: a first prompt's attention over its own keys where MLX's fused kernel is not used (short
  prompts): the same float32 arithmetic as ``decode_attention``, one query row a block, where MLX takes eight
  launches (two of them cuBLAS products, ~15-30 us of host time each); the length is read from the keys' shape,
  so one build serves every prompt length.
- ``prompt_rope``: a first prompt's packed QKV as its rotated queries, both presents over the whole KV buffer and
  the prompt's rows written back: where MLX ran the rotation in float32, a transpose and per present a pad and a
  select over every buffer row.
- ``rms_norm``: (Skip)SimplifiedLayerNormalization of rows: the float32 sum of input, skip and
  bias, its mean square, the scaled result and both roundings to the output type in one kernel, where
  MLX takes three (the sum and its casts, ``mx.fast.rms_norm`` on float32, the final cast).
- ``take_rows``: a Gather along any axis (an embedding's rows, a pruned LM head's last token), where MLX's gather
  is a JIT kernel of its own.
- ``gather_bytes``: many small arrays' bytes into one uint8 array (a ``concatenate`` of N arrays
  is N copy kernels).

Used only where ``enabled()`` says so: a build of a Program that asked for them
(``BuildContext.cuda_kernels``, ``kernels/build.py``), running on the GPU of MLX's CUDA backend.
"""
from __future__ import annotations

import functools
import hashlib

import mlx.core as mx
import numpy as np

from . import build, consts, cuda_cache

#: warps per block of ``decode_attention`` (each strides over the keys, ATTN_KEYS at a time)
ATTN_WARPS = 8
#: keys a warp of ``decode_attention`` takes at once (their loads in flight together)
ATTN_KEYS = 4
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


#: why the kernels were turned off for this process (empty: they are not): a run that failed with them
#: and succeeded without them (``interpreter.Program.run``)
_DISABLED: list[str] = []


def usable() -> bool:
    """Whether MLX runs CUDA here and the kernels have not been turned off."""
    return cuda_backend() and not _DISABLED


def disable(reason: str) -> None:
    """Turn the kernels off for this process (once; a RuntimeWarning says why)."""
    if not _DISABLED:
        _DISABLED.append(reason)
        import warnings
        warnings.warn(f"ortmlx: custom CUDA kernels turned off for this process: {reason}", RuntimeWarning,
                      stacklevel=2)


def disabled_reason() -> str | None:
    return _DISABLED[0] if _DISABLED else None


def enabled() -> bool:
    """Whether the build in progress may use these kernels (asked for, usable, and on the GPU)."""
    b = build.current()
    return b is not None and b.cuda_kernels and usable() and mx.default_device() == mx.gpu


#: in every kernel of ours before it reads anything but constants or writes anything (its first statement unless
#: its source places it): on sm_90 and later, wait until the kernel before it in its stream is done and its writes
#: visible, then let the next one start. A plain launch has nothing to wait for and no dependent (no-ops); a
#: replay's launches made with programmatic dependent launch (tuning ``replay_pdl``) start while the one before
#: them runs, read their weights, and wait here.
PRIOR_WAIT = """
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
"""


def with_prior_wait(source: str) -> str:
    """A kernel body as built: ``PRIOR_WAIT`` first, unless the source places it."""
    return source if PRIOR_WAIT in source else PRIOR_WAIT + source


def _kernel(prefix: str, input_names: list, output_names: list, source: str, header: str = "",
            ensure_row_contiguous: bool = True):
    """``mx.fast.cuda_kernel`` named ``prefix`` + a hash of its text (MLX keys compiled kernels by name), its builds
    kept in MLX's kernel cache across processes (``cuda_cache``); ``ensure_row_contiguous=False``: inputs are passed
    as they lie (the source reads their strides)."""
    source = with_prior_wait(source)
    name = f"{prefix}_{hashlib.sha1((header + source).encode()).hexdigest()[:12]}"
    fn = mx.fast.cuda_kernel(name=name, input_names=input_names, output_names=output_names,
                             source=source, header=header, ensure_row_contiguous=ensure_row_contiguous)
    return cuda_cache.CachedKernel(name, input_names, output_names, source, header, fn, ensure_row_contiguous)


def _f32_literal(x: float) -> str:
    """A CUDA float literal of exactly ``float32(x)`` (hexadecimal: no decimal rounding)."""
    v = float(np.float32(x))
    if not np.isfinite(v):
        raise ValueError(f"constant {x} is not finite in float32")
    return v.hex() + "f"


#: the attention of one (batch row b, query head n) block: warp w takes keys lo+w*KEYS .. +KEYS-1, then the
#: KEYS after lo+(w+WARPS)*KEYS, ... (a decode row is latency-bound: many keys' loads in flight); lane l
#: the features l, l+32, ... of a row. Scores and the softmax are float32; online softmax per warp, merged
#: across warps at the end. Reads QVAL(d), KEY_AT(t, d), VAL_AT(t, d) (macros of the kernel using it);
#: b, n, kvh, ql (query position), tl (total length) and base (offset of the (b, kvh) KV rows) are set.
_ATTEND = r"""
    constexpr int PER = (HEAD + 31) / 32;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    int hi = ql < tl - 1 ? ql : tl - 1;
    if (hi > KV - 1) hi = KV - 1;
    int lo = 0;
    if (WINDOW > 0 && ql - WINDOW + 1 > lo) lo = ql - WINDOW + 1;
    float qv[PER];
    float acc[PER];
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int d = lane + 32 * i;
        qv[i] = d < HEAD ? QVAL(d) : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF;
    float l = 0.0f;
    for (int t0 = lo + warp * KEYS; t0 <= hi; t0 += WARPS * KEYS) {
        // KEYS keys at once: every key's and value's loads are issued before any is used
        float part[KEYS];
        float val[KEYS][PER];
        #pragma unroll
        for (int u = 0; u < KEYS; ++u) {
            const int t = t0 + u <= hi ? t0 + u : hi;       // past hi: a valid address, masked below
            part[u] = 0.0f;
            #pragma unroll
            for (int i = 0; i < PER; ++i) {
                const int d = lane + 32 * i;
                if (d < HEAD) {
                    part[u] += qv[i] * KEY_AT(t, d);
                    val[u][i] = VAL_AT(t, d);
                } else {
                    val[u][i] = 0.0f;
                }
            }
        }
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            #pragma unroll
            for (int u = 0; u < KEYS; ++u) part[u] += __shfl_xor_sync(0xffffffffu, part[u], off);
        }
        float mn = m;
        #pragma unroll
        for (int u = 0; u < KEYS; ++u) {
            float sc = part[u] * ALPHA;
            if (SOFTCAP > 0.0f) sc = SOFTCAP * tanhf(sc / SOFTCAP_DIV);
            part[u] = t0 + u <= hi ? sc : NEG_INF;
            mn = fmaxf(mn, part[u]);
        }
        const float corr = expf(m - mn);
        l *= corr;
        #pragma unroll
        for (int i = 0; i < PER; ++i) acc[i] *= corr;
        #pragma unroll
        for (int u = 0; u < KEYS; ++u) {
            const float p = expf(part[u] - mn);
            l += p;
            #pragma unroll
            for (int i = 0; i < PER; ++i) acc[i] += p * val[u][i];
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

_ATTN_SOURCE = r"""
    const int b = blockIdx.x / NH;
    const int n = blockIdx.x - b * NH;
    const int kvh = n / (NH / NKV);
    const int ql = past_len[b];
    const int tl = total_len[b];
    const T* qrow = q + ((size_t)b * QH + n) * HEAD;
    const size_t base = ((size_t)b * NKV + kvh) * (size_t)KV * HEAD;
#define QVAL(d) static_cast<float>(qrow[d])
#define KEY_AT(t, d) static_cast<float>(k[base + (size_t)(t) * HEAD + (d)])
#define VAL_AT(t, d) static_cast<float>(v[base + (size_t)(t) * HEAD + (d)])
""" + _ATTEND

#: one kernel for a decode row written into a shared KV buffer: blocks [0, NB*NH) rotate their query
#: head and the new key row (in shared memory) and attend, reading row ql of K/V from the new rows;
#: the other blocks write the presents (the past with row past_len[b] replaced) in chunks of CROWS
#: rows, and chunk 0 the new rows themselves (k_new, v_new).
_FUSED_SOURCE = r"""
    if (blockIdx.x < NB * NH) {
        const int b = blockIdx.x / NH;
        const int n = blockIdx.x - b * NH;
        const int kvh = n / (NH / NKV);
        const int ql = past_len[b];
        const int tl = total_len[b];
        const size_t base = ((size_t)b * NKV + kvh) * (size_t)KV * HEAD;
        __shared__ float qsh[HEAD];
        __shared__ float knew[HEAD];
        __shared__ float vnew[HEAD];
        const float* cb = cosv + (size_t)b * HEAD;
        const float* sb = sinv + (size_t)b * HEAD;
        const T* qh = qsrc + (size_t)b * Q_ROW + Q_OFF + (size_t)n * HEAD;
        const T* kh = ksrc + (size_t)b * K_ROW + K_OFF + (size_t)kvh * HEAD;
        const T* vh = vsrc + (size_t)b * V_ROW + V_OFF + (size_t)kvh * HEAD;
        const T* qb = bias + Q_OFF + (size_t)n * HEAD;
        const T* kb = bias + K_OFF + (size_t)kvh * HEAD;
        const T* vb = bias + V_OFF + (size_t)kvh * HEAD;
        for (int d = threadIdx.x; d < HEAD; d += blockDim.x) {
            qsh[d] = static_cast<float>(ortmlx_rope<T, ROT_DIM, INTERLEAVED, HAS_QKV_BIAS>(qh, qb, cb, sb, d));
            knew[d] = static_cast<float>(ortmlx_rope<T, ROT_DIM, INTERLEAVED, HAS_QKV_BIAS>(kh, kb, cb, sb, d));
            vnew[d] = static_cast<float>(ortmlx_ld<T, HAS_QKV_BIAS>(vh, vb, d));
        }
        __syncthreads();
#define QVAL(d) qsh[d]
#define KEY_AT(t, d) ((t) == ql ? knew[d] : static_cast<float>(past_k[base + (size_t)(t) * HEAD + (d)]))
#define VAL_AT(t, d) ((t) == ql ? vnew[d] : static_cast<float>(past_v[base + (size_t)(t) * HEAD + (d)]))
""" + _ATTEND + r"""
    } else {
        // the presents, CROWS rows a block: the past's rows in PIECE-element pieces (16 bytes when a row
        // is a whole number of them and the buffers are aligned), one piece a thread, the loads in flight
        // together; row past_len[b] is the new (rotated) key / value row
        constexpr int NCHUNK = (KV + CROWS - 1) / CROWS;
        constexpr int PIECE = (HEAD * sizeof(T)) % 16 == 0 ? 16 / (int)sizeof(T) : 1;
        const int idx = blockIdx.x - NB * NH;
        const int chunk = idx % NCHUNK;
        const int bh = idx / NCHUNK;
        const int b = bh / NKV;
        const int kvh = bh - b * NKV;
        const int pl = past_len[b];
        const float* cb = cosv + (size_t)b * HEAD;
        const float* sb = sinv + (size_t)b * HEAD;
        const T* kh = ksrc + (size_t)b * K_ROW + K_OFF + (size_t)kvh * HEAD;
        const T* vh = vsrc + (size_t)b * V_ROW + V_OFF + (size_t)kvh * HEAD;
        const T* kb = bias + K_OFF + (size_t)kvh * HEAD;
        const T* vb = bias + V_OFF + (size_t)kvh * HEAD;
        const size_t base = (size_t)bh * KV * HEAD;
        const int r0 = chunk * CROWS;
        const int rows = (KV - r0) < CROWS ? (KV - r0) : CROWS;
        const bool vec = PIECE > 1 && ((reinterpret_cast<size_t>(past_k) | reinterpret_cast<size_t>(past_v) |
                                        reinterpret_cast<size_t>(present_k) | reinterpret_cast<size_t>(present_v)) &
                                       15) == 0;
        if (vec) {
            constexpr int ROWP = HEAD / PIECE;
            for (int e = threadIdx.x; e < rows * ROWP; e += blockDim.x) {
                const int t = r0 + e / ROWP;
                if (t == pl) continue;
                const size_t at = base + (size_t)t * HEAD + (size_t)(e - (e / ROWP) * ROWP) * PIECE;
                const uint4 kx = *reinterpret_cast<const uint4*>(past_k + at);
                const uint4 vx = *reinterpret_cast<const uint4*>(past_v + at);
                *reinterpret_cast<uint4*>(present_k + at) = kx;
                *reinterpret_cast<uint4*>(present_v + at) = vx;
            }
        } else {
            for (int e = threadIdx.x; e < rows * HEAD; e += blockDim.x) {
                const int t = r0 + e / HEAD;
                if (t == pl) continue;
                const size_t at = base + (size_t)t * HEAD + (e - (e / HEAD) * HEAD);
                const T kx = past_k[at];
                const T vx = past_v[at];
                present_k[at] = kx;
                present_v[at] = vx;
            }
        }
        if (pl >= r0 && pl < r0 + rows) {
            for (int d = threadIdx.x; d < HEAD; d += blockDim.x) {
                const size_t at = base + (size_t)pl * HEAD + d;
                present_k[at] = ortmlx_rope<T, ROT_DIM, INTERLEAVED, HAS_QKV_BIAS>(kh, kb, cb, sb, d);
                present_v[at] = ortmlx_ld<T, HAS_QKV_BIAS>(vh, vb, d);
            }
        }
        if (chunk == 0) {
            for (int d = threadIdx.x; d < HEAD; d += blockDim.x) {
                k_new[(size_t)bh * HEAD + d] = ortmlx_rope<T, ROT_DIM, INTERLEAVED, HAS_QKV_BIAS>(kh, kb, cb, sb, d);
                v_new[(size_t)bh * HEAD + d] = ortmlx_ld<T, HAS_QKV_BIAS>(vh, vb, d);
            }
        }
    }
"""


def _whole_pieces(head: int, itemsize: int) -> bool:
    """Whether a row of ``head`` elements is a whole number of 16-byte pieces (the fused kernel's PIECE)."""
    return (head * itemsize) % 16 == 0


def fused_rows_per_block(head: int, itemsize: int, threads: int) -> int:
    """Rows of the presents one copy block of the fused kernel writes: a 16-byte piece a thread (the
    kernel's PIECE), at least one row."""
    piece = 16 // itemsize if _whole_pieces(head, itemsize) else 1
    return max(1, threads // (head // piece))


_ROPE_HEADER = r"""
// feature d of a packed-QKV row, plus its bias when the Add that fed it was folded in (T's own addition,
// as MLX's Add computes it)
template <typename T, bool HB>
__device__ __forceinline__ T ortmlx_ld(const T* x, const T* bias, int d) {
    if (HB) return static_cast<T>(x[d] + bias[d]);
    return x[d];
}

// x rotated at feature d as ``apply_rotary`` does: float32 products and sum (never contracted into an
// FMA), rounded once to T; features at or past ROT_DIM (all of them when ROT_DIM == 0) as they are.
template <typename T, int ROT_DIM, bool INTERLEAVED, bool HB>
__device__ __forceinline__ T ortmlx_rope(const T* x, const T* bias, const float* c, const float* s, int d) {
    if (d >= ROT_DIM) return ortmlx_ld<T, HB>(x, bias, d);
    const int half = ROT_DIM / 2;
    const int p = INTERLEAVED ? (d ^ 1) : (d < half ? d + half : d - half);
    return static_cast<T>(__fadd_rn(__fmul_rn(static_cast<float>(ortmlx_ld<T, HB>(x, bias, d)), c[d]),
                                    __fmul_rn(static_cast<float>(ortmlx_ld<T, HB>(x, bias, p)), s[d])));
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
    return _kernel("ortmlx_decode_attention", ["q", "k", "v", "past_len", "total_len", "sink"], ["out"], _ATTN_SOURCE,
                   head)


def _attend_reason(q, k, v, attention_bias) -> str | None:
    """What every ``_ATTEND`` kernel refuses: an attention bias, other types, q/k/v not 4-D with v shaped as k."""
    if attention_bias is not None:
        return "attention_bias"
    if q.dtype not in _ATTN_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes q {q.dtype} k {k.dtype} v {v.dtype}"
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        return f"shapes q {q.shape} k {k.shape} v {v.shape}"
    return None


def _sink_input(sink) -> mx.array:
    """An ``_ATTEND`` kernel's sink input: the per-head logits in float32 (a placeholder without them)."""
    return consts.zeros((1,), mx.float32) if sink is None else sink.astype(mx.float32)


def decode_attention_reason(q, k, v, num_heads: int, kv_num_heads: int, attention_bias=None) -> str | None:
    """Why ``decode_attention`` does not cover this case (None: it does)."""
    reason = _attend_reason(q, k, v, attention_bias)
    if reason is not None:
        return reason
    if q.shape[2] != 1:
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
    sink_arr = _sink_input(sink)
    kernel = _attn_kernel(float(alpha), float(softcap))
    # template ints must be >= 0: MLX writes them into the kernel's name (no window: 0)
    threads = 32 * ATTN_WARPS
    (out,) = kernel(
        inputs=[q, k, v, past_len.astype(mx.int32), total_len.astype(mx.int32), sink_arr],
        template=[("T", q.dtype), ("NH", num_heads), ("NKV", kv_num_heads), ("HEAD", h), ("QH", qh),
                  ("KV", k.shape[2]), ("WARPS", ATTN_WARPS), ("KEYS", ATTN_KEYS),
                  ("WINDOW", max(int(local_window_size), 0)), ("HAS_SINK", sink is not None)],
        grid=(b * num_heads * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(b, num_heads, h)], output_dtypes=[q.dtype])
    return out


#: a first prompt's attention: one block a (row b, query s, head n), ``_ATTEND`` over keys t <= s of its own
#: S keys (q (B, N, S, H), k and v (B, Nkv, S, H) read through their strides: views of the packed QKV need no
#: copy); S comes from k's shape, so one build serves every prompt length. ``_ATTEND`` writes row (b, n) of a
#: (rows, NH, HEAD) output: here row b * S + s, so the output is (B, S, NH * HEAD) as the node's.
_PROMPT_SOURCE = r"""
    const int KV = k_shape[2];
    const int n = blockIdx.x % NH;
    const int row = blockIdx.x / NH;
    const int bb = row / KV;
    const int ql = row - bb * KV;
    const int b = row;
    const int kvh = n / (NH / NKV);
    const int tl = total_len[bb];
    if (DROP_PAST && ql >= tl) {            // a row the caller drops (a padded prompt's): zeros, no keys read
        T* zrow = out + ((size_t)row * NH + n) * HEAD;
        for (int d = threadIdx.x; d < HEAD; d += blockDim.x) zrow[d] = static_cast<T>(0.0f);
        return;
    }
    const T* qrow = q + bb * q_strides[0] + n * q_strides[1] + ql * q_strides[2];
    const T* kb = k + bb * k_strides[0] + kvh * k_strides[1];
    const T* vb = v + bb * v_strides[0] + kvh * v_strides[1];
#define QVAL(d) static_cast<float>(qrow[(d) * q_strides[3]])
#define KEY_AT(t, d) static_cast<float>(kb[(t) * k_strides[2] + (d) * k_strides[3]])
#define VAL_AT(t, d) static_cast<float>(vb[(t) * v_strides[2] + (d) * v_strides[3]])
""" + _ATTEND


@functools.lru_cache(maxsize=64)
def _prompt_kernel(alpha: float, softcap: float):
    return _kernel("ortmlx_prompt_attention", ["q", "k", "v", "total_len", "sink"], ["out"], _PROMPT_SOURCE,
                   _attn_header(alpha, softcap), ensure_row_contiguous=False)


#: the longest prompt ``prompt_attention`` takes: a block a query row re-reads its row's keys from L2, which grows
#: with S^2 (longer prompts take MLX's fused kernel, ``build.fused_attention``)
PROMPT_MAX = 1024


def prompt_attention_reason(q, k, v, num_heads: int, kv_num_heads: int, attention_bias=None) -> str | None:
    """Why ``prompt_attention`` does not cover this case (None: it does)."""
    reason = _attend_reason(q, k, v, attention_bias)
    if reason is not None:
        return reason
    b, nq, s, h = q.shape
    if nq != num_heads or k.shape != (b, kv_num_heads, s, h) or num_heads % kv_num_heads:
        return f"shapes q {q.shape} k {k.shape} for heads {num_heads}:{kv_num_heads}"
    if h > ATTN_MAX_HEAD:
        return f"head size {h}"
    if s > PROMPT_MAX:
        return f"{s} tokens (at most {PROMPT_MAX})"
    return None


def prompt_attention(q, k, v, total_len, *, alpha: float, softcap: float = 0.0, local_window_size: int = -1,
                     sink=None, drop_past: bool = False):
    """A first prompt's GroupQueryAttention over its own keys, as ``contrib_attention.prompt_attention`` computes it.

    q (B, N, S, H) rotated queries; k, v (B, Nkv, S, H); total_len (B,) int32: query s of row b sees keys
    t <= s, t < total_len[b] (and t > s - w with a local window w > 0). Scores ``(q . k) * alpha`` (then softcap),
    softmax with the optional per-head ``sink`` logit, weighted values: float32, rounded once to q's type
    (``decode_attention``'s arithmetic, one query row a block). Returns (B, S, N * H). ``drop_past``: the caller
    drops query rows s >= total_len[b] (a padded prompt's), which are zero, their keys never read.
    """
    b, n, s, h = q.shape
    sink_arr = _sink_input(sink)
    threads = 32 * ATTN_WARPS
    (out,) = _prompt_kernel(float(alpha), float(softcap))(
        inputs=[q, k, v, total_len.astype(mx.int32), sink_arr],
        template=[("T", q.dtype), ("NH", n), ("NKV", k.shape[1]), ("HEAD", h), ("WARPS", ATTN_WARPS),
                  ("KEYS", ATTN_KEYS), ("WINDOW", max(int(local_window_size), 0)), ("HAS_SINK", sink is not None),
                  ("DROP_PAST", bool(drop_past))],
        grid=(b * s * n * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(b, s, n * h)], output_dtypes=[q.dtype])
    return out


_PROMPT_ROPE_SOURCE = r"""
    // thread i < B*S*NH*HEAD: element (b, s, n, d) of the rotated queries (B, S, NH, HEAD); past them, the
    // presents' elements (b, kh, r, d) of (B, NKV, ROWS, HEAD), keys then values: row r < S (and, HAS_VALID,
    // r < valid[b]) the rotated key / the value of prompt row r, every other row zero; rows r < S also into the
    // (B, NKV, S, HEAD) k_rows / v_rows (the rows the runtime writes back). B and S are qkv's shape,
    // read at run time: one build serves every prompt length (ROWS 0: the presents have S rows).
    constexpr int HEADS = NH + 2 * NKV;
    const size_t nb = qkv_shape[0], S = qkv_shape[1];
    const size_t R = ROWS ? static_cast<size_t>(ROWS) : S;
    const size_t nq = nb * NH * S * HEAD;
    const size_t np_ = nb * NKV * R * HEAD;
    size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    if (i < nq) {
        const int d = i % HEAD;
        const size_t t = i / HEAD;
        const int n = t % NH;
        const size_t row = t / NH;
        q_out[i] = ortmlx_rope<T, ROT_DIM, INTERLEAVED, HAS_QKV_BIAS>(
            qkv + row * (HEADS * HEAD) + n * HEAD, bias + n * HEAD, cosv + row * HEAD, sinv + row * HEAD, d);
        return;
    }
    i -= nq;
    if (i >= 2 * np_) return;
    const bool is_v = i >= np_;
    const size_t j = is_v ? i - np_ : i;
    const int d = j % HEAD;
    size_t t = j / HEAD;
    const size_t r = t % R;
    t /= R;
    const int kh = t % NKV;
    const size_t b = t / NKV;
    T val = static_cast<T>(0.0f);
    if (r < S && (!HAS_VALID || static_cast<long long>(r) < static_cast<long long>(valid[b]))) {
        const size_t row = b * S + r;
        const int head = NH + (is_v ? NKV : 0) + kh;
        const T* x = qkv + row * (HEADS * HEAD) + head * HEAD;
        val = is_v ? ortmlx_ld<T, HAS_QKV_BIAS>(x, bias + head * HEAD, d)
                   : ortmlx_rope<T, ROT_DIM, INTERLEAVED, HAS_QKV_BIAS>(x, bias + head * HEAD, cosv + row * HEAD,
                                                                      sinv + row * HEAD, d);
    }
    (is_v ? present_v : present_k)[j] = val;
    if (r < S) (is_v ? v_rows : k_rows)[((b * NKV + kh) * S + r) * HEAD + d] = val;
"""
#: threads per block of ``prompt_rope``
ROPE_THREADS = 256


@functools.lru_cache(maxsize=1)
def _prompt_rope_kernel():
    return _kernel("ortmlx_prompt_rope", ["qkv", "cosv", "sinv", "valid", "bias"],
                   ["q_out", "present_k", "present_v", "k_rows", "v_rows"], _PROMPT_ROPE_SOURCE, _ROPE_HEADER)


def prompt_rope_reason(qkv, num_heads: int, kv_num_heads: int, rot_dim: int, rows: int) -> str | None:
    """Why ``prompt_rope`` does not cover this case (None: it does)."""
    if qkv.dtype not in _ATTN_DTYPES or qkv.ndim not in (3, 4):
        return f"packed QKV {qkv.dtype} {qkv.shape}"
    b, s = qkv.shape[:2]
    heads = num_heads + 2 * kv_num_heads
    h = qkv.shape[3] if qkv.ndim == 4 else qkv.shape[2] // heads
    if qkv.shape[2:] not in ((heads, h), (heads * h,)) or h == 0:
        return f"packed QKV {qkv.shape} for heads {num_heads}+2*{kv_num_heads}"
    if rot_dim % 2 or rot_dim > h or rows < s:
        return f"rotary dim {rot_dim}, head size {h}, {rows} present rows for {s} tokens"
    if b * (num_heads * s + 2 * kv_num_heads * rows) * h >= 2**31:
        return "too large"
    return None


def prompt_rope(qkv, cos, sin, valid, rows: int, *, num_heads: int, kv_num_heads: int, rot_dim: int,
                interleaved: bool, qkv_bias=None):
    """A first prompt's queries and presents from its packed QKV, in one kernel.

    qkv (B, S, N+2Nkv, H) or (B, S, (N+2Nkv)*H); cos, sin (B, S, H) float32 rotary tables (``rotary_tables``; unused
    when ``rot_dim`` is 0); valid (B,) int32 or None: the prompt's own length in each row (a padded prompt). The
    query and key heads are rotated as ``apply_rotary`` rotates them, after ``qkv_bias`` ((N+2Nkv)*H,) is added in
    the input's type. Returns q (B, N, S, H), a view of (B, S, N, H) rows (MLX's cuDNN attention gives its output
    the queries' layout: (B, S, N * H) rows with no transpose), the presents (B, Nkv, rows, H): row r < S (and
    < valid[b]) the rotated key / the value of prompt row r, zero past it, and their first S rows as arrays of their
    own (B, Nkv, S, H) (what the runtime writes back to host memory, with no copy of a strided view). MLX took a
    transpose, the rotation's float32 kernel, and per present a pad and a select over all its rows.
    """
    b, s = qkv.shape[:2]
    heads = num_heads + 2 * kv_num_heads
    h = qkv.shape[3] if qkv.ndim == 4 else qkv.shape[2] // heads
    dtype = qkv.dtype
    if rot_dim == 0:
        cos = sin = consts.zeros((1,), mx.float32)
    if qkv_bias is not None and (qkv_bias.shape != (heads * h,) or qkv_bias.dtype != dtype):
        raise ValueError(f"qkv_bias {qkv_bias.shape} {qkv_bias.dtype} needs a packed QKV row of {heads * h}")
    total = b * (num_heads * s + 2 * kv_num_heads * rows) * h
    q, pk, pv, k_rows, v_rows = _prompt_rope_kernel()(
        inputs=[qkv, cos.astype(mx.float32), sin.astype(mx.float32),
                consts.zeros((1,), mx.int32) if valid is None else valid.astype(mx.int32),
                consts.zeros((1,), dtype) if qkv_bias is None else qkv_bias],
        template=[("T", dtype), ("NH", num_heads), ("NKV", kv_num_heads), ("HEAD", h),
                  ("ROWS", 0 if rows == s else int(rows)),
                  ("ROT_DIM", int(rot_dim)), ("INTERLEAVED", bool(interleaved)),
                  ("HAS_QKV_BIAS", qkv_bias is not None), ("HAS_VALID", valid is not None)],
        grid=(-(-total // ROPE_THREADS) * ROPE_THREADS, 1, 1), threadgroup=(ROPE_THREADS, 1, 1),
        output_shapes=[(b, s, num_heads, h)] + [(b, kv_num_heads, rows, h)] * 2 + [(b, kv_num_heads, s, h)] * 2,
        output_dtypes=[dtype] * 5)
    return q.transpose(0, 2, 1, 3), pk, pv, k_rows, v_rows


_NORM_SOURCE = r"""
    // block: one row; threads stride over its features. x = input (+ skip) (+ bias) in float32;
    // the sum (rounded to T) is an output; y = gamma * (x * rsqrt(mean(x^2) + eps)), rounded to T.
    const size_t row = blockIdx.x;
    const T* xr = x + row * HIDDEN;
    const T* sr = skip + row * HIDDEN;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < HIDDEN; j += blockDim.x) {
        float t = static_cast<float>(xr[j]);
        if (HAS_SKIP) t = t + static_cast<float>(sr[j]);
        if (HAS_BIAS) t = t + static_cast<float>(bias[j]);
        if (HAS_SKIP) sum[row * HIDDEN + j] = static_cast<T>(t);
        ss += t * t;
    }
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    __shared__ float part[32];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (lane == 0) part[warp] = ss;
    __syncthreads();
    float tot = 0.0f;
    const int nw = (blockDim.x + 31) / 32;
    for (int w = 0; w < nw; ++w) tot += part[w];
    const float normalizer = rsqrtf(tot / HIDDEN + EPS);
    for (int j = threadIdx.x; j < HIDDEN; j += blockDim.x) {
        float t = static_cast<float>(xr[j]);
        if (HAS_SKIP) t = t + static_cast<float>(sr[j]);
        if (HAS_BIAS) t = t + static_cast<float>(bias[j]);
        const float g = static_cast<float>(gamma[j]);
        out[row * HIDDEN + j] = static_cast<T>(g * (t * normalizer));
    }
"""
#: threads per row of ``rms_norm``
NORM_THREADS = 256


@functools.lru_cache(maxsize=64)
def _norm_kernel(eps: float):
    head = f"constexpr float EPS = {_f32_literal(eps)};\n"
    return _kernel("ortmlx_rms_norm", ["x", "skip", "bias", "gamma"], ["out", "sum"], _NORM_SOURCE, head)


def rms_norm_reason(x, skip, gamma, bias) -> str | None:
    """Why ``rms_norm`` does not cover this case (None: it does)."""
    if x.dtype not in _ATTN_DTYPES or x.ndim not in (2, 3) or x.size == 0:
        return f"input {x.dtype} {x.shape}"
    h = x.shape[-1]
    if skip is not None and (skip.shape != x.shape or skip.dtype != x.dtype):
        return f"skip {skip.dtype} {skip.shape}"
    for what, p in (("gamma", gamma), ("bias", bias)):
        if p is not None and (p.shape != (h,) or p.dtype != x.dtype):
            return f"{what} {p.dtype} {p.shape}"
    if x.size // h >= 2**31:
        return "too many rows"
    return None


def rms_norm(x, gamma, epsilon: float, skip=None, bias=None):
    """(y, sum): y = gamma * (s * rsqrt(mean(s^2, last axis) + eps)) with s = x (+ skip) (+ bias), all in
    float32 (what ``mx.fast.rms_norm`` computes on the float32 sum), rounded once to x's type; ``sum`` is
    s rounded to x's type (None without ``skip``)."""
    h = x.shape[-1]
    rows = x.size // h
    dummy = consts.zeros((1,), x.dtype)
    out, total = _norm_kernel(float(epsilon))(
        inputs=[x, dummy if skip is None else skip, dummy if bias is None else bias, gamma],
        template=[("T", x.dtype), ("HIDDEN", h), ("HAS_SKIP", skip is not None), ("HAS_BIAS", bias is not None)],
        grid=(rows * NORM_THREADS, 1, 1), threadgroup=(NORM_THREADS, 1, 1),
        output_shapes=[x.shape, x.shape if skip is not None else (1,)], output_dtypes=[x.dtype, x.dtype])
    return out, (total if skip is not None else None)


_SWIGLU_SOURCE = r"""
    // y: rows of [gate | up] (or [up | gate]), 2 * N each; out = (g * sigmoid(g)) * u with the ONNX nodes'
    // roundings: Sigmoid in float32 rounded to T, each Mul of two T values rounded to T. The row count is y's
    // shape, read at run time: a prompt of any length runs the one build.
    size_t rows = 1;
    for (int k = 0; k + 1 < y_ndim; ++k) rows *= static_cast<size_t>(y_shape[k]);
    const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    if (i >= rows * static_cast<size_t>(N)) return;
    const size_t r = i / N, c = i % N;
    const T* yr = y + r * 2 * static_cast<size_t>(N);
    const float g = static_cast<float>(yr[GATE_FIRST ? c : N + c]);
    const float u = static_cast<float>(yr[GATE_FIRST ? N + c : c]);
    const float e = 1.0f / (1.0f + expf(fabsf(g)));
    const T sg = static_cast<T>(g < 0.0f ? e : 1.0f - e);
    const T a = static_cast<T>(g * static_cast<float>(sg));
    out[i] = static_cast<T>(static_cast<float>(a) * u);
"""
#: threads per block of ``swiglu``
SWIGLU_THREADS = 256


@functools.lru_cache(maxsize=1)
def _swiglu_kernel():
    return _kernel("ortmlx_swiglu", ["y"], ["out"], _SWIGLU_SOURCE)


def swiglu_reason(y, n: int) -> str | None:
    """Why ``swiglu`` does not cover this case (None: it does)."""
    if y.dtype not in _ATTN_DTYPES or y.ndim < 1 or y.shape[-1] != 2 * n or n <= 0 or not 0 < y.size < 2**31:
        return f"merged product {y.dtype} {y.shape} for width {n}"
    return None


def swiglu(y, n: int, gate_first: bool = True):
    """(g * sigmoid(g)) * u of a merged gate/up product ``y`` [..., 2N] (gate then up, or up then gate):
    [..., N] in y's type, one kernel instead of two slices and MLX's elementwise kernels (a prompt's four
    unfused ones, over float32 copies). Rounded as the ONNX nodes are (Sigmoid computed in float32 and rounded,
    each Mul rounded to the type)."""
    total = y.size // 2
    (out,) = _swiglu_kernel()(
        inputs=[y], template=[("T", y.dtype), ("N", n), ("GATE_FIRST", bool(gate_first))],
        grid=(-(-total // SWIGLU_THREADS) * SWIGLU_THREADS, 1, 1), threadgroup=(SWIGLU_THREADS, 1, 1),
        output_shapes=[tuple(y.shape[:-1]) + (n,)], output_dtypes=[y.dtype])
    return out


@functools.lru_cache(maxsize=64)
def _fused_kernel(alpha: float, softcap: float):
    head = _attn_header(alpha, softcap) + _ROPE_HEADER
    k = _kernel("ortmlx_decode_rope_attention",
                ["qsrc", "ksrc", "vsrc", "cosv", "sinv", "past_k", "past_v", "past_len", "total_len", "sink", "bias"],
                ["out", "present_k", "present_v", "k_new", "v_new"], _FUSED_SOURCE, head)
    # a present over its past: the copy writes each row's own bytes back and skips row past_len, which the
    # attention reads from shared memory (a replayed step keeps one KV buffer: ``cuda_replay``)
    k.in_place.update(present_k="past_k", present_v="past_v")
    return k


def decode_rope_attention_reason(q, k, v, past_k, past_v, num_heads: int, kv_num_heads: int, rot_dim: int,
                                 attention_bias=None) -> str | None:
    """Why ``decode_rope_attention`` does not cover this case (None: it does)."""
    if attention_bias is not None:
        return "attention_bias"
    if past_k is None or past_v is None or past_k.ndim != 4 or past_v.shape != past_k.shape:
        return "past buffers"
    b, kvn, kv, h = past_k.shape
    srcs = (q,) if k is None else (q, k, v)
    if any(a.dtype != past_k.dtype for a in srcs + (past_v,)) or past_k.dtype not in _ATTN_DTYPES:
        return "dtypes"
    if k is None:
        if q.shape not in ((b, 1, num_heads + 2 * kvn, h), (b, 1, (num_heads + 2 * kvn) * h)):
            return f"packed QKV {q.shape}"
    elif q.shape != (b, 1, num_heads * h) or k.shape != (b, 1, kvn * h) or v.shape != k.shape:
        return f"q {q.shape} k {k.shape}"
    if kvn != kv_num_heads or h > ATTN_MAX_HEAD or num_heads % kvn or rot_dim % 2 or rot_dim > h:
        return f"heads {num_heads}:{kv_num_heads}, head size {h}, rotary dim {rot_dim}"
    if not _whole_pieces(h, past_k.dtype.size):
        # the presents' copy moves 16-byte pieces; its element-wise form (for unaligned buffers) has not
        # run on a GPU with such rows
        return f"head size {h}: a {past_k.dtype} row is not a whole number of 16-byte pieces"
    if b * kvn * kv * h >= 2**31:
        return "too large"
    return None


def decode_rope_attention(q, k, v, cos, sin, past_k, past_v, past_len, total_len, *, num_heads: int,
                          kv_num_heads: int, rot_dim: int, interleaved: bool, alpha: float, softcap: float = 0.0,
                          local_window_size: int = -1, sink=None, qkv_bias=None):
    """A decode row of GroupQueryAttention into a shared KV buffer, in one kernel.

    q (B, 1, N+2Nkv, H) or (B, 1, (N+2Nkv)*H) packed QKV with k, v None, or q (B, 1, N*H), k, v (B, 1, Nkv*H); cos, sin (B, H)
    float32 rotary tables of the row (the sin carrying the rotation's sign, ``rotary_tables``; unused when
    ``rot_dim`` is 0); past_k, past_v (B, Nkv, T, H). The query and key heads are rotated as
    ``apply_rotary`` rotates them (after adding ``qkv_bias`` ((N+2Nkv)*H,), packed QKV only, in the
    input's type: the Add folded into the node); the presents are the pasts with row past_len[b] replaced by the new
    (rotated) key and value rows; the attention is ``decode_attention``'s over the presents. Returns
    (out (B, 1, N*H): GroupQueryAttention's output layout, present_k, present_v, k_new, v_new (B, Nkv, 1, H)).
    """
    b, kvn, kv, h = past_k.shape
    hq = num_heads * h
    if k is None:
        row = (num_heads + 2 * kvn) * h
        srcs, layout = (q, q, q), (row, 0, row, hq, row, hq + kvn * h)
    else:
        srcs, layout = (q, k, v), (hq, 0, kvn * h, 0, kvn * h, 0)
    if rot_dim == 0:
        cos = sin = consts.zeros((1,), mx.float32)
    sink_arr = _sink_input(sink)
    if qkv_bias is not None and (k is not None or qkv_bias.shape != (layout[0],) or qkv_bias.dtype != past_k.dtype):
        raise ValueError(f"qkv_bias {qkv_bias.shape} {qkv_bias.dtype} needs a packed QKV row of {layout[0]}")
    bias = consts.zeros((1,), past_k.dtype) if qkv_bias is None else qkv_bias
    threads = 32 * ATTN_WARPS
    crows = fused_rows_per_block(h, past_k.dtype.size, threads)
    blocks = b * num_heads + b * kvn * (-(-kv // crows))
    names = ("Q_ROW", "Q_OFF", "K_ROW", "K_OFF", "V_ROW", "V_OFF")
    outs = _fused_kernel(float(alpha), float(softcap))(
        inputs=[*srcs, cos.astype(mx.float32), sin.astype(mx.float32), past_k, past_v, past_len.astype(mx.int32),
                total_len.astype(mx.int32), sink_arr, bias],
        template=[("T", past_k.dtype), ("NB", b), ("NH", num_heads), ("NKV", kvn), ("HEAD", h), ("KV", kv),
                  ("WARPS", ATTN_WARPS), ("KEYS", ATTN_KEYS), ("WINDOW", max(int(local_window_size), 0)),
                  ("HAS_SINK", sink is not None), ("ROT_DIM", int(rot_dim)), ("INTERLEAVED", bool(interleaved)),
                  ("CROWS", crows), ("HAS_QKV_BIAS", qkv_bias is not None), *zip(names, layout)],
        grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(b, 1, num_heads * h), past_k.shape, past_k.shape, (b, kvn, 1, h), (b, kvn, 1, h)],
        output_dtypes=[past_k.dtype] * 5)
    return tuple(outs)


#: ``decode_setup``: thread (b, j) makes element j of row b's rotary tables (``rotary_tables``' values: the cache's
#: column j (side by side) or j / 2 (interleaved), column 0 past the rotary dims, as float32; the sin with the
#: rotation's sign), thread (b, 0) also the row's lengths; the position (past_len, or the given id) taken into
#: the cache as ``take_rows`` takes it (a negative one counted from the end, then clamped)
_SETUP_SOURCE = r"""
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= NB * HEAD) return;
    const int b = i / HEAD;
    const int j = i - b * HEAD;
    const int sk = static_cast<int>(seqlens[b]);
    if (j == 0) {
        past_len[b] = sk;
        total_len[b] = sk + 1;
    }
    if (ROWS == 0) return;
    int64_t p = HAS_POS ? static_cast<int64_t>(pos[b]) : static_cast<int64_t>(sk);
    p = p < 0 ? p + ROWS : p;
    p = p < 0 ? 0 : (p >= ROWS ? ROWS - 1 : p);
    const int col = j < 2 * HALF ? (INTERLEAVED ? j / 2 : j % HALF) : 0;
    const float sign = INTERLEAVED ? (j % 2 == 0 ? -1.0f : 1.0f) : (j < HALF ? -1.0f : 1.0f);
    cos_row[i] = static_cast<float>(cos_cache[p * HALF + col]);
    sin_row[i] = static_cast<float>(sin_cache[p * HALF + col]) * sign;
"""


@functools.lru_cache(maxsize=1)
def _setup_kernel():
    return _kernel("ortmlx_decode_setup", ["seqlens", "pos", "cos_cache", "sin_cache"],
                   ["past_len", "total_len", "cos_row", "sin_row"], _SETUP_SOURCE)


def decode_setup_reason(seqlens, position_ids, cos_cache, sin_cache, b: int, head: int) -> str | None:
    """Why ``decode_setup`` does not make this decode row's lengths and tables (None: it does)."""
    if seqlens.dtype != mx.int32 or seqlens.shape != (b,):
        return f"seqlens_k {seqlens.dtype} {seqlens.shape}"
    if position_ids is not None and (position_ids.size != b or position_ids.dtype not in (mx.int32, mx.int64)):
        return f"position_ids {position_ids.dtype} {position_ids.shape}"
    if cos_cache is not None:
        if cos_cache.ndim != 2 or sin_cache is None or sin_cache.shape != cos_cache.shape or \
                cos_cache.dtype not in _ATTN_DTYPES or sin_cache.dtype != cos_cache.dtype or \
                2 * cos_cache.shape[1] > head or cos_cache.size >= 2**31:
            return f"cos_cache {cos_cache.dtype} {cos_cache.shape}"
    return None


def decode_setup(seqlens, position_ids, cos_cache, sin_cache, head: int, interleaved: bool):
    """(past_len, total_len, cos, sin) of a decode row (S == 1) in one kernel: past_len = seqlens_k, total_len =
    seqlens_k + 1 (B,) int32; cos, sin (B, head) float32 as ``rotary_tables`` makes them at the position (the
    row's ``position_ids``, else its past length); None, None without a cache. ``decode_setup_reason`` None."""
    b = seqlens.shape[0]
    rows = 0 if cos_cache is None else cos_cache.shape[0]
    half = 1 if cos_cache is None else cos_cache.shape[1]
    dummy = consts.zeros((1,), mx.float32)
    pos = dummy if position_ids is None else position_ids.reshape(-1)
    tables = [cos_cache, sin_cache] if cos_cache is not None else [dummy, dummy]
    past, total, c, sn = _setup_kernel()(
        inputs=[seqlens, pos] + tables,
        template=[("NB", b), ("HEAD", head), ("HALF", half), ("ROWS", rows), ("HAS_POS", position_ids is not None),
                  ("INTERLEAVED", bool(interleaved))],
        grid=(-(-b * head // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(b,), (b,), (b, head), (b, head)],
        output_dtypes=[mx.int32, mx.int32, mx.float32, mx.float32])
    return past, total, (c if rows else None), (sn if rows else None)


def _gather_source(parts: int, to_host: bool = False) -> str:
    """Blocks ``i * per .. i * per + per - 1`` copy input ``in{i}`` (``per``: the grid's blocks over the parts): its
    byte count and offset come as data (``table``: int64 pairs), so one kernel per number of parts serves every size
    (a prompt bucket's rows build no kernel of their own); 16-byte stores where both ends are aligned (over the bus
    to host memory a byte store is a transaction of its own)."""
    cases = "\n".join(f"        case {i}: src = reinterpret_cast<const uint8_t*>(in{i}); break;" for i in range(parts))
    # to host memory: the address comes as data (``sink[0]``), ``out`` is one byte the host never reads
    dst = ("    uint8_t* dst = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(sink[0]));\n"
           "    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = 1;\n") if to_host else "    uint8_t* dst = out;\n"
    return ("    const uint8_t* src = nullptr;\n"
            f"    const unsigned per = gridDim.x / {parts}u;\n"
            "    const unsigned part = blockIdx.x / per;\n"
            f"    switch (part) {{\n{cases}\n        default: return;\n    }}\n"
            "    const size_t nbytes = static_cast<size_t>(table[2 * part]);\n"
            "    const size_t off = static_cast<size_t>(table[2 * part + 1]);\n"
            f"{dst}"
            "    uint8_t* d = dst + off;\n"
            "    const size_t i = static_cast<size_t>(blockIdx.x % per) * blockDim.x + threadIdx.x;\n"
            "    const size_t step = static_cast<size_t>(per) * blockDim.x;\n"
            "    size_t k0 = 0;\n"
            "    if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(d)) & 0xF) == 0) {\n"
            "        const size_t n16 = nbytes / 16;\n"
            "        for (size_t k = i; k < n16; k += step)\n"
            "            reinterpret_cast<uint4*>(d)[k] = reinterpret_cast<const uint4*>(src)[k];\n"
            "        k0 = n16 * 16;\n"
            "    }\n"
            "    for (size_t k = k0 + i; k < nbytes; k += step) d[k] = src[k];\n")


@functools.lru_cache(maxsize=64)
def _gather_kernel(parts: int, to_host: bool = False):
    names = [f"in{i}" for i in range(parts)] + ["table"] + (["sink"] if to_host else [])
    return _kernel("ortmlx_gather_host" if to_host else "ortmlx_gather_bytes", names, ["out"],
                   _gather_source(parts, to_host))


@functools.lru_cache(maxsize=64)
def _gather_table(sizes: tuple[int, ...]) -> mx.array:
    """The (bytes, offset) pairs of ``gather_bytes``'s parts, flat int64; made once per layout (a host-made array is
    read across the bus until the GPU has touched it)."""
    offsets = np.cumsum((0,) + sizes[:-1])
    return mx.array(np.stack([np.array(sizes, np.int64), offsets.astype(np.int64)], axis=1).reshape(-1))


#: bytes of the array a host-writing kernel returns to order the work (its first byte: one the kernel writes), above
#: the 8 bytes or less MLX's CUDA allocator serves from its pool of managed memory (a write across the bus)
ORDER_BYTES = 16


def _host_write(kernel, inputs: list, grid: tuple, threadgroup: tuple) -> mx.array:
    """Launch a kernel that writes host memory: its result, a view of the first byte of ``ORDER_BYTES``, is what
    later work waits on."""
    (out,) = kernel(inputs=inputs, grid=grid, threadgroup=threadgroup, output_shapes=[(ORDER_BYTES,)],
                    output_dtypes=[mx.uint8])
    return out[:1]


#: most arrays one ``gather_bytes`` kernel takes (a kernel's parameters are limited to 32 KB)
GATHER_MAX = 512
#: threads of a ``gather_bytes`` block; the blocks a part gets: one per this many bytes of the largest, at most
#: ``GATHER_BLOCKS_MAX``
GATHER_THREADS = 256
GATHER_BYTES_PER_BLOCK = 64 << 10
GATHER_BLOCKS_MAX = 16


def _gather_grid(sizes: tuple[int, ...]) -> tuple:
    per = max(1, min(GATHER_BLOCKS_MAX, max(sizes) // GATHER_BYTES_PER_BLOCK))
    return (len(sizes) * per * GATHER_THREADS, 1, 1), (GATHER_THREADS, 1, 1)


def gather_bytes(arrays: list, size: int | None = None, to_host=None) -> mx.array:
    """The bytes of ``arrays`` (row-major, one after another) as one uint8 array: one kernel. With
    ``size`` larger than their sum the array has ``size`` bytes and those after the sum are not written.

    ``to_host``: a one-element uint64 array holding the device address of page-locked host memory
    (``cuda_driver.HostBuffer``) of at least their sum of bytes: the kernel writes them there
    instead, and returns one byte that only orders the work (evaluate it, then read the memory)."""
    if not arrays or len(arrays) > GATHER_MAX:
        raise ValueError(f"gather_bytes takes 1..{GATHER_MAX} arrays, got {len(arrays)}")
    sizes = tuple(int(a.nbytes) for a in arrays)
    if min(sizes) == 0:
        raise ValueError("gather_bytes: an empty array")
    if to_host is not None:
        _check_address(to_host, "gather_bytes")
        grid, group = _gather_grid(sizes)
        return _host_write(_gather_kernel(len(sizes), True), list(arrays) + [_gather_table(sizes), to_host],
                           grid, group)
    n = sum(sizes) if size is None else max(int(size), sum(sizes))
    grid, group = _gather_grid(sizes)
    (out,) = _gather_kernel(len(sizes))(inputs=list(arrays) + [_gather_table(sizes)], grid=grid, threadgroup=group,
                                        output_shapes=[(n,)], output_dtypes=[mx.uint8])
    return out


def _check_address(to_host, what: str) -> None:
    """``to_host`` must be the one-element uint64 array holding a device address of host memory."""
    if to_host.dtype != mx.uint64 or to_host.size != 1:
        raise ValueError(f"{what}: to_host must be one uint64 address, got {to_host.dtype} of shape {to_host.shape}")


_COPY_HOST = r"""
    const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
    uint8_t* d = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(sink[0]));
    const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;
    if (i == 0) done[0] = 1;
    size_t k0 = 0;
    if (((reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d)) & 15) == 0) {
        const size_t n16 = NBYTES / 16;
        for (size_t k = i; k < n16; k += step) reinterpret_cast<uint4*>(d)[k] = reinterpret_cast<const uint4*>(s)[k];
        k0 = n16 * 16;
    }
    for (size_t k = k0 + i; k < NBYTES; k += step) d[k] = s[k];
"""
#: threads per block of ``copy_to_host``, and most blocks
COPY_THREADS, COPY_BLOCKS = 256, 264


def _copy_grid(nbytes: int) -> tuple[tuple, tuple]:
    """(grid, threadgroup) of the copy kernels: a block per 16 stores a thread, at most ``COPY_BLOCKS``."""
    blocks = max(1, min(COPY_BLOCKS, -(-nbytes // (16 * COPY_THREADS))))
    return (blocks * COPY_THREADS, 1, 1), (COPY_THREADS, 1, 1)


@functools.lru_cache(maxsize=64)
def _copy_host_kernel(nbytes: int):
    return _kernel("ortmlx_copy_host", ["src", "sink"], ["done"], _COPY_HOST.replace("NBYTES", f"{nbytes}ull"))


#: results at least this large are written by ``copy_to_address`` into a staging buffer that host threads copy
#: into ORT's output buffer (``runtime/devread.py``); a closure's smaller host outputs go through its page-locked buffer
#: (``compiled/trace.py``). Measured: docs/performance.md, "direct_out"
DIRECT_MIN = 8 << 20


#: ``copy_to_address``'s source: the byte count read from the target array, so one kernel serves every size
_COPY_ANY = _COPY_HOST.replace("NBYTES", "static_cast<size_t>(sink[1])")


@functools.lru_cache(maxsize=1)
def _copy_any_kernel():
    return _kernel("ortmlx_copy_any", ["src", "sink"], ["done"], _COPY_ANY)


def copy_to_address(a: mx.array, target: mx.array) -> mx.array:
    """``copy_to_host`` for any size, one kernel for all: ``target`` is [device address, byte count] (uint64), the
    count ``a.nbytes``; with tuning ``byte_copies`` ``a`` is read as its bytes (one instantiation for every type: no
    build at an InferenceSession's first result of a new type). Returns the one byte that orders the work."""
    if target.dtype != mx.uint64 or target.shape != (2,):
        raise ValueError(f"copy_to_address: target must be [address, bytes] as uint64, got {target.dtype} "
                         f"of shape {target.shape}")
    n = int(a.nbytes)
    if n == 0:
        raise ValueError("copy_to_address: an empty array")
    src = a.reshape(-1).view(mx.uint8) if byte_copies() and a.dtype != mx.uint8 else a
    return _host_write(_copy_any_kernel(), [src, target], *_copy_grid(n))


#: ``stage[0]`` is the device address of a page-locked buffer: its first 8 bytes the byte count, the bytes from
#: ``COPY_IN_HEADER`` on (16-byte aligned); ``limit`` (a broadcast, never read) has the output's size, so a count
#: the host wrote wrong cannot write past the output
_COPY_IN = r"""
    const uint8_t* base = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(stage[0]));
    const size_t want = static_cast<size_t>(*reinterpret_cast<const uint64_t*>(base));
    const size_t room = static_cast<size_t>(limit_shape[0]);
    const size_t nbytes = want < room ? want : room;
    const uint8_t* s = base + 16;
    uint8_t* d = reinterpret_cast<uint8_t*>(out);
    const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;
    size_t k0 = 0;
    if (((reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d)) & 15) == 0) {
        const size_t n16 = nbytes / 16;
        for (size_t k = i; k < n16; k += step) reinterpret_cast<uint4*>(d)[k] = reinterpret_cast<const uint4*>(s)[k];
        k0 = n16 * 16;
    }
    for (size_t k = k0 + i; k < nbytes; k += step) d[k] = s[k];
"""
#: bytes of a staging buffer before its payload (``copy_from_address``)
COPY_IN_HEADER = 16


@functools.lru_cache(maxsize=1)
def _copy_in_kernel():
    return _kernel("ortmlx_copy_in", ["stage", "limit"], ["out"], _COPY_IN, ensure_row_contiguous=False)


@functools.lru_cache(maxsize=1)
def _zero_byte() -> mx.array:
    return mx.array(0, mx.uint8)


#: ``take_rows``: ``mx.take(data, idx, A)`` for data of any rank and strides, the int32 or int64 positions (negative
#: ones counted from the end, as Gather's) clamped into [0, N) so an index a traced guard will reject reads no memory
#: outside the data. Output element i is (outer o, index r,
#: inner c) of [prod(shape[:A]), K, prod(shape[A+1:])]; o and c are unravelled through the data's own strides.
_TAKE_SOURCE = r"""
    const int nd = data_ndim;
    const int64_t n = data_shape[A];
    const int64_t k = idx_shape[0];
    int64_t inner = 1;
    for (int d = A + 1; d < nd; ++d) inner *= data_shape[d];
    int64_t outer = 1;
    for (int d = 0; d < A; ++d) outer *= data_shape[d];
    const int64_t total = outer * k * inner;
    const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total; i += step) {
        int64_t c = i % inner;
        const int64_t t = i / inner;
        int64_t o = t / k;
        int64_t j = static_cast<int64_t>(idx[(t - o * k) * idx_strides[0]]);
        j = j < 0 ? j + n : j;
        j = j < 0 ? 0 : (j >= n ? n - 1 : j);
        int64_t off = j * data_strides[A];
        for (int d = nd - 1; d > A; --d) {
            off += (c % data_shape[d]) * data_strides[d];
            c /= data_shape[d];
        }
        for (int d = A - 1; d >= 0; --d) {
            off += (o % data_shape[d]) * data_strides[d];
            o /= data_shape[d];
        }
        out[i] = data[off];
    }
"""
TAKE_THREADS, TAKE_BLOCKS = 256, 1024


@functools.lru_cache(maxsize=1)
def _take_kernel():
    return _kernel("ortmlx_take_rows", ["data", "idx"], ["out"], _TAKE_SOURCE, ensure_row_contiguous=False)


#: the data ``take_rows`` copies elements of (any plain type; 4-bit weights' bytes among them)
_TAKE_DTYPES = _ATTN_DTYPES + (mx.uint8, mx.int8, mx.uint16, mx.int16, mx.uint32, mx.int32)


def take_reason(data, idx, axis: int) -> str | None:
    """Why ``take_rows`` does not take ``mx.take(data, idx, axis)`` (None: it does)."""
    if not 0 <= axis < data.ndim or data.dtype not in _TAKE_DTYPES or data.size == 0 or data.size >= 2**31:
        return f"data {data.dtype} {data.shape} along axis {axis}"
    if idx.dtype not in (mx.int32, mx.int64) or idx.size == 0:
        return f"indices {idx.dtype} {idx.shape}"
    return None


def take_rows(data, idx, axis: int = 0):
    """``mx.take(data, idx, axis)`` (``take_reason`` None) as one kernel of ours, read through the data's strides, so
    a new host builds it beside the call's other kernels (MLX's own gather is a JIT kernel built alone at the first
    evaluation: ~2.6-3 s on a new H100 host). Indices in [-N, 0) count from the end; others outside [0, N) are
    clamped."""
    flat = idx.reshape(-1)
    shape = tuple(data.shape)
    total = flat.size * (data.size // shape[axis])
    blocks = max(1, min(TAKE_BLOCKS, -(-total // TAKE_THREADS)))
    (out,) = _take_kernel()(inputs=[data, flat], template=[("T", data.dtype), ("A", axis)],
                            grid=(blocks * TAKE_THREADS, 1, 1), threadgroup=(TAKE_THREADS, 1, 1),
                            output_shapes=[shape[:axis] + tuple(idx.shape) + shape[axis + 1:]],
                            output_dtypes=[data.dtype])
    return out


#: ``take_dequant_rows``: thread i makes element j of output row r (i = r * COLS + j): row p = idx[r] of the packed
#: data (negative counted from the end, then clamped, as ``take_rows``), its BITS-bit value j (low bits first), minus
#: the block's zero point (packed likewise, else 2^(BITS-1)), times the block's scale. (q - z) is exact in float and
#: its product with a float16 scale too, so one rounding to S gives MLX's half product bit for bit.
_DEQUANT_TAKE_SOURCE = r"""
    const int64_t total = static_cast<int64_t>(K) * COLS;
    const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total; i += step) {
        const int64_t r = i / COLS;
        const int64_t j = i - r * COLS;
        int64_t p = static_cast<int64_t>(idx[r]);
        p = p < 0 ? p + N : p;
        p = p < 0 ? 0 : (p >= N ? N - 1 : p);
        const int64_t blk = j / BLOCK;
        const int byte = data[p * ROW + (BITS == 4 ? j / 2 : j)];
        const int q = BITS == 4 ? ((byte >> (4 * (j & 1))) & 15) : byte;
        int z = 1 << (BITS - 1);
        if (HAS_ZP) {
            const int zb = zero_points[p * ZROW + (BITS == 4 ? blk / 2 : blk)];
            z = BITS == 4 ? ((zb >> (4 * (blk & 1))) & 15) : zb;
        }
        out[i] = static_cast<S>(static_cast<float>(q - z) * static_cast<float>(scales[p * KB + blk]));
    }
"""


@functools.lru_cache(maxsize=1)
def _dequant_take_kernel():
    return _kernel("ortmlx_take_dequant_rows", ["data", "scales", "zero_points", "idx"], ["out"], _DEQUANT_TAKE_SOURCE)


def take_dequant_reason(data, scales, zero_points, idx, block_size: int, bits: int) -> str | None:
    """Why ``take_dequant_rows`` does not make these rows (None: it does)."""
    if data.dtype != mx.uint8 or data.ndim != 2 or data.size == 0 or data.size >= 2**31 or bits not in (4, 8):
        return f"data {data.dtype} {data.shape} of {bits}-bit values"
    n, cols = data.shape[0], data.shape[1] * 8 // bits
    kb = -(-cols // block_size)
    if scales.dtype not in (mx.float16, mx.float32) or tuple(scales.shape) != (n, kb):
        return f"scales {scales.dtype} {scales.shape}"
    if zero_points is not None and (zero_points.dtype != mx.uint8 or
                                    tuple(zero_points.shape) != (n, -(-kb * bits // 8))):
        return f"zero_points {zero_points.dtype} {zero_points.shape}"
    if idx.dtype not in (mx.int32, mx.int64) or idx.size == 0 or idx.size * cols >= 2**31:
        return f"indices {idx.dtype} {idx.shape}"
    return None


def take_dequant_rows(data, scales, zero_points, idx, block_size: int, bits: int):
    """GatherBlockQuantized's rows in one kernel (``take_dequant_reason`` None): rows ``idx`` of ``data`` [N, packed]
    (gather axis 0, quantized along the last), each element (q - zp) * scale of its block, in the scales' type;
    (idx.size, columns). As ``contrib_quant.dequantize_gathered`` over ``take_rows``' rows, bit for bit."""
    flat = idx.reshape(-1)
    n, row = data.shape
    cols = row * 8 // bits
    kb = -(-cols // block_size)
    zp = zero_points if zero_points is not None else data       # (never read without zero points)
    total = flat.size * cols
    blocks = max(1, min(TAKE_BLOCKS, -(-total // TAKE_THREADS)))
    (out,) = _dequant_take_kernel()(
        inputs=[data, scales, zp, flat],
        template=[("S", scales.dtype), ("K", flat.size), ("COLS", cols), ("N", n), ("ROW", row), ("BITS", bits),
                  ("BLOCK", block_size), ("KB", kb), ("ZROW", zp.shape[-1]), ("HAS_ZP", zero_points is not None)],
        grid=(blocks * TAKE_THREADS, 1, 1), threadgroup=(TAKE_THREADS, 1, 1),
        output_shapes=[(flat.size, cols)], output_dtypes=[scales.dtype])
    return out


def take(data, idx, axis: int):
    """``mx.take(data, idx, axis)``: through ``take_rows`` where the build in progress asks for it (tuning
    ``take_rows``) and may use these kernels."""
    if build.take_rows() and enabled() and take_reason(data, idx, axis) is None:
        return take_rows(data, idx, axis)
    return mx.take(data, idx, axis=axis)


def prebuild_copies() -> None:
    """Start building the two copy kernels every GPU InferenceSession uses (uploads, large results) side by side, at
    the first one's start: built one after another, at its probes and its first large result, they added ~2 s each
    to a new host's first call (docs/performance.md)."""
    if usable() and not _PREBUILT:
        _PREBUILT.append(True)
        _copy_in_kernel().queue([("uint64", 0), ("uint8", 1)], ["uint8"])
        # the driver's self-test copies int32 (``devread``); with byte copies every result is uint8
        _copy_any_kernel().queue([("uint8" if byte_copies() else "int32", 1), ("uint64", 1)], ["uint8"])


_PREBUILT: list = []


@functools.lru_cache(maxsize=1)
def byte_copies() -> bool:
    """Tuning ``byte_copies`` (the environment's: the copies serve every InferenceSession of the process)."""
    from ..tuning import Tuning, TuningError
    try:
        return Tuning.from_env().byte_copies
    except TuningError:
        return False


def copy_from_address(stage: mx.array, nbytes: int) -> mx.array:
    """A new uint8 array of ``nbytes`` bytes read from page-locked host memory: ``stage`` (one uint64, made once
    per buffer and kept on the device: no call writes memory the kernel would fault in) is the buffer's device
    address; the buffer holds the byte count (``nbytes``, uint64) and, from ``COPY_IN_HEADER`` on, the bytes.
    One kernel for every size."""
    if stage.dtype != mx.uint64 or stage.size != 1:
        raise ValueError(f"copy_from_address: stage must be one uint64 address, got {stage.dtype} "
                         f"of shape {stage.shape}")
    if nbytes <= 0:
        raise ValueError("copy_from_address: an empty copy")
    limit = mx.broadcast_to(_zero_byte(), (nbytes,))
    grid, group = _copy_grid(nbytes)
    (out,) = _copy_in_kernel()(inputs=[stage, limit], grid=grid, threadgroup=group, output_shapes=[(nbytes,)],
                               output_dtypes=[mx.uint8])
    return out


def copy_to_host(a: mx.array, to_host: mx.array) -> mx.array:
    """Copy ``a``'s row-major bytes to page-locked host memory at the device address ``to_host`` holds
    (a one-element uint64 array; ``cuda_driver.HostBuffer``): one kernel, 16-byte stores when both ends
    are aligned. Returns one byte that only orders the work (evaluate it, then read the memory)."""
    _check_address(to_host, "copy_to_host")
    n = int(a.nbytes)
    if n == 0:
        raise ValueError("copy_to_host: an empty array")
    return _host_write(_copy_host_kernel(n), [a, to_host], *_copy_grid(n))
