"""One decode row's product with what makes the row, in one custom CUDA kernel (MLX's CUDA backend).

A decode layer runs a norm kernel before its QKV and its gate/up products, and the MLP's gating kernel
before its down product: each a launch whose only reader is the next product. These kernels make the
row in shared memory first, rounded to the type exactly as those kernels round it, then multiply it by
a column-major weight (each output's K contiguous: ``dtypes.device_copies``), float32 sums rounded once:

- ``norm_gemv``: (Skip)SimplifiedLayerNormalization of the row (``cuda_kernels.rms_norm``'s sums in its
  order), then ``row @ W``; also the rounded sum of input, skip and bias (the next layer's residual).
- ``swiglu_gemv``: the SiLU gating of a merged gate/up row (``cuda_kernels.swiglu``), then ``row @ W``.

Every block makes the whole row (a few KB read from L2) and takes several outputs; ``TPR`` threads
split each output's K with 16-byte loads. Used only where ``row_reason`` is None, in a build that may
use the custom kernels (``cuda_kernels.enabled``).
"""
from __future__ import annotations

import functools
import weakref


from .cuda_kernels import NORM_THREADS, _ATTN_DTYPES, _f32_literal, _kernel

#: most bytes of the row a block keeps in shared memory (static shared memory is limited to 48 KB a block)
ROW_MAX_BYTES = 32 << 10
#: blocks worth filling the GPU with before a block takes more outputs (two per SM of an H100/H200)
TARGET_BLOCKS = 264

#: weights stored column-major by ``dtypes.device_copies`` (``register_col_major``): id -> weak reference
_COL_MAJOR: dict[int, weakref.ref] = {}


def register_col_major(arrays) -> None:
    """Weights ``dtypes.device_copies`` made column-major: products with them may take these kernels."""
    for a in arrays:
        k = id(a)
        _COL_MAJOR[k] = weakref.ref(a, lambda r, k=k: _COL_MAJOR.pop(k, None) if _COL_MAJOR.get(k) is r else None)


def col_major(w) -> bool:
    """Whether ``w`` is a weight ``register_col_major`` was given (and still alive)."""
    r = _COL_MAJOR.get(id(w))
    return r is not None and r() is w


_GEMV_TAIL = r"""
    __syncthreads();
    // out[n] = sum_k arow[k] * w[k, n]: TPR threads split output n's K, then reduce (shuffles, then warps)
    constexpr int VEC = 16 / sizeof(T);
    const int64_t sk = w_strides[WND - 2];
    const int64_t sn = w_strides[WND - 1];
    const int part = tid % TPR;
    const int64_t n = static_cast<int64_t>(blockIdx.x) * (THREADS / TPR) + tid / TPR;
    float acc = 0.0f;
    if (n < N) {
        const T* wn = w + n * sn;
        if (sk == 1 && (K % VEC) == 0 && (reinterpret_cast<uintptr_t>(wn) % 16) == 0) {
            const uint4* wv = reinterpret_cast<const uint4*>(wn);
            const uint4* av = reinterpret_cast<const uint4*>(arow);
            #pragma unroll 4
            for (int c = part; c < K / VEC; c += TPR) {
                const uint4 wa = wv[c];
                const uint4 aa = av[c];
                const T* wt = reinterpret_cast<const T*>(&wa);
                const T* at = reinterpret_cast<const T*>(&aa);
                #pragma unroll
                for (int j = 0; j < VEC; ++j) acc += static_cast<float>(wt[j]) * static_cast<float>(at[j]);
            }
        } else {
            for (int k = part; k < K; k += TPR) acc += static_cast<float>(wn[k * sk]) * static_cast<float>(arow[k]);
        }
    }
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (TPR > 32) {
        __shared__ float red[THREADS / 32];
        if (tid % 32 == 0) red[tid / 32] = acc;
        __syncthreads();
        if (part == 0) {
            float t = 0.0f;
            for (int j = 0; j < TPR / 32; ++j) t += red[tid / 32 + j];
            acc = t;
        }
    }
    if (n < N && part == 0) out[n] = static_cast<T>(acc);
"""

_NORM_ROW = r"""
    // the row: s = x (+ skip) (+ bias) in float32; its sum of squares over NORM_T threads in rms_norm's order
    __shared__ __align__(16) T arow[K];
    __shared__ float nsum[NORM_T / 32];
    const int tid = threadIdx.x;
    const int64_t xs = x_strides[XND - 1];
    const int64_t ks = HAS_SKIP ? skip_strides[XND - 1] : 0;
    float ss = 0.0f;
    if (tid < NORM_T) {
        for (int j = tid; j < K; j += NORM_T) {
            float t = static_cast<float>(x[j * xs]);
            if (HAS_SKIP) t = t + static_cast<float>(skip[j * ks]);
            if (HAS_BIAS) t = t + static_cast<float>(bias[j]);
            ss += t * t;
        }
    }
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (tid < NORM_T && tid % 32 == 0) nsum[tid / 32] = ss;
    __syncthreads();
    float tot = 0.0f;
    for (int w = 0; w < NORM_T / 32; ++w) tot += nsum[w];
    const float normalizer = rsqrtf(tot / K + EPS);
    for (int j = tid; j < K; j += THREADS) {
        float t = static_cast<float>(x[j * xs]);
        if (HAS_SKIP) t = t + static_cast<float>(skip[j * ks]);
        if (HAS_BIAS) t = t + static_cast<float>(bias[j]);
        if (HAS_SKIP && blockIdx.x == 0) sum[j] = static_cast<T>(t);
        const float g = static_cast<float>(gamma[j]);
        arow[j] = static_cast<T>(g * (t * normalizer));
    }
"""

