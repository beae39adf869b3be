"""The plan a fused group runs: its nodes, ordered inputs/outputs and constants."""
from __future__ import annotations

from ..ir import Graph


def build_plan(sub: Graph, name: str, inputs: list[str], outputs: list[str]) -> Graph:
    """Inputs/outputs in the fused node's order (how ORT passes them at Compute).

    ``sub`` is the group's subgraph; constant initializers it owns stay
    constants unless ORT still passes them as inputs.
    """
    ins = [i for i in inputs if i]
    missing = [o for o in outputs if o and o not in {x for n in sub.nodes for x in n.outputs} and o not in ins
               and o not in sub.constants]
    if missing:
        raise ValueError(f"group {name}: outputs {missing} are produced by no node of the group")
    crossing = [f"'{n}' ({sub.value(n).kind})" for n in [*ins, *outputs] if n and not sub.value(n).is_tensor]
    if crossing:
        raise ValueError(f"group {name}: inputs/outputs {', '.join(crossing)} are not tensors; Compute exchanges "
                         f"only tensors with ORT (the partitioner keeps such values inside one group)")
    constants = {k: v for k, v in sub.constants.items() if k not in set(ins)}
    return Graph(list(sub.nodes), ins, [o for o in outputs], dict(sub.values), constants, name)
