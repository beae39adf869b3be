"""The decode/prefill pair for groups with attention: route each call by its query length."""
from __future__ import annotations

import dataclasses
import weakref

import mlx.core as mx
import numpy as np

from ..kernels import cuda_kernels
from ..kernels import dtypes as dt
from ..kernels.merge import step_readers
from ..kernels.passes import Step
from ..kernels.registry import MS, norm_domain
from ..tuning import Tuning
from .config import DECODE, PREFILL, PREFILL_EXACT

from .analysis import constant_if
from .core import Call, CompiledSubgraph
from .result import RunnerOptions, RunResult
from .decode_ops import (gather_block_quantized_traced, gather_elements_traced, gather_padded_tail, gather_traced,
                         gqa_growing_traced, gqa_traced, prepack_nbits, prepack_qmoe, rotary_traced,
                         scatter_elements_traced)

#: symbolic dims a decode key leaves free: the growing attention-mask length. The past
#: length stays in the key: with genai's shared buffer it is the buffer size (fixed for a
#: generation), and the traced attention bakes it into the present's shape.
FREE_DIM_NAMES = frozenset({"total_sequence_length"})
#: a growing-KV decode (past_present_share_buffer false) leaves the past length free too
GROWING_FREE_DIM_NAMES = frozenset({"total_sequence_length", "past_sequence_length"})
SEQ_DIM_NAME = "sequence_length"
TOTAL_DIM_NAME = "total_sequence_length"
PAST_DIM_NAME = "past_sequence_length"
BATCH_DIM_NAME = "batch_size"
#: ops whose outputs a prompt padded at its end changes (their state is the sequence's tail)
UNPADDABLE = frozenset({"CausalConvWithState"})
#: prefill buckets: 16, 32, 64, ... (capped by the KV buffer and the rotary cache)
BUCKET_MIN = 16
#: the shortest bucket where a short prompt's call is launch-bound (MLX's CUDA backend with our prompt kernel):
#: shorter prompts share it, one trace and verification instead of one per bucket (docs/performance.md)
LAUNCH_BOUND_BUCKET = 256


def bucket_for(s: int, cap: int, least: int = BUCKET_MIN) -> int | None:
    """The padded length for a prompt of ``s`` tokens, at least ``least`` (None: no bucket fits under ``cap``)."""
    b = least
    while b < s:
        b *= 2
    b = min(b, cap)
    return b if b >= s else None


def least_bucket(config, tuning: Tuning) -> int:
    """The shortest prefill bucket for a program built with ``config`` (``passes.BuildConfig``): ``tuning``'s
    ``bucket_min``, else ``LAUNCH_BOUND_BUCKET`` on MLX's CUDA backend with the prompt kernel, else ``BUCKET_MIN``.
    Kept under the least fused-attention bucket and within the prompt kernel's lengths, so a padded prompt takes
    its own length's attention form (the eager answer it is verified against)."""
    cuda = config.device == "gpu" and config.cuda_kernels and cuda_kernels.cuda_backend()
    want = tuning.bucket_min or (LAUNCH_BOUND_BUCKET if cuda and config.prompt_kernel else BUCKET_MIN)
    b = BUCKET_MIN
    while b < want and (not config.fused_attention or b * 2 < config.fused_attention_min) \
            and b * 2 <= cuda_kernels.PROMPT_MAX:
        b *= 2
    return b


def rope_rows(program) -> int | None:
    """Rows of the constant rotary caches of the group's GroupQueryAttention nodes (None: unknown)."""
    rows = []
    for st in program.steps:
        if st.node.op_type == "GroupQueryAttention" and st.attrs.get("do_rotary", 0):
            c = program.constants.get(st.inputs[7]) if len(st.inputs) > 7 else None
            if c is None:
                return None
            rows.append(int(c.shape[0]))
    return min(rows) if rows else 1 << 30