_SWIGLU_ROW = r"""
    // the row: (g * sigmoid(g)) * u of y = [gate | up] (or [up | gate]) with swiglu's roundings
    __shared__ __align__(16) T arow[K];
    const int tid = threadIdx.x;
    const int64_t ys = y_strides[YND - 1];
    for (int j = tid; j < K; j += THREADS) {
        const float g = static_cast<float>(y[(GATE_FIRST ? j : K + j) * ys]);
        const float u = static_cast<float>(y[(GATE_FIRST ? K + j : j) * ys]);
        const float e = 1.0f / (1.0f + expf(fabsf(g)));
        const T sg = static_cast<T>(g < 0.0f ? e : 1.0f - e);
        const T a = static_cast<T>(g * static_cast<float>(sg));
        arow[j] = static_cast<T>(static_cast<float>(a) * u);
    }
"""

NORM_SOURCE = _NORM_ROW + _GEMV_TAIL
SWIGLU_SOURCE = _SWIGLU_ROW + _GEMV_TAIL


@functools.lru_cache(maxsize=64)
def _norm_kernel(eps: float):
    head = f"constexpr float EPS = {_f32_literal(eps)};\nconstexpr int NORM_T = {NORM_THREADS};\n"
    return _kernel("ortmlx_norm_gemv", ["x", "skip", "bias", "gamma", "w"], ["out", "sum"], NORM_SOURCE, head,
                   ensure_row_contiguous=False)


@functools.lru_cache(maxsize=1)
def _swiglu_kernel():
    return _kernel("ortmlx_swiglu_gemv", ["y", "w"], ["out"], SWIGLU_SOURCE, ensure_row_contiguous=False)


def threads_per_output(k: int, vec: int) -> int:
    """Threads splitting one output's K: from a warp up to NORM_THREADS, about four 16-byte loads each."""
    tpr, chunks = 32, -(-k // vec)
    while tpr < NORM_THREADS and chunks > 4 * tpr:
        tpr *= 2
    return tpr


def block_threads(n: int, tpr: int) -> int:
    """Threads of a block: NORM_THREADS, or up to 1024 (more outputs a block, fewer rows made) while the
    product still has ``TARGET_BLOCKS`` blocks."""
    threads = NORM_THREADS
    while threads < 1024 and -(-n // (2 * threads // tpr)) >= TARGET_BLOCKS:
        threads *= 2
    return threads


def row_reason(a, w, k: int) -> str | None:
    """Why ``a`` (the row's source: every dim but the last 1) times ``w`` (a registered column-major [K, N] or
    [1, K, N] weight of a's type) is not a case of these kernels (None: it is)."""
    if not col_major(w):
        return "not a column-major weight"
    if a.dtype != w.dtype or a.dtype not in _ATTN_DTYPES or w.ndim not in (2, 3) or (w.ndim == 3 and w.shape[0] != 1):
        return f"row {a.dtype} {a.shape}, weight {w.dtype} {w.shape}"
    if a.ndim < 1 or any(d != 1 for d in a.shape[:-1]) or w.shape[-2] != k:
        return f"row {a.shape} for weight {w.shape}"
    if k * a.dtype.size > ROW_MAX_BYTES or w.size >= 2**31 or w.size == 0:
        return f"size K {k}, weight {w.shape}"
    return None


def _launch(kernel, inputs, template, k: int, n: int, dtype, row_shape, extra_shapes=()):
    tpr = threads_per_output(k, 16 // dtype.size)
    threads = block_threads(n, tpr)
    blocks = -(-n // (threads // tpr))
    return kernel(inputs=inputs, template=template + [("K", k), ("N", n), ("TPR", tpr), ("THREADS", threads)],
                  grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
                  output_shapes=[tuple(row_shape[:-1]) + (n,), *extra_shapes],
                  output_dtypes=[dtype] * (1 + len(extra_shapes)))


def norm_gemv(x, gamma, epsilon: float, w, skip=None, bias=None):
    """(row @ w, sum) with row = ``cuda_kernels.rms_norm(x, gamma, epsilon, skip, bias)[0]`` of one row x
    (``row_reason(x, w, K)`` is None; gamma and bias contiguous [K]); ``sum`` as rms_norm's (None without skip)."""
    k = x.shape[-1]
    out, total = _launch(_norm_kernel(float(epsilon)),
                         [x, x if skip is None else skip, gamma if bias is None else bias, gamma, w],
                         [("T", x.dtype), ("HAS_SKIP", skip is not None), ("HAS_BIAS", bias is not None),
                          ("XND", x.ndim), ("WND", w.ndim)],
                         k, w.shape[-1], x.dtype, x.shape, [x.shape if skip is not None else (1,)])
    return out, (total if skip is not None else None)


def swiglu_gemv(y, w, width: int, gate_first: bool = True):
    """``cuda_kernels.swiglu(y, width, gate_first) @ w`` for one merged gate/up row y [..., 2 * width]
    (``row_reason(y, w, width)`` is None)."""
    if y.shape[-1] != 2 * width:
        raise ValueError(f"merged row {y.shape} for width {width}")
    (out,) = _launch(_swiglu_kernel(), [y, w], [("T", y.dtype), ("GATE_FIRST", bool(gate_first)), ("YND", y.ndim),
                                               ("WND", w.ndim)], width, w.shape[-1], y.dtype, y.shape)
    return out
