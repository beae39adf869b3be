"""Random small ONNX graphs from the registered ops, checked MLX EP == CPU EP.

``cases()`` is a hypothesis strategy drawing a :class:`Case` (a model and its
feeds); ``check_case`` runs it on both EPs and raises ``FuzzFailure`` on a
wrong answer or an MLX-only error. Only op types that have a translator
registered *now* are generated (the registry grows), at the versions the model's
opset resolves to.

Values are tracked with their dtype, shape and two flags that keep the
comparison honest: ``exact`` (the value is bit-identical on any correct
implementation: graph inputs, constants, and exact ops on exact values) and
``finite``. Discontinuous ops (Floor, comparisons, Cast to int, ArgMax ...) only
read exact values, so a 1-ulp difference upstream cannot flip them; integer
Div/Mod get a fresh non-zero divisor; float inputs are multiples of 1/8 in
[-4, 4] with optional NaN/Inf/-0.0.

Used by tests/test_fuzz.py (fixed budget, CI) and scripts/fuzz.py (long runs).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx.defs
import onnx.numpy_helper
from onnx import TensorProto as T
from onnx import helper

OPSET = 21
F32, F64, I32, I64, BOOL = T.FLOAT, T.DOUBLE, T.INT32, T.INT64, T.BOOL
F16 = T.FLOAT16
FLOATS = (F32, F64)
INTS = (I32, I64)
NUM = FLOATS + INTS
NP = {F32: np.float32, F64: np.float64, I32: np.int32, I64: np.int64, BOOL: np.bool_}


class FuzzFailure(AssertionError):
    """MLX EP and CPU EP disagree (or only MLX fails) on a generated case."""


@dataclass
class V:
    name: str
    dtype: int
    shape: tuple
    exact: bool = True
    finite: bool = True


@dataclass
class Case:
    model: onnx.ModelProto
    feeds: dict
    ops: list[str]
    desc: str = ""
    #: the reference answers for some feeds (None: the CPU EP's session of ``model``; ``half_case``)
    reference: Callable[[dict], list] | None = None

    def __repr__(self) -> str:      # what hypothesis prints for a falsifying example
        return f"Case(ops={self.ops})\n{self.desc}"


def _since(op: str) -> int | None:
    try:
        return onnx.defs.get_schema(op, OPSET).since_version
    except Exception:  # noqa: BLE001
        return None


def registered_ops() -> set[str]:
    """Op types (default domain) with a translator for the fuzz opset's version."""
    from .kernels import ops as _ops  # noqa: F401 - importing registers every translator
    from .kernels.registry import REGISTRY
    import importlib
    import pkgutil
    for m in pkgutil.iter_modules(_ops.__path__):
        importlib.import_module(f"{_ops.__name__}.{m.name}")
    out = set()
    for op in REGISTRY.op_types(""):
        s = _since(op)
        if s is not None and REGISTRY.resolve("", op, s) is not None:
            out.add(op)
    return out


