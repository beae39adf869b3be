"""Shape and layout ops: Shape, Size, Identity, Reshape, Transpose, Concat, Split,
Squeeze, Unsqueeze, Flatten, Expand, Tile, DepthToSpace, SpaceToDepth.

Most ops have a numpy twin (``host=``) with identical semantics so that shape
math (Shape -> Gather -> Concat -> Reshape ...) runs on the host. The shared
cores take the array module (``np`` or ``mx``) as their first argument.
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..registry import register


# ---------------------------------------------------------------- helpers
def ints(x) -> list[int]:
    """A host tensor (or list/attr) as a list of Python ints."""
    return [int(v) for v in np.asarray(x).reshape(-1)]


def norm_axis(axis: int, rank: int, what: str = "axis") -> int:
    """``axis`` in [-rank, rank) as a non-negative index."""
    axis = int(axis)
    if not -rank <= axis < rank:
        raise ValueError(f"{what} {axis} out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def norm_axes(axes, rank: int, what: str = "axes") -> list[int]:
    out = [norm_axis(a, rank, what) for a in axes]
    if len(set(out)) != len(out):
        raise ValueError(f"{what} {list(axes)} has duplicates")
    return out


def contiguous(out):
    """Host results as contiguous arrays (MLX cannot import negative strides, e.g. reversed slices)."""
    if isinstance(out, tuple):
        return tuple(contiguous(o) for o in out)
    out = np.asarray(out)
    return out if out.flags.c_contiguous else out.copy(order="C")      # (ascontiguousarray makes 0-d 1-d)


def twin(core):
    """The numpy twin of a core taking the array module first."""
    def host(*args, **attrs):
        return contiguous(core(np, *args, **attrs))
    host.__name__ = f"{core.__name__}_host"
    return host


# ---------------------------------------------------------------- Shape / Size / Identity
def _shape_host(data, *, start=0, end=None):
    return np.array(data.shape[start:end], dtype=np.int64)


@register("Shape", 1, host=_shape_host, shape_only=True)
def shape(data, *, start=0, end=None):
    """The shape as int64; start/end (opset 15) slice it, clamped like Python slices."""
    return _shape_host(data, start=start, end=end)


def _size_host(data):
    return np.array(math.prod(data.shape), dtype=np.int64)


@register("Size", 1, host=_size_host, shape_only=True)
def size(data):
    return _size_host(data)


def _identity(xp, x):
    return x


@register("Identity", 1, host=twin(_identity), carriers=True)
def identity(x):
    return x


# ---------------------------------------------------------------- Reshape
def reshape_target(in_shape, shape, allowzero: int = 0) -> list[int]:
    """ONNX Reshape's output shape: 0 copies the input dim (unless allowzero), -1 is inferred."""
    shape = ints(shape)
    out = []
    for i, s in enumerate(shape):
        if s == 0 and not allowzero:
            if i >= len(in_shape):
                raise ValueError(f"shape {shape}: 0 at position {i} but the input has rank {len(in_shape)}")
            s = in_shape[i]
        elif s < -1:
            raise ValueError(f"shape {shape} has invalid entry {s}")
        out.append(s)
    total = math.prod(in_shape)
    unknown = [i for i, s in enumerate(out) if s == -1]
    if len(unknown) > 1:
        raise ValueError(f"shape {shape} has more than one -1")
    if unknown:
        known = math.prod(s for i, s in enumerate(out) if i != unknown[0])
        if known == 0 and allowzero and total == 0:
            # ORT (allowzero, a 0 beside the -1): -1 = product of the non-zero input dims over the
            # product of the non-zero requested dims
            num = math.prod(d for d in in_shape if d)
            den = math.prod(s for i, s in enumerate(out) if i != unknown[0] and s)
            if num % den:
                raise ValueError(f"cannot reshape input of shape {tuple(in_shape)} to {shape}")
            out[unknown[0]] = num // den
            return out
        if known == 0 or total % known:
            raise ValueError(f"cannot reshape input of shape {tuple(in_shape)} to {shape}")
        out[unknown[0]] = total // known
    if math.prod(out) != total:
        raise ValueError(f"cannot reshape input of shape {tuple(in_shape)} to {shape}")
    return out


def _reshape(xp, data, shape, allowzero=0):
    return xp.reshape(data, reshape_target(data.shape, shape, allowzero))


def _reshape_check(view):
    """Refuses allowzero values other than 0/1."""
    if view.attrs.get("allowzero", 0) not in (0, 1):
        return f"allowzero={view.attrs['allowzero']!r}"
    return None


@register("Reshape", 5, const=(1,), host=twin(_reshape), check=_reshape_check, carriers=True)
def reshape(data, shape, *, allowzero=0):
    """Reshape; allowzero (opset 14) makes 0 a real zero-size dim."""
    return _reshape(mx, data, shape, allowzero)


# ---------------------------------------------------------------- Transpose
def _transpose(xp, data, perm=None):
    r = data.ndim
    perm = list(range(r))[::-1] if perm is None else norm_axes(perm, r, "perm")
    if len(perm) != r:
        raise ValueError(f"perm {perm} has length {len(perm)}, input rank is {r}")
    return xp.transpose(data, perm)


