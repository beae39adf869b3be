"""An LSTM, GRU or RNN layer's whole recurrence as one custom CUDA kernel (MLX's CUDA backend).

Unrolled in MLX ops (``ops/recurrent.py``) a time step is a product of the state with R (a cuBLAS call: 12-25 us
of host time to launch) and the gates' fused kernel; a 200-step bidirectional layer is hundreds of launches for
microseconds of arithmetic. Here one launch runs every step of every direction:

    LSTM: g = xw_t + h R^T;  c = sigmoid(g_f) c + sigmoid(g_i) tanh(g_c);  h = sigmoid(g_o) tanh(c)
    GRU (linear_before_reset): z, r = sigmoid(xw_z + h R_z^T), sigmoid(xw_r + h R_r^T);
                               h~ = tanh(xw_h + r (h R_h^T + Rb_h));  h = (1 - z) h~ + z h
    GRU (the reset gate first, ``gru_early``): the same z and r;  h~ = tanh(xw_h + (r h) R_h^T)
    RNN: h = tanh(xw_t + h R^T)

with ``xw_t = x_t W^T + Wb (+ Rb)`` made for all steps by one product beforehand (``clip`` clamps each activation's
input, as the ops do). A direction's hidden units are split over ``blocks``; each step every block reads the whole
previous state (from L2), computes its units' gates (a warp a unit, ``BATCH_TILE`` batch rows at a time, the sums in
float32), writes its part of the new state, and meets its direction's other blocks at a barrier (a counter in global
memory; a ``gru_early`` step meets them twice: every unit's r h before the product with R_h). So all of a direction's
blocks must be resident at once: at most ``BLOCKS_MAX`` small blocks a direction and one a multiprocessor in all,
which the GPU holds beside other work; a barrier not met within ``BARRIER_TIMEOUT_NS`` traps (the call fails; it
never hangs). Measured: docs/general_models.md.
"""
from __future__ import annotations

import functools

import mlx.core as mx

from . import consts
from .cuda_kernels import _f32_literal, _kernel

#: blocks a direction is split over at most (all of them wait for each other every step)
BLOCKS_MAX = 32
#: multiprocessors assumed where the driver does not say (the blocks of a launch are at most this many)
RESIDENT_UNKNOWN = 8
#: hidden units a block takes at least (fewer blocks for small layers: a barrier costs the same)
UNITS_MIN = 8
#: warps a block
WARPS = 8
#: batch rows a warp takes at once (each weight it loads serves them all)
BATCH_TILE = 8
#: most floats of the state (batch x hidden) a block keeps in shared memory
STATE_MAX = 8192
#: a barrier not met in this long traps: a grid that cannot be resident would otherwise spin forever (long enough
#: for any time slice another process takes the GPU for)
BARRIER_TIMEOUT_NS = 30_000_000_000
#: uint32s between the directions' barrier counts: a line of their own each, and an array over 8 bytes (MLX puts
#: those in host-visible managed memory, where each atomic took ~60 us: a step's barrier ~125 us on an H100)
SYNC_STRIDE = 32
#: gates a cell computes per hidden unit
GATES = {"lstm": 4, "gru": 3, "gru_early": 3, "rnn": 1}
#: the kernel's CELL value per cell (``gru``: linear_before_reset, ``gru_early``: the reset gate before R_h)
CELLS = {"lstm": 0, "gru": 1, "gru_early": 2, "rnn": 3}

