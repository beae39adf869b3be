"""Our custom CUDA kernels (``mx.fast.cuda_kernel``) built once per host, not once per process.

MLX 0.32 compiles a custom kernel with NVRTC at its first launch in every process and never writes the result to
its kernel cache (``get_jit_module(..., use_disk_cache=false)`` in its ``custom_kernel.cpp``), although it looks
there first. So each new process paid an NVRTC build for every instantiation of every kernel (numbers:
docs/performance.md, "a new process's first token"). Here, before MLX's first launch of an
instantiation in a process, the source MLX will build is written out as MLX writes it (``mlx_source``), named as
MLX names the module (the kernel's name and libstdc++'s ``std::hash`` of that source, ``module_name``) and, when
the cache lacks it, compiled with the NVRTC library MLX itself loaded, with MLX's flags and include paths and a
stand-in for the one MLX header the source includes (``STANDIN``: the types our kernels use) and an empty
``<cooperative_groups.h>`` (``HEADERS``); the cubin and its mangled name are written where MLX looks
(``ptx_path``), file by file through a rename. MLX then loads it
instead of building it. NVRTC builds one program at a time in a process, so the builds run in worker processes
(``kernels/nvrtc.py``), one per core: the instantiations a graph build (an eager run or a trace) asks for are
queued as it meets them, and its end waits for them (``settle``) before its evaluation launches them. Anything
that fails leaves MLX to build the kernel as before; a source that differs from MLX's only misses the cache.
Tuning ``kernel_cache=0`` (environment only) turns it off; off for any other reason on MLX's CUDA backend, one
stderr line says why.
"""
from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

from . import build
from . import nvrtc as _nvrtc
from .nvrtc import Nvrtc, NvrtcError, write_module

#: MLX releases whose ``cuda_kernel`` source layout, module naming and device header this was checked against on a
#: GPU (tests/test_cuda_cache.py: MLX's own printed source, its build's results); another release: off
MLX_VERSIONS = ("0.32.4",)

#: names MLX's device header declares in ``mlx::core::cu`` besides ``Shape``/``Strides`` (MLX 0.32): a kernel text
#: defining one would get MLX's in MLX's build and its own in ours under the same module name
#: (tests/test_cuda_cache.py keeps our kernels clear of them)
MLX_HEADER_NAMES = ("Limits", "LoopedElemToLoc", "elem_to_loc", "elem_to_loc_nd", "finite_max", "finite_min",
                    "is_aligned", "load_vector", "store_vector", "unsafe_load_vector", "AlignedVector")

#: the one MLX header the generated source includes, replaced by what our kernels use of it: ``Shape`` and
#: ``Strides`` laid out as MLX passes them (``cuda::std::array``: one ``T[N]`` member; MAX_NDIM from MLX's shipped
#: config.h), the half types. Not ``<cuda/std/array>`` itself: parsing it was most of a kernel's build
#: (docs/performance.md), and our kernels only index these.
STANDIN_NAME = "mlx/backend/cuda/device/utils.cuh"
STANDIN = """#pragma once
#include "mlx/backend/cuda/device/config.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/cstdint>
namespace mlx::core::cu {
template <typename T, int N>
struct StandinArray {
  T elems[N];
  __host__ __device__ constexpr const T& operator[](int i) const { return elems[i]; }
  __host__ __device__ constexpr T& operator[](int i) { return elems[i]; }
};
using Shape = StandinArray<int32_t, MAX_NDIM>;
using Strides = StandinArray<int64_t, MAX_NDIM>;
}
"""

#: the generated source also includes ``<cooperative_groups.h>`` and names its namespace; our kernels use none of it
COOPERATIVE_GROUPS = "#pragma once\nnamespace cooperative_groups {}\n"

#: the in-memory headers our builds give NVRTC in place of MLX's (include name -> text)
HEADERS = {STANDIN_NAME: STANDIN, "cooperative_groups.h": COOPERATIVE_GROUPS}

#: ``custom_kernel.cpp``'s default header
DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'

