"""kernels/cuda_cache.py: our custom kernels' builds kept in MLX's kernel cache under MLX's own module names.

On any machine: libstdc++'s string hash (against g++'s), MLX's cache paths, the builder writing and finding a
module (a stand-in compiler), the kernel wrapper. With NVRTC installed (``nvidia-cuda-nvrtc``, MLX's shipped
headers): every kernel compiles against the stand-in header. On MLX's CUDA backend: the reproduced source is
MLX's, a new process loads the module instead of building it, and its results are MLX's build's bit for bit.
"""
from __future__ import annotations

import glob
import io
import os
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from ortmlx.kernels import cuda_cache as cc
from ortmlx.kernels import cuda_kernels

GPU = cuda_kernels.cuda_backend()
SAMPLES = [b"", b"a", b"abcdefg", b"abcdefgh", b"abcdefghi", bytes(range(256)) * 3, cc.STANDIN.encode()]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_std_hash_is_libstdcxx_string_hash(tmp_path):
    prog = tmp_path / "h.cpp"
    prog.write_text(textwrap.dedent("""
        #include <cstdio>
        #include <fstream>
        #include <sstream>
        #include <string>
        int main(int argc, char** argv) {
          for (int i = 1; i < argc; ++i) {
            std::ifstream f(argv[i], std::ios::binary); std::stringstream ss; ss << f.rdbuf();
            std::printf("%zx\\n", std::hash<std::string>{}(ss.str()));
          }
        }"""))
    exe = tmp_path / "h"
    subprocess.run(["g++", "-O1", "-o", str(exe), str(prog)], check=True, capture_output=True)
    files = []
    for i, data in enumerate(SAMPLES):
        p = tmp_path / f"s{i}"
        p.write_bytes(data)
        files.append(str(p))
    want = subprocess.run([str(exe), *files], check=True, capture_output=True, text=True).stdout.split()
    assert [f"{cc.std_hash(d):x}" for d in SAMPLES] == want


def test_names_and_paths_follow_mlx():
    tmpl = [("T", mx.float16), ("N", 4), ("B", True), ("C", False)]
    assert cc.kernel_name("k", tmpl) == "custom_kernel_k_float16_t_4_t_f"
    body = "out[0] = x[x_strides[0]] + y[0] * y_shape[0] + z_ndim;"
    src = cc.mlx_source("custom_kernel_k", "// head\n", body, ["x", "y", "z"],
                        [("float16", 2), ("int32", 0), ("bfloat16", 3)], ["out", "o2"], ["float32", "uint8"], tmpl)
    assert "    const __half* x,\n    const __grid_constant__ Strides x_strides,\n" in src
    # a 0-d input gets no shape arguments, even when the source names them
    assert "    const int32_t* y,\n    const __nv_bfloat16* z,\n    const __grid_constant__ int z_ndim,\n" in src
    assert "    float* out,\n    uint8_t* o2) {\n" in src
    assert "  using T = __half;\n  constexpr int N = 4;\n  constexpr bool B = true;\n  constexpr bool C = false;\n" \
        in src
    assert src.startswith('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
                          "// head\nnamespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
                          "__global__ void custom_kernel_k(\n")
    assert src.endswith(body + "\n}\n\n} // namespace mlx::core::cu\n")
    assert cc.mlx_source("f", "", "s", [], [], ["o"], ["float32"], []).endswith("float* o) {\ns\n}\n\n} // namespace "
                                                                               "mlx::core::cu\n")
    assert cc.module_name("f", src) == f"f_{cc.std_hash(src.encode()):x}"
    assert cc.ptx_path("/c", "m" * 10) == "/c/" + "m" * 10 + ".ptx"
    long = "a" * 245 + "b" * 245 + "c" * 7
    assert cc.ptx_path("/c", long) == "/c/" + "a" * 245 + "/" + "b" * 245 + "/" + "c" * 7 + ".ptx"


class _FakeNvrtc:
    path = "libnvrtc-stand-in.so"

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail

    def compile(self, src, file, name, options, headers):
        self.calls.append((file, name, options, headers))
        if self.fail:
            raise cc.NvrtcError(self.fail)
        return b"CUBIN" + src.encode()[:8], "_Z_lowered"