SOURCE = r"""
    // grid: (NB blocks, D directions); xw [T, D, B, G*H] (x W^T + biases), r [D, G*H, H], h0/c0 [D, B, H],
    // rbh [D, H] (CELL_GRU), lens [B]; y [T, D, B, H]; st [4, D, B, H]: h after even / odd steps, c (CELL_LSTM)
    // or z (CELL_GRU_EARLY), r * h (CELL_GRU_EARLY); sync [D * SYNC_STRIDE]: the directions' barrier counts.
    // A warp takes a unit j for BT batch rows at a time; lane l finishes row b0 + l (the same thread every step).
    const int T = xw_shape[0];
    const int B = xw_shape[2];
    const int d = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int u0 = blockIdx.x * UNITS;
    const int nunits = min(UNITS, H - u0);
    const bool rev = (d == 1) || REV0;
    const size_t dbh = static_cast<size_t>(D) * B * H;
    const size_t off = static_cast<size_t>(d) * B * H;
    float* const cst = st + 2 * dbh + off;
    float* const rhx = st + 3 * dbh + off;
    const float* const R = r + static_cast<size_t>(d) * G * H * H;
    constexpr int G1 = CELL == CELL_GRU_EARLY ? 2 : G;
    unsigned met = 0;
    __shared__ float hs[STATE_MAX];
    for (int k = 0; k < T; ++k) {
        const int t = rev ? T - 1 - k : k;
        const float* hsrc = (k == 0 ? h0 : st + (k & 1) * dbh) + off;
        float* const hdst = st + ((k + 1) & 1) * dbh + off;
        const float* const xt = xw + (static_cast<size_t>(t) * D + d) * B * (G * H);
        float* const yt = y + (static_cast<size_t>(t) * D + d) * B * H;
        for (int i = threadIdx.x; i < B * H; i += blockDim.x) hs[i] = __ldcg(hsrc + i);
        __syncthreads();
        for (int u = warp; u < nunits; u += WARPS) {
            const int j = u0 + u;
            for (int b0 = 0; b0 < B; b0 += BT) {
                const int rows = min(BT, B - b0);
                float a[4];                     // G1 <= 4: every cell's branch indexes in bounds
                dots<G1, H, BT>(R, j, hs, b0, rows, lane, a);
                if (lane >= rows) continue;
                const int b = b0 + lane;
                const float* x = xt + static_cast<size_t>(b) * (G * H);
                const size_t o = static_cast<size_t>(b) * H + j;
                const float hp = hs[o];
                const bool live = !HAS_LENS || t < lens[b];
                float hn = hp;
                if (CELL == CELL_LSTM) {
                    const float cp = k == 0 ? c0[off + o] : cst[o];
                    float cn = cp;
                    if (live) {
                        const float gi = sigm(gate_in(x[j] + a[0]));
                        const float go = sigm(gate_in(x[H + j] + a[1]));
                        const float gf = sigm(gate_in(x[2 * H + j] + a[2]));
                        const float gc = tanhf(gate_in(x[3 * H + j] + a[3]));
                        cn = gf * cp + gi * gc;
                        hn = go * tanhf(cn);
                    }
                    cst[o] = cn;
                } else if (CELL == CELL_RNN) {
                    if (live) hn = tanhf(gate_in(x[j] + a[0]));
                } else if (CELL == CELL_GRU) {
                    if (live) {
                        const float z = sigm(gate_in(x[j] + a[0]));
                        const float rr = sigm(gate_in(x[H + j] + a[1]));
                        const float hh = tanhf(gate_in(x[2 * H + j] + rr * (a[G1 - 1] + rbh[d * H + j])));
                        hn = (1.0f - z) * hh + z * hp;
                    }
                } else {
                    // the reset gate scales h before its product with R_h: first every unit's r * h
                    cst[o] = sigm(gate_in(x[j] + a[0]));
                    rhx[o] = sigm(gate_in(x[H + j] + a[1])) * hp;
                }
                if (CELL != CELL_GRU_EARLY) {
                    yt[o] = live ? hn : 0.0f;
                    hdst[o] = hn;
                }
            }
        }
        if (CELL == CELL_GRU_EARLY) {
            meet(sync + d * SYNC_STRIDE, ++met * gridDim.x);
            for (int i = threadIdx.x; i < B * H; i += blockDim.x) hs[i] = __ldcg(rhx + i);
            __syncthreads();
            for (int u = warp; u < nunits; u += WARPS) {
                const int j = u0 + u;
                for (int b0 = 0; b0 < B; b0 += BT) {
                    const int rows = min(BT, B - b0);
                    float a[1];
                    dots<1, H, BT>(R + static_cast<size_t>(2) * H * H, j, hs, b0, rows, lane, a);
                    if (lane >= rows) continue;
                    const int b = b0 + lane;
                    const size_t o = static_cast<size_t>(b) * H + j;
                    const float hp = __ldcg(hsrc + o);
                    const bool live = !HAS_LENS || t < lens[b];
                    float hn = hp;
                    if (live) {
                        const float z = cst[o];
                        hn = (1.0f - z) * tanhf(gate_in(xt[static_cast<size_t>(b) * (G * H) + 2 * H + j] + a[0]))
                            + z * hp;
                    }
                    yt[o] = live ? hn : 0.0f;
                    hdst[o] = hn;
                }
            }
        }
        // the direction's blocks meet: every block's part of this step's state written before any reads it
        meet(sync + d * SYNC_STRIDE, ++met * gridDim.x);
    }
"""

