"""A step made of our kernels only, recorded as MLX runs it and replayed as one CUDA graph.

MLX's host work is ~5-8 us a launch of a custom kernel (``docs/performance.md``), so a decode step of ~170
launches is bound by the host. A step whose every launch is one of ours (``cuda_cache.CachedKernel``) can skip it:

1. ``record()`` runs the step twice through MLX (two calls with different inputs) and notes each launch: the
   kernel, its template and grid, its input and output arrays.
2. ``Replay.build`` reads every array's device address, shape and strides through one kernel (MLX 0.32 exports no
   CUDA DLPack) and checks each launch's pointers: an earlier launch's output, a step input (its buffer refilled
   before each replay: ``write``), or a constant (the same address in both calls). Anything else came from an
   operation that is not ours (MLX's own kernels, a copy MLX made for a strided input): the step is refused.
3. The second call's launches are captured once on a stream of ours (``cuLaunchKernel`` of the kernels' modules
   in MLX's kernel cache, arguments packed as MLX's ``custom_kernel.cpp`` packs them) and replayed by one
   ``cuGraphLaunch``. Step inputs and outputs live in one device allocation of the replay's own (MLX moves a
   buffer it reads on the host: a graph must not point into MLX's); the constants are MLX's, held.

An output a kernel may write over its input (``CachedKernel.in_place``, a KV buffer's present over its past) is
given that input's buffer, so a replayed decode step keeps one KV buffer.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time

import mlx.core as mx
import numpy as np

from . import cuda_cache as cc
from . import cuda_driver

#: cuStreamCreate: no implicit ordering with the legacy stream
STREAM_NON_BLOCKING = 1
#: cuStreamBeginCapture: only this thread's calls are captured
CAPTURE_THREAD_LOCAL = 1
#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: a launch may start before the one before it ends (its
#: kernel waits for it: ``cuda_kernels.PRIOR_WAIT``)
ATTR_PROGRAMMATIC = 6
#: MLX's Shape / Strides: fixed arrays of this many int32 / int64 (``MAX_NDIM``)
MAX_NDIM = 10
#: arrays ``describe`` reads in one kernel (a kernel's parameters are limited to 32 KB: ~136 bytes each)
DESCRIBE_CHUNK = 64
#: int64 fields per array ``describe`` writes: address, ndim, shape, strides
_FIELDS = 2 + 2 * MAX_NDIM

DRIVER_CDEF = """
int cuModuleLoadData(void** module, const void* image);
int cuModuleUnload(void* hmod);
int cuModuleGetFunction(void** hfunc, void* hmod, const char* name);
int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void* src, size_t n, void* stream);
int cuMemcpyDtoH_v2(void* dst, unsigned long long src, size_t n);
int cuMemcpyDtoD_v2(unsigned long long dst, unsigned long long src, size_t n);
int cuMemcpyDtoDAsync_v2(unsigned long long dst, unsigned long long src, size_t n, void* stream);
int cuMemAlloc_v2(unsigned long long* dptr, size_t bytesize);
int cuMemFree_v2(unsigned long long dptr);
int cuStreamCreate(void** stream, unsigned int flags);
int cuStreamDestroy_v2(void* stream);
int cuStreamSynchronize(void* stream);
int cuLaunchKernel(void* f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
                   unsigned int bz, unsigned int shmem, void* stream, void** params, void** extra);
typedef struct { int id; int pad; union { char raw[64]; int allowed; unsigned long long align; } value; }
    ortmlx_launch_attr;
typedef struct {
    unsigned int gx, gy, gz, bx, by, bz, shmem;
    void* stream;
    ortmlx_launch_attr* attrs;
    unsigned int n_attrs;
} ortmlx_launch_config;
int cuLaunchKernelEx(const ortmlx_launch_config* config, void* f, void** params, void** extra);
int cuStreamBeginCapture_v2(void* stream, int mode);
int cuStreamEndCapture(void* stream, void** graph);
int cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long flags);
int cuGraphLaunch(void* exec, void* stream);
int cuGraphExecDestroy(void* exec);
int cuGraphDestroy(void* graph);
"""


class Refused(RuntimeError):
    """The recorded step cannot be replayed (the reason names the launch and argument)."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of a kernel of ours as ``CachedKernel.__call__`` made it."""
    kernel: cc.CachedKernel
    template: tuple
    grid: tuple
    threadgroup: tuple
    inputs: tuple
    outputs: tuple
    output_dtypes: tuple
    extra: tuple                # keywords other than grid, threadgroup, output_shapes (init_value: refused)

    @property
    def label(self) -> str:
        return self.kernel.name.rsplit("_", 1)[0]


