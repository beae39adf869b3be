"""A product's row maker folded into the product's step (``cuda_rows``: one kernel for a decode row).

Two folds of a Program's steps, made after the weights are merged and lifted:

- ``swiglu_down_folds``: an MLP's merged gate/up step with its SiLU gating (``merge.swiglu_folds``) and the
  down projection that alone reads the gating: for a decode row the gating is made by the gate/up
  product's kernel when a norm folds into it too (below: ``cuda_rows.norm_gemv(gating=)``, then
  ``cuda_rows.gemv``), else inside the down product's kernel (``cuda_rows.swiglu_gemv``).
- ``norm_folds``: a (Skip)SimplifiedLayerNormalization whose normalized output only one product step
  reads (a QKV or gate/up product, merged or not, the MLP fold above, the LM head): for a decode row the
  norm is made inside that product's kernel (``cuda_rows.norm_gemv``), which also writes the sum output.

Anything else (prompt rows, other layouts, the CPU) runs the folded nodes' own translators in turn: the
same functions as the unfolded steps, so the same values.
"""
from __future__ import annotations

import dataclasses
import functools

from . import cuda_kernels, cuda_rows, merge

MS = "com.microsoft"


def _via_mm(A, W, *, base, mm=None):
    """A plain product step's function taking ``mm`` as the merged ones do."""
    return base(A, W) if mm is None else mm(A, W, base)


def swiglu_down(A, W, W_down, *, width: int, gate_first: bool, down, mm=None, gated_rows: bool = True):
    """``down(gating(A @ W), W_down)``: ``merge.merged_swiglu`` then the down projection's own function.
    For a decode row: the gate/up product's kernel makes the gating when ``mm`` can (``norm_product``'s) and
    ``gated_rows``, then one kernel multiplies that row (``cuda_rows.gemv``); else the down product's kernel
    makes it (every block making the whole gated row)."""
    if mm is not None and gated_rows and cuda_kernels.enabled():
        gated = mm(A, W, gating=(width, gate_first))
        if gated is not None:
            if cuda_rows.row_reason(gated, W_down, width) is None:
                return cuda_rows.gemv(gated, W_down)
            return down(gated, W_down)
    y = (mm or merge.matmul_lifted)(A, W)
    if cuda_kernels.enabled() and cuda_rows.row_reason(y, W_down, width) is None:
        return cuda_rows.swiglu_gemv(y, W_down, width, gate_first)
    return down(merge.swiglu_of(y, width, gate_first), W_down)


class _Row:
    """Stands for the norm's output in a product call until ``mm`` sees it (``norm_product``)."""


def norm_product(*args, n_norm: int, norm, product, skip_form: bool, epsilon: float):
    """The norm step's function over ``args[:n_norm]``, then the product step's over its output and
    ``args[n_norm:]``; returns the product's outputs (and the norm's sum, for the skip form). The norm is
    made inside the product's kernel for a decode row (``cuda_rows.norm_gemv``), else by ``norm``."""
    nin, rest = args[:n_norm], args[n_norm:]
    if skip_form:
        x, skip, gamma = nin[:3]
        bias = nin[3] if n_norm > 3 else None
    else:
        (x, gamma), skip, bias = nin, None, None
    row, made = _Row(), {}

    def normed():
        if "outs" not in made:
            outs = norm(*nin)
            made["outs"] = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        return made["outs"]

    def mm(A, W, base=merge.matmul_lifted, gating=None):
        # gating (width, gate_first): the gated row of a merged gate/up product, or None where not made here
        if A is not row:
            return None if gating else base(A, W)
        if "sum" not in made and cuda_kernels.enabled() and cuda_kernels.rms_norm_reason(x, skip, gamma, bias) is None \
                and cuda_rows.row_reason(x, W, x.shape[-1]) is None:
            y, made["sum"] = cuda_rows.norm_gemv(x, gamma, epsilon, W, skip, bias, gating=gating)
            return y
        return None if gating else base(normed()[0], W)

    res = product(row, *rest, mm=mm)
    res = tuple(res) if isinstance(res, (tuple, list)) else (res,)
    if not skip_form:
        return res
    if "sum" in made:
        return res + (made["sum"],)
    outs = normed()
    return res + (outs[3] if len(outs) > 3 else None,)


def _product(st):
    """The function of a step that multiplies its first input by constant weights, taking ``mm`` (None: not one)."""
    fn = st.opdef.fn
    if isinstance(fn, functools.partial) and fn.func in (merge.merged_matmul, merge.merged_swiglu, swiglu_down):
        return fn
    if st.node.op_type == "MatMul" and st.node.domain in ("", "ai.onnx") and len(st.inputs) == 2 \
            and len(st.outputs) == 1 and not st.opdef.wants_ctx and st.bodies is None:
        return functools.partial(_via_mm, base=fn)
    return None


