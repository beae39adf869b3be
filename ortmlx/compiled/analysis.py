"""Which parts of a Program can be traced, and what a trace bakes in.

``host_plan`` replays the interpreter's host/device decisions (``Program.build``)
on the values of one eager call, without evaluating anything, and reports:
which group inputs are read on the host (their *values* get baked into a trace),
which host values derive from traced inputs (shapes baked at trace time), and a
reason when the group cannot be traced at all.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from ..kernels.interpreter import HOST_MAX_ELEMS, host_evaluable

#: op types whose presence makes a group an attention (decode/prefill) group
ATTENTION_OPS = frozenset({"GroupQueryAttention", "MultiHeadAttention", "Attention", "RotaryEmbedding",
                           "SparseAttention", "PagedAttention"})


@dataclass(frozen=True)
class HostPlan:
    host_inputs: frozenset[int]        # group inputs whose values are read on the host
    dynamic_host: tuple[str, ...]      # shape-derived values a trace would bake (not hoisted)
    host_outputs: frozenset[int]       # group outputs that are host (numpy) values
    reason: str | None                 # why this group cannot be traced (None: it can)
    hoist: tuple[str, ...] = ()        # shape-derived values fed to a shapeless closure as data
    hoist_steps: frozenset[int] = frozenset()   # steps that compute them (run per call, not traced)
    #: traced values whose shapes were baked as the key's (``keyed``): checked unchanged at every verification
    keyed: tuple[str, ...] = ()

    def shapeless_reason(self) -> str | None:
        """Why a shapeless trace of this plan could bake something wrong (None: nothing found)."""
        if self.reason:
            return self.reason
        if self.host_inputs:
            return f"group inputs {sorted(self.host_inputs)} are read on the host"
        if self.dynamic_host:
            return f"values computed from traced shapes would be baked ({', '.join(self.dynamic_host[:3])})"
        if self.host_outputs:
            return f"outputs {sorted(self.host_outputs)} are host values"
        return None


def constant_if(st) -> bool:
    """An If whose branches are constants alone (no outer values, every node a Constant): taking a branch reads
    no data, so the If is host work on its condition (Phi-3 LongRoPE's rotary caches, chosen by the length)."""
    if st.node.op_type != "If" or not st.bodies:
        return False
    return all(not names and all(b.node.op_type == "Constant" for b in prog.steps)
               for prog, names in st.bodies.values())


def static_reason(program) -> str | None:
    """Why no trace of this program can be attempted, from its nodes alone."""
    for st in program.steps:
        if st.node.has_subgraphs and not constant_if(st):
            return f"{st.node.label}: control-flow node"
        if st.opdef.host_computed:
            return f"{st.node.label}: reads data on the host"
        if st.opdef.containers:
            return f"{st.node.label}: sequence/optional values (eager only)"
    return None


def is_attention(program) -> bool:
    return any(st.node.op_type in ATTENTION_OPS for st in program.steps)


def host_plan(program, env: dict, hoist: bool = False, keyed=None) -> HostPlan:
    """Replay ``Program.build``'s host decisions using the values of an eager call (``env``).

    Pass 1 finds which steps run on the host and which group inputs they read by value.
    Pass 2 follows two taints: *traced* (computed from traced inputs' data) and *shaped*
    (computed from traced inputs' shapes: a trace bakes them). With ``hoist``, shaped
    values that only feed traced computations become closure inputs computed per call.
    ``keyed(name)``: whether a value's declared shape is fixed by the closure's key (``keyed_shapes``); the shape of
    such a traced value is no shaped value, and the plan lists those values (``HostPlan.keyed``) so that each
    verification checks their shapes did not change.
    """
    used: set[str] = set()
    plan = _host_plan(program, env, hoist, keyed, used)
    return dataclasses.replace(plan, keyed=tuple(sorted(used))) if used and plan.reason is None else plan


def _host_plan(program, env: dict, hoist: bool, keyed, used: set) -> HostPlan:
    reason = static_reason(program)
    if reason:
        return HostPlan(frozenset(), (), frozenset(), reason)
    in_pos = {n: i for i, n in enumerate(program.inputs)}
    host = {n: True for n in program.inputs}
    host_inputs: set[int] = set()
    on_host: list[bool] = []
    for st in program.steps:
        od = st.opdef
        names = [n for n in st.inputs if n]
        flags = [True if not n else host.get(n, False) for n in st.inputs]
        sizes_ok = all(not host.get(n, False) or _size(env.get(n)) <= HOST_MAX_ELEMS for n in names)
        h = host_evaluable(od, st.out_types, flags) and sizes_ok
        on_host.append(h)
        if h:
            if not od.shape_only:
                host_inputs.update(in_pos[n] for n in names if n in in_pos and host.get(n))
            outs_host = {o: True for o in st.outputs if o}
        else:
            for i, n in enumerate(st.inputs):
                if not n:
                    continue
                if i in od.const_inputs:
                    if host.get(n) and n in in_pos:
                        host_inputs.add(in_pos[n])
                else:
                    host[n] = False
            outs_host = {o: isinstance(env.get(o), np.ndarray) for o in st.outputs if o}
        host.update(outs_host)
    host_outputs = frozenset(j for j, o in enumerate(program.outputs) if host.get(o, False))

    traced = {n for i, n in enumerate(program.inputs) if i not in host_inputs}
    shaped: set[str] = set()
    uses: list[tuple[int, str]] = []            # (step, shaped value) a traced computation consumes
    producer: dict[str, int] = {}
    for k, st in enumerate(program.steps):
        od = st.opdef
        names = [n for n in st.inputs if n]
        t_in = any(n in traced for n in names)
        for i, n in enumerate(st.inputs):
            if n and not on_host[k] and i in od.const_inputs and n in traced:
                return HostPlan(frozenset(host_inputs), (), host_outputs,
                                f"{st.node.label}: input {i} ('{n}') is read on the host from a traced value")
        outs = [o for o in st.outputs if o]
        for o in outs:
            producer[o] = k
        if on_host[k]:
            fixed = [n for n in names if n in traced]
            if any(n in shaped for n in names) or (t_in and not (
                    od.shape_only and keyed is not None and all(keyed(n) for n in fixed))):
                shaped.update(outs)
            elif t_in:
                used.update(fixed)
        elif t_in:
            traced.update(outs)
            uses.extend((k, n) for i, n in enumerate(st.inputs)
                        if n in shaped and i not in od.const_inputs)
            baked = [n for i, n in enumerate(st.inputs) if n in shaped and i in od.const_inputs]
            if baked:
                uses.append((k, "@" + baked[0]))     # read on the host: cannot be hoisted
        elif any(n in shaped for n in names):
            shaped.update(outs)
    out_shaped = [o for o in program.outputs if o in shaped]
    need = sorted({n for _, n in uses} | set(out_shaped))
    if not need:
        return HostPlan(frozenset(host_inputs), (), host_outputs, None)
    if not hoist or any(n.startswith("@") for n in need) or out_shaped:
        return HostPlan(frozenset(host_inputs), tuple(n.lstrip("@") for n in need), host_outputs, None)
    steps = _ancestors(program, need, producer)
    if any(o in traced for k in steps for o in program.steps[k].outputs if o):
        return HostPlan(frozenset(host_inputs), tuple(need), host_outputs, None)   # would hoist traced work
    leaked = [o for k in steps for o in program.steps[k].outputs
              if o and o not in need and any(o in st.inputs for j, st in enumerate(program.steps) if j not in steps)]
    if leaked:
        return HostPlan(frozenset(host_inputs), tuple(need), host_outputs, None)
    return HostPlan(frozenset(host_inputs), (), host_outputs, None, tuple(need), frozenset(steps))


def keyed_shapes(program, free: frozenset):
    """``host_plan``'s ``keyed`` for a key that leaves the group inputs' dims ``free`` ((input, axis)) free and fixes
    the others: a value whose declared shape has only whole-number dims and names (or expressions, e.g.
    ``batch_size * sequence_length``) of the fixed input dims. A wrong declaration would bake a wrong value: the
    plan lists the values taken so (``HostPlan.keyed``), and each verification checks their shapes unchanged."""
    g = program.graph
    fixed, loose = set(), set()
    for i, n in enumerate(program.inputs):
        for ax, d in enumerate(g.value(n).shape or ()):
            if isinstance(d, str):
                (loose if (i, ax) in free else fixed).add(d)
    fixed -= loose

    def keyed(name: str) -> bool:
        shape = g.value(name).shape
        return shape is not None and all(
            isinstance(d, int) or (isinstance(d, str) and set(_NAME.findall(d)) <= fixed and _NAME.search(d))
            for d in shape)
    return keyed


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _ancestors(program, names, producer: dict) -> set[int]:
    """Indices of the steps ``names`` are computed by (transitively, within the group)."""
    todo, seen = list(names), set()
    while todo:
        n = todo.pop()
        k = producer.get(n)
        if k is None or k in seen:
            continue
        seen.add(k)
        todo.extend(i for i in program.steps[k].inputs if i)
    return seen


def _size(v) -> int:
    return int(getattr(v, "size", 0)) if v is not None else 0


def hoist_free_work(program, env: dict, plan: HostPlan, free_inputs) -> HostPlan:
    """Move small integer computations over shape-varying (free-dim) group inputs out of a
    shapeless trace: they run per call before the closure and enter it as data.

    Example: genai's decode reads ``attention_mask`` [1, T] (T grows every token) only through
    ReduceSum -> Sub -> Cast (seqlens_k). Hoisted, every value the closure sees has a fixed shape.
    Only steps whose inputs are free group inputs, constants or values already hoisted, and whose
    outputs were small integer/bool tensors in this call, are moved; a value that a traced step
    would read on the host, or that is a group output, keeps the plan as it was.
    """
    if plan.reason or not free_inputs:
        return plan
    free = {program.inputs[i] for i in free_inputs}
    hoisted = set(plan.hoist_steps)
    avail = set(free) | set(program.constants) | set(plan.hoist)
    avail.update(o for k in hoisted for o in program.steps[k].outputs if o)
    moved: set[int] = set()
    derived: set[str] = set()
    for k, st in enumerate(program.steps):
        if k in hoisted or st.opdef.host_computed or st.node.has_subgraphs:
            continue
        ins = [n for n in st.inputs if n]
        outs = [o for o in st.outputs if o]
        if not ins or not outs or not all(n in avail for n in ins) or not any(n in free or n in derived for n in ins):
            continue
        if not all(_small_int(env.get(o)) for o in outs):
            continue
        moved.add(k)
        avail.update(outs)
        derived.update(outs)
    if not moved:
        return plan
    keep = [j for j in range(len(program.steps)) if j not in moved and j not in hoisted]
    need = sorted({n for j in keep for n in program.steps[j].inputs if n in derived})
    for j in keep:
        st = program.steps[j]
        if any(n in derived and i in st.opdef.const_inputs for i, n in enumerate(st.inputs)):
            return plan                     # a traced step would read it on the host
    if not need or any(o in derived for o in program.outputs):
        return plan
    used = _ancestors(program, need, {o: k for k in moved for o in program.steps[k].outputs if o})
    return dataclasses.replace(plan, hoist=tuple(plan.hoist) + tuple(need),
                               hoist_steps=frozenset(hoisted | used))


def _small_int(v) -> bool:
    """An integer/bool tensor of at most HOST_MAX_ELEMS elements (MLX or NumPy)."""
    if v is None:
        return False
    if isinstance(v, np.ndarray):
        return v.size <= HOST_MAX_ELEMS and (v.dtype.kind in "iub")
    dtype = getattr(v, "dtype", None)
    size = getattr(v, "size", HOST_MAX_ELEMS + 1)
    if dtype is None or size > HOST_MAX_ELEMS:
        return False
    import mlx.core as mx
    return dtype == mx.bool_ or mx.issubdtype(dtype, mx.integer)
