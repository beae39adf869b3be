"""Decide which nodes MLX claims and group them into subgraphs ORT accepts.

A group is valid when no path leaves it and re-enters it (through an
unclaimed node or another group). Groups are grown greedily in topological
order: every claimed node that becomes ready joins the open group; the group
closes only when nothing claimed is ready, then unclaimed nodes are released.
Nothing can then leave a group and come back into it.
"""
from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

from ..kernels.interpreter import host_evaluable
from ..kernels.registry import REGISTRY, support_reason
from ..ir import OPTIONAL, SEQUENCE, Graph, Node


@dataclass
class Unclaimed:
    node: str
    op: str
    reason: str


@dataclass
class PartitionReport:
    graph: str
    device: str
    n_nodes: int
    groups: list[list[str]] = field(default_factory=list)          # node labels per group
    unclaimed: list[Unclaimed] = field(default_factory=list)
    syncs: list[str] = field(default_factory=list)      # host reads of device values (eager only)
    produced: frozenset[str] = frozenset()              # values the graph's nodes produce (identifies a body)
    absorbed_by: str = ""       # a control-flow body that runs on MLX inside this claimed node (its label)

    @property
    def n_claimed(self) -> int:
        return self.n_nodes if self.absorbed_by else sum(len(g) for g in self.groups)

    def absorb(self, label: str) -> None:
        """This body graph runs on MLX as part of the claimed control-flow node ``label``."""
        self.absorbed_by = label
        self.unclaimed = []

    def reasons(self) -> Counter:
        return Counter(u.reason for u in self.unclaimed)

    def format(self) -> str:
        if self.absorbed_by:
            return (f"graph '{self.graph}' on MLX {self.device}: all {self.n_nodes} nodes run on MLX inside the "
                    f"claimed {self.absorbed_by}")
        lines = [f"graph '{self.graph}' on MLX {self.device}: {self.n_claimed}/{self.n_nodes} nodes claimed "
                 f"in {len(self.groups)} group(s), {len(self.unclaimed)} left to the CPU EP"]
        for i, g in enumerate(self.groups):
            ops = Counter(lbl.split(" '")[0] for lbl in g)
            lines.append(f"  group {i}: {len(g)} nodes ({', '.join(f'{k} x{v}' for k, v in ops.most_common())})")
        for u in self.unclaimed:
            lines.append(f"  CPU: {u.op} '{u.node}': {u.reason}")
        for s in self.syncs:
            lines.append(f"  host sync (eager, never compiled): {s}")
        return "\n".join(lines)


def claim(graph: Graph, device: str, disabled_ops: frozenset[str] = frozenset()) -> tuple[list[list[Node]], PartitionReport]:
    """Return the claimed groups (each in topological order) and the partition report.

    Compute exchanges only tensors with ORT, so a sequence/optional value must live inside one group:
    nodes touching one that would cross a group boundary are refused and the claim is redone until
    no such value is left (each round refuses more nodes, so it ends).
    """
    refused: dict[int, str] = {}
    while True:
        claimed, report = _claim_nodes(graph, device, disabled_ops, refused)
        groups = _group(graph, claimed)
        crossing = container_crossings(graph, groups)
        if not crossing:
            break
        refused.update(crossing)
    report.groups = [[n.label for n in g] for g in groups]
    return groups, report