def test_builder_writes_the_module_mlx_reads_then_finds_it(tmp_path):
    nv = _FakeNvrtc()
    b = cc.Builder(nv, "sm_90a", ["/inc"], str(tmp_path))
    src = "__global__ void f() {}"
    assert b.ensure("custom_kernel_f", src) == "built"
    path = cc.ptx_path(str(tmp_path), cc.module_name("custom_kernel_f", src))
    assert open(path, "rb").read() == b"CUBIN" + src.encode()[:8]
    assert open(path[:-4] + ".txt").read() == "mlx::core::cu::custom_kernel_f\t_Z_lowered\n"
    file, name, options, headers = nv.calls[0]
    assert name == "mlx::core::cu::custom_kernel_f" and headers == cc.HEADERS
    assert options[:2] == ["--device-as-default-execution-space", "--gpu-architecture=sm_90a"]
    assert "--include-path=/inc" in options
    assert b.ensure("custom_kernel_f", src) == "built" and len(nv.calls) == 1          # remembered
    assert cc.Builder(nv, "sm_90a", [], str(tmp_path)).ensure("custom_kernel_f", src) == "cached"
    assert len(nv.calls) == 1 and not glob.glob(str(tmp_path / "*.tmp"))
    assert b.counts == {"cached": 0, "built": 1, "failed": 0}


def test_a_failed_build_writes_nothing(tmp_path):
    b = cc.Builder(_FakeNvrtc(fail="error: identifier is undefined"), "sm_90a", [], str(tmp_path))
    st = b.ensure("custom_kernel_g", "x")
    assert st.startswith("failed: ") and "undefined" in st
    assert os.listdir(tmp_path) == [] and b.counts["failed"] == 1


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(cc.os, "replace", refuse)
    b = cc.Builder(_FakeNvrtc(), "sm_90a", [], str(tmp_path))
    assert b.ensure("custom_kernel_h", "y") == "failed: disk full"
    assert os.listdir(tmp_path) == []


def test_nvrtc_is_mlxs_among_several(monkeypatch, tmp_path):
    import builtins
    libs = {n: tmp_path / n for n in ("libnvrtc.so.12", "libnvrtc.so.13")}
    for p in libs.values():
        p.write_bytes(b"")
    maps = "".join(f"7f00-7f10 r-xp 0 0:0 0 {p}\n" for p in libs.values()) + "7f20-7f30 r-xp 0 0:0 0 /x/libc.so.6\n"
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: io.StringIO(maps) if f == "/proc/self/maps"
                        else real_open(f, *a, **k))
    assert cc.loaded_nvrtc(13) == str(libs["libnvrtc.so.13"]) and cc.loaded_nvrtc(12) == str(libs["libnvrtc.so.12"])
    assert cc.loaded_nvrtc(None) is None and cc.loaded_nvrtc(11) is None       # which is MLX's is not known
    maps = f"7f00-7f10 r-xp 0 0:0 0 {libs['libnvrtc.so.12']}\n"
    assert cc.loaded_nvrtc(None) == str(libs["libnvrtc.so.12"])


def test_cache_dir_is_mlxs(monkeypatch, tmp_path):
    import tempfile
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    assert cc.cache_dir() == str(tmp_path)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "")              # MLX keeps no cache then: nothing is written
    assert cc.cache_dir() is None
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    assert cc.cache_dir() == os.path.join(tempfile.gettempdir(), "mlx", mx.__version__, "ptx")


def test_a_failing_builder_never_reaches_the_call(monkeypatch):
    def broken():
        raise RuntimeError("boom")
    monkeypatch.setattr(cc, "builder", broken)
    got = []
    k = cc.CachedKernel("k", ["x"], ["out"], "src", "", lambda **kw: got.append(kw) or ["r"])
    x = mx.zeros((2,), mx.float32)
    assert k(inputs=[x], output_dtypes=[mx.float32], template=[("T", mx.float32)]) == ["r"]
    assert list(k.seen.values()) == ["failed: RuntimeError: boom"]
    assert k(inputs=[x], output_dtypes=[mx.float32], template=[("T", object())]) == ["r"]   # MLX's to refuse
    assert k(inputs=[1.0], output_dtypes=[mx.float32]) == ["r"] and len(got) == 3


