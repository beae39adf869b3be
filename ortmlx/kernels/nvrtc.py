"""NVRTC through ctypes, and the worker process that builds our kernels into MLX's kernel cache.

Imported by ``kernels/cuda_cache.py``, and run as a script by file path (``python -I -S nvrtc.py LIBNVRTC``) in the
worker processes that build several kernels at once: NVRTC compiles one program at a time in a process (two
threads of one process built no faster than one), so parallel builds take processes. Standard library only, so a
worker starts without importing ortmlx, MLX or ONNX Runtime. A worker reads one JSON job a line on stdin
(``build``'s fields), builds it, writes the module where MLX looks, and answers one JSON line.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import threading


class NvrtcError(RuntimeError):
    pass


class Nvrtc:
    """An NVRTC library through ctypes (in the main process: the one MLX loaded, ``cuda_cache.loaded_nvrtc``)."""

    def __init__(self, path: str):
        self.path = path
        lib = self.lib = ctypes.CDLL(path)
        P, C, S = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        for fn, args in (("nvrtcCreateProgram", [ctypes.POINTER(P), C, C, ctypes.c_int, ctypes.POINTER(C),
                                                 ctypes.POINTER(C)]),
                         ("nvrtcAddNameExpression", [P, C]),
                         ("nvrtcCompileProgram", [P, ctypes.c_int, ctypes.POINTER(C)]),
                         ("nvrtcGetProgramLogSize", [P, ctypes.POINTER(S)]),
                         ("nvrtcGetProgramLog", [P, C]),
                         ("nvrtcGetLoweredName", [P, C, ctypes.POINTER(C)]),
                         ("nvrtcGetCUBINSize", [P, ctypes.POINTER(S)]),
                         ("nvrtcGetCUBIN", [P, C]),
                         ("nvrtcDestroyProgram", [ctypes.POINTER(P)]),
                         ("nvrtcVersion", [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)])):
            f = getattr(lib, fn)
            f.argtypes, f.restype = args, ctypes.c_int
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise NvrtcError(f"{what} failed with nvrtcResult {rc}")

    def compile(self, src: str, file: str, name: str, options: list[str],
                headers: dict[str, str]) -> tuple[bytes, str]:
        """(cubin, ``name``'s lowered name) of ``src`` compiled with ``options``; ``headers``: include name ->
        text, found before the include paths."""
        lib, prog = self.lib, ctypes.c_void_p()
        hn = (ctypes.c_char_p * len(headers))(*[k.encode() for k in headers])
        ht = (ctypes.c_char_p * len(headers))(*[v.encode() for v in headers.values()])
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), file.encode(), len(headers), ht, hn),
                    "nvrtcCreateProgram")
        try:
            self._check(lib.nvrtcAddNameExpression(prog, name.encode()), "nvrtcAddNameExpression")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            rc = lib.nvrtcCompileProgram(prog, len(options), opts)
            if rc != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(prog, log)
                raise NvrtcError(f"{file}: {log.value.decode(errors='replace').strip()[:400]}")
            lowered = ctypes.c_char_p()
            self._check(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)), "nvrtcGetLoweredName")
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            buf = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
            return buf.raw, lowered.value.decode()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def write_module(path: str, cubin: bytes, names: bytes) -> None:
    """The names (``.txt``) then the module (``.ptx``, which MLX checks first), each through a rename."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for p, data in ((path[:-4] + ".txt", names), (path, cubin)):
        tmp = f"{p}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, p)
        finally:
            if os.path.exists(tmp):         # (a failed write: nothing half-written is left for MLX to find)
                os.remove(tmp)


def build(nv, job: dict) -> None:
    """Compile ``job["src"]`` (as file ``job["file"]``, the kernel ``job["name"]``, with ``job["options"]`` and
    ``job["headers"]``) and write it and its lowered name to ``job["path"]``; raises on any failure."""
    cubin, lowered = nv.compile(job["src"], job["file"], job["name"], job["options"], job["headers"])
    write_module(job["path"], cubin, f"{job['name']}\t{lowered}\n".encode())


def serve(nv, lines, out) -> None:
    """Build each job of ``lines`` (JSON) in turn, answering ``{"ok": true}`` or ``{"ok": false, "error": ...}``."""
    for line in lines:
        try:
            build(nv, json.loads(line))
            reply = {"ok": True}
        except Exception as e:  # noqa: BLE001 - the caller records it; MLX builds that kernel itself
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    serve(Nvrtc(sys.argv[1]), sys.stdin, sys.stdout)
