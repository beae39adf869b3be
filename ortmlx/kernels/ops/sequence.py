"""Sequence and optional ops: SequenceConstruct, SequenceEmpty, SequenceAt, SequenceInsert, SequenceErase,
SequenceLength, SplitToSequence, ConcatFromSequence, Optional, OptionalHasElement, OptionalGetElement.

A sequence is a Python list of mx arrays, an optional None (empty) or its value. Such values never
cross a group boundary (the partitioner keeps them inside one group; Compute exchanges only tensors),
and groups holding them run eagerly (never traced). Positions and split sizes are read on the host
(``const=``). Where ORT's CPU kernel and the spec disagree on a case we can see at claim time
(SplitToSequence's keepdims=0 with a scalar split, ConcatFromSequence's new_axis beyond 1), the case
is refused; run-time values follow ORT 1.31 where it is more permissive than the spec (split sizes
of 0, an empty 1-D split read as no split).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ... import ir
from ..registry import register, same_input_types
from .shape import _concat, norm_axis

SEQ, OPT, TENSOR = ir.SEQUENCE, ir.OPTIONAL, ir.TENSOR


# ---------------------------------------------------------------- helpers
def kinds_reason(view, inputs: dict[int, set[str]], outputs: dict[int, set[str]]) -> str | None:
    """Every named input/output must be of one of the kinds given for its position."""
    for what, table, kind_of in (("input", inputs, view.kind), ("output", outputs, view.out_kind)):
        for i, allowed in table.items():
            k = kind_of(i)
            if k is not None and k not in allowed:
                return f"{what} {i} is {ir.article(k)} {k}, expected {' or '.join(sorted(allowed))}"
    return None


def _elem_dtype_reason(view, seq_in: int | None, tensor_in: int | None = None, tensor_out: int | None = None,
                       seq_out: int | None = None) -> str | None:
    """The sequence's element type must match the tensor going in or out (ORT checks it at run time)."""
    vi = view.value(seq_in) if seq_in is not None else view.out_value(seq_out)
    want = vi.tensor_dtype if vi is not None else None
    for t in ([view.dtype(tensor_in)] if tensor_in is not None else []) + \
             ([view.out_dtype(tensor_out)] if tensor_out is not None else []):
        if want is not None and t is not None and t != want:
            return f"tensor is {dt.name(t)}, the sequence holds {dt.name(want)}"
    return None


def _position(p, n: int, insert: bool = False) -> int:
    """A position in [-n, n-1] (SequenceInsert: [-n, n]) as an index; reads the first element like ORT."""
    a = np.asarray(p).reshape(-1)
    if a.size == 0:
        raise ValueError(f"position is an empty tensor of shape {np.asarray(p).shape}")
    k = int(a[0])
    hi = n if insert else n - 1
    if not -n <= k <= hi:
        raise ValueError(f"position {k} out of range [{-n}, {hi}] for a sequence of {n} tensor(s)")
    return k + n if k < 0 else k


def _as_seq(s, what: str = "input sequence") -> list:
    if not isinstance(s, list):
        raise TypeError(f"{what} is a {type(s).__name__}, not a sequence")
    return s


# ---------------------------------------------------------------- construct / empty / length
def _construct_check(view):
    """Tensors of one element type in, a sequence of it out."""
    return kinds_reason(view, {i: {TENSOR} for i in range(view.n_inputs)}, {0: {SEQ}}) or \
        same_input_types(view) or _elem_dtype_reason(view, None, seq_out=0, tensor_in=0)


@register("SequenceConstruct", 11, containers=True, check=_construct_check)
def sequence_construct(*inputs):
    """A sequence of the inputs (all of one element type)."""
    if not inputs:
        raise ValueError("SequenceConstruct needs at least one input")
    return list(inputs)


def _empty_check(view):
    """A sequence out (its element type must exist in MLX)."""
    return kinds_reason(view, {}, {0: {SEQ}})


@register("SequenceEmpty", 11, containers=True, check=_empty_check)
def sequence_empty(*, dtype=dt.FLOAT):
    """An empty sequence (its element type is the output's declared type)."""
    return []


def _seq_len_host(input_sequence):
    return np.array(len(_as_seq(input_sequence)), np.int64)