def test_our_kernels_stay_clear_of_mlxs_header_names():
    """Our kernel texts may not name what MLX's device header declares beyond the stand-in's: a definition there
    would be MLX's in MLX's build and ours in ours, under one module name."""
    import re
    from ortmlx.kernels import cuda_rows
    for mod in (cuda_kernels, cuda_rows):
        text = open(mod.__file__).read()
        for name in cc.MLX_HEADER_NAMES:
            assert not re.search(rf"\b{name}\b", text), (mod.__name__, name)


def test_cached_kernel_prepares_each_instantiation_once(monkeypatch):
    got, made = [], []
    monkeypatch.setattr(cc.CachedKernel, "prepare", lambda self, *a: made.append(a) or "built")
    k = cc.CachedKernel("k", ["x"], ["out"], "src", "", lambda **kw: got.append(kw) or ["r"])
    x16, x32 = mx.zeros((2, 3), mx.float16), mx.zeros((2, 3), mx.float32)
    for x in (x16, x16, x32):
        assert k(inputs=[x], output_dtypes=[x.dtype], template=[("T", x.dtype)], grid=(1, 1, 1)) == ["r"]
    assert made == [([("T", mx.float16)], [("float16", 2)], ["float16"]),
                    ([("T", mx.float32)], [("float32", 2)], ["float32"])]
    assert [kw["grid"] for kw in got] == [(1, 1, 1)] * 3 and got[0]["inputs"][0] is x16
    for v in (True, 1):                     # two instantiations (custom_kernel_k_t, custom_kernel_k_1)
        k(inputs=[x16], output_dtypes=[x16.dtype], template=[("N", v)])
    assert [m[0] for m in made[2:]] == [[("N", True)], [("N", 1)]]


# a worker that speaks nvrtc.serve's protocol: each job takes DELAY s; a job whose name holds "fail" is refused, one
# whose name holds "die" ends the worker unanswered, one whose name holds "linger" closes its output and exits 1 s later
_FAKE_WORKER = """
import importlib.util, json, os, sys, time
spec = importlib.util.spec_from_file_location("nvrtc", {path!r})      # (as the real worker: no package import)
nvrtc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nvrtc)
write_module = nvrtc.write_module
for line in sys.stdin:
    job = json.loads(line)
    time.sleep({delay})
    if "die" in job["name"]:
        sys.exit(3)
    if "linger" in job["name"]:
        os.close(1)
        time.sleep(1.0)
        sys.exit(3)
    if "fail" in job["name"]:
        print(json.dumps({{"ok": False, "error": "NvrtcError: refused"}}), flush=True)
        continue
    write_module(job["path"], b"CUBIN" + job["name"].encode(), (job["name"] + "\\t_Z\\n").encode())
    print(json.dumps({{"ok": True, "pid": os.getpid()}}), flush=True)
"""


def _pooled(tmp_path, workers: int, delay: float) -> cc.Builder:
    script = tmp_path / "worker.py"
    from ortmlx.kernels import nvrtc
    script.write_text(_FAKE_WORKER.format(path=nvrtc.__file__, delay=delay))
    b = cc.Builder(_FakeNvrtc(), "sm_90a", [], str(tmp_path / "cache"), workers=workers)
    b.pool.command = [sys.executable, str(script)]
    return b


def test_a_worker_that_stops_answering_gets_no_more_jobs(tmp_path):
    """A worker whose output ends before it has exited: the next job goes to a new worker (written to the
    exiting one, it was lost as well)."""
    b = _pooled(tmp_path, workers=2, delay=0.01)
    b.pool.workers = 1                      # one feeder thread: both jobs go through it, in order
    for f in ("custom_kernel_linger", "custom_kernel_ok"):
        assert b.submit(f, "s") == "queued"
    assert b.settle(30)
    assert b.state[b.job("custom_kernel_linger", "s")["path"]] == "failed: the build worker exited"
    assert b.state[b.job("custom_kernel_ok", "s")["path"]] == "built"


