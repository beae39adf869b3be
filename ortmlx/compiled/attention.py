"""The decode/prefill pair for groups with attention: route each call by its query length."""
from __future__ import annotations

import dataclasses

from ..kernels.registry import MS, norm_domain
from .config import DECODE, PREFILL
from .core import CompiledSubgraph
from .decode_ops import gather_traced, gqa_traced

#: symbolic dims a decode key leaves free: the growing attention-mask length. The past
#: length stays in the key: with genai's shared buffer it is the buffer size (fixed for a
#: generation), and the traced attention bakes it into the present's shape.
FREE_DIM_NAMES = frozenset({"total_sequence_length"})
SEQ_DIM_NAME = "sequence_length"


def traced_overrides(program, decode: bool | None) -> dict:
    """Step index -> OpDef with a trace-friendly translator: Gather (indices as data) and, for
    attention closures, GroupQueryAttention (``decode``: total length as data too)."""
    out = {}
    for i, st in enumerate(program.steps):
        dom = norm_domain(st.node.domain)
        if st.node.op_type == "Gather" and dom == "":
            out[i] = dataclasses.replace(st.opdef, fn=gather_traced, const_inputs=frozenset(), wants_ctx=False)
        elif decode is not None and st.node.op_type == "GroupQueryAttention" and dom == MS:
            const = frozenset() if decode else st.opdef.const_inputs
            out[i] = dataclasses.replace(st.opdef, fn=gqa_traced(decode), const_inputs=const, wants_ctx=False)
    return out


def dims_named(program, names) -> frozenset:
    """(input index, axis) of every group-input dim whose symbolic name is in ``names``."""
    g = program.graph
    return frozenset((i, ax) for i, n in enumerate(program.inputs)
                     for ax, d in enumerate(g.value(n).shape or ()) if d in names)


class AttentionRunner:
    """Decode (S == 1: shapeless) and prefill (shape-keyed) closures over one attention group."""

    supports_probe = True

    def __init__(self, program, options, stats=None):
        self.program = program
        self.name = program.graph.name
        self.seq_dims = sorted(dims_named(program, {SEQ_DIM_NAME}))
        self.decode = None
        self.prefill = None
        if not options.no_decode_compile and self.seq_dims:
            self.decode = CompiledSubgraph(program, DECODE, stats, traced_overrides(program, True),
                                           dims_named(program, FREE_DIM_NAMES), label="decode")
        if not options.no_prefill_compile:
            self.prefill = CompiledSubgraph(program, PREFILL, stats, traced_overrides(program, False), label="prefill")
        if stats is not None and hasattr(stats, "group"):
            stats.group(self.name)["compiled"] = "+".join(p.label for p in self.parts())
        self.eager_calls = 0

    def parts(self) -> list[CompiledSubgraph]:
        return [p for p in (self.decode, self.prefill) if p is not None]

    def seq_len(self, inputs: list) -> int | None:
        """The call's query length (None when no input has a ``sequence_length`` dim)."""
        for i, ax in self.seq_dims:
            a = inputs[i]
            if a is not None and a.ndim > ax:
                return int(a.shape[ax])
        return None

    def run(self, inputs: list, probe=None) -> list:
        s = self.seq_len(inputs)
        r = self.decode if s == 1 else self.prefill     # a path switched off runs eagerly
        if r is None:
            self.eager_calls += 1
            return self.program.run(inputs, probe=probe) if probe is not None else self.program.run(inputs)
        return r.run(inputs, probe)

    def release(self) -> None:
        for p in self.parts():
            p.release()
