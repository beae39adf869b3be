"""Trace-friendly GroupQueryAttention for the decode and prefill closures.

The eager translator (``kernels/ops/contrib_attention.py``) validates ``seqlens_k`` on
the host and bakes ``total_sequence_length``; neither works in a trace. Here the
valid lengths stay data: ``seqlens_k`` and ``total_sequence_length`` are MLX
arrays, the RoPE rows are gathered by data positions (``rotary_tables`` takes
positions as an array; the rotate-half is a permutation ``take`` plus ``where`` for
partial rotary), packed QKV is split with ``take`` (no Slice in a shapeless graph),
and the eager translator's host validation becomes a *guard*: a boolean computed in
the graph, returned next to the outputs and checked after eval; a false guard makes
the call answer from eager (which raises the eager error or gives its answer).
The attention math itself is the eager translator's ``gqa_core``.
"""
from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from ..kernels import build, consts, cuda_kernels
from ..kernels.interpreter import mx_device
from ..kernels.ops import contrib_quant as q
from ..kernels.ops.contrib_attention import (_bnsh, apply_rotary, attention_probs_softmax, gqa_core, rope_layout,
                                             rotary_tables, softmax_sink)
from ..kernels.ops.contrib_attention import KVQuant, gqa_window_core, head_rms_norm
from ..kernels.ops.contrib_quant import dequantize_gathered, gbq_layout
from ..kernels.ops.shape import norm_axis


class Untraceable(RuntimeError):
    """A traced form does not cover this case: the trace fails and the call answers from eager."""

_GQA_INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
               "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale", "v_scale",
               "q_norm_weight", "k_norm_weight", "qkv_bias")
_GQA_DEFAULTS = dict(scale=0.0, softcap=0.0, do_rotary=0, rotary_interleaved=0, local_window_size=-1,
                     smooth_softmax=-1, causal=1, qk_output=0, kv_cache_bit_width=0, k_quant_type="NONE",
                     v_quant_type="NONE", sliding_window_cache=0, qk_norm_epsilon=1e-6)


def add_row_hint(present: mx.array, past: mx.array, start: mx.array, rows: mx.array) -> None:
    """Declare, inside a trace, that ``present`` equals ``past`` bit for bit except rows
    ``start[b] .. start[b] + S`` (axis -2) of batch row b, which hold ``rows`` (B, ..., S, H).
    The copy-out of an aliased KV buffer then writes those rows without diffing (``runtime/mirror.py``)."""
    b = build.current()
    if b is not None and b.hints is not None:
        b.hints.append((present, past, start, rows))


def add_guard(ok: mx.array) -> None:
    """A boolean that must be true for the traced answer to be used: a scalar, or (from
    ``every``) one element."""
    b = build.current()
    items = b.guards if b is not None else None
    if items is None:
        raise RuntimeError("a guarded traced op ran outside a compiled trace")
    if not any(g is ok for g in items):
        items.append(ok)


def seqlens_i32(sk: mx.array) -> mx.array:
    """A GroupQueryAttention's ``seqlens_k`` flat int32, once per build for every layer (a group input: alive to the
    build's end, so its id is a memo key)."""
    return build.memo(("gqa_seqlens", id(sk)), lambda: sk.reshape(-1).astype(mx.int32))


def every(x: mx.array) -> mx.array:
    """``mx.all(x)`` for a guard's condition; one element in a shape-keyed trace stays as it is.

    The closure ands its one-element guards elementwise and reduces once (``core``): MLX fuses
    those compares and ands into one kernel, where an ``mx.all`` per condition ends a fusion each
    (a 0.5B decode step had ~13 guard kernels). For one element the truth is the same."""
    if x.size == 1 and not build.shapeless():
        return x
    return mx.all(x)


def split_packed_qkv(qkv, num_heads: int, kv_num_heads: int):
    """(B,S,(N+2Nkv)*H) -> q, k, v: slices, or ``take`` in a shapeless trace (no static slices)."""
    b, s, hidden = qkv.shape
    heads = num_heads + 2 * kv_num_heads
    h = hidden // heads
    if h * heads != hidden:
        raise ValueError(f"packed QKV hidden {hidden} not divisible into {num_heads}+2*{kv_num_heads} heads")
    x = qkv.reshape(b, s, heads, h)

    def part(lo: int, n: int):
        if not build.shapeless():
            return x[:, :, lo:lo + n].reshape(b, s, n * h)
        return mx.take(x, consts.arange(n, mx.int32, lo), axis=2).reshape(b, s, n * h)
    return part(0, num_heads), part(num_heads, kv_num_heads), part(num_heads + kv_num_heads, kv_num_heads)


