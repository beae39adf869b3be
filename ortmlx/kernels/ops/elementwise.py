"""Elementwise arithmetic and math (binary ops broadcast numpy-style, as ONNX does from opset 7).

Dtype sets are those ORT's CPU EP has kernels for (what the tests compare against), plus
bfloat16, tested against the CPU EP's float32 result rounded to bfloat16.
Integer Div truncates toward zero and integer Mod follows ORT's C++ kernels.
Half-precision transcendentals run in float32 and round back, as ORT's CPU EP does.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from .. import fastmath
from ..registry import register, same_input_types

F = frozenset({dt.FLOAT, dt.FLOAT16, dt.DOUBLE, dt.BFLOAT16})
INTS = dt.INTS
ARITH = F | INTS
HALF = (mx.float16, mx.bfloat16)


def _is_int(a) -> bool:
    return mx.issubdtype(a.dtype, mx.integer)


def _via_f32(fn):
    """Run ``fn`` in float32 for half-precision inputs and round back."""
    def run(x):
        if x.dtype in HALF:
            return fn(x.astype(mx.float32)).astype(x.dtype)
        return fn(x)
    return run




# ---------------------------------------------------------------- binary arithmetic
@register("Add", 7, dtypes=ARITH, check=same_input_types, host=np.add)
def add(A, B):
    """A + B (integers wrap)."""
    return mx.add(A, B)


@register("Sub", 7, dtypes=ARITH, check=same_input_types, host=np.subtract)
def sub(A, B):
    """A - B (integers wrap)."""
    return mx.subtract(A, B)


@register("Mul", 7, dtypes=ARITH, check=same_input_types, host=np.multiply)
def mul(A, B):
    """A * B (integers wrap)."""
    return mx.multiply(A, B)


def _trunc_div(a, b):
    """Integer division rounding toward zero (C++), on MLX; a divisor of -1 negates (INT_MIN wraps)."""
    if not mx.issubdtype(a.dtype, mx.signedinteger):
        return mx.floor_divide(a, b)
    minus1 = b == -1
    b1 = mx.where(minus1, mx.ones_like(b), b)           # INT_MIN // -1 traps (SIGFPE) in C
    q = mx.floor_divide(a, b1)
    r = mx.subtract(a, mx.multiply(q, b1))
    fix = mx.logical_and(r != 0, mx.not_equal(a < 0, b1 < 0))
    return mx.where(minus1, mx.negative(a), mx.where(fix, q + 1, q))


def _int_divisor_check(view) -> str | None:
    """Integer Div/Mod: ORT raises on a zero divisor, which MLX cannot see without a sync.

    The divisor is then read on the host (``_int_divisor_on_host``) and checked for zeros before
    it is copied to MLX; refused only when it would be computed on the device inside the group.
    """
    r = same_input_types(view)
    if r or view.dtype(0) not in dt.INTS:
        return r
    b = view.const(1)
    if b is None:
        if _host_math(view) or view.arrives_on_host(1):
            return None                     # a host array: checked for zeros before MLX sees it
        return ("integer divisor is computed on the device (ORT raises on a zero divisor at run time; "
                "checking it would need a sync)")
    if not np.all(b):
        return "integer divisor contains 0 (ORT raises 'Integer division by zero')"
    return None


def _int_divisor_on_host(in_types) -> tuple[int, ...]:
    """Integer Div/Mod read the divisor (input 1) on the host; floats keep it on the device."""
    return (1,) if in_types and in_types[0] in dt.INTS else ()


def _host_divisor(B, like) -> mx.array:
    """An integer divisor read on the host: raise on a zero like ORT's CPU EP, then copy it to MLX."""
    if isinstance(B, mx.array):
        return B
    B = np.asarray(B)
    _no_zero_divisor(B)
    return mx.array(np.ascontiguousarray(B) if B.ndim else B, dtype=like.dtype)


def _host_math(view) -> bool:
    """Every input is a constant or host shape math (Shape -> ...): the numpy twin runs.

    (A shape-math value above HOST_MAX_ELEMS elements would run on the device, where a
    zero divisor cannot be seen; shape vectors are rank-sized.)
    """
    return all(view.on_host(i) for i in range(view.n_inputs) if view.has(i))


def _no_zero_divisor(B):
    if B.dtype.kind in "iu" and not np.all(B):
        zeros = int(B.size - np.count_nonzero(B))
        raise ValueError(f"integer division by zero ({zeros} zero(s) in the divisor of shape {B.shape})")


def _div_host(A, B):
    A, B = np.asarray(A), np.asarray(B)
    if A.dtype.kind not in "iu":
        return np.divide(A, B)
    _no_zero_divisor(B)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):     # INT_MIN // -1 wraps
        q = np.floor_divide(A, B)
        if A.dtype.kind == "i":
            r = A - q * B
            q = np.where((r != 0) & ((A < 0) != (B < 0)), q + 1, q).astype(q.dtype)
    return q