def _length_check(view):
    """A sequence in, a tensor out."""
    return kinds_reason(view, {0: {SEQ}}, {0: {TENSOR}})


@register("SequenceLength", 11, containers=True, host=_seq_len_host, shape_only=True, check=_length_check)
def sequence_length(input_sequence):
    """The number of tensors, an int64 scalar (host value: it feeds shape math without a sync)."""
    return _seq_len_host(input_sequence)


# ---------------------------------------------------------------- at / insert / erase
def _at_check(view):
    """A sequence and a position in, a tensor of the sequence's element type out."""
    return kinds_reason(view, {0: {SEQ}, 1: {TENSOR}}, {0: {TENSOR}}) or \
        _elem_dtype_reason(view, 0, tensor_out=0)


@register("SequenceAt", 11, const=(1,), containers=True, check=_at_check)
def sequence_at(input_sequence, position):
    """The tensor at ``position`` (negative counts from the back)."""
    s = _as_seq(input_sequence)
    return s[_position(position, len(s))]


def _insert_check(view):
    """A sequence, a tensor of its element type and a position in, a sequence out."""
    return kinds_reason(view, {0: {SEQ}, 1: {TENSOR}, 2: {TENSOR}}, {0: {SEQ}}) or \
        _elem_dtype_reason(view, 0, tensor_in=1)


@register("SequenceInsert", 11, const=(2,), containers=True, check=_insert_check)
def sequence_insert(input_sequence, tensor, position=None):
    """Insert ``tensor`` before ``position`` in [-n, n] (default and n: append)."""
    s = _as_seq(input_sequence)
    k = len(s) if position is None else _position(position, len(s), insert=True)
    return s[:k] + [tensor] + s[k:]


def _erase_check(view):
    """A sequence and a position in, a sequence out."""
    return kinds_reason(view, {0: {SEQ}, 1: {TENSOR}}, {0: {SEQ}})


@register("SequenceErase", 11, const=(1,), containers=True, check=_erase_check)
def sequence_erase(input_sequence, position=None):
    """Remove the tensor at ``position`` (default: the last one)."""
    s = _as_seq(input_sequence)
    if not s:
        raise ValueError("cannot erase from an empty sequence")
    if position is None:
        return s[:-1]
    k = _position(position, len(s))
    return s[:k] + s[k + 1:]


# ---------------------------------------------------------------- split / concat
def _split_check(view):
    """Refuses keepdims=0 with a split input that is (or may be) a scalar: ORT drops the axis there, the
    spec ignores keepdims whenever split is given."""
    reason = kinds_reason(view, {0: {TENSOR}, 1: {TENSOR}}, {0: {SEQ}}) or \
        _elem_dtype_reason(view, None, seq_out=0, tensor_in=0)
    if reason:
        return reason
    if view.has(1) and view.attrs.get("keepdims", 1) == 0:
        c = view.const(1)
        rank = c.ndim if c is not None else view.rank(1)
        if rank != 1:
            return ("keepdims=0 with a split input that may be a scalar: ORT drops the axis, the spec "
                    "ignores keepdims when split is given")
    return None


