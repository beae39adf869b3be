"""Seeded RandomUniform / RandomNormal (and the *Like forms), reproducing ORT's CPU kernels bit for bit.

ORT's CPU kernels draw from ``std::default_random_engine`` seeded with ``uint32_t(seed)``: with
libstdc++ (ORT's Linux wheels) that is ``minstd_rand0`` (x <- 16807 x mod 2^31-1; a zero seed
becomes 1). Each node owns one engine for the life of its session: consecutive runs continue the
stream. Per run a fresh distribution object maps draws to values:

- ``generate_canonical``: float32 takes one draw, ``float(x - 1) / float(2^31 - 1)`` (the divisor
  rounds to 2^31); float64 takes two, ``((x1 - 1) + (x2 - 1) r) / double(r*r)`` with r = 2^31 - 2;
  a result of 1 becomes ``nextafter(1, 0)``.
- uniform: ``u * (high - low) + low`` in the output type.
- normal: Marsaglia's polar method (pairs (2u-1, 2v-1) until 0 < r2 <= 1; y*m first, then the
  saved x*m; a saved value is dropped at the end of a run), ``m = sqrt(-2 log(r2) / r2)`` with
  the C library's ``logf`` / ``log`` (called here from the same libm ORT calls), then
  ``v * scale + mean``.

Verified against onnxruntime 1.31 on Linux x86_64 (glibc, libstdc++) only: other platforms and
versions are refused (macOS ORT uses libc++, whose engine and distributions differ). Unseeded nodes
are refused: ORT seeds them from the clock, nothing to verify against.
"""
from __future__ import annotations

import functools
import platform
import sys
import threading

import mlx.core as mx
import numpy as np

from .. import dtypes as dt
from ...version import loaded_ort_version
from ..registry import register

M = 2147483647                  # minstd_rand0: modulus 2^31 - 1
A = 16807                       # multiplier (increment 0)
_BLOCK = 1 << 15                # draws per vectorised step
_R = M - 1                      # engine range max - min + 1 = 2^31 - 2
VERIFIED_ORT = (1, 31)
GEN_TYPES = {dt.FLOAT: np.float32, dt.DOUBLE: np.float64}


def _powers() -> np.ndarray:
    """A^k mod M for k = 1.._BLOCK (uint64: every product stays below 2^62)."""
    p = np.array([A], np.uint64)
    while len(p) < _BLOCK:
        p = np.concatenate([p, p * p[-1] % np.uint64(M)])
    return p[:_BLOCK]


_POW: list = []


class Engine:
    """libstdc++'s minstd_rand0 (std::default_random_engine), drawn in vectorised blocks."""

    def __init__(self, seed: int):
        s = int(seed) % M
        self.x = s if s else 1
        self.lock = threading.Lock()

    def peek(self, n: int) -> np.ndarray:
        """The next ``n`` outputs (uint64), without advancing."""
        if not _POW:
            _POW.append(_powers())
        p = _POW[0]
        out = np.empty(n, np.uint64)
        x = np.uint64(self.x)
        for s in range(0, n, _BLOCK):
            k = min(_BLOCK, n - s)
            out[s:s + k] = x * p[:k] % np.uint64(M)
            x = out[s + k - 1]
        return out

    def draw(self, n: int) -> np.ndarray:
        out = self.peek(n)
        if n:
            self.x = int(out[-1])
        return out


def _canonical(draws: np.ndarray, t) -> np.ndarray:
    """generate_canonical<t> over the draws (float32: one per value, float64: two)."""
    if t == np.float32:
        v = (draws - np.uint64(1)).astype(np.float32) / np.float32(float(_R))
        one_below = np.nextafter(np.float32(1), np.float32(0))
    else:
        d = (draws - np.uint64(1)).astype(np.float64).reshape(-1, 2)
        v = (d[:, 0] + d[:, 1] * np.float64(_R)) / np.float64(float(_R * _R))
        one_below = np.nextafter(1.0, 0.0)
    return np.where(v >= 1, one_below, v).astype(t)


def _per_value(t) -> int:
    return 1 if t == np.float32 else 2


def uniform(eng: Engine, n: int, t, low: float = 0.0, high: float = 1.0) -> np.ndarray:
    """``n`` values of std::uniform_real_distribution<t>(low, high)."""
    u = _canonical(eng.draw(n * _per_value(t)), t)
    lo, hi = t(np.float32(low)), t(np.float32(high))
    with np.errstate(over="ignore"):                    # IEEE overflow to inf, as in ORT
        return (u * (hi - lo) + lo).astype(t)