@register("Div", 7, dtypes=ARITH, check=_int_divisor_check, host=_div_host, const_when=_int_divisor_on_host)
def div(A, B):
    """A / B; integers truncate toward zero like ORT's C++ kernel (a zero divisor raises)."""
    if _is_int(A):
        B = _host_divisor(B, A)
        return _trunc_div(A, B)
    return mx.divide(A, B)


def _mod_check(view) -> str | None:
    r = _int_divisor_check(view)
    if r:
        return r
    if view.attrs.get("fmod", 0) == 0 and view.dtype(0) in dt.FLOATS:
        return f"Mod with fmod=0 on {dt.name(view.dtype(0))} is invalid (ORT rejects it)"
    if view.attrs.get("fmod", 0) not in (0, 1):
        return f"fmod={view.attrs['fmod']!r} is not 0 or 1"
    if view.attrs.get("fmod", 0) == 1 and view.dtype(0) in (dt.INT64, dt.UINT64) and view.device != "cpu":
        return f"{dt.name(view.dtype(0))} fmod=1 goes through float64 in ORT (float64 is CPU-only in MLX)"
    return None


WIDE = (mx.int64, mx.uint64)


def _c_fmod_f64(A, B):
    """ORT's 64-bit integer fmod: std::fmod on doubles, then a cast (CPU device: float64)."""
    a, b = A.astype(mx.float64), B.astype(mx.float64)
    r = mx.remainder(a, b)                                # sign of b; C fmod has the sign of a
    r = mx.where(mx.logical_and(r != 0, mx.not_equal(r < 0, a < 0)), r - b, r)
    return r.astype(A.dtype)


def _mod_host(A, B, *, fmod=0):
    A, B = np.asarray(A), np.asarray(B)
    _no_zero_divisor(B)
    with np.errstate(divide="ignore", invalid="ignore"):
        if fmod and A.dtype in (np.int64, np.uint64):     # like the device: std::fmod on doubles
            return np.fmod(A.astype(np.float64), B.astype(np.float64)).astype(A.dtype)
        if fmod:
            return np.fmod(A, B)
        return np.mod(A, B)


@register("Mod", 10, dtypes=ARITH, check=_mod_check, host=_mod_host, const_when=_int_divisor_on_host)
def mod(A, B, *, fmod=0):
    """Remainder: fmod=0 takes the divisor's sign (integers), fmod=1 the dividend's (C fmod)."""
    if _is_int(A):
        B = _host_divisor(B, A)
    if fmod == 1 and A.dtype in WIDE:
        return _c_fmod_f64(A, B)
    if _is_int(A) and mx.issubdtype(A.dtype, mx.signedinteger):
        minus1 = B == -1                                   # INT_MIN % -1 traps (SIGFPE) in C
        B1 = mx.where(minus1, mx.ones_like(B), B)
        r = mx.remainder(A, B1) if fmod == 0 else mx.subtract(A, mx.multiply(_trunc_div(A, B1), B1))
        return mx.where(minus1, mx.zeros_like(r), r)
    if fmod == 0 or _is_int(A):
        return mx.remainder(A, B)                          # unsigned: both conventions agree
    if A.dtype in HALF:
        return mod(A.astype(mx.float32), B.astype(mx.float32), fmod=1).astype(A.dtype)
    r = mx.remainder(A, B)                    # sign of B; move it to the sign of A
    fix = mx.logical_and(r != 0, mx.not_equal(r < 0, A < 0))
    return mx.where(fix, r - B, r)


POW_BASE = frozenset({dt.FLOAT, dt.FLOAT16, dt.DOUBLE, dt.BFLOAT16, dt.INT32, dt.INT64})
POW_EXP = frozenset({dt.FLOAT, dt.DOUBLE, dt.INT32, dt.INT64})


def _pow_check(view) -> str | None:
    tb, te = view.dtype(0), view.dtype(1)
    if te not in POW_EXP and te != tb:
        return f"Pow exponent {dt.name(te)} with base {dt.name(tb)} not supported by ORT's CPU EP"
    if tb in dt.INTS and te == dt.BFLOAT16:
        return f"Pow of {dt.name(tb)} by bfloat16 has no ORT CPU kernel to verify against"
    if (tb == dt.INT64 or (tb in dt.INTS and te in dt.FLOATS)) and view.device != "cpu":
        return f"Pow {dt.name(tb)} ** {dt.name(te)} goes through float64 in ORT (float64 is CPU-only in MLX)"
    return None


