"""Which parts of a Program can be traced, and what a trace bakes in.

``host_plan`` replays the interpreter's host/device decisions (``Program.build``)
on the values of one eager call, without evaluating anything, and reports:
which group inputs are read on the host (their *values* get baked into a trace),
which host values derive from traced inputs (shapes baked at trace time), and a
reason when the group cannot be traced at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.interpreter import HOST_MAX_ELEMS, host_evaluable

#: op types whose presence makes a group an attention (decode/prefill) group
ATTENTION_OPS = frozenset({"GroupQueryAttention", "MultiHeadAttention", "Attention", "RotaryEmbedding",
                           "SparseAttention", "PagedAttention"})


@dataclass(frozen=True)
class HostPlan:
    host_inputs: frozenset[int]        # group inputs whose values are read on the host
    dynamic_host: tuple[str, ...]      # labels of host steps that read traced values (shapes)
    host_outputs: frozenset[int]       # group outputs that are host (numpy) values
    reason: str | None                 # why this group cannot be traced (None: it can)

    def shapeless_reason(self) -> str | None:
        """Why a shapeless trace of this plan could bake something wrong (None: nothing found)."""
        if self.reason:
            return self.reason
        if self.host_inputs:
            return f"group inputs {sorted(self.host_inputs)} are read on the host"
        if self.dynamic_host:
            return f"host shape math on traced values ({', '.join(self.dynamic_host[:3])})"
        if self.host_outputs:
            return f"outputs {sorted(self.host_outputs)} are host values"
        return None


def static_reason(program) -> str | None:
    """Why no trace of this program can be attempted, from its nodes alone."""
    for st in program.steps:
        if st.node.has_subgraphs:
            return f"{st.node.label}: control-flow node"
        if st.opdef.host_computed:
            return f"{st.node.label}: reads data on the host"
    return None


def is_attention(program) -> bool:
    return any(st.node.op_type in ATTENTION_OPS for st in program.steps)


def host_plan(program, env: dict) -> HostPlan:
    """Replay ``Program.build``'s host decisions using the values of an eager call (``env``)."""
    reason = static_reason(program)
    in_pos = {n: i for i, n in enumerate(program.inputs)}
    host = {n: True for n in program.inputs}
    dynamic = set(program.inputs)
    host_inputs: set[int] = set()
    dyn_host: list[str] = []
    for st in program.steps:
        if reason:
            break
        od = st.opdef
        names = [n for n in st.inputs if n]
        flags = [True if not n else host.get(n, False) for n in st.inputs]
        sizes_ok = all(not host.get(n, False) or _size(env.get(n)) <= HOST_MAX_ELEMS for n in names)
        on_host = host_evaluable(od, st.out_types, flags) and sizes_ok
        is_dyn = any(n in dynamic for n in names)
        if on_host:
            if not od.shape_only:
                host_inputs.update(in_pos[n] for n in names if n in in_pos and host.get(n))
            if is_dyn:
                dyn_host.append(st.node.label)
            outs_host = {o: True for o in st.outputs if o}
        else:
            for i, n in enumerate(st.inputs):
                if not n:
                    continue
                if i in od.const_inputs:
                    if host.get(n):
                        if n in in_pos:
                            host_inputs.add(in_pos[n])
                        elif n in dynamic:
                            dyn_host.append(st.node.label)
                    elif n not in program.constants:
                        reason = f"{st.node.label}: input {i} ('{n}') is read on the host from an MLX value"
                else:
                    host[n] = False
            outs_host = {o: isinstance(env.get(o), np.ndarray) for o in st.outputs if o}
        host.update(outs_host)
        if is_dyn:
            dynamic.update(o for o in st.outputs if o)
    host_outputs = frozenset(j for j, o in enumerate(program.outputs) if host.get(o, False))
    return HostPlan(frozenset(host_inputs), tuple(dyn_host), host_outputs, reason)


def _size(v) -> int:
    return int(getattr(v, "size", 0)) if v is not None else 0