@contextlib.contextmanager
def record():
    """Note every launch of our kernels this thread makes meanwhile: yields the list ``Launch``es go into."""
    prev = getattr(cc.RECORDING, "launches", None)
    raw: list = []
    cc.RECORDING.launches = raw
    launches: list[Launch] = []
    try:
        yield launches
    finally:
        cc.RECORDING.launches = prev
        for kernel, template, kw, inputs, outs, dtypes in raw:
            extra = tuple(sorted(k for k in kw if k not in ("grid", "threadgroup", "output_shapes")))
            launches.append(Launch(kernel, template, tuple(kw.get("grid", ())), tuple(kw.get("threadgroup", ())),
                                   inputs, outs, dtypes, extra))


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """What the device sees of an array: the address MLX passes a kernel, shape and strides (elements)."""
    address: int
    shape: tuple
    strides: tuple
    itemsize: int

    @property
    def extent(self) -> int:
        """Bytes from ``address`` to one past the last element."""
        if any(d == 0 for d in self.shape):
            return 0
        return (sum((d - 1) * abs(s) for d, s in zip(self.shape, self.strides)) + 1) * self.itemsize

    @property
    def row_contiguous(self) -> bool:
        """MLX's flag: the strides of a row-major layout, dimensions of size 1 aside."""
        acc = 1
        for d, s in zip(reversed(self.shape), reversed(self.strides)):
            if d != 1:
                if s != acc:
                    return False
                acc *= d
        return True


def _describe_source(n: int) -> str:
    lines = ["    if (blockIdx.x != 0 || threadIdx.x != 0) return;"]
    for i in range(n):
        f = i * _FIELDS
        lines += [f"    info[{f}] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(a{i}));",
                  f"    info[{f + 1}] = a{i}_ndim;",
                  f"    for (int d = 0; d < a{i}_ndim; ++d) {{ info[{f + 2} + d] = a{i}_shape[d]; "
                  f"info[{f + 2 + MAX_NDIM} + d] = a{i}_strides[d]; }}"]
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=2)
def _describe_kernel(n: int):
    from .cuda_kernels import _kernel
    return _kernel("ortmlx_describe", [f"a{i}" for i in range(n)], ["info"], _describe_source(n),
                   ensure_row_contiguous=False)


def describe(arrays: list) -> list[ArrayInfo]:
    """Each (evaluated) array's device address, shape and strides as MLX passes them to a kernel that reads them
    as they lie: one launch per ``DESCRIBE_CHUNK`` arrays. A 0-d array is read as its (1,) view."""
    flat = [a.reshape(1) if a.ndim == 0 else a for a in arrays]
    infos = []
    for at in range(0, len(flat), DESCRIBE_CHUNK):
        part = flat[at:at + DESCRIBE_CHUNK]
        pad = part + [part[-1]] * (DESCRIBE_CHUNK - len(part))
        (info,) = _describe_kernel(DESCRIBE_CHUNK)(inputs=pad, grid=(1, 1, 1), threadgroup=(1, 1, 1),
                                                   output_shapes=[(DESCRIBE_CHUNK * _FIELDS,)],
                                                   output_dtypes=[mx.int64])
        rows = np.array(info).reshape(DESCRIBE_CHUNK, _FIELDS)
        for a, r in zip(part, rows):
            nd = int(r[1])
            infos.append(ArrayInfo(int(r[0]) & ((1 << 64) - 1), tuple(int(x) for x in r[2:2 + nd]),
                                   tuple(int(x) for x in r[2 + MAX_NDIM:2 + MAX_NDIM + nd]), a.dtype.size))
    return infos


@dataclasses.dataclass(frozen=True)
class Ref:
    """Where a launch's pointer argument points: ``kind`` "out" (launch ``which``'s output ``index``), "input"
    (step input ``which``) or "const"; ``offset`` bytes into it."""
    kind: str
    which: int
    index: int
    offset: int