def _int_pow(x, y):
    """Integer power like ORT (std::pow in double, then a cast).

    Negative exponents give 0 unless |x| == 1; 0 ** negative (inf) and results out of
    range become the type's minimum, as the x86 conversion does.
    """
    y = y.astype(x.dtype)
    neg = y < 0
    p = mx.power(x, mx.where(neg, mx.zeros_like(y), y))
    one = mx.ones_like(x)
    odd = mx.remainder(y, 2) != 0
    small = mx.where(x == 1, one, mx.where(x == -1, mx.where(odd, -one, one), mx.zeros_like(x)))
    lo = mx.array(np.iinfo(np.dtype(str(x.dtype).split(".")[-1])).min, x.dtype)
    approx = mx.power(x.astype(mx.float32), y.astype(mx.float32))
    bound = float(2 ** (8 * x.dtype.size - 1))
    bad = mx.logical_or(mx.logical_and(x == 0, neg), mx.logical_or(approx >= bound, approx < -bound))
    return mx.where(bad, lo, mx.where(neg, small, p))


@register("Pow", 7, dtypes=POW_BASE, check=_pow_check)
def pow_(X, Y):
    """X ** Y; the exponent may have another numeric type (opset 12+)."""
    if X.dtype == mx.int64 or (_is_int(X) and mx.issubdtype(Y.dtype, mx.floating)):
        # std::pow on doubles, then a cast
        return mx.power(X.astype(mx.float64), Y.astype(mx.float64)).astype(X.dtype)
    if _is_int(X):
        return _int_pow(X, Y)
    if X.dtype in HALF:
        return mx.power(X.astype(mx.float32), Y.astype(mx.float32)).astype(X.dtype)
    return mx.power(X, Y.astype(X.dtype))


# ---------------------------------------------------------------- unary
SIGNED_F = F | dt.SIGNED


@register("Neg", 6, dtypes=SIGNED_F, host=np.negative)
def neg(X):
    """-X (integers wrap)."""
    return mx.negative(X)


@register("Abs", 6, dtypes=ARITH, host=np.abs)
def abs_(X):
    """|X| (INT_MIN stays INT_MIN)."""
    return X if mx.issubdtype(X.dtype, mx.unsignedinteger) else mx.abs(X)


def _sign_host(X):
    return np.sign(X)


@register("Sign", 9, dtypes=ARITH, host=_sign_host)
def sign(X):
    """-1, 0 or 1 with X's type; NaN stays NaN (float16: 0, like ORT)."""
    if _is_int(X):
        return mx.sign(X)
    s = mx.sign(X)
    if X.dtype == mx.float16:                 # ORT's float16 kernel maps NaN to 0
        return s
    return mx.where(mx.isnan(X), X, s)


def _unary(op, since, fn, dtypes=F, doc=""):
    def translator(X):
        return fn(X)
    translator.__name__ = op.lower()
    translator.__doc__ = doc or f"{op}(X) elementwise."
    register(op, since, dtypes=dtypes)(translator)
    return translator


#: MLX computes float64 exp/sin/cos at float32 accuracy (rel. error ~4e-7 measured on 0.32.4): no float64
F_NO_F64 = F - {dt.DOUBLE}


def _zero_kept(fn):
    """An odd ``fn`` with fn(+-0) = +-0 as IEEE and ORT give it: MLX 0.32.4's CPU backend gives sin(-0) = +0 and
    erf(+0) = -0 (a zero's sign shows through 1/x)."""
    def run(x):
        return mx.where(x == 0, x, fn(x))
    return run


for _op, _since, _fn, _types in [
    ("Reciprocal", 6, _via_f32(mx.reciprocal), F),
    ("Sqrt", 6, _via_f32(mx.sqrt), F),
    ("Exp", 6, _via_f32(fastmath.exp), F_NO_F64),
    ("Log", 6, _via_f32(mx.log), F),
    ("Floor", 6, mx.floor, F),
    ("Ceil", 6, mx.ceil, F),
    ("Round", 11, mx.round, F),          # MLX rounds half to even, like ORT
    ("Erf", 9, _via_f32(_zero_kept(mx.erf)), frozenset({dt.FLOAT, dt.FLOAT16, dt.BFLOAT16})),
    ("Sin", 7, _via_f32(_zero_kept(mx.sin)), F_NO_F64),
    ("Cos", 7, _via_f32(mx.cos), F_NO_F64),
    ("Tan", 7, _via_f32(mx.tan), frozenset({dt.FLOAT, dt.FLOAT16})),
    ("Asin", 7, _via_f32(mx.arcsin), frozenset({dt.FLOAT, dt.FLOAT16})),
    ("Acos", 7, _via_f32(mx.arccos), frozenset({dt.FLOAT, dt.FLOAT16})),
    ("Atan", 7, _via_f32(mx.arctan), frozenset({dt.FLOAT, dt.FLOAT16})),
    ("Sinh", 9, _via_f32(mx.sinh), frozenset({dt.FLOAT, dt.FLOAT16})),
    ("Cosh", 9, _via_f32(mx.cosh), frozenset({dt.FLOAT, dt.FLOAT16})),
    ("Tanh", 6, _via_f32(mx.tanh), F),
    ("Asinh", 9, _via_f32(mx.arcsinh), frozenset({dt.FLOAT, dt.FLOAT16})),
    ("Acosh", 9, _via_f32(mx.arccosh), frozenset({dt.FLOAT, dt.FLOAT16})),
    ("Atanh", 9, _via_f32(mx.arctanh), frozenset({dt.FLOAT, dt.FLOAT16})),
]:
    _unary(_op, _since, _fn, _types)