def _gqa_args(args, attrs, refused: tuple, label: str, pack: bool = False):
    """Attributes with defaults, inputs by name, and (q, k, v) with packed QKV split and the q/k norms
    (``q/k_norm_weight``) applied; raises Untraceable for inputs the traced forms do not cover (quantized
    KV, ``refused``).

    ``pack``: outside shapeless traces, packed QKV without q/k norms comes back as it is, q (B,S,(N+2Nkv)*H),
    with k, v None (``gqa_core(packed=True)``)."""
    a = {**_GQA_DEFAULTS, **attrs}
    x = dict(zip(_GQA_INPUTS, list(args) + [None] * (len(_GQA_INPUTS) - len(args))))
    for k in refused:
        if x[k] is not None:
            raise Untraceable(f"{label}: input {k}")
    if x["past_key"] is None or x["past_value"] is None:
        raise Untraceable(f"{label} needs past_key/past_value")
    q, k, v = x["query"], x["key"], x["value"]
    norms = x["q_norm_weight"] is not None
    if norms and x["k_norm_weight"] is None:
        raise ValueError("q_norm_weight and k_norm_weight must both be given")
    if k is None and pack and not norms and not a["sliding_window_cache"] and not build.shapeless():
        b, s, hidden = q.shape
        heads = a["num_heads"] + 2 * a["kv_num_heads"]
        if hidden % heads:
            raise ValueError(f"packed QKV hidden {hidden} not divisible into {a['num_heads']}+2*"
                             f"{a['kv_num_heads']} heads")
        return a, x, q, None, None
    if k is None:
        if x["qkv_bias"] is not None:
            q = q + x["qkv_bias"]
            x["qkv_bias"] = None
        q, k, v = split_packed_qkv(q, a["num_heads"], a["kv_num_heads"])
    if norms:
        q = head_rms_norm(q, x["q_norm_weight"], a["qk_norm_epsilon"], a["num_heads"])
        k = head_rms_norm(k, x["k_norm_weight"], a["qk_norm_epsilon"], a["kv_num_heads"])
    return a, x, q, k, v


def gqa_window_traced(a, x, q, k, v, decode: bool, padded: bool = False):
    """GroupQueryAttention over a windowed KV cache (``sliding_window_cache=1``) in a trace: the eager
    translator's ``gqa_window_core`` with its host checks on ``seqlens_k`` as a guard. The capacity C
    (the past's rows) is a shape, the same for every call of a closure; decode (S == 1) replays
    shapeless (its present is C rows whatever the total length). A padded (bucketed) prefill is not
    traced: the op needs seqlens_k + 1 >= S, which a padded prompt breaks (ORT rejects it)."""
    if padded:
        raise Untraceable("windowed KV cache (sliding_window_cache=1): a padded prompt has seqlens_k + 1 < S")
    nh, kvh = a["num_heads"], a["kv_num_heads"]
    b, s, hidden = q.shape
    h = hidden // nh
    past_k, past_v = x["past_key"], x["past_value"]
    cap, w = past_k.shape[2], a["local_window_size"]
    if past_k.shape != (b, kvh, cap, h) or past_v.shape != past_k.shape or k.shape != (b, s, kvh * h):
        raise ValueError(f"traced GroupQueryAttention: shapes q {q.shape} k {k.shape} past {past_k.shape}")
    if cap < w:
        raise ValueError(f"sliding_window_cache: KV cache capacity ({cap}) must be at least local_window_size ({w})")
    if decode and s != 1:
        raise Untraceable("traced decode GroupQueryAttention: S == 1")
    if not decode and s > 1 and b > 1:
        tot = int(np.asarray(x["total_sequence_length"]).reshape(-1)[0])
        if s != tot:
            raise ValueError(f"batch_size must be 1 when sequence_length > 1 and past context is given (B={b}, S={s})")
    sk = x["seqlens_k"]
    seqlens = seqlens_i32(sk)
    rows = None
    if a["do_rotary"]:
        cos = x["cos_cache"]
        if cos is None or x["sin_cache"] is None:
            raise ValueError("do_rotary=1 needs cos_cache and sin_cache")
        if h % 16 or cos.shape[-1] * 2 > h or cos.shape[-1] % 8:
            raise ValueError(f"rotary: head_size {h}, cos_cache {cos.shape}")
        rows = cos.shape[0]

    def guard():
        ok = every(seqlens + 1 >= s)
        return ok & every(seqlens < rows) if rows is not None else ok
    add_guard(build.memo(("gqa_window_guard", id(sk), s, rows), guard))
    return gqa_window_core(q, k, v, past_k, past_v, seqlens, num_heads=nh, kv_num_heads=kvh, window=w,
                           scale=a["scale"], softcap=a["softcap"],
                           cos_cache=x["cos_cache"] if a["do_rotary"] else None,
                           sin_cache=x["sin_cache"] if a["do_rotary"] else None,
                           rotary_interleaved=bool(a["rotary_interleaved"]),
                           sink=softmax_sink(x["head_sink"], a["smooth_softmax"], nh))


