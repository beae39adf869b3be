"""Control flow: If, Loop, Scan, SequenceMap (ai.onnx), run eagerly with nested bodies.

Each graph attribute arrives as an ``interpreter.Body``: call it with the body's inputs to get
its outputs (lazy MLX arrays or host values); it sees the outer scope by itself. Every body
node was checked by the partitioner (``partition.bodies_reason``); these checks cover the
node's own contract: body arity, attributes, and the cases ORT's CPU EP answers differently
from the spec.

- If: ``cond`` is read on the host (a sync when the device computed it).
- Loop: the trip count and every iteration's condition are read on the host; loop-carried
  values stay MLX arrays (evaluated every ``SETTLE_EVERY`` iterations, which bounds the lazy graph
  a loop holds); scan outputs are stacked on a new axis 0. With zero iterations a scan output is ORT's
  empty tensor: ``[0] + the body output's shape`` with symbolic dims as 0 (an unknown rank is
  refused). A loop-carried value may be a sequence (a list, kept inside the group like any sequence); scan
  outputs are tensors. ORT's CPU EP obeys the body's condition output even when the node's ``cond`` input is
  omitted (the spec says it is ignored): such loops are claimed only when the body passes its
  condition through or makes it constantly true, where both agree.
- Scan (9+): ``scan_input_axes/directions``, ``scan_output_axes/directions``; a zero-length
  sequence is an error, as in ORT's CPU EP. Opset-8 Scan (batch axis, ``sequence_lens``) has no
  translator.
- SequenceMap (17+): the body runs once per element of the first input sequence, with the matching element
  of every additional sequence and every additional tensor whole; its outputs are collected into sequences.
  It is also a container op (sequence inputs/outputs, kept inside one group by the partitioner). Like ORT's
  CPU EP (which runs the spec's function body: a Loop of SequenceLength(input 0) iterations reading
  SequenceAt of every sequence), an empty first sequence gives empty outputs, a shorter additional
  sequence is an error, and a longer one's extra elements are ignored.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ... import ir
from ..registry import register
from .sequence import kinds_reason


# ----------------------------------------------------------------------------- helpers


def _one(v, what: str):
    """The single element of ``v`` read on the host (a sync for a device value)."""
    a = dt.host(v).reshape(-1)
    if a.size != 1:
        raise ValueError(f"{what} must hold exactly one element, got shape {dt.host(v).shape}")
    return a[0]


def _mx(v, dtype: int | None = None) -> mx.array:
    """A body result as an MLX array of element type ``dtype`` when given (host results are small integer/bool
    arrays, or outer values as ORT handed them); a 0-d host value stays 0-d."""
    if isinstance(v, mx.array):
        return v
    a = np.asarray(v)
    a = a if a.flags.c_contiguous else a.copy(order="C")        # (ascontiguousarray makes 0-d 1-d)
    return dt.to_mx(a, dtype) if dtype is not None else mx.array(a)


#: a loop evaluates its values every this many iterations (bounds the lazy graph it holds)
SETTLE_EVERY = 16


def _settle(step: int, values) -> None:
    """Every ``SETTLE_EVERY`` iterations, evaluate the MLX values among ``values``."""
    if step % SETTLE_EVERY != SETTLE_EVERY - 1:
        return
    lazy = [e for v in values for e in (v if isinstance(v, list) else [v]) if isinstance(e, mx.array)]
    if lazy:
        mx.eval(*lazy)


def _out_types(body) -> list[int | None]:
    """The element types a bound body declares for its outputs."""
    return [body.program.types.get(o) for o in body.program.outputs]


def _body(view, attr: str):
    return view.attrs.get(attr)


def _arity(body, n_in: int, n_out: int, attr: str) -> str | None:
    """The body's input/output counts the node's contract requires."""
    if not isinstance(body, ir.Graph):
        return f"attribute '{attr}' is not a readable graph"
    if len(body.inputs) != n_in:
        return f"{attr} has {len(body.inputs)} inputs, the node needs {n_in}"
    if len(body.outputs) != n_out:
        return f"{attr} has {len(body.outputs)} outputs, the node needs {n_out}"
    return None


# ----------------------------------------------------------------------------- If

def _if_check(view) -> str | None:
    """Every branch node must be claimable (checked by the partitioner); branches take no inputs and give
    the node's outputs; cond is bool (read on the host)."""
    n_out = len(view.node.outputs)
    for attr in ("then_branch", "else_branch"):
        body = _body(view, attr)
        if not isinstance(body, ir.Graph):
            return f"attribute '{attr}' is not a readable graph"
        if body.inputs:
            return f"{attr} has inputs {body.inputs} (If branches take none)"
        if len(body.outputs) != n_out:
            return f"{attr} has {len(body.outputs)} outputs, the node has {n_out}"
    if view.dtype(0) != dt.BOOL:
        return f"cond is {dt.name(view.dtype(0))}, not bool"
    return None


