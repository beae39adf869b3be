"""Reductions (ReduceX, ArgMax/ArgMin) and CumSum.

Axes come from the attribute (ReduceX before opset 18, ReduceSum before 13) or from a
host-known second input. Empty axes reduce everything unless noop_with_empty_axes.
Reducing an empty set gives what ORT's CPU EP gives: 0 for sums and means, 1 for
products, the type's lowest/highest value for max/min, -inf (the type's minimum for
integers) for the log reductions. Integer L2/LogSum/LogSumExp/Mean compute in float
and truncate, like ORT, except LogSumExp, which ORT (1.31) sums as e^(x - max) in the
integer type, dropping every term below 1: it answers trunc(max + log(#maxima)); here it is
ONNX's reference, the float log-sum-exp truncated (tests/ops/test_reduction.py).

Integer ReduceSum is exact and wraps on overflow; ORT's CPU EP (1.31) sums integers through double
and saturates: the two differ only on sums out of the type's range or, for int64, past 2**53
(measured: [2**53 + 1, 2] -> 2**53 + 2 there). Not refused (a claim-time check cannot see values).

NaN: ORT's float ReduceMax/ReduceMin treat NaN inconsistently (it depends on position
and vectorisation); we propagate NaN as the ONNX reference does. ArgMax/ArgMin follow
ORT's sequential rule: a NaN first element wins, other NaNs are skipped.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ..registry import register

F = frozenset({dt.FLOAT, dt.FLOAT16, dt.DOUBLE, dt.BFLOAT16})
REDUCE = F | frozenset({dt.INT32, dt.INT64})
MAXMIN = F | frozenset({dt.INT8, dt.UINT8, dt.INT32, dt.INT64, dt.BOOL})
LSE = F | frozenset({dt.INT32, dt.INT64})
HALF = (mx.float16, mx.bfloat16)


def _norm_axes(axes, rank: int, noop: int):
    """Sorted non-negative axes; None means identity (noop with empty axes)."""
    if axes is None or len(axes) == 0:
        return None if noop else tuple(range(rank))
    out = []
    for a in np.asarray(axes).reshape(-1).tolist():
        a = int(a)
        if not -rank <= a < max(rank, 1):
            raise ValueError(f"axis {a} out of range for rank {rank}")
        out.append(a % rank if rank else 0)
    if len(set(out)) != len(out):
        raise ValueError(f"repeated axes {list(axes)!r}")
    return tuple(sorted(out))


def _empty_value(kind: str, dtype):
    if kind in ("sum", "mean", "l1", "l2", "sumsquare"):
        return 0
    if kind == "prod":
        return 1
    if dtype == mx.bool_:
        return kind == "min"
    if mx.issubdtype(dtype, mx.integer):
        info = np.iinfo(np.dtype(str(dtype).split(".")[-1]))
        return {"max": info.min, "min": info.max}.get(kind, info.min)
    return {"max": -np.inf, "min": np.inf}.get(kind, -np.inf)


def _float_of(x):
    return mx.float32 if x.dtype in HALF or mx.issubdtype(x.dtype, mx.integer) else x.dtype


def _reduce(kind: str, x, axes, keepdims: int, noop: int):
    ax = _norm_axes(axes, x.ndim, noop)
    if ax is None:
        return _elementwise(kind, x)
    if x.ndim == 0:
        ax = ()
    if not ax:
        return _elementwise(kind, x)
    if x.size == 0:
        shape = [1 if i in ax else s for i, s in enumerate(x.shape)]
        if not keepdims:
            shape = [s for i, s in enumerate(x.shape) if i not in ax]
        return mx.full(shape, _empty_value(kind, x.dtype), x.dtype)
    kd = bool(keepdims)
    if kind in ("max", "min"):
        return (mx.max if kind == "max" else mx.min)(x, axis=ax, keepdims=kd)
    is_int = mx.issubdtype(x.dtype, mx.integer)
    if kind in ("sum", "prod", "l1", "sumsquare") and is_int:
        y = mx.abs(x) if kind == "l1" else x * x if kind == "sumsquare" else x
        return (mx.prod if kind == "prod" else mx.sum)(y, axis=ax, keepdims=kd).astype(x.dtype)
    if kind == "mean" and is_int:
        n = int(np.prod([x.shape[a] for a in ax]))
        s = mx.sum(x, axis=ax, keepdims=kd).astype(x.dtype)
        return _trunc_div(s, mx.array(n, x.dtype))
    xf = x.astype(_float_of(x))
    if kind == "sum":
        y = mx.sum(xf, axis=ax, keepdims=kd)
    elif kind == "prod":
        y = mx.prod(xf, axis=ax, keepdims=kd)
    elif kind == "mean":
        y = mx.mean(xf, axis=ax, keepdims=kd)
    elif kind == "l1":
        y = mx.sum(mx.abs(xf), axis=ax, keepdims=kd)
    elif kind == "l2":
        y = mx.sqrt(mx.sum(xf * xf, axis=ax, keepdims=kd))
    elif kind == "sumsquare":
        y = mx.sum(xf * xf, axis=ax, keepdims=kd)
    elif kind == "logsum":
        y = mx.log(mx.sum(xf, axis=ax, keepdims=kd))
    elif kind == "logsumexp":
        y = mx.logsumexp(xf, axis=ax, keepdims=kd)
    else:
        raise ValueError(f"unknown reduction {kind!r}")
    return y.astype(x.dtype)


def _elementwise(kind: str, x):
    """A reduction over no axes (noop_with_empty_axes): ORT still applies the per-element part."""
    if kind in ("sum", "mean", "max", "min", "prod"):
        return x
    if kind == "l1":
        return x if mx.issubdtype(x.dtype, mx.unsignedinteger) else mx.abs(x)
    if kind == "sumsquare":
        return x * x
    xf = x.astype(_float_of(x))
    y = {"l2": lambda: mx.sqrt(xf * xf), "logsum": lambda: mx.log(xf),
         "logsumexp": lambda: mx.log(mx.exp(xf))}[kind]()
    return y.astype(x.dtype)


def _trunc_div(a, b):
    q = mx.floor_divide(a, b)
    r = a - q * b
    return mx.where(mx.logical_and(r != 0, mx.not_equal(a < 0, b < 0)), q + 1, q)


def _axes_check(view) -> str | None:
    if view.has(1) and view.dtype(1) not in (dt.INT64, None):
        return f"axes input is {dt.name(view.dtype(1))}, not int64"
    return None


def _make(op: str, kind: str, types, new_since: int):
    """Register ``op`` with axes as an attribute (opset 1) and as an input (``new_since``)."""
    def attr_form(data, *, axes=None, keepdims=1):
        return _reduce(kind, data, axes, keepdims, 0)

    def input_form(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
        return _reduce(kind, data, axes, keepdims, noop_with_empty_axes)

    for f, form in ((attr_form, "attribute"), (input_form, "input")):
        f.__name__ = f"{op.lower()}_{form}"
        f.__doc__ = f"{op} with axes as an {form}."
    register(op, 1, dtypes=types)(attr_form)
    register(op, new_since, dtypes=types, const=(1,), check=_axes_check)(input_form)


_make("ReduceSum", "sum", REDUCE, 13)
_make("ReduceMean", "mean", REDUCE, 18)
_make("ReduceMax", "max", MAXMIN, 18)
_make("ReduceMin", "min", MAXMIN, 18)
_make("ReduceProd", "prod", REDUCE, 18)
_make("ReduceL1", "l1", REDUCE, 18)
_make("ReduceL2", "l2", REDUCE, 18)
_make("ReduceLogSum", "logsum", REDUCE, 18)
_make("ReduceLogSumExp", "logsumexp", LSE - {dt.DOUBLE}, 18)   # float64 exp in MLX is float32-accurate
_make("ReduceSumSquare", "sumsquare", REDUCE, 18)


def reduce_sum_ints_host(data, axes=None, keepdims=1, noop_with_empty_axes=0):
    """ReduceSum of an integer array in NumPy (either form: axes as the attribute or the input):
    exact integer sums that wrap on overflow, as the MLX translator computes (ORT's CPU EP agrees
    while sums stay in range and, for int64, below 2**53: it sums through double and saturates).
    Not a registered host form (that would make every plan read such inputs on the host): compiled
    closures use it for values they compute per call outside the trace (``compiled.core``'s hoisted
    work: genai's attention-mask length)."""
    data = np.asarray(data)
    if data.dtype.kind not in "iu":
        raise ValueError(f"integer ReduceSum on the host got {data.dtype}")
    ax = _norm_axes(None if axes is None else np.asarray(axes), data.ndim, noop_with_empty_axes)
    if ax is None:
        return data.copy()
    return np.sum(data, axis=ax, keepdims=bool(keepdims), dtype=data.dtype)


# ---------------------------------------------------------------- ArgMax / ArgMin
ARG = F | frozenset({dt.INT8, dt.UINT8, dt.INT32, dt.INT64})


def _arg(x, axis: int, keepdims: int, last: int, largest: bool):
    if not -x.ndim <= axis < max(x.ndim, 1):
        raise ValueError(f"axis {axis} out of range for rank {x.ndim}")
    axis %= max(x.ndim, 1)
    n = x.shape[axis]
    if n == 0:
        raise ValueError(f"ArgMax/ArgMin over an empty axis {axis} (shape {x.shape})")
    is_float = mx.issubdtype(x.dtype, mx.floating)
    valid = mx.logical_not(mx.isnan(x)) if is_float else None
    if is_float:
        fill = mx.array(-np.inf if largest else np.inf, x.dtype)
        y = mx.where(valid, x, fill)
    else:
        y = x
    best = (mx.max if largest else mx.min)(y, axis=axis, keepdims=True)
    hit = y == best
    if is_float:
        hit = mx.logical_and(hit, valid)
    hit = hit.astype(mx.uint8)
    if last:
        idx = (n - 1) - mx.argmax(hit[_rev(x.ndim, axis)], axis=axis, keepdims=True).astype(mx.int64)
    else:
        idx = mx.argmax(hit, axis=axis, keepdims=True).astype(mx.int64)
    if is_float:
        first = mx.take(valid, mx.array([0]), axis=axis)
        idx = mx.where(first, idx, mx.zeros_like(idx))
    return idx if keepdims else mx.squeeze(idx, axis=axis)


def _rev(ndim: int, axis: int):
    return tuple(slice(None, None, -1) if i == axis else slice(None) for i in range(ndim))


def _arg_check(view) -> str | None:
    r = view.rank(0)
    s = view.shape(0)
    axis = view.attrs.get("axis", 0)
    if r is not None and s is not None and -r <= axis < r and s[axis] == 0:
        return f"ArgMax/ArgMin over empty axis {axis}"
    return None


@register("ArgMax", 1, dtypes=ARG, check=_arg_check)
def argmax(data, *, axis=0, keepdims=1, select_last_index=0):
    """Index of the largest value along ``axis`` (int64)."""
    return _arg(data, axis, keepdims, select_last_index, True)


@register("ArgMin", 1, dtypes=ARG, check=_arg_check)
def argmin(data, *, axis=0, keepdims=1, select_last_index=0):
    """Index of the smallest value along ``axis`` (int64)."""
    return _arg(data, axis, keepdims, select_last_index, False)


# ---------------------------------------------------------------- CumSum
CUMSUM = frozenset({dt.FLOAT, dt.FLOAT16, dt.DOUBLE, dt.BFLOAT16, dt.INT32, dt.INT64})


def _cumsum_check(view) -> str | None:
    if view.dtype(1) not in (dt.INT32, dt.INT64):
        return f"CumSum axis is {dt.name(view.dtype(1))}, not int32/int64"
    return None


@register("CumSum", 11, dtypes=CUMSUM, const=(1,), check=_cumsum_check)
def cumsum(x, axis, *, exclusive=0, reverse=0):
    """Running sum along ``axis`` (a host scalar), optionally exclusive and/or reversed."""
    a = np.asarray(axis).reshape(-1)
    if a.size != 1:
        raise ValueError(f"CumSum axis must be a scalar, got shape {np.asarray(axis).shape}")
    ax = int(a[0])
    if not -x.ndim <= ax < x.ndim:
        raise ValueError(f"CumSum axis {ax} out of range for rank {x.ndim}")
    if x.size == 0:
        return x
    y = x.astype(mx.float32) if x.dtype in HALF else x
    out = mx.cumsum(y, axis=ax % x.ndim, reverse=bool(reverse), inclusive=not exclusive)
    return out.astype(x.dtype)


# ---------------------------------------------------------------- CumProd
#: ORT's CPU kernels; float16 multiplies in float32 and rounds each output once (verified bit-exact)
CUMPROD = frozenset({dt.FLOAT, dt.FLOAT16, dt.DOUBLE, dt.INT32, dt.INT64, dt.UINT32, dt.UINT64})


def _cumprod_check(view) -> str | None:
    if view.dtype(1) not in (dt.INT32, dt.INT64):
        return f"CumProd axis is {dt.name(view.dtype(1))}, not int32/int64"
    return None


@register("CumProd", 26, dtypes=CUMPROD, const=(1,), check=_cumprod_check)
def cumprod(x, axis, *, exclusive=0, reverse=0):
    """Running product along ``axis`` (a host scalar), optionally exclusive and/or reversed.

    Integers wrap on overflow like ORT's C++ kernel; floats multiply in order along the axis.
    """
    a = np.asarray(axis).reshape(-1)
    if a.size != 1:
        raise ValueError(f"CumProd axis must be a scalar, got shape {np.asarray(axis).shape}")
    ax = int(a[0])
    if not -x.ndim <= ax < x.ndim:
        raise ValueError(f"CumProd axis {ax} out of range for rank {x.ndim}")
    if x.size == 0:
        return x
    y = x.astype(mx.float32) if x.dtype in HALF else x
    out = mx.cumprod(y, axis=ax % x.ndim, reverse=bool(reverse), inclusive=not exclusive)
    return out.astype(x.dtype)