@register("Transpose", 1, host=twin(_transpose), carriers=True)
def transpose(data, *, perm=None):
    return _transpose(mx, data, perm)


# ---------------------------------------------------------------- Concat
def _concat(xp, *inputs, axis=1):
    if not inputs:
        raise ValueError("Concat needs at least one input")
    r = inputs[0].ndim
    a = norm_axis(axis, r)
    if any(x.ndim != r for x in inputs):
        raise ValueError(f"Concat inputs of ranks {[x.ndim for x in inputs]} differ")
    full = [x for x in inputs if math.prod(x.shape)]
    ref = (full or inputs)[0].shape
    if not full:
        shape = list(ref)
        shape[a] = sum(x.shape[a] for x in inputs)
        if not math.prod(shape):
            # every input empty and so is the output: ORT's shape (the first input's off the axis), whatever the rest
            return xp.zeros(shape, dtype=inputs[0].dtype)
    for x in inputs:
        if any(d != e for k, (d, e) in enumerate(zip(x.shape, ref)) if k != a):
            if math.prod(x.shape) == 0 and x.shape[a] == 0:
                continue                      # ORT skips an empty input that adds nothing
            raise ValueError(f"Concat inputs of shapes {[tuple(i.shape) for i in inputs]} differ off axis {axis}"
                             + (" (ORT would return uninitialized memory here)" if not math.prod(x.shape) else ""))
    if not full:
        return xp.zeros(shape, dtype=inputs[0].dtype)
    return xp.concatenate(full, axis=a) if len(full) > 1 else full[0]


@register("Concat", 1, host=twin(_concat))
def concat_v1(*inputs, axis=1):
    """Concat-1: axis defaults to 1."""
    return _concat(mx, *inputs, axis=axis)


def _concat_required(xp, *inputs, axis):
    return _concat(xp, *inputs, axis=axis)


@register("Concat", 4, host=twin(_concat_required))
def concat(*inputs, axis):
    """Concat (axis required from opset 4, negative from 11)."""
    return _concat(mx, *inputs, axis=axis)