@register("If", 1, const=(0,), control=True, check=_if_check)
def if_(cond, *, then_branch, else_branch):
    """The outputs of the branch ``cond`` selects (read on the host)."""
    branch = then_branch if bool(_one(cond, "If cond")) else else_branch
    return tuple(branch())


# ----------------------------------------------------------------------------- Loop

def _passes_cond_through(body) -> bool:
    """The body's condition output is its condition input (directly or via Identity) or constantly true."""
    out, cin = body.outputs[0], body.inputs[1]
    if out == cin:
        return True
    c = body.constants.get(out)
    if c is not None:
        return bool(np.all(c)) and c.size > 0
    prod = {o: n for n in body.nodes for o in n.outputs if o}.get(out)
    return prod is not None and prod.op_type == "Identity" and list(prod.inputs) == [cin]


def _loop_check(view) -> str | None:
    """Every body node must be claimable (checked by the partitioner); body arity matches the node. Refuses a
    Loop with neither M nor cond, one without M whose body passes its condition through (it never ends), an
    omitted cond whose body computes its condition (ORT obeys it, the spec ignores it), scan outputs of
    unknown rank (zero iterations: ORT's [0] + body shape, symbolic dims 0), and non-tensor values other than
    loop-carried sequences of one type throughout."""
    body = _body(view, "body")
    n_carried = len(view.node.inputs) - 2
    if n_carried < 0:
        return f"{len(view.node.inputs)} inputs (Loop needs M and cond, possibly empty)"
    n_scan = len(view.node.outputs) - n_carried
    if n_scan < 0:
        return f"{len(view.node.outputs)} outputs for {n_carried} loop-carried values"
    r = _arity(body, 2 + n_carried, 1 + n_carried + n_scan, "body")
    if r:
        return r
    if not all(view.has(2 + k) for k in range(n_carried)):
        return "a loop-carried input is omitted"
    if view.has(0) and view.dtype(0) != dt.INT64:
        return f"trip count M is {dt.name(view.dtype(0))}, not int64"
    if view.has(1) and view.dtype(1) != dt.BOOL:
        return f"cond is {dt.name(view.dtype(1))}, not bool"
    if not view.has(0) and not view.has(1):
        return ("neither trip count M nor cond: only the body's condition could end the loop "
                "(ORT's CPU EP obeys it, the spec ignores it)")
    if not view.has(0) and _passes_cond_through(body):
        return "no trip count M and the body passes its condition through: once entered, the loop never ends"
    if not view.has(1) and not _passes_cond_through(body):
        return ("cond input omitted but the body computes its condition output (the spec ignores it, "
                "ORT's CPU EP stops on it)")
    r = _loop_kinds_reason(view, body, n_carried)
    if r:
        return r
    for k in range(n_scan):
        name = body.outputs[1 + n_carried + k]
        if body.value(name).shape is None:
            return (f"scan output {k} ('{name}') has unknown rank: its zero-iteration shape "
                    f"cannot be known")
    return None


def _carried_reason(k: int, infos: list) -> str | None:
    """Loop-carried value ``k`` (node input, body input, body output, node output): all tensors, or all
    sequences of one known element type."""
    kinds = {vi.kind if vi is not None else ir.TENSOR for vi in infos}
    if kinds == {ir.TENSOR}:
        return None
    types = {vi.tensor_dtype if vi is not None else None for vi in infos}
    if kinds != {ir.SEQUENCE} or len(types) != 1 or None in types:
        what = ", ".join(vi.type_str(dt.name) if vi is not None else "unknown" for vi in infos)
        return (f"loop-carried value {k} is not a tensor or one sequence type throughout (node input, body input, "
                f"body output, node output: {what})")
    return None


def _loop_kinds_reason(view, body, n_carried: int) -> str | None:
    """M, cond, the iteration count and conditions, and scan outputs are tensors; a loop-carried value is a tensor
    or a sequence (the same sequence type in and out of the node and the body)."""
    r = kinds_reason(view, {0: {ir.TENSOR}, 1: {ir.TENSOR}},
                     {k: {ir.TENSOR} for k in range(n_carried, len(view.node.outputs))})
    if r:
        return r
    for name in [*body.inputs[:2], body.outputs[0], *body.outputs[1 + n_carried:]]:
        if not body.value(name).is_tensor:
            return f"body value '{name}' is {ir.article(body.value(name).kind)} {body.value(name).kind}, not a tensor"
    for k in range(n_carried):
        r = _carried_reason(k, [view.value(2 + k), body.value(body.inputs[2 + k]),
                                body.value(body.outputs[1 + k]), view.out_value(k)])
        if r:
            return r
    return None


