"""Decode rows' products with what makes each row, in one custom CUDA kernel (MLX's CUDA backend).

A decode layer runs a norm kernel before its QKV and its gate/up products, and the MLP's gating kernel
before its down product: each a launch whose only reader is the next product. These kernels make the
row in shared memory first, rounded to the type exactly as those kernels round it, then multiply it by
a column-major weight (each output's K contiguous: ``dtypes.device_copies``), float32 sums rounded once:

- ``norm_gemv``: (Skip)SimplifiedLayerNormalization of the row (``cuda_kernels.rms_norm``'s sums in its
  order), then ``row @ W``; also the rounded sum of input, skip and bias (the next layer's residual).
  With ``gating``, W is an MLP's merged gate/up weight and each output is the SiLU gating of its gate and up
  sums (``cuda_kernels.swiglu``'s roundings): the gated row itself, half as wide as the product.
- ``gemv``: a copy of one row (that gated row), then ``row @ W`` (the down product).
- ``swiglu_gemv``: the SiLU gating of a merged gate/up row (``cuda_kernels.swiglu``), then ``row @ W`` (when
  the gate/up product did not make the gating: every block makes the whole gated row again).

Rows (up to ``ROWS_MAX``, as tuning ``batch_rows`` allows: a batch's decode rows) go ``RB`` to a block
(``rows_per_block``: as many as 32 KB of shared memory holds), which makes them all and multiplies each weight it
loads into every one of them, each row summed as a lone row is: a batch's row gets the bits that row gets alone.
Every block makes its rows (a few KB read from L2), so a product runs at most ``GRID_MAX`` blocks a row block that
take rounds of outputs; ``TPR`` threads split each output's K with 16-byte loads, and a thread's first weights are
loaded into registers before the rows are made (their latency overlaps their making).
Used only where ``row_reason`` is None, in a build that may use the custom kernels
(``cuda_kernels.enabled``). Measured on the H200: ``docs/performance.md`` (tuning keys ``fuse_rows``, ``gated_rows``).
"""
from __future__ import annotations

import functools
import math
import weakref

from . import build
from .cuda_kernels import NORM_THREADS, PRIOR_WAIT, _ATTN_DTYPES, _f32_literal, _kernel

#: most rows a product takes (a batch's decode rows, a short prompt's): a block makes RB of them and reads the
#: weight's outputs it takes once for those, so R rows read the weight ceil(R / RB) times; more go to MLX's GEMM
ROWS_MAX = 16
#: rows taken by default (tuning batch_rows unset): a batch of 4's step ran faster so, one of 16's no faster
#: than through MLX's GEMM (docs/performance.md)
ROWS_DEFAULT = 4
#: most bytes of the row a block keeps in shared memory (static shared memory is limited to 48 KB a block)
ROW_MAX_BYTES = 32 << 10
#: threads of a block: rms_norm's NORM_THREADS (the row's sum of squares is summed in its order)
THREADS = NORM_THREADS
#: most blocks of a product (four per SM of an H100/H200): each block makes the whole row, so more blocks
#: only repeat that work; fewer take several rounds of outputs
GRID_MAX = 528

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


#: before the row is made: each thread loads its first output's weights (CPT 16-byte chunks, registers), so
#: their latency overlaps the row's making. A GATED product's output n reads two weight columns, the gate's
#: and the up's (WC 2): the merged [gate | up] (or [up | gate]) weight of an MLP, N its width
_GEMV_HEAD = r"""
    constexpr int VEC = 16 / sizeof(T);
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * RB;
    const int nr = static_cast<int>(NR - r0 < RB ? NR - r0 : RB);
    out += r0 * N;
    constexpr int PER = THREADS / TPR;
    constexpr int CPT = (K / VEC + TPR - 1) / TPR;
    constexpr int WC = GATED ? 2 : 1;
    constexpr int64_t GOFF = GATED && !GATE_FIRST ? N : 0;
    constexpr int64_t UOFF = GATED && GATE_FIRST ? N : 0;
    const int tid = threadIdx.x;
    const int part = tid % TPR;
    const int64_t sk = w_strides[WND - 2];
    const int64_t sn = w_strides[WND - 1];
    // 16-byte loads: each output's K contiguous and 16-byte aligned (a column-major weight); else element loads
    const bool vec = sk == 1 && (K % VEC) == 0 &&
        ((reinterpret_cast<uintptr_t>(w) | static_cast<uintptr_t>(sn * sizeof(T))) % 16) == 0;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * PER;
    const int64_t step = static_cast<int64_t>(gridDim.x) * PER;
    int64_t n = first + tid / TPR;
    uint4 wr[WC][CPT > 0 ? CPT : 1];
    if (vec && n < N) {
        #pragma unroll
        for (int q = 0; q < WC; ++q) {
            const uint4* wv = reinterpret_cast<const uint4*>(w + (n + (q ? UOFF : GOFF)) * sn);
            #pragma unroll
            for (int c = 0; c < CPT; ++c)
                if (part + c * TPR < K / VEC) wr[q][c] = wv[part + c * TPR];
        }
    }
"""