def _split_sizes(dim: int, split) -> tuple[list[int], bool]:
    """Chunk sizes along the axis and whether keepdims applies (ORT: no split, a scalar, or an empty 1-D split)."""
    if split is None:
        return [1] * dim, True
    a = np.asarray(split)
    if a.ndim == 0:
        k = int(a)
        if k <= 0:
            raise ValueError(f"split {k} must be > 0")
        return [k] * (dim // k) + ([dim % k] if dim % k else []), True
    sizes = [int(v) for v in a.reshape(-1)]
    if not sizes:
        return [1] * dim, True               # ORT: an empty split is no split
    if min(sizes) < 0:
        raise ValueError(f"split {sizes} must hold values >= 0")      # ORT 1.31 accepts empty chunks
    if sum(sizes) != dim:
        raise ValueError(f"split {sizes} sums to {sum(sizes)}, the axis has {dim}")
    return sizes, False


@register("SplitToSequence", 11, const=(1,), containers=True, check=_split_check)
def split_to_sequence(input, split=None, *, axis=0, keepdims=1):
    """Chunks of ``input`` along ``axis``: of 1 (default, keepdims applies), of a scalar size, or of 1-D sizes."""
    a = norm_axis(axis, input.ndim)
    sizes, keep_rule = _split_sizes(input.shape[a], split)
    out, start = [], 0
    for n in sizes:
        sl = [slice(None)] * input.ndim
        sl[a] = slice(start, start + n)
        part = input[tuple(sl)]
        out.append(mx.squeeze(part, a) if keep_rule and not keepdims else part)
        start += n
    return out


def _concat_check(view):
    """Refuses new_axis other than 0 or 1 (the spec's values; ORT stacks for any non-zero)."""
    reason = kinds_reason(view, {0: {SEQ}}, {0: {TENSOR}}) or _elem_dtype_reason(view, 0, tensor_out=0)
    if reason:
        return reason
    if view.attrs.get("new_axis", 0) not in (0, 1):
        return f"new_axis={view.attrs['new_axis']} (the spec allows 0 or 1)"
    return None


@register("ConcatFromSequence", 11, containers=True, check=_concat_check)
def concat_from_sequence(input_sequence, *, axis, new_axis=0):
    """Concatenate the tensors along ``axis`` (``new_axis=1``: stack them on a new axis)."""
    s = _as_seq(input_sequence)
    if not s:
        raise ValueError("ConcatFromSequence needs a sequence of 1 or more tensors, got an empty one")
    if not new_axis:
        if s[0].ndim == 0:
            raise ValueError("cannot concatenate scalars")
        return _concat(mx, *s, axis=axis)
    a = norm_axis(axis, s[0].ndim + 1)
    shapes = {tuple(x.shape) for x in s}
    if len(shapes) > 1:
        raise ValueError(f"stacked tensors must share one shape, got {sorted(shapes)}")
    return mx.stack(s, axis=a)


# ---------------------------------------------------------------- optional
def _optional_check(view):
    """A tensor or sequence (or nothing) in, an optional out; the ``type`` attribute (a TypeProto ORT
    cannot expose) is not read: the output's declared type says the same."""
    return kinds_reason(view, {0: {TENSOR, SEQ}}, {0: {OPT}})


@register("Optional", 15, containers=True, opaque_attrs=("type",), check=_optional_check)
def optional(input=None, *, type=None):
    """An optional holding ``input``, empty when it is omitted (its type is the output's declared type)."""
    return input


def _has_element_host(input=None):
    return np.array(input is not None, np.bool_)


def _has_check(view):
    """An optional in, a bool tensor out."""
    return kinds_reason(view, {0: {OPT}}, {0: {TENSOR}})


def _has_check_v18(view):
    """An optional, tensor or sequence (or nothing) in, a bool tensor out."""
    return kinds_reason(view, {0: {OPT, TENSOR, SEQ}}, {0: {TENSOR}})


@register("OptionalHasElement", 15, containers=True, host=_has_element_host, shape_only=True, check=_has_check)
def optional_has_element(input):
    """Whether the optional holds a value (a bool scalar on the host)."""
    return _has_element_host(input)


@register("OptionalHasElement", 18, containers=True, host=_has_element_host, shape_only=True,
          check=_has_check_v18)
def optional_has_element_v18(input=None):
    """Opset 18: a tensor or sequence input holds a value; an omitted one does not."""
    return _has_element_host(input)


def _get_element(input):
    if input is None:
        raise ValueError("the optional input is empty (holds no element)")
    return input


def _get_check(view):
    """An optional in, its tensor or sequence out."""
    return kinds_reason(view, {0: {OPT}}, {0: {TENSOR, SEQ}})


def _get_check_v18(view):
    """An optional, tensor or sequence in, a tensor or sequence out."""
    return kinds_reason(view, {0: {OPT, TENSOR, SEQ}}, {0: {TENSOR, SEQ}})


@register("OptionalGetElement", 15, containers=True, check=_get_check)
def optional_get_element(input):
    """The value an optional holds (an error when empty)."""
    return _get_element(input)


@register("OptionalGetElement", 18, containers=True, check=_get_check_v18)
def optional_get_element_v18(input):
    """Opset 18: a tensor or sequence input is returned as is."""
    return _get_element(input)