def _locate(addr: int, outs: list, inputs: list, before: int) -> Ref | None:
    """The output of a launch before ``before`` or the step input whose bytes hold ``addr`` (None: neither)."""
    for k in range(before - 1, -1, -1):
        for j, info in enumerate(outs[k]):
            if info.address <= addr < info.address + max(info.extent, 1):
                return Ref("out", k, j, addr - info.address)
    for m, info in enumerate(inputs):
        if info.address <= addr < info.address + max(info.extent, 1):
            return Ref("input", m, 0, addr - info.address)
    return None


def plan(first: list[Launch], second: list[Launch], infos: dict, step_inputs: tuple[list, list]) -> list[list[Ref]]:
    """Every pointer argument of ``second``'s launches as a ``Ref`` (inputs, then outputs), checked against
    ``first`` (the same step with other inputs): the same kernels, templates, grids and shapes; each input an
    earlier output, a step input, or a constant. ``infos``: id(array) -> ``ArrayInfo`` for every array of both
    calls. Raises ``Refused`` naming the first problem; its ``problems`` lists them all."""
    if len(first) != len(second):
        raise Refused(f"the two calls made {len(first)} and {len(second)} launches")
    ins = [[infos[id(a)] for a in step] for step in step_inputs]
    outs = [[[infos[id(o)] for o in ln.outputs] for ln in lns] for lns in (first, second)]
    refs, problems = [], []
    for i, (a, b) in enumerate(zip(first, second)):
        where = f"launch {i} ({b.label})"
        if a.kernel is not b.kernel or a.template != b.template or a.grid != b.grid or \
                a.threadgroup != b.threadgroup or a.output_dtypes != b.output_dtypes:
            problems.append(f"{where}: the two calls launched it otherwise")
            refs.append([])
            continue
        if b.extra:
            problems.append(f"{where}: launched with {', '.join(b.extra)}")
        row = []
        for j, (x, y) in enumerate(zip(a.inputs, b.inputs)):
            ia, ib = infos[id(x)], infos[id(y)]
            name = b.kernel.input_names[j]
            if ia.shape != ib.shape or ia.strides != ib.strides or x.dtype != y.dtype:
                problems.append(f"{where} input {name}: {ia.shape}/{ia.strides} then {ib.shape}/{ib.strides}")
            elif b.kernel.contiguous and not ib.row_contiguous and ib.extent:
                problems.append(f"{where} input {name}: strides {ib.strides} (MLX copies it before the launch)")
            ra = _locate(ia.address, outs[0], ins[0], i)
            rb = _locate(ib.address, outs[1], ins[1], i)
            if rb is None and ra is None and ia.address == ib.address:
                rb = Ref("const", 0, 0, 0)
            elif rb is None or rb != ra:
                problems.append(f"{where} input {name} {tuple(y.shape)} {y.dtype}: made by an operation that is "
                                "not a kernel of ours")
            row.append(rb)
        for j, (x, y) in enumerate(zip(a.outputs, b.outputs)):
            if tuple(x.shape) != tuple(y.shape):
                problems.append(f"{where} output {b.kernel.output_names[j]}: shape {x.shape} then {y.shape}")
            row.append(Ref("out", i, j, 0))
        refs.append(row)
    if problems:
        e = Refused(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        e.problems = problems
        raise e
    return refs


#: graphs a replay keeps, one per set of external addresses (``rebind``)
GRAPHS = 4
#: alignment of each buffer in a replay's arena (MLX's allocator aligns as much; 16-byte loads need 16)
ALIGN = 256


def _build_answer(k, ins: list, outs: list, ln: Launch) -> str:
    """What this process's kernel builder said of ``ln``'s instantiation (``CachedKernel.seen``), or why it is off."""
    return k.seen.get(cc.instantiation_key(ln.template, ins, outs)) or f"none ({cc.reason() or 'not asked'})"


class Replay:
    """A recorded step as one CUDA graph (``build``): ``write`` the step inputs, ``launch``, ``wait``, ``read``.

    The replay owns its buffers: one device allocation (the arena) holds every step input and every launch's
    output (an in-place output shares its input's), so MLX's allocator never sees them; the constants it reads
    (weights) stay MLX's arrays, held here."""

    def __init__(self, drv, lib, ffi):
        self.drv, self.lib, self.ffi = drv, lib, ffi
        self.stream = self.graph = self.exec = None
        self.arena = None               # the device allocation (an address)
        self.modules: dict = {}
        self.functions: dict = {}       # (kernel, template, inputs, outputs) -> its CUfunction
        self.consts: list = []          # MLX arrays the launches read in place
        self.addr: dict = {}            # id(array of the second call) -> its address in the arena
        self.inputs: list = []          # the second call's step inputs (while building)
        self.input_keys: list = []      # their keys in ``addr``, and sizes
        self.input_bytes: list = []
        self.external: set = set()      # keys of step inputs at the caller's addresses
        self.same: dict = {}            # key of an output written over an input -> the input's key
        self.specs: list = []
        self.timings: dict = {}         # seconds of each part of ``build``
        self.graphs: dict = {}          # the external addresses -> (graph, exec) not in use now
        self.launches = 0
        #: launches after the first made with programmatic dependent launch (tuning replay_pdl: ``_capture``), or
        #: why the driver refused that (then they are plain)
        self.pdl = False
        self.pdl_refused = ""
        self.labels: dict = {}          # kernel label -> its launches in the step (what a fusion would save)
        #: ``stage_inputs``: page-locked host memory laid out as the arena's step inputs (``write`` fills it, the
        #: next ``launch`` copies its runs), per input index its offset there, and whether it was written
        self.stage = None
        self.stage_at: dict = {}
        self.stage_lo = 0
        self.stage_runs: list = []      # [lo, hi) arena offsets of each run ``launch`` copies
        self.staged = False

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise cuda_driver.DriverError(f"{what} failed with CUresult {rc}")

    @classmethod
    def build(cls, first: list[Launch], second: list[Launch], step_inputs: tuple[list, list],
              in_place: list | None = None, external: dict | None = None, pdl: bool = False) -> "Replay":
        """The replay of ``second`` (``first``: the same step run with other inputs; ``step_inputs``: the arrays
        each call was given, evaluated, row-contiguous). ``in_place``: (output, step input) array pairs of
        ``second`` a kernel may write over (``CachedKernel.in_place``): the output gets the input's buffer. The
        step inputs start as the second call's, in the arena, except those ``external`` names (step input index
        -> a device address of as many bytes, row-major, which the caller keeps alive and never moves: an MLX
        array in unified memory). ``pdl``: every launch but the first may start while the one before it ends
        (programmatic dependent launch; our kernels wait for it first: ``cuda_kernels.PRIOR_WAIT``). Raises
        ``Refused``; needs MLX's CUDA backend and kernel cache."""
        drv = cuda_driver.driver()
        if drv is None:
            raise Refused("no CUDA driver")
        lib = driver_lib(drv)
        if cc.cache_dir() is None:
            raise Refused("MLX keeps no kernel cache (MLX_PTX_CACHE_DIR is empty)")
        arrays, seen = [], set()
        for lns, step in zip((first, second), step_inputs):
            for a in list(step) + [x for ln in lns for x in ln.inputs + ln.outputs]:
                if id(a) not in seen:
                    seen.add(id(a))
                    arrays.append(a)
        t0 = time.perf_counter()
        mx.eval(arrays)
        infos = dict(zip((id(a) for a in arrays), describe(arrays)))
        t1 = time.perf_counter()
        refs = plan(first, second, infos, step_inputs)
        r = cls(drv, lib, drv.ffi)
        r.pdl = pdl
        r.inputs = list(step_inputs[1])
        try:
            r._lay_out(second, refs, infos, in_place or [], external or {})
            t2 = time.perf_counter()
            r._specs(second, refs, infos)
            t3 = time.perf_counter()
            r._capture()
            r.timings = {"describe": t1 - t0, "plan+arena": t2 - t1, "modules": t3 - t2,
                         "capture": time.perf_counter() - t3}
        except Exception:
            r.close()
            raise
        r.labels = dict(collections.Counter(ln.label for ln in second).most_common())
        r.input_keys = [id(a) for a in r.inputs]
        r.input_bytes = [a.nbytes for a in r.inputs]
        r.inputs = []                       # (the recorded arrays go: the replay keeps addresses and sizes)
        return r

    def _lay_out(self, second: list[Launch], refs: list, infos: dict, pairs: list, external: dict) -> None:
        """Arena offsets for the step inputs and the outputs (in-place ones at their input's), the arena
        allocated and the step inputs copied in; the constants held."""
        sizes: dict = {}
        for m, a in enumerate(self.inputs):
            info = infos[id(a)]
            if not info.row_contiguous:
                raise Refused(f"step input {m}: strides {info.strides}")
            if m not in external:
                sizes[id(a)] = info.extent
        same = {}
        for out, inp in pairs:
            hit = [(i, j) for i, ln in enumerate(second) for j, o in enumerate(ln.outputs) if o is out]
            if len(hit) != 1 or not any(inp is a for a in self.inputs):
                raise Refused("an in-place pair whose output no launch made or whose input is not a step input")
            i, j = hit[0]
            ln = second[i]
            want = ln.kernel.in_place.get(ln.kernel.output_names[j])
            read = None if want is None else infos[id(ln.inputs[ln.kernel.input_names.index(want)])]
            if read is None or read.address != infos[id(inp)].address or read.shape != infos[id(inp)].shape:
                raise Refused(f"launch {i} ({ln.label}): output {ln.kernel.output_names[j]} may not be written "
                              "over that input")
            if infos[id(out)].shape != infos[id(inp)].shape:
                raise Refused(f"launch {i} ({ln.label}): in place over an input of another shape")
            same[id(out)] = inp
        for ln in second:
            for o in ln.outputs:
                if id(o) not in same:
                    sizes[id(o)] = max(infos[id(o)].extent, 1)
        offsets, total = {}, 0
        for k, n in sizes.items():
            offsets[k] = total
            total += -(-n // ALIGN) * ALIGN
        p = self.ffi.new("unsigned long long*")
        self.drv.current()
        mx.synchronize()                    # the step inputs' bytes are MLX's work until it is done
        self._check(self.lib.cuMemAlloc_v2(p, max(total, ALIGN)), "cuMemAlloc")
        self.arena = int(p[0])
        self.addr = {k: self.arena + off for k, off in offsets.items()}
        for m, address in external.items():
            self.addr[id(self.inputs[m])] = int(address)
            self.external.add(id(self.inputs[m]))
        for out_id, inp in same.items():
            self.addr[out_id] = self.addr[id(inp)]
            self.same[out_id] = id(inp)
        for a in self.inputs:
            if id(a) in sizes and sizes[id(a)]:
                self._check(self.lib.cuMemcpyDtoD_v2(self.addr[id(a)], infos[id(a)].address, sizes[id(a)]),
                            "cuMemcpyDtoD")
        held = {}
        for ln, row in zip(second, refs):
            for a, ref in zip(ln.inputs, row):
                if ref.kind == "const":
                    held[id(a)] = a
        self.consts = list(held.values())

    def _function(self, ln: Launch):
        """The CUfunction of ``ln``'s instantiation, loaded from MLX's kernel cache."""
        k = ln.kernel
        ins = [(cc.dtype_name(a.dtype), a.ndim) for a in ln.inputs]
        outs = [cc.dtype_name(t) for t in ln.output_dtypes]
        key = (id(k), ln.template, tuple(ins), tuple(outs))
        if key in self.functions:
            return self.functions[key]
        func = cc.kernel_name(k.name, list(ln.template))
        src = cc.mlx_source(func, k.header, k.source, k.input_names, ins, k.output_names, outs, list(ln.template))
        path = cc.ptx_path(cc.cache_dir(), cc.module_name(func, src))
        if path not in self.modules:
            try:
                with open(path, "rb") as f:
                    image = f.read()
                with open(path[:-4] + ".txt") as f:
                    lowered = f.read().split("\t", 1)[1].split("\n", 1)[0].strip()
            except (OSError, IndexError) as e:
                why = _build_answer(k, ins, outs, ln)
                raise Refused(f"{ln.label}: not in MLX's kernel cache ({e}; our build: {why})") from None
            if not image.startswith(b"\x7fELF"):
                image += b"\0"              # PTX text: the driver reads it up to a NUL
            mod, fn = self.ffi.new("void**"), self.ffi.new("void**")
            self._check(self.lib.cuModuleLoadData(mod, self.ffi.from_buffer(image)), "cuModuleLoadData")
            self.modules[path] = (mod[0], None)
            self._check(self.lib.cuModuleGetFunction(fn, mod[0], lowered.encode()), "cuModuleGetFunction")
            self.modules[path] = (mod[0], fn[0])
        self.functions[key] = self.modules[path][1]
        return self.functions[key]

    def _specs(self, second: list[Launch], refs: list, infos: dict) -> None:
        """Per launch (function, grid, block, arguments as MLX's ``CustomKernel::eval_gpu`` makes them: an input's
        pointer, then its shape, strides, ndim where the source names them and its ndim > 0; then the outputs'
        pointers). A pointer is ("at", key, offset): ``self.addr[key] + offset`` when captured (``rebind`` moves
        them), or ("const", address)."""
        self.specs = []
        for i, (ln, row) in enumerate(zip(second, refs)):
            args = []
            shapes = cc.shape_infos(ln.kernel.source, ln.kernel.input_names)
            for j, (a, ref) in enumerate(zip(ln.inputs, row)):
                info = infos[id(a)]
                if ref.kind == "out":
                    args.append(("at", id(second[ref.which].outputs[ref.index]), ref.offset))
                elif ref.kind == "input":
                    args.append(("at", id(self.inputs[ref.which]), ref.offset))
                else:
                    args.append(("const", info.address))
                if a.ndim > 0:
                    sh, st, nd = shapes[j]
                    if sh:
                        args.append(("i32", tuple(info.shape)))
                    if st:
                        args.append(("i64", tuple(info.strides)))
                    if nd:
                        args.append(("ndim", len(info.shape)))
            args += [("at", id(o), 0) for o in ln.outputs]
            (tx, ty, tz), (gx, gy, gz) = ln.threadgroup, ln.grid
            block = (min(tx, gx), min(ty, gy), min(tz, gz))
            grid = (-(-gx // tx), -(-gy // ty), -(-gz // tz))
            self.specs.append((self._function(ln), grid, block, args))

    def _params(self, args: list, keep: list):
        ffi, new = self.ffi, []
        for kind, *v in args:
            if kind == "at":
                new.append(ffi.new("unsigned long long*", self.addr[v[0]] + v[1]))
            elif kind == "const":
                new.append(ffi.new("unsigned long long*", v[0]))
            elif kind == "i32":
                new.append(ffi.new(f"int32_t[{MAX_NDIM}]", list(v[0])))
            elif kind == "i64":
                new.append(ffi.new(f"int64_t[{MAX_NDIM}]", list(v[0])))
            else:
                new.append(ffi.new("int32_t*", v[0]))
        keep.extend(new)
        params = ffi.new(f"void*[{len(new)}]", [ffi.cast("void*", p) for p in new])
        keep.append(params)
        return params

    def _capture(self) -> None:
        """Capture the launches (``specs``, at the addresses now) as the graph to launch; with ``pdl``, a capture
        or instantiation the driver refuses is made again without it (why kept in ``pdl_refused``)."""
        try:
            self._capture_as(self.pdl)
        except cuda_driver.DriverError as e:
            if not self.pdl:
                raise
            self._drop_graph()
            self.pdl, self.pdl_refused = False, str(e)
            self._capture_as(False)

    def _destroy(self, graph, exec_) -> None:
        if exec_ is not None:
            self.lib.cuGraphExecDestroy(exec_)
        if graph is not None:
            self.lib.cuGraphDestroy(graph)

    def _drop_graph(self) -> None:
        self._destroy(self.graph, self.exec)
        self.exec = self.graph = None

    def _capture_as(self, pdl: bool) -> None:
        ffi, lib = self.ffi, self.lib
        keep: list = []
        launches = [(f, grid, block, self._params(args, keep)) for f, grid, block, args in self.specs]
        self.drv.current()
        if self.stream is None:
            s = ffi.new("void**")
            self._check(lib.cuStreamCreate(s, STREAM_NON_BLOCKING), "cuStreamCreate")
            self.stream = s[0]
        self._check(lib.cuStreamBeginCapture_v2(self.stream, CAPTURE_THREAD_LOCAL), "cuStreamBeginCapture")
        failed = None
        config = self._pdl_config(keep) if pdl else None
        for i, (f, grid, block, params) in enumerate(launches):
            if config is not None and i > 0:
                config.gx, config.gy, config.gz = grid
                config.bx, config.by, config.bz = block
                rc, call = lib.cuLaunchKernelEx(config, f, params, ffi.NULL), "cuLaunchKernelEx"
            else:
                rc, call = lib.cuLaunchKernel(f, *grid, *block, 0, self.stream, params, ffi.NULL), "cuLaunchKernel"
            if rc != 0:
                failed = f"{call} failed with CUresult {rc}"
                break
        g = ffi.new("void**")
        rc = lib.cuStreamEndCapture(self.stream, g)
        if rc == 0:
            self.graph = g[0]
        if failed or rc != 0:
            raise cuda_driver.DriverError(failed or f"cuStreamEndCapture failed with CUresult {rc}")
        e = ffi.new("void**")
        self._check(lib.cuGraphInstantiateWithFlags(e, self.graph, 0), "cuGraphInstantiate")
        self.exec = e[0]
        self.launches = len(launches)

    def _pdl_config(self, keep: list):
        """A launch configuration on the replay's stream whose one attribute allows programmatic serialization
        (its grid and block set per launch; the attribute kept alive in ``keep``)."""
        ffi = self.ffi
        attr = ffi.new("ortmlx_launch_attr*")
        attr.id, attr.value.allowed = ATTR_PROGRAMMATIC, 1
        keep.append(attr)
        config = ffi.new("ortmlx_launch_config*")
        config.stream, config.attrs, config.n_attrs = self.stream, attr, 1
        return config

    def _bound(self) -> tuple:
        return tuple(sorted((k, self.addr[k]) for k in self.external))

    def rebind(self, external: dict) -> None:
        """Step inputs ``build`` was given as ``external`` at other addresses from now on (step input index -> a
        device address: the outputs written over them move too): the graph captured at those addresses (kept, at
        most ``GRAPHS``; the last launch done first)."""
        self.wait()
        self.graphs[self._bound()] = (self.graph, self.exec)
        for m, address in external.items():
            if self.input_keys[m] not in self.external:
                raise ValueError(f"step input {m} is in the arena, not external")
            self.addr[self.input_keys[m]] = int(address)
        for out_key, in_key in self.same.items():
            self.addr[out_key] = self.addr[in_key]
        got = self.graphs.pop(self._bound(), None)
        if got is not None:
            self.graph, self.exec = got
            return
        while len(self.graphs) >= GRAPHS:
            self._destroy(*self.graphs.pop(next(iter(self.graphs))))
        self.exec = self.graph = None
        self._capture()

    def address(self, a) -> int:
        """The device address the replay keeps ``a`` (a step input or output of the second call) at."""
        return self.addr[id(a)]

    def input_address(self, index: int) -> int:
        return self.addr[self.input_keys[index]]

    def stage_inputs(self, buffer=None) -> None:
        """From now on ``write`` puts the step inputs in the arena that no kernel writes over (``same``) into
        page-locked host memory (``buffer(drv, nbytes)``: a ``cuda_driver.HostBuffer``, started as the arena's
        bytes) laid out as they lie in the arena, and ``launch`` copies each run of them that no other input lies
        between in one asynchronous copy before the graph: one copy a call, not one staged copy of pageable
        memory per input."""
        regions = sorted((self.addr[key] - self.arena, m) for m, key in enumerate(self.input_keys)
                         if key not in self.external and self.input_bytes[m])
        written_over = set(self.same.values())
        staged = {m for _, m in regions if self.input_keys[m] not in written_over}
        if not staged:
            return
        runs: list = []                     # [lo, hi) of each run of staged inputs, in arena offsets
        for off, m in regions:
            end = off + self.input_bytes[m]
            if m not in staged:
                runs.append(None)           # (a run ends here)
            elif runs and runs[-1] is not None:
                runs[-1][1] = max(runs[-1][1], end)
            else:
                runs.append([off, end])
        runs = [tuple(r) for r in runs if r is not None]
        lo, hi = runs[0][0], runs[-1][1]
        stage = (buffer or cuda_driver.HostBuffer)(self.drv, hi - lo)
        # it starts as the arena's bytes: an input not written before a launch keeps its value
        self.drv.current()
        self._check(self.lib.cuMemcpyDtoH_v2(self.ffi.cast("void*", stage.host_address), self.arena + lo, hi - lo),
                    "cuMemcpyDtoH")
        self.stage, self.stage_lo, self.stage_runs, self.staged = stage, lo, runs, False
        self.stage_at = {m: off - lo for off, m in regions if m in staged}

    def write(self, index: int, values: np.ndarray) -> None:
        """Step input ``index``'s new bytes (its size), copied before the next ``launch``."""
        data = np.ascontiguousarray(values)
        if data.nbytes != self.input_bytes[index]:
            raise ValueError(f"step input {index}: {data.nbytes} bytes for an array of {self.input_bytes[index]}")
        at = self.stage_at.get(index)
        if at is not None:
            # (the last copy out of it is done: a launch is always waited for before the next call's writes)
            self.stage.array[at:at + data.nbytes] = data.reshape(-1).view(np.uint8)
            self.staged = True
            return
        self.drv.current()
        # on the replay's stream: ordered before its next launch (a pageable source is staged before this returns)
        self._check(self.lib.cuMemcpyHtoDAsync_v2(self.input_address(index), self.ffi.from_buffer(data),
                                                  data.nbytes, self.stream), "cuMemcpyHtoDAsync")

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """``nbytes`` from device address ``src`` to ``dst`` on the replay's stream (before its next launch)."""
        self._check(self.lib.cuMemcpyDtoDAsync_v2(dst, src, nbytes, self.stream), "cuMemcpyDtoDAsync")

    def upload(self, dst: int, values: np.ndarray) -> None:
        """``values``' bytes to device address ``dst`` on the replay's stream (before its next launch)."""
        data = np.ascontiguousarray(values)
        self._check(self.lib.cuMemcpyHtoDAsync_v2(dst, self.ffi.from_buffer(data), data.nbytes, self.stream),
                    "cuMemcpyHtoDAsync")

    def launch(self) -> None:
        if self.staged:
            for lo, hi in self.stage_runs:
                self._check(self.lib.cuMemcpyHtoDAsync_v2(
                    self.arena + lo, self.ffi.cast("void*", self.stage.host_address + lo - self.stage_lo), hi - lo,
                    self.stream), "cuMemcpyHtoDAsync")
            self.staged = False
        self._check(self.lib.cuGraphLaunch(self.exec, self.stream), "cuGraphLaunch")

    def wait(self) -> None:
        self._check(self.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def read(self, a) -> np.ndarray:
        """A step input's or output's bytes in the arena now (after ``wait``), as an array of its shape and type
        (bfloat16 as uint16)."""
        out = np.empty(tuple(a.shape), np.dtype(cc.dtype_name(a.dtype)) if a.dtype != mx.bfloat16 else np.uint16)
        if out.nbytes:
            self._check(self.lib.cuMemcpyDtoH_v2(self.ffi.from_buffer(out), self.addr[id(a)], out.nbytes),
                        "cuMemcpyDtoH")
        return out

    def close(self) -> None:
        lib = self.lib
        if self.stream is not None:
            lib.cuStreamSynchronize(self.stream)
        for g, e in self.graphs.values():
            self._destroy(g, e)
        self.graphs = {}
        self._drop_graph()
        if self.stream is not None:
            lib.cuStreamDestroy_v2(self.stream)
        if self.arena is not None:
            lib.cuMemFree_v2(self.arena)
        for mod, _ in self.modules.values():
            lib.cuModuleUnload(mod)
        self.stream = self.arena = None
        self.modules, self.consts = {}, []
        if self.stage is not None:
            self.stage.free()
            self.stage, self.stage_at = None, {}


@functools.lru_cache(maxsize=1)
def driver_lib(drv):
    """The driver library with the calls a replay makes (another cffi handle on ``libcuda.so.1``)."""
    ffi = drv.ffi
    ffi.cdef(DRIVER_CDEF, override=True)
    return ffi.dlopen("libcuda.so.1")

