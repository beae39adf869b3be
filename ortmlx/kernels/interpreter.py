"""The eager interpreter: resolve a plan once, then per call build the lazy MLX
graph of the whole group and evaluate it once.

Values live either on the host (numpy: group inputs as ORT hands them, small
integer shape math, constant inputs a translator reads on the host) or in MLX.
A host value is copied into MLX the first time a device op needs it.
"""
from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import KernelError
from .. import ir
from . import build, consts, cuda_cache, cuda_rows, merge, passes
from . import cuda_kernels as ck
from . import dtypes as dt
from .build import BuildContext
from .ops import conv
from .passes import BuildConfig, Rewrite, Step, resolve
from .registry import OpDef

#: host evaluation is for shape math: integer/bool tensors up to this many elements
HOST_MAX_ELEMS = 4096


def _memory_cap() -> int:
    """Bytes one value may take: MLX's memory limit (else physical memory).

    MLX's CPU allocator does not check for failure: an allocation the machine
    cannot back crashes the process. A value larger than this is refused first.
    """
    try:
        cap = int(mx.get_memory_limit())
    except Exception:  # noqa: BLE001
        cap = 0
    if cap <= 0:
        try:
            import os
            cap = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            cap = 1 << 40
    return cap


MAX_VALUE_BYTES = _memory_cap()


def too_big(label: str, j: int, name: str, v) -> str:
    return (f"{label}: output {j} ('{name}') of shape {tuple(v.shape)} {v.dtype} would take "
            f"{v.nbytes / 2**30:.1f} GiB, more than the {MAX_VALUE_BYTES / 2**30:.1f} GiB MLX may allocate here")


def host_evaluable(opdef: OpDef, out_types: list[int | None], inputs_host: list[bool]) -> bool:
    """Whether a node runs on the host (numpy) given which of its inputs are host values.

    Shared by the partitioner (at claim time) and the interpreter (per call).
    """
    if opdef.host is None:
        return False
    if not all(t in dt.INTS or t == dt.BOOL for t in out_types if t is not None) or not out_types:
        return False
    if opdef.shape_only:
        return True
    return all(inputs_host)


def mx_device(device: str):
    return mx.gpu if device == "gpu" else mx.cpu


def mlx_gpu_available() -> bool:
    """MLX has a GPU here (CUDA on Linux, Metal on macOS)."""
    for backend in ("cuda", "metal"):
        mod = getattr(mx, backend, None)
        try:
            if mod is not None and mod.is_available():
                return True
        except Exception:  # noqa: BLE001 - a backend that cannot even answer is not available
            pass
    return False


class Body:
    """A control-flow body bound to the outer-scope values it reads: ``body(*inputs)`` -> its outputs.

    Runs the body's nested ``Program`` lazily (no evaluation); outputs are mx arrays or host (numpy) values.
    """

    def __init__(self, program: "Program", outer: dict[str, Any]):
        self.program = program
        self.outer = outer

    @property
    def n_inputs(self) -> int:
        return len(self.program.inputs)

    @property
    def n_outputs(self) -> int:
        return len(self.program.outputs)

    def __call__(self, *inputs) -> list[Any]:
        env = dict(self.outer)
        env.update(self.program.constants)
        env.update(self.program.host_constants)
        env = self.program.build(list(inputs), env)
        return [env[o] for o in self.program.outputs]


