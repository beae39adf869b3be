"""The graph rewrites a group's program is built with: ``run(graph, steps, config)`` applies each pass in turn.

A ``Step`` is one resolved node (its translator, inputs, outputs, types). The program (``interpreter.Program``)
first makes one step per node, then the passes rewrite the list; each keeps every output's value and only
changes how it is computed (fewer, larger kernels; weights stored as the fast product wants them):

============== ======================================================== =====================================
pass           what                                                     on by default
============== ======================================================== =====================================
merge_siblings sibling MatMuls reading one A: one product (``merge``)   GPU with device constants
fold_mlp       an MLP's SiLU gating made by its merged gate/up step      GPU with the custom CUDA kernels
fold_qkv_bias  a packed QKV's bias Add folded into GroupQueryAttention   GPU with the custom CUDA kernels
lift_weights   3-D products' weights stored [1, K, N] (one MLX node)     always
widen_weights  half MatMul weights kept in float32 (the BLAS's sgemm)    MLX's CPU backend
dense_nbits    MatMulNBits weights dequantized to float32 once           MLX's CPU backend
fuse_rows      a decode row's norm / gating made in the next product     GPU with the custom CUDA kernels
============== ======================================================== =====================================

Before the passes (``half_dense_nbits``: GPU with the custom CUDA kernels, while the weights fit), half-precision
MatMulNBits become MatMuls over their weights dequantized once to the half type (``merge.nbits_as_matmuls``),
so the passes above treat an int4 model as its fp16 form.

``BuildConfig.for_device`` resolves the defaults (and the ``Tuning`` knobs that switch them); a pass is a
function ``(Rewrite, BuildConfig) -> None`` testable on a hand-made graph.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from ..errors import KernelError
from ..ir import outer_refs
from ..tuning import Tuning
from .ops.conv import GEMM_FORMS
from . import dtypes as dt
from . import cuda_kernels, cuda_rows, merge, rowfold
from .build import BuildContext
from .registry import REGISTRY, Ctx, OpDef


@dataclass
class Step:
    node: Any
    opdef: OpDef
    inputs: list[str]
    outputs: list[str]
    attrs: dict
    out_types: list[int | None]
    in_types: list[int | None]
    ctx: Ctx | None
    in_containers: frozenset[int] = frozenset()      # inputs that are sequence/optional values (passed as is)
    out_infos: tuple = ()                            # outputs' ValueInfo when the step touches containers
    bodies: dict | None = None       # control flow: graph attribute -> (nested Program, outer names it reads)


def resolve(graph, node, inputs: list[str], types: dict, device: str, nested: Callable) -> Step:
    """The step of ``node`` reading ``inputs`` (its own, or a pass's); ``nested(body graph)`` makes a control-flow
    body's program."""
    opdef = REGISTRY.resolve(node.domain, node.op_type, node.since_version)
    if opdef is None:
        raise KernelError(f"{node.label}: no translator (since_version {node.since_version})")
    out_types = [types.get(o) if o else None for o in node.outputs]
    in_types = [types.get(i) if i else None for i in inputs]
    opdef = opdef.for_types(in_types)
    ctx = Ctx(node, out_types, in_types, device, len(node.outputs)) if opdef.wants_ctx else None
    bodies = {attr: (nested(g), outer_refs(g)) for attr, g in node.subgraphs.items()} if opdef.control else None
    conts = frozenset(k for k, i in enumerate(inputs) if i and not graph.value(i).is_tensor)
    infos = tuple(graph.value(o) if o else None for o in node.outputs) if opdef.containers else ()
    return Step(node, opdef, list(inputs), list(node.outputs), dict(node.attrs), out_types, in_types, ctx, conts,
                infos, bodies)


@dataclass(frozen=True)
class BuildConfig:
    """Which passes a program is built with (``for_device``: the defaults, resolved)."""
    device: str = "cpu"
    #: builds may use the custom CUDA kernels (``cuda_kernels.py``; a GPU of MLX's CUDA backend)
    cuda_kernels: bool = False
    #: constants copied into device memory once, MatMul weights column-major (GPU)
    device_constants: bool = False
    merge_matmuls: bool = False
    fold_mlp: bool = False
    fold_qkv_bias: bool = False
    #: a half-precision MatMul and its bias Add as one product rounded once (``fold_bias``)
    fold_bias: bool = False
    lift_weights: bool = True
    widen_weights: bool = False
    dense_nbits: bool = False
    #: half MatMulNBits as MatMuls over weights dequantized once to the half type (``merge.nbits_as_matmuls``)
    half_dense_nbits: bool = False
    fuse_rows: bool = False
    #: fuse_rows also folds the MLP's gating into the down product
    gated_rows: bool = True
    #: a compiled decode's row hints written by their kernel into page-locked host memory (compiled/core.py)
    pinned_hints: bool = False
    #: results of ``cuda_kernels.DIRECT_MIN`` bytes or more written into ORT's buffers by the runtime, not through
    #: a closure's page-locked buffer (``runtime/devread.py``)
    direct_out: bool = False
    #: a half-precision prompt's attention through MLX's fused kernel (``BuildContext.fused_attention``)
    fused_attention: bool = False
    #: the least power-of-two prompt bucket that takes it (``BuildContext.fused_attention_min``)
    fused_attention_min: int = 1
    #: shorter prompts' attention in one custom kernel (``BuildContext.prompt_kernel``)
    prompt_kernel: bool = True
    #: Gathers by ``cuda_kernels.take_rows`` (``BuildContext.take_rows``)
    take_rows: bool = False
    #: decode rows' MatMuls by ``cuda_rows.gemv`` (``BuildContext.row_products``; with tuning ``replay``)
    row_products: bool = False
    #: a first prompt's queries and presents from one kernel (``BuildContext.prompt_rope``)
    prompt_rope: bool = False
    #: a batch's lengths out of MLX's pool of small arrays (``BuildContext.unpooled``)
    unpooled: bool = False
    #: half-precision MatMulNBits products (``BuildContext.half_nbits``)
    half_nbits: bool = False
    #: float32 Exp and Sigmoid through ``fastmath``'s polynomial exp (``BuildContext.poly_exp``)
    poly_exp: bool = False
    #: the forms of 2-D convolution run as products over shifted input views (``BuildContext.conv_gemm``)
    conv_gemm: frozenset = frozenset()
    #: the least batch at which they do (``BuildContext.conv_gemm_batch``)
    conv_gemm_batch: int = 1
    #: kernels a call would wait for built on a background thread (``BuildContext.build_behind``)
    build_behind: bool = True
    #: most rows the row kernels take (``BuildContext.row_limit``)
    row_limit: int = 1

    @classmethod
    def for_device(cls, device: str, tuning: Tuning | None = None, **overrides) -> "BuildConfig":
        """The defaults for ``device`` with ``tuning``'s knobs, then ``overrides`` (a field: a value, or None for
        the default)."""
        t = tuning or Tuning()
        gpu = device == "gpu"
        conv = overrides.get("conv_gemm", t.conv_gemm)
        kernels = bool(overrides.get("cuda_kernels", t.cuda_kernels)) and gpu
        devc = bool(overrides.get("device_constants", t.device_constants))

        def pick(name: str, knob, default):
            v = overrides.get(name)
            if v is not None:
                return bool(v)
            return default if knob is None else bool(knob)
        prompt = pick("prompt_kernel", t.prompt_kernel, True)
        return cls(device=device, cuda_kernels=kernels, device_constants=devc,
                   merge_matmuls=pick("merge_matmuls", None, devc and gpu),
                   fold_mlp=pick("fold_mlp", None if t.fold_mlp else False, kernels),
                   fold_qkv_bias=pick("fold_qkv_bias", None, kernels),
                   fold_bias=pick("fold_bias", t.fold_bias, device == "cpu"),
                   lift_weights=pick("lift_weights", t.lift_weights, True),
                   widen_weights=pick("widen_weights", t.widen_weights, device == "cpu"),
                   dense_nbits=pick("dense_nbits", t.dense_nbits, device == "cpu"),
                   half_dense_nbits=pick("half_dense_nbits", t.half_dense_nbits, kernels and devc),
                   fuse_rows=pick("fuse_rows", None if t.fuse_rows else False, kernels),
                   gated_rows=pick("gated_rows", t.gated_rows, True),
                   pinned_hints=bool(overrides.get("pinned_hints", t.pinned_hints)) and kernels,
                   direct_out=bool(overrides.get("direct_out", t.direct_out)) and kernels,
                   fused_attention=pick("fused_attention", t.fused_attention, gpu),
                   fused_attention_min=_pow2_at_least(int(
                       overrides.get("fused_attention_min") or t.fused_attention_min
                       or _least_fused(kernels, prompt))),
                   prompt_kernel=prompt,
                   take_rows=pick("take_rows", t.take_rows, True) and kernels,
                   row_products=pick("row_products", t.replay, False) and kernels,
                   prompt_rope=pick("prompt_rope", t.prompt_rope, True) and kernels,
                   unpooled=pick("unpooled", t.unpooled_lengths, True) and gpu,
                   half_nbits=pick("half_nbits", t.half_nbits, gpu),
                   poly_exp=pick("poly_exp", t.poly_exp, device == "cpu"),
                   conv_gemm=_conv_forms(conv, gpu),
                   conv_gemm_batch=GPU_CONV_GEMM_BATCH if gpu and conv is None else 1,
                   build_behind=pick("build_behind", t.build_behind, True),
                   row_limit=min(cuda_rows.ROWS_MAX,
                                 int(overrides.get("row_limit") or t.batch_rows or cuda_rows.ROWS_DEFAULT)))

    def context(self, **fields) -> BuildContext:
        """A build's context: this config's choices for translators (every ``BuildContext`` field of the same name),
        then ``fields`` (the build's own)."""
        return BuildContext(**{**{n: getattr(self, n) for n in _CONTEXT_CHOICES}, **fields})


#: the ``BuildConfig`` fields a build's context carries (``BuildConfig.context``)
_CONTEXT_CHOICES = tuple(f.name for f in dataclasses.fields(BuildContext)
                         if f.name in {g.name for g in dataclasses.fields(BuildConfig)})


#: the shortest prompt bucket whose attention takes MLX's fused kernel (cuDNN's on CUDA) by default: cuDNN builds a
#: graph for every new length (0.5-0.7 s for lengths up to 151 on a host's first sight of the shape), where the
#: float32 ops take milliseconds, no slower warm up to 128 tokens and slower from 512 (docs/performance.md)
FUSED_ATTENTION_MIN = 256
#: the same where shorter prompts take our kernel (MLX's CUDA backend, ``prompt_kernel``): at 256 tokens it ran as
#: fast as cuDNN warm and its first call after the first prompt took 84-92 ms against cuDNN's 150-490 (an H100,
#: 2026-12-06); at 512 it was slower (docs/performance.md)
CUDA_FUSED_ATTENTION_MIN = 512


def _least_fused(kernels: bool, prompt_kernel: bool) -> int:
    """The default least fused bucket: ``CUDA_FUSED_ATTENTION_MIN`` where our prompt kernel takes the shorter ones."""
    return CUDA_FUSED_ATTENTION_MIN if kernels and prompt_kernel and cuda_kernels.cuda_backend() else \
        FUSED_ATTENTION_MIN


#: on a GPU, by default, convolutions of batches this large run as products: MLX 0.32.4's CUDA convolution (float32,
#: TF32 off) made illegal memory accesses at batch 4-8 (never at 1-2), and at batch 1 the products were slower
#: (docs/general_models.md)
GPU_CONV_GEMM_BATCH = 4


def _pow2_at_least(n: int) -> int:
    """``n`` rounded up to a power of two of at least 32: every prompt length a padded bucket serves (16, 32, ...)
    then falls on the bucket's side of it (``build.fused_attention``)."""
    return max(32, 1 << (n - 1).bit_length())


def _conv_forms(knob, gpu: bool) -> frozenset:
    """``conv_gemm``'s forms: all (on), none (off), else the device's: on the CPU the 1x1, depthwise and shifted forms
    (faster there than MLX's convolution; im2col is slower); on the GPU all but shifted (not yet measured there),
    from ``GPU_CONV_GEMM_BATCH``."""
    if knob is None:
        return GEMM_FORMS - {"shifted"} if gpu else frozenset({"pointwise", "depthwise", "shifted"})
    return GEMM_FORMS if knob else frozenset()


@dataclass
class Rewrite:
    """What the passes rewrite: the steps, the value types, and the weights as the program will hold them."""
    graph: Any
    steps: list
    types: dict
    #: weights the passes made (a merged product's), name -> NumPy array
    made: dict = field(default_factory=dict)
    #: weights made on the device (dense MatMulNBits), name -> evaluated MLX array
    made_mx: dict = field(default_factory=dict)
    #: constants no step reads any more (their merged or dequantized forms are read instead)
    gone: set = field(default_factory=set)
    #: weights stored [1, K, N] / widened to float32
    lifted: set = field(default_factory=set)
    widened: set = field(default_factory=set)
    #: the sibling groups ``merge_siblings`` merged
    groups: list = field(default_factory=list)
    #: bytes one value may take (MLX's memory limit): copies that would crowd it are not made
    memory_cap: int = 1 << 62
    #: makes a control-flow body's program (``resolve``'s ``nested``)
    nested: Callable | None = None

    def weights(self) -> set:
        """Names of every constant weight a step may read (the graph's and the made ones; not group inputs)."""
        return (set(self.graph.constants) | set(self.made)) - set(self.graph.inputs)


def merge_siblings(r: Rewrite, cfg: BuildConfig) -> None:
    r.groups = merge.sibling_groups(r.graph)
    if not r.groups:
        return
    at = {id(st.node): k for k, st in enumerate(r.steps)}
    later = {id(n) for g in r.groups for n in g[1:]}
    for g in r.groups:
        name = merge.merged_name(g)
        r.made[name] = merge.merged_weight(r.graph, g)
        r.types[name] = r.types.get(g[0].inputs[1])
        r.gone |= {n.inputs[1] for n in g}
        k = at[id(g[0])]
        st = r.steps[k]
        outs = [n.outputs[0] for n in g]
        opdef = dataclasses.replace(st.opdef, fn=merge.merged_fn(r.graph, g), wants_ctx=False)
        r.steps[k] = Step(st.node, opdef, [g[0].inputs[0], name], outs, {}, [r.types.get(o) for o in outs],
                          [r.types.get(g[0].inputs[0]), r.types.get(name)], None)
    r.steps = [st for st in r.steps if id(st.node) not in later]


def fold_mlp(r: Rewrite, cfg: BuildConfig) -> None:
    # keyed by each merged gate/up group's first MatMul: its step is the merged product
    swiglus = merge.swiglu_folds(r.graph, r.groups)
    if not swiglus:
        return
    folded = {i for _, _, ids in swiglus.values() for i in ids}
    for k, st in enumerate(r.steps):
        sw = swiglus.get(id(st.node))
        if sw is not None:
            fn = functools.partial(merge.merged_swiglu, width=int(r.graph.constants[st.node.inputs[1]].shape[1]),
                                   gate_first=sw[0])
            r.steps[k] = dataclasses.replace(st, opdef=dataclasses.replace(st.opdef, fn=fn), outputs=[sw[1]],
                                             out_types=[r.types.get(sw[1])])
    r.steps = [st for st in r.steps if id(st.node) not in folded]


def fold_qkv_bias(r: Rewrite, cfg: BuildConfig) -> None:
    folds = merge.qkv_bias_folds(r.graph)
    if not folds:
        return
    adds = {id(add) for add, _, _ in folds.values()}
    for k, st in enumerate(r.steps):
        f = folds.get(id(st.node))
        if f is not None:
            _, x, bias = f
            ins = [x] + list(st.node.inputs[1:]) + [""] * (merge.QKV_BIAS_INPUT - len(st.node.inputs)) + [bias]
            r.steps[k] = resolve(r.graph, st.node, ins, r.types, cfg.device, r.nested)
    r.steps = [st for st in r.steps if id(st.node) not in adds]


def fold_bias(r: Rewrite, cfg: BuildConfig) -> None:
    folds = merge.bias_product_folds(r.graph, r.types)
    if not folds:
        return
    folded, present = set(), {id(st.node) for st in r.steps}
    for k, st in enumerate(r.steps):
        f = folds.get(id(st.node))
        if f is None or id(f[0]) not in present or st.inputs != list(st.node.inputs) or \
                st.outputs != list(st.node.outputs):
            continue                                # (a merged product, or an Add folded elsewhere: both stay)
        add, bias = f
        r.steps[k] = dataclasses.replace(
            st, inputs=list(st.inputs) + [bias], outputs=list(add.outputs), out_types=[r.types.get(add.outputs[0])],
            in_types=list(st.in_types) + [r.types.get(bias)],
            opdef=dataclasses.replace(st.opdef, fn=merge.matmul_bias, wants_ctx=False), ctx=None)
        folded.add(id(add))
    r.steps = [st for st in r.steps if id(st.node) not in folded]


def lift_weights(r: Rewrite, cfg: BuildConfig) -> None:
    shapes = {k: np.shape(v) for k, v in list(r.graph.constants.items()) + list(r.made.items())}
    r.lifted = merge.lifted_weights(r.graph, r.steps, shapes)


def widen_weights(r: Rewrite, cfg: BuildConfig) -> None:
    widened = merge.widened_weights(r.graph, r.steps, r.types, dt.name)
    # the float32 copies take twice the half weights' bytes: not when that would crowd the memory MLX may use
    if sum(2 * np.asarray(r.graph.constants[k]).nbytes for k in widened) <= r.memory_cap // 4:
        r.widened = widened


def dense_nbits(r: Rewrite, cfg: BuildConfig) -> None:
    dense = merge.dense_nbits(r.graph, r.steps)
    if sum(4 * a["N"] * a["K"] for _, a, _ in dense.values()) > r.memory_cap // 4:
        return                          # the float32 weights would crowd MLX's memory
    for k, (packed, a, private) in dense.items():
        st = r.steps[k]
        names = list(st.inputs) + [""] * (6 - len(st.inputs))
        name = f"{packed}::dense"
        with mx.stream(mx.gpu if cfg.device == "gpu" else mx.cpu):
            r.made_mx[name] = merge.nbits_weight(r.graph, names, a)
        r.gone |= private
        r.types[name] = dt.FLOAT
        r.steps[k] = dataclasses.replace(
            st, inputs=[names[0], name, "", "", "", names[5]], in_types=[st.in_types[0], dt.FLOAT],
            opdef=dataclasses.replace(st.opdef, fn=merge.matmul_dense_nbits, wants_ctx=False))


def route_matmuls(r: Rewrite, cfg: BuildConfig) -> None:
    """Plain MatMul steps over a lifted or widened weight multiply through ``merge.matmul_lifted`` (a merged
    step does itself)."""
    for i, st in enumerate(r.steps):
        if len(st.inputs) == 2 and (st.inputs[1] in r.lifted or st.inputs[1] in r.widened) \
                and st.node.op_type == "MatMul" and len(st.outputs) == 1 and st.inputs[1] not in r.made:
            r.steps[i] = dataclasses.replace(st, opdef=dataclasses.replace(st.opdef, fn=merge.matmul_lifted))


def fuse_rows(r: Rewrite, cfg: BuildConfig) -> None:
    weights = r.weights()
    r.steps = rowfold.swiglu_down_folds(r.graph, r.steps, weights, cfg.gated_rows)
    r.steps = rowfold.norm_folds(r.graph, r.steps, weights)


#: (pass, whether the config runs it), in order
PASSES: list[tuple[Callable, Callable]] = [
    (merge_siblings, lambda c: c.merge_matmuls),
    (fold_qkv_bias, lambda c: c.fold_qkv_bias),
    (fold_mlp, lambda c: c.fold_mlp and c.merge_matmuls),
    (fold_bias, lambda c: c.fold_bias),
    (lift_weights, lambda c: c.lift_weights),
    (widen_weights, lambda c: c.widen_weights),
    (dense_nbits, lambda c: c.dense_nbits),
    (route_matmuls, lambda c: True),
    (fuse_rows, lambda c: c.fuse_rows),
]


def run(r: Rewrite, cfg: BuildConfig) -> Rewrite:
    """Every pass the config turns on, in order, over ``r``."""
    for fn, on in PASSES:
        if on(cfg):
            fn(r, cfg)
    return r
