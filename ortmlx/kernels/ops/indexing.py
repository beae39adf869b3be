"""Indexing and data movement: Slice, Gather*, Scatter*, Pad, TopK, NonZero, Unique,
Compress, ReverseSequence, CenterCropPad.

Index tensors are host values (``const=``): they are range-checked on the host
(ORT errors on an out-of-range index, so do we) and turned into flat positions
before they reach MLX.
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .. import cuda_kernels
from .. import dtypes as dt
from ..registry import register
from .shape import contiguous, ints, norm_axes, norm_axis, twin


def _idx(a: np.ndarray) -> mx.array:
    """Host positions as an MLX index array."""
    a = np.asarray(a, dtype=np.int64)
    return mx.array(a.astype(np.int32) if a.size == 0 or a.max() < 2**31 else a)


def check_indices(indices, n: int, what: str = "index") -> np.ndarray:
    """Indices in [-n, n) as non-negative int64; ValueError naming the first bad one."""
    idx = np.asarray(indices).astype(np.int64)
    bad = (idx < -n) | (idx >= n)
    if bad.any():
        raise ValueError(f"{what} {int(idx[bad].reshape(-1)[0])} out of range [{-n}, {n - 1}]")
    return np.where(idx < 0, idx + n, idx)


# ---------------------------------------------------------------- Slice
_INT_MAX = (2**31 - 1, 2**63 - 1)


def slice_spec(shape, starts, ends, axes=None, steps=None) -> tuple:
    """Python slices with ONNX Slice semantics (negative and out-of-range starts/ends clamp)."""
    starts, ends = ints(starts), ints(ends)
    r = len(shape)
    axes = list(range(len(starts))) if axes is None else norm_axes(ints(axes), r)
    steps = [1] * len(starts) if steps is None else ints(steps)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ValueError(f"starts {starts}, ends {ends}, axes {axes}, steps {steps} differ in length")
    sl = [slice(None)] * r
    for s, e, a, st in zip(starts, ends, axes, steps):
        if st == 0:
            raise ValueError(f"step 0 on axis {a}")
        d = shape[a]
        open_end = e in _INT_MAX                 # ORT: an INT32/INT64 max end means "to the edge"
        s, e = s + d if s < 0 else s, e + d if e < 0 else e
        if st > 0:
            s, e = min(max(s, 0), d), min(max(e, 0), d)
        else:
            s, e = min(max(s, 0), d - 1), -1 if open_end else min(max(e, -1), d - 1)
        sl[a] = slice(s, None if e < 0 else e, st) if d > 0 else slice(0, 0)
    return tuple(sl)


def _slice(xp, data, starts, ends, axes=None, steps=None):
    return data[slice_spec(data.shape, starts, ends, axes, steps)]


def _slice1_host(data, *, starts, ends, axes=None):
    return contiguous(_slice(np, data, starts, ends, axes))


@register("Slice", 1, host=_slice1_host)
def slice_v1(data, *, starts, ends, axes=None):
    """Slice-1: starts/ends/axes as attributes."""
    return _slice(mx, data, starts, ends, axes)


@register("Slice", 10, const=(1, 2, 3, 4), host=twin(_slice))
def slice_(data, starts, ends, axes=None, steps=None):
    """Slice-10+: starts/ends/axes/steps as host inputs; negative steps walk backwards."""
    return _slice(mx, data, starts, ends, axes, steps)


# ---------------------------------------------------------------- Gather family
def _gather(xp, data, indices, axis=0):
    a = norm_axis(axis, data.ndim)
    idx = check_indices(indices, data.shape[a])
    return np.take(data, idx, axis=a) if xp is np else cuda_kernels.take(data, _idx(idx), a)


@register("Gather", 1, const=(1,), host=twin(_gather))
def gather(data, indices, *, axis=0):
    """Gather along ``axis``; negative indices count from the end; out of range is an error."""
    return _gather(mx, data, indices, axis)


def _gather_elements(xp, data, indices, axis=0):
    r = data.ndim
    a = norm_axis(axis, r)
    idx = np.asarray(indices)
    if idx.ndim != r:
        raise ValueError(f"indices rank {idx.ndim} != data rank {r}")
    if any(i > d for k, (i, d) in enumerate(zip(idx.shape, data.shape)) if k != a):
        raise ValueError(f"indices shape {idx.shape} exceeds data shape {tuple(data.shape)} off axis {a}")
    idx = check_indices(idx, data.shape[a])
    sl = tuple(slice(None) if k == a else slice(0, i) for k, i in enumerate(idx.shape))
    d = data[sl]
    if idx.size == 0:
        return xp.zeros(idx.shape, dtype=data.dtype)
    return np.take_along_axis(d, idx, a) if xp is np else mx.take_along_axis(d, _idx(idx), axis=a)


@register("GatherElements", 11, const=(1,), host=twin(_gather_elements))
def gather_elements(data, indices, *, axis=0):
    return _gather_elements(mx, data, indices, axis)


def nd_positions(shape, indices, batch_dims: int = 0, lenient_empty: bool = False) -> tuple[np.ndarray, int, tuple]:
    """GatherND/ScatterND addressing: flat slice numbers (shape indices.shape[:-1]), slice size, slice shape.

    ``lenient_empty``: when the addressed slices are empty nothing is read, and (like ORT's GatherND)
    the indices are not range-checked.
    """
    idx = np.asarray(indices).astype(np.int64)
    b, r = int(batch_dims), len(shape)
    if idx.ndim < 1 or not 0 <= b < min(idx.ndim, r):
        raise ValueError(f"batch_dims {b} invalid for indices rank {idx.ndim} and data rank {r}")
    k = idx.shape[-1]
    if k > r - b:
        raise ValueError(f"index tuples of length {k} exceed data rank {r} - batch_dims {b}")
    if tuple(idx.shape[:b]) != tuple(shape[:b]):
        raise ValueError(f"batch dims of indices {idx.shape[:b]} != data {tuple(shape[:b])}")
    dims = shape[b:b + k]
    rest = tuple(shape[b + k:])
    if lenient_empty and math.prod(rest) == 0:
        return np.zeros(idx.shape[:-1], np.int64), 0, rest
    flat = np.zeros(idx.shape[:-1], np.int64)
    for j, n in enumerate(dims):
        flat = flat * n + check_indices(idx[..., j], n)
    nb, p = math.prod(shape[:b]), math.prod(dims)
    offsets = (np.arange(nb, dtype=np.int64) * p).reshape(tuple(shape[:b]) + (1,) * (flat.ndim - b))
    flat = flat + offsets
    return flat, math.prod(rest), rest


def _gather_nd(xp, data, indices, batch_dims=0):
    flat, inner, rest = nd_positions(data.shape, indices, batch_dims, lenient_empty=True)
    if inner == 0:
        return xp.zeros((*flat.shape, *rest), dtype=data.dtype)
    src = xp.reshape(data, (math.prod(data.shape[:data.ndim - len(rest)]), *rest))
    out = np.take(src, flat.reshape(-1), axis=0) if xp is np else mx.take(src, _idx(flat.reshape(-1)), axis=0)
    return xp.reshape(out, (*flat.shape, *rest))


@register("GatherND", 11, const=(1,), host=twin(_gather_nd))
def gather_nd(data, indices, *, batch_dims=0):
    """GatherND (batch_dims from opset 12)."""
    return _gather_nd(mx, data, indices, batch_dims)


def _scatter_flat(data, pos: np.ndarray, updates, reduction: str):
    """Scatter ``updates`` (same size as ``pos``) into the flattened data at host positions."""
    flat = mx.reshape(data, (-1,))
    upd = mx.reshape(updates, (-1,))
    pos = pos.reshape(-1)
    if pos.size == 0:
        return data
    if reduction == "none":              # ORT writes in order: the last duplicate wins
        _, first_rev = np.unique(pos[::-1], return_index=True)
        keep = np.sort(pos.size - 1 - first_rev)
        if keep.size != pos.size:
            upd = mx.take(upd, _idx(keep), axis=0)
            pos = pos[keep]
        out = mx.put_along_axis(flat, _idx(pos), upd, axis=0)
    else:
        at = flat.at[_idx(pos)]
        out = {"add": at.add, "mul": at.multiply, "max": at.maximum, "min": at.minimum}[reduction](upd)
    return mx.reshape(out, data.shape)


def _reduction_check(allowed):
    def check(view):
        """Refuses unknown reductions and reductions on bool. float16 and bfloat16 ones are taken, though ORT's CPU
        kernel has none (a model holding one runs only where an EP takes it): tested against the float32 op."""
        red = view.attrs.get("reduction", "none")
        if red not in allowed:
            return f"reduction {red!r}"
        if red != "none" and view.dtype(0) == dt.BOOL:
            return f"reduction {red!r} on {dt.name(view.dtype(0))} (ORT's CPU kernel rejects it)"
        return None
    return check


def _scatter_elements(data, indices, updates, axis, reduction):
    r = data.ndim
    a = norm_axis(axis, r)
    idx = np.asarray(indices)
    if idx.ndim != r or tuple(idx.shape) != tuple(updates.shape):
        raise ValueError(f"indices shape {idx.shape} must equal updates shape {tuple(updates.shape)} "
                         f"and have the data rank {r}")
    if any(i > d for k, (i, d) in enumerate(zip(idx.shape, data.shape)) if k != a):
        raise ValueError(f"indices shape {idx.shape} exceeds data shape {tuple(data.shape)} off axis {a}")
    idx = check_indices(idx, data.shape[a])
    coords = list(np.indices(idx.shape, sparse=True))
    coords[a] = idx
    pos = np.ravel_multi_index(tuple(np.broadcast_arrays(*coords)), data.shape) if idx.size else idx
    return _scatter_flat(data, pos, updates, reduction)


@register("Scatter", 9, const=(1,))
def scatter(data, indices, updates, *, axis=0):
    """Scatter (deprecated alias of ScatterElements without reduction)."""
    return _scatter_elements(data, indices, updates, axis, "none")


@register("ScatterElements", 11, const=(1,), check=_reduction_check({"none", "add", "mul", "max", "min"}))
def scatter_elements(data, indices, updates, *, axis=0, reduction="none"):
    """ScatterElements; reduction add/mul from opset 16, max/min from 18."""
    return _scatter_elements(data, indices, updates, axis, reduction)


@register("ScatterND", 11, const=(1,), check=_reduction_check({"none", "add", "mul", "max", "min"}))
def scatter_nd(data, indices, updates, *, reduction="none"):
    """ScatterND; reduction add/mul from opset 16, max/min from 18."""
    flat, inner, rest = nd_positions(data.shape, indices)
    if tuple(updates.shape) != (*flat.shape, *rest):
        raise ValueError(f"updates shape {tuple(updates.shape)} != {(*flat.shape, *rest)}")
    pos = flat[..., None] * inner + np.arange(inner, dtype=np.int64)
    return _scatter_flat(data, pos, updates, reduction)


# ---------------------------------------------------------------- Pad
def _pad_check(view):
    """Refuses unknown modes (wrap only from opset 19)."""
    mode = view.attrs.get("mode", "constant")
    allowed = ("constant", "reflect", "edge") + (("wrap",) if view.since_version >= 19 else ())
    if mode not in allowed:
        return f"mode {mode!r}"
    return None


def _pad_index(d: int, before: int, after: int, mode: str) -> np.ndarray:
    """Source position of every output position along one axis (edge / wrap / reflect)."""
    i = np.arange(-before, d + after)
    if mode == "edge":
        return np.clip(i, 0, d - 1)
    if mode == "wrap":
        return np.mod(i, d)
    if d == 1:
        return np.zeros_like(i)
    period = 2 * (d - 1)
    i = np.mod(i, period)
    return np.where(i < d, i, period - i)


def _pad(data, pads, value, mode, axes):
    """Crop negative pads, then pad: constant with ``value`` (0 when None), else via a host index map."""
    r = data.ndim
    pads = ints(pads)
    axes = list(range(r)) if axes is None else norm_axes(ints(axes), r)
    if len(pads) != 2 * len(axes):
        raise ValueError(f"pads {pads} must have 2 entries per axis ({len(axes)} axes)")
    n = len(axes)
    if mode != "constant" and math.prod(data.shape) == 0:
        return _pad_empty(data, pads, axes, mode)
    crop = [slice(None)] * r
    grow = [(0, 0)] * r
    for k, a in enumerate(axes):
        b, e, d = pads[k], pads[k + n], data.shape[a]
        lo, hi = max(-b, 0), d - max(-e, 0)
        if d + b + e < 0:
            raise ValueError(f"pads {(b, e)} leave a negative size on axis {a} of size {d}")
        if hi <= lo and (b or e) and mode != "constant":
            raise ValueError(f"{mode} padding of axis {a}, which is empty after cropping")
        if hi < lo:                          # cropped past the end: only constant values remain
            crop[a], grow[a] = slice(0, 0), (d + b + e, 0)
            continue
        crop[a] = slice(lo, hi)
        grow[a] = (max(b, 0), max(e, 0))
        if mode == "reflect" and (b > 0 or e > 0) and max(b, e) > hi - lo - 1:
            raise ValueError(f"reflect pads {(b, e)} exceed {hi - lo - 1}, the most axis {a} allows")
    x = data[tuple(crop)]
    if mode == "constant":
        if all(g == (0, 0) for g in grow):
            return x
        v = mx.array(0, x.dtype) if value is None else value
        return mx.pad(x, grow, constant_values=v)
    for a, (b, e) in enumerate(grow):
        if b or e:
            d = x.shape[a]
            x = mx.take(x, _idx(_pad_index(d, b, e, mode)), axis=a)
    return x


def _pad_empty(data, pads, axes, mode):
    """Edge/reflect/wrap padding of an empty input, as ORT's CPU kernel decides it."""
    if mode == "wrap":
        raise ValueError("wrap padding of an empty input")
    n, out = len(axes), list(data.shape)
    for k, a in enumerate(axes):
        b, e, d = pads[k], pads[k + n], data.shape[a]
        if d == 0 and d + b + e > 0:
            raise ValueError(f"{mode} padding of axis {a}, which is empty")
        if d + b + e < 0:
            raise ValueError(f"pads {(b, e)} leave a negative size on axis {a} of size {d}")
        out[a] = d + b + e
    return mx.zeros(out, data.dtype)


@register("Pad", 2, check=_pad_check)
def pad_v2(data, *, pads, mode="constant", value=0.0):
    """Pad-2: pads and value as attributes."""
    return _pad(data, pads, mx.array(value).astype(data.dtype), mode, None)


@register("Pad", 11, const=(1, 3), check=_pad_check)
def pad(data, pads, constant_value=None, axes=None, *, mode="constant"):
    """Pad-11+: pads (and axes from 18) as host inputs, constant_value a one-element tensor; wrap from 19."""
    v = None
    if constant_value is not None:
        if constant_value.size != 1:
            raise ValueError(f"constant_value must hold one element, got shape {tuple(constant_value.shape)}")
        v = mx.reshape(constant_value, ()).astype(data.dtype)
    return _pad(data, pads, v, mode, axes)


# ---------------------------------------------------------------- TopK
_TOPK_TYPES = {dt.FLOAT, dt.DOUBLE, dt.INT32, dt.INT64, dt.FLOAT16, dt.BFLOAT16, dt.INT8, dt.UINT8,
               dt.INT16, dt.UINT16, dt.UINT32, dt.UINT64}


def _topk_check(view):
    """Refuses sorted=0: ORT's unsorted order is implementation-defined."""
    if not view.attrs.get("sorted", 1):
        return "sorted=0: ORT's unsorted order is implementation-defined"
    return None


def _topk(x, k: int, axis: int, largest: int):
    a = norm_axis(axis, x.ndim)
    n = x.shape[a]
    if not 0 <= k <= n:
        raise ValueError(f"k={k} out of range for axis {a} of size {n}")
    if x.dtype in (mx.float32, mx.float16, mx.bfloat16, mx.float64):
        key = -x if largest else x
    else:
        key = mx.bitwise_invert(x) if largest else x       # order-reversing and exact for every int type
    order = mx.argsort(key, axis=a)                         # stable: ties keep the lower index first
    sl = [slice(None)] * x.ndim
    sl[a] = slice(0, k)
    idx = order[tuple(sl)]
    if k == 1 and key.dtype == x.dtype and mx.issubdtype(x.dtype, mx.floating):
        # ORT's k=1 scan keeps the first element when it is NaN (nothing compares greater/less);
        # otherwise NaNs never win, as here. (k > 1 with NaNs: ORT's heap order is not reproduced.)
        sl[a] = slice(0, 1)
        idx = mx.where(mx.isnan(x[tuple(sl)]), mx.zeros_like(idx), idx)
    return mx.take_along_axis(x, idx, axis=a), idx.astype(mx.int64)


@register("TopK", 1, dtypes=_TOPK_TYPES, check=_topk_check)
def topk_v1(X, *, k, axis=-1):
    return _topk(X, int(k), axis, 1)


@register("TopK", 10, const=(1,), dtypes=_TOPK_TYPES, check=_topk_check)
def topk_v10(X, K, *, axis=-1):
    return _topk(X, ints(K)[0] if np.asarray(K).size == 1 else _bad_k(K), axis, 1)


@register("TopK", 11, const=(1,), dtypes=_TOPK_TYPES, check=_topk_check)
def topk(X, K, *, axis=-1, largest=1, sorted=1):
    """TopK; ties resolve to the lower index (ORT's order). sorted=0 is refused."""
    return _topk(X, ints(K)[0] if np.asarray(K).size == 1 else _bad_k(K), axis, largest)


def _bad_k(K):
    raise ValueError(f"K must hold a single value, got shape {np.asarray(K).shape}")


# ---------------------------------------------------------------- host-computed: NonZero, Unique

@register("NonZero", 9, host_computed=True)
def nonzero(X, *, ctx):
    """Indices of the non-zero elements, (rank, n) int64 in row-major order."""
    x = dt.host(X)
    if ctx.in_dtypes[0] == dt.BFLOAT16:
        x = x & 0x7FFF                      # bf16 bits: +-0 are the only zeros
    if x.ndim == 0:                         # ORT: one coordinate row for a scalar
        return np.zeros((1, int(bool(x))), np.int64)
    return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)