def _empty_scan_output(shape, dtype: int | None) -> mx.array:
    """ORT's scan output of a zero-iteration Loop: shape [0] + body shape (symbolic dims -> 0)."""
    dims = [0] + [d if isinstance(d, int) and d >= 0 else 0 for d in shape]
    return mx.zeros(dims, dtype=dt.MLX.get(dtype, mx.float32))


@register("Loop", 1, const=(0, 1), control=True, containers=True, check=_loop_check)
def loop(M=None, cond=None, *v_initial, body, ctx):
    """Run ``body`` while ``i < M`` and ``cond``; returns final loop-carried values, then stacked scan outputs."""
    trip = None if M is None else int(_one(M, "Loop trip count M"))
    keep = True if cond is None else bool(_one(cond, "Loop cond"))
    carried = list(v_initial)
    n = len(carried)
    scans: list[list] = [[] for _ in range(ctx.n_outputs - n)]
    types = _out_types(body)[1 + n:]
    i = 0
    while keep and (trip is None or i < trip):
        outs = body(np.array(i, np.int64), np.array(keep), *carried)
        carried = outs[1:1 + n]
        for k, v in enumerate(outs[1 + n:]):
            scans[k].append(_mx(v, types[k]))
        _settle(i, [outs[0], *carried, *(s[-1] for s in scans)])
        keep = bool(_one(outs[0], "Loop body condition"))
        i += 1
    return tuple(carried + [_stack_scan(items, body, 1 + n + k, ctx.out_dtypes[n + k])
                            for k, items in enumerate(scans)])


def _stack_scan(items: list, body, j: int, dtype: int | None) -> mx.array:
    """A Loop scan output: the iterations' values on a new axis 0 (ORT's empty tensor when none)."""
    if items:
        return mx.stack(items, axis=0)
    return _empty_scan_output(body.program.graph.value(body.program.outputs[j]).shape, dtype)


# ----------------------------------------------------------------------------- Scan

def _axes_reason(what: str, axes, ranks: list, since: int) -> str | None:
    """Scan axes attribute ``axes`` against the ranks it indexes (None rank: unknown)."""
    if axes is None:
        return None
    if len(axes) != len(ranks):
        return f"{what} has {len(axes)} entries for {len(ranks)} values"
    for k, (a, r) in enumerate(zip(axes, ranks)):
        if r is None:
            return f"{what}[{k}] indexes a value of unknown rank"
        if not -r <= a < r or (a < 0 and since < 11):
            return f"{what}[{k}] = {a} is out of range for rank {r}"
    return None


def _dirs_reason(what: str, dirs, n: int) -> str | None:
    if dirs is None:
        return None
    if len(dirs) != n:
        return f"{what} has {len(dirs)} entries for {n} values"
    bad = [d for d in dirs if d not in (0, 1)]
    return f"{what} holds {bad[0]} (0 or 1 only)" if bad else None


def _scan_check(view) -> str | None:
    """Every body node must be claimable (checked by the partitioner); body arity matches the node; scan axes
    in range of known ranks (negative from opset 11), directions 0/1. A zero-length sequence fails, as in ORT."""
    body, a = _body(view, "body"), view.attrs
    m = a["num_scan_inputs"]
    n_in = len(view.node.inputs)
    if not 1 <= m <= n_in:
        return f"num_scan_inputs = {m} with {n_in} inputs"
    n_state = n_in - m
    n_scan = len(view.node.outputs) - n_state
    if n_scan < 0:
        return f"{len(view.node.outputs)} outputs for {n_state} state values"
    if not all(view.has(i) for i in range(n_in)):
        return "an input is omitted"
    r = _arity(body, n_state + m, n_state + n_scan, "body")
    if r:
        return r
    in_ranks = [view.rank(n_state + k) for k in range(m)]
    out_ranks = [None if body.value(o).rank is None else body.value(o).rank + 1 for o in body.outputs[n_state:]]
    return (_axes_reason("scan_input_axes", a["scan_input_axes"], in_ranks, view.since_version)
            or _dirs_reason("scan_input_directions", a["scan_input_directions"], m)
            or _axes_reason("scan_output_axes", a["scan_output_axes"], out_ranks, view.since_version)
            or _dirs_reason("scan_output_directions", a["scan_output_directions"], n_scan))


def _seq_len(xs: list, axes: list[int]) -> int:
    """The common length of the scan inputs along their scan axes."""
    lens = {int(x.shape[ax]) for x, ax in zip(xs, axes)}
    if len(lens) != 1:
        raise ValueError(f"scan inputs have different lengths {sorted(lens)} along their scan axes")
    n = lens.pop()
    if n == 0:
        raise ValueError("scan inputs have length 0 along their scan axes (ORT's CPU EP fails too)")
    return n