#: dtype name -> (the C type MLX declares a buffer of it as, the name in a template argument's hash)
TYPES = {"bool": ("bool", "bool"), "int8": ("int8_t", "int8_t"), "int16": ("int16_t", "int16_t"),
         "int32": ("int32_t", "int32_t"), "int64": ("int64_t", "int64_t"), "uint8": ("uint8_t", "uint8_t"),
         "uint16": ("uint16_t", "uint16_t"), "uint32": ("uint32_t", "uint32_t"), "uint64": ("uint64_t", "uint64_t"),
         "float16": ("__half", "float16_t"), "bfloat16": ("__nv_bfloat16", "bfloat16_t"),
         "float32": ("float", "float"), "float64": ("double", "double")}

_M64 = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995


def std_hash(data: bytes) -> int:
    """libstdc++'s ``std::hash<std::string>`` on a 64-bit target (``_Hash_bytes``, seed 0xc70f6907)."""
    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)
    n = len(data)
    h = (0xC70F6907 ^ (n * _MUL)) & _M64
    end = n & ~7
    for p in range(0, end, 8):
        d = (shift_mix((int.from_bytes(data[p:p + 8], "little") * _MUL) & _M64) * _MUL) & _M64
        h = ((h ^ d) * _MUL) & _M64
    if n & 7:
        h = ((h ^ int.from_bytes(data[end:], "little")) * _MUL) & _M64
    h = (shift_mix(h) * _MUL) & _M64
    return shift_mix(h)


def dtype_name(t) -> str:
    """``mx.float16`` -> ``"float16"``."""
    return str(t).rsplit(".", 1)[-1]


def shape_infos(source: str, input_names: list) -> list[tuple[bool, bool, bool]]:
    """Which of each input's shape, strides and ndim MLX passes: those the source names."""
    return [(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source) for n in input_names]