def _gqa_guard(seqlens, total, decode: bool, s: int, p: int, present_len: int, first_prompt: bool,
               rows: int | None) -> mx.array:
    """Where a traced GroupQueryAttention answers as eager does: eager's run-time checks on
    ``seqlens_k`` and the total length (``rows``: the rotary cache's, None without rotation)."""
    if decode:
        total_arr = (total if isinstance(total, mx.array) else mx.array(total)).reshape(-1).astype(mx.int32)
        # eager: present rows max(total, P) == P needs total <= P; S == 1 makes first/next prompt agree
        ok = every(total_arr <= p) & every(total_arr >= 1)
        # total == 1 is eager's first prompt: past length 0 whatever seqlens says; equal only at 0
        ok = ok & (every(total_arr > 1) | every(seqlens == 0))
    else:
        ok = mx.array(True)
    ok = ok & every(seqlens >= 0) & every(seqlens < present_len)
    if not first_prompt:
        ok = ok & every(seqlens + 1 >= s) & every(seqlens + 1 - s <= p)
        if rows is not None:
            ok = ok & every(seqlens < rows)
    return ok


def gqa_traced(decode: bool, padded: bool = False):
    """A GroupQueryAttention translator for traces: ``decode`` (S == 1, KV buffer of
    fixed length P, total length as data) or prefill (total length baked: shape-keyed).

    ``padded``: a bucketed prefill whose prompt was padded past its valid length; the
    present rows at or beyond the valid length are zero, as for the unpadded prompt. Such a
    present differs from a zero past in its first S rows only: it declares them as row hints, which
    the runtime uses where the past was a zero stand-in or a mirror (``BucketedPrefill``).
    """
    def gqa(*args, **attrs):
        if not padded or attrs.get("sliding_window_cache", 0):
            return _gqa(*args, **attrs)
        # the presents' rows at or past the prompt's length are zero (selected over the bucket's rows only)
        sk = args[5]
        # the prompt's own length, once per seqlens_k input; also for ``gather_padded_tail``
        valid = build.memo(PADDED_VALID + (id(sk),), lambda: consts.unpooled(lambda x: x + 1, seqlens_i32(sk)))
        _note_padded_valid(valid)
        o, pk, pv, k_rows, v_rows = _gqa(*args, prompt_valid=valid, new_rows=True, **attrs)
        b = pk.shape[0]
        start = build.memo(("prefill_start", b), lambda: consts.zeros((b,), mx.int32))
        # the bucket's first rows (<= t: BucketedPrefill caps the bucket by the buffer)
        add_row_hint(pk, args[3], start, k_rows)
        add_row_hint(pv, args[4], start, v_rows)
        return o, pk, pv

    def _gqa(*args, prompt_valid=None, new_rows=False, **attrs):
        a, x, q, k, v = _gqa_args(args, attrs, (), "traced GroupQueryAttention", pack=True)
        if a["sliding_window_cache"]:
            return gqa_window_traced(a, x, q, k, v, decode, padded)
        nh, kvh = a["num_heads"], a["kv_num_heads"]
        packed = k is None
        b, s, hidden = q.shape
        h = hidden // (nh + 2 * kvh) if packed else hidden // nh
        past_k, past_v = x["past_key"], x["past_value"]
        p = past_k.shape[2]
        kvq = KVQuant(a["kv_cache_bit_width"], x["k_scale"], x["v_scale"]) if a["kv_cache_bit_width"] else None
        hp = h if kvq is None or kvq.bits == 8 else h // 2          # a 4-bit cache packs two values a byte
        if past_k.shape != (b, kvh, p, hp) or past_v.shape != past_k.shape or \
                (not packed and k.shape != (b, s, kvh * h)):
            raise ValueError(f"traced GroupQueryAttention: shapes q {q.shape} k {None if packed else k.shape} past {past_k.shape}")
        # one int32 form per build for every layer: one start array for all their row hints
        sk = x["seqlens_k"]
        seqlens = seqlens_i32(sk)
        total = x["total_sequence_length"]
        if decode:
            if s != 1 or x["position_ids"] is not None or x["attention_bias"] is not None:
                raise Untraceable("traced decode GroupQueryAttention: S == 1, no position_ids/bias")
            present_len, first_prompt, tot = p, False, None
        else:
            tot = int(np.asarray(total).reshape(-1)[0])
            if x["position_ids"] is not None:
                raise Untraceable("traced prefill GroupQueryAttention: position_ids")
            if s > tot and s > 1:
                raise ValueError(f"total_sequence_length {tot} is less than the sequence length {s}")
            present_len, first_prompt = max(tot, p), s == tot
        rows = None
        if a["do_rotary"]:
            cos = x["cos_cache"]
            if cos is None or x["sin_cache"] is None:
                raise ValueError("do_rotary=1 needs cos_cache and sin_cache")
            if cos.shape[-1] * 2 > h:
                raise ValueError(f"rotary dim {2 * cos.shape[-1]} exceeds head size {h}")
            rows = cos.shape[0]
            if first_prompt and s - 1 >= rows:
                raise ValueError(f"position {s - 1} is beyond the rotary cache ({rows} rows)")
        # every layer's guard is the same: one per build (a closure ands each guard object once)
        tkey = ("id", id(total)) if isinstance(total, mx.array) else ("host", np.asarray(total).tolist())
        add_guard(build.memo(("gqa_guard", id(sk), tkey, decode, s, p, present_len, first_prompt, rows),
                              lambda: _gqa_guard(seqlens, total, decode, s, p, present_len, first_prompt, rows)))
        if x["attention_bias"] is not None:
            ab = x["attention_bias"].shape
            if len(ab) != 4 or ab[0] not in (1, b) or ab[1] not in (1, nh) or ab[2] != s or ab[3] != tot:
                raise Untraceable(f"traced GroupQueryAttention: attention_bias shape {ab}")
        sink = softmax_sink(x["head_sink"], a["smooth_softmax"], nh)
        # a plain causal mask: a padded prompt's rows past its length are dropped; a lone prompt has none such
        causal = first_prompt and (padded or b == 1)
        if causal and not padded:
            add_guard(build.memo(("gqa_full", id(sk), s), lambda: every(seqlens + 1 == s)))
        res = gqa_core(q, k, v, past_k, past_v, seqlens, total_sequence_length=present_len, num_heads=nh,
                       kv_num_heads=kvh, first_prompt=first_prompt, scale=a["scale"], softcap=a["softcap"],
                       local_window_size=a["local_window_size"],
                       cos_cache=x["cos_cache"] if a["do_rotary"] else None,
                       sin_cache=x["sin_cache"] if a["do_rotary"] else None,
                       rotary_interleaved=bool(a["rotary_interleaved"]), position_ids=None,
                       attention_bias=x["attention_bias"], sink=sink, in_place=decode, packed=packed,
                       qkv_bias=x["qkv_bias"], kv_quant=kvq, causal_prompt=causal,
                       prompt_valid=prompt_valid if first_prompt else None, new_rows=new_rows and first_prompt)
        if prompt_valid is not None and not first_prompt:       # rows past the prompt's length zeroed over all
            o, pk, pv = res
            t = pk.shape[2]
            keep = consts.arange(t).reshape(1, 1, t, 1) < prompt_valid.reshape(b, 1, 1, 1)
            zero = consts.zeros((), pk.dtype)
            pk, pv = mx.where(keep, pk, zero), mx.where(keep, pv, zero)
            return (o, pk, pv, pk[:, :, :s], pv[:, :, :s]) if new_rows else (o, pk, pv)
        if not decode:
            return res
        # decode writes row seqlens_k (= past length, S == 1) into the buffer and leaves the others
        o, pk, pv, k_new, v_new = res
        add_row_hint(pk, past_k, seqlens, k_new)
        add_row_hint(pv, past_v, seqlens, v_new)
        return o, pk, pv
    return gqa


