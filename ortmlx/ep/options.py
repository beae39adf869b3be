"""Provider options and environment variables, copied out once at EP creation.

Every option can be given as a provider option (``providers=[("MLXExecutionProvider",
{"device": "cpu"})]``, which ORT hands over as session config entries
``ep.mlxexecutionprovider.<key>``) or as an environment variable. A provider option
wins over the environment. For on/off switches, "" and "0" (and "false", "off")
mean off; any other option left empty (``ORTMLX_DEVICE=``) is unset (the environment's,
then the default).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

PREFIX = "ep.mlxexecutionprovider."
_FALSE = {"", "0", "false", "off", "no"}

#: option -> environment variables (first found wins), help text
SPEC: dict[str, tuple[tuple[str, ...], str]] = {
    "device": (("ORTMLX_DEVICE",), "auto|cpu|gpu: where MLX runs (auto: the GPU when MLX has one)"),
    "no_compile": (("ORTMLX_NO_COMPILE", "ONNX_GENAI_MLX_NO_COMPILE", "ONNXRUNTIME_EP_MLX_NO_COMPILE"),
                   "1: never use mx.compile, run every group eagerly"),
    "no_general_compile": (("ORTMLX_NO_GENERAL_COMPILE", "MLX_EP_NO_GENERAL_COMPILE",
                            "ONNXRUNTIME_EP_MLX_NO_GENERAL_COMPILE"), "1: no compiled path for groups without attention"),
    "no_prefill_compile": (("ORTMLX_NO_PREFILL_COMPILE", "MLX_EP_NO_PREFILL_COMPILE",
                            "ONNXRUNTIME_EP_MLX_NO_PREFILL_COMPILE"), "1: no compiled prefill path"),
    "no_decode_compile": (("ORTMLX_NO_DECODE_COMPILE", "ONNXRUNTIME_EP_MLX_NO_DECODE_COMPILE"),
                          "1: no compiled (shapeless) decode path"),
    "gpu_decode_compile": (("ORTMLX_GPU_DECODE_COMPILE",), "0: run the decode step eagerly on a GPU (compiled by default: "
                                                           "2.1-2.9x eager decode on the H200, docs/performance.md)"),
    "no_kv_mirror": (("ORTMLX_NO_KV_MIRROR",), "1: no device mirror of buffers an output writes in place (genai's "
                                               "shared KV buffer): every call copies them in and out whole"),
    "no_kv_batch": (("ORTMLX_NO_KV_BATCH",), "1: write row-hinted KV buffers back one by one (ep/mirror.py) rather "
                                             "than in one batch of C copies per call (ep/kvbatch.py)"),
    "driver_read": (("ORTMLX_DRIVER_READ",), "0: read results to the host with numpy rather than the CUDA driver's copy "
                                             "on MLX's CUDA backend (ep/devread.py)"),
    "device_constants": (("ORTMLX_DEVICE_CONSTANTS",), "0: keep constants (weights) where mx.array puts them (on MLX's "
                                                       "CUDA backend: managed memory) and MatMul weights row-major, "
                                                       "rather than copied into device memory once, MatMul weights "
                                                       "column-major (MLX's gemv for a decode row; GPU only)"),
    "lift_weights": (("ORTMLX_LIFT_WEIGHTS",), "1|0: store constant MatMul weights of 3-D products [1, K, N] (one MLX "
                                               "node per product; 2-D, MLX flattens A and unflattens the product: two "
                                               "more per product and call) (kernels/merge.py); default: on (CPU "
                                               "backend 1.06-1.17x decode, H200 1.00-1.10x; tokens identical)"),
    "widen_weights": (("ORTMLX_WIDEN_WEIGHTS",), "1|0: keep float16/bfloat16 MatMul weights in float32 (widened once at "
                                                 "load, twice the memory) so products run in the BLAS's sgemm and are "
                                                 "rounded once; default: on with MLX's CPU backend (its half matmul is "
                                                 "not BLAS-backed), off on a GPU (kernels/merge.py)"),
    "dense_nbits": (("ORTMLX_DENSE_NBITS",), "1|0: dequantize constant MatMulNBits weights to float32 once at load "
                                             "(8x an int4 weight's memory; skipped when over a quarter of the memory "
                                             "MLX may use) so products run in the BLAS's sgemm; default: on with "
                                             "MLX's CPU backend (its quantized matmul is a plain loop), off on a GPU"),
    "cuda_kernels": (("ORTMLX_CUDA_KERNELS",), "0: no custom CUDA kernels (kernels/cuda_kernels.py: one-kernel decode "
                                               "attention, fused norms, the row-hint gather; fold_mlp, "
                                               "fuse_rows and pinned_hints need them) on MLX's CUDA backend"),
    "fold_mlp": (("ORTMLX_FOLD_MLP",), "0: keep an MLP's SiLU gating (Sigmoid, Mul, Mul) as its own nodes after the merged "
                                       "gate/up product, rather than one step (one custom kernel for a decode row) "
                                       "(GPU, with cuda_kernels; kernels/merge.py)"),
    "fuse_rows": (("ORTMLX_FUSE_ROWS",), "0: keep a decode row's norm and its MLP gating as kernels of their own "
                                         "before the products that read them, rather than made inside those "
                                         "products' kernels (GPU, with cuda_kernels; kernels/rowfold.py)"),
    "pinned_hints": (("ORTMLX_PINNED_HINTS",), "0: gather a compiled decode call's new KV rows into a device buffer "
                                               "and copy that to the host, rather than have the gather kernel write "
                                               "them into page-locked host memory (GPU, with cuda_kernels)"),
    "compile_mode": (("ORTMLX_COMPILE_MODE",), "enabled|no_fuse|no_simplify|disabled: mx.compile mode"),
    "trace": (("ORTMLX_TRACE",), "path.json: write a Chrome/Perfetto trace of the session"),
    "verbose": (("ORTMLX_VERBOSE",), "1: print a session summary at release"),
    "disable_ops": (("ORTMLX_DISABLE_OPS",), "comma-separated op types never claimed"),
    "fault": (("ORTMLX_FAULT",), "testing only: stage[:node][#count] at which to raise (getcapability|compile|compute|"
                                 "copy_in|build|eval|copy_out|trace; #N: the first N times only)"),
}

_BOOLS = {"no_compile", "no_general_compile", "no_prefill_compile", "no_decode_compile", "gpu_decode_compile",
          "no_kv_mirror", "no_kv_batch", "driver_read", "device_constants", "cuda_kernels", "pinned_hints", "fold_mlp",
          "fuse_rows", "lift_weights", "widen_weights", "dense_nbits", "verbose"}


def flag(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in _FALSE


@dataclass(frozen=True)
class EpOptions:
    device: str = "auto"
    no_compile: bool = False
    no_general_compile: bool = False
    no_prefill_compile: bool = False
    no_decode_compile: bool = False
    gpu_decode_compile: bool = True
    no_kv_mirror: bool = False
    no_kv_batch: bool = False
    driver_read: bool = True
    device_constants: bool = True
    cuda_kernels: bool = True
    pinned_hints: bool = True
    fold_mlp: bool = True
    fuse_rows: bool = True
    lift_weights: bool | None = None          # None: the Program's default (on)
    widen_weights: bool | None = None         # None: by device (Program)
    dense_nbits: bool | None = None           # None: by device (Program)
    compile_mode: str = "enabled"
    trace: str = ""
    verbose: bool = False
    disable_ops: frozenset = field(default_factory=frozenset)
    fault: str = ""
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_sources(cls, provider: dict[str, str], env: dict[str, str] | None = None) -> "EpOptions":
        env = os.environ if env is None else env
        unknown = sorted(set(provider) - set(SPEC))
        if unknown:
            raise ValueError(f"unknown MLXExecutionProvider option(s) {unknown}; known: {sorted(SPEC)}")
        vals: dict = {}
        for key, (env_names, _) in SPEC.items():
            raw = provider.get(key)
            if not _given(key, raw):
                raw = next((env[e] for e in env_names if _given(key, env.get(e))), None)
            if raw is None:
                continue
            vals[key] = flag(raw) if key in _BOOLS else raw.strip()
        if "disable_ops" in vals:
            vals["disable_ops"] = frozenset(o.strip() for o in vals["disable_ops"].split(",") if o.strip())
        dev = vals.get("device", "auto").lower()
        if dev not in ("auto", "cpu", "gpu"):
            raise ValueError(f"device must be auto, cpu or gpu, got {dev!r}")
        vals["device"] = dev
        mode = vals.get("compile_mode", "enabled").lower()
        if mode not in ("enabled", "no_fuse", "no_simplify", "disabled"):
            raise ValueError(f"compile_mode must be enabled|no_fuse|no_simplify|disabled, got {mode!r}")
        vals["compile_mode"] = mode
        return cls(**vals, raw=dict(provider))

    @classmethod
    def from_session_config(cls, config: dict[str, str]) -> "EpOptions":
        return cls.from_sources({k[len(PREFIX):]: v for k, v in config.items() if k.startswith(PREFIX)})

    @property
    def compile_enabled(self) -> bool:
        return not self.no_compile and self.compile_mode != "disabled"


def _given(key: str, value: str | None) -> bool:
    """Whether ``value`` sets option ``key``: an empty switch is off, any other option left empty
    (``ORTMLX_DEVICE=``) is unset."""
    return value is not None and (key in _BOOLS or bool(value.strip()))


def option_names() -> list[str]:
    return [f.name for f in fields(EpOptions) if f.name != "raw"]