def test_workers_build_at_once_and_settle_waits_for_them(tmp_path):
    import time
    b = _pooled(tmp_path, workers=3, delay=1.0)
    t0 = time.perf_counter()
    assert [b.submit(f"custom_kernel_k{i}", f"src {i}") for i in range(6)] == ["queued"] * 6
    assert b.submit("custom_kernel_k0", "src 0") == "queued" and b.pool.jobs.qsize() <= 6     # queued once
    assert b.settle(30) and not b.flight
    took = time.perf_counter() - t0
    assert took < 4.5, took                  # six 1 s builds, three at a time (one at a time: 6 s)
    assert b.counts == {"cached": 0, "built": 6, "failed": 0} and b.pool.live <= 3
    for i in range(6):
        mod = cc.module_name(f"custom_kernel_k{i}", f"src {i}")
        assert open(cc.ptx_path(b.dir, mod), "rb").read() == f"CUBINmlx::core::cu::custom_kernel_k{i}".encode()
        assert b.submit(f"custom_kernel_k{i}", f"src {i}") == "built"
    again = cc.Builder(_FakeNvrtc(), "sm_90a", [], b.dir, workers=3)
    assert again.submit("custom_kernel_k5", "src 5") == "cached" and again.pool.live == 0


def test_a_build_past_the_wait_is_given_up_once(tmp_path):
    import time
    b = _pooled(tmp_path, workers=2, delay=1.5)
    assert b.submit("custom_kernel_slow", "s") == "queued"
    t0 = time.perf_counter()
    assert not b.settle(0.2) and not b.flight
    assert b.state[b.job("custom_kernel_slow", "s")["path"]] == "failed: not built within 0.2 s"
    assert b.settle(5) and time.perf_counter() - t0 < 1.0          # nothing left to wait for
    time.sleep(2.0)                                                 # its late answer changes nothing
    assert b.counts == {"cached": 0, "built": 0, "failed": 1}
    assert b.state[b.job("custom_kernel_slow", "s")["path"]].startswith("failed: not built")


def test_a_refused_or_lost_build_is_left_to_mlx(tmp_path):
    b = _pooled(tmp_path, workers=2, delay=0.05)
    for f in ("custom_kernel_fail", "custom_kernel_die", "custom_kernel_ok"):
        assert b.submit(f, "s") == "queued"
    assert b.settle(30)
    assert b.state[b.job("custom_kernel_fail", "s")["path"]] == "failed: NvrtcError: refused"
    assert b.state[b.job("custom_kernel_die", "s")["path"]] == "failed: the build worker exited"
    assert b.ensure("custom_kernel_ok", "s") == "built" and b.counts == {"cached": 0, "built": 1, "failed": 2}
    assert sorted(os.listdir(b.dir)) == sorted(os.path.basename(cc.ptx_path(b.dir, cc.module_name(
        "custom_kernel_ok", "s")))[:-4] + e for e in (".ptx", ".txt"))
    assert b.ensure("custom_kernel_late", "t") == "built"            # a new worker after the lost one


def test_workers_only_where_the_interpreter_can_start_them(monkeypatch):
    monkeypatch.setattr(cc.os, "cpu_count", lambda: 64)
    for exe, n in (("/usr/bin/python3", cc.WORKERS_MAX), ("/opt/venv/bin/python3.12", cc.WORKERS_MAX),
                   ("/usr/bin/my-app", 1), ("", 1)):
        monkeypatch.setattr(cc.sys, "executable", exe)
        assert cc.worker_count() == n, exe
    monkeypatch.setattr(cc.sys, "executable", "/usr/bin/python3")
    monkeypatch.setattr(cc.os, "cpu_count", lambda: 1)
    assert cc.worker_count() == 1