_UNIQUE_TYPES = dt.NUMERIC - {dt.BFLOAT16} | {dt.BOOL}      # bf16 bits would not sort as numbers


@register("Unique", 11, dtypes=_UNIQUE_TYPES, host_computed=True)
def unique(X, *, axis=None, sorted=1):
    """Unique values (or slices along ``axis``): Y, first indices, inverse indices, counts."""
    x = dt.host(X)
    if x.dtype.kind == "f" and np.isnan(x).any():
        raise ValueError("NaN input: ORT's Unique treats NaN as equal to whatever it is compared with, "
                         "an order-dependent result that is not reproduced")
    if axis is None:
        flat = x.reshape(-1)
    else:
        a = norm_axis(axis, x.ndim)
        inner = math.prod(d for k, d in enumerate(x.shape) if k != a)
        flat = np.moveaxis(x, a, 0).reshape(x.shape[a], inner)
    y, first, inverse, counts = np.unique(flat, return_index=True, return_inverse=True, return_counts=True,
                                          axis=None if axis is None else 0)
    inverse = inverse.reshape(-1)
    if not sorted:                            # order of first occurrence
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        y, first, counts, inverse = y[order], first[order], counts[order], rank[inverse]
    if axis is not None:
        a = norm_axis(axis, x.ndim)
        rest = tuple(np.delete(np.array(x.shape), a))
        y = np.moveaxis(y.reshape((y.shape[0], *rest)), 0, a)
    i64 = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return np.ascontiguousarray(y), i64(first), i64(inverse), i64(counts)