#: after it: rounds of PER outputs a block (a grid of at most GRID_MAX blocks): out[n] = sum_k arow[k] * w[k, n],
#: float32 sums rounded once; TPR threads split output n's K, then reduce (shuffles, then warps). A GATED output
#: is the SiLU gating of its two rounded sums (swiglu's roundings, ``_GATING``)
_GEMV_ROUNDS = r"""
    __syncthreads();
    for (int64_t base = first; base < N; base += step, n += step) {
        if (vec && n < N && base != first) {
            #pragma unroll
            for (int q = 0; q < WC; ++q) {
                const uint4* wv = reinterpret_cast<const uint4*>(w + (n + (q ? UOFF : GOFF)) * sn);
                #pragma unroll
                for (int c = 0; c < CPT; ++c)
                    if (part + c * TPR < K / VEC) wr[q][c] = wv[part + c * TPR];
            }
        }
        // the block's rows one after another over the weights in registers (a row's sums at a time: few registers)
        #pragma unroll 1
        for (int i = 0; i < (RB == 1 ? 1 : nr); ++i) {     // (a lone row: no loop at all)
            const T* ai = arow + i * K;
            float acc[WC];
            #pragma unroll
            for (int q = 0; q < WC; ++q) acc[q] = 0.0f;
            if (n < N) {
                if (vec) {
                    const uint4* av = reinterpret_cast<const uint4*>(ai);
                    #pragma unroll
                    for (int c = 0; c < CPT; ++c) {
                        if (part + c * TPR < K / VEC) {
                            const uint4 aa = av[part + c * TPR];
                            const T* at = reinterpret_cast<const T*>(&aa);
                            #pragma unroll
                            for (int q = 0; q < WC; ++q) {
                                const T* wt = reinterpret_cast<const T*>(&wr[q][c]);
                                #pragma unroll
                                for (int j = 0; j < VEC; ++j)
                                    acc[q] += static_cast<float>(wt[j]) * static_cast<float>(at[j]);
                            }
                        }
                    }
                } else {
                    #pragma unroll
                    for (int q = 0; q < WC; ++q) {
                        const T* wn = w + (n + (q ? UOFF : GOFF)) * sn;
                        for (int k = part; k < K; k += TPR)
                            acc[q] += static_cast<float>(wn[k * sk]) * static_cast<float>(ai[k]);
                    }
                }
            }
            #pragma unroll
            for (int q = 0; q < WC; ++q) {
                #pragma unroll
                for (int off = 16; off > 0; off >>= 1) acc[q] += __shfl_xor_sync(0xffffffffu, acc[q], off);
            }
            if (TPR > 32) {
                __shared__ float red[WC][THREADS / 32];
                __syncthreads();
                if (tid % 32 == 0) {
                    #pragma unroll
                    for (int q = 0; q < WC; ++q) red[q][tid / 32] = acc[q];
                }
                __syncthreads();
                if (part == 0) {
                    #pragma unroll
                    for (int q = 0; q < WC; ++q) {
                        float t = 0.0f;
                        for (int j = 0; j < TPR / 32; ++j) t += red[q][tid / 32 + j];
                        acc[q] = t;
                    }
                }
            }
            if (n < N && part == 0) {
                if (GATED)
                    out[i * N + n] = gating(static_cast<float>(static_cast<T>(acc[0])),
                                            static_cast<float>(static_cast<T>(acc[WC - 1])));
                else
                    out[i * N + n] = static_cast<T>(acc[0]);
            }
        }
    }
"""