def test_the_worker_script_needs_only_the_standard_library(tmp_path):
    """The pool runs ``nvrtc.py`` by path with ``-I -S`` (no site-packages): it gets as far as loading NVRTC."""
    from ortmlx.kernels import nvrtc
    r = subprocess.run([sys.executable, "-I", "-S", nvrtc.__file__, str(tmp_path / "libnvrtc-missing.so")],
                       input="", capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "OSError" in r.stderr and "libnvrtc-missing.so" in r.stderr, r.stderr[-500:]
    assert "ImportError" not in r.stderr and "ModuleNotFoundError" not in r.stderr


def test_serve_answers_each_job(tmp_path):
    from ortmlx.kernels import nvrtc
    import json
    out, nv = io.StringIO(), _FakeNvrtc()
    (tmp_path / "plain").write_text("")
    job = {"src": "abc", "file": "a.cu", "name": "n", "options": ["-x"], "headers": {"h": "t"}}
    jobs = [json.dumps(dict(job, path=str(tmp_path / "m.ptx"))), "not json",
            json.dumps(dict(job, path=str(tmp_path / "plain" / "m.ptx")))]          # (under a file: unwritable)
    nvrtc.serve(nv, iter(jobs), out)
    replies = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [r["ok"] for r in replies] == [True, False, False] and len(nv.calls) == 2
    assert nv.calls[0] == ("a.cu", "n", ["-x"], {"h": "t"})
    assert (tmp_path / "m.ptx").read_bytes() == b"CUBINabc" and (tmp_path / "m.txt").read_text() == "n\t_Z_lowered\n"
    assert replies[1]["error"].startswith("JSONDecodeError") and "Error" in replies[2]["error"]


def test_a_graph_build_queues_its_kernels_and_a_lone_call_waits(monkeypatch):
    from ortmlx.kernels import build
    calls = []

    class Stub:
        def submit(self, func, src):
            calls.append(("submit", func))
            return "queued"

        def ensure(self, func, src):
            calls.append(("ensure", func))
            return "built"
    monkeypatch.setattr(cc, "builder", lambda: Stub())
    k = cc.CachedKernel("k", ["x"], ["out"], "src", "", lambda **kw: ["r"])
    x = mx.zeros((2,), mx.float32)
    with build.active(build.BuildContext()):
        k(inputs=[x], output_dtypes=[mx.float32], template=[("T", mx.float32)])
    k(inputs=[x], output_dtypes=[mx.float32], template=[("T", mx.float16)])
    assert calls == [("submit", "custom_kernel_k_float"), ("ensure", "custom_kernel_k_float16_t")]
    assert list(k.seen.values()) == ["queued", "built"]


def test_eager_runs_and_traces_wait_for_their_builds(monkeypatch):
    """An eager run's graph build and a closure's trace each end by waiting for the kernel builds they queued."""
    from onnx import TensorProto as T
    from onnx import helper
    import ortmlx.compiled as C
    from ortmlx.testing import make_model, session
    model = make_model([helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Neg", ["h"], ["y"])],
                       [("x", T.FLOAT, ["N", 4])], [("y", T.FLOAT, ["N", 4])], {})
    seen = []
    monkeypatch.setattr(cc, "settle", lambda: seen.append(C.tracing()))
    x = {"x": np.arange(8, dtype=np.float32).reshape(2, 4) - 3}
    session(model, options={"no_compile": "1"}).run(None, x)
    assert seen == [False]
    seen.clear()
    s = session(model)
    for _ in range(3):
        np.testing.assert_array_equal(s.run(None, x)[0], -np.maximum(x["x"], 0))
    assert True in seen                  # the trace's own wait


@pytest.mark.skipif(GPU, reason="on a machine without MLX's CUDA backend")
def test_builder_is_off_without_a_cuda_device(monkeypatch):
    monkeypatch.setattr(cc, "_builder", [])
    monkeypatch.setattr(cc, "_reason", [])
    assert cc.builder() is None and cc.reason()


def test_an_off_builder_on_a_cuda_backend_says_why_once(monkeypatch, capsys):
    """Off on MLX's CUDA backend for a reason other than the user's kernel_cache=0: one stderr line naming it."""
    import mlx.core as mx
    monkeypatch.setattr(cc, "_builder", [])
    monkeypatch.setattr(cc, "_reason", [])
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cc, "loaded_nvrtc", lambda major=None: None)
    monkeypatch.setattr(mx, "device_info", lambda d: {"compute_capability_major": 9, "compute_capability_minor": 0})
    monkeypatch.setattr(mx, "__version__", cc.MLX_VERSIONS[0])
    monkeypatch.setenv("ORTMLX_TUNING", "")
    assert cc.builder() is None and cc.builder() is None
    err = capsys.readouterr().err
    assert err.count("MLXExecutionProvider: our CUDA kernels are not kept") == 1, err
    assert "no NVRTC library of MLX's loaded (or several)" in err, err
    monkeypatch.setattr(cc, "_builder", [])
    monkeypatch.setattr(cc, "_reason", [])
    monkeypatch.setenv("ORTMLX_TUNING", "kernel_cache=0")
    assert cc.builder() is None and cc.reason() == "tuning kernel_cache=0"
    assert capsys.readouterr().err == ""


def _nvrtc_setup():
    """(library, include paths) of an installed NVRTC wheel and MLX's shipped headers, else None."""
    lib, incs = cc.wheel_nvrtc(), cc.include_paths()
    if lib is None or not all(os.path.isdir(p) for p in incs) or len(incs) < 3:
        return None
    return lib, incs


@pytest.mark.skipif(_nvrtc_setup() is None, reason="needs the nvidia-cuda-nvrtc wheel and MLX's CUDA headers")
def test_every_kernel_compiles_against_the_standin():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    from cuda_kernel_check import check_all
    lib, incs = _nvrtc_setup()
    assert check_all(cc.Nvrtc(lib), incs, "sm_90a", quiet=True) == 0


# ------------------------------------------------------------------ on MLX's CUDA backend
_CHILD = """
import json, sys, time
import mlx.core as mx
import numpy as np
import ortmlx
from ortmlx.kernels import build, cuda_cache, cuda_kernels
rng = np.random.default_rng(0)
x = mx.array(rng.standard_normal((3, 896)).astype(np.float16))
s = mx.array(rng.standard_normal((3, 896)).astype(np.float16))
g = mx.array(rng.standard_normal((896,)).astype(np.float16))
t0 = time.perf_counter()
with build.active(build.BuildContext(cuda_kernels=True)):
    out, total = cuda_kernels.rms_norm(x, g, 1e-6, skip=s)
cuda_cache.settle()                 # as a build's end does: its kernels' builds done before its eval
mx.eval(out, total)
b = cuda_cache.builder()
print(json.dumps({"s": time.perf_counter() - t0, "out": np.array(out).tolist(), "sum": np.array(total).tolist(),
                  "counts": b.counts if b else None, "reason": cuda_cache.reason(),
                  "failures": b.failures if b else []}))
"""


def _child(cache: str, kernel_cache: bool) -> dict:
    import json
    env = dict(os.environ, MLX_PTX_CACHE_DIR=cache, ORTMLX_TUNING="" if kernel_cache else "kernel_cache=0")
    r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GPU, reason="needs MLX's CUDA backend")