_HEADER = r"""
constexpr int CELL_LSTM = 0, CELL_GRU = 1, CELL_GRU_EARLY = 2, CELL_RNN = 3;
__device__ __forceinline__ float sigm(float v) { return 1.0f / (1.0f + expf(-v)); }
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// out[g] = R[g * H + j, :] . h[b0 + lane, :] for lane < rows (a warp: lanes stride over H, each weight loaded once
// for the BT rows; a butterfly sum gives every lane every row's sums, and lane l keeps row l's)
template <int NG, int H, int BT>
__device__ __forceinline__ void dots(const float* R, int j, const float* h, int b0, int rows, int lane, float* out) {
    float acc[BT][NG];
    #pragma unroll
    for (int b = 0; b < BT; ++b) {
        #pragma unroll
        for (int g = 0; g < NG; ++g) acc[b][g] = 0.0f;
    }
    for (int i = lane; i < H; i += 32) {
        float w[NG];
        #pragma unroll
        for (int g = 0; g < NG; ++g) w[g] = __ldg(R + (static_cast<size_t>(g) * H + j) * H + i);
        #pragma unroll
        for (int b = 0; b < BT; ++b) {
            if (b < rows) {
                const float hv = h[(b0 + b) * H + i];
                #pragma unroll
                for (int g = 0; g < NG; ++g) acc[b][g] = fmaf(w[g], hv, acc[b][g]);
            }
        }
    }
    #pragma unroll
    for (int g = 0; g < NG; ++g) out[g] = 0.0f;
    #pragma unroll
    for (int b = 0; b < BT; ++b) {
        if (b < rows) {
            #pragma unroll
            for (int g = 0; g < NG; ++g) {
                float v = acc[b][g];
                #pragma unroll
                for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                if (lane == b) out[g] = v;
            }
        }
    }
}
// a barrier of the direction's blocks: the count reaches target once every block has arrived this many times
__device__ __forceinline__ void meet(unsigned* count, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1u);
        unsigned n = 0;
        unsigned long long start = 0;
        while (load_acquire(count) < target) {
            if ((++n & 1023u) == 0) {
                const unsigned long long now = now_ns();
                if (start == 0) start = now;
                else if (now - start > TIMEOUT_NS) __trap();
            }
        }
        __threadfence();
    }
    __syncthreads();
}
"""


def header(clip: float | None) -> str:
    """The kernel's header: the barrier's time limit and ``gate_in`` (the activations' input, clamped to ``clip``)."""
    head = f"constexpr unsigned long long TIMEOUT_NS = {BARRIER_TIMEOUT_NS}ull;\n" + _HEADER
    if clip is None:
        return head + "__device__ __forceinline__ float gate_in(float v) { return v; }\n"
    c = _f32_literal(clip)
    return head + f"__device__ __forceinline__ float gate_in(float v) {{ return fminf(fmaxf(v, -{c}), {c}); }}\n"


INPUTS = ["xw", "r", "h0", "c0", "rbh", "lens"]
OUTPUTS = ["y", "st", "sync"]