def _sole_reader(graph, steps, name: str):
    """The index of the one step reading ``name``, once and as its first input, else None (also when a
    control-flow body reads it: ``merge.step_readers``)."""
    if not name or name in graph.outputs:
        return None
    readers = merge.step_readers(graph, steps).get(name, [])
    if len(readers) != 1:
        return None
    k = next((k for k, st in enumerate(steps) if st is readers[0]), None)
    return k if k is not None and steps[k].inputs[0] == name else None


def _fused(steps, k: int, p: int, fn, inputs: list, outputs: list, out_types: list):
    """``steps`` with step ``k`` replaced by one step of ``fn`` (the product ``p``'s node and opdef) and ``p`` gone."""
    st = steps[p]
    opdef = dataclasses.replace(st.opdef, fn=fn, wants_ctx=False, host=None, const_inputs=frozenset())
    types = {**dict(zip(steps[k].inputs, steps[k].in_types)), **dict(zip(st.inputs, st.in_types))}
    new = dataclasses.replace(st, opdef=opdef, inputs=inputs, outputs=outputs, attrs={}, out_types=out_types,
                              in_types=[types.get(i) for i in inputs], ctx=None)
    return [new if j == k else s for j, s in enumerate(steps) if j != p]


def swiglu_down_folds(graph, steps, weights: set, gated_rows: bool = True) -> list:
    """``steps`` with each merged SiLU-gating step and the down product that alone reads it (its weight in
    ``weights``, the constants) made one ``swiglu_down`` step, in the gating step's place (``gated_rows``:
    ``swiglu_down``'s)."""
    k = 0
    while k < len(steps):
        st = steps[k]
        fn = st.opdef.fn
        p = None
        if isinstance(fn, functools.partial) and fn.func is merge.merged_swiglu and len(st.outputs) == 1:
            p = _sole_reader(graph, steps, st.outputs[0])
        down = _product(steps[p]) if p is not None and p > k else None
        if down is not None and isinstance(down, functools.partial) and down.func is _via_mm \
                and steps[p].inputs[1] in weights:
            f = functools.partial(swiglu_down, width=fn.keywords["width"], gate_first=fn.keywords["gate_first"],
                                  down=down.keywords["base"], gated_rows=gated_rows)
            steps = _fused(steps, k, p, f, st.inputs + [steps[p].inputs[1]], list(steps[p].outputs),
                           list(steps[p].out_types))
        k += 1
    return steps


def norm_folds(graph, steps, weights: set) -> list:
    """``steps`` with each (Skip)SimplifiedLayerNormalization over the last axis (no mean / inv_std output,
    gamma and bias constants) and the one product step reading its normalized output (weights in
    ``weights``) made one ``norm_product`` step, in the norm's place."""
    k = 0
    while k < len(steps):
        st = steps[k]
        node = st.node
        skip_form = node.op_type == "SkipSimplifiedLayerNormalization" and node.domain == MS and not any(st.outputs[1:3])
        simple = node.op_type == "SimplifiedLayerNormalization" and node.domain in ("", "ai.onnx") \
            and len(st.outputs) == 1 and st.attrs.get("stash_type", 1) == 1 \
            and st.attrs.get("axis", -1) in (-1, (graph.value(st.inputs[0]).rank or 0) - 1)
        params = st.inputs[2:] if skip_form else st.inputs[1:]
        p = None
        if (skip_form or simple) and all(i in graph.constants for i in params if i) and all(st.inputs[:1]):
            p = _sole_reader(graph, steps, st.outputs[0])
        prod = _product(steps[p]) if p is not None and p > k else None
        if prod is not None and all(w in weights for w in steps[p].inputs[1:] if w):
            ins = list(st.inputs)
            while ins and not ins[-1]:
                ins.pop()
            norm = functools.partial(st.opdef.fn, **st.attrs, **({"ctx": st.ctx} if st.opdef.wants_ctx else {}))
            f = functools.partial(norm_product, n_norm=len(ins), norm=norm, product=prod, skip_form=skip_form,
                                  epsilon=float(st.attrs.get("epsilon", 1e-12 if skip_form else 1e-5)))
            outs, types = list(steps[p].outputs), list(steps[p].out_types)
            if skip_form:
                outs.append(st.outputs[3] if len(st.outputs) > 3 else "")
                types.append(st.out_types[3] if len(st.outputs) > 3 else None)
            steps = _fused(steps, k, p, f, ins + list(steps[p].inputs[1:]), outs, types)
        k += 1
    return steps