_LIBM: list = []


def _log(values: np.ndarray, t) -> np.ndarray:
    """The C library's logf/log of each value: the exact results ORT's kernel gets."""
    if not _LIBM:
        import cffi
        ffi = cffi.FFI()
        ffi.cdef("float logf(float); double log(double);")
        _LIBM.append(ffi.dlopen("libm.so.6"))
    f = _LIBM[0].logf if t == np.float32 else _LIBM[0].log
    return np.fromiter((f(v) for v in values.tolist()), t, len(values))


def _polar_pairs(eng: Engine, pairs: int, t):
    """(x, y, r2) of the first ``pairs`` accepted polar-method candidates; the engine advances past
    exactly the draws they (and the rejected candidates before them) consumed."""
    per = 2 * _per_value(t)
    xs, ys, rs = [], [], []
    need = pairs
    while need:
        k = need + need // 4 + 16                        # acceptance is pi/4
        d = eng.peek(k * per)
        u = _canonical(d, t).reshape(k, 2)
        two = t(2.0)
        x = ((two * u[:, 0]).astype(np.float64) - 1.0).astype(t)
        y = ((two * u[:, 1]).astype(np.float64) - 1.0).astype(t)
        r2 = (x * x + y * y).astype(t)
        ok = np.nonzero(~((r2 > 1.0) | (r2 == 0.0)))[0][:need]
        used = int(ok[-1]) + 1 if len(ok) == need else k
        eng.x = int(d[used * per - 1])
        xs.append(x[ok])
        ys.append(y[ok])
        rs.append(r2[ok])
        need -= len(ok)
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(rs)


