"""com.microsoft mixture of experts: MoE (float experts) and QMoE (int4/int8 block-quantized experts),
as onnxruntime-genai's builder emits them (gpt-oss, LFM2-MoE) and ORT's CPU kernels compute them.

Routing (measured against ORT 1.31.1's CPU EP): softmax of ``router_probs`` (the router's logits) over
every expert in float32; the top ``k`` by probability, a tie going to the higher expert index; with
``normalize_routing_weights`` the k probabilities divided by their sum. Each selected expert computes
fc1 (+ bias), the activation, fc2 (+ bias); the outputs are summed weighted by the routing weights.
SwiGLU (``swiglu_fusion=1``, the only layout ORT's CPU kernel takes): fc1's rows interleave gate
(even) and linear (odd); G = min(g, limit), L = clamp(l, -limit, limit), G * sigmoid(alpha * G) * (L + beta).
gelu is the tanh approximation. Half inputs: each stage is rounded to the input type (fc1 + bias, the
activation, fc2 + bias), the weighted sum is float32, as ORT's MLFloat16 kernel does.

QMoE: fc*_experts_weights (E, N, K * bits / 8) uint8, values packed low bits first along K; W[e, n, k] =
(q - zp) * scale with zp the given zero points or 2^(bits - 1), one scale per ``block_size`` along K (or
per row without it). That packing read as little-endian uint32 words is MLX's affine packing, so the
experts' products run as ``mx.gather_qmm`` (bias = -zp * scale) where MLX has the group size, else on
dequantized weights. We compute in float: ORT's CPU EP matches at accuracy_level 0/1 for 4-bit experts;
8-bit experts (and accuracy_level 4) quantize the activations to int8 there (tests bound that
difference and compare exactly with the float MoE on the dequantized weights).

The selected experts' products use ``mx.gather_mm`` / ``mx.gather_qmm`` with the expert indices as data:
no host reads, so both translators trace (decode closures replay them shapeless; QMoE's weights are
packed for ``gather_qmm`` once per closure, ``prepack_qmoe``).
"""
from __future__ import annotations

import mlx.core as mx

from .. import consts
from .. import dtypes as dt
from ..registry import MS, register
from .contrib_quant import _MLX_GROUPS, unpack_bits

_TYPES = {dt.FLOAT, dt.FLOAT16, dt.BFLOAT16}
_ACTS = ("relu", "gelu", "silu", "identity", "swiglu")


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


# ---------------------------------------------------------------------------- routing
def route(router_probs, k: int, normalize: bool, router_max: int = 256):
    """(expert indices (T, k) int32 in ORT's order, routing weights (T, k) float32) of the router's logits
    (T, E): softmax, top k (ties to the higher index), optionally renormalized over the k."""
    e = router_probs.shape[-1]
    if k > e:
        raise ValueError(f"k={k} exceeds the {e} experts")
    p = mx.softmax(router_probs.astype(mx.float32), axis=-1)
    j = consts.arange(e)
    pi, pj = p[:, :, None], p[:, None, :]
    beats = (pj > pi) | ((pj == pi) & (j.reshape(1, 1, e) > j.reshape(1, e, 1)))
    rank = mx.sum(beats.astype(mx.int32), axis=-1)                       # (T, E): a permutation of 0..E-1
    idx = mx.argsort(rank, axis=-1)[:, :k].astype(mx.int32)              # experts in rank order
    w = mx.take_along_axis(p, idx, axis=-1)
    if normalize:
        w = w / mx.sum(w, axis=-1, keepdims=True)
    return idx, w


def _activate(y, act: str, alpha: float, beta: float, limit: float | None):
    """The activation of fc1's output (float32)."""
    if act == "swiglu":
        g, lin = y[..., 0::2], y[..., 1::2]
        if limit is not None:
            g = mx.minimum(g, limit)
            lin = mx.clip(lin, -limit, limit)
        return g * mx.sigmoid(alpha * g) * (lin + beta)
    if act == "relu":
        return mx.maximum(y, 0.0)
    if act == "silu":
        return y * mx.sigmoid(y)
    if act == "gelu":
        return 0.5 * y * (1.0 + mx.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))
    return y


