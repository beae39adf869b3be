"""Read an ``OrtGraph`` into the Python IR (``ortmlx.ir``)."""
from __future__ import annotations

import numpy as np

from .. import ir
from ..ir import Graph, Node, UnreadableAttr, ValueInfo
from .abi import (ATTR_FLOAT, ATTR_FLOATS, ATTR_GRAPH, ATTR_INT, ATTR_INTS, ATTR_STRING, ATTR_STRINGS,
                  ATTR_TENSOR, Abi)
from .errors import OrtCallError

#: ORT's ONNXType enum -> IR value kind (0, unknown, reads as an untyped tensor as before)
ONNX_TYPE_TENSOR, ONNX_TYPE_SEQUENCE, ONNX_TYPE_OPTIONAL = 1, 2, 6
_KINDS = {ONNX_TYPE_SEQUENCE: ir.SEQUENCE, 3: ir.MAP, 4: ir.OPAQUE, 5: ir.SPARSE_TENSOR, ONNX_TYPE_OPTIONAL: ir.OPTIONAL}
#: nesting read for sequence/optional element types (optional(seq(tensor)) needs 2)
_MAX_NESTING = 4
GRAPH_ATTR = "graph attribute"      # why a graph attribute is unreadable until its body is read


class GraphReader:
    def __init__(self, abi: Abi):
        self.abi = abi
        self.ffi = abi.ffi
        self.api = abi.api

    def value_info(self, vi) -> ValueInfo:
        abi, ffi, api = self.abi, self.ffi, self.api
        name = abi.call_str(api.GetValueInfoName, vi)
        ti = ffi.new("const OrtTypeInfo**")
        abi.check(api.GetValueInfoTypeInfo(vi, ti))
        if ti[0] == ffi.NULL:
            return ValueInfo(name)
        return self.type_info(name, ti[0])

    def type_info(self, name: str, ti, depth: int = 0) -> ValueInfo:
        """An ``OrtTypeInfo`` as a ValueInfo: tensors with type and shape, sequences/optionals with ``elem``."""
        abi, ffi, api = self.abi, self.ffi, self.api
        onnx_type = ffi.new("int*")
        abi.check(api.GetOnnxTypeFromTypeInfo(ti, onnx_type))
        if onnx_type[0] == ONNX_TYPE_TENSOR:
            return self._tensor_info(name, ti)
        kind = _KINDS.get(onnx_type[0])
        if kind is None:
            return ValueInfo(name)
        elem = None
        if kind in (ir.SEQUENCE, ir.OPTIONAL) and depth < _MAX_NESTING:
            try:
                elem = self._contained(ti, kind, depth)
            except OrtCallError:       # an element type we cannot read: kind known, element unknown (refused)
                elem = None
        return ValueInfo(name, kind=kind, elem=elem)

    def _contained(self, ti, kind: str, depth: int) -> ValueInfo | None:
        """The element type of a sequence / the contained type of an optional (None: ORT gives none)."""
        abi, ffi, api = self.abi, self.ffi, self.api
        owned = ffi.new("OrtTypeInfo**")
        if kind == ir.SEQUENCE:
            info = ffi.new("const OrtSequenceTypeInfo**")
            abi.check(api.CastTypeInfoToSequenceTypeInfo(ti, info))
            if info[0] == ffi.NULL:
                return None
            abi.check(api.GetSequenceElementType(info[0], owned))
        else:
            info = ffi.new("const OrtOptionalTypeInfo**")
            abi.check(api.CastTypeInfoToOptionalTypeInfo(ti, info))
            if info[0] == ffi.NULL:
                return None
            abi.check(api.GetOptionalContainedTypeInfo(info[0], owned))
        if owned[0] == ffi.NULL:
            return None
        try:
            return self.type_info("", owned[0], depth + 1)
        finally:
            api.ReleaseTypeInfo(owned[0])

    def _tensor_info(self, name: str, ti) -> ValueInfo:
        abi, ffi, api = self.abi, self.ffi, self.api
        tti = ffi.new("const OrtTensorTypeAndShapeInfo**")
        abi.check(api.CastTypeInfoToTensorInfo(ti, tti))
        if tti[0] == ffi.NULL:
            return ValueInfo(name)
        et, dims, syms = abi.tensor_info(tti[0])
        if not api.TensorTypeAndShape_HasShape(tti[0]):
            return ValueInfo(name, et, None)          # rank unknown (not a scalar)
        shape = tuple(d if d >= 0 else (s or None) for d, s in zip(dims, syms))
        return ValueInfo(name, et, shape)

    def _value_list(self, getter_n, getter, obj, values: dict) -> list[str]:
        names = []
        for vi in self.abi.array(getter_n, getter, obj, "const OrtValueInfo*"):
            if vi == self.ffi.NULL:
                names.append("")
                continue
            info = self.value_info(vi)
            values.setdefault(info.name, info)
            names.append(info.name)
        return names

    def read_attr(self, attr, ty: int):
        abi, ffi, api = self.abi, self.ffi, self.api
        size = ffi.new("size_t*")
        if ty == ATTR_INT:
            v = ffi.new("int64_t*")
            abi.check(api.ReadOpAttr(attr, ty, v, 8, size))
            return int(v[0])
        if ty == ATTR_FLOAT:
            v = ffi.new("float*")
            abi.check(api.ReadOpAttr(attr, ty, v, 4, size))
            return float(v[0])
        if ty in (ATTR_INTS, ATTR_FLOATS, ATTR_STRING, ATTR_STRINGS):
            st = api.ReadOpAttr(attr, ty, ffi.NULL, 0, size)     # sets the size, may return a status
            if st != ffi.NULL:
                api.ReleaseStatus(st)
            nbytes = size[0]
            if nbytes == 0:
                return "" if ty == ATTR_STRING else []
            buf = ffi.new("char[]", nbytes)
            abi.check(api.ReadOpAttr(attr, ty, buf, nbytes, size))
            raw = ffi.buffer(buf, nbytes)[:]
            if ty == ATTR_INTS:
                return [int(x) for x in np.frombuffer(raw, np.int64)]
            if ty == ATTR_FLOATS:
                return [float(x) for x in np.frombuffer(raw, np.float32)]
            if ty == ATTR_STRING:
                return raw.decode("utf-8", "replace")
            return [s.decode("utf-8", "replace") for s in raw.rstrip(b"\0").split(b"\0")]
        if ty == ATTR_TENSOR:
            out = ffi.new("OrtValue**")
            abi.check(api.OpAttr_GetTensorAttributeAsOrtValue(attr, out))
            try:
                arr, _ = abi.value_to_numpy(out[0], copy=True)
            finally:
                api.ReleaseValue(out[0])
            return arr
        if ty == ATTR_GRAPH:
            return UnreadableAttr(GRAPH_ATTR)
        return UnreadableAttr(f"attribute type {ty}")

    def attributes(self, node) -> dict:
        abi, ffi, api = self.abi, self.ffi, self.api
        out = {}
        for a in abi.array(api.Node_GetNumAttributes, api.Node_GetAttributes, node, "const OrtOpAttr*"):
            name = abi.call_str(api.OpAttr_GetName, a)
            ty = ffi.new("int*")
            try:
                abi.check(api.OpAttr_GetType(a, ty))     # fails for kinds ORT cannot expose (a TypeProto)
                out[name] = self.read_attr(a, ty[0])
            except Exception as e:  # noqa: BLE001 - an unreadable attribute refuses the claim, not the session
                out[name] = UnreadableAttr(f"{type(e).__name__}: {e}")
        return out

    def subgraphs(self, h, n: int, copy_constants: bool) -> dict[str, Graph]:
        """The node's ``n`` graph attributes (control-flow bodies), attribute name -> body Graph."""
        abi, ffi, api = self.abi, self.ffi, self.api
        graphs = ffi.new("const OrtGraph*[]", n)
        names = ffi.new("const char*[]", n)
        abi.check(api.Node_GetSubgraphs(h, graphs, n, names))
        return {abi.str(names[i]) or f"#{i}": self.graph(graphs[i], copy_constants) for i in range(n)}

    def bodies(self, h, attrs: dict, values: dict, copy_constants: bool) -> tuple[bool, dict, list[str]]:
        """(has subgraphs, attribute -> body Graph, implicit inputs); graph attributes in ``attrs`` become
        their bodies. A body that cannot be read leaves its attributes unreadable (refuses the claim)."""
        abi, ffi, api = self.abi, self.ffi, self.api
        n = ffi.new("size_t*")
        abi.check(api.Node_GetNumSubgraphs(h, n))
        if n[0] == 0:
            return False, {}, []
        try:
            subgraphs = self.subgraphs(h, n[0], copy_constants)
            implicit = self._value_list(api.Node_GetNumImplicitInputs, api.Node_GetImplicitInputs, h, values)
        except Exception as e:  # noqa: BLE001 - an unreadable body refuses the claim, not the session
            for k, v in attrs.items():
                if isinstance(v, UnreadableAttr) and v.why == GRAPH_ATTR:
                    attrs[k] = UnreadableAttr(f"{GRAPH_ATTR}: {type(e).__name__}: {e}")
            return True, {}, []
        attrs.update((k, g) for k, g in subgraphs.items() if k in attrs)
        return True, subgraphs, implicit

    def node(self, h, index: int, values: dict, copy_constants: bool = False) -> Node:
        abi, ffi, api = self.abi, self.ffi, self.api
        since = ffi.new("int*")
        abi.check(api.Node_GetSinceVersion(h, since))
        attrs = self.attributes(h)
        has_subgraphs, subgraphs, implicit = self.bodies(h, attrs, values, copy_constants)
        return Node(
            name=abi.call_str(api.Node_GetName, h),
            op_type=abi.call_str(api.Node_GetOperatorType, h),
            domain=abi.call_str(api.Node_GetDomain, h),
            since_version=since[0],
            inputs=self._value_list(api.Node_GetNumInputs, api.Node_GetInputs, h, values),
            outputs=self._value_list(api.Node_GetNumOutputs, api.Node_GetOutputs, h, values),
            attrs=attrs,
            index=index,
            handle=h,
            has_subgraphs=has_subgraphs,
            implicit_inputs=implicit,
            subgraphs=subgraphs,
        )

    def graph(self, g, copy_constants: bool = False) -> Graph:
        """The whole graph. Constants are views of ORT memory unless ``copy_constants``."""
        abi, ffi, api = self.abi, self.ffi, self.api
        values: dict[str, ValueInfo] = {}
        inputs = self._value_list(api.Graph_GetNumInputs, api.Graph_GetInputs, g, values)
        outputs = self._value_list(api.Graph_GetNumOutputs, api.Graph_GetOutputs, g, values)
        constants: dict[str, np.ndarray] = {}
        flag = ffi.new("bool*")
        val = ffi.new("const OrtValue**")
        for vi in abi.array(api.Graph_GetNumInitializers, api.Graph_GetInitializers, g, "const OrtValueInfo*"):
            info = self.value_info(vi)
            values.setdefault(info.name, info)
            abi.check(api.ValueInfo_IsConstantInitializer(vi, flag))
            if not flag[0]:
                continue
            abi.check(api.ValueInfo_GetInitializerValue(vi, val))
            if val[0] != ffi.NULL:
                try:
                    constants[info.name], _ = abi.value_to_numpy(val[0], copy=copy_constants)
                except Exception:  # noqa: BLE001 - e.g. string tensors: not a constant we can use
                    pass
        handles = abi.array(api.Graph_GetNumNodes, api.Graph_GetNodes, g, "const OrtNode*")
        nodes = [self.node(h, i, values, copy_constants) for i, h in enumerate(handles)]
        name = abi.call_str(api.Graph_GetName, g)
        # graph inputs that are constant initializers are constants, not runtime inputs
        inputs = [i for i in inputs if i not in constants]
        return Graph(nodes, inputs, outputs, values, constants, name)