def _norm(axes, values, extra: int = 0) -> list[int]:
    """Scan axes, default 0, made non-negative against each value's rank (+ ``extra``)."""
    axes = axes if axes is not None else [0] * len(values)
    return [ax + v.ndim + extra if ax < 0 else ax for ax, v in zip(axes, values)]


@register("Scan", 9, control=True, check=_scan_check)
def scan(*inputs, body, num_scan_inputs, scan_input_axes=None, scan_input_directions=None,
         scan_output_axes=None, scan_output_directions=None):
    """Run ``body`` over slices of the scan inputs; returns final states, then the stacked scan outputs."""
    n_state = len(inputs) - num_scan_inputs
    states, xs = list(inputs[:n_state]), list(inputs[n_state:])
    in_axes = _norm(scan_input_axes, xs)
    in_dirs = scan_input_directions or [0] * len(xs)
    length = _seq_len(xs, in_axes)
    per_step: list[list] = [[] for _ in range(body.n_outputs - n_state)]
    types = _out_types(body)[n_state:]
    for t in range(length):
        slices = [mx.take(x, length - 1 - t if d else t, axis=ax) for x, ax, d in zip(xs, in_axes, in_dirs)]
        outs = body(*states, *slices)
        states = outs[:n_state]
        for k, v in enumerate(outs[n_state:]):
            per_step[k].append(_mx(v, types[k]))
        _settle(t, [*states, *(p[-1] for p in per_step)])
    out_dirs = scan_output_directions or [0] * len(per_step)
    out_axes = _norm(scan_output_axes, [p[0] for p in per_step], extra=1)
    stacked = [mx.stack(p[::-1] if d else p, axis=ax) for p, ax, d in zip(per_step, out_axes, out_dirs)]
    return tuple(states + stacked)


# ----------------------------------------------------------------------------- SequenceMap

def _smap_types_reason(view, body) -> str | None:
    """Body input/output element types must match the node's sequences and tensors (ORT's function body
    passes them through unchanged)."""
    for k, name in enumerate(body.inputs):
        want, have = body.value(name).dtype, (view.value(k).tensor_dtype if view.value(k) else None)
        if want is None or have is None or want != have:
            return (f"body input {k} ('{name}') is {dt.name(want) if want else 'untyped'}, node input {k} "
                    f"holds {dt.name(have) if have else 'an unknown type'}")
    for k, name in enumerate(body.outputs):
        want, have = body.value(name).dtype, (view.out_value(k).tensor_dtype if view.out_value(k) else None)
        if want is None or have is None or want != have:
            return (f"body output {k} ('{name}') is {dt.name(want) if want else 'untyped'}, output sequence "
                    f"{k} holds {dt.name(have) if have else 'an unknown type'}")
    return None


def _smap_check(view) -> str | None:
    """Every body node must be claimable (checked by the partitioner); one body input per node input and one
    body output per output sequence, of matching element types; input 0 a sequence, the others sequences or
    tensors (none omitted), every output a sequence."""
    body = _body(view, "body")
    n_in, n_out = len(view.node.inputs), len(view.node.outputs)
    r = _arity(body, n_in, n_out, "body")
    if r:
        return r
    if not all(view.has(i) for i in range(n_in)):
        return "an input is omitted"
    return (kinds_reason(view, {0: {ir.SEQUENCE}, **{i: {ir.SEQUENCE, ir.TENSOR} for i in range(1, n_in)}},
                         {k: {ir.SEQUENCE} for k in range(n_out)})
            or _smap_types_reason(view, body))


def _element(v, i: int, k: int):
    """Iteration ``i``'s value of node input ``k``: a sequence's element ``i``, a tensor whole."""
    if not isinstance(v, list):
        return v
    if i >= len(v):
        raise ValueError(f"additional input {k} is a sequence of {len(v)} tensor(s), shorter than input_sequence: "
                         f"no element {i}")
    return v[i]


@register("SequenceMap", 17, control=True, containers=True, check=_smap_check)
def sequence_map(input_sequence, *additional_inputs, body):
    """Run ``body`` on each element of ``input_sequence`` (with the matching element of each additional sequence,
    each additional tensor whole); returns one sequence per body output."""
    if not isinstance(input_sequence, list):
        raise TypeError(f"input_sequence is a {type(input_sequence).__name__}, not a sequence")
    types = _out_types(body)
    outs: list[list] = [[] for _ in range(body.n_outputs)]
    for i, x in enumerate(input_sequence):
        res = body(x, *(_element(v, i, k + 1) for k, v in enumerate(additional_inputs)))
        for k, v in enumerate(res):
            outs[k].append(_mx(v, types[k]))
        _settle(i, [o[-1] for o in outs])
    return tuple(outs)