# ---------------------------------------------------------------- Compress / ReverseSequence / CenterCropPad
@register("Compress", 9, const=(1,))
def compress(input, condition, *, axis=None):
    """Elements (or slices along ``axis``) where ``condition`` is true."""
    cond = np.asarray(condition).astype(bool).reshape(-1)
    x = mx.reshape(input, (-1,)) if axis is None else input
    a = 0 if axis is None else norm_axis(axis, input.ndim)
    cond = cond[:x.shape[a]]                # ORT ignores entries past the end of the axis
    return mx.take(x, _idx(np.nonzero(cond)[0]), axis=a)


@register("ReverseSequence", 10, const=(1,))
def reverse_sequence(input, sequence_lens, *, batch_axis=1, time_axis=0):
    """Reverse the first sequence_lens[b] steps along ``time_axis`` of every batch entry."""
    x = input
    if x.ndim < 2:
        raise ValueError(f"input rank {x.ndim} < 2")
    ba, ta = norm_axis(batch_axis, x.ndim, "batch_axis"), norm_axis(time_axis, x.ndim, "time_axis")
    if ba == ta or {ba, ta} - {0, 1}:
        raise ValueError(f"batch_axis {batch_axis} and time_axis {time_axis} must be 0 and 1")
    lens = np.asarray(sequence_lens).astype(np.int64).reshape(-1)
    nb, nt = x.shape[ba], x.shape[ta]
    if lens.size != nb:
        raise ValueError(f"sequence_lens has {lens.size} entries, batch axis has {nb}")
    if ((lens < 0) | (lens > nt)).any():
        raise ValueError(f"sequence_lens {lens.tolist()} out of range [0, {nt}]")
    t = np.arange(nt)[None, :]
    src = np.where(t < lens[:, None], lens[:, None] - 1 - t, t)       # (batch, time)
    if ta < ba:
        src = src.T
    shape = list(src.shape) + [1] * (x.ndim - 2)
    idx = mx.broadcast_to(_idx(src.reshape(shape)), x.shape)
    return mx.take_along_axis(x, idx, axis=ta)