def gqa_growing_traced(*args, **attrs):
    """A decode GroupQueryAttention for separate, growing past/present buffers
    (``past_present_share_buffer: false``), traced shapeless with the past length free.

    Eager, for S == 1 with seqlens_k == P (the past's rows) and total_sequence_length == P + 1
    (genai's contract here): present_len = max(total, P) = P + 1, the present is the past with the
    new row appended, query position P, and the causal/length mask is all true (with a local
    window w: when P + 1 <= w). So present = concatenate (its length follows the input's shape in
    a shapeless replay), scores are reshaped with -1 along the key axis, and the mask is dropped;
    those conditions are guards, with the key length read from the data shape (a sum of ones
    over the score row, shapeless) rather than baked. The op sequence is ``gqa_core``'s.
    """
    import math
    a, x, q, k, v = _gqa_args(args, attrs, ("position_ids", "attention_bias", "k_scale", "v_scale"),
                              "traced growing-KV GroupQueryAttention")
    if a["sliding_window_cache"]:
        # its buffer is the window's capacity, whatever the other layers' past length: the windowed form
        return gqa_window_traced(a, x, q, k, v, True)
    nh, kvh = a["num_heads"], a["kv_num_heads"]
    b, s, hidden = q.shape
    h = hidden // nh
    if s != 1 or h * nh != hidden or k.shape != (b, s, kvh * h) or v.shape != k.shape:
        raise Untraceable(f"traced growing-KV GroupQueryAttention: q {q.shape} k {k.shape}")
    past_k, past_v = x["past_key"], x["past_value"]
    if past_k.ndim != 4 or (past_k.shape[0], past_k.shape[1], past_k.shape[3]) != (b, kvh, h) \
            or past_v.shape != past_k.shape:
        raise ValueError(f"traced GroupQueryAttention: past {past_k.shape} / {past_v.shape}")
    seqlens = x["seqlens_k"].reshape(-1).astype(mx.int32)
    if seqlens.size != b:
        raise ValueError(f"seqlens_k has {seqlens.size} elements, expected {b}")
    total = x["total_sequence_length"]
    total = (total if isinstance(total, mx.array) else mx.array(np.asarray(total))).reshape(-1).astype(mx.int32)
    q, k, v = _bnsh(q, nh), _bnsh(k, kvh), _bnsh(v, kvh)
    past_len = seqlens                                      # total_len - s with s == 1
    ok = every(total > 1) & every(seqlens + 1 == total)
    if a["do_rotary"]:
        cos, sin = x["cos_cache"], x["sin_cache"]
        if cos is None or sin is None:
            raise ValueError("do_rotary=1 needs cos_cache and sin_cache")
        if h % 16 or cos.shape[-1] * 2 > h or cos.shape[-1] % 8:
            raise ValueError(f"rotary: head_size {h}, cos_cache {cos.shape}")
        rows = cos.shape[0]
        ok = ok & every(seqlens < rows)
        pos = past_len.reshape(b, 1) + consts.arange(s).reshape(1, s)
        pos = mx.clip(pos, 0, rows - 1)                    # a failed guard answers from eager anyway
        c, sn = rotary_tables(cos, sin, pos, h, bool(a["rotary_interleaved"]))
        c, sn = c.reshape(b, 1, s, h), sn.reshape(b, 1, s, h)
        rd = 2 * cos.shape[-1]
        q = apply_rotary(q, c, sn, rd, bool(a["rotary_interleaved"]))
        k = apply_rotary(k, c, sn, rd, bool(a["rotary_interleaved"]))
    pk = mx.concatenate([past_k, k], axis=2)
    pv = mx.concatenate([past_v, v], axis=2)
    alpha = a["scale"] if a["scale"] != 0.0 else 1.0 / math.sqrt(h)
    group = nh // kvh
    qf = q.astype(mx.float32).reshape(b, kvh, group * s, h)
    scores = (qf @ pk.astype(mx.float32).swapaxes(-1, -2)) * alpha
    scores = scores.reshape(b, nh, s, -1)
    # the key length P + 1 as data: must equal total (so seqlens == P: every key is visible)
    keys = mx.sum(mx.ones_like(scores), axis=-1).astype(mx.int32)          # (b, nh, s)
    ok = ok & every(keys == total.reshape(-1, 1, 1))
    if a["local_window_size"] > 0:
        ok = ok & every(total <= a["local_window_size"])
    if a["softcap"] > 0.0:
        scores = a["softcap"] * mx.tanh(scores / a["softcap"])
    sink = softmax_sink(x["head_sink"], a["smooth_softmax"], nh)
    add_guard(ok)
    probs = attention_probs_softmax(scores, mx.array(True), sink)
    out = probs.reshape(b, kvh, group * s, -1) @ pv.astype(mx.float32)
    out = out.reshape(b, nh, s, h).transpose(0, 2, 1, 3).reshape(b, s, nh * h)
    return out.astype(q.dtype), pk, pv