def _claim_nodes(graph: Graph, device: str, disabled_ops: frozenset[str],
                 refused: dict[int, str]) -> tuple[dict[int, bool], PartitionReport]:
    """Per node: claimed or not (with the reason in the report); ``refused``: node id -> reason imposed."""
    report = PartitionReport(graph.name, device, len(graph.nodes), produced=_produced(graph))
    producers = graph.producers()
    claimed: dict[int, bool] = {}
    host_known: set[str] = set(graph.constants) | set(graph.inputs)
    host_math: set[str] = set(graph.constants)     # constants and outputs of claimed host shape math
    for node in graph.nodes:
        reason, opdef = node_reason(node, graph, device, disabled_ops, host_math, host_known)
        if reason is None and id(node) in refused:
            reason = refused[id(node)]
        if reason is None:
            if opdef.control:
                host = ": conditions and trip counts are read on the host" if opdef.const_inputs else ""
                report.syncs.append(f"{node.label} runs its bodies eagerly{host}")
            for i in sorted(opdef.const_inputs):
                if i < len(node.inputs) and node.inputs[i] and node.inputs[i] not in host_known:
                    # read on the host after the device computes it: an eager sync; never traced
                    p = producers.get(node.inputs[i])
                    report.syncs.append(f"{node.label} reads input {i} ('{node.inputs[i]}') computed by "
                                        f"{p.label if p is not None else 'an outer scope'} on the device")
        ok = reason is None
        claimed[id(node)] = ok
        if not ok:
            report.unclaimed.append(Unclaimed(node.name, node.op_type if not node.domain or node.domain == "ai.onnx"
                                              else f"{node.domain}.{node.op_type}", reason))
            host_known.update(o for o in node.outputs if o)       # arrives from ORT as a host tensor
            continue
        _track_host(node, opdef, graph, host_math, host_known)
    return claimed, report


def container_crossings(graph: Graph, groups: list[list[Node]]) -> dict[int, str]:
    """Claimed nodes touching a sequence/optional value that is not inside one group -> the reason.

    Such a value would be a fused node's input or output (or a graph input/output, or from an outer
    scope), and Compute exchanges only tensors with ORT.
    """
    group_of = {id(n): k for k, g in enumerate(groups) for n in g}
    producers, consumers = graph.producers(), graph.consumers(implicit=True)
    outer = set(graph.inputs) | set(graph.outputs)
    out: dict[int, str] = {}
    for name, vi in graph.values.items():
        if vi.is_tensor:
            continue
        touching = ([producers[name]] if name in producers else []) + consumers.get(name, [])
        where = {group_of.get(id(n)) for n in touching}
        if not where - {None}:
            continue
        if name in outer:
            why = "a graph input or output"
        elif name not in producers:
            why = "produced outside this graph"
        elif None in where or len(where) > 1:
            why = "used by a node outside its group"
        else:
            continue
        reason = f"{vi.kind} '{name}' is {why}: sequence/optional values must stay inside one MLX group"
        out.update((id(n), reason) for n in touching if group_of.get(id(n)) is not None)
    return out


def _produced(graph: Graph) -> frozenset[str]:
    return frozenset(o for n in graph.nodes for o in n.outputs if o)


def claimed_bodies(groups: list[list[Node]]) -> dict[frozenset[str], str]:
    """The bodies (nested ones too) of the claimed control-flow nodes: produced values -> the node's label.

    ORT asks for a body's capability before its parent's, so these bodies' reports say "left to the CPU EP";
    the provider marks them absorbed (``PartitionReport.absorb``) once the parent is claimed.
    """
    out: dict[frozenset[str], str] = {}

    def visit(node: Node, label: str) -> None:
        for body in node.subgraphs.values():
            key = _produced(body)
            if key:
                out[key] = label
            for inner in body.nodes:
                visit(inner, label)

    for g in groups:
        for n in g:
            visit(n, n.label)
    return out


def node_reason(node: Node, graph: Graph, device: str, disabled_ops: frozenset[str], host_math: set,
                host_known: set):
    """Why ``node`` of ``graph`` cannot be claimed (None: it can), and its resolved OpDef."""
    opdef = REGISTRY.resolve(node.domain, node.op_type, node.since_version)
    if opdef is not None:
        opdef = opdef.for_types([graph.value(i).dtype if i else None for i in node.inputs])
    if node.op_type in disabled_ops:
        return "disabled by the disable_ops option", opdef
    reason = support_reason(node, opdef, graph.values, graph.constants, device, host_math, host_known)
    if reason is None and opdef.control:
        reason = bodies_reason(node, device, disabled_ops, opdef.containers)
    return reason, opdef