@register("CenterCropPad", 18, const=(1,))
def center_crop_pad(input_data, shape, *, axes=None):
    """Crop or zero-pad each axis to ``shape``, centred (odd remainders go to the end)."""
    x = input_data
    shape = ints(shape)
    axes = list(range(x.ndim)) if axes is None else norm_axes(axes, x.ndim)
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} has {len(shape)} entries for {len(axes)} axes")
    crop = [slice(None)] * x.ndim
    grow = [(0, 0)] * x.ndim
    for a, s in zip(axes, shape):
        d = x.shape[a]
        if s < 0:
            raise ValueError(f"negative target size {s}")
        if s < d:
            lo = (d - s) // 2
            crop[a] = slice(lo, lo + s)
        elif s > d:
            lo = (s - d) // 2
            grow[a] = (lo, s - d - lo)
    y = x[tuple(crop)]
    return mx.pad(y, grow) if any(g != (0, 0) for g in grow) else y


# ---------------------------------------------------------------- Col2Im
def col2im_positions(image, block, dilations, pads, strides) -> np.ndarray:
    """Flat image position of every (kernel offset, column) pair, -1 where it falls in the padding."""
    n = len(image)
    grids = []
    for d in range(n):
        span = dilations[d] * (block[d] - 1) + 1
        n_out = (image[d] + pads[d] + pads[d + n] - span) // strides[d] + 1
        if n_out < 1:
            raise ValueError(f"block {block[d]} (dilation {dilations[d]}) does not fit image dim {image[d]} "
                             f"with pads {(pads[d], pads[d + n])}")
        k = np.arange(block[d])[:, None]
        o = np.arange(n_out)[None, :]
        grids.append(o * strides[d] - pads[d] + k * dilations[d])           # (block[d], n_out[d])
    pos = np.zeros([1] * (2 * n), np.int64)
    ok = np.ones([1] * (2 * n), bool)
    for d, g in enumerate(grids):
        shape = [1] * (2 * n)
        shape[d], shape[n + d] = g.shape
        g = g.reshape(shape)
        pos = pos * image[d] + g
        ok = ok & (g >= 0) & (g < image[d])
    pos = np.where(ok, pos, -1)
    return pos.reshape(math.prod(block), -1)                                  # (prod(block), L)