def moe_core(input, router_probs, fc1, fc1_bias, fc2, fc2_bias, *, k: int, activation_type: str,
             normalize_routing_weights: int, activation_alpha: float, activation_beta: float,
             swiglu_limit: float | None):
    """MoE with ``fc1(x3, idx)`` / ``fc2(a3, idx)``: the selected experts' products of (T, 1, 1, K) rows ->
    (T, k, 1, N) float32 (the expert weights are behind the callables: float or quantized)."""
    shape = input.shape
    hidden = shape[-1]
    x = input.reshape(-1, hidden)
    t = x.shape[0]
    if router_probs.ndim != 2 or router_probs.shape[0] != t:
        raise ValueError(f"router_probs shape {router_probs.shape}, expected ({t}, num_experts)")
    idx, w = route(router_probs, k, bool(normalize_routing_weights))
    half = input.dtype != mx.float32
    xt = x.reshape(t, 1, 1, hidden)
    y1 = fc1(xt, idx)                                                     # (T, k, 1, fc1)
    if half:                                      # ORT's half GEMM writes its output in the input type
        y1 = y1.astype(input.dtype).astype(mx.float32)
    if fc1_bias is not None:
        y1 = y1 + mx.take(fc1_bias, idx, axis=0).astype(mx.float32)[:, :, None, :]
    if half:
        y1 = y1.astype(input.dtype).astype(mx.float32)
    a = _activate(y1, activation_type, activation_alpha, activation_beta, swiglu_limit)
    if half:
        a = a.astype(input.dtype).astype(mx.float32)
    y2 = fc2(a, idx)                                                      # (T, k, 1, H)
    if half:
        y2 = y2.astype(input.dtype).astype(mx.float32)
    if fc2_bias is not None:
        y2 = y2 + mx.take(fc2_bias, idx, axis=0).astype(mx.float32)[:, :, None, :]
    if half:
        y2 = y2.astype(input.dtype).astype(mx.float32)
    out = mx.sum(y2[:, :, 0, :] * w[:, :, None], axis=1)
    return out.astype(input.dtype).reshape(shape)


def _dense(weights):
    """fc(x3, idx) over float expert weights (E, N, K): the selected experts' x @ W^T in float32."""
    wt = weights.swapaxes(-1, -2)

    def fc(x3, idx):
        return mx.gather_mm(x3.astype(mx.float32), wt.astype(mx.float32), rhs_indices=idx)
    fc.operands = (wt,)
    return fc


def _common_check(v, fc1_w: int, fc2_w: int, fc3: tuple) -> str | None:
    a = v.attrs
    t = v.dtype(0)
    if t not in _TYPES:
        return f"dtype {dt.name(t)} (float, float16, bfloat16 only)"
    act = _s(a.get("activation_type", "relu"))
    if act not in _ACTS:
        return f"activation_type={act!r}"
    if act == "swiglu" and a.get("swiglu_fusion", 0) != 1:
        return f"swiglu_fusion={a.get('swiglu_fusion', 0)} (ORT's CPU kernel takes the interleaved layout, 1, only)"
    if a.get("use_sparse_mixer", 0):
        return "use_sparse_mixer=1 not supported"
    if a.get("k", 1) < 1:
        return f"k={a.get('k', 1)}"
    if any(v.has(i) for i in fc3):
        return "fc3 experts not supported (ORT's CPU kernel has none)"
    if v.rank(0) not in (None, 2, 3):
        return f"input rank {v.rank(0)} (2D or 3D only)"
    if v.rank(1) not in (None, 2):
        return f"router_probs rank {v.rank(1)} (2D only)"
    if v.dtype(1) != t:
        return f"router_probs {dt.name(v.dtype(1))}, input {dt.name(t)}"
    for i in (fc1_w, fc2_w):
        if v.rank(i) not in (None, 3):
            return f"input {i} rank {v.rank(i)} (3D expert weights only)"
    return None


# ---------------------------------------------------------------------------- MoE
def _half_norm0(v) -> str | None:
    """ORT's float16 kernel without normalize_routing_weights disagrees with its own float32 kernel on the
    same inputs (by the size of the output, measured on 1.31.1): nothing to verify against."""
    if v.dtype(0) == dt.FLOAT16 and not v.attrs.get("normalize_routing_weights", 0):
        return ("float16 with normalize_routing_weights=0 (ORT's float16 kernel disagrees with its float32 "
                "kernel there)")
    return None


def _moe_check(v) -> str | None:
    r = _common_check(v, 2, 4, (6, 7)) or _half_norm0(v)
    if r:
        return r
    for i in (2, 3, 4, 5):
        if v.has(i) and v.dtype(i) != v.dtype(0):
            return f"input {i} is {dt.name(v.dtype(i))}, input {dt.name(v.dtype(0))}"
    return None


def _limit(swiglu_limit):
    return None if swiglu_limit is None else float(swiglu_limit)