def _track_host(node: Node, opdef, graph: Graph, host_math: set, host_known: set) -> None:
    """Record the outputs of a claimed node that the interpreter computes on the host."""
    out_types = [graph.value(o).dtype for o in node.outputs if o]
    flags = [(not i) or i in host_known for i in node.inputs]
    if host_evaluable(opdef, out_types, flags):
        host_known.update(o for o in node.outputs if o)
        if all((not i) or i in host_math or (opdef.shape_only and k == 0)
               for k, i in enumerate(node.inputs)):
            host_math.update(o for o in node.outputs if o)


def bodies_reason(node: Node, device: str, disabled_ops: frozenset[str] = frozenset(),
                  containers: bool = False) -> str | None:
    """Why a control-flow node's bodies cannot all run on MLX (None: every body node can). ``containers``: the
    node's translator takes sequence/optional body inputs/outputs (its check matches their kinds)."""
    if not node.subgraphs:
        return "control-flow node without readable bodies"
    for attr, body in node.subgraphs.items():
        reason = body_reason(body, device, disabled_ops, containers)
        if reason:
            return f"{attr} body: {reason}"
    return None


def _untyped(body: Graph, containers: bool = False) -> str | None:
    """The first value of ``body`` that cannot be held: not a tensor of known element type. Sequences and
    optionals are allowed between body nodes (each node's check verifies the kinds it takes); as body inputs
    or outputs only when the control-flow op handles them (``containers``: its check matches the kinds)."""
    io = set(body.inputs) | set(body.outputs)
    names = [*body.inputs, *body.outputs, *(x for n in body.nodes for x in (*n.inputs, *n.outputs))]
    for name in names:
        if not name or name in body.constants:
            continue
        vi = body.value(name)
        if vi.is_tensor and vi.dtype is not None:
            continue
        if vi.kind in (SEQUENCE, OPTIONAL) and vi.tensor_dtype is not None and (containers or name not in io):
            continue
        return name
    return None


def body_reason(body: Graph, device: str, disabled_ops: frozenset[str] = frozenset(),
                containers: bool = False) -> str | None:
    """Why ``body`` cannot run whole on MLX (None: every node, nested bodies included, can).

    Body inputs (iteration values) and outer-scope values may live on the device: only the body's
    own constants and the host shape math computed from them count as host values.
    """
    bad = _untyped(body, containers)
    if bad is not None:
        what = "a body input or output" if bad in set(body.inputs) | set(body.outputs) else "a body value"
        return f"{what} '{bad}' is not a tensor of known type (sequence, optional or unknown)"
    host_known: set[str] = set(body.constants)
    host_math: set[str] = set(body.constants)
    for node in body.nodes:
        reason, opdef = node_reason(node, body, device, disabled_ops, host_math, host_known)
        if reason is not None:
            return f"{node.label}: {reason}"
        _track_host(node, opdef, body, host_math, host_known)
    return None


def _group(graph: Graph, claimed: dict[int, bool]) -> list[list[Node]]:
    producers = graph.producers()
    by_id = {id(n): n for n in graph.nodes}
    preds = {id(n): {id(producers[i]) for i in (*n.inputs, *n.implicit_inputs) if i and i in producers}
             for n in graph.nodes}
    succs: dict[int, list[Node]] = {k: [] for k in by_id}
    for n in graph.nodes:
        for p in preds[id(n)]:
            succs[p].append(n)
    indeg = {k: len(v) for k, v in preds.items()}
    order = {id(n): k for k, n in enumerate(graph.nodes)}
    ready: dict[bool, list[int]] = {True: [], False: []}      # heaps of topological positions
    for k, d in indeg.items():
        if d == 0:
            heapq.heappush(ready[claimed[k]], order[k])
    groups: list[list[Node]] = []
    current: list[Node] = []
    while ready[True] or ready[False]:
        is_claimed = bool(ready[True])
        if not is_claimed and current:
            groups.append(current)
            current = []
        node = graph.nodes[heapq.heappop(ready[is_claimed])]
        if is_claimed:
            current.append(node)
        for s in succs[id(node)]:
            indeg[id(s)] -= 1
            if indeg[id(s)] == 0:
                heapq.heappush(ready[claimed[id(s)]], order[id(s)])
    if current:
        groups.append(current)
    return groups