class BucketedPrefill(CompiledSubgraph):
    """Prefill on prompts padded to a bucket: one trace per bucket, not per prompt length.

    Only for a first prompt whose mask-like inputs (``total_sequence_length`` dims) are all ones (a batch's
    rows all of one length), with a shared KV buffer at least as long as the bucket. Inputs are padded with
    zeros along their ``sequence_length``/``total_sequence_length`` dims; outputs are cropped
    back along ``sequence_length``; present rows past the valid length are zeroed in the trace.
    A bucket's closure is trusted after matching eager at two different prompt lengths, the second in the first's
    call where it can (``_another_length``: the prompt less its last token).

    A first prompt reads nothing of its past KV buffers: where GroupQueryAttention is their only reader,
    the closure gets device zeros in their place (``zero_past``: no upload of genai's whole buffer), and its
    presents' first rows, hinted, are all that is written back (``RunResult.standins``).
    """

    def __init__(self, program, stats=None, tuning: Tuning | None = None):
        super().__init__(program, PREFILL, stats, traced_overrides(program, False, padded=True), label="prefill",
                         tuning=tuning)
        self.seq = sorted(dims_named(program, {SEQ_DIM_NAME}))
        self.total = sorted(dims_named(program, {TOTAL_DIM_NAME}))
        self.batch = sorted(dims_named(program, {BATCH_DIM_NAME}))
        self.past = sorted(dims_named(program, {PAST_DIM_NAME}))
        self.rows = rope_rows(program)
        #: steps a padded prompt changes: a windowed KV cache (GroupQueryAttention sliding_window_cache=1)
        #: needs seqlens_k + 1 >= S (ORT rejects a padded prompt); a causal convolution's present state is
        #: the input's last positions (the padding's); an If of constants may pick its branch by the padded
        #: length (Phi-3 LongRoPE's caches). Such groups prefill shape-keyed (``prefill_exact``)
        self.windowed = any((st.node.op_type == "GroupQueryAttention" and st.attrs.get("sliding_window_cache", 0))
                            or st.node.op_type in UNPADDABLE or constant_if(st) for st in program.steps)
        g = program.graph
        self.out_seq = [(j, ax) for j, n in enumerate(program.outputs)
                        for ax, d in enumerate(g.value(n).shape or ()) if d == SEQ_DIM_NAME]
        self.zero_past = unread_past(program, {i for i, _ in self.past})
        self.least = least_bucket(program.config, self.tuning)
        self._zeros: dict[tuple, mx.array] = {}         # (shape, ONNX type) -> evaluated zeros

    def _standin(self, i: int, a) -> mx.array | None:
        """Device zeros shaped and typed as input ``i`` (one evaluated array per shape and type), or None."""
        t = self._in_types[i] or dt.onnx_type_of(a)
        key = (tuple(a.shape), t)
        z = self._zeros.get(key)
        if z is None and t in dt.MLX and t not in dt.CARRIERS:
            z = self._zeros[key] = mx.zeros(key[0], dt.MLX[t])
            mx.eval(z)
        return z

    def release(self) -> None:
        self._zeros.clear()
        super().release()

    def _another_length(self, inputs: list) -> list | None:
        """The prompt's first s - 1 tokens (its sequence and mask dims cut); whether they pad to the same key is the
        caller's check (``_verify_another``)."""
        sb = self.bucket(inputs)
        if sb is None:
            return None
        cut = list(inputs)
        for i, ax in self.seq + self.total:
            idx = [slice(None)] * cut[i].ndim
            idx[ax] = slice(0, sb[0] - 1)
            cut[i] = cut[i][tuple(idx)]
        return cut

    def bucket(self, inputs: list) -> tuple[int, int] | None:
        """(prompt length, bucket) when this call can be padded (one batch size and length, masks all ones), else
        None."""
        if not (self.seq and self.total and self.past) or self.rows is None or self.windowed:
            return None
        size = {(i, ax): inputs[i].shape[ax] for i, ax in self.seq + self.total + self.batch + self.past
                if inputs[i] is not None and inputs[i].ndim > ax}
        if len(size) != len(self.seq) + len(self.total) + len(self.batch) + len(self.past):
            return None
        s = {size[d] for d in self.seq + self.total}
        p = {size[d] for d in self.past}
        if len(s) != 1 or len(p) != 1 or len({size[d] for d in self.batch}) > 1:
            return None
        (s,), (p,) = s, p
        if s < 2:
            return None
        for i in {i for i, _ in self.total}:
            a = inputs[i]
            if a.dtype.kind not in "iub" or not np.all(a == 1):
                return None
        b = bucket_for(s, min(p, self.rows), self.least)
        return (s, b) if b is not None else None

    def _prepare(self, inputs: list):
        sb = self.bucket(inputs)
        if sb is None:
            return None
        s, b = sb
        axes = {}
        for i, ax in self.seq + self.total:
            axes.setdefault(i, []).append(ax)
        padded = list(inputs)
        for i, ax_list in axes.items():
            widths = [(0, 0)] * inputs[i].ndim
            for ax in ax_list:
                widths[ax] = (0, b - s)
            padded[i] = np.pad(inputs[i], widths)
        standins = []
        for i in self.zero_past:
            if inputs[i] is not None and inputs[i].size and (z := self._standin(i, inputs[i])) is not None:
                padded[i] = z
                standins.append(i)
        crop = self.out_seq

        def post(outs: list) -> list:
            outs = list(outs)
            for j, ax in crop:
                idx = [slice(None)] * outs[j].ndim
                idx[ax] = slice(0, s)
                outs[j] = outs[j][tuple(idx)]
            return outs
        return Call(padded, tuple(None if a is None else a.shape for a in inputs), post, padded=True,
                    standins=frozenset(standins))