def _fmt(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def kernel_name(name: str, template: list) -> str:
    """MLX's name of an instantiation: ``custom_kernel_`` + the name + its template arguments' hash."""
    parts = []
    for _, v in template:
        if isinstance(v, bool):
            parts.append("_t" if v else "_f")
        elif isinstance(v, int):
            parts.append(f"_{v}")
        else:
            parts.append("_" + TYPES[dtype_name(v)][1])
    return "custom_kernel_" + name + "".join(parts)


def mlx_source(func: str, header: str, source: str, input_names: list, inputs: list, output_names: list,
               output_dtypes: list, template: list) -> str:
    """The source MLX builds for one instantiation (``build_kernel`` in MLX's ``custom_kernel.cpp``).
    ``inputs``: (dtype name, ndim) per input; ``output_dtypes``: dtype names."""
    out = [DEFAULT_HEADER, header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
           "__global__ void ", func, "(\n"]
    for name, (t, ndim), (sh, st, nd) in zip(input_names, inputs, shape_infos(source, input_names)):
        out += ["    const ", TYPES[t][0], "* ", name, ",\n"]
        if ndim > 0:
            if sh:
                out += ["    const __grid_constant__ Shape ", name, "_shape,\n"]
            if st:
                out += ["    const __grid_constant__ Strides ", name, "_strides,\n"]
            if nd:
                out += ["    const __grid_constant__ int ", name, "_ndim,\n"]
    for j, (name, t) in enumerate(zip(output_names, output_dtypes)):
        out += ["    ", TYPES[t][0], "* ", name, ",\n" if j < len(output_names) - 1 else ") {\n"]
    if template:
        for name, v in template:
            if isinstance(v, (bool, int)):
                out.append(f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {name} = {_fmt(v)};\n")
            else:
                out.append(f"  using {name} = {TYPES[dtype_name(v)][0]};\n")
        out.append("\n")
    out += [source, "\n}\n\n} // namespace mlx::core::cu\n"]
    return "".join(out)


def module_name(func: str, src: str) -> str:
    """MLX's JIT module name of a custom kernel: its name and the hash of its source, in hex."""
    return f"{func}_{std_hash(src.encode()):x}"


def ptx_path(cache_dir: str, module: str) -> str:
    """Where MLX reads a module (``get_ptx_path``: names over 245 characters become directories)."""
    limit, parts, off = 245, [], 0
    while len(module) - off > limit:
        parts.append(module[off:off + limit])
        off += limit
    return os.path.join(cache_dir, *parts, module[off:] + ".ptx")


def cache_dir() -> str | None:
    """MLX's CUDA kernel cache (``ptx_cache_dir``: ``MLX_PTX_CACHE_DIR``, else ``$TMPDIR/mlx/<version>/ptx``); None
    where MLX keeps none (the variable set empty)."""
    from ..version import ptx_cache_dir
    return ptx_cache_dir()


def loaded_nvrtc(major: int | None = None) -> str | None:
    """The path of the NVRTC library mapped into this process (libmlx's, on MLX's CUDA backend): the one there is,
    or the one of CUDA ``major`` (MLX's build) among several; None when that leaves none or more than one."""
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.rsplit(None, 1)[-1]
                if os.path.basename(p).startswith("libnvrtc.so"):
                    found.add(os.path.realpath(p))
    except OSError:
        return None
    if len(found) > 1 and major is not None:
        found = {p for p in found if os.path.basename(p).startswith(f"libnvrtc.so.{major}")}
    return found.pop() if len(found) == 1 else None


def wheel_nvrtc(major: int = 13) -> str | None:
    """The NVRTC library of an installed ``nvidia-cuda-nvrtc`` wheel of CUDA ``major`` (``nvidia/cu13/lib``), or None:
    for building the kernels where MLX has none loaded (``scripts/cuda_kernel_check.py``)."""
    import glob
    import importlib.util
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    found = [p for r in roots for p in glob.glob(os.path.join(r, f"cu{major}", "lib", f"libnvrtc.so.{major}"))]
    return found[0] if found else None


def mlx_cuda_major() -> int | None:
    """The CUDA major MLX was built for (its ``mlx-cuda-N`` distribution), None when not known."""
    from ..version import mlx_backends
    majors = [int(d.rsplit("-", 1)[1]) for d in mlx_backends() if d.startswith("mlx-cuda-")]
    return majors[0] if len(majors) == 1 else None


def include_paths(cuda_major: int = 13) -> list[str]:
    """MLX's NVRTC include paths (``include_path_args``): its bundled headers and CCCL, then the CUDA runtime's
    headers (the ``nvidia`` package beside MLX of its CUDA major, else ``CUDA_HOME``/``CUDA_PATH``/
    ``/usr/local/cuda``)."""
    import mlx
    root = os.path.dirname(os.path.abspath(mlx.__path__[0] if hasattr(mlx, "__path__") else mlx.__file__))
    mlx_dir = os.path.join(root, "mlx")
    paths = [p for p in (os.path.join(mlx_dir, "include"), os.path.join(mlx_dir, "include", "cccl"))
             if os.path.isdir(p)]
    p = os.path.join(root, "nvidia", "cu13" if cuda_major >= 13 else "cuda_runtime", "include")
    if os.path.isdir(p):
        return paths + [p]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return paths + [os.path.join(home, "include")]


def nvrtc_options(arch: str, includes: list[str]) -> list[str]:
    """MLX's NVRTC options (``compile`` in its ``jit_module.cpp``) for ``arch`` (``sm_90a``) and include paths."""
    return ["--device-as-default-execution-space", f"--gpu-architecture={arch}"] + [f"--include-path={p}"
                                                                                   for p in includes]


#: worker processes that build at once (NVRTC builds one program at a time per process), at most
WORKERS_MAX = 16
#: seconds a worker process waits for another job before it exits
WORKER_IDLE_S = 10.0
#: the longest ``settle`` waits for the builds in flight (a build takes ~1-5 s); then MLX builds what is left itself
SETTLE_TIMEOUT_S = 120.0


def worker_count() -> int:
    """Worker processes for this machine: one per core, at most ``WORKERS_MAX``; 1 (builds in this process) where
    ``sys.executable`` is not a Python interpreter (an application embedding Python) or there is one core."""
    if not re.fullmatch(r"(python|pypy)[0-9.]*(\.exe)?", os.path.basename(sys.executable or "")):
        return 1
    return max(1, min(WORKERS_MAX, os.cpu_count() or 1))


def _reaped(proc):
    """None, once a worker that stopped answering is gone: the next job starts a new one (an exiting worker
    may not have exited yet when ``poll`` looks, and a job written to it would be lost too)."""
    if proc is not None:
        try:
            proc.kill()
            proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - gone or unkillable: either way it gets no more jobs
            pass
    return None


class _Pool:
    """Worker processes (``command``: one that serves ``nvrtc.serve``'s protocol), each fed by a thread of this
    process; a worker starts with its thread when more jobs are queued than threads are idle, and exits after
    ``WORKER_IDLE_S`` without one. ``done(job, error)`` is called once per job (error None: built)."""

    def __init__(self, command: list[str], workers: int, done):
        self.command, self.workers, self.done = command, workers, done
        self.jobs: "queue.Queue[dict]" = queue.Queue()
        self.lock = threading.Lock()
        self.live = self.idle = 0

    def put(self, job: dict) -> None:
        with self.lock:
            self.jobs.put(job)
            if self.jobs.qsize() > self.idle and self.live < self.workers:     # (more queued than idle threads)
                self.live += 1
                self.idle += 1
                threading.Thread(target=self._feed, name="ortmlx-nvrtc-feed", daemon=True).start()

    def _feed(self) -> None:
        proc = None
        try:
            while True:
                try:
                    job = self.jobs.get(timeout=WORKER_IDLE_S)
                except queue.Empty:
                    with self.lock:                     # (checked under the lock ``put`` queues under)
                        if self.jobs.empty():
                            self.live -= 1
                            self.idle -= 1
                            return
                    continue
                with self.lock:
                    self.idle -= 1
                error = None
                try:
                    if proc is None or proc.poll() is not None:
                        proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=subprocess.DEVNULL, text=True)
                    proc.stdin.write(json.dumps(job) + "\n")
                    proc.stdin.flush()
                    line = proc.stdout.readline()
                    reply = json.loads(line) if line else {"ok": False, "error": "the build worker exited"}
                    error = None if reply.get("ok") else str(reply.get("error"))
                    if not line:
                        proc = _reaped(proc)
                except Exception as e:  # noqa: BLE001 - that kernel is left to MLX
                    error = f"{type(e).__name__}: {e}"
                    proc = _reaped(proc)
                with self.lock:
                    self.idle += 1
                self.done(job, error)
        finally:
            if proc is not None and proc.poll() is None:
                proc.stdin.close()
                proc.wait()


class Builder:
    """Builds missing instantiations into MLX's cache; one per process (``builder()``). With ``workers`` > 1 the
    builds run in that many worker processes at once (``submit``); ``settle`` waits for them before an evaluation
    that may launch them."""

    def __init__(self, nvrtc: Nvrtc, arch: str, includes: list[str], directory: str, workers: int = 1):
        self.nvrtc, self.arch, self.includes, self.dir = nvrtc, arch, includes, directory
        self.options = nvrtc_options(arch, includes)
        self.lock = threading.Lock()
        self.counts = {"cached": 0, "built": 0, "failed": 0}
        self.failures: list[str] = []
        self.state: dict[str, str] = {}             # module path -> "queued", "built" or "failed: why"
        self.flight: dict[str, threading.Event] = {}
        self.pool = None if workers <= 1 else _Pool(
            [sys.executable, "-I", "-S", _nvrtc.__file__, nvrtc.path], workers, self._done)

    def job(self, func: str, src: str) -> dict:
        mod = module_name(func, src)
        return {"src": src, "file": mod + ".cu", "name": "mlx::core::cu::" + func, "options": self.options,
                "headers": dict(HEADERS), "path": ptx_path(self.dir, mod)}

    def submit(self, func: str, src: str) -> str:
        """``"cached"`` when MLX's cache holds the module of ``src``; ``"queued"`` when a worker builds it now;
        without workers ``"built"`` when built into it here, else ``"failed: why"`` (MLX builds it itself then)."""
        return self._submit(func, self.job(func, src))

    def _submit(self, func: str, job: dict) -> str:
        path = job["path"]
        with self.lock:
            st = self.state.get(path)
            if st is not None:
                return st
            if os.path.exists(path):
                self.counts["cached"] += 1
                return "cached"
            if self.pool is not None:
                self.state[path] = "queued"
                self.flight[path] = threading.Event()
                self.pool.put(job)
                return "queued"
            try:
                _nvrtc.build(self.nvrtc, job)
                st = "built"
            except Exception as e:  # noqa: BLE001 - MLX builds it itself
                st = f"failed: {e}"
            self._record(func, path, st)
            return st

    def _record(self, func: str, path: str, st: str) -> None:
        self.state[path] = st
        self.counts[st.split(":")[0]] += 1
        if st != "built":
            self.failures.append(f"{func}: {st[len('failed: '):]}")

    def _done(self, job: dict, error: str | None) -> None:
        with self.lock:
            ev = self.flight.pop(job["path"], None)
            if ev is None:                  # given up on (``settle``): its late answer changes nothing
                return
            self._record(job["name"].rsplit("::", 1)[-1], job["path"], "built" if error is None else f"failed: {error}")
        ev.set()

    def settle(self, timeout: float = SETTLE_TIMEOUT_S) -> bool:
        """Wait for every build in flight; False when ``timeout`` passed first: those still in flight are then given
        up on (recorded failed, left to MLX), so a stuck worker delays one evaluation, not every later one."""
        end = time.monotonic() + timeout
        while True:
            with self.lock:
                ev = next(iter(self.flight.values()), None)
            if ev is None:
                return True
            if not ev.wait(max(0.0, end - time.monotonic())):
                with self.lock:
                    late, self.flight = self.flight, {}
                    for path in late:
                        self._record(os.path.basename(path), path, f"failed: not built within {timeout:g} s")
                for e in late.values():
                    e.set()
                return False

    def ensure(self, func: str, src: str) -> str:
        """``submit``, then the build's end waited for: ``"cached"``, ``"built"`` or ``"failed: why"``."""
        job = self.job(func, src)
        st = self._submit(func, job)
        if st == "queued":
            with self.lock:
                ev = self.flight.get(job["path"])
            if ev is not None and not ev.wait(SETTLE_TIMEOUT_S):
                self.settle(0.0)            # (gives it up, with any other build as late)
            with self.lock:
                st = self.state[job["path"]]
        return st


def settle() -> None:
    """Wait for this process's kernel builds in flight (before an evaluation that may launch them; free when none
    is)."""
    if _builder and _builder[0] is not None and _builder[0].flight:
        _builder[0].settle()


_builder: list = []         # [Builder | None]: made at the first launch (None: off here, with the reason)
_reason: list = []


def builder() -> Builder | None:
    """This process's builder (None when off: not asked for, not MLX's CUDA backend, no NVRTC found, ...)."""
    if _builder:
        return _builder[0]
    b, why, cuda = None, None, False
    try:
        import mlx.core as mx
        from ..tuning import Tuning, TuningError
        try:
            on = Tuning.from_env().kernel_cache
        except TuningError:
            on = True
        cuda = bool(mx.cuda.is_available())
        info = mx.device_info(mx.gpu) if on and cuda else {}
        lib = loaded_nvrtc(mlx_cuda_major()) if on else None
        directory = cache_dir()
        if not on:
            why = "tuning kernel_cache=0"
        elif mx.__version__ not in MLX_VERSIONS:
            why = f"MLX {mx.__version__} is not one of {MLX_VERSIONS}"
        elif "compute_capability_major" not in info:
            why = "no CUDA device"
        elif lib is None:
            why = "no NVRTC library of MLX's loaded (or several)"
        elif directory is None:
            why = "MLX_PTX_CACHE_DIR is empty: MLX keeps no kernel cache"
        else:
            major, minor = int(info["compute_capability_major"]), int(info["compute_capability_minor"])
            arch = f"sm_{major}{minor}{'a' if major >= 9 else ''}"
            nv = Nvrtc(lib)
            b = Builder(nv, arch, include_paths(nv.version[0]), directory, worker_count())
    except Exception as e:  # noqa: BLE001 - MLX builds the kernels itself then
        b, why = None, f"{type(e).__name__}: {e}"
    _builder.append(b)
    _reason.append(why)
    if b is None and why != "tuning kernel_cache=0" and cuda:
        # each process then pays MLX's own build of every kernel of ours: say so once, with why
        sys.stderr.write(f"MLXExecutionProvider: our CUDA kernels are not kept in MLX's kernel cache in this "
                         f"process ({why}); each new process builds them again\n")
    return b


def reason() -> str | None:
    """Why the builder is off in this process (None: on, or not asked for yet)."""
    return _reason[0] if _reason else None


#: ``launches`` (a list) while ``cuda_replay.record`` records this thread's launches of our kernels
RECORDING = threading.local()


def instantiation_key(template, inputs, output_dtypes) -> tuple:
    """What ``CachedKernel.seen`` keeps an instantiation's build answer under (``inputs``: a (dtype name, ndim)
    tuple per input; ``output_dtypes``: dtype names)."""
    return (tuple((n, type(v).__name__, v if isinstance(v, (bool, int)) else dtype_name(v)) for n, v in template),
            tuple(inputs), tuple(output_dtypes))


class CachedKernel:
    """An ``mx.fast.cuda_kernel`` whose instantiations are made sure of in MLX's kernel cache before MLX's first
    launch of each in this process; called as the kernel is."""

    def __init__(self, name: str, input_names: list, output_names: list, source: str, header: str, fn,
                 contiguous: bool = True):
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.source, self.header, self.fn = source, header, fn
        #: MLX copies an input that is not row-contiguous before the launch (``ensure_row_contiguous``)
        self.contiguous = contiguous
        #: output name -> the input it may be written over (its launch is right with both the same buffer)
        self.in_place: dict[str, str] = {}
        self.seen: dict = {}        # (template, inputs, output types) -> the builder's answer

    def __call__(self, *, inputs, output_dtypes, template=None, **kw):
        template = list(template or [])
        try:
            key = instantiation_key(template, ((dtype_name(a.dtype), a.ndim) for a in inputs),
                                    (dtype_name(t) for t in output_dtypes))
        except Exception:  # noqa: BLE001 - a scalar input or an odd template: left to MLX (its own build, its error)
            key = None
        if key is not None and key not in self.seen:
            self.seen[key] = self.prepare(template, list(key[1]), list(key[2]))
        outs = self.fn(inputs=inputs, output_dtypes=output_dtypes, template=template, **kw)
        launches = getattr(RECORDING, "launches", None)
        if launches is not None:            # ``cuda_replay.record``
            launches.append((self, tuple(template), dict(kw), tuple(inputs), tuple(outs), tuple(output_dtypes)))
        return outs

    def queue(self, inputs: list, output_dtypes: list, template: list | None = None) -> str:
        """Start building one instantiation (``inputs``: (dtype name, ndim) per input) on the builder's workers and
        return without waiting: its first call then waits for that build (``ensure``) rather than starting one.
        So kernels needed one after another build side by side. Never raises."""
        try:
            b = builder()
            if b is None:
                return f"off ({reason()})"
            template = list(template or [])
            func = kernel_name(self.name, template)
            return b.submit(func, mlx_source(func, self.header, self.source, self.input_names, inputs,
                                             self.output_names, output_dtypes, template))
        except Exception as e:  # noqa: BLE001
            return f"failed: {type(e).__name__}: {e}"

    def prepare(self, template: list, inputs: list, output_dtypes: list) -> str:
        """The builder's answer for one instantiation; never raises (MLX builds it itself on any failure)."""
        try:
            b = builder()
            if b is None:
                return f"off ({reason()})"
            func = kernel_name(self.name, template)
            src = mlx_source(func, self.header, self.source, self.input_names, inputs, self.output_names,
                             output_dtypes, template)
            # inside a graph build the builds run at once, waited for when it ends (``settle``); else now
            return b.submit(func, src) if build.current() is not None else b.ensure(func, src)
        except Exception as e:  # noqa: BLE001
            return f"failed: {type(e).__name__}: {e}"