#: the SiLU gating of a gate value g and an up value u (floats of the type's values), rounded as
#: ``cuda_kernels.swiglu`` rounds: sigmoid(g), then g * sigmoid(g), then that times u
_GATING = r"""
    auto gating = [](float g, float u) -> T {
        const float e = 1.0f / (1.0f + expf(fabsf(g)));
        const T sg = static_cast<T>(g < 0.0f ? e : 1.0f - e);
        const T a = static_cast<T>(g * static_cast<float>(sg));
        return static_cast<T>(static_cast<float>(a) * u);
    };
"""

#: the row: s = x (+ skip) (+ bias) in float32, its sum of squares in rms_norm's order (THREADS is its
#: NORM_THREADS), loops unrolled so that a thread's loads are in flight together
_NORM_ROW = r"""
    __shared__ __align__(16) T arow[RB * K];
    __shared__ float nsum[RB][THREADS / 32];
    constexpr int PASSES = (K + THREADS - 1) / THREADS;
    const int64_t xs = x_strides[XND - 1];
    const int64_t ks = HAS_SKIP ? skip_strides[XND - 1] : 0;
    for (int r = 0; r < nr; ++r) {
        const T* xr = x + row_loc(r0 + r, x_shape, x_strides, XND);
        const T* kr = HAS_SKIP ? skip + row_loc(r0 + r, skip_shape, skip_strides, XND) : skip;
        T* sr = HAS_SKIP ? sum + (r0 + r) * K : sum;
        float t[PASSES];
        float ss = 0.0f;
        #pragma unroll
        for (int i = 0; i < PASSES; ++i) {
            const int j = tid + i * THREADS;
            if (j < K) {
                float v = static_cast<float>(xr[j * xs]);
                if (HAS_SKIP) v = v + static_cast<float>(kr[j * ks]);
                if (HAS_BIAS) v = v + static_cast<float>(bias[j]);
                t[i] = v;
            }
        }
        #pragma unroll
        for (int i = 0; i < PASSES; ++i)
            if (tid + i * THREADS < K) ss += t[i] * t[i];
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        if (tid % 32 == 0) nsum[r][tid / 32] = ss;
        __syncthreads();
        float tot = 0.0f;
        for (int q = 0; q < THREADS / 32; ++q) tot += nsum[r][q];
        const float normalizer = rsqrtf(tot / K + EPS);
        #pragma unroll
        for (int i = 0; i < PASSES; ++i) {
            const int j = tid + i * THREADS;
            if (j < K) {
                if (HAS_SKIP && blockIdx.x == 0) sr[j] = static_cast<T>(t[i]);
                arow[r * K + j] = static_cast<T>(static_cast<float>(gamma[j]) * (t[i] * normalizer));
            }
        }
    }
"""

#: the row: (g * sigmoid(g)) * u of y = [gate | up] (or [up | gate]) with swiglu's roundings; 16-byte loads
#: and stores when y's row is contiguous and aligned
_SWIGLU_ROW = r"""
    __shared__ __align__(16) T arow[RB * K];
    const int64_t ys = y_strides[YND - 1];
    for (int r = 0; r < nr; ++r) {
        const T* yr = y + row_loc(r0 + r, y_shape, y_strides, YND);
        const T* gp = yr + (GATE_FIRST_ROW ? 0 : K * ys);
        const T* up = yr + (GATE_FIRST_ROW ? K * ys : 0);
        T* ar = arow + r * K;
        if (ys == 1 && (K % VEC) == 0 && ((reinterpret_cast<uintptr_t>(gp) | reinterpret_cast<uintptr_t>(up)) % 16) == 0) {
            constexpr int CH = (K / VEC + THREADS - 1) / THREADS;
            uint4 gv[CH], uv[CH];
            #pragma unroll
            for (int i = 0; i < CH; ++i) {
                const int c = tid + i * THREADS;
                if (c < K / VEC) {
                    gv[i] = reinterpret_cast<const uint4*>(gp)[c];
                    uv[i] = reinterpret_cast<const uint4*>(up)[c];
                }
            }
            #pragma unroll
            for (int i = 0; i < CH; ++i) {
                const int c = tid + i * THREADS;
                if (c < K / VEC) {
                    const T* g8 = reinterpret_cast<const T*>(&gv[i]);
                    const T* u8 = reinterpret_cast<const T*>(&uv[i]);
                    uint4 o;
                    T* o8 = reinterpret_cast<T*>(&o);
                    #pragma unroll
                    for (int j = 0; j < VEC; ++j) o8[j] = gating(static_cast<float>(g8[j]), static_cast<float>(u8[j]));
                    reinterpret_cast<uint4*>(ar)[c] = o;
                }
            }
        } else {
            for (int j = tid; j < K; j += THREADS)
                ar[j] = gating(static_cast<float>(gp[j * ys]), static_cast<float>(up[j * ys]));
        }
    }
"""