# ---------------------------------------------------------------- variadic
def _fold(fn, inputs):
    if not inputs:
        raise ValueError("variadic op needs at least one input")
    out = inputs[0]
    for x in inputs[1:]:
        out = fn(out, x)
    return out


def _max_host(*xs):
    return _fold(np.maximum, xs)


def _min_host(*xs):
    return _fold(np.minimum, xs)


MAXMIN = frozenset({dt.FLOAT, dt.FLOAT16, dt.DOUBLE, dt.BFLOAT16, dt.INT8, dt.UINT8, dt.INT32, dt.UINT32,
                    dt.INT64, dt.UINT64})


@register("Max", 8, dtypes=MAXMIN, check=same_input_types, host=_max_host)
def max_(*data_0):
    """Elementwise max of all inputs; NaN propagates."""
    return _fold(mx.maximum, data_0)


@register("Min", 8, dtypes=MAXMIN, check=same_input_types, host=_min_host)
def min_(*data_0):
    """Elementwise min of all inputs; NaN propagates."""
    return _fold(mx.minimum, data_0)


@register("Sum", 8, dtypes=F, check=same_input_types)
def sum_(*data_0):
    """Elementwise sum of all inputs (half precision accumulates in float32)."""
    if data_0[0].dtype in HALF:
        return _fold(mx.add, [x.astype(mx.float32) for x in data_0]).astype(data_0[0].dtype)
    return _fold(mx.add, data_0)


@register("Mean", 8, dtypes=frozenset({dt.FLOAT, dt.FLOAT16, dt.BFLOAT16}), check=same_input_types)
def mean(*data_0):
    """Elementwise mean of all inputs."""
    if data_0[0].dtype in HALF:
        return mean(*[x.astype(mx.float32) for x in data_0]).astype(data_0[0].dtype)
    return mx.divide(_fold(mx.add, data_0), mx.array(len(data_0), data_0[0].dtype))


# ---------------------------------------------------------------- Clip
CLIP = F | frozenset({dt.INT8, dt.UINT8, dt.INT32, dt.UINT32, dt.INT64, dt.UINT64})


def _clip(x, lo, hi):
    """max(x, lo) then min(., hi): min > max gives max; NaN in x propagates."""
    if lo is not None:
        x = mx.where(x < lo, lo, x)
    if hi is not None:
        x = mx.where(x > hi, hi, x)
    return x


@register("Clip", 6, dtypes=frozenset({dt.FLOAT}))
def clip_6(input, *, min=-3.4028234663852886e38, max=3.4028234663852886e38):
    """Clip with min/max attributes (opset 6)."""
    return _clip(input, mx.array(min, input.dtype), mx.array(max, input.dtype))


def _clip11_check(view) -> str | None:
    for i in (1, 2):
        if view.has(i):
            if view.dtype(i) is not None and view.dtype(i) != view.dtype(0):
                return f"Clip bound {i} is {dt.name(view.dtype(i))}, input is {dt.name(view.dtype(0))}"
            s = view.shape(i)
            if s is not None and len(s) != 0 and not (len(s) == 1 and s[0] == 1):
                return f"Clip bound {i} has shape {s}, not a scalar"
    return None


@register("Clip", 11, dtypes=CLIP, check=_clip11_check)
def clip(input, min=None, max=None):
    """Clip with optional scalar min/max inputs (opset 11+).

    An omitted float bound is the type's finite limit, as in ORT (so +-inf clip to +-max).
    """
    lo = None if min is None else min.reshape(())
    hi = None if max is None else max.reshape(())
    if mx.issubdtype(input.dtype, mx.floating):
        fi = mx.finfo(input.dtype)
        lo = mx.array(fi.min, input.dtype) if lo is None else lo
        hi = mx.array(fi.max, input.dtype) if hi is None else hi
    return _clip(input, lo, hi)
