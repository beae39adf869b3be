"""Block-quantized weights of onnxruntime's model builders: MatMulNBits, GatherBlockQuantized.

MatMulNBits: B is (N, k_blocks, blob) uint8, ``bits``-bit (2/4/8) values packed low bits first;
W[n, k] = (q - zp) * scale per block of ``block_size`` along K (default zp 2^(bits-1));
Y = A @ W^T (+ bias). ORT's packing read as little-endian uint32 words is MLX's affine
packing, so when the blocks tile K exactly and MLX has the group size, the product runs
as ``mx.quantized_matmul`` with bias = -zp * scale; otherwise W is dequantized first.
accuracy_level is a speed hint: we always compute in float (ORT at level 4 quantizes A to
int8 on the CPU; tests compare level 0 exactly and level 4 with a stated tolerance). Half inputs
are widened to float32 unless the build keeps them half (``build.half_nbits``: tuning ``half_nbits``).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import build, consts, cuda_kernels
from .. import dtypes as dt
from ..registry import MS, register

#: ORT's CPU kernel has float and float16; bfloat16 is tested against it in float32
_TYPES = {dt.FLOAT, dt.FLOAT16, dt.BFLOAT16}
_MLX_GROUPS = {32, 64, 128}


# ------------------------------------------------------------------ unpacking
def unpack_bits(packed, bits: int):
    """uint8 (..., n) -> uint8 (..., n * 8 / bits), low bits first."""
    if bits == 8:
        return packed
    per = 8 // bits
    mask = mx.array((1 << bits) - 1, mx.uint8)
    parts = [(packed >> mx.array(bits * i, mx.uint8)) & mask for i in range(per)]
    return mx.stack(parts, axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)


def block_zero_points(zero_points, n: int, k_blocks: int, bits: int, dtype):
    """(N, k_blocks) zero points in ``dtype``: packed uint8 rows, float, or the default."""
    if zero_points is None:
        return mx.full((n, k_blocks), float(1 << (bits - 1)), dtype)
    if zero_points.dtype == mx.uint8:
        row = -(-k_blocks * bits // 8)
        z = unpack_bits(zero_points.reshape(n, row), bits)
        return z[:, :k_blocks].astype(dtype)
    return zero_points.reshape(n, k_blocks).astype(dtype)


def dequantize_blocks(B, scales, zero_points, *, K: int, N: int, bits: int, block_size: int, dtype):
    """The (N, K) float weight of MatMulNBits."""
    k_blocks = B.shape[1]
    q = unpack_bits(B.reshape(N, k_blocks, -1), bits).astype(dtype)           # (N, kb, block)
    s = scales.reshape(N, k_blocks, 1).astype(dtype)
    z = block_zero_points(zero_points, N, k_blocks, bits, dtype).reshape(N, k_blocks, 1)
    w = ((q - z) * s).reshape(N, k_blocks * block_size)
    return w if k_blocks * block_size == K else w[:, :K]


# ------------------------------------------------------------------ MatMulNBits
def _mnb_check(v) -> str | None:
    a = v.attrs
    bits, bs, K, N = a.get("bits", 4), a["block_size"], a["K"], a["N"]
    if bits not in (2, 4, 8):
        return f"bits={bits} (2, 4 and 8 only)"
    if bs < 16 or bs & (bs - 1):
        return f"block_size={bs} is not a power of two >= 16"
    if a.get("weight_prepacked", 0):
        return "weight_prepacked=1 (an EP-specific layout)"
    if v.has(4):
        return "g_idx (act-order) not supported"
    if v.dtype(2) != v.dtype(0):
        return f"scales {dt.name(v.dtype(2))} differ from A {dt.name(v.dtype(0))}"
    if v.has(3) and v.dtype(3) not in (dt.UINT8, v.dtype(0)):
        return f"zero_points dtype {dt.name(v.dtype(3))}"
    if v.has(3) and v.dtype(3) != dt.UINT8 and bits != 4:
        return f"float zero points with bits={bits} (ORT's CPU kernel has none to verify against)"
    if v.has(5) and v.dtype(5) != v.dtype(0):
        return f"bias dtype {dt.name(v.dtype(5))}"
    kb = -(-K // bs)
    sb = v.shape(1)
    if sb is not None and all(isinstance(d, int) for d in sb) and tuple(sb) != (N, kb, bs * bits // 8):
        return f"B shape {tuple(sb)} is not ({N}, {kb}, {bs * bits // 8})"
    sa = v.shape(0)
    if sa is not None and sa and isinstance(sa[-1], int) and sa[-1] != K:
        return f"A's last dim {sa[-1]} != K={K}"
    return None


def _mlx_quantized(A, B, scales, zero_points, *, K, N, bits, block_size):
    """A @ W^T via mx.quantized_matmul (blocks tile K, group size MLX has)."""
    kb = K // block_size
    w = B.reshape(N, kb * block_size * bits // 8).view(mx.uint32)
    s = scales.reshape(N, kb).astype(A.dtype)
    z = block_zero_points(zero_points, N, kb, bits, A.dtype)
    return mx.quantized_matmul(A, w, s, -z * s, transpose=True, group_size=block_size, bits=bits)


@register("MatMulNBits", 1, domain=MS, dtypes=_TYPES, check=_mnb_check)
def matmul_nbits(A, B, scales, zero_points=None, g_idx=None, bias=None, *, K, N, block_size, bits=4,
                 accuracy_level=0, weight_prepacked=0):
    """Y = A @ dequant(B)^T (+ bias); A (..., K), Y (..., N)."""
    kb = -(-K // block_size)
    if A.shape[-1] != K:
        raise ValueError(f"A's last dim {A.shape[-1]} != K={K}")
    if B.size != N * kb * block_size * bits // 8:
        raise ValueError(f"B has {B.size} bytes, expected {N}x{kb}x{block_size * bits // 8}")
    if scales.size != N * kb:
        raise ValueError(f"scales has {scales.size} elements, expected {N * kb}")
    if zero_points is not None:
        want = N * (-(-kb * bits // 8)) if zero_points.dtype == mx.uint8 else N * kb
        if zero_points.size != want:
            raise ValueError(f"zero_points has {zero_points.size} elements, expected {want}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias shape {bias.shape}, expected ({N},)")
    ct = nbits_compute_type(A.dtype)
    a = A.astype(ct)
    if K % block_size == 0 and block_size in _MLX_GROUPS:
        y = _mlx_quantized(a, B, scales, zero_points, K=K, N=N, bits=bits, block_size=block_size)
    else:
        w = dequantize_blocks(B, scales, zero_points, K=K, N=N, bits=bits, block_size=block_size, dtype=ct)
        y = a @ w.T
    if bias is not None:
        y = y + bias.astype(ct)
    return y.astype(A.dtype)


def nbits_compute_type(dtype):
    """A MatMulNBits product's type for activations of ``dtype``: float32 (one rounding, as ORT's CPU EP), or
    the half type itself where the build keeps half products half."""
    return dtype if dtype in (mx.float16, mx.bfloat16) and build.half_nbits() else mx.float32


# ------------------------------------------------------------------ GatherBlockQuantized
def _gbq_check(v) -> str | None:
    a = v.attrs
    bits, bs = a.get("bits", 4), a.get("block_size", 128)
    if v.dtype(0) != dt.UINT8:
        return f"data {dt.name(v.dtype(0))} (uint8 packed data only)"
    if bits not in (4, 8):
        return f"bits={bits} (4 and 8 only)"
    if bs < 16 or bs & (bs - 1):
        return f"block_size={bs} is not a power of two >= 16"
    r = v.rank(0)
    if r is None:
        return "data rank unknown"
    qa, ga = a.get("quantize_axis", 1), a.get("gather_axis", 0)
    if qa % r != r - 1:
        return f"quantize_axis={qa} is not the last axis (rank {r})"
    if ga != 0:
        return f"gather_axis={ga} (ORT: uint8 data gathers along axis 0 only)"
    if v.has(3) and v.dtype(3) != dt.UINT8:
        return f"zero_points {dt.name(v.dtype(3))}"
    if v.dtype(2) not in (dt.FLOAT, dt.FLOAT16):
        return f"scales {dt.name(v.dtype(2))} (ORT's CPU kernel: float and float16)"
    return None


def gbq_layout(data, scales, bits: int, block_size: int, gather_axis: int) -> tuple[int, int, int]:
    """(gather axis, unpacked columns, blocks per row) of GatherBlockQuantized; checks the scales shape."""
    ga = gather_axis % data.ndim
    cols = data.shape[-1] * 8 // bits
    kb = -(-cols // block_size)
    if tuple(scales.shape) != tuple(data.shape[:-1]) + (kb,):
        raise ValueError(f"scales shape {scales.shape}, expected {tuple(data.shape[:-1]) + (kb,)}")
    return ga, cols, kb


def dequantize_gathered(data, scales, zero_points, flat, ga: int, cols: int, kb: int, block_size: int, bits: int):
    """Rows ``flat`` (int32 MLX indices) of ``data`` along ``ga``, dequantized: (q - zp) * scale per block
    of the last axis (zp: the packed zero points, else the midpoint). The zero points' crop to ``kb``
    is a take, so traces can use it too. Returns (..., cols) with len(flat) rows on ``ga``."""
    # an embedding's rows through our row kernel where the build may (MLX's gather: a JIT kernel per type, built alone)
    q = unpack_bits(cuda_kernels.take(data, flat, ga), bits)
    s = cuda_kernels.take(scales, flat, ga)
    if zero_points is None:
        z = mx.full(s.shape, float(1 << (bits - 1)), s.dtype)
    else:
        zrow = -(-kb * bits // 8)
        if tuple(zero_points.shape) != tuple(data.shape[:-1]) + (zrow,):
            raise ValueError(f"zero_points shape {zero_points.shape}, expected {tuple(data.shape[:-1]) + (zrow,)}")
        z = unpack_bits(cuda_kernels.take(zero_points, flat, ga), bits)
        z = mx.take(z.reshape(-1, z.shape[-1]), consts.arange(kb), axis=1)
        z = z.reshape(s.shape).astype(s.dtype)
    lead = q.shape[:-1]
    if kb * block_size != q.shape[-1]:          # the last block is short: pad it, crop after
        q = mx.concatenate([q, mx.zeros((*lead, kb * block_size - q.shape[-1]), q.dtype)], axis=-1)
    qb = q.reshape(*lead, kb, block_size)
    w = ((qb.astype(s.dtype) - z[..., None]) * s[..., None]).reshape(*lead, kb * block_size)
    return w[..., :cols] if kb * block_size != cols else w


@register("GatherBlockQuantized", 1, domain=MS, check=_gbq_check)
def gather_block_quantized(data, indices, scales, zero_points=None, *, bits=4, block_size=128,
                           quantize_axis=1, gather_axis=0):
    """Gather along gather_axis, then dequantize (q - zp) * scale per block of the last axis."""
    ga, cols, kb = gbq_layout(data, scales, bits, block_size, gather_axis)
    idx = _host_ints(indices)
    n = data.shape[ga]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise ValueError(f"indices out of range [-{n}, {n - 1}]")
    flat = mx.array(np.where(idx < 0, idx + n, idx).reshape(-1).astype(np.int32))
    w = dequantize_gathered(data, scales, zero_points, flat, ga, cols, kb, block_size, bits)
    out_shape = data.shape[:ga] + tuple(idx.shape) + data.shape[ga + 1:-1] + (cols,)
    return w.reshape(out_shape)


def _host_ints(x) -> np.ndarray:
    """Host copy of a small integer input (evaluates it in eager mode)."""
    return np.array(x if isinstance(x, np.ndarray) else dt.to_numpy(x))