#: the row: a copy of one row a (a decode row's gating made by the gate/up product: ``norm_gemv(gating=)``)
_COPY_ROW = r"""
    __shared__ __align__(16) T arow[RB * K];
    const int64_t as = a_strides[AND_ - 1];
    for (int r = 0; r < nr; ++r) {
        const T* ap = a + row_loc(r0 + r, a_shape, a_strides, AND_);
        T* ar = arow + r * K;
        if (as == 1 && (K % VEC) == 0 && (reinterpret_cast<uintptr_t>(ap) % 16) == 0) {
            for (int c = tid; c < K / VEC; c += THREADS)
                reinterpret_cast<uint4*>(ar)[c] = reinterpret_cast<const uint4*>(ap)[c];
        } else {
            for (int j = tid; j < K; j += THREADS) ar[j] = ap[j * as];
        }
    }
"""

#: where row r (blockIdx.y) of an array starts: r over its leading dims (all but the last), read through its strides
_ROW_LOC = r"""
    auto row_loc = [](int64_t r, const Shape& shape, const Strides& strides, int nd) -> int64_t {
        int64_t loc = 0;
        for (int d = nd - 2; d >= 0; --d) {
            loc += (r % shape[d]) * strides[d];
            r /= shape[d];
        }
        return loc;
    };
"""

# (the weights' first loads come before the wait for the kernel before: they read constants only)
NORM_SOURCE = _ROW_LOC + _GATING + _GEMV_HEAD + PRIOR_WAIT + _NORM_ROW + _GEMV_ROUNDS
SWIGLU_SOURCE = _ROW_LOC + _GATING + _GEMV_HEAD + PRIOR_WAIT + _SWIGLU_ROW + _GEMV_ROUNDS
ROW_SOURCE = _ROW_LOC + _GATING + _GEMV_HEAD + PRIOR_WAIT + _COPY_ROW + _GEMV_ROUNDS


@functools.lru_cache(maxsize=64)
def _norm_kernel(eps: float):
    head = f"constexpr float EPS = {_f32_literal(eps)};\n"
    return _kernel("ortmlx_norm_gemv", ["x", "skip", "bias", "gamma", "w"], ["out", "sum"], NORM_SOURCE, head,
                   ensure_row_contiguous=False)


@functools.lru_cache(maxsize=1)
def _swiglu_kernel():
    return _kernel("ortmlx_swiglu_gemv", ["y", "w"], ["out"], SWIGLU_SOURCE, ensure_row_contiguous=False)


@functools.lru_cache(maxsize=1)
def _row_kernel():
    return _kernel("ortmlx_row_gemv", ["a", "w"], ["out"], ROW_SOURCE, ensure_row_contiguous=False)


