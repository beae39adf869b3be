"""The op registry: (domain, op_type, since_version) -> translator.

A translator is a small function whose positional parameters are the node's
inputs (``None`` for an omitted optional input) and whose keyword-only
parameters are the spec's attributes with the spec's defaults::

    @register("Gemm", since=11)
    def gemm(A, B, C=None, *, alpha=1.0, beta=1.0, transA=0, transB=0): ...

Lookups resolve to the newest registration whose ``since`` is <= the node's
schema since_version (what ORT resolved for the model's opset). Support is
decided at claim time from the declaration: accepted attributes (the keyword
parameters), allowed dtypes, inputs that must be host values, and an optional
``check`` returning a reason string when a case is not handled exactly.
"""
from __future__ import annotations

import bisect
import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import ir
from ..ir import UnreadableAttr
from . import dtypes as dt

ONNX = ""
MS = "com.microsoft"
ML = "ai.onnx.ml"

_DOMAIN_ALIASES = {"ai.onnx": ""}


def norm_domain(domain: str) -> str:
    return _DOMAIN_ALIASES.get(domain, domain)


@dataclass(frozen=True)
class OpDef:
    domain: str
    op_type: str
    since: int
    fn: Callable
    attrs: dict[str, Any]                 # accepted attribute -> default (inspect.Parameter.empty: required)
    const_inputs: frozenset[int]          # inputs read on the host (numpy) at run time
    dtypes: frozenset[int] | None         # allowed element types of the first input
    check: Callable[["NodeView"], str | None] | None
    host: Callable | None                 # numpy implementation for small integer shape math
    shape_only: bool                      # host impl reads only the input's shape (Shape, Size)
    host_computed: bool                   # reads data on the host (NonZero, Unique): never traced
    wants_ctx: bool
    variadic: bool
    until: int | None = None              # informational: next since_version registered
    carriers: bool = False                # may see carrier types (dtypes.CARRIERS: float8, int4, int2 ...)
    const_when: Callable | None = None    # in_types -> more inputs read on the host for these types
    containers: bool = False              # may see sequence/optional values (lists / None); never traced
    opaque_attrs: frozenset[str] = frozenset()   # attributes never read (the graph's value types say the same)
    control: bool = False                 # control flow: graph attributes arrive as callable bodies

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.domain, self.op_type, self.since)

    def for_types(self, in_types: list[int | None]) -> "OpDef":
        """This registration for a node with input element types ``in_types``: ``const_when``'s
        inputs (e.g. integer divisors) join ``const_inputs``. Unchanged without ``const_when``."""
        if self.const_when is None:
            return self
        extra = frozenset(self.const_when(list(in_types))) - self.const_inputs
        return dataclasses.replace(self, const_inputs=self.const_inputs | extra) if extra else self


@dataclass
class Ctx:
    """What a translator that asks for ``ctx`` learns about its node at run time."""
    node: Any
    out_dtypes: list[int | None]
    in_dtypes: list[int | None]
    device: str
    n_outputs: int
    extra: dict = field(default_factory=dict)


