"""A closed NumPy form of a closure's hoisted integer work (genai's attention-mask lengths).

A decode closure's hoisted program (``analysis.hoist_free_work``) is a handful of integer steps on
host values: genai's ``Shape -> Gather -> Cast`` (the total length) and ``ReduceSum -> Sub -> Cast``
(``seqlens_k``). ``Program.host_runner`` runs them through the translators' host forms with a
build's checks, several times slower inside a decode step (the code gone cold between tokens) than the
same arithmetic written out (measured: docs/performance.md, ``hoist_closed_form``). ``closed_form`` resolves each
step once into one NumPy expression over integer values, for the few ops such work uses and
only with constant operands where the op takes them; anything else: None (the generic runner).

The form is checked against the generic runner on its first calls (``checked``): any difference
(value, shape or type) and the closure uses the generic runner from then on.
"""
from __future__ import annotations

import numpy as np

from ..kernels import dtypes as dt
from ..kernels.interpreter import HOST_MAX_ELEMS

#: calls on which ``checked`` runs both forms and compares them
CHECK_CALLS = 2


def _const(prog, name: str):
    """A small integer constant as the generic runner reads it (``Program.host_constants``: NumPy, not the
    MLX copy), or None."""
    v = prog.host_constants.get(name)
    return None if v is None else np.asarray(v)


def _int(t) -> bool:
    return t in dt.INTS


def _step_form(prog, st):
    """(function of the step's one non-constant input, that input's name), or None."""
    op, a, ins = st.node.op_type, st.attrs, st.inputs
    if st.bodies is not None or st.in_containers or st.out_infos or len(st.outputs) != 1:
        return None
    if not all(_int(t) for t in st.out_types) or not all(t is None or _int(t) for t in st.in_types):
        return None
    npt = dt.NUMPY.get(st.out_types[0])
    if npt is None:
        return None
    if op == "Shape" and len(ins) == 1:
        start, end = a.get("start", 0), a.get("end")

        def shape(x):
            return np.array(x.shape[start:end], np.int64)
        return shape, ins[0]
    if op == "Gather" and len(ins) == 2 and a.get("axis", 0) == 0:
        idx = _const(prog, ins[1])
        if idx is None or idx.dtype.kind not in "iu":
            return None

        hi, lo = (int(idx.max()), int(idx.min())) if idx.size else (-1, 0)

        def gather(x):
            if x.ndim != 1 or hi >= x.shape[0] or lo < -x.shape[0]:
                raise IndexError(f"index {idx} for shape {x.shape}")
            return x[idx]
        return gather, ins[0]
    if op == "Cast" and len(ins) == 1 and st.in_types[0] is not None:
        def cast(x):
            return x.astype(npt)
        return cast, ins[0]
    if op == "ReduceSum" and len(ins) == 2 and not a.get("noop_with_empty_axes", 0):
        axes = _const(prog, ins[1])
        if axes is None or axes.ndim != 1 or not axes.size or axes.dtype.kind not in "iu":
            return None
        keep = bool(a.get("keepdims", 1))
        ax = tuple(int(v) for v in axes)

        def reduce_sum(x):
            return np.add.reduce(x, axis=tuple(v + x.ndim if v < 0 else v for v in ax), keepdims=keep, dtype=x.dtype)
        return reduce_sum, ins[0]
    if op in ("Sub", "Add") and len(ins) == 2:
        c = _const(prog, ins[1])
        if c is None or c.dtype.kind not in "iu":
            return None
        f = np.subtract if op == "Sub" else np.add

        def arith(x):
            if x.dtype != c.dtype:
                raise TypeError(f"{op} of {x.dtype} and {c.dtype}")
            return f(x, c)
        return arith, ins[0]
    return None


def closed_form(prog):
    """A runner like ``Program.host_runner``'s (inputs -> value environment, or None: build as usual)
    for a program whose every step has a closed form here, else None."""
    plan = []
    for st in prog.steps:
        form = _step_form(prog, st)
        if form is None:
            return None
        fn, src = form
        plan.append((fn, src, st.outputs[0], dt.NUMPY[st.out_types[0]]))
    names = list(prog.inputs)
    made = {out for _, _, out, _ in plan}
    #: the program inputs the steps read: (name, index); the environment holds only those and the steps' values
    srcs = [(n, names.index(n)) for n in dict.fromkeys(src for _, src, _, _ in plan) if n not in made and n in names]

    def run(inputs: list) -> dict | None:
        if len(inputs) != len(names):
            return None
        env = {}
        for n, k in srcs:           # the steps' own values are small integer NumPy arrays by construction
            x = inputs[k]
            if not isinstance(x, np.ndarray) or x.size > HOST_MAX_ELEMS or x.dtype.kind not in "iu":
                return None
            env[n] = x
        try:
            for fn, src, out, npt in plan:
                v = np.asarray(fn(env[src]))
                env[out] = v if v.dtype == npt else v.astype(npt)
        except Exception:  # noqa: BLE001 - the generic runner (or the build) decides, with its own errors
            return None
        return env
    return run


def checked(fast, generic, names, on_mismatch):
    """``fast`` checked against ``generic`` on its first ``CHECK_CALLS`` calls (the values ``names``:
    equal, same shape and type); after a difference, ``generic`` only (``on_mismatch(why)`` told once)."""
    state = {"left": CHECK_CALLS, "bad": False}

    def run(inputs: list) -> dict | None:
        if state["bad"]:
            return generic(inputs)
        if state["left"] <= 0:
            return fast(inputs)
        want = generic(inputs)
        if want is None:
            return None
        got = fast(inputs)
        state["left"] -= 1
        for n in names:
            g, w = (None if env is None else env.get(n) for env in (got, want))
            w = np.asarray(w)
            if g is None or g.dtype != w.dtype or g.shape != w.shape or not np.array_equal(g, w):
                state["bad"] = True
                on_mismatch(f"the hoisted work's closed form differs on {n!r}: {g!r} vs {w!r}")
                break
        return want
    run.state = state                   # what the checks found (tests read it)
    return run