def gather_traced(data, indices, *, axis=0):
    """Gather with the indices as data: out-of-range indices fail a guard (eager raises). Where the build asks for
    a step of our kernels only (``build.row_products``) the indices go to ``take_rows`` as they are (it counts
    negative ones from the end)."""
    a = norm_axis(axis, data.ndim)
    n = data.shape[a]
    idx = indices if isinstance(indices, mx.array) else _const_indices(np.asarray(indices))
    if build.row_products() and cuda_kernels.enabled() and n < 2**31 and \
            cuda_kernels.take_reason(data, idx, a) is None:
        add_guard(every((idx >= -n) & (idx < n)))
        return cuda_kernels.take_rows(data, idx, a)
    idx = idx.astype(mx.int64)
    add_guard(every((idx >= -n) & (idx < n)))
    idx = mx.where(idx < 0, idx + n, idx)
    return cuda_kernels.take(data, idx.astype(mx.int32) if n < 2**31 else idx, a)


def _const_indices(idx: np.ndarray) -> mx.array:
    """Constant indices as one evaluated array per value (a replayed step reads it as a constant)."""
    return _const_indices_of(idx.tobytes(), idx.dtype.str, idx.shape)


@functools.lru_cache(maxsize=256)
def _const_indices_of(data: bytes, dtype: str, shape: tuple) -> mx.array:
    return consts.roomy(mx.array(np.frombuffer(data, np.dtype(dtype)).reshape(shape)))