@register("Col2Im", 18, const=(1, 2), dtypes={dt.FLOAT})   # ORT's CPU kernel: float only (nothing to verify others)
def col2im(input, image_shape, block_shape, *, dilations=None, pads=None, strides=None):
    """Sum the columns of ``input`` (N, C*prod(block), L) back into images (N, C, *image_shape)."""
    image, block = ints(image_shape), ints(block_shape)
    n = len(image)
    dil = [1] * n if dilations is None else list(dilations)
    st = [1] * n if strides is None else list(strides)
    pd = [0] * (2 * n) if pads is None else list(pads)
    if len(block) != n or len(dil) != n or len(st) != n or len(pd) != 2 * n or min(block + dil + st) < 1:
        raise ValueError(f"image_shape {image}, block_shape {block}, dilations {dil}, strides {st}, pads {pd} "
                         "are inconsistent")
    pos = col2im_positions(image, block, dil, pd, st)
    nb, c_k, length = input.shape
    k = math.prod(block)
    if c_k % k or pos.shape[1] != length:
        raise ValueError(f"input shape {tuple(input.shape)} does not match block {block} and {pos.shape[1]} columns")
    c = c_k // k
    keep = np.nonzero(pos.reshape(-1) >= 0)[0]
    cols = mx.transpose(mx.reshape(input, (nb * c, k * length)))                # (K*L, N*C)
    cols = mx.take(cols, _idx(keep), axis=0)
    out = mx.zeros((math.prod(image), nb * c), input.dtype).at[_idx(pos.reshape(-1)[keep])].add(cols)
    return mx.reshape(mx.transpose(out), (nb, c, *image))