# ---------------------------------------------------------------- Split
def split_sizes(dim: int, n_outputs: int, split=None, num_outputs=None) -> list[int]:
    """Chunk sizes along the split axis."""
    if split is not None:
        split = ints(split)
        if len(split) != n_outputs or sum(split) != dim or min(split, default=0) < 0:
            raise ValueError(f"split {split} does not divide dim {dim} into {n_outputs} outputs")
        return split
    if num_outputs is not None:
        if num_outputs != n_outputs or num_outputs < 1:
            raise ValueError(f"num_outputs={num_outputs} but the node has {n_outputs} outputs")
        chunk = -(-dim // num_outputs)
        sizes = [chunk] * (num_outputs - 1) + [dim - chunk * (num_outputs - 1)]
        if sizes[-1] <= 0:                  # ORT rejects an empty (or negative) last chunk
            raise ValueError(f"dim {dim} cannot be split into {num_outputs} chunks of {chunk}")
        return sizes
    if dim % n_outputs:
        raise ValueError(f"dim {dim} cannot be split evenly into {n_outputs} outputs")
    return [dim // n_outputs] * n_outputs


def _split(x, axis, sizes):
    a = norm_axis(axis, x.ndim)
    outs, start = [], 0
    for s in sizes:
        sl = [slice(None)] * x.ndim
        sl[a] = slice(start, start + s)
        outs.append(x[tuple(sl)])
        start += s
    return tuple(outs)


def _split_attr_check(view):
    """Refuses an empty split attribute (ambiguous between versions)."""
    s = view.attrs.get("split")
    return "empty split attribute" if s is not None and len(s) == 0 else None


@register("Split", 2, check=_split_attr_check)
def split_v2(input, *, axis=0, split=None, ctx):
    """Split-2/11: sizes as an attribute."""
    x = input
    return _split(x, axis, split_sizes(x.shape[norm_axis(axis, x.ndim)], ctx.n_outputs, split or None))


@register("Split", 13, const=(1,))
def split_v13(input, split=None, *, axis=0, ctx):
    """Split-13: sizes as an optional input."""
    x = input
    return _split(x, axis, split_sizes(x.shape[norm_axis(axis, x.ndim)], ctx.n_outputs, split))


@register("Split", 18, const=(1,))
def split_v18(input, split=None, *, axis=0, num_outputs=None, ctx):
    """Split-18: sizes as an input or num_outputs chunks (the last one smaller)."""
    x = input
    if split is not None and num_outputs is not None:
        raise ValueError("both the split input and num_outputs are given")
    return _split(x, axis, split_sizes(x.shape[norm_axis(axis, x.ndim)], ctx.n_outputs, split, num_outputs))


# ---------------------------------------------------------------- Squeeze / Unsqueeze / Flatten
def _squeeze(xp, data, axes=None):
    if axes is None:
        ax = [i for i, d in enumerate(data.shape) if d == 1]
    else:
        ax = sorted({norm_axis(a, data.ndim, "axes") for a in ints(axes)})   # ORT accepts duplicates here
        bad = [a for a in ax if data.shape[a] != 1]
        if bad:
            raise ValueError(f"cannot squeeze axis {bad[0]} of size {data.shape[bad[0]]}")
    return xp.reshape(data, [d for i, d in enumerate(data.shape) if i not in ax])


@register("Squeeze", 1, host=twin(_squeeze))
def squeeze_v1(data, *, axes=None):
    return _squeeze(mx, data, axes)


@register("Squeeze", 13, const=(1,), host=twin(_squeeze))
def squeeze(data, axes=None):
    return _squeeze(mx, data, axes)


def _unsqueeze(xp, data, axes):
    axes = ints(axes)
    r = data.ndim + len(axes)
    ax = set(norm_axes(axes, r))
    it = iter(data.shape)
    return xp.reshape(data, [1 if i in ax else next(it) for i in range(r)])


@register("Unsqueeze", 1, host=twin(_unsqueeze))
def unsqueeze_v1(data, *, axes):
    return _unsqueeze(mx, data, axes)


@register("Unsqueeze", 13, const=(1,), host=twin(_unsqueeze))
def unsqueeze(data, axes):
    return _unsqueeze(mx, data, axes)


def _flatten(xp, input, axis=1):
    r = input.ndim
    if not -r <= axis <= r:
        raise ValueError(f"axis {axis} out of range for rank {r}")
    a = axis + r if axis < 0 else axis
    return xp.reshape(input, (math.prod(input.shape[:a]), math.prod(input.shape[a:])))


@register("Flatten", 1, host=twin(_flatten))
def flatten(input, *, axis=1):
    return _flatten(mx, input, axis)


# ---------------------------------------------------------------- Expand / Tile
def _expand(xp, input, shape):
    shape = ints(shape)
    if min(shape, default=0) < 0:
        raise ValueError(f"shape {shape} has a negative entry")
    try:
        out = np.broadcast_shapes(tuple(input.shape), tuple(shape))
    except ValueError:
        raise ValueError(f"input of shape {tuple(input.shape)} cannot be expanded to {shape}") from None
    return xp.broadcast_to(input, out)


@register("Expand", 8, const=(1,), host=twin(_expand))
def expand(input, shape):
    """Bidirectional broadcast of the input against ``shape``."""
    return _expand(mx, input, shape)


def _tile(xp, input, repeats):
    repeats = ints(repeats)
    if len(repeats) != input.ndim or min(repeats, default=0) < 0:
        raise ValueError(f"repeats {repeats} invalid for input of rank {input.ndim}")
    if input.ndim == 0:
        return input
    return xp.tile(input, repeats)


@register("Tile", 6, const=(1,), host=twin(_tile))
def tile(input, repeats):
    return _tile(mx, input, repeats)


# ---------------------------------------------------------------- DepthToSpace / SpaceToDepth
def _d2s_check(view):
    """Refuses modes other than DCR/CRD."""
    if view.attrs.get("mode", "DCR") not in ("DCR", "CRD"):
        return f"mode {view.attrs['mode']!r}"
    return None


def _depth_to_space(x, blocksize, mode):
    if x.ndim != 4:
        raise ValueError(f"input rank {x.ndim}, expected 4")
    b, c, h, w = x.shape
    bs = int(blocksize)
    if bs < 1 or c % (bs * bs):
        raise ValueError(f"channels {c} not divisible by blocksize {bs}^2")
    c2 = c // (bs * bs)
    if mode == "DCR":
        y = mx.transpose(mx.reshape(x, (b, bs, bs, c2, h, w)), (0, 3, 4, 1, 5, 2))
    else:
        y = mx.transpose(mx.reshape(x, (b, c2, bs, bs, h, w)), (0, 1, 4, 2, 5, 3))
    return mx.reshape(y, (b, c2, h * bs, w * bs))


@register("DepthToSpace", 1, check=_d2s_check)
def depth_to_space_v1(input, *, blocksize):
    return _depth_to_space(input, blocksize, "DCR")


@register("DepthToSpace", 11, check=_d2s_check)
def depth_to_space(input, *, blocksize, mode="DCR"):
    return _depth_to_space(input, blocksize, mode)


@register("SpaceToDepth", 1, check=_d2s_check)
def space_to_depth(input, *, blocksize):
    x = input
    if x.ndim != 4:
        raise ValueError(f"input rank {x.ndim}, expected 4")
    b, c, h, w = x.shape
    bs = int(blocksize)
    if bs < 1 or h % bs or w % bs:
        raise ValueError(f"spatial dims {(h, w)} not divisible by blocksize {bs}")
    y = mx.transpose(mx.reshape(x, (b, c, h // bs, bs, w // bs, bs)), (0, 3, 5, 1, 2, 4))
    return mx.reshape(y, (b, c * bs * bs, h // bs, w // bs))