#: build-memo key of a padded prefill's valid length per batch row (set by its GroupQueryAttention): with a
#: ``seqlens_k`` input's id, that input's length; alone, the one length every such node gave, or ``AMBIGUOUS``
PADDED_VALID = ("padded_valid_length",)
AMBIGUOUS = object()


def _note_padded_valid(valid) -> None:
    """Record the length ``gather_padded_tail`` reads: ``AMBIGUOUS`` once two nodes gave different ones."""
    b = build.current()
    if b is not None:
        seen = b.memo.setdefault(PADDED_VALID, valid)
        if seen is not valid:
            b.memo[PADDED_VALID] = AMBIGUOUS


def gather_padded_tail(k: int):
    """Gather along the sequence axis (1) of a constant negative index ``k`` in a prompt padded to its bucket:
    row ``valid + k`` of each batch row, not ``bucket + k`` (the builder's ``prune_lm_head`` keeps the last
    token's hidden state so). The valid length is the padded GroupQueryAttention's (``PADDED_VALID``)."""
    def gather(data, indices, *, axis=0):
        b = build.current()
        valid = b.memo.get(PADDED_VALID) if b is not None else None
        if valid is None or data.ndim < 2:
            raise Untraceable("a padded prompt's tail gather before any GroupQueryAttention gave its length")
        if valid is AMBIGUOUS:
            raise Untraceable("a padded prompt's tail gather after GroupQueryAttention nodes of different seqlens_k")
        n = data.shape[0]
        idx = valid.reshape(-1).astype(mx.int32) + k
        add_guard(every(idx >= 0))
        idx = mx.maximum(idx, 0)
        if n == 1:      # a take: ``take_rows`` on a GPU, where MLX's gather is a JIT kernel built alone
            return cuda_kernels.take(data, idx, 1).squeeze(1)
        idx = mx.broadcast_to(idx.reshape((n,) + (1,) * (data.ndim - 1)), (n, 1) + tuple(data.shape[2:]))
        return mx.take_along_axis(data, idx, axis=1).squeeze(1)
    return gather


def _traced_indices(indices, n: int):
    """Indices as an int array in [0, n): out-of-range ones fail a guard (eager raises), negatives wrap."""
    idx = indices if isinstance(indices, mx.array) else mx.array(np.asarray(indices))
    idx = idx.astype(mx.int64)
    add_guard(every((idx >= -n) & (idx < n)))
    idx = mx.where(idx < 0, idx + n, idx)
    return mx.clip(idx, 0, max(n - 1, 0)).astype(mx.int32)


def gather_elements_traced(data, indices, *, axis=0):
    """GatherElements with the indices as data (the eager translator range-checks them on the host)."""
    from ..kernels.ops.shape import norm_axis
    a = norm_axis(axis, data.ndim)
    if indices.ndim != data.ndim or any(i > d for k, (i, d) in enumerate(zip(indices.shape, data.shape)) if k != a):
        raise ValueError(f"GatherElements: indices shape {indices.shape} does not fit data {data.shape} at axis {a}")
    if indices.size == 0:
        raise Untraceable("traced GatherElements: empty indices")
    sl = tuple(slice(None) if k == a else slice(0, i) for k, i in enumerate(indices.shape))
    d = data[sl] if any(i != dd for k, (i, dd) in enumerate(zip(indices.shape, data.shape)) if k != a) else data
    return mx.take_along_axis(d, _traced_indices(indices, data.shape[a]), axis=a)


def scatter_elements_traced(data, indices, updates, *, axis=0, reduction="none"):
    """ScatterElements (reduction none) with the indices as data. Eager writes duplicates in order (the
    last wins); here positions along the axis must be distinct in each row, a guard (else eager answers)."""
    from ..kernels.ops.shape import norm_axis
    if reduction != "none":
        raise Untraceable(f"traced ScatterElements: reduction {reduction!r}")
    a = norm_axis(axis, data.ndim)
    if indices.shape != updates.shape or indices.ndim != data.ndim:
        raise ValueError(f"ScatterElements: indices {indices.shape} / updates {updates.shape} / data {data.shape}")
    if any(i != d for k, (i, d) in enumerate(zip(indices.shape, data.shape)) if k != a) or indices.size == 0:
        raise Untraceable("traced ScatterElements: indices narrower than the data off the axis")
    idx = _traced_indices(indices, data.shape[a])
    t = mx.moveaxis(idx, a, -1)
    add_guard(every(mx.sum((t[..., :, None] == t[..., None, :]).astype(mx.int32), axis=-1) == 1))
    return mx.put_along_axis(data, idx, updates.astype(data.dtype), axis=a)