@register("MoE", 1, domain=MS, check=_moe_check)
def moe(input, router_probs, fc1_experts_weights, fc1_experts_bias=None, fc2_experts_weights=None,
        fc2_experts_bias=None, fc3_experts_weights=None, fc3_experts_bias=None, *, k=1, activation_type="relu",
        normalize_routing_weights=0, use_sparse_mixer=0, swiglu_fusion=0, activation_alpha=1.0,
        activation_beta=0.0, swiglu_limit=None):
    """Mixture of experts with float experts: fc1 (E, fusion * I, H), fc2 (E, H, I)."""
    act = _s(activation_type)
    e, n1, h = fc1_experts_weights.shape
    inter = n1 // 2 if act == "swiglu" else n1
    if input.shape[-1] != h or fc2_experts_weights.shape != (e, h, inter) or router_probs.shape[-1] != e:
        raise ValueError(f"MoE: input {input.shape}, router {router_probs.shape}, fc1 {fc1_experts_weights.shape}, "
                         f"fc2 {fc2_experts_weights.shape} do not fit")
    return moe_core(input, router_probs, _dense(fc1_experts_weights), fc1_experts_bias,
                    _dense(fc2_experts_weights), fc2_experts_bias, k=k, activation_type=act,
                    normalize_routing_weights=normalize_routing_weights, activation_alpha=activation_alpha,
                    activation_beta=activation_beta, swiglu_limit=_limit(swiglu_limit))


# ---------------------------------------------------------------------------- QMoE
def _qmoe_check(v) -> str | None:
    r = _common_check(v, 2, 5, (8, 9, 10, 13)) or _half_norm0(v)
    if r:
        return r
    a = v.attrs
    if _s(a.get("quant_type", "int")) != "int":
        return f"quant_type={_s(a['quant_type'])!r} (integer experts only)"
    bits = a.get("expert_weight_bits", 4)
    if bits not in (4, 8):
        return f"expert_weight_bits={bits} (4 and 8 only)"
    for name in ("fc1_expert_weight_bits", "fc2_expert_weight_bits", "fc3_expert_weight_bits"):
        if name in v.node.attrs and a.get(name) != bits:
            return f"{name}={a.get(name)} differs from expert_weight_bits={bits}"
    if a.get("weights_prepacked", -1) not in (-1, 0):
        return f"weights_prepacked={a['weights_prepacked']} (an EP-specific layout)"
    bs = a.get("block_size", 0)
    if bs and (bs < 16 or bs & (bs - 1)):
        return f"block_size={bs} is not a power of two >= 16"
    for i, what in ((14, "router_weights"), (15, "fc1_global_scale"), (16, "fc2_global_scale"),
                    (17, "fc1_act_scale"), (18, "fc2_act_scale"), (19, "fc1_act_block_scale"),
                    (20, "fc2_act_block_scale")):
        if v.has(i):
            return f"input {what} not supported"
    for i in (2, 5, 11, 12):
        if v.has(i) and v.dtype(i) != dt.UINT8:
            return f"input {i} is {dt.name(v.dtype(i))} (uint8 packed only)"
    for i in (3, 6, 4, 7):
        if v.has(i) and v.dtype(i) != v.dtype(0):
            return f"input {i} is {dt.name(v.dtype(i))}, input {dt.name(v.dtype(0))}"
    if not (v.has(3) and v.has(6)):
        return "fc1_scales and fc2_scales are required for integer experts"
    return None


