"""Developer tuning knobs: one variable, parsed here and nowhere else.

    ORTMLX_TUNING="cuda_kernels=0,call_ahead=1"      # or the provider option tuning="..."

Each knob switches one optimisation for A/B measurement (docs/performance.md, "How to measure").
Users never need them: the defaults are the measured best per device. A provider option wins over
the environment, key by key. The process-wide knobs (``ENV_ONLY``: ``blas`` and ``blas_threads`` act when
``ortmlx`` is imported, before MLX loads) are read from the environment only; the provider option refuses them.

Imports only ``ortmlx.errors``: every layer may read a ``Tuning``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .errors import UserError

ENV = "ORTMLX_TUNING"
_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}
COMPILE_MODES = ("enabled", "no_fuse", "no_simplify", "disabled")


class TuningError(UserError):
    """A malformed tuning string (one line, naming the key and the valid values)."""


@dataclass(frozen=True)
class Tuning:
    """What each knob does; ``None``: decided by the device (the documented default)."""
    #: device mirrors of ORT buffers an output writes in place (genai's shared KV buffer)
    kv_mirror: bool = True
    #: row-hinted KV buffers written back in one batch of C copies per call (runtime/kvbatch.py)
    kv_batch: bool = True
    #: results read with the CUDA driver's copy on MLX's CUDA backend (runtime/devread.py), not NumPy
    driver_read: bool = True
    #: constants copied into device memory once, MatMul weights column-major (GPU)
    device_constants: bool = True
    #: the custom CUDA kernels (kernels/cuda_kernels.py); fold_mlp, fuse_rows, pinned_hints need them
    cuda_kernels: bool = True
    #: a compiled decode's new KV rows written by the gather kernel into page-locked host memory
    pinned_hints: bool = True
    #: large results written by a kernel into page-locked staging memory, then copied into ORT's output buffer
    #: on several threads (GPU, with cuda_kernels; runtime/devread.py); off: read through managed memory
    direct_out: bool = True
    #: host inputs and constants over 8 bytes copied into page-locked staging (1 MB or more: on several threads),
    #: then read into device memory by a kernel (GPU, with cuda_kernels; runtime/upload.py); off: MLX's own copy
    #: (mx.array, managed memory)
    direct_in: bool = True
    #: an MLP's SiLU gating as one step after the merged gate/up product (GPU, with cuda_kernels)
    fold_mlp: bool = True
    #: a decode row's norm and gating made inside the next product's kernel (GPU, with cuda_kernels)
    fuse_rows: bool = True
    #: fuse_rows also folds the MLP's gating into the down product
    gated_rows: bool = True
    #: constant MatMul weights of 3-D products stored [1, K, N] (None: on)
    lift_weights: bool | None = None
    #: half-precision MatMul weights widened to float32 once (None: on with MLX's CPU backend)
    widen_weights: bool | None = None
    #: MatMulNBits weights dequantized to float32 once (None: on with MLX's CPU backend)
    dense_nbits: bool | None = None
    #: half-precision MatMulNBits made plain MatMuls over their weights dequantized once to the half type, so the
    #: fp16 paths take them (merged products, row kernels; None: on a GPU with cuda_kernels, while they fit)
    half_dense_nbits: bool | None = None
    #: mx.compile's mode
    compile_mode: str = "enabled"
    #: a GPU eval started asynchronously with the heap settled meanwhile (compiled/core.py)
    eval_settle: bool = True
    #: the GPU's work waited for by polling the CUDA context before MLX's own wait
    spin_wait: bool = True
    #: hoisted integer work through its closed NumPy form (compiled/hoist_form.py)
    hoist_closed_form: bool = True
    #: the next decode call's closure call made while the device runs this one (None: on a GPU)
    call_ahead: bool | None = None
    #: a prompt's attention through MLX's fused kernel (mx.fast.scaled_dot_product_attention; cuDNN on CUDA) in
    #: half precision (None: on a GPU); off: scores, softmax and P @ V as separate float32 ops
    fused_attention: bool | None = None
    #: the fused kernel only from prompts whose power-of-two bucket is at least this (rounded up to a power of two
    #: >= 32; None: 256, 512 on MLX's CUDA backend with prompt_kernel: kernels/passes.py FUSED_ATTENTION_MIN)
    fused_attention_min: int | None = None
    #: the shortest prefill bucket (a power of two >= 16, kept under the least fused-attention bucket and within the
    #: prompt kernel's lengths; None: 256 on MLX's CUDA backend with prompt_kernel, where shorter prompts cost a
    #: launch-bound call alike, else 16)
    bucket_min: int | None = None
    #: a shorter prompt's attention as one custom kernel (GPU, with cuda_kernels), not MLX's float32 ops
    prompt_kernel: bool = True
    #: a Gather along any axis (an embedding, RoPE's cos/sin rows, a last token) as one custom kernel (take_rows;
    #: GPU, with cuda_kernels), built beside a call's other kernels where MLX's gather is a JIT build of its own
    take_rows: bool = True
    #: a first prompt's rotation, query transpose and presents as one custom kernel (cuda_kernels.prompt_rope; GPU,
    #: with cuda_kernels), where MLX takes a float32 rotation and, per present, a pad and a select over its rows
    prompt_rope: bool = True
    #: the lengths every layer's attention kernel reads (seqlens_k + 1, the past length) computed once a call over
    #: seqlens_k plus 16 bytes of zeros, out of MLX's pool of managed memory for arrays of 8 bytes or less
    #: (consts.unpooled; GPU)
    unpooled_lengths: bool = True
    #: process-wide, environment only: large results copied to the host as their bytes (one copy-kernel build for
    #: every type; GPU)
    byte_copies: bool = True
    #: MatMulNBits products in the activations' half precision, scales included (MLX's CUDA tensor-core qmm
    #: takes half inputs only; off: A widened to float32, one rounding, as ORT's CPU EP; None: on a GPU)
    half_nbits: bool | None = None
    #: float32 Exp and Sigmoid through a polynomial exp in MLX ops, one fused kernel (None: on MLX's CPU backend,
    #: whose own exp is scalar code; kernels/fastmath.py)
    poly_exp: bool | None = None
    #: 2-D convolutions as products over the kernel's shifted input views (kernels/ops/conv.py): on: every form
    #: (1x1, depthwise, shifted, im2col); None: the device's (CPU: 1x1, depthwise and shifted; GPU: all but
    #: shifted, from batch 4); off: MLX's convolution
    conv_gemm: bool | None = None
    #: a half-precision MatMul and the Add of its constant bias as one product, the bias added before the result
    #: is rounded (kernels/passes.py fold_bias; None: on MLX's CPU backend, not yet measured on a GPU)
    fold_bias: bool | None = None
    #: kernels a call would wait for built on a background thread while it answers without them (the polynomial
    #: exp's fused kernel: kernels/background.py); off: the call builds them and waits
    build_behind: bool = True
    #: MLX's kernel fusion in a prompt's closures (None: off on a GPU, where the fused kernels were most of a new
    #: host's compiled first token and no faster warm: docs/performance.md; on elsewhere)
    prompt_fuse: bool | None = None
    #: with build_behind, a new compiled closure's kernels built in a worker process (runtime/prebuild.py) while
    #: its key's calls answer without them (interim), for a group that is the whole model (None: on a GPU, where
    #: a thread of the process starved; the CPU backend builds on the thread)
    prebuild: bool | None = None
    #: while a key's fused kernels are built elsewhere (prebuild, build_behind), its program traced without fusion
    #: answers (MLX's own kernels: nothing to build), verified as any closure; off: those calls answer eagerly
    interim: bool = True
    #: most rows (a batch's decode rows, a short prompt's) the row kernels take, each computed as it is alone
    #: (kernels/cuda_rows.py, at most its ROWS_MAX); None: its ROWS_DEFAULT (more rows: MLX's GEMM)
    batch_rows: int | None = None
    #: a trusted decode closure's step recorded and replayed as one CUDA graph of our kernels (compiled/replay.py,
    #: kernels/cuda_replay.py; GPU, with cuda_kernels); its decode rows' MatMuls take our row kernel
    replay: bool = False
    #: the replay's guard evaluated on MLX's CPU stream, built without our kernels (off: on the GPU, the closure's
    #: own body; compiled/replay.py)
    replay_host_guard: bool = False
    #: the replay's host inputs written into page-locked memory and copied in one piece before its launch (off: a
    #: copy of pageable memory each; kernels/cuda_replay.py ``Replay.stage_inputs``)
    replay_staged_feed: bool = False
    #: the replay's launches made with programmatic dependent launch: each may start while the one before it ends,
    #: its kernel waiting for it first (sm_90 and later; kernels/cuda_replay.py ``Replay._capture``)
    replay_pdl: bool = False
    #: shapeless closures compiled on a GPU too (off: MLX 0.32.4's CUDA backend ran them ~3x slower)
    gpu_shapeless: bool = False
    #: testing only: stage[:node][#count] at which to raise (see ortmlx/stats.py)
    fault: str = ""
    #: process-wide, environment only: OpenBLAS under MLX's Linux CPU backend (ortmlx/blas.py)
    blas: bool = True
    #: process-wide, environment only: OpenBLAS threads (None: min(4, cores))
    blas_threads: int | None = None
    #: process-wide, environment only: our custom CUDA kernels' NVRTC builds kept in MLX's kernel cache, so a new
    #: process loads them instead of building them again (kernels/cuda_cache.py)
    kernel_cache: bool = True
    #: process-wide, environment only: a large result's fresh destination pages faulted in by threads of their own
    #: ahead of the copy into them (runtime/devread.py)
    prefault_out: bool = True

    @classmethod
    def parse(cls, text: str | None, base: "Tuning | None" = None, where: str = ENV) -> "Tuning":
        """``base`` (default: all defaults) with the ``key=value`` pairs of ``text`` applied."""
        base = base or cls()
        if not text or not text.strip():
            return base
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        vals = {}
        for key, sep, raw in _items(text):
            if key not in kinds:
                raise TuningError(f"{where}: unknown key {key!r}; keys: {', '.join(kinds)}")
            if not sep:
                raise TuningError(f"{where}: {key!r} needs a value ({key}=...)")
            vals[key] = _value(where, key, kinds[key], raw)
        return dataclasses.replace(base, **vals)

    @classmethod
    def from_env(cls, env: dict | None = None) -> "Tuning":
        env = os.environ if env is None else env
        return cls.parse(env.get(ENV))

    def describe(self) -> str:
        """The knobs that differ from the defaults, as a tuning string ("" when none)."""
        d = Tuning()
        return ",".join(f"{f.name}={_show(getattr(self, f.name))}" for f in dataclasses.fields(self)
                        if getattr(self, f.name) != getattr(d, f.name))


#: the process-wide knobs, read from ORTMLX_TUNING only (one process, many sessions; some act at import)
ENV_ONLY = frozenset({"byte_copies", "blas", "blas_threads", "kernel_cache", "prefault_out"})


def _items(text: str | None):
    """(key, "=" or "", value) of each non-empty ``key=value`` item of a tuning string, stripped, in order."""
    for item in (text or "").split(","):
        key, sep, raw = item.strip().partition("=")
        if key or sep or raw:
            yield key.strip(), sep, raw.strip()


def keys(text: str | None) -> list[str]:
    """The keys a tuning string names, in order (unchecked: ``Tuning.parse`` checks them)."""
    return [k for k, _, _ in _items(text) if k]


def _value(where: str, key: str, kind: str, raw: str):
    low = raw.lower()
    if kind in ("bool", "bool | None"):
        if kind == "bool | None" and low in ("", "auto"):
            return None
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        extra = ", auto" if kind == "bool | None" else ""
        raise TuningError(f"{where}: {key}={raw!r}: valid values are 0, 1 (or off/on, false/true){extra}")
    if kind == "int | None":
        if low in ("", "auto"):
            return None
        try:
            n = int(raw)
        except ValueError:
            n = -1
        if n < 1:
            raise TuningError(f"{where}: {key}={raw!r}: a positive integer or auto")
        return n
    if key == "compile_mode":
        if low not in COMPILE_MODES:
            raise TuningError(f"{where}: compile_mode={raw!r}: valid values are {', '.join(COMPILE_MODES)}")
        return low
    return raw


def _show(v) -> str:
    return "auto" if v is None else ("1" if v is True else "0" if v is False else str(v))