def test_mlx_source_is_what_mlx_builds(capfd):
    k = cuda_kernels._norm_kernel(1e-6)
    x = mx.zeros((3, 896), mx.float16)
    g = mx.zeros((896,), mx.float16)
    tmpl = [("T", mx.float16), ("HIDDEN", 896), ("HAS_SKIP", True), ("HAS_BIAS", False)]
    k.fn(inputs=[x, x, x, g], output_dtypes=[mx.float16, mx.float16], output_shapes=[x.shape, x.shape],
         template=tmpl, grid=(32, 3, 1), threadgroup=(32, 1, 1), verbose=True)
    printed = capfd.readouterr().out
    src = cc.mlx_source(cc.kernel_name(k.name, tmpl), k.header, k.source, k.input_names,
                        [("float16", 2)] * 3 + [("float16", 1)], k.output_names, ["float16", "float16"], tmpl)
    body = printed.split("```\n", 1)[1].rsplit("\n```", 1)[0]
    assert body == src


@pytest.mark.skipif(not GPU, reason="needs MLX's CUDA backend")
def test_a_new_process_loads_the_kernel_mlx_would_build(tmp_path):
    first = _child(str(tmp_path / "on"), True)
    assert first["reason"] is None and first["counts"]["built"] >= 1 and not first["failures"], first
    again = _child(str(tmp_path / "on"), True)
    assert again["counts"]["cached"] >= 1 and again["counts"]["built"] == 0, again
    mlx_own = _child(str(tmp_path / "off"), False)
    assert mlx_own["counts"] is None and "kernel_cache=0" in mlx_own["reason"]
    assert not glob.glob(str(tmp_path / "off" / "custom_kernel_*.ptx"))      # MLX writes none of its own
    for r in (first, again):
        assert r["out"] == mlx_own["out"] and r["sum"] == mlx_own["sum"]
    print(f"first launch: built here {first['s']:.2f} s, loaded {again['s']:.2f} s, MLX's build {mlx_own['s']:.2f} s")


