"""One ORT copy's C API as seen from Python (onnxruntime and onnxruntime-genai
each load their own ORT: every factory keeps the Abi of the ORT that created it).
"""
from __future__ import annotations

import sys

import numpy as np

from ..kernels import dtypes as dt
from ..version import set_loaded_ort
from . import cdef
from .errors import OrtCallError

ATTR_INT, ATTR_INTS, ATTR_FLOAT, ATTR_FLOATS, ATTR_STRING, ATTR_STRINGS, ATTR_GRAPH, ATTR_TENSOR = 1, 2, 3, 4, 5, 6, 7, 8


class Abi:
    def __init__(self, ffi, lib, api, version: str):
        self.ffi, self.lib, self.api = ffi, lib, api
        self.version = version
        self.struct_version = cdef.EP_STRUCT_VERSION
        self.epapi = api.GetEpApi()
        if self.epapi == ffi.NULL:
            raise OrtCallError(f"onnxruntime {version} has no plugin-EP API")
        self.NULL = ffi.NULL
        # bound once: attribute access on a cdata struct costs per call
        self.gather_inputs = lib.ortmlx_gather_inputs
        self.get_output = lib.ortmlx_get_output
        # the gather's view check and the batched helpers of the KV fast path (runtime/kvbatch.py): the shim is built
        # from this package's cdef (pip install / build_ext), so every helper is there
        self.same_inputs = lib.ortmlx_same_inputs
        self.get_outputs = lib.ortmlx_get_outputs
        self.copy_blocks = lib.ortmlx_copy_blocks
        self.compare_blocks = lib.ortmlx_compare_blocks
        self.kv_write = lib.ortmlx_kv_write
        self.max_rank = 16

    # ------------------------------------------------------------------ basics
    def status(self, code: int, msg: str):
        return self.api.CreateStatus(code, msg.encode("utf-8", "replace"))

    def check(self, st) -> None:
        if st != self.NULL:
            msg = self.ffi.string(self.api.GetErrorMessage(st)).decode("utf-8", "replace")
            self.api.ReleaseStatus(st)
            raise OrtCallError(msg)

    def str(self, p) -> str | None:
        return None if p == self.NULL else self.ffi.string(p).decode("utf-8", "replace")

    def call_str(self, fn, obj) -> str:
        p = self.ffi.new("const char**")
        self.check(fn(obj, p))
        return self.str(p[0]) or ""

    def kvp_dict(self, kvp) -> dict[str, str]:
        if kvp == self.NULL:
            return {}
        ffi = self.ffi
        keys, vals, n = ffi.new("const char* const**"), ffi.new("const char* const**"), ffi.new("size_t*")
        self.api.GetKeyValuePairs(kvp, keys, vals, n)
        return {self.str(keys[0][i]): self.str(vals[0][i]) for i in range(n[0])}

    def session_config(self, session_options) -> dict[str, str]:
        kvp = self.ffi.new("OrtKeyValuePairs**")
        self.check(self.api.GetSessionOptionsConfigEntries(session_options, kvp))
        try:
            return self.kvp_dict(kvp[0])
        finally:
            self.api.ReleaseKeyValuePairs(kvp[0])

    def array(self, getter_n, getter, obj, ctype: str) -> list:
        n = self.ffi.new("size_t*")
        self.check(getter_n(obj, n))
        if n[0] == 0:
            return []
        arr = self.ffi.new(f"{ctype}[]", n[0])
        self.check(getter(obj, arr, n[0]))
        return [arr[i] for i in range(n[0])]

    # ------------------------------------------------------------------ tensors
    def tensor_info(self, tinfo) -> tuple[int, list[int], list[str | None]]:
        ffi, api = self.ffi, self.api
        et, nd = ffi.new("int*"), ffi.new("size_t*")
        self.check(api.GetTensorElementType(tinfo, et))
        self.check(api.GetDimensionsCount(tinfo, nd))
        k = nd[0]
        dims = ffi.new("int64_t[]", max(k, 1))
        syms = ffi.new("const char*[]", max(k, 1))
        self.check(api.GetDimensions(tinfo, dims, k))
        self.check(api.GetSymbolicDimensions(tinfo, syms, k))
        return et[0], [dims[i] for i in range(k)], [self.str(syms[i]) for i in range(k)]

    def value_to_numpy(self, value, copy: bool) -> tuple[np.ndarray, int]:
        """An OrtValue tensor in CPU memory as numpy (bf16 as uint16 bits) and its element type."""
        ffi, api = self.ffi, self.api
        info = ffi.new("OrtTensorTypeAndShapeInfo**")
        self.check(api.GetTensorTypeAndShape(value, info))
        try:
            et, dims, _ = self.tensor_info(info[0])
        finally:
            api.ReleaseTensorTypeAndShapeInfo(info[0])
        count = int(np.prod(dims)) if dims else 1
        if et in dt.CARRIERS:       # float8 bits / packed 4- and 2-bit integers -> one element per byte
            if count == 0:
                return np.zeros(dims, dt.CARRIERS[et]), et
            data = ffi.new("const void**")
            self.check(api.GetTensorData(value, data))
            arr = dt.unpack_carrier(ffi.buffer(data[0], dt.carrier_nbytes(et, count)), et, count).reshape(dims)
            return (arr.copy() if copy else arr), et
        if et not in dt.NUMPY:
            raise OrtCallError(f"tensor of element type {dt.name(et)} cannot be read")
        dtype = np.dtype(dt.NUMPY[et])
        if count == 0:
            return np.zeros(dims, dtype), et
        data = ffi.new("const void**")
        self.check(api.GetTensorData(value, data))
        arr = np.frombuffer(ffi.buffer(data[0], count * dtype.itemsize), dtype=dtype).reshape(dims)
        return (arr.copy() if copy else arr), et


def check_ort_version(version: str) -> None:
    """Refuse an ORT without the plugin-EP ABI; warn once outside the tested range."""
    set_loaded_ort(version)
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < cdef.MIN_ORT_VERSION:
        raise OrtCallError(f"onnxruntime {version} is older than {cdef.MIN_ORT_VERSION}: no plugin-EP ABI")
    lo, hi = cdef.TESTED_ORT
    if not lo <= parts <= hi and version not in _WARNED:
        _WARNED.add(version)
        sys.stderr.write(f"MLXExecutionProvider: onnxruntime {version} is outside the tested range "
                         f"{lo}..{hi}; the EP requests API {cdef.ORT_API_VERSION} and claims struct version "
                         f"{cdef.EP_STRUCT_VERSION}\n")


_WARNED: set[str] = set()