# ---------------------------------------------------------------- TensorScatter (opset 24)
def _tensor_scatter_check(view):
    mode = view.attrs.get("mode", "linear")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in ("linear", "circular"):
        return f"mode {mode!r} is not 'linear' or 'circular'"
    return None


@register("TensorScatter", 24, const=(2,), check=_tensor_scatter_check)
def tensor_scatter(past_cache, update, write_indices=None, *, mode="linear", axis=-2):
    """The cache with ``update`` written along ``axis`` from ``write_indices[b]`` for each batch row b.

    Validation follows ORT's CPU kernel (errors, not values): axis in [1, rank), shapes equal off
    the axis, sequence_length <= max_sequence_length, write_indices of shape [batch] and >= 0, and
    in linear mode write_index + sequence_length <= max_sequence_length. Circular positions are
    taken modulo max_sequence_length; with sequence_length <= max they never repeat.
    """
    mode = mode.decode() if isinstance(mode, bytes) else mode
    r = past_cache.ndim
    ax = axis + r if axis < 0 else axis
    if not 0 < ax < r:
        raise ValueError(f"TensorScatter axis {axis} must be in [1, {r - 1}] after normalization")
    if update.ndim != r or any(a != b for d, (a, b) in enumerate(zip(past_cache.shape, update.shape)) if d != ax):
        raise ValueError(f"update shape {tuple(update.shape)} differs from past_cache {tuple(past_cache.shape)} "
                         f"off axis {ax}")
    batch, m, s = past_cache.shape[0], past_cache.shape[ax], update.shape[ax]
    if s > m:
        raise ValueError(f"update sequence_length {s} exceeds max_sequence_length {m}")
    if write_indices is None:
        w = np.zeros(batch, np.int64)
    else:
        w = np.asarray(write_indices).astype(np.int64)
        if w.shape != (batch,):
            raise ValueError(f"write_indices shape {w.shape} must be [batch_size] = ({batch},)")
    if (w < 0).any():
        raise ValueError(f"write_indices {int(w[w < 0][0])} is negative")
    if mode == "linear" and (w > m - s).any():
        raise ValueError(f"linear mode: write_indices {int(w[w > m - s][0])} + sequence_length {s} exceeds "
                         f"max_sequence_length {m}")
    if s == 0 or update.size == 0:
        return past_cache
    pos = w[:, None] + np.arange(s, dtype=np.int64)[None, :]
    if mode == "circular":
        pos %= m
    idx = _idx(pos).reshape((batch,) + (1,) * (ax - 1) + (s,) + (1,) * (r - ax - 1))
    return mx.put_along_axis(past_cache, mx.broadcast_to(idx, update.shape), update, axis=ax)