# ---------------------------------------------------------------------------- the builder
class Builder:
    def __init__(self, draw, st, avoid: frozenset = frozenset()):
        self.draw, self.st = draw, st
        self.avoid = avoid                 # known-bug quirks ("Op:quirk") not to generate, see KNOWN_BUGS
        self.values: list[V] = []
        self.nodes = []
        self.inits: dict[str, np.ndarray] = {}
        self.inputs = []               # ValueInfoProtos
        self.feeds: dict[str, np.ndarray] = {}
        self.ops: list[str] = []
        self.n = itertools.count()
        self.rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        self.specials = draw(st.booleans())

    def name(self, p: str = "v") -> str:
        return f"{p}{next(self.n)}"

    def axis(self, rank: int) -> int:
        """An axis of a rank-``rank`` value, negative or not."""
        return self.draw(self.st.integers(-rank, rank - 1))

    def choice(self, seq):
        seq = list(seq)
        return seq[self.draw(self.st.integers(0, len(seq) - 1))]

    def flag(self, p: float = 0.5) -> bool:
        return self.draw(self.st.floats(0, 1)) < p

    @contextlib.contextmanager
    def specials_while(self, allowed: bool):
        """Fresh values meanwhile hold NaN and inf only where ``allowed`` (and this case draws them at all)."""
        saved = self.specials
        self.specials = saved and allowed
        try:
            yield
        finally:
            self.specials = saved

    # ------------------------------------------------------------------ raw values
    def data(self, dtype: int, shape: tuple, nonzero: bool = False) -> tuple[np.ndarray, bool]:
        r = self.rng
        finite = True
        if dtype in FLOATS:
            a = np.asarray(r.integers(-32, 33, shape) / 8.0).astype(NP[dtype])      # 0-d stays an array
            if nonzero:
                a[a == 0] = 0.5
            elif self.specials and a.size and r.random() < 0.5:
                k = max(1, a.size // 4)
                idx = r.integers(0, a.size, k)
                a.reshape(-1)[idx] = r.choice(np.array([np.nan, np.inf, -np.inf, -0.0], NP[dtype]), k)
                finite = bool(np.isfinite(a).all())
        elif dtype in INTS:
            a = np.asarray(r.integers(-9, 10, shape)).astype(NP[dtype])
            if nonzero:
                a[a == 0] = 3
        else:
            a = np.asarray(r.random(shape) < 0.5)
        return np.array(a, order="C"), finite          # (ascontiguousarray would make 0-d arrays 1-d)

    def raw(self, dtype: int, shape: tuple, const: bool | None = None, nonzero: bool = False) -> V:
        a, finite = self.data(dtype, shape, nonzero)
        const = self.flag(0.35) if const is None else const
        n = self.name("c" if const else "x")
        if const:
            self.inits[n] = a
        else:
            self.feeds[n] = a
            mode = self.draw(self.st.integers(0, 5))
            if mode == 0:
                decl = None                                          # unknown rank
            elif mode == 1:
                decl = [f"{n}_d{i}" for i in range(len(shape))]      # symbolic dims
            else:
                decl = list(shape)
            self.inputs.append(helper.make_tensor_value_info(n, dtype, decl))
        v = V(n, dtype, tuple(shape), True, finite)
        self.values.append(v)
        return v

    def shape(self, max_rank: int = 4, min_rank: int = 0) -> tuple:
        rank = self.draw(self.st.integers(min_rank, max_rank))
        dims = []
        for _ in range(rank):
            dims.append(0 if self.flag(0.04) else self.draw(self.st.integers(1, 4)))
        return tuple(dims)

    def bcast_partner(self, shape: tuple) -> tuple:
        out = [d if self.flag(0.7) else 1 for d in shape]
        drop = self.draw(self.st.integers(0, len(out)))
        out = out[drop:] if self.flag(0.3) else out
        if self.flag(0.15):
            out = [self.draw(self.st.integers(1, 3))] + out
        return tuple(out)

    def pick(self, pred, make_dtype=None, make_shape=None) -> V | None:
        """An existing value satisfying ``pred`` (mostly) or a fresh raw one; None if none fits."""
        cands = [v for v in self.values if pred(v)]
        if cands and self.flag(0.75):
            return self.choice(cands)
        dt = make_dtype if make_dtype is not None else self.choice(NUM)
        for _ in range(8):
            shp = make_shape if make_shape is not None else self.shape()
            if pred(V("", dt, shp)):
                return self.raw(dt, shp)
        return self.choice(cands) if cands else None

    def partner(self, v: V, dtype: int | None = None, nonzero: bool = False) -> V:
        dtype = v.dtype if dtype is None else dtype
        if not nonzero:
            cands = [w for w in self.values if w.dtype == dtype and _bshape(v.shape, w.shape) is not None]
            if cands and self.flag(0.5):
                return self.choice(cands)
        return self.raw(dtype, self.bcast_partner(v.shape), nonzero=nonzero)

    def emit(self, op: str, ins: list[str], outs: list[V], **attrs) -> None:
        self.nodes.append(helper.make_node(op, ins, [o.name for o in outs], name=self.name(op.lower() + "_"),
                                           **attrs))
        self.values.extend(outs)
        self.ops.append(op)

    def const_i64(self, vals) -> str:
        n = self.name("k")
        self.inits[n] = np.asarray(vals, np.int64)
        return n

    def out(self, dtype, shape, exact, finite=True) -> V:
        return V(self.name("t"), dtype, tuple(shape), exact, finite)


def _bshape(a: tuple, b: tuple) -> tuple | None:
    try:
        return tuple(np.broadcast_shapes(a, b))
    except ValueError:
        return None


# ---------------------------------------------------------------------------- op builders
UNARY_EXACT = {"Neg": NUM, "Abs": NUM, "Relu": FLOATS, "Identity": NUM + (BOOL,)}
UNARY_STEP = {"Floor": FLOATS, "Ceil": FLOATS, "Round": FLOATS, "Sign": NUM}
#: periodic ops: a 1-ulp difference in a computed input of magnitude M moves them by ~M ulp (sin of a ReduceProd
#: of 1e5), so they read exact values only, as the step ops do
PERIODIC = {"Sin", "Cos", "Tan"}
#: ops defined on an interval: a 1-ulp difference in a computed input at its edge (a Resize's 1.0000001) is NaN on
#: one side, so they read exact values only too
EDGED = {"Acos", "Asin", "Acosh", "Atanh"}
UNARY_F = {"Exp": FLOATS, "Log": FLOATS, "Sqrt": FLOATS, "Tanh": FLOATS, "Sigmoid": FLOATS, "Erf": (F32,),
           "Sin": FLOATS, "Cos": FLOATS, "Reciprocal": FLOATS, "Softplus": (F32,), "Softsign": (F32,),
           "Atan": (F32,), "Elu": (F32,), "Selu": (F32,), "HardSigmoid": (F32,), "HardSwish": (F32,),
           "LeakyRelu": (F32,), "Celu": (F32,), "Mish": (F32,), "Gelu": (F32,), "Acos": (F32,), "Asin": (F32,),
           "Acosh": (F32,), "Asinh": (F32,), "Atanh": (F32,), "Cosh": (F32,), "Sinh": (F32,), "Tan": (F32,),
           "Shrink": (F32,), "ThresholdedRelu": (F32,)}
BITWISE = {"BitwiseAnd", "BitwiseOr", "BitwiseXor"}
BINARY = {"Add": NUM, "Sub": NUM, "Mul": NUM, "Div": NUM, "Pow": FLOATS, "Mod": NUM}
VARIADIC = {"Max": NUM, "Min": NUM, "Sum": FLOATS, "Mean": FLOATS}
COMPARE = {"Equal": NUM, "Less": NUM, "Greater": NUM, "LessOrEqual": NUM, "GreaterOrEqual": NUM}
LOGICAL = {"And", "Or", "Xor"}
REDUCE = {"ReduceSum": NUM, "ReduceMax": NUM, "ReduceMin": NUM, "ReduceMean": FLOATS, "ReduceProd": FLOATS,
          "ReduceL1": FLOATS, "ReduceL2": FLOATS, "ReduceSumSquare": FLOATS, "ReduceLogSumExp": FLOATS}


def b_unary(b: Builder, op: str) -> None:
    types = {**UNARY_EXACT, **UNARY_STEP, **UNARY_F}[op]
    step = op in UNARY_STEP or op in PERIODIC or op in EDGED
    v = b.pick(lambda w: w.dtype in types and (w.exact or not step), b.choice(types))
    if v is None:
        return
    if v.dtype not in types:
        return
    attrs = {}
    if op == "LeakyRelu":
        attrs["alpha"] = b.choice([0.01, 0.2, 1.5])
    if op == "Gelu":
        attrs["approximate"] = b.choice(["none", "tanh"])
    if op in ("Elu", "Celu"):
        attrs["alpha"] = b.choice([1.0, 0.5])
    if op == "Shrink":
        attrs.update(lambd=b.choice([0.5, 1.0]), bias=b.choice([0.0, 0.25]))
    if op == "ThresholdedRelu":
        attrs["alpha"] = b.choice([0.5, 1.0])
    exact = v.exact and (op in UNARY_EXACT or op in UNARY_STEP)
    b.emit(op, [v.name], [b.out(v.dtype, v.shape, exact, v.finite and op not in UNARY_F)], **attrs)


def b_binary(b: Builder, op: str) -> None:
    types = BINARY[op]
    a = b.pick(lambda w: w.dtype in types and (op != "Mod" or w.exact), b.choice(types))
    if a is None:
        return
    if a.dtype not in types:
        return
    attrs = {}
    if op in ("Div", "Mod") and a.dtype in INTS:
        c = b.partner(a, nonzero=True)
    elif op == "Mod":
        c = b.partner(a, nonzero=True)
    else:
        c = b.partner(a)
    if op == "Mod":
        attrs["fmod"] = 1 if a.dtype in FLOATS else b.choice([0, 1])
    if op == "Pow":
        c = b.raw(a.dtype, b.bcast_partner(a.shape))             # exponents stay small
    shp = _bshape(a.shape, c.shape)
    if shp is None:
        return
    if a.dtype in INTS and op == "Mul" and not (a.exact and c.exact and _small(b, a) and _small(b, c)):
        return                                                  # keep integer products far from overflow
    exact = a.exact and c.exact and (op in ("Add", "Sub") or (op in ("Mul", "Mod") and _raw(b, a) and _raw(b, c))
                                     or (a.dtype in INTS and op == "Div"))
    ins = [a.name, c.name] if b.flag(0.8) or op in ("Sub", "Div", "Pow", "Mod") else [c.name, a.name]
    b.emit(op, ins, [b.out(a.dtype, shp, exact, a.finite and c.finite and op in ("Add", "Sub", "Mul"))], **attrs)


def _raw(b: Builder, v: V) -> bool:
    return v.name in b.inits or v.name in b.feeds


def _small(b: Builder, v: V) -> bool:
    return _raw(b, v)


def b_variadic(b: Builder, op: str) -> None:
    types = VARIADIC[op]
    a = b.pick(lambda w: w.dtype in types, b.choice(types))
    if a is None:
        return
    if a.dtype not in types:
        return
    ins = [a]
    for _ in range(b.draw(b.st.integers(0, 2))):
        ins.append(b.partner(a))
    shp = a.shape
    for w in ins[1:]:
        shp = _bshape(shp, w.shape)
        if shp is None:
            return
    exact = all(w.exact for w in ins) and op in ("Max", "Min")
    b.emit(op, [w.name for w in ins], [b.out(a.dtype, shp, exact, all(w.finite for w in ins))])


def b_compare(b: Builder, op: str) -> None:
    a = b.pick(lambda w: w.dtype in NUM and w.exact, b.choice(NUM))
    if a is None:
        return
    if a.dtype not in NUM or not a.exact:
        return
    c = b.partner(a)
    if not c.exact:
        return
    shp = _bshape(a.shape, c.shape)
    if shp is not None:
        b.emit(op, [a.name, c.name], [b.out(BOOL, shp, True)])


def b_logical(b: Builder, op: str) -> None:
    a = b.pick(lambda w: w.dtype == BOOL, BOOL)
    if a is None:
        return
    c = b.partner(a, BOOL)
    shp = _bshape(a.shape, c.shape)
    if shp is not None:
        b.emit(op, [a.name, c.name], [b.out(BOOL, shp, True)])


def b_not(b: Builder, op: str) -> None:
    a = b.pick(lambda w: w.dtype == BOOL, BOOL)
    if a is None:
        return
    b.emit(op, [a.name], [b.out(BOOL, a.shape, True)])


def b_isx(b: Builder, op: str) -> None:
    a = b.pick(lambda w: w.dtype in FLOATS and w.exact, b.choice(FLOATS))
    if a is None:
        return
    if a.dtype in FLOATS and a.exact:
        b.emit(op, [a.name], [b.out(BOOL, a.shape, True)])


def b_where(b: Builder, op: str) -> None:
    cnd = b.pick(lambda w: w.dtype == BOOL, BOOL)
    if cnd is None:
        return
    x = b.pick(lambda w: w.dtype in NUM, b.choice(NUM))
    if x is None:
        return
    if x.dtype not in NUM:
        return
    y = b.partner(x)
    shp = _bshape(cnd.shape, x.shape)
    shp = _bshape(shp, y.shape) if shp is not None else None
    if shp is None:
        return
    if x.dtype in FLOATS and "Where:negative_zero" in b.avoid:
        zero = b.name("c")                  # x + 0 is never -0 (the known difference)
        b.inits[zero] = np.zeros((), NP[x.dtype])
        x0 = b.out(x.dtype, x.shape, x.exact, x.finite)
        b.emit("Add", [x.name, zero], [x0])
        x = x0
    b.emit(op, [cnd.name, x.name, y.name], [b.out(x.dtype, shp, x.exact and y.exact, x.finite and y.finite)])


def b_cast(b: Builder, op: str) -> None:
    a = b.pick(lambda w: True, b.choice(NUM + (BOOL,)))
    if a is None:
        return
    to = b.choice([t for t in NUM + (BOOL,) if t != a.dtype] or [a.dtype])
    if a.dtype in FLOATS and to not in FLOATS and not (a.exact and a.finite):
        return                                                  # float -> int of NaN/Inf or inexact: UB/unstable
    exact = a.exact and (to != F32 or a.dtype != F64)
    b.emit(op, [a.name], [b.out(to, a.shape, exact, a.finite or to not in FLOATS)], to=int(to))


def b_transpose(b: Builder, op: str) -> None:
    a = b.pick(lambda w: len(w.shape) >= 1)
    if a is None:
        return
    perm = list(b.rng.permutation(len(a.shape)))
    attrs = {"perm": [int(p) for p in perm]} if b.flag(0.8) else {}
    if not attrs:
        perm = list(range(len(a.shape)))[::-1]
    b.emit(op, [a.name], [b.out(a.dtype, tuple(a.shape[p] for p in perm), a.exact, a.finite)], **attrs)


def b_reshape(b: Builder, op: str) -> None:
    a = b.pick(lambda w: 0 not in w.shape)
    if a is None:
        return
    if 0 in a.shape:
        return
    n = int(np.prod(a.shape, dtype=np.int64))
    dims, rest = [], n
    for _ in range(b.draw(b.st.integers(0, 3))):
        divs = [d for d in range(1, rest + 1) if rest % d == 0]
        d = b.choice(divs)
        dims.append(d)
        rest //= d
    dims.append(rest)
    out = tuple(dims)
    spec = list(dims)
    if b.flag(0.3):
        spec[b.draw(b.st.integers(0, len(spec) - 1))] = -1
    b.emit(op, [a.name, b.const_i64(spec)], [b.out(a.dtype, out, a.exact, a.finite)])


def b_flatten(b: Builder, op: str) -> None:
    a = b.pick(lambda w: True)
    if a is None:
        return
    r = len(a.shape)
    axis = b.draw(b.st.integers(-r, r)) if r else 0
    k = axis % (r + 1) if r else 0
    if axis < 0:
        k = axis + r
    out = (int(np.prod(a.shape[:k], dtype=np.int64)), int(np.prod(a.shape[k:], dtype=np.int64)))
    b.emit(op, [a.name], [b.out(a.dtype, out, a.exact, a.finite)], axis=axis)


def b_unsqueeze(b: Builder, op: str) -> None:
    a = b.pick(lambda w: len(w.shape) <= 4)
    if a is None:
        return
    r = len(a.shape)
    k = b.draw(b.st.integers(1, 2))
    axes = sorted(set(int(x) for x in b.rng.choice(r + k, size=k, replace=False)))
    out = list(a.shape)
    for ax in axes:
        out.insert(ax, 1)
    spec = [ax - (r + len(axes)) if b.flag(0.3) else ax for ax in axes]
    b.emit(op, [a.name, b.const_i64(spec)], [b.out(a.dtype, tuple(out), a.exact, a.finite)])


def b_squeeze(b: Builder, op: str) -> None:
    a = b.pick(lambda w: 1 in w.shape, make_shape=(2, 1, 3))
    if a is None:
        return
    ones = [i for i, d in enumerate(a.shape) if d == 1]
    if not ones:
        return
    if b.flag(0.2):
        b.emit(op, [a.name], [b.out(a.dtype, tuple(d for d in a.shape if d != 1), a.exact, a.finite)])
        return
    axes = sorted(set(b.choice(ones) for _ in range(b.draw(b.st.integers(1, len(ones))))))
    out = tuple(d for i, d in enumerate(a.shape) if i not in axes)
    b.emit(op, [a.name, b.const_i64(axes)], [b.out(a.dtype, out, a.exact, a.finite)])


def b_concat(b: Builder, op: str) -> None:
    a = b.pick(lambda w: len(w.shape) >= 1)
    if a is None or (0 in a.shape and "Concat:uninitialized" in b.avoid):
        return
    r = len(a.shape)
    axis = b.axis(r)
    ins, total = [a], a.shape[axis]
    for _ in range(b.draw(b.st.integers(1, 2))):
        shp = list(a.shape)
        shp[axis] = b.draw(b.st.integers(0, 3))
        ins.append(b.raw(a.dtype, tuple(shp)))
        total += shp[axis]
    out = list(a.shape)
    out[axis] = total
    b.emit(op, [w.name for w in ins], [b.out(a.dtype, tuple(out), all(w.exact for w in ins),
                                             all(w.finite for w in ins))], axis=axis)


def b_expand(b: Builder, op: str) -> None:
    a = b.pick(lambda w: len(w.shape) <= 3)
    if a is None:
        return
    tgt = [d if d != 1 or b.flag(0.5) else b.draw(b.st.integers(1, 3)) for d in a.shape]
    tgt = [1 if b.flag(0.2) else d for d in tgt]                 # Expand also accepts 1 where the input is larger
    if b.flag(0.3):
        tgt = [2] + tgt
    out = _bshape(a.shape, tuple(tgt))
    if out is not None:
        b.emit(op, [a.name, b.const_i64(tgt)], [b.out(a.dtype, out, a.exact, a.finite)])


def b_tile(b: Builder, op: str) -> None:
    a = b.pick(lambda w: len(w.shape) >= 1)
    if a is None:
        return
    reps = [b.draw(b.st.integers(0 if b.flag(0.05) else 1, 3)) for _ in a.shape]
    out = tuple(d * r for d, r in zip(a.shape, reps))
    b.emit(op, [a.name, b.const_i64(reps)], [b.out(a.dtype, out, a.exact, a.finite)])


def b_slice(b: Builder, op: str) -> None:
    a = b.pick(lambda w: len(w.shape) >= 1)
    if a is None:
        return
    r = len(a.shape)
    axes = sorted(set(b.draw(b.st.integers(0, r - 1)) for _ in range(b.draw(b.st.integers(1, r)))))
    starts, ends, steps, out = [], [], [], list(a.shape)
    for ax in axes:
        d = a.shape[ax]
        step = b.choice([1, 1, 2, -1, -2])
        s = b.draw(b.st.integers(-d - 2, d + 2))
        e = b.choice([b.draw(b.st.integers(-d - 2, d + 2)), 2**62 if step > 0 else -(2**62)])
        starts.append(s)
        ends.append(e)
        steps.append(step)
        out[ax] = len(range(*slice(s, e, step).indices(d)))
    ins = [a.name, b.const_i64(starts), b.const_i64(ends)]
    if b.flag(0.8):
        ins.append(b.const_i64([ax - r if b.flag(0.3) else ax for ax in axes]))
        ins.append(b.const_i64(steps))
    elif steps != [1] * len(steps) or axes != list(range(len(axes))):
        return
    b.emit(op, ins, [b.out(a.dtype, tuple(out), a.exact, a.finite)])


def b_gather(b: Builder, op: str) -> None:
    a = b.pick(lambda w: len(w.shape) >= 1 and w.shape[0] > 0)
    if a is None:
        return
    r = len(a.shape)
    axis = b.axis(r)
    d = a.shape[axis]
    if d == 0:
        return
    ishape = b.shape(max_rank=2)
    idx = b.rng.integers(-d, d, ishape).astype(np.int64)
    n = b.name("k")
    b.inits[n] = idx
    ax = axis % r
    out = a.shape[:ax] + tuple(ishape) + a.shape[ax + 1:]
    b.emit(op, [a.name, n], [b.out(a.dtype, out, a.exact, a.finite)], axis=axis)


def b_shape(b: Builder, op: str) -> None:
    a = b.pick(lambda w: True)
    if a is None:
        return
    b.emit(op, [a.name], [b.out(I64, (len(a.shape),), True)])


def b_reduce(b: Builder, op: str) -> None:
    types = REDUCE[op]
    a = b.pick(lambda w: w.dtype in types and len(w.shape) >= 1, b.choice(types))
    if a is None:
        return
    if a.dtype not in types or not a.shape:
        return
    if op in ("ReduceMax", "ReduceMin") and 0 in a.shape:
        return                                                  # empty max/min: no identity (implementation-defined)
    if not a.finite and f"{op}:nan_input" in b.avoid:
        return
    r = len(a.shape)
    keep = b.choice([0, 1])
    ins = [a.name]
    if b.flag(0.8):
        axes = sorted(set(b.draw(b.st.integers(0, r - 1)) for _ in range(b.draw(b.st.integers(1, r)))))
        neg_ok = 0 not in a.shape or "Reduce:empty_negative_axes" not in b.avoid
        ins.append(b.const_i64([ax - r if neg_ok and b.flag(0.3) else ax for ax in axes]))
    else:
        axes = list(range(r))
    out = tuple((1 if keep else None) if i in axes else d for i, d in enumerate(a.shape))
    out = tuple(d for d in out if d is not None)
    if a.dtype in INTS and op in ("ReduceSum",) and int(np.prod(a.shape)) > 64:
        return
    exact = a.exact and op in ("ReduceMax", "ReduceMin") or (a.exact and op == "ReduceSum" and _raw(b, a))
    b.emit(op, ins, [b.out(a.dtype, out, exact, a.finite and op in ("ReduceMax", "ReduceMin", "ReduceSum"))],
           keepdims=keep)


def b_softmax(b: Builder, op: str) -> None:
    a = b.pick(lambda w: w.dtype in FLOATS and len(w.shape) >= 1, b.choice(FLOATS))
    if a is None:
        return
    if a.dtype not in FLOATS or not a.shape:
        return
    r = len(a.shape)
    axis = b.axis(r)
    if a.shape[axis] == 0 and f"{op}:empty_axis" in b.avoid:
        return
    b.emit(op, [a.name], [b.out(a.dtype, a.shape, False, False)], axis=axis)


def b_argx(b: Builder, op: str) -> None:
    a = b.pick(lambda w: w.dtype in NUM and w.exact and len(w.shape) >= 1 and 0 not in w.shape, F32)
    if a is None:
        return
    if a.dtype not in NUM or not a.exact or not a.shape or 0 in a.shape or not a.finite:
        return
    r = len(a.shape)
    axis = b.axis(r)
    keep = b.choice([0, 1])
    out = list(a.shape)
    if keep:
        out[axis] = 1
    else:
        del out[axis]
    b.emit(op, [a.name], [b.out(I64, tuple(out), True)], axis=axis, keepdims=keep,
           select_last_index=b.choice([0, 1]))


def b_matmul(b: Builder, op: str) -> None:
    t = b.choice(FLOATS)
    m, k, n = (b.draw(b.st.integers(1, 4)) for _ in range(3))
    batch = b.shape(max_rank=2)
    ra = b.choice([1, 2, 2 + len(batch)])
    rb = b.choice([1, 2, 2 + len(batch)])
    sa = (k,) if ra == 1 else (batch + (m, k) if ra > 2 else (m, k))
    sb = (k,) if rb == 1 else (batch + (k, n) if rb > 2 else (k, n))
    a = b.pick(lambda w: w.dtype == t and w.shape == sa, t, sa)
    if a is None:
        return
    c = b.pick(lambda w: w.dtype == t and w.shape == sb, t, sb)
    if c is None:
        return
    out = np.matmul(np.zeros(sa, np.float32), np.zeros(sb, np.float32)).shape
    b.emit(op, [a.name, c.name], [b.out(t, out, False, False)])


def b_clip(b: Builder, op: str) -> None:
    a = b.pick(lambda w: w.dtype in FLOATS, F32)
    if a is None:
        return
    if a.dtype not in FLOATS:
        return
    ins = [a.name]
    lo = b.choice([None, -1.0, 0.5])
    hi = b.choice([None, 2.0, 0.5])
    if (lo is None or hi is None) and not a.finite and "Clip:inf_without_bound" in b.avoid:
        return
    for val in (lo, hi):
        if val is None:
            ins.append("")
        else:
            nm = b.name("k")
            b.inits[nm] = np.asarray(val, NP[a.dtype])
            ins.append(nm)
    while ins and ins[-1] == "":
        ins.pop()
    b.emit(op, ins, [b.out(a.dtype, a.shape, a.exact, a.finite)])


def _distinct(b: Builder, dtype: int, shape: tuple) -> V:
    """A fresh value whose elements all differ (no ties for an order-dependent op to break its own way)."""
    v = b.raw(dtype, shape)
    a = (b.rng.permutation(int(np.prod(shape))).reshape(shape) - int(np.prod(shape)) // 2).astype(NP[dtype])
    if dtype in FLOATS:
        a = (a / 4).astype(NP[dtype])
    (b.inits if v.name in b.inits else b.feeds)[v.name] = np.array(a, order="C")
    v.finite = True
    return v


def b_pad(b: Builder, op: str) -> None:
    a = b.pick(lambda w: w.dtype in NUM and len(w.shape) >= 1)
    if a is None or a.dtype not in NUM or not a.shape:
        return
    r = len(a.shape)
    mode = b.choice(["constant", "constant", "reflect", "edge", "wrap"])
    axes = sorted(set(b.draw(b.st.integers(0, r - 1)) for _ in range(b.draw(b.st.integers(1, r)))))
    begin, end = [], []
    for ax in axes:
        d = a.shape[ax]
        for side in (begin, end):
            if mode == "constant":
                side.append(b.draw(b.st.integers(-d // 2, 2)))      # negative pads crop
            elif d == 0:
                side.append(0)
            else:
                side.append(b.draw(b.st.integers(0, min(2, d - 1 if mode == "reflect" else d))))
    out = list(a.shape)
    for ax, p0, p1 in zip(axes, begin, end):
        out[ax] = a.shape[ax] + p0 + p1
    if min(out) < 0:
        return
    ins = [a.name, b.const_i64(begin + end)]
    use_axes = axes != list(range(r)) or b.flag(0.3)
    value = ""
    if mode == "constant" and b.flag(0.6):
        value = b.name("k")
        b.inits[value] = np.asarray(b.choice([0, 3, -2]), NP[a.dtype])
    if value or use_axes:
        ins.append(value)
    if use_axes:
        ins.append(b.const_i64([ax - r if b.flag(0.3) else ax for ax in axes]))
    b.emit(op, ins, [b.out(a.dtype, tuple(out), a.exact, a.finite)], mode=mode)


def b_topk(b: Builder, op: str) -> None:
    t = b.choice((F32, F64, I32, I64))
    shape = b.shape(max_rank=3, min_rank=1)
    if 0 in shape:
        return
    a = _distinct(b, t, shape)
    r = len(shape)
    axis = b.axis(r)
    k = b.draw(b.st.integers(1, shape[axis]))
    out = list(shape)
    out[axis] = k
    b.emit(op, [a.name, b.const_i64([k])], [b.out(t, tuple(out), True), b.out(I64, tuple(out), True)], axis=axis,
           largest=b.choice([0, 1]), sorted=1)


def _axis_indices(b: Builder, ishape: tuple, axis: int, d: int, unique: bool) -> np.ndarray:
    """Indices of shape ``ishape`` into a dim of size ``d`` along ``axis`` (negative ones too); ``unique``: distinct
    along the axis at every other position (a scatter's writes then never collide)."""
    if unique:
        moved = np.moveaxis(np.zeros(ishape, np.int64), axis, -1)
        flat = moved.reshape(-1, ishape[axis])
        for row in flat:
            row[:] = b.rng.permutation(d)[:ishape[axis]]
        idx = np.moveaxis(flat.reshape(moved.shape), -1, axis)
    else:
        idx = b.rng.integers(0, d, ishape)
    neg = b.rng.random(ishape) < 0.3
    return np.where(neg, idx - d, idx).astype(np.int64)


def b_gather_elements(b: Builder, op: str) -> None:
    a = _nonempty(b)
    if a is None:
        return
    r = len(a.shape)
    axis = b.axis(r)
    ishape = tuple(b.draw(b.st.integers(1, 3)) if i == axis % r else b.draw(b.st.integers(1, d))
                   for i, d in enumerate(a.shape))
    n = b.name("k")
    b.inits[n] = _axis_indices(b, ishape, axis % r, a.shape[axis], False)
    b.emit(op, [a.name, n], [b.out(a.dtype, ishape, a.exact, a.finite)], axis=axis)


def _nonempty(b: Builder, types=None) -> V | None:
    """A value of rank >= 1 with no empty dim (of ``types``, when given), or None."""
    def ok(w: V) -> bool:
        return len(w.shape) >= 1 and 0 not in w.shape and (types is None or w.dtype in types)
    a = b.pick(ok)
    return a if a is not None and ok(a) else None


def _scatter(b: Builder, op: str, a: V, idx: np.ndarray, upd: V, **attrs) -> None:
    """``op`` writes ``upd`` into ``a`` at ``idx`` (whose writes never collide) under a drawn reduction."""
    n = b.name("k")
    b.inits[n] = idx
    red = b.choice(["none", "none", "add", "mul", "max", "min"])
    exact = a.exact and upd.exact and (red in ("none", "max", "min") or a.dtype in INTS)
    finite = a.finite and upd.finite and red in ("none", "max", "min")
    b.emit(op, [a.name, n, upd.name], [b.out(a.dtype, a.shape, exact, finite)], reduction=red, **attrs)


def b_scatter_elements(b: Builder, op: str) -> None:
    a = _nonempty(b, NUM)
    if a is None:
        return
    r = len(a.shape)
    axis = b.axis(r)
    ishape = tuple(b.draw(b.st.integers(1, d)) for d in a.shape)
    idx = _axis_indices(b, ishape, axis % r, a.shape[axis], True)
    _scatter(b, op, a, idx, b.raw(a.dtype, ishape), axis=axis)


def b_cumsum(b: Builder, op: str) -> None:
    a = b.pick(lambda w: w.dtype in NUM and len(w.shape) >= 1)
    if a is None or a.dtype not in NUM or not a.shape:
        return
    if a.dtype in INTS and int(np.prod(a.shape)) > 64:
        return
    r = len(a.shape)
    nm = b.name("k")
    b.inits[nm] = np.asarray(b.axis(r), b.choice([np.int64, np.int32]))
    exact = a.exact and (a.dtype in INTS or _raw(b, a))
    b.emit(op, [a.name, nm], [b.out(a.dtype, a.shape, exact, False)], exclusive=b.choice([0, 1]),
           reverse=b.choice([0, 1]))


def b_trilu(b: Builder, op: str) -> None:
    a = b.pick(lambda w: len(w.shape) >= 2)
    if a is None or len(a.shape) < 2:
        return
    ins = [a.name]
    if b.flag(0.7):
        nm = b.name("k")
        b.inits[nm] = np.asarray(b.draw(b.st.integers(-4, 4)), np.int64)
        ins.append(nm)
    b.emit(op, ins, [b.out(a.dtype, a.shape, a.exact, a.finite)], upper=b.choice([0, 1]))


def b_gather_nd(b: Builder, op: str) -> None:
    a = _nonempty(b)
    if a is None:
        return
    r = len(a.shape)
    bd = b.choice([0, 0, 1]) if r >= 2 else 0
    k = b.draw(b.st.integers(1, r - bd))
    lead = a.shape[:bd] + tuple(b.draw(b.st.integers(1, 3)) for _ in range(b.draw(b.st.integers(0, 2))))
    dims = a.shape[bd:bd + k]
    idx = np.stack([b.rng.integers(-d, d, lead) for d in dims], axis=-1).astype(np.int64)
    n = b.name("k")
    b.inits[n] = idx
    out = lead + a.shape[bd + k:]
    b.emit(op, [a.name, n], [b.out(a.dtype, out, a.exact, a.finite)], batch_dims=bd)


def b_scatter_nd(b: Builder, op: str) -> None:
    a = _nonempty(b, NUM)
    if a is None:
        return
    r = len(a.shape)
    k = b.draw(b.st.integers(1, r))
    cells = int(np.prod(a.shape[:k]))
    m = b.draw(b.st.integers(1, min(cells, 4)))
    flat = b.rng.permutation(cells)[:m]                        # distinct cells: writes never collide
    idx = np.stack(np.unravel_index(flat, a.shape[:k]), axis=-1).astype(np.int64)
    idx = np.where(b.rng.random(idx.shape) < 0.3, idx - np.array(a.shape[:k]), idx)
    _scatter(b, op, a, idx, b.raw(a.dtype, (m,) + a.shape[k:]))


def b_onehot(b: Builder, op: str) -> None:
    shape = b.shape(max_rank=2, min_rank=1)             # (ORT's shape inference wants rank >= 1)
    depth = b.draw(b.st.integers(1, 5))
    t = I64                                             # (the CPU EP's kernels: int64 indices and depth,
    ind = b.raw(t, shape)                               # int64 or float values)
    (b.inits if ind.name in b.inits else b.feeds)[ind.name] = b.rng.integers(-depth - 1, depth + 1,
                                                                                shape).astype(NP[t])
    dn = b.name("k")
    b.inits[dn] = np.asarray(depth, np.int64)
    vt = b.choice((I64, F32))
    vn = b.name("k")
    b.inits[vn] = np.asarray([b.choice([0, -1]), b.choice([1, 5])], NP[vt])
    r = len(shape) + 1
    axis = b.axis(r)
    out = list(shape)
    out.insert(axis % r, depth)
    b.emit(op, [ind.name, dn, vn], [b.out(vt, tuple(out), True)], axis=axis)


def b_space_depth(b: Builder, op: str) -> None:
    bs = b.choice([1, 2])
    n_, c, h, w = (b.draw(b.st.integers(1, 2)), b.draw(b.st.integers(1, 3)), b.draw(b.st.integers(1, 3)),
                   b.draw(b.st.integers(1, 3)))
    if op == "DepthToSpace":
        shape, out, attrs = (n_, c * bs * bs, h, w), (n_, c, h * bs, w * bs), {"mode": b.choice(["DCR", "CRD"])}
    else:
        shape, out, attrs = (n_, c, h * bs, w * bs), (n_, c * bs * bs, h, w), {}
    a = b.pick(lambda v: v.shape == shape and v.dtype == F32, F32, shape)      # (the CPU EP's only type)
    if a is None or a.shape != shape or a.dtype != F32:
        return
    b.emit(op, [a.name], [b.out(a.dtype, out, a.exact, a.finite)], blocksize=bs, **attrs)


def b_reverse_sequence(b: Builder, op: str) -> None:
    a = b.pick(lambda w: len(w.shape) >= 2 and 0 not in w.shape[:2])
    if a is None or len(a.shape) < 2 or 0 in a.shape[:2]:
        return
    time_axis = b.choice([0, 1])
    batch_axis = 1 - time_axis
    lens = b.rng.integers(1, a.shape[time_axis] + 1, a.shape[batch_axis]).astype(np.int64)
    n = b.name("k")
    b.inits[n] = lens
    b.emit(op, [a.name, n], [b.out(a.dtype, a.shape, a.exact, a.finite)], time_axis=time_axis,
           batch_axis=batch_axis)


def b_compress(b: Builder, op: str) -> None:
    a = b.pick(lambda w: len(w.shape) >= 1)
    if a is None or not a.shape:
        return
    r = len(a.shape)
    axis = b.choice([None] + list(range(-r, r)))
    size = int(np.prod(a.shape)) if axis is None else a.shape[axis]
    cond = b.rng.random(b.draw(b.st.integers(0, size))) < 0.5
    n = b.name("k")
    b.inits[n] = cond
    kept = int(cond.sum())
    if axis is None:
        out, attrs = (kept,), {}
    else:
        out, attrs = tuple(kept if i == axis % r else d for i, d in enumerate(a.shape)), {"axis": axis}
    b.emit(op, [a.name, n], [b.out(a.dtype, out, a.exact, a.finite)], **attrs)


def b_hardmax(b: Builder, op: str) -> None:
    shape = b.shape(max_rank=3, min_rank=1)
    a = _distinct(b, F32, shape)                        # (the CPU EP's only type)
    r = len(shape)
    b.emit(op, [a.name], [b.out(F32, shape, True)], axis=b.axis(r))


def b_range(b: Builder, op: str) -> None:
    t = b.choice(NUM)
    start, delta = b.draw(b.st.integers(-5, 5)), b.choice([1, 2, -1, -3, 3])
    limit = start + delta * b.draw(b.st.integers(-1, 6))
    names = []
    for v in (start, limit, delta):
        nm = b.name("k")
        b.inits[nm] = np.asarray(v / 2 if t in FLOATS else v, NP[t])
        names.append(nm)
    n = max(0, -(-(limit - start) // delta))
    b.emit(op, names, [b.out(t, (n,), True)])


def b_bitwise(b: Builder, op: str) -> None:
    a = b.pick(lambda w: w.dtype in INTS and w.exact, b.choice(INTS))
    if a is None or a.dtype not in INTS or not a.exact:
        return
    if op == "BitwiseNot":
        b.emit(op, [a.name], [b.out(a.dtype, a.shape, True)])
        return
    c = b.partner(a)
    shp = _bshape(a.shape, c.shape)
    if shp is not None and c.exact:
        b.emit(op, [a.name, c.name], [b.out(a.dtype, shp, True)])


def b_prelu(b: Builder, op: str) -> None:
    a = b.pick(lambda w: w.dtype == F32, F32)
    if a is None or a.dtype != F32:
        return
    slope = b.raw(F32, b.bcast_partner(a.shape))
    if _bshape(a.shape, slope.shape) != a.shape:
        return                                  # the slope broadcasts to x (unidirectional)
    b.emit(op, [a.name, slope.name], [b.out(F32, a.shape, False, False)])


def b_castlike(b: Builder, op: str) -> None:
    a = b.pick(lambda w: w.exact and w.finite and w.dtype in NUM)
    if a is None or not (a.exact and a.finite) or a.dtype not in NUM:
        return
    t = b.choice(NUM)
    like = b.raw(t, (1,))
    exact = a.dtype in INTS or t in FLOATS
    b.emit(op, [a.name, like.name], [b.out(t, a.shape, exact)])


def b_size(b: Builder, op: str) -> None:
    a = b.pick(lambda w: True)
    if a is not None:
        b.emit(op, [a.name], [b.out(I64, (), True)])


def b_constant_of_shape(b: Builder, op: str) -> None:
    shape = b.shape(max_rank=3)
    t = b.choice(NUM)
    attrs = {}
    if b.flag(0.7):
        attrs["value"] = onnx.numpy_helper.from_array(np.asarray([b.choice([0, 1, -3])], NP[t]), "value")
    else:
        t = F32
    b.emit(op, [b.const_i64(list(shape))], [b.out(t, shape, True)], **attrs)


def b_eyelike(b: Builder, op: str) -> None:
    a = b.pick(lambda w: len(w.shape) == 2 and w.dtype in NUM)
    if a is None or len(a.shape) != 2 or a.dtype not in NUM:
        return
    t = b.choice(NUM)
    b.emit(op, [a.name], [b.out(t, a.shape, True)], k=b.draw(b.st.integers(-3, 3)), dtype=t)


def b_split(b: Builder, op: str) -> None:
    a = _nonempty(b)
    if a is None:
        return
    r = len(a.shape)
    axis = b.axis(r)
    d = a.shape[axis]
    if b.flag(0.5):
        cuts = sorted(b.rng.choice(np.arange(0, d + 1), b.draw(b.st.integers(0, 2)), replace=True).tolist())
        sizes = [e - s for s, e in zip([0] + cuts, cuts + [d])]
        ins, attrs = [a.name, b.const_i64(sizes)], {}
    else:
        n = b.draw(b.st.integers(1, min(d, 3)))
        sizes = [-(-d // n)] * (d // -(-d // n)) + ([d % -(-d // n)] if d % -(-d // n) else [])
        ins, attrs = [a.name], {"num_outputs": len(sizes)}
    outs = [b.out(a.dtype, tuple(k if i == axis % r else x for i, x in enumerate(a.shape)), a.exact, a.finite)
            for k in sizes]
    b.emit(op, ins, outs, axis=axis, **attrs)


def b_gemm(b: Builder, op: str) -> None:
    m, k, n = (b.draw(b.st.integers(1, 4)) for _ in range(3))
    ta, tb = b.choice([0, 1]), b.choice([0, 1])
    a = b.raw(F32, (k, m) if ta else (m, k))
    c = b.raw(F32, (n, k) if tb else (k, n))
    ins = [a.name, c.name]
    if b.flag(0.7):
        ins.append(b.raw(F32, b.choice([(m, n), (n,), (1, n), (m, 1), ()])).name)
    b.emit(op, ins, [b.out(F32, (m, n), False, False)], transA=ta, transB=tb, alpha=b.choice([1.0, 0.5]),
           beta=b.choice([1.0, 2.0]))


def b_norm(b: Builder, op: str) -> None:
    """LayerNormalization, InstanceNormalization, GroupNormalization, BatchNormalization (inference),
    LpNormalization and MeanVarianceNormalization of fresh float32 values (an InstanceNormalization's scale
    finite unless the known difference is asked for: ``InstanceNormalization:inf_scale``)."""
    rank = {"LayerNormalization": (1, 4), "LpNormalization": (1, 3)}.get(op, (3, 4))
    shape = tuple(b.draw(b.st.integers(1, 4)) for _ in range(b.draw(b.st.integers(*rank))))
    # MVN over a constant group (one element, or equal ones): the spec's epsilon gives 0, ORT's CPU kernel (none) NaN
    if op == "MeanVarianceNormalization" and int(np.prod([shape[a] for a in (0, 2, 3) if a < len(shape)])) < 2:
        return
    x = _distinct(b, F32, shape) if op == "MeanVarianceNormalization" else b.raw(F32, shape)
    c = shape[1] if len(shape) > 1 else 1
    if op == "LayerNormalization":
        axis = b.axis(len(shape))
        tail = shape[axis % len(shape):]
        ins = [x.name, b.raw(F32, tail).name] + ([b.raw(F32, tail).name] if b.flag(0.6) else [])
        b.emit(op, ins, [b.out(F32, shape, False, False)], axis=axis, epsilon=1e-3)
    elif op == "InstanceNormalization":
        with b.specials_while("InstanceNormalization:inf_scale" not in b.avoid):
            scale = b.raw(F32, (c,))
        b.emit(op, [x.name, scale.name, b.raw(F32, (c,)).name], [b.out(F32, shape, False, False)], epsilon=1e-3)
    elif op == "GroupNormalization":
        g = b.choice([d for d in (1, 2, 4) if c % d == 0])
        b.emit(op, [x.name, b.raw(F32, (c,)).name, b.raw(F32, (c,)).name], [b.out(F32, shape, False, False)],
               num_groups=g, epsilon=1e-3)
    elif op == "BatchNormalization":
        var = b.name("k")
        b.inits[var] = (b.rng.random(c) + 0.5).astype(np.float32)
        ins = [x.name] + [b.raw(F32, (c,), const=True).name for _ in range(3)]
        ins.insert(4, var)
        b.emit(op, ins, [b.out(F32, shape, False, False)], epsilon=1e-3)
    elif op == "LpNormalization":
        b.emit(op, [x.name], [b.out(F32, shape, False, False)], axis=b.axis(len(shape)),
               p=b.choice([1, 2]))
    else:
        b.emit(op, [x.name], [b.out(F32, shape, False, False)])


def b_global_pool(b: Builder, op: str) -> None:
    shape = tuple(b.draw(b.st.integers(1, 4)) for _ in range(b.draw(b.st.integers(3, 4))))
    x = b.raw(F32, shape)
    if op == "GlobalMaxPool" and "GlobalMaxPool:nan" in b.avoid and \
            np.isnan(b.feeds.get(x.name, b.inits.get(x.name))).any():
        return
    out = shape[:2] + (1,) * (len(shape) - 2)
    b.emit(op, [x.name], [b.out(F32, out, op == "GlobalMaxPool" and x.exact, False)])


def b_reduce_log_sum(b: Builder, op: str) -> None:
    # exact values only: a sum of computed ones can cancel to a rounding residue (+-3e-8 of a normalization's
    # outputs), whose log is -17 on one summation order and NaN on another
    a = b.pick(lambda w: w.dtype == F32 and w.exact and len(w.shape) >= 1, F32)
    if a is None or a.dtype != F32 or not a.exact or not a.shape:
        return
    b.emit(op, [a.name], [b.out(F32, (1,) * len(a.shape), False, False)])


def b_nonzero(b: Builder, op: str) -> None:
    a = b.pick(lambda w: w.exact and w.dtype in NUM + (BOOL,) and len(w.shape) >= 1)
    if a is None or not a.exact or not a.shape:
        return
    n = int(np.count_nonzero(b.feeds.get(a.name, b.inits.get(a.name)))) if _raw(b, a) else None
    if n is None:
        return                                  # the count of a computed value is not known here
    b.emit(op, [a.name], [b.out(I64, (len(a.shape), n), True)])


def b_unique(b: Builder, op: str) -> None:
    a = b.pick(lambda w: w.exact and w.finite and w.dtype in NUM and _raw(b, w))
    if a is None or not (a.exact and a.finite and _raw(b, a)) or a.dtype not in NUM:
        return
    vals = b.feeds.get(a.name, b.inits.get(a.name))
    n = len(np.unique(vals))
    b.emit(op, [a.name], [b.out(a.dtype, (n,), True), b.out(I64, (n,), True),
                          b.out(I64, tuple(vals.reshape(-1).shape), True), b.out(I64, (n,), True)], sorted=1)


def _window(b: Builder, nsp: int, pool: bool) -> dict:
    """Random window attributes for ``nsp`` spatial dims: kernel 1-3, strides and dilations 1-2, pads 0-2 (a pool's
    below its kernel, as ORT's CPU EP requires) or an auto_pad."""
    k = [b.draw(b.st.integers(1, 3)) for _ in range(nsp)]
    a = {"kernel_shape": k}
    if b.flag(0.6):
        a["strides"] = [b.draw(b.st.integers(1, 2)) for _ in range(nsp)]
    if b.flag(0.4):
        a["dilations"] = [b.draw(b.st.integers(1, 2)) for _ in range(nsp)]
    mode = b.choice(["NOTSET", "NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"])
    if mode != "NOTSET":
        a["auto_pad"] = mode
    elif b.flag(0.6):
        a["pads"] = [b.draw(b.st.integers(0, min(2, k[i % nsp] - 1) if pool else 2)) for i in range(2 * nsp)]
    return a


def _window_out(in_sizes, a: dict, ceil_mode: int = 0) -> list[int]:
    """Output sizes of a Conv / pool window (ORT's CPU EP's geometry)."""
    from .kernels.ops.pool import pool_geometry
    nsp = len(in_sizes)
    return pool_geometry(in_sizes, a["kernel_shape"], a.get("strides", [1] * nsp), a.get("dilations", [1] * nsp),
                         a.get("pads", [0] * (2 * nsp)), a.get("auto_pad", "NOTSET"), ceil_mode)[2]


def _finite_only(fn):
    """A builder whose fresh values are finite: NaN and inf through convolutions and pools are each EP's own."""
    def build(b: Builder, op: str) -> None:
        with b.specials_while(False):
            fn(b, op)
    return build


@_finite_only
def b_einsum(b: Builder, op: str) -> None:
    """Einsum of 1-3 fresh inputs: letters of sizes 1-4 (a letter twice in one input: its diagonal), an
    ellipsis over the same batch dims in every input (or none), an explicit output (any order, some letters summed
    away) or numpy's implicit one; values multiples of 1/8, so the sums are exact in float32. No zero sizes: ORT
    1.31.1's CPU EP dies of SIGFPE on some (``bad,dad->da`` over (0, 2, 0) twice)."""
    letters = "abcde"[:b.draw(b.st.integers(1, 5))]
    size = {c: b.draw(b.st.integers(1, 4)) for c in letters}
    batch = tuple(b.draw(b.st.integers(1, 3)) for _ in range(b.draw(b.st.integers(0, 2)))) if b.flag(0.25) else None
    terms, shapes = [], []
    for _ in range(b.draw(b.st.integers(1, 3))):
        subs = "".join(b.choice(letters) for _ in range(b.draw(b.st.integers(0, 3))))
        terms.append(("..." if batch is not None else "") + subs)
        shapes.append((batch or ()) + tuple(size[c] for c in subs))
    eq = ",".join(terms)
    if b.flag(0.7):
        used = sorted({c for t in terms for c in t if c != "."})
        keep = [c for c in used if b.flag(0.6)]
        order = b.draw(b.st.permutations(keep)) if keep else []
        eq += "->" + ("..." if batch is not None else "") + "".join(order)
    try:
        out = np.einsum(eq, *[np.zeros(sh, np.float32) for sh in shapes]).shape
    except ValueError:
        return                                  # (numpy's own rules: an equation no EP must take)
    t = F32 if b.flag(0.85) else F64
    ins = [b.raw(t, sh).name for sh in shapes]
    b.emit(op, ins, [b.out(t, out, True)], equation=eq)


@_finite_only
def b_conv(b: Builder, op: str) -> None:
    """Conv: 1-3 spatial dims, groups, strides, dilations, pads or auto_pad, an optional bias; products of
    multiples of 1/8, so the sums are exact in float32."""
    nsp = b.draw(b.st.integers(1, 3))
    g = b.draw(b.st.integers(1, 2))
    c, m = g * b.draw(b.st.integers(1, 2)), g * b.draw(b.st.integers(1, 2))
    sizes = [b.draw(b.st.integers(1, 6 if nsp < 3 else 4)) for _ in range(nsp)]
    a = _window(b, nsp, pool=False)
    out = _window_out(sizes, a)
    if min(out) < 1:
        return
    x = b.raw(F32, (b.draw(b.st.integers(1, 2)), c, *sizes))
    w = b.raw(F32, (m, c // g, *a["kernel_shape"]))
    if b.flag(0.5):
        del a["kernel_shape"]                   # taken from the weight
    ins = [x.name, w.name] + ([b.raw(F32, (m,)).name] if b.flag(0.5) else [])
    b.emit(op, ins, [b.out(F32, (x.shape[0], m, *out), True)], group=g, **a)


@_finite_only
def b_conv_transpose(b: Builder, op: str) -> None:
    """ConvTranspose with explicit pads: strides, dilations, output_padding below the stride or dilation, groups."""
    nsp = b.draw(b.st.integers(1, 2))
    g = b.draw(b.st.integers(1, 2))
    c, m = g * b.draw(b.st.integers(1, 2)), g * b.draw(b.st.integers(1, 2))
    sizes = [b.draw(b.st.integers(1, 4)) for _ in range(nsp)]
    k = [b.draw(b.st.integers(1, 3)) for _ in range(nsp)]
    st = [b.draw(b.st.integers(1, 3)) for _ in range(nsp)]
    dl = [b.draw(b.st.integers(1, 2)) for _ in range(nsp)]
    pads = [b.draw(b.st.integers(0, 2)) for _ in range(2 * nsp)]
    op_ = [b.draw(b.st.integers(0, max(st[i], dl[i]) - 1)) for i in range(nsp)]
    out = [st[i] * (sizes[i] - 1) + op_[i] + (k[i] - 1) * dl[i] + 1 - pads[i] - pads[i + nsp] for i in range(nsp)]
    if min(out) < 1:
        return
    x = b.raw(F32, (b.draw(b.st.integers(1, 2)), c, *sizes))
    w = b.raw(F32, (c, m // g, *k))
    ins = [x.name, w.name] + ([b.raw(F32, (m,)).name] if b.flag(0.5) else [])
    b.emit(op, ins, [b.out(F32, (x.shape[0], m, *out), True)], group=g, strides=st, dilations=dl, pads=pads,
           output_padding=op_)


@_finite_only
def b_pool(b: Builder, op: str) -> None:
    """MaxPool, AveragePool (count_include_pad) and LpPool (p 1-3): 1-3 spatial dims, strides, dilations, pads below
    the kernel or an auto_pad, ceil_mode."""
    nsp = b.draw(b.st.integers(1, 3))
    sizes = [b.draw(b.st.integers(1, 6 if nsp < 3 else 4)) for _ in range(nsp)]
    a = _window(b, nsp, pool=True)
    ceil = int(b.flag(0.4))
    out = _window_out(sizes, a, ceil)
    if min(out) < 1:
        return
    if ceil:
        a["ceil_mode"] = 1
    if op == "AveragePool" and b.flag(0.5):
        a["count_include_pad"] = 1
    if op == "LpPool":
        a["p"] = b.draw(b.st.integers(1, 3))
    x = b.raw(F32, (b.draw(b.st.integers(1, 2)), b.draw(b.st.integers(1, 3)), *sizes))
    b.emit(op, [x.name], [b.out(F32, (*x.shape[:2], *out), op == "MaxPool", op == "MaxPool")], **a)


@_finite_only
def b_resize(b: Builder, op: str) -> None:
    """Resize of a 4-D float32 value: nearest (every nearest_mode), linear or cubic (its coefficient,
    exclude_outside, antialias), every coordinate_transformation_mode (tf_crop_and_resize with a roi and an
    extrapolation value), by constant scales or sizes (a keep_aspect_ratio_policy), over all axes or the last two."""
    shape = (b.draw(b.st.integers(1, 2)), b.draw(b.st.integers(1, 3)), b.draw(b.st.integers(1, 5)),
             b.draw(b.st.integers(1, 5)))
    x = b.raw(F32, shape)
    mode = b.choice(["nearest", "linear", "cubic"])
    ctm = b.choice(["half_pixel", "asymmetric", "pytorch_half_pixel", "align_corners", "half_pixel_symmetric",
                    "tf_crop_and_resize"])
    a = {"mode": mode, "coordinate_transformation_mode": ctm}
    if mode == "nearest":
        a["nearest_mode"] = b.choice(["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
    else:
        if b.flag(0.3):
            a["antialias"] = 1
        if mode == "cubic":
            a["cubic_coeff_a"] = b.choice([-0.75, -0.5])
            a["exclude_outside"] = b.choice([0, 1])
    axes = [2, 3] if b.flag(0.4) else None
    if axes is not None:
        a["axes"] = axes
    roi = ""
    if ctm == "tf_crop_and_resize":
        lo = [b.choice([0.0, 0.25, 0.5]) for _ in range(2)]
        hi = [b.choice([0.5, 0.75, 1.0, 1.25]) for _ in range(2)]
        roi = b.name("k")
        b.inits[roi] = np.asarray(lo + hi if axes else [0.0, 0.0] + lo + [1.0, 1.0] + hi, np.float32)
        a["extrapolation_value"] = b.choice([0.0, -1.5])
    full = list(shape)
    if b.flag(0.5):
        sc = [b.choice([0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0]) for _ in range(2)]
        scales = ([1.0, 1.0] + sc) if axes is None else sc
        k = b.name("k")
        b.inits[k] = np.asarray(scales, np.float32)
        ins = [x.name, roi, k]
        full[2:] = [int(np.floor(shape[2 + i] * sc[i])) for i in range(2)]
    else:
        sz = [b.draw(b.st.integers(1, 8)) for _ in range(2)]
        pol = b.choice(["stretch", "stretch", "not_larger", "not_smaller"])
        if pol != "stretch":
            a["keep_aspect_ratio_policy"] = pol
            r = [sz[i] / shape[2 + i] for i in range(2)]
            f = min(r) if pol == "not_larger" else max(r)
            sz = [int(np.floor(f * shape[2 + i] + 0.5)) for i in range(2)]
        ins = [x.name, roi, "", b.const_i64((list(shape[:2]) if axes is None else []) + sz)]
        full[2:] = sz
    if min(full) < 1:
        return
    b.emit(op, ins, [b.out(F32, tuple(full), mode == "nearest" and ctm != "tf_crop_and_resize")], **a)


BUILDERS = {}
for _op in UNARY_EXACT.keys() | UNARY_STEP.keys() | UNARY_F.keys():
    BUILDERS[_op] = b_unary
for _op in BINARY:
    BUILDERS[_op] = b_binary
for _op in VARIADIC:
    BUILDERS[_op] = b_variadic
for _op in COMPARE:
    BUILDERS[_op] = b_compare
for _op in LOGICAL:
    BUILDERS[_op] = b_logical
for _op in REDUCE:
    BUILDERS[_op] = b_reduce
BUILDERS.update({"Not": b_not, "IsNaN": b_isx, "IsInf": b_isx, "Where": b_where, "Cast": b_cast,
                 "Transpose": b_transpose, "Reshape": b_reshape, "Flatten": b_flatten, "Unsqueeze": b_unsqueeze,
                 "Squeeze": b_squeeze, "Concat": b_concat, "Expand": b_expand, "Tile": b_tile, "Slice": b_slice,
                 "Gather": b_gather, "Shape": b_shape, "Softmax": b_softmax, "LogSoftmax": b_softmax,
                 "ArgMax": b_argx, "ArgMin": b_argx, "MatMul": b_matmul, "Clip": b_clip, "Pad": b_pad,
                 "TopK": b_topk, "GatherElements": b_gather_elements, "ScatterElements": b_scatter_elements,
                 "CumSum": b_cumsum, "Trilu": b_trilu, "GatherND": b_gather_nd, "ScatterND": b_scatter_nd,
                 "OneHot": b_onehot, "DepthToSpace": b_space_depth, "SpaceToDepth": b_space_depth,
                 "ReverseSequence": b_reverse_sequence, "Compress": b_compress, "Hardmax": b_hardmax,
                 "Range": b_range, "BitwiseNot": b_bitwise, "PRelu": b_prelu, "CastLike": b_castlike,
                 "Size": b_size, "ConstantOfShape": b_constant_of_shape, "EyeLike": b_eyelike, "Split": b_split,
                 "Gemm": b_gemm, "GlobalAveragePool": b_global_pool, "GlobalMaxPool": b_global_pool,
                 "ReduceLogSum": b_reduce_log_sum, "NonZero": b_nonzero, "Unique": b_unique, "Conv": b_conv,
                 "ConvTranspose": b_conv_transpose, "MaxPool": b_pool, "AveragePool": b_pool, "LpPool": b_pool,
                 "Resize": b_resize, "Einsum": b_einsum})
for _op in BITWISE:
    BUILDERS[_op] = b_bitwise
for _op in ("LayerNormalization", "InstanceNormalization", "GroupNormalization", "BatchNormalization",
            "LpNormalization", "MeanVarianceNormalization"):
    BUILDERS[_op] = b_norm


def fuzzable_ops(only: set[str] | None = None) -> list[str]:
    ops = registered_ops() & set(BUILDERS)
    if only:
        ops &= set(only)
    return sorted(ops)


#: differences from ORT's CPU EP the fuzzer found where the CPU EP's answer is not the one to give (the MLX EP's is
#: tested against its reference in tests/ops/): quirk -> what differs. ``cases(avoid=KNOWN_BUGS)`` keeps them out of
#: CI; scripts/fuzz.py generates them unless --avoid-known.
KNOWN_BUGS: dict[str, str] = {
    "ReduceLogSumExp:nan_input": "ReduceLogSumExp of [inf, nan, 2]: MLX nan, as NumPy; the CPU EP inf over every "
                                 "axis, nan over the last (its answer depends on the axes and where the NaN sits)",
    "ReduceMax:nan_input": "ReduceMax of [1, nan, 2]: MLX nan, as NumPy; CPU EP 2 (it returns NaN only when the "
                           "first reduced element is NaN)",
    "ReduceMin:nan_input": "ReduceMin of [1, nan, 2]: MLX nan, CPU EP 1 (same order dependence as ReduceMax)",
    "GlobalMaxPool:nan": "GlobalMaxPool of a channel holding NaN: the CPU EP's answer depends on the shape and on "
                         "where the NaN sits (skipped, kept, or the elements before it dropped); MLX keeps it",
    "Concat:uninitialized": "Concat of empty inputs whose dims off the axis differ, into a non-empty output (the "
                            "builder's shape of an empty Slice can be off): the CPU EP returns uninitialized memory, "
                            "the MLX EP raises (tests/ops/test_shape.py)",
    "InstanceNormalization:inf_scale": "InstanceNormalization with an infinite scale: the CPU EP gives NaN (inf - inf "
                                       "of its folded scale and shift), MLX the spec's scale * (x - mean) / sd + B, "
                                       "+-inf, as onnx's reference (test_normalization.py)",
    "Where:negative_zero": "Where taking -0.0 from X: the CPU EP gives +0.0 (from Y it keeps -0.0); MLX -0.0, as "
                           "NumPy (test_elementwise.py::test_where_keeps_the_sign_of_zero)",
    "Reduce:empty_negative_axes": "ReduceSum/L1/L2/Mean/Max... of a float32[0] input with axes=[-1]: the CPU EP "
                                  "gives shape (0,), where axes=[0], the same axis, gives () holding the identity; "
                                  "MLX gives () for both (test_reduction.py::test_reduce_empty_last_axis_is_axis_zero)",
}


def cases(ops: list[str] | None = None, max_nodes: int = 6, avoid=frozenset()):
    """Hypothesis strategy of :class:`Case` over ``ops`` (default: every registered op we can build)."""
    avoid = frozenset(avoid)
    from hypothesis import strategies as st

    pool = list(ops) if ops is not None else fuzzable_ops()
    if not pool:
        raise RuntimeError("no fuzzable op is registered")

    @st.composite
    def _case(draw):
        b = Builder(draw, st, avoid)
        first = b.raw(draw(st.sampled_from(NUM + (BOOL,))), b.shape(), const=False)
        for _ in range(draw(st.integers(1, max_nodes))):
            op = draw(st.sampled_from(pool))
            BUILDERS[op](b, op)
        produced = [v for v in b.values if v.name not in b.inits and v.name not in b.feeds]
        if not produced:
            b.emit("Identity", [first.name], [b.out(first.dtype, first.shape, True, first.finite)])
            produced = b.values[-1:]
        outs = [produced[-1]] + [v for v in produced[:-1] if draw(st.booleans())]
        inputs = list(b.inputs)
        used = {i for n in b.nodes for i in n.input}
        # graph inputs nobody reads are still legal; keep them (ORT warns, both EPs ignore them)
        graph = helper.make_graph(
            b.nodes, "fuzz", inputs,
            [helper.make_tensor_value_info(v.name, v.dtype, None) for v in outs],
            [onnx.numpy_helper.from_array(a, k) for k, a in b.inits.items() if k in used])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=10)
        desc = "\n".join(f"  {n.op_type}({', '.join(n.input)}) -> {', '.join(n.output)} "
                         f"{ {a.name: helper.get_attribute_value(a) for a in n.attribute} or ''}" for n in b.nodes)
        desc += "\n  inputs: " + ", ".join(f"{k}{v.dtype}{list(v.shape)}" for k, v in b.feeds.items())
        desc += "\n  consts: " + ", ".join(f"{k}{v.dtype}{list(v.shape)}" for k, v in b.inits.items() if k in used)
        return Case(model, dict(b.feeds), list(b.ops), desc)

    return _case()


# ---------------------------------------------------------------------------- checking
@dataclass
class Outcome:
    status: str                  # "ok", "cpu_rejects" (no reference), "both_fail"
    claimed: int = 0
    nodes: int = 0
    info: dict = field(default_factory=dict)


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if got.shape != want.shape:
        raise FuzzFailure(f"{what}: shape {got.shape} != CPU {want.shape}")
    if got.dtype != want.dtype:
        raise FuzzFailure(f"{what}: dtype {got.dtype} != CPU {want.dtype}")
    if got.dtype.kind == "f":
        fin = want[np.isfinite(want)]
        scale = max(1.0, float(np.abs(fin).max())) if fin.size else 1.0
        tol = 1e-2 if got.dtype == np.float16 else 1e-3        # float16: ~10 of its ulps (``half_case``)
        try:
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, equal_nan=True)
        except AssertionError as e:
            raise FuzzFailure(f"{what}: {e}") from None
    elif not np.array_equal(got, want):
        bad = np.argwhere(got != want)[:5].tolist()
        raise FuzzFailure(f"{what}: values differ at {bad}: MLX {got.ravel()[:8]} CPU {want.ravel()[:8]}")


def half_case(case: Case) -> Case:
    """``case`` with every float32 value float16 instead (inputs, constants, outputs, Cast / dtype attributes, tensor
    attributes, ConstantOfShape's default): the half-precision paths of the same graph (``scripts/fuzz.py --half``).
    The generator's values, multiples of 1/8 in [-4, 4], are float16 values too. Its reference is the CPU EP's node
    by node (``node_by_node``)."""
    m = onnx.ModelProto()
    m.CopyFrom(case.model)
    g = m.graph
    for v in itertools.chain(g.input, g.output, g.value_info):
        if v.type.tensor_type.elem_type == F32:
            v.type.tensor_type.elem_type = F16
    for i, t in enumerate(g.initializer):
        if t.data_type == F32:
            g.initializer[i].CopyFrom(onnx.numpy_helper.from_array(
                onnx.numpy_helper.to_array(t).astype(np.float16), t.name))
    for n in g.node:
        if n.op_type == "ConstantOfShape" and not any(a.name == "value" for a in n.attribute):
            n.attribute.append(helper.make_attribute("value", helper.make_tensor("value", F16, [1], [0.0])))
        for a in n.attribute:
            if a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT and a.i == F32:
                a.i = F16
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == F32:
                a.t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(a.t).astype(np.float16),
                                                          a.t.name))
    feeds = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in case.feeds.items()}
    return Case(m, feeds, case.ops, case.desc.replace("float32", "float16"), node_by_node(m))


def node_by_node(model: onnx.ModelProto):
    """A reference that runs ``model`` on ORT's CPU EP one node at a time, each output a NumPy value: a float16 op
    ORT has no kernel for runs in float32 between casts it inserts, and in one session it elides them between such
    ops (a Tanh -> Acos chain in float32), so its answer is not float16's op by op. Returns ``run(feeds)``."""
    import onnxruntime as ort
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    outs = [o.name for o in model.graph.output]
    made: dict = {}

    def node_session(k: int, n, env: dict):
        ins = [i for i in dict.fromkeys(n.input) if i]
        key = (k, tuple((env[i].dtype, env[i].ndim) for i in ins))
        if key not in made:
            g = helper.make_graph([n], "node", [helper.make_tensor_value_info(
                i, helper.np_dtype_to_tensor_dtype(env[i].dtype), [None] * env[i].ndim) for i in ins],
                [onnx.ValueInfoProto(name=o) for o in n.output if o])
            m = helper.make_model(g, opset_imports=model.opset_import, ir_version=model.ir_version)
            made[key] = (ins, ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]))
        return made[key]

    def run(feeds: dict) -> list:
        env = {**consts, **feeds}
        for k, n in enumerate(model.graph.node):
            ins, s = node_session(k, n, env)
            env.update(zip([o for o in n.output if o], s.run(None, {i: env[i] for i in ins})))
        return [env[o] for o in outs]
    return run


def _moved(a: np.ndarray) -> np.ndarray:
    """A one-element array's value moved: a float negated, an integer one further from zero, a bool flipped (a
    divisor stays non-zero; a count or index that leaves its range is for the CPU EP to reject)."""
    if a.dtype == np.bool_:
        return np.logical_not(a, out=np.empty_like(a))
    if a.dtype.kind == "f":
        return np.negative(a, out=np.empty_like(a))
    return np.add(a, np.sign(a), out=np.empty_like(a))


def varied_feeds(feeds: dict, k: int) -> dict:
    """``feeds`` with new values of the same shapes and types (seed ``k``): each array's elements shuffled (the
    same values in other places: divisors stay non-zero, indices in range; a shape fed as data may change the
    output's), a one-element array's value moved (``_moved``)."""
    rng = np.random.default_rng(k)
    return {n: rng.permutation(a.reshape(-1)).reshape(a.shape) if a.size > 1 else _moved(a) if a.size else a
            for n, a in feeds.items()}


def check_case(case: Case, options: dict | None = None, calls: int = 1, vary: bool = False) -> Outcome:
    """Run ``case`` on the CPU EP and the MLX EP; raise FuzzFailure when MLX is wrong. ``calls`` > 1: the MLX EP's
    session runs the feeds that many times, every answer checked (after the first, a compiled closure verified
    against eager answers: the compiled path). ``vary``: from the middle call on, every other call's feeds are
    ``varied_feeds`` (new values, same shapes and types: what a closure traced on the first values must not bake);
    a variation the CPU EP rejects is skipped."""
    from .testing import session, unclaimed_ops
    blob = case.model.SerializeToString()
    try:
        reference = case.reference
        if reference is None:
            cpu = session(blob, "CPUExecutionProvider", record=False)
            reference = functools.partial(cpu.run, None)
        want = reference(case.feeds)
    except Exception as e:  # noqa: BLE001 - no reference answer: the CPU EP rejects the model itself
        cpu_err = f"{type(e).__name__}: {str(e)[:200]}"
    else:
        cpu_err = None
    try:
        s = session(blob, options=options)
        got = s.run(None, case.feeds)
    except Exception as e:  # noqa: BLE001
        if cpu_err is not None:
            return Outcome("both_fail", info={"cpu": cpu_err})
        raise FuzzFailure(f"MLX EP failed where the CPU EP succeeded: {type(e).__name__}: {str(e)[:1500]}") from None
    if cpu_err is not None:
        return Outcome("cpu_rejects", info={"cpu": cpu_err})
    n = len(case.model.graph.node)
    left = sum(unclaimed_ops(s).values())
    varied = 0
    for k in range(calls):
        feeds, expect, how = case.feeds, want, ""
        if vary and k >= calls // 2 and (k - calls // 2) % 2 == 0:
            feeds = varied_feeds(case.feeds, k)
            try:
                expect = reference(feeds)
            except Exception:  # noqa: BLE001 - the CPU EP rejects these values: no reference for them
                continue
            how, varied = " (varied feeds)", varied + 1
        if k:
            try:
                got = s.run(None, feeds)
            except Exception as e:  # noqa: BLE001
                raise FuzzFailure(f"call {k + 1}{how}: MLX EP failed after answering: {type(e).__name__}: "
                                  f"{str(e)[:1500]}") from None
        for o, g, w in zip(s.get_outputs(), got, expect):
            _close(np.asarray(g), np.asarray(w), f"call {k + 1}{how}, output {o.name}" if calls > 1
                   else f"output {o.name}")
    return Outcome("ok", claimed=n - left, nodes=n, info={"varied": varied} if vary else {})