def qmoe_layout(weights, scales, zero_points, bits: int, block_size: int):
    """(E, N, K, block, k_blocks) of one projection's quantized experts; raises when the shapes disagree."""
    e, n, kp = weights.shape
    kdim = kp * 8 // bits
    bs = block_size if block_size > 0 else kdim
    if kdim % bs:
        raise ValueError(f"QMoE: K={kdim} is not a multiple of block_size {bs}")
    kb = kdim // bs
    if scales.size != e * n * kb:
        raise ValueError(f"QMoE: scales {scales.shape} do not fit {e} experts x {n} rows x {kb} blocks")
    if zero_points is not None and zero_points.size != e * n * (-(-kb * bits // 8)):
        raise ValueError(f"QMoE: zero points {zero_points.shape} do not fit {e} x {n} x {kb} blocks of {bits} bits")
    return e, n, kdim, bs, kb


def _zero_points(zero_points, e: int, n: int, kb: int, bits: int):
    """(E, N, kb) float32 zero points: packed uint8 rows, or the default 2^(bits - 1)."""
    if zero_points is None:
        return mx.full((e, n, kb), float(1 << (bits - 1)), mx.float32)
    row = -(-kb * bits // 8)
    z = unpack_bits(zero_points.reshape(e, n, row), bits)
    return z[..., :kb].astype(mx.float32)


def quantized_fc(weights, scales, zero_points, bits: int, block_size: int):
    """fc(x3, idx) over one projection's quantized experts: ``gather_qmm`` on MLX's affine packing where the
    group size fits, else the dequantized weights (float32) through ``gather_mm``."""
    e, n, kdim, bs, kb = qmoe_layout(weights, scales, zero_points, bits, block_size)
    s = scales.reshape(e, n, kb).astype(mx.float32)
    z = _zero_points(zero_points, e, n, kb, bits)
    if bs in _MLX_GROUPS and (kdim * bits) % 32 == 0:
        w32 = weights.reshape(e, n, kdim * bits // 8).view(mx.uint32)
        zs = -z * s

        def fc(x3, idx):
            return mx.gather_qmm(x3.astype(mx.float32), w32, s, zs, rhs_indices=idx, transpose=True,
                                 group_size=bs, bits=bits)
        fc.operands = (w32, s, zs)
        return fc
    q = unpack_bits(weights.reshape(e, n, kdim * bits // 8), bits).astype(mx.float32).reshape(e, n, kb, bs)
    w = ((q - z[..., None]) * s[..., None]).reshape(e, n, kdim)
    return _dense(w)


@register("QMoE", 1, domain=MS, check=_qmoe_check)
def qmoe(input, router_probs, fc1_experts_weights, fc1_scales=None, fc1_experts_bias=None, fc2_experts_weights=None,
         fc2_scales=None, fc2_experts_bias=None, fc3_experts_weights=None, fc3_scales=None, fc3_experts_bias=None,
         fc1_zero_points=None, fc2_zero_points=None, fc3_zero_points=None, router_weights=None,
         fc1_global_scale=None, fc2_global_scale=None, fc1_act_scale=None, fc2_act_scale=None,
         fc1_act_block_scale=None, fc2_act_block_scale=None, *, k=1, activation_type="relu",
         normalize_routing_weights=0, use_sparse_mixer=0, swiglu_fusion=0, activation_alpha=1.0,
         activation_beta=0.0, swiglu_limit=None, expert_weight_bits=4, block_size=0, quant_type="int",
         accuracy_level=0, weights_prepacked=-1, fc1_expert_weight_bits=None, fc2_expert_weight_bits=None,
         fc3_expert_weight_bits=None):
    """Mixture of experts with int4/int8 block-quantized experts (see the module docstring)."""
    fc1 = quantized_fc(fc1_experts_weights, fc1_scales, fc1_zero_points, expert_weight_bits, block_size)
    fc2 = quantized_fc(fc2_experts_weights, fc2_scales, fc2_zero_points, expert_weight_bits, block_size)
    return qmoe_with(fc1, fc2, input, router_probs, fc1_experts_weights, fc1_experts_bias, fc2_experts_weights,
                     fc2_experts_bias, k=k, activation_type=activation_type,
                     normalize_routing_weights=normalize_routing_weights, activation_alpha=activation_alpha,
                     activation_beta=activation_beta, swiglu_limit=swiglu_limit, expert_weight_bits=expert_weight_bits)


def qmoe_with(fc1, fc2, input, router_probs, fc1_experts_weights, fc1_experts_bias, fc2_experts_weights,
              fc2_experts_bias, *, k, activation_type, normalize_routing_weights, activation_alpha, activation_beta,
              swiglu_limit, expert_weight_bits):
    """QMoE with its two projections given (``quantized_fc``, or packed once: ``prepack_qmoe``)."""
    act = _s(activation_type)
    bits = expert_weight_bits
    e, n1, kp = fc1_experts_weights.shape
    h = kp * 8 // bits
    inter = n1 // 2 if act == "swiglu" else n1
    if input.shape[-1] != h or fc2_experts_weights.shape != (e, h, inter * bits // 8) or router_probs.shape[-1] != e:
        raise ValueError(f"QMoE: input {input.shape}, router {router_probs.shape}, fc1 {fc1_experts_weights.shape}, "
                         f"fc2 {fc2_experts_weights.shape} do not fit {bits}-bit experts")
    return moe_core(input, router_probs, fc1, fc1_experts_bias, fc2, fc2_experts_bias, k=k, activation_type=act,
                    normalize_routing_weights=normalize_routing_weights, activation_alpha=activation_alpha,
                    activation_beta=activation_beta, swiglu_limit=_limit(swiglu_limit))