_SENTINEL = r"""
import json, os
import mlx.core as mx
import numpy as np
import ortmlx
from ortmlx.kernels import build, cuda_cache as cc, cuda_kernels
x = mx.array(np.random.default_rng(0).standard_normal((3, 896)).astype(np.float16))
g = mx.ones((896,), mx.float16)
k = cuda_kernels._norm_kernel(1e-6)
tmpl = [("T", mx.float16), ("HIDDEN", 896), ("HAS_SKIP", True), ("HAS_BIAS", False)]
ins = [("float16", 2), ("float16", 2), ("float16", 1), ("float16", 1)]
func = cc.kernel_name(k.name, tmpl)
real = cc.mlx_source(func, k.header, k.source, k.input_names, ins, k.output_names, ["float16", "float16"], tmpl)
# the same parameters as the real kernel's (the names its source uses, kept in comments), a body that writes 7
body = "if (blockIdx.x == 0 && threadIdx.x == 0) { out[0] = T(7.0f); }\n" + \
    "\n".join("// " + line for line in k.source.splitlines())
fake = cc.mlx_source(func, k.header, body, k.input_names, ins, k.output_names, ["float16", "float16"], tmpl)
assert cc.shape_infos(body, k.input_names) == cc.shape_infos(k.source, k.input_names)
b = cc.builder()
cubin, lowered = b.nvrtc.compile(fake, "fake.cu", "mlx::core::cu::" + func, b.options, cc.HEADERS)
cc.write_module(cc.ptx_path(b.dir, cc.module_name(func, real)), cubin, f"mlx::core::cu::{func}\t{lowered}\n".encode())
with build.active(build.BuildContext(cuda_kernels=True)):
    out, _ = cuda_kernels.rms_norm(x, g, 1e-6, skip=x)
    mx.eval(out)
print(json.dumps({"first": float(np.array(out)[0, 0]), "counts": b.counts}))
"""


@pytest.mark.skipif(not GPU, reason="needs MLX's CUDA backend")
def test_mlx_launches_the_module_written_under_its_name(tmp_path):
    """A stand-in kernel (it writes 7) written under the module name of rms_norm's source is what MLX launches:
    the name, the path and the mangled-name file are the ones MLX reads."""
    import json
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp_path), ORTMLX_TUNING="")
    r = subprocess.run([sys.executable, "-c", _SENTINEL], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["first"] == 7.0 and got["counts"]["cached"] == 1, got


@pytest.mark.parametrize("as_bytes", [True, False], ids=["byte_copies", "typed"])
def test_prebuilt_copies_are_the_instantiations_the_copies_use(monkeypatch, as_bytes):
    """``prebuild_copies`` queues exactly the two instantiations the staged upload and the driver's self-test copy
    (int32) then wait for; with tuning ``byte_copies`` a copy of any type or rank uses that one instantiation."""
    from ortmlx.kernels import cuda_kernels as ck
    calls = []
    monkeypatch.setattr(ck, "byte_copies", lambda: as_bytes)

    class Stub:
        def submit(self, func, src):
            calls.append(("submit", func, src))
            return "queued"

        def ensure(self, func, src):
            calls.append(("ensure", func, src))
            return "built"
    monkeypatch.setattr(cc, "builder", lambda: Stub())
    monkeypatch.setattr(ck, "usable", lambda: True)
    monkeypatch.setattr(ck, "_PREBUILT", [])
    monkeypatch.setattr(ck, "_kernel", lambda prefix, ins, outs, source, header="", **kw: cc.CachedKernel(
        prefix, ins, outs, source, header, lambda **k: [mx.zeros((1,), mx.uint8)]))
    for f in (ck._copy_in_kernel, ck._copy_any_kernel):
        f.cache_clear()
    try:
        ck.prebuild_copies()
        ck.prebuild_copies()                    # once a process
        stage = mx.bitwise_or(mx.array(5, dtype=mx.uint64), mx.array(0, mx.uint64))    # as ``Uploader`` makes it
        ck.copy_from_address(stage, 100)
        for a in ((mx.zeros((3, 5), mx.float16), mx.zeros((7,), mx.int32), mx.zeros((2, 2, 2, 3), mx.float32))
                  if as_bytes else (mx.zeros((7,), mx.int32),)):      # (the self-test's copy: int32 rows)
            ck.copy_to_address(a, mx.array([1, a.nbytes], dtype=mx.uint64))
    finally:
        for f in (ck._copy_in_kernel, ck._copy_any_kernel):
            f.cache_clear()
    queued = {(f, s) for kind, f, s in calls if kind == "submit"}
    waited = {(f, s) for kind, f, s in calls if kind == "ensure"}
    assert len([c for c in calls if c[0] == "submit"]) == 2 and len(queued) == 2
    assert waited == queued, (sorted(f for f, _ in waited), sorted(f for f, _ in queued))
    assert all(("const uint8_t* src" in s) == as_bytes for f, s in queued if "copy_any" in f)