def normal(eng: Engine, n: int, t, mean: float = 0.0, scale: float = 1.0) -> np.ndarray:
    """``n`` values of one std::normal_distribution<t>(mean, scale) object (libstdc++'s polar method)."""
    if n == 0:
        return np.zeros(0, t)
    x, y, r2 = _polar_pairs(eng, (n + 1) // 2, t)
    mult = np.sqrt((t(-2) * _log(r2, t)).astype(t) / r2).astype(t)
    v = np.stack([y * mult, x * mult], axis=1).reshape(-1)[:n].astype(t)
    with np.errstate(over="ignore"):                    # IEEE overflow to inf, as in ORT
        return (v * t(np.float32(scale)) + t(np.float32(mean))).astype(t)


# ---------------------------------------------------------------- claim
@functools.lru_cache(maxsize=1)
def _libc() -> str:
    """The C library's name ('glibc' ...); platform.libc_ver() reads the interpreter binary: asked once."""
    return platform.libc_ver()[0]


def platform_reason() -> str | None:
    """Why ORT's generators here may not be the libstdc++/glibc streams verified (None: they are)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (f"seeded random streams verified on Linux x86_64 only (here {sys.platform} "
                f"{platform.machine()}; e.g. macOS ORT uses libc++'s engine and distributions)")
    libc = _libc()
    if libc != "glibc":
        return f"seeded random streams verified with glibc's libm only (here {libc or 'unknown'})"
    v = loaded_ort_version()
    parts = tuple(int(p) for p in (v or "").split(".")[:2] if p.isdigit())
    if parts != VERIFIED_ORT:
        return (f"seeded random streams verified with onnxruntime {VERIFIED_ORT[0]}.{VERIFIED_ORT[1]} only "
                f"(loaded: {v})")
    return None


def _seed_reason(view) -> str | None:
    if "seed" not in view.node.attrs:
        return "no seed: ORT seeds the engine from the clock, an unseeded stream cannot be verified"
    s = float(view.attrs["seed"])
    if not 0.0 <= s < 2.0 ** 32:
        return f"seed {s!r} outside [0, 2**32): ORT's float -> uint32_t conversion of it is undefined"
    return None


def _gen_check(view, like: bool) -> str | None:
    """Refuses unseeded nodes, opset 22+, dtypes other than float32/float64, negative shapes and
    platforms other than the verified one."""
    if view.since_version >= 22:
        return f"since_version {view.since_version}: ORT's CPU EP has no kernel to verify against"
    reason = _seed_reason(view)
    if reason:
        return reason
    if like and "dtype" not in view.node.attrs:
        t = view.dtype(0)
        if t not in GEN_TYPES:
            return f"no dtype attribute and input dtype {dt.name(t)} (ORT infers float32/float64 only)"
    else:
        t = int(view.attrs.get("dtype", dt.FLOAT))
        if t not in GEN_TYPES:
            return f"dtype {dt.name(t)} (ORT's CPU kernels generate float32/float64 only)"
    if not like:
        shape = [int(s) for s in view.attrs.get("shape", [])]
        if any(s < 0 for s in shape):
            return f"shape {shape} has a negative dimension"
    return _params_reason(view) or platform_reason()


def _params_reason(view) -> str | None:
    """libstdc++ (built with assertions in ORT's wheel) aborts the process unless low <= high and
    scale > 0; non-finite parameters are not verified either."""
    a = view.attrs
    if "mean" in a or "scale" in a:
        mean, scale = float(a.get("mean", 0.0)), float(a.get("scale", 1.0))
        if not (np.isfinite(mean) and np.isfinite(scale)) or scale <= 0:
            return f"mean {mean!r}, scale {scale!r}: scale must be finite and > 0 (ORT's libstdc++ aborts otherwise)"
        return None
    low, high = float(a.get("low", 0.0)), float(a.get("high", 1.0))
    if not (np.isfinite(low) and np.isfinite(high)) or low > high:
        return f"low {low!r}, high {high!r}: must be finite with low <= high (ORT's libstdc++ aborts otherwise)"
    return None


def _check(view) -> str | None:
    """Claims only seeded float32/float64 nodes below opset 22 with low <= high / scale > 0, on Linux x86_64
    (glibc) under onnxruntime 1.31: the streams verified bit for bit against ORT's CPU kernels."""
    return _gen_check(view, like=False)


def _like_check(view) -> str | None:
    """As RandomUniform/RandomNormal; without a dtype attribute the input must be float32/float64."""
    return _gen_check(view, like=True)


def _engine(ctx, seed: float) -> Engine:
    """The node's engine for this session (ORT: one per kernel instance), made on first use."""
    eng = ctx.extra.get("engine")
    if eng is None:
        eng = ctx.extra.setdefault("engine", Engine(int(seed)))
    return eng


def _generate(kind: str, shape, t_onnx: int, ctx, seed: float, a: float, b: float) -> mx.array:
    t = GEN_TYPES.get(t_onnx)
    if t is None:
        raise ValueError(f"dtype {dt.name(t_onnx)} is not float32/float64")
    shape = [int(s) for s in shape]
    n = int(np.prod(shape)) if shape else 1
    eng = _engine(ctx, seed)
    with eng.lock:                                      # ORT serialises the kernel's draws too
        v = uniform(eng, n, t, a, b) if kind == "uniform" else normal(eng, n, t, a, b)
    return dt.to_mx(v.reshape(shape), t_onnx)


def _like_type(dtype, ctx) -> int:
    return int(dtype) if dtype is not None else ctx.in_dtypes[0]


@register("RandomUniform", 1, host_computed=True, check=_check)
def random_uniform(*, shape, dtype=dt.FLOAT, high=1.0, low=0.0, seed=None, ctx):
    """Uniform values in [low, high) from the node's seeded engine (its stream continues across runs)."""
    return _generate("uniform", shape, int(dtype), ctx, seed, low, high)


@register("RandomNormal", 1, host_computed=True, check=_check)
def random_normal(*, shape, dtype=dt.FLOAT, mean=0.0, scale=1.0, seed=None, ctx):
    """Normal values (mean, scale) from the node's seeded engine (its stream continues across runs)."""
    return _generate("normal", shape, int(dtype), ctx, seed, mean, scale)


@register("RandomUniformLike", 1, host_computed=True, check=_like_check)
def random_uniform_like(input, *, dtype=None, high=1.0, low=0.0, seed=None, ctx):
    """RandomUniform with the input's shape (and its type, without a dtype attribute)."""
    return _generate("uniform", input.shape, _like_type(dtype, ctx), ctx, seed, low, high)


@register("RandomNormalLike", 1, host_computed=True, check=_like_check)
def random_normal_like(input, *, dtype=None, mean=0.0, scale=1.0, seed=None, ctx):
    """RandomNormal with the input's shape (and its type, without a dtype attribute)."""
    return _generate("normal", input.shape, _like_type(dtype, ctx), ctx, seed, mean, scale)