@functools.lru_cache(maxsize=16)
def _kernel_for(clip: float | None):
    return _kernel("ortmlx_recurrence", INPUTS, OUTPUTS, SOURCE, header(clip))


@functools.lru_cache(maxsize=1)
def multiprocessors() -> int:
    """The GPU's streaming multiprocessors (``RESIDENT_UNKNOWN`` where the driver does not say)."""
    from . import cuda_driver
    try:
        drv = cuda_driver.driver()
        return drv.multiprocessors() if drv is not None else RESIDENT_UNKNOWN
    except cuda_driver.DriverError:
        return RESIDENT_UNKNOWN


def blocks(hidden: int, most: int = BLOCKS_MAX) -> tuple[int, int]:
    """(blocks a direction, hidden units a block) for a layer of ``hidden`` units, at most ``most`` blocks."""
    nb = max(1, min(most, hidden // UNITS_MIN))
    units = -(-hidden // nb)
    return -(-hidden // units), units


def reason(cell: str, x, r, batch: int, clip) -> str | None:
    """Why ``recurrence`` does not take this layer (None: it does). ``x``: the layer's input, ``r``: R."""
    if cell not in GATES:
        return f"cell {cell}"
    if x.dtype != mx.float32 or r.dtype != mx.float32:
        return f"dtypes {x.dtype} / {r.dtype}"
    hidden = r.shape[-1]
    if batch * hidden > STATE_MAX or batch == 0 or hidden == 0:
        return f"batch {batch} x hidden {hidden} (at most {STATE_MAX} state values)"
    if clip is not None and not (0 < float(clip) < float("inf")):
        return f"clip {clip}"
    return None


def template(cell: str, hidden: int, dirs: int, units: int, reverse_first: bool, has_lens: bool) -> list:
    """The kernel's template values for one layer form (``units`` hidden units a block: ``blocks``)."""
    return [("G", GATES[cell]), ("H", hidden), ("D", dirs), ("UNITS", units), ("WARPS", WARPS),
            ("STATE_MAX", STATE_MAX), ("REV0", bool(reverse_first)), ("HAS_LENS", bool(has_lens)),
            ("CELL", CELLS[cell]), ("SYNC_STRIDE", SYNC_STRIDE), ("BT", BATCH_TILE)]


def recurrence(cell: str, xw, r, h0, c0, rbh, lens, *, reverse_first: bool = False, clip: float | None = None):
    """All steps of a layer: (Y [T, D, B, H], Y_h [D, B, H], Y_c [D, B, H] or None for a GRU).

    ``xw`` [T, D, B, G*H]: the input's product with W plus every bias the gates add directly (a ``gru`` cell's
    h-gate recurrent bias goes as ``rbh`` [D, H]); ``r`` [D, G*H, H]; ``h0``, ``c0`` [D, B, H] (c0: LSTM only);
    ``lens`` [B] int32 or None: a row's steps at times >= its length carry its state and give zeros;
    direction 1 runs backwards in time, and direction 0 too with ``reverse_first``."""
    t, d, b, gh = xw.shape
    h = r.shape[-1]
    # one block a multiprocessor at most: the barrier needs every block resident at once, beside other work
    nb, units = blocks(h, max(1, min(BLOCKS_MAX, multiprocessors() // d)))
    threads = 32 * WARPS
    f32 = mx.float32
    y, st, _ = _kernel_for(None if clip is None else float(clip))(
        inputs=[xw, r, h0, c0 if c0 is not None else h0, rbh if rbh is not None else consts.zeros((1,), f32),
                lens if lens is not None else consts.zeros((1,), mx.int32)],
        template=template(cell, h, d, units, reverse_first, lens is not None),
        grid=(nb * threads, d, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(t, d, b, h), (4, d, b, h), (d * SYNC_STRIDE,)], output_dtypes=[f32, f32, mx.uint32],
        init_value=0)
    return y, st[t % 2], (st[2] if cell == "lstm" else None)