def threads_per_output(k: int, vec: int) -> int:
    """Threads splitting one output's K: from a warp up to a block, about eight 16-byte loads each (all in
    registers at once: ``CPT`` of the kernel)."""
    tpr, chunks = 32, -(-k // vec)
    while tpr < THREADS and chunks > 8 * tpr:
        tpr *= 2
    return tpr


def grid_blocks(n: int, tpr: int) -> int:
    """Blocks of a product of ``n`` outputs: at most ``GRID_MAX`` (each makes the row once, then takes rounds
    of THREADS / tpr outputs), the rounds spread evenly."""
    groups = -(-n // (THREADS // tpr))
    rounds = -(-groups // GRID_MAX)
    return -(-groups // rounds)


def row_reason(a, w, k: int) -> str | None:
    """Why ``a`` (the rows' source: its last dim; at most the build's ``row_limit`` rows) times ``w`` (a registered
    column-major [K, N] or [1, K, N] weight of a's type) is not a case of these kernels (None: it is)."""
    if not col_major(w):
        return "not a column-major weight"
    if a.dtype != w.dtype or a.dtype not in _ATTN_DTYPES or w.ndim not in (2, 3) or (w.ndim == 3 and w.shape[0] != 1):
        return f"row {a.dtype} {a.shape}, weight {w.dtype} {w.shape}"
    if a.ndim < 1 or w.shape[-2] != k:
        return f"row {a.shape} for weight {w.shape}"
    limit = build.row_limit()
    if not 0 < _rows(a.shape) <= limit:
        return f"{_rows(a.shape)} rows {a.shape}: not 1 to {limit} (tuning batch_rows)"
    if k * a.dtype.size > ROW_MAX_BYTES or w.size >= 2**31 or w.size == 0:
        return f"size K {k}, weight {w.shape}"
    return None


def _rows(shape) -> int:
    return math.prod(shape[:-1])


def rows_per_block(rows: int, k: int, size: int) -> int:
    """Rows a block makes and multiplies (``RB``): as many as its shared memory holds (``ROW_MAX_BYTES``), so a
    weight is read once for them all; each row's sums are a lone row's, in its order."""
    return max(1, min(rows, ROW_MAX_BYTES // (k * size)))


def _launch(kernel, inputs, template, k: int, n: int, dtype, row_shape, extra_shapes=(), gating=None):
    """One product kernel's call: ``n`` outputs of each K-long row (``gating`` (width, gate_first): ``n`` gated
    outputs of a [K, 2n] merged weight); grid row y takes rows [y * RB, (y + 1) * RB), each computed as a lone
    row is."""
    tpr = threads_per_output(k, 16 // dtype.size)
    rows = _rows(row_shape)
    rb = rows_per_block(rows, k, dtype.size)
    gate = [("GATED", gating is not None), ("GATE_FIRST", bool(gating[1]) if gating else True)]
    return kernel(inputs=inputs, template=template + gate + [("K", k), ("N", n), ("TPR", tpr), ("THREADS", THREADS),
                                                             ("RB", rb), ("NR", rows)],
                  grid=(grid_blocks(n, tpr) * THREADS, -(-rows // rb), 1), threadgroup=(THREADS, 1, 1),
                  output_shapes=[tuple(row_shape[:-1]) + (n,), *extra_shapes],
                  output_dtypes=[dtype] * (1 + len(extra_shapes)))


def norm_gemv(x, gamma, epsilon: float, w, skip=None, bias=None, gating=None):
    """(row @ w, sum) with row = ``cuda_kernels.rms_norm(x, gamma, epsilon, skip, bias)[0]`` of each row of x
    (``row_reason(x, w, K)`` is None; gamma and bias contiguous [K]); ``sum`` as rms_norm's (None without skip).
    ``gating`` (width, gate_first): w is an MLP's merged gate/up weight [K, 2 * width] and the product is its
    gating, ``cuda_kernels.swiglu(row @ w, width, gate_first)``, bit for bit (each sum rounded, then gated)."""
    k = x.shape[-1]
    n = w.shape[-1]
    if gating is not None:
        if n != 2 * gating[0]:
            raise ValueError(f"merged gate/up weight {w.shape} for width {gating[0]}")
        n = gating[0]
    out, total = _launch(_norm_kernel(float(epsilon)),
                         [x, x if skip is None else skip, gamma if bias is None else bias, gamma, w],
                         [("T", x.dtype), ("HAS_SKIP", skip is not None), ("HAS_BIAS", bias is not None),
                          ("XND", x.ndim), ("WND", w.ndim)],
                         k, n, x.dtype, x.shape, [x.shape if skip is not None else (1,)], gating)
    return out, (total if skip is not None else None)


def swiglu_gemv(y, w, width: int, gate_first: bool = True):
    """``cuda_kernels.swiglu(y, width, gate_first) @ w`` for each merged gate/up row of y [..., 2 * width]
    (``row_reason(y, w, width)`` is None)."""
    if y.shape[-1] != 2 * width:
        raise ValueError(f"merged row {y.shape} for width {width}")
    (out,) = _launch(_swiglu_kernel(), [y, w], [("T", y.dtype), ("GATE_FIRST_ROW", bool(gate_first)),
                                               ("YND", y.ndim), ("WND", w.ndim)], width, w.shape[-1], y.dtype, y.shape)
    return out


def gemv(a, w):
    """``a @ w`` for each row of a [..., K] (``row_reason(a, w, K)`` is None): float32 sums rounded once."""
    k = a.shape[-1]
    (out,) = _launch(_row_kernel(), [a, w], [("T", a.dtype), ("AND_", a.ndim), ("WND", w.ndim)],
                     k, w.shape[-1], a.dtype, a.shape)
    return out
