"""A small Python IR of the graph ORT hands the EP.

Built by ``ortmlx.ep.graph_reader`` from ORT's C structs (or by
``from_onnx`` from an ``onnx.ModelProto`` for tools and tests). Constant
values are numpy arrays; during GetCapability they may be views of ORT's
memory that are only valid inside that callback.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

Dim = int | str | None          # int: static, str: symbolic name, None: unknown


class UnreadableAttr:
    """Stands in for an attribute the EP could not read; support checks refuse the node."""

    def __init__(self, why: str):
        self.why = why

    def __repr__(self) -> str:
        return f"<unreadable: {self.why}>"


#: value kinds (ORT's ONNXType). TENSOR also covers values ORT gives no type for (dtype None).
TENSOR, SEQUENCE, OPTIONAL, MAP, OPAQUE, SPARSE_TENSOR = "tensor", "sequence", "optional", "map", "opaque", "sparse_tensor"


def article(word: str) -> str:
    """'a' or 'an' for messages ("an optional")."""
    return "an" if word[:1] in "aeiou" else "a"


@dataclass(frozen=True)
class ValueInfo:
    name: str
    dtype: int | None = None                 # ONNX TensorProto elem type; None: not a tensor / unknown
    shape: tuple[Dim, ...] | None = None     # None: rank unknown
    kind: str = TENSOR                       # TENSOR, SEQUENCE, OPTIONAL, MAP, OPAQUE, SPARSE_TENSOR
    elem: "ValueInfo | None" = None          # SEQUENCE: the element type; OPTIONAL: the contained type

    @property
    def is_tensor(self) -> bool:
        return self.kind == TENSOR

    @property
    def tensor_dtype(self) -> int | None:
        """The element type of the tensors this value holds (through sequences/optionals); None: unknown."""
        if self.kind == TENSOR:
            return self.dtype
        if self.kind in (SEQUENCE, OPTIONAL) and self.elem is not None:
            return self.elem.tensor_dtype
        return None

    def type_str(self, dtype_name=str) -> str:
        """ONNX's spelling of the type, e.g. ``seq(tensor(float32))`` (``dtype_name`` names element types)."""
        if self.kind == TENSOR:
            return f"tensor({dtype_name(self.dtype)})" if self.dtype is not None else "tensor(?)"
        inner = self.elem.type_str(dtype_name) if self.elem is not None else "?"
        if self.kind == SEQUENCE:
            return f"seq({inner})"
        if self.kind == OPTIONAL:
            return f"optional({inner})"
        return self.kind

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def static_shape(self) -> tuple[int, ...] | None:
        if self.shape is None or not all(isinstance(d, int) and d >= 0 for d in self.shape):
            return None
        return tuple(self.shape)  # type: ignore[arg-type]


@dataclass
class Node:
    name: str
    op_type: str
    domain: str
    since_version: int
    inputs: list[str]            # "" marks an omitted optional input
    outputs: list[str]           # "" marks an omitted optional output
    attrs: dict[str, Any] = field(default_factory=dict)
    index: int = 0               # position in ORT's topological order
    handle: Any = None           # the OrtNode* it came from (ep layer only)
    has_subgraphs: bool = False
    implicit_inputs: list[str] = field(default_factory=list)     # outer-scope values its bodies read
    subgraphs: dict[str, "Graph"] = field(default_factory=dict)   # graph attribute -> body (also in attrs)

    @property
    def label(self) -> str:
        """How errors and reports name the node."""
        dom = f"{self.domain}." if self.domain not in ("", "ai.onnx") else ""
        return f"{dom}{self.op_type} '{self.name}'"


@dataclass
class Graph:
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    values: dict[str, ValueInfo]
    constants: dict[str, np.ndarray]        # constant initializers (bf16 as uint16 bits)
    name: str = ""

    def value(self, name: str) -> ValueInfo:
        return self.values.get(name) or ValueInfo(name)

    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs if o}

    def consumers(self, implicit: bool = False) -> dict[str, list[Node]]:
        """Value -> the nodes reading it (``implicit``: also control-flow nodes whose subgraphs read it)."""
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in (n.inputs + n.implicit_inputs if implicit else n.inputs):
                if i:
                    out.setdefault(i, []).append(n)
        return out


def outer_refs(graph: Graph) -> list[str]:
    """Names ``graph`` reads from an enclosing scope (its nodes' and nested bodies' free values), in first-use order."""
    local = set(graph.inputs) | set(graph.constants)
    out: dict[str, None] = {}
    for n in graph.nodes:
        for name in [*n.inputs, *(r for g in n.subgraphs.values() for r in outer_refs(g))]:
            if name and name not in local:
                out.setdefault(name)
        local.update(o for o in n.outputs if o)
    for o in graph.outputs:
        if o and o not in local:
            out.setdefault(o)
    return list(out)