# ---------------------------------------------------------------------------- RotaryEmbedding
def rotary_traced(input, position_ids, cos_cache, sin_cache, *, interleaved=0, is_packed_batching=0,
                  num_heads=0, rotary_embedding_dim=0, scale=1.0):
    """com.microsoft RotaryEmbedding with ``position_ids`` as data (the eager translator reads
    them on the host). Eager's range check becomes a guard; the math is eager's
    (``rotary_tables`` + ``apply_rotary``)."""
    if is_packed_batching or scale != 1.0:
        raise Untraceable("traced RotaryEmbedding: is_packed_batching / scale")
    x, b, n, s, h, rd = rope_layout(input, cos_cache, sin_cache, num_heads, rotary_embedding_dim)
    rows = cos_cache.shape[0]
    pid = position_ids if isinstance(position_ids, mx.array) else mx.array(np.asarray(position_ids))
    pid = pid.astype(mx.int64)
    if pid.size == 1:
        # eager: a one-element position_ids is a start offset for the S positions
        start = pid.reshape(1, 1)
        add_guard(every(start >= 0) & every(start + s <= rows))
        pos = mx.broadcast_to(consts.arange(s, mx.int64).reshape(1, s) + start, (b, s))
    elif tuple(pid.shape) == (b, s):
        add_guard(every(pid >= 0) & every(pid < rows))
        pos = pid
    else:
        raise ValueError(f"position_ids shape {pid.shape}, expected (1,) or ({b}, {s})")
    pos = mx.clip(pos, 0, rows - 1).astype(mx.int32)   # a failed guard answers from eager anyway
    c, sn = rotary_tables(cos_cache, sin_cache, pos, h, bool(interleaved))
    y = apply_rotary(x, c.reshape(b, 1, s, h), sn.reshape(b, 1, s, h), rd, bool(interleaved))
    if input.ndim == 4:
        return y
    return y.transpose(0, 2, 1, 3).reshape(b, s, n * h)


