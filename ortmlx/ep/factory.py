"""The EP factory ORT gets from ``CreateEpFactories``: names, devices, EP creation."""
from __future__ import annotations

import os
import sys

from ..version import __version__, mlx_backends
from ..kernels.cuda_kernels import prebuild_copies
from ..kernels.interpreter import mlx_gpu_available
from ..kernels.precision import fp32_matmul_error, fp32_matmul_exact
from .abi import Abi
from .errors import EP_NAME
from .options import EpOptions, OptionError

HW_CPU, HW_GPU = 0, 1
VENDOR = "ortmlx"


class Factory:
    def __init__(self, abi: Abi, registered_name: str):
        ffi, lib = abi.ffi, abi.lib
        self.abi = abi
        self.registered_name = registered_name
        self._cstrs = {k: ffi.new("char[]", v.encode()) for k, v in
                       (("name", registered_name or EP_NAME), ("vendor", VENDOR), ("version", __version__))}
        c = self.c = ffi.new("OrtEpFactory*")
        c.ort_version_supported = abi.struct_version
        c.GetName = lib.ortmlx_factory_get_name
        c.GetVendor = lib.ortmlx_factory_get_vendor
        c.GetSupportedDevices = lib.ortmlx_factory_get_supported_devices
        c.CreateEp = lib.ortmlx_factory_create_ep
        c.ReleaseEp = lib.ortmlx_factory_release_ep
        c.GetVendorId = lib.ortmlx_factory_get_vendor_id
        c.GetVersion = lib.ortmlx_factory_get_version
        c.CreateDataTransfer = lib.ortmlx_factory_create_data_transfer
        c.IsStreamAware = lib.ortmlx_factory_is_stream_aware
        self.eps: dict[int, object] = {}

    def cstr(self, key: str):
        return self._cstrs[key]

    def get_supported_devices(self, devices, num_devices, ep_devices, max_ep_devices, num_out) -> None:
        """One EP device per MLX device: the CPU always, the GPU when MLX has one and ORT lists one."""
        abi, api, ffi = self.abi, self.abi.api, self.abi.ffi
        want = {HW_CPU: "cpu"}
        if mlx_gpu_available():
            want[HW_GPU] = "gpu"
        n = 0
        for i in range(num_devices):
            ty = api.HardwareDevice_Type(devices[i])
            if ty not in want or n >= max_ep_devices:
                continue
            kind = want.pop(ty)
            meta, opts = ffi.new("OrtKeyValuePairs**"), ffi.new("OrtKeyValuePairs**")
            api.CreateKeyValuePairs(meta)
            api.CreateKeyValuePairs(opts)
            try:
                api.AddKeyValuePair(meta[0], b"mlx_device", kind.encode())
                out = ffi.new("OrtEpDevice**")
                abi.check(abi.epapi.CreateEpDevice(self.c, devices[i], meta[0], opts[0], out))
            finally:
                api.ReleaseKeyValuePairs(meta[0])
                api.ReleaseKeyValuePairs(opts[0])
            ep_devices[n] = out[0]
            n += 1
        num_out[0] = n

    def create_ep(self, devices, metas, num_devices, session_options, logger, ep_out) -> None:
        from .provider import Ep
        abi = self.abi
        options = EpOptions.from_session_config(abi.session_config(session_options))
        kinds = [abi.kvp_dict(metas[i]).get("mlx_device", "cpu") for i in range(num_devices)]
        device = options.device
        if device == "auto":
            device = "gpu" if ("gpu" in kinds or not kinds) and mlx_gpu_available() else "cpu"
        elif device == "gpu" and not mlx_gpu_available():
            raise OptionError(f"option device='gpu': MLX has no GPU here (installed: {', '.join(mlx_backends()) or 'no backend'}"
                              "; an NVIDIA GPU needs ortmlx[cuda13] or ortmlx[cuda12])")
        if device == "gpu":
            prebuild_copies()       # built while ORT loads the model; the InferenceSession's first upload waits for them
        if device == "gpu" and not fp32_matmul_exact("gpu"):
            why = (f"float32 matmul on MLX's GPU has relative error {fp32_matmul_error('gpu'):.1e} (TF32: "
                   f"MLX_ENABLE_TF32={os.environ.get('MLX_ENABLE_TF32')!r}, or mlx.core was imported before ortmlx)")
            if options.device == "gpu":
                raise OptionError(f"option device='gpu' refused: {why}")
            sys.stderr.write(f"MLXExecutionProvider: using the CPU device: {why}\n")
            device = "cpu"
        ep = Ep(self, options, device)
        self.eps[ep.address] = ep
        ep_out[0] = ep.c

    def release_ep(self, ep_ptr) -> None:
        ep = self.eps.pop(int(self.abi.ffi.cast("uintptr_t", ep_ptr)), None)
        if ep is not None:
            ep.release()