class Program:
    """A fused group resolved once: a step per node (``passes.resolve``), the graph rewrites its ``BuildConfig``
    turns on (``passes.run``), and its constants loaded into MLX; ``run``/``build`` evaluate it per call."""

    def __init__(self, graph, device: str = "cpu", config: BuildConfig | None = None, upload: dt.Upload = dt.to_mx,
                 **overrides):
        """``config``: the passes (default: ``BuildConfig.for_device(device, **overrides)``; an override is a
        ``BuildConfig`` field, e.g. ``merge_matmuls=True``, and None keeps the default). ``upload``: how host arrays
        (call inputs, constants) become MLX arrays (the runtime's staged copy on a GPU, ``runtime/upload.py``)."""
        cfg = config or BuildConfig.for_device(device, **overrides)
        source = graph
        if cfg.half_dense_nbits:
            # at most a quarter of what MLX may hold, as dense_nbits
            graph = merge.nbits_as_matmuls(graph, min(merge.HALF_DENSE_MAX, MAX_VALUE_BYTES // 4), device) or graph
        self.graph = graph
        self.device = device
        self.config = cfg
        self.upload = upload
        #: builds may use ``kernels/cuda_kernels.py`` (on a GPU of MLX's CUDA backend)
        self.cuda_kernels = cfg.cuda_kernels
        #: a compiled decode's row hints written by their kernel into page-locked host memory (compiled/core.py)
        self.pinned_hints = cfg.pinned_hints
        #: results of ``cuda_kernels.DIRECT_MIN`` bytes or more go to ORT's buffers from the runtime (devread.py)
        self.direct_out = cfg.direct_out
        self.inputs = list(graph.inputs)
        self.outputs = list(graph.outputs)
        self.types = {n: v.dtype for n, v in graph.values.items()}

        def nested(body):
            return Program(body, device)
        steps = [resolve(graph, node, list(node.inputs), self.types, device, nested) for node in graph.nodes]
        r = passes.run(Rewrite(graph, steps, self.types, memory_cap=MAX_VALUE_BYTES, nested=nested), cfg)
        self.steps: list[Step] = r.steps
        conv_w = conv.weights(graph) - r.lifted - set(r.made) - set(r.made_mx)

        def stored(k, v):
            if k in r.lifted:
                return v.reshape((1,) + v.shape)
            return np.ascontiguousarray(conv.to_channels_last(v)) if k in conv_w else v
        with mx.stream(mx_device(device)):
            constants_mx = {k: upload(stored(k, v), self.types.get(k) or dt.FROM_NUMPY[v.dtype])
                            for k, v in list(graph.constants.items()) + list(r.made.items())
                            if k not in set(self.inputs) and k not in r.gone}
            for k in r.widened:
                if k in constants_mx:
                    constants_mx[k] = constants_mx[k].astype(mx.float32)
            constants_mx.update(r.made_mx)
            mx.eval(*constants_mx.values())
            if cfg.device_constants and device == "gpu":
                made = dt.device_copies(constants_mx, self._matmul_weights(graph) |
                                        {merge.merged_name(g) for g in r.groups})
                cuda_rows.register_col_major(constants_mx[k] for k in made)
                consts.roomy_all(constants_mx)          # scalars: out of MLX's pool of small arrays
            for k in conv_w & constants_mx.keys():      # uploaded channels-last: back to ONNX's axes, as a view
                constants_mx[k] = conv.to_channels_first(constants_mx[k])
        self.constants = constants_mx
        consts.register(constants_mx.values())     # their casts are made once (consts.cast)
        #: small integer/bool constants also live on the host, so shape math on them stays there
        self.host_constants = {k: np.array(v) for k, v in graph.constants.items()
                               if k in constants_mx and v.size <= HOST_MAX_ELEMS
                               and dt.FROM_NUMPY.get(np.asarray(v).dtype) in dt.INTS | {dt.BOOL}
                               and self.types.get(k) != dt.BFLOAT16 and self.types.get(k) not in dt.CARRIERS}
        if graph is not source:
            # the half weights nbits_as_matmuls made live on the device now: their host copies go (nothing
            # after the build reads a program's graph constants)
            for k in set(graph.constants) - set(source.constants):
                graph.constants[k] = np.empty((0,) * np.ndim(graph.constants[k]), graph.constants[k].dtype)

    @staticmethod
    def _matmul_weights(graph) -> frozenset:
        """Constants that are the 2-D B of an ai.onnx MatMul (kept column-major on a GPU: ``dtypes.device_copies``)."""
        return frozenset(n.inputs[1] for n in graph.nodes
                         if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") and len(n.inputs) > 1
                         and n.inputs[1] in graph.constants and np.ndim(graph.constants[n.inputs[1]]) == 2)

    # ------------------------------------------------------------------ per call
    def run(self, inputs: list[np.ndarray | None], probe=None) -> list[Any]:
        """Evaluate the group on host inputs; returns evaluated mx arrays or numpy arrays.

        A run that fails with the custom CUDA kernels is run again without them; when that succeeds the
        kernels are turned off for the process (``cuda_kernels.disable``), else the first error is raised."""
        kernels = self.cuda_kernels and ck.usable()
        try:
            return self._run(inputs, probe, kernels)
        except Exception as e:
            if not kernels:
                raise
            try:
                out = self._run(inputs, None, False)
            except Exception:
                raise e from None
            ck.disable(f"{type(e).__name__}: {e}")
            return out

    def _run(self, inputs: list, probe, kernels: bool) -> list[Any]:
        with mx.stream(mx_device(self.device)):
            if probe is not None:
                probe.mark("build")
            env = self.build(inputs, kernels=kernels)
            results = [env[o] for o in self.outputs]
            lazy = [r for r in results if isinstance(r, mx.array)]
            if probe is not None:
                probe.mark("eval")
            if lazy:
                mx.eval(*lazy)
        return results

    def build(self, inputs: list[Any], env: dict | None = None, host_extra: dict | None = None,
              kernels: bool | None = None, ctx: BuildContext | None = None) -> dict[str, Any]:
        """Build the lazy graph: returns name -> value for every value of the group.

        ``host_extra``: op type -> a NumPy form used for this build like a registered host form
        (integer outputs, every input a host value). ``ctx``: the build's context (a trace passes its own);
        by default a fresh one, the custom CUDA kernels allowed per ``kernels`` (default: when the program
        asked for them and they are usable)."""
        if ctx is not None:                 # (a trace's: it waits for the kernel builds when it ends)
            with build.active(ctx):
                return self._build(inputs, env, host_extra, ctx)
        if kernels is None:
            kernels = self.cuda_kernels and ck.usable()
        ctx = self.config.context(cuda_kernels=kernels)
        with build.active(ctx):
            env = self._build(inputs, env, host_extra, ctx)
        cuda_cache.settle()                 # the build's kernel builds, run at once, done before its eval
        return env

    def _build(self, inputs: list[Any], env: dict | None, host_extra: dict | None, ctx: BuildContext) -> dict[str, Any]:
        if env is None:
            env = dict(self.constants)
            env.update(self.host_constants)
        if len(inputs) != len(self.inputs):
            raise KernelError(f"expected {len(self.inputs)} inputs, got {len(inputs)}")
        for name, a in zip(self.inputs, inputs):
            env[name] = a
        dev: dict[str, mx.array] = {}       # device copies of host values, made once per call
        for st in self.steps:
            od = st.opdef
            args = []
            host_flags = []
            for i, name in enumerate(st.inputs):
                if not name:
                    args.append(None)
                    host_flags.append(True)
                    continue
                v = env[name]
                is_host = not isinstance(v, mx.array)
                host_flags.append(is_host)
                args.append(v)
            host_fn = od.host or (_extra_host_form(st, host_extra) if all(host_flags) else None)
            if od.host is None and host_fn is not None:
                on_host = True
            else:
                on_host = host_evaluable(od, st.out_types, host_flags)
            on_host = on_host and \
                all(a is None or not isinstance(a, np.ndarray) or a.size <= HOST_MAX_ELEMS for a in args)
            attrs = st.attrs if st.bodies is None else self._bind_bodies(st, env)
            try:
                if on_host:
                    if not od.shape_only:
                        args = [None if a is None else np.asarray(a) for a in args]
                    out = host_fn(*args, **attrs)
                else:
                    for i, a in enumerate(args):
                        if a is None or i in st.in_containers:
                            continue
                        if i in od.const_inputs:
                            if isinstance(a, mx.array):
                                args[i] = dt.to_numpy(a)       # forces evaluation: eager only
                        elif not isinstance(a, mx.array):
                            args[i] = self._device_copy(st.inputs[i], a, dev)
                    out = od.fn(*args, **attrs, ctx=st.ctx) if od.wants_ctx else od.fn(*args, **attrs)
            except KernelError as e:
                if st.bodies is None:
                    raise
                raise KernelError(f"{st.node.label}: {e}") from e      # a body node failed: name both
            except Exception as e:
                raise KernelError(f"{st.node.label}: {type(e).__name__}: {e}") from e
            if st.out_infos:
                self._store_container_outputs(st, out, env)
                continue
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for j, name in enumerate(st.outputs):
                if not name:
                    continue
                if j >= len(outs) or outs[j] is None:
                    raise KernelError(f"{st.node.label}: translator produced no output {j} ('{name}')")
                v = env[name] = _as_type(outs[j], st.out_types[j])
                if isinstance(v, mx.array):
                    if v.nbytes > MAX_VALUE_BYTES:
                        raise KernelError(too_big(st.node.label, j, name, v))
                    if v.size == 0 and not ctx.shapeless:
                        # an empty value holds nothing: a fresh one cuts the graph that made it, which MLX
                        # 0.32.4's CPU backend can hang evaluating (InstanceNormalization over no positions)
                        env[name] = mx.zeros(v.shape, v.dtype)
        return env

    def host_runner(self, host_extra: dict | None = None):
        """A NumPy-only form of ``build`` for a program whose every step is host work (a compiled closure's
        hoisted mask arithmetic): the steps' host forms resolved once, called in turn. Returns None when a
        step has none; the runner returns the value environment, or None (the caller builds as usual, which
        also raises a build's own errors) when this call's values are not all host ones within
        ``HOST_MAX_ELEMS`` or a host form fails. Same functions, same values as ``build`` takes on the host."""
        plan = []
        for st in self.steps:
            od = st.opdef
            fn = od.host or _extra_host_form(st, host_extra)
            if fn is None or (od.host is not None and not host_evaluable(od, st.out_types, [True] * len(st.inputs))):
                return None
            if st.bodies is not None or st.out_infos or st.in_containers:
                return None
            plan.append((fn, st.inputs, st.outputs, st.attrs, st.out_types, od.shape_only and fn is od.host))
        start = dict(self.constants)
        start.update(self.host_constants)
        names = list(self.inputs)

        def run(inputs: list) -> dict | None:
            if len(inputs) != len(names):
                return None
            env = dict(start)
            env.update(zip(names, inputs))
            for fn, ins, outs, attrs, types, shape_only in plan:
                args = []
                for n in ins:
                    v = env[n] if n else None
                    if isinstance(v, np.ndarray):
                        if v.size > HOST_MAX_ELEMS:
                            return None
                    elif isinstance(v, mx.array):
                        if not shape_only:
                            return None
                    elif v is not None and not shape_only:
                        v = np.asarray(v)
                    args.append(v)
                try:
                    out = fn(*args, **attrs)
                except Exception:  # noqa: BLE001 - the caller's build raises it with the node's name
                    return None
                res = out if isinstance(out, (tuple, list)) else (out,)
                if len(res) < len(outs):
                    return None
                for j, name in enumerate(outs):
                    if name:
                        if res[j] is None:
                            return None
                        env[name] = _as_type(res[j], types[j])
            return env
        return run

    @staticmethod
    def _store_container_outputs(st: Step, out, env: dict) -> None:
        """Outputs of a ``containers`` translator: a tuple with one entry per output (a lone output may
        come bare); a sequence is a list, an empty optional None."""
        outs = out if isinstance(out, tuple) else (out,)
        for j, name in enumerate(st.outputs):
            if not name:
                continue
            info = st.out_infos[j]
            if j >= len(outs) or (outs[j] is None and info.kind != ir.OPTIONAL):
                raise KernelError(f"{st.node.label}: translator produced no output {j} ('{name}')")
            try:
                v = env[name] = _as_value(outs[j], info)
            except (TypeError, ValueError) as e:
                raise KernelError(f"{st.node.label}: output {j} ('{name}'): {e}") from e
            if isinstance(v, mx.array) and v.nbytes > MAX_VALUE_BYTES:      # ConcatFromSequence's result
                raise KernelError(too_big(st.node.label, j, name, v))

    @staticmethod
    def _bind_bodies(st: Step, env: dict) -> dict:
        """The step's attributes with each body bound to the outer values it reads from ``env``."""
        attrs = dict(st.attrs)
        for attr, (prog, names) in st.bodies.items():
            missing = [n for n in names if n not in env]
            if missing:
                raise KernelError(f"{st.node.label}: {attr} body reads outer-scope value(s) {missing} "
                                  f"that the group does not have")
            attrs[attr] = Body(prog, {n: env[n] for n in names})
        return attrs

    def _device_copy(self, name: str, a, dev: dict) -> mx.array:
        """The MLX copy of host value ``name`` (preloaded for constants, else made once per call)."""
        v = dev.get(name)
        if v is None:
            v = self.constants.get(name) if name in self.host_constants else None
            if v is None:
                a = np.asarray(a)
                v = self.upload(np.ascontiguousarray(a) if a.ndim else a, self.types.get(name) or dt.onnx_type_of(a))
            dev[name] = v
        return v


def _extra_host_form(st: Step, host_extra: dict | None):
    """The NumPy form ``host_extra`` gives this step's op (a standard-domain op whose outputs are all
    integers), or None (``Program.build(host_extra=)``)."""
    if host_extra and st.node.domain in ("", "ai.onnx") and st.node.op_type in host_extra and st.out_types \
            and all(t in dt.INTS for t in st.out_types):
        return host_extra[st.node.op_type]
    return None


def _as_value(v, info):
    """Coerce a value to its declared kind: tensors via ``_as_type``, sequences element-wise."""
    if info is None or info.kind == ir.TENSOR:
        if isinstance(v, (list, tuple)):
            raise TypeError(f"a tensor was declared, a {type(v).__name__} arrived")
        return _as_type(v, info.dtype if info is not None else None)
    if info.kind == ir.SEQUENCE:
        if not isinstance(v, list):
            raise TypeError(f"a sequence was declared, a {type(v).__name__} arrived")
        return [_as_value(e, info.elem) for e in v]
    if info.kind == ir.OPTIONAL:
        return None if v is None else _as_value(v, info.elem)
    raise TypeError(f"a {info.kind} value cannot be held")


def _as_type(v, t: int | None):
    """Coerce a translator result to the element type the graph declares."""
    if t is None:
        return v
    if t in dt.CARRIERS:        # never reinterpret: a carrier result must already be its carrier
        have = v.dtype if isinstance(v, mx.array) else np.asarray(v).dtype
        if have != (dt.CARRIER_MLX[t] if isinstance(v, mx.array) else dt.CARRIERS[t]):
            raise KernelError(f"a {dt.name(t)} result arrived as {have}, not its carrier")
        return v
    if isinstance(v, mx.array):
        want = dt.MLX.get(t)
        if want is not None and v.dtype != want:
            v = v.astype(want)
        return v
    want = dt.NUMPY.get(t)
    v = np.asarray(v)
    if want is not None and v.dtype != want and t != dt.BFLOAT16:
        v = v.astype(want)
    return v


def numel(shape) -> int:
    return math.prod(shape) if shape else 1