class Registry:
    def __init__(self) -> None:
        self._ops: dict[tuple[str, str], list[OpDef]] = {}

    def register(self, op_type: str, since: int = 1, *, domain: str = ONNX, const: tuple[int, ...] = (),
                 dtypes: frozenset[int] | set[int] | None = None, check: Callable | None = None,
                 host: Callable | None = None, shape_only: bool = False, host_computed: bool = False,
                 const_when: Callable | None = None, carriers: bool = False, containers: bool = False,
                 opaque_attrs: tuple[str, ...] = (), control: bool = False):
        """Decorator registering ``fn`` as the translator of ``op_type`` from opset ``since`` on.

        ``containers=True``: the node may touch sequence/optional values (a sequence is a list of mx
        arrays, an optional is None or its value); its ``check`` must verify every value's kind. Such
        groups are never traced, and the partitioner keeps those values inside one group.

        ``opaque_attrs``: attributes the translator never reads because the graph's value types carry
        the same (Optional's ``type``, a TypeProto ORT cannot expose): an unreadable one does not refuse.

        ``carriers=True``: the node may touch carrier types (``dtypes.CARRIERS``: float8, int4, int2);
        the translator's ``check`` must refuse every carrier case it does not handle exactly.

        ``const_when(in_types) -> indices``: inputs read on the host only for some input element
        types (integer Div's divisor, checked for zeros); resolved per node by ``OpDef.for_types``.

        ``control=True``: a control-flow op (If, Loop, Scan, SequenceMap). Its graph attributes arrive as
        ``interpreter.Body`` callables (body inputs -> body outputs); the partitioner checks every
        body node (``partition.bodies_reason``) besides ``check``. Never traced.
        """
        def deco(fn: Callable) -> Callable:
            sig = inspect.signature(fn)
            attrs, variadic, wants_ctx = {}, False, False
            for p in sig.parameters.values():
                if p.kind is p.KEYWORD_ONLY:
                    if p.name == "ctx":
                        wants_ctx = True
                    else:
                        attrs[p.name] = p.default
                elif p.kind is p.VAR_POSITIONAL:
                    variadic = True
                elif p.kind is p.VAR_KEYWORD:
                    raise ValueError(f"translator {fn.__name__} for {op_type}: **kwargs hides which attributes it handles")
            d = OpDef(norm_domain(domain), op_type, since, fn, attrs, frozenset(const),
                      frozenset(dtypes) if dtypes is not None else None, check, host, shape_only,
                      host_computed, wants_ctx, variadic, const_when=const_when, carriers=carriers,
                      containers=containers, opaque_attrs=frozenset(opaque_attrs), control=control)
            lst = self._ops.setdefault((d.domain, op_type), [])
            if any(o.since == since for o in lst):
                raise ValueError(f"{domain or 'ai.onnx'}::{op_type} since {since} registered twice")
            bisect.insort(lst, d, key=lambda o: o.since)
            return fn
        return deco

    def resolve(self, domain: str, op_type: str, since_version: int) -> OpDef | None:
        """Newest registration with since <= ``since_version``."""
        lst = self._ops.get((norm_domain(domain), op_type))
        if not lst:
            return None
        i = bisect.bisect_right([o.since for o in lst], since_version)
        return lst[i - 1] if i else None

    def __iter__(self):
        """Every registration, with ``until`` filled in, sorted by domain and op."""
        for key in sorted(self._ops):
            lst = self._ops[key]
            for a, b in zip(lst, lst[1:] + [None]):
                yield OpDef(**{**a.__dict__, "until": b.since - 1 if b else None})

    def op_types(self, domain: str | None = ONNX) -> set[str]:
        """Op types with a translator in ``domain`` (None: in any domain)."""
        return {op for (d, op) in self._ops if domain is None or d == norm_domain(domain)}


REGISTRY = Registry()
register = REGISTRY.register


class NodeView:
    """A node as support checks see it: attributes with defaults, input types, constant values."""

    def __init__(self, node, opdef: OpDef, values: dict, constants: dict[str, np.ndarray], device: str,
                 host_known: set | frozenset | None = None, host_values: set | frozenset | None = None):
        self.node = node
        self.opdef = opdef
        self.device = device
        self._values = values
        self._constants = constants
        self._host_known = host_known
        self._host_values = host_values
        self.attrs = {k: v for k, v in opdef.attrs.items() if v is not inspect.Parameter.empty}
        self.attrs.update(node.attrs)

    @property
    def since_version(self) -> int:
        return self.node.since_version

    @property
    def n_inputs(self) -> int:
        return len(self.node.inputs)

    def has(self, i: int) -> bool:
        return i < len(self.node.inputs) and bool(self.node.inputs[i])

    def _vi(self, i: int, outputs: bool = False):
        names = self.node.outputs if outputs else self.node.inputs
        if i >= len(names) or not names[i]:
            return None
        return self._values.get(names[i])

    def dtype(self, i: int) -> int | None:
        vi = self._vi(i)
        return vi.dtype if vi else None

    def out_dtype(self, i: int = 0) -> int | None:
        vi = self._vi(i, outputs=True)
        return vi.dtype if vi else None

    def shape(self, i: int):
        vi = self._vi(i)
        return vi.shape if vi else None

    def out_shape(self, i: int = 0):
        vi = self._vi(i, outputs=True)
        return vi.shape if vi else None

    def value(self, i: int) -> "ir.ValueInfo | None":
        """Input ``i``'s ValueInfo (kind, element type ...); None when omitted or unknown."""
        return self._vi(i)

    def out_value(self, i: int = 0) -> "ir.ValueInfo | None":
        return self._vi(i, outputs=True)

    def kind(self, i: int) -> str | None:
        """Input ``i``'s value kind (``ir.TENSOR``, ``ir.SEQUENCE``, ``ir.OPTIONAL`` ...); None when omitted."""
        vi = self._vi(i)
        return (vi.kind if vi else ir.TENSOR) if self.has(i) else None

    def out_kind(self, i: int = 0) -> str | None:
        vi = self._vi(i, outputs=True)
        return vi.kind if vi else None

    def rank(self, i: int) -> int | None:
        s = self.shape(i)
        return None if s is None else len(s)

    def on_host(self, i: int) -> bool:
        """Input ``i`` is a constant or computed by claimed host shape math (Shape -> ...) at claim time.

        Graph inputs and values from other EPs do not count (they may be large data tensors);
        False when the caller does not track provenance.
        """
        return self._host_known is not None and self.has(i) and self.node.inputs[i] in self._host_known

    def arrives_on_host(self, i: int) -> bool:
        """Input ``i`` is not computed on the device by a node claimed before it: a constant, a graph
        input, the output of a node left to another EP, or claimed host shape math. A translator that
        reads it on the host (``const=``) then needs no sync, except when host shape math grows past
        the interpreter's host size limit and runs on the device (then the eager path syncs).
        False when the caller does not track provenance.
        """
        return self._host_values is not None and self.has(i) and self.node.inputs[i] in self._host_values

    def const(self, i: int) -> np.ndarray | None:
        """The value of input ``i`` when it is a constant initializer, else None."""
        if not self.has(i):
            return None
        return self._constants.get(self.node.inputs[i])