def unread_past(program, past: set[int]) -> frozenset[int]:
    """The group inputs among ``past`` that only GroupQueryAttention reads, as past_key/past_value (not through
    a windowed cache): a first prompt does not read their values."""
    readers = step_readers(program.graph, program.steps)
    out = set()
    for i in past:
        name = program.inputs[i]
        sts = readers.get(name, [])
        if sts and name not in program.outputs and all(
                isinstance(st, Step) and st.node.op_type == "GroupQueryAttention"
                and norm_domain(st.node.domain) == MS and not st.attrs.get("sliding_window_cache", 0)
                and all(k in (3, 4) for k, n in enumerate(st.inputs) if n == name) for st in sts):
            out.add(i)
    return frozenset(out)


def traced_overrides(program, decode: bool | None, padded: bool = False, growing: bool = False) -> dict:
    """Step index -> OpDef with a trace-friendly translator: Gather, GatherElements, ScatterElements,
    GatherBlockQuantized (indices as data), RotaryEmbedding (positions as data), MatMulNBits and QMoE (weights prepacked) and, for attention
    closures, GroupQueryAttention (``decode``: total length as data too; ``growing``: a decode whose
    past length grows, present = past + the new row)."""
    out = {}
    for i, st in enumerate(program.steps):
        dom = norm_domain(st.node.domain)
        if st.node.op_type == "Gather" and dom == "":
            k = _sequence_tail(program, st) if padded else None
            fn = gather_traced if k is None else gather_padded_tail(k)
            out[i] = dataclasses.replace(st.opdef, fn=fn, const_inputs=frozenset(), wants_ctx=False)
        elif st.node.op_type in ("GatherElements", "ScatterElements") and dom == "" and st.node.since_version >= 11:
            fn = gather_elements_traced if st.node.op_type == "GatherElements" else scatter_elements_traced
            out[i] = dataclasses.replace(st.opdef, fn=fn, const_inputs=frozenset(), wants_ctx=False)
        elif st.node.op_type == "RotaryEmbedding" and dom == MS:
            out[i] = dataclasses.replace(st.opdef, fn=rotary_traced, const_inputs=frozenset(), wants_ctx=False)
        elif st.node.op_type == "GatherBlockQuantized" and dom == MS:
            out[i] = dataclasses.replace(st.opdef, fn=gather_block_quantized_traced, const_inputs=frozenset(),
                                         wants_ctx=False)
        elif st.node.op_type in ("MatMulNBits", "QMoE") and dom == MS:
            fn = _prepacked(program, i)
            if fn is not None:
                out[i] = dataclasses.replace(st.opdef, fn=fn, wants_ctx=False)
        elif decode is not None and st.node.op_type == "GroupQueryAttention" and dom == MS:
            const = frozenset() if decode else st.opdef.const_inputs
            fn = gqa_growing_traced if (decode and growing) else gqa_traced(decode, padded)
            out[i] = dataclasses.replace(st.opdef, fn=fn, const_inputs=const, wants_ctx=False)
    return out


def _sequence_tail(program, st) -> int | None:
    """``k`` when step ``st`` gathers one row ``k`` < 0 counted from the end of a ``sequence_length`` axis 1 (a
    padded prompt's end is its padding), else None."""
    if len(st.inputs) < 2 or int(st.attrs.get("axis", 0)) != 1:
        return None
    idx = program.constants.get(st.inputs[1])
    if idx is None or np.ndim(idx) != 0 or not np.issubdtype(np.asarray(idx).dtype, np.integer) or int(idx) >= 0:
        return None
    shape = program.graph.value(st.inputs[0]).shape or ()
    return int(idx) if len(shape) > 1 and shape[1] == SEQ_DIM_NAME else None


_PREPACKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _prepacked(program, i: int):
    """The prepacked MatMulNBits / QMoE translator of step ``i`` (shared by a program's closures)."""
    per = _PREPACKED.setdefault(program, {})
    if i not in per:
        try:
            st = program.steps[i]
            per[i] = (prepack_qmoe if st.node.op_type == "QMoE" else prepack_nbits)(program, st)
        except Exception:  # noqa: BLE001 - not prepackable: the eager translator is traced (and may fail)
            per[i] = None
    return per[i]


def dims_named(program, names) -> frozenset:
    """(input index, axis) of every group-input dim whose symbolic name is in ``names``."""
    g = program.graph
    return frozenset((i, ax) for i, n in enumerate(program.inputs)
                     for ax, d in enumerate(g.value(n).shape or ()) if d in names)


class AttentionRunner:
    """Decode (S == 1: shapeless) and prefill (shape-keyed) closures over one attention group."""

    def __init__(self, program, options: RunnerOptions, stats=None):
        self.program = program
        self.name = program.graph.name
        self.seq_dims = sorted(dims_named(program, {SEQ_DIM_NAME}))
        self.decode = None
        self.prefill = None
        tuning = options.tuning
        decode_ok = options.compiles("decode")
        if decode_ok and self.seq_dims:
            self.decode = CompiledSubgraph(program, DECODE, stats, traced_overrides(program, True),
                                           dims_named(program, FREE_DIM_NAMES), label="decode", tuning=tuning)
        self.decode_growing = None
        self.past_dims = sorted(dims_named(program, {PAST_DIM_NAME}))
        self.total_dims = sorted(dims_named(program, {TOTAL_DIM_NAME}))
        if decode_ok and self.seq_dims and self.past_dims and self.total_dims:
            self.decode_growing = CompiledSubgraph(program, DECODE, stats,
                                                   traced_overrides(program, True, growing=True),
                                                   dims_named(program, GROWING_FREE_DIM_NAMES),
                                                   label="decode_growing", tuning=tuning)
        self.prefill_exact = None
        if options.compiles("prefill"):
            self.prefill = BucketedPrefill(program, stats, tuning)
            self.prefill_exact = CompiledSubgraph(program, PREFILL_EXACT, stats, traced_overrides(program, False),
                                                  label="prefill_exact", tuning=tuning)
        if stats is not None:
            stats.group(self.name)["compiled"] = "+".join(p.label for p in self.parts())
        self.eager_calls = 0

    def parts(self) -> list[CompiledSubgraph]:
        return [p for p in (self.decode, self.decode_growing, self.prefill, self.prefill_exact) if p is not None]

    def growing(self, inputs: list, s: int) -> bool:
        """Whether this call's past grows into the present (separate buffers): every
        ``past_sequence_length`` dim is P and every ``total_sequence_length`` dim is P + S."""
        try:
            p = {inputs[i].shape[ax] for i, ax in self.past_dims if inputs[i] is not None}
            t = {inputs[i].shape[ax] for i, ax in self.total_dims if inputs[i] is not None}
        except (AttributeError, IndexError):
            return False
        return len(p) == 1 and len(t) == 1 and t.pop() == p.pop() + s

    def seq_len(self, inputs: list) -> int | None:
        """The call's query length (None when no input has a ``sequence_length`` dim)."""
        for i, ax in self.seq_dims:
            a = inputs[i]
            if a is not None and a.ndim > ax:
                return int(a.shape[ax])
        return None

    def run(self, inputs: list, probe=None, since: tuple | None = None) -> RunResult:
        s = self.seq_len(inputs)
        if s == 1:
            # a path switched off runs eagerly
            r = self.decode_growing if self.decode_growing is not None and self.growing(inputs, 1) else self.decode
        elif self.prefill is not None and self.prefill.bucket(inputs) is not None:
            r = self.prefill
        else:
            r = self.prefill_exact
        if r is None:
            self.eager_calls += 1
            return RunResult(self.program.run(inputs, probe=probe))
        return r.run(inputs, probe, since)

    def steady(self, inputs: list) -> None:
        return None             # decode and prefill have their own memo (keys, mirrors, row hints)

    def replay(self, steady, inputs: list) -> None:
        return None

    def release(self) -> None:
        for p in self.parts():
            p.release()