# ---------------------------------------------------------------------------- MatMulNBits
def prepack_nbits(program, st):
    """MatMulNBits with constant weights, packed for ``mx.quantized_matmul`` once (the eager
    translator's uint32 ``view`` of B has no shapeless form). None: not prepackable here (the
    eager translator is used, and a shapeless trace of it fails and runs eagerly)."""
    a = {**{k: v for k, v in st.opdef.attrs.items() if v is not inspect_empty()}, **st.attrs}
    K, N, bs, bits = a.get("K"), a.get("N"), a.get("block_size"), a.get("bits", 4)
    if None in (K, N, bs) or K % bs or bs not in q._MLX_GROUPS or a.get("weight_prepacked", 0):
        return None
    names = list(st.inputs) + [""] * (6 - len(st.inputs))
    if names[4]:
        return None                                   # g_idx: the eager translator's business
    consts = program.constants
    B = consts.get(names[1])
    scales = consts.get(names[2])
    zp = consts.get(names[3]) if names[3] else None
    if B is None or scales is None or (names[3] and zp is None) or B.dtype != mx.uint8:
        return None
    kb = K // bs
    if B.size != N * kb * bs * bits // 8 or scales.size != N * kb:
        return None
    if zp is not None:
        want = N * (-(-kb * bits // 8)) if zp.dtype == mx.uint8 else N * kb
        if zp.size != want:
            return None
    # exactly the eager translator's operands, per compute type (float32, or the scales' half type where the
    # build keeps half products half)
    types = [mx.float32] + ([scales.dtype] if program.config.half_nbits and scales.dtype != mx.float32 else [])
    packed = {}
    with mx.stream(mx_device(program.device)):
        w = mx.contiguous(B.reshape(N, kb * bs * bits // 8).view(mx.uint32))
        for t in types:
            s = scales.reshape(N, kb).astype(t)
            zs = -q.block_zero_points(zp, N, kb, bits, t) * s
            packed[t] = (mx.contiguous(s), mx.contiguous(zs))
        mx.eval(w, *packed.values())

    def matmul_nbits_packed(A, B, scales, zero_points=None, g_idx=None, bias=None, *, K, N, block_size,
                            bits=4, accuracy_level=0, weight_prepacked=0):
        if A.shape[-1] != K:
            raise ValueError(f"A's last dim {A.shape[-1]} != K={K}")
        if bias is not None and bias.shape != (N,):
            raise ValueError(f"bias shape {bias.shape}, expected ({N},)")
        ct = q.nbits_compute_type(A.dtype)
        if ct not in packed:
            ct = mx.float32
        s, zs = packed[ct]
        y = mx.quantized_matmul(A.astype(ct), w, s, zs, transpose=True, group_size=block_size, bits=bits)
        if bias is not None:
            y = y + bias.astype(ct)
        return y.astype(A.dtype)
    return matmul_nbits_packed


def inspect_empty():
    import inspect
    return inspect.Parameter.empty


# ---------------------------------------------------------------------------- GatherBlockQuantized
def gather_block_quantized_traced(data, indices, scales, zero_points=None, *, bits=4, block_size=128,
                                  quantize_axis=1, gather_axis=0):
    """GatherBlockQuantized with the indices as data (eager reads them on the host): out-of-range
    indices fail a guard; the dequantization is eager's (``dequantize_gathered``), or where the build asks for a step
    of our kernels only (``build.row_products``) one kernel of ours on the indices as they come (``take_dequant_rows``,
    bit for bit the same rows)."""
    ga, cols, kb = gbq_layout(data, scales, bits, block_size, gather_axis)
    if kb * block_size != cols:
        raise Untraceable("traced GatherBlockQuantized: blocks that do not tile the row")
    idx = indices if isinstance(indices, mx.array) else _const_indices(np.asarray(indices))
    n = data.shape[ga]
    out_shape = data.shape[:ga] + tuple(idx.shape) + data.shape[ga + 1:-1] + (cols,)
    if build.row_products() and cuda_kernels.enabled() and ga == 0 and \
            cuda_kernels.take_dequant_reason(data, scales, zero_points, idx, block_size, bits) is None:
        add_guard(every((idx >= -n) & (idx < n)))
        return cuda_kernels.take_dequant_rows(data, scales, zero_points, idx, block_size, bits).reshape(out_shape)
    idx = idx.astype(mx.int64)
    add_guard(every((idx >= -n) & (idx < n)))
    flat = mx.clip(mx.where(idx < 0, idx + n, idx), 0, n - 1).reshape(-1).astype(mx.int32)
    w = dequantize_gathered(data, scales, zero_points, flat, ga, cols, kb, block_size, bits)
    return w.reshape(out_shape)


# ---------------------------------------------------------------------------- QMoE
def prepack_qmoe(program, st):
    """QMoE with constant expert weights, packed for ``mx.gather_qmm`` once (the eager translator's uint32
    ``view`` of the weights has no shapeless form). None: not prepackable (the eager translator is used)."""
    from ..kernels.interpreter import mx_device
    from ..kernels.ops import contrib_moe as m
    a = {**{k: v for k, v in st.opdef.attrs.items() if v is not inspect_empty()}, **st.attrs}
    names = list(st.inputs) + [""] * (13 - len(st.inputs))
    consts = program.constants
    parts = []
    for w, s, z in ((names[2], names[3], names[11]), (names[5], names[6], names[12])):
        arrs = [consts.get(n) if n else None for n in (w, s, z)]
        if arrs[0] is None or arrs[1] is None or (z and arrs[2] is None):
            return None
        parts.append(arrs)
    bits, bs = a.get("expert_weight_bits", 4), a.get("block_size", 0)
    with mx.stream(mx_device(program.device)):
        fcs = [m.quantized_fc(w, s, z, bits, bs) for w, s, z in parts]
        packed = [mx.contiguous(o) for fc in fcs for o in fc.operands]
        mx.eval(*packed)        # evaluated now: the closures capture them as constants
    fc1, fc2 = fcs

    def qmoe_packed(input, router_probs, fc1_experts_weights, fc1_scales=None, fc1_experts_bias=None,
                    fc2_experts_weights=None, fc2_scales=None, fc2_experts_bias=None, *rest, k=1,
                    activation_type="relu", normalize_routing_weights=0, activation_alpha=1.0, activation_beta=0.0,
                    swiglu_limit=None, expert_weight_bits=4, **_checked):
        # (the rest: fc3 / zero points / scales the check refused or packed above; attributes it checked)
        return m.qmoe_with(fc1, fc2, input, router_probs, fc1_experts_weights, fc1_experts_bias, fc2_experts_weights,
                           fc2_experts_bias, k=k, activation_type=activation_type,
                           normalize_routing_weights=normalize_routing_weights, activation_alpha=activation_alpha,
                           activation_beta=activation_beta, swiglu_limit=swiglu_limit,
                           expert_weight_bits=expert_weight_bits)
    return qmoe_packed