def same_input_types(view: NodeView) -> str | None:
    """Check for binary/variadic ops: every input must share input 0's element type."""
    t0 = view.dtype(0)
    for i in range(1, view.n_inputs):
        if view.has(i) and view.dtype(i) is not None and view.dtype(i) != t0:
            return f"input {i} is {dt.name(view.dtype(i))}, input 0 is {dt.name(t0)}"
    return None


def check_dtypes(view: NodeView) -> str | None:
    """Generic dtype rule: every tensor the node touches must exist in MLX on the device; sequence and
    optional values only for ``containers`` translators, and their tensors' element type too."""
    node, d = view.node, view.opdef
    for kind, names in (("input", node.inputs), ("output", node.outputs)):
        for i, n in enumerate(names):
            if not n:
                continue
            vi = view._values.get(n)
            if vi is not None and not vi.is_tensor:
                reason = _container_reason(vi, d, view.device)
                if reason:
                    return f"{kind} {i} ('{n}') {reason}"
                continue
            t = vi.dtype if vi else None
            if t is None:
                if kind == "output":
                    return f"{kind} {i} ('{n}') has no known tensor type"
                continue
            if kind == "input" and i in d.const_inputs:
                if t in dt.NUMPY or t == dt.STRING:
                    continue
            if t in dt.CARRIERS and d.carriers:
                continue
            if not dt.supported_on(t, view.device):
                return f"{kind} {i} ('{n}') is {dt.name(t)}, not supported by MLX on {view.device}"
    if d.dtypes is not None and node.inputs and node.inputs[0]:
        t = view.dtype(0)
        if t is not None and t not in d.dtypes:
            return f"input 0 dtype {dt.name(t)} not handled by this translator"
    return None


def _container_reason(vi, d: OpDef, device: str) -> str | None:
    """Why a non-tensor value cannot be touched by this translator (None: it can)."""
    what = vi.type_str(dt.name)
    if not d.containers:
        return f"is {ir.article(vi.kind)} {vi.kind} ({what}), not a tensor"
    inner = vi
    while inner is not None and inner.kind in (ir.SEQUENCE, ir.OPTIONAL):
        inner = inner.elem
    if inner is None or not inner.is_tensor or inner.dtype is None:
        return f"is {what}: element type unknown or not a tensor"
    if not dt.supported_on(inner.dtype, device):
        return f"is {what}: {dt.name(inner.dtype)} is not supported by MLX on {device}"
    return None


def support_reason(node, opdef: OpDef | None, values: dict, constants: dict, device: str,
                   host_known: set | frozenset | None = None,
                   host_values: set | frozenset | None = None) -> str | None:
    """Why ``node`` cannot be claimed by itself (None: it can). Host-input provenance is the partitioner's
    (``host_known``: constants and host shape-math values, when given, lets checks ask ``view.on_host(i)``;
    ``host_values``: every value not computed on the device, for ``view.arrives_on_host(i)``)."""
    if opdef is None:
        dom = node.domain or "ai.onnx"
        return f"unsupported op {dom}::{node.op_type} (since_version {node.since_version})"
    if node.has_subgraphs and not opdef.control:
        return "node with graph attributes (subgraphs) and no control-flow translator"
    bad = [k for k, v in node.attrs.items() if isinstance(v, UnreadableAttr) and k not in opdef.opaque_attrs]
    if bad:
        return f"attribute {bad[0]!r} could not be read ({node.attrs[bad[0]].why})"
    extra = sorted(set(node.attrs) - set(opdef.attrs))
    if extra:
        return f"unsupported attribute(s) {', '.join(map(repr, extra))}"
    missing = [k for k, v in opdef.attrs.items() if v is inspect.Parameter.empty and k not in node.attrs]
    if missing:
        return f"required attribute(s) {', '.join(map(repr, missing))} missing"
    if not opdef.variadic:
        n_pos = sum(1 for p in inspect.signature(opdef.fn).parameters.values()
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        if len(node.inputs) > n_pos:
            return f"{len(node.inputs)} inputs, translator takes {n_pos}"
    view = NodeView(node, opdef, values, constants, device, host_known, host_values)
    reason = check_dtypes(view)
    if reason:
        return reason
    if opdef.check is not None:
        try:
            return opdef.check(view)
        except Exception as e:  # a check that cannot decide refuses the claim
            return f"support check failed: {type(e).__name__}: {e}"
    return None
