"""The C callbacks ORT calls, bound with ``@ffi.def_extern`` when the shim loads.

Each one finds its Python object by the address of the struct ORT passes back,
and runs inside ``guarded``: no exception ever reaches C.
"""
from __future__ import annotations

import atexit

from ..errors import OrtmlxError
from . import cdef
from .abi import Abi, check_ort_version
from .errors import ORT_FAIL, ORT_INVALID_ARGUMENT, format_error, guarded

_OBJECTS: dict[int, object] = {}      # struct address -> Factory / Ep / ComputeInfo
_FACTORIES: list = []                 # keep-alive
_STATE = {"installed": False, "pinned": None}


def _addr(ffi, p) -> int:
    return int(ffi.cast("uintptr_t", p))


def objects() -> dict[int, object]:
    return _OBJECTS


def install(ffi, lib) -> None:
    if _STATE["installed"]:
        return
    _STATE["installed"] = True

    def obj(p):
        return _OBJECTS[_addr(ffi, p)]

    class _NoAbi:
        """Used before an API table exists: errors can only become NULL."""
        def status(self, code, msg):
            return ffi.NULL

    # ------------------------------------------------------------------ exports
    @ffi.def_extern()
    def CreateEpFactories(registered_name, ort_api_base, default_logger, factories, max_factories, num_factories):
        try:
            api = ort_api_base.GetApi(cdef.ORT_API_VERSION)
            version = ffi.string(ort_api_base.GetVersionString()).decode()
        except BaseException:  # noqa: BLE001
            return ffi.NULL
        if api == ffi.NULL:
            api1 = ort_api_base.GetApi(1)
            return api1.CreateStatus(ORT_FAIL, f"MLXExecutionProvider needs ORT API {cdef.ORT_API_VERSION}; "
                                               f"onnxruntime {version} does not provide it".encode())
        try:
            check_ort_version(version)
            abi = Abi(ffi, lib, api, version)
            if _STATE["pinned"] is None:
                _STATE["pinned"] = lib.ortmlx_pin_self()
            if max_factories < 1:
                return api.CreateStatus(ORT_INVALID_ARGUMENT, b"MLXExecutionProvider: max_factories < 1")
            from .factory import Factory
            f = Factory(abi, ffi.string(registered_name).decode() if registered_name != ffi.NULL else "")
            _FACTORIES.append(f)
            _OBJECTS[_addr(ffi, f.c)] = f
            factories[0] = f.c
            num_factories[0] = 1
            return ffi.NULL
        except BaseException as e:  # noqa: BLE001
            return api.CreateStatus(ORT_FAIL, format_error("CreateEpFactories", e).encode())

    @ffi.def_extern()
    def ReleaseEpFactory(factory):
        try:
            f = _OBJECTS.pop(_addr(ffi, factory), None)
            if f is not None and f in _FACTORIES:
                _FACTORIES.remove(f)
        except BaseException:  # noqa: BLE001
            pass
        return ffi.NULL

    # ------------------------------------------------------------------ factory
    @ffi.def_extern()
    def ortmlx_factory_get_name(this):
        return _name(this, "name")

    @ffi.def_extern()
    def ortmlx_factory_get_vendor(this):
        return _name(this, "vendor")

    @ffi.def_extern()
    def ortmlx_factory_get_version(this):
        return _name(this, "version")

    @guarded("GetName", default=None, status=False)
    def _name_impl(_abi, this, key):
        return obj(this).cstr(key)

    def _name(this, key):
        r = _name_impl(_NoAbi(), this, key)
        return ffi.NULL if r is None else r

    @ffi.def_extern()
    def ortmlx_factory_get_vendor_id(this):
        return 0

    @ffi.def_extern()
    def ortmlx_factory_get_supported_devices(this, devices, n, ep_devices, max_n, num_out):
        f = _OBJECTS.get(_addr(ffi, this))
        return _supported(f.abi if f else _NoAbi(), f, devices, n, ep_devices, max_n, num_out)

    @guarded("GetSupportedDevices")
    def _supported(_abi, f, devices, n, ep_devices, max_n, num_out):
        f.get_supported_devices(devices, n, ep_devices, max_n, num_out)
        return ffi.NULL

    @ffi.def_extern()
    def ortmlx_factory_create_ep(this, devices, metas, n, session_options, logger, ep_out):
        f = _OBJECTS.get(_addr(ffi, this))
        return _create_ep(f.abi if f else _NoAbi(), f, devices, metas, n, session_options, logger, ep_out)

    @guarded("CreateEp")
    def _create_ep(_abi, f, devices, metas, n, session_options, logger, ep_out):
        f.create_ep(devices, metas, n, session_options, logger, ep_out)
        ep = f.eps[_addr(ffi, ep_out[0])]
        _OBJECTS[ep.address] = ep
        return ffi.NULL

    @ffi.def_extern()
    def ortmlx_factory_release_ep(this, ep):
        _release_ep(_NoAbi(), this, ep)

    @guarded("ReleaseEp", status=False)
    def _release_ep(_abi, this, ep):
        _OBJECTS.pop(_addr(ffi, ep), None)
        f = _OBJECTS.get(_addr(ffi, this))
        if f is not None:
            f.release_ep(ep)

    @ffi.def_extern()
    def ortmlx_factory_create_data_transfer(this, data_transfer):
        data_transfer[0] = ffi.NULL      # inputs and outputs live in CPU memory: nothing to transfer
        return ffi.NULL

    @ffi.def_extern()
    def ortmlx_factory_is_stream_aware(this):
        return False

    # ------------------------------------------------------------------ EP
    @ffi.def_extern()
    def ortmlx_ep_get_name(this):
        ep = _OBJECTS.get(_addr(ffi, this))
        return ep.factory.cstr("name") if ep is not None else ffi.NULL

    @ffi.def_extern()
    def ortmlx_ep_get_capability(this, graph, support_info):
        ep = _OBJECTS.get(_addr(ffi, this))
        return _get_capability(ep.abi if ep else _NoAbi(), ep, graph, support_info)

    @guarded("GetCapability")
    def _get_capability(_abi, ep, graph, support_info):
        with ep.lock:
            ep.get_capability(graph, support_info)
        return ffi.NULL

    @ffi.def_extern()
    def ortmlx_ep_compile(this, graphs, fused_nodes, count, infos, ep_context_nodes):
        ep = _OBJECTS.get(_addr(ffi, this))
        return _compile(ep.abi if ep else _NoAbi(), ep, graphs, fused_nodes, count, infos)

    @guarded("Compile")
    def _compile(_abi, ep, graphs, fused_nodes, count, infos):
        with ep.lock:
            ep.compile(graphs, fused_nodes, count, infos)
            for a, info in ep.infos.items():
                _OBJECTS[a] = info
        return ffi.NULL

    @ffi.def_extern()
    def ortmlx_ep_release_node_compute_infos(this, infos, n):
        _release_infos(_NoAbi(), this, infos, n)

    @guarded("ReleaseNodeComputeInfos", status=False)
    def _release_infos(_abi, this, infos, n):
        for i in range(n):
            _OBJECTS.pop(_addr(ffi, infos[i]), None)
        ep = _OBJECTS.get(_addr(ffi, this))
        if ep is not None:
            with ep.lock:
                ep.release_infos(infos, n)

    # ------------------------------------------------------------------ compute
    @ffi.def_extern()
    def ortmlx_nci_create_state(this, compute_context, state):
        info = _OBJECTS.get(_addr(ffi, this))
        if info is None:
            return ffi.NULL
        state[0] = ffi.cast("void*", this)
        return ffi.NULL

    @ffi.def_extern()
    def ortmlx_nci_compute(this, state, kctx):
        info = _OBJECTS.get(_addr(ffi, state))
        if info is None:
            return _missing(this)
        return _compute(info.abi, info, kctx)

    def _missing(this):
        f = next(iter(_FACTORIES), None)
        return f.abi.status(ORT_FAIL, "MLXExecutionProvider Compute: unknown compute state") if f else ffi.NULL

    def _compute_node(exc, info, kctx):
        """The node a failed call names: the exception's own, else the group with its nodes (``info.label``)."""
        node = exc.node if isinstance(exc, OrtmlxError) else None
        return info.label if node in (None, info.name) else node

    @guarded("Compute", node_of=_compute_node)
    def _compute(_abi, info, kctx):
        info.compute(kctx)
        return ffi.NULL

    @ffi.def_extern()
    def ortmlx_nci_release_state(this, state):
        return None

    atexit.register(_at_exit)


def _at_exit() -> None:
    """Drop compiled closures and MLX state before the interpreter tears down."""
    try:
        from .. import compiled
        compiled.release_all()
    except BaseException:  # noqa: BLE001
        pass
