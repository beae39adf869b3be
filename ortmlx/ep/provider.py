"""The EP: GetCapability (claim and group) and Compile (plans -> compute infos)."""
from __future__ import annotations

import threading

from ..ir import Graph
from ..runtime.prebuild import ModelSource
from ..subgraph.partition import Unclaimed, claim, claimed_bodies
from ..stats import SessionStats
from ..subgraph.plan import build_plan
from .compute import ComputeInfo
from .graph_reader import GraphReader
from .options import EpOptions

#: partition reports of every EP in this process, newest last (``python -m ortmlx check`` reads them)
REPORTS: list = []
_REPORTS_MAX = 64


def _fault(ep: "Ep", stage: str, node: str = "") -> None:
    """Testing hook: raise at ``stage`` (optionally only for one node) when the fault option says so.

    The option's syntax is ``stage[:node][#count]`` (see ``ortmlx.stats.FaultSpec``).
    """
    if ep.stats.faults is not None:
        ep.stats.fault(stage, node)


class Ep:
    def __init__(self, factory, options: EpOptions, device: str):
        abi = factory.abi
        ffi, lib = abi.ffi, abi.lib
        self.factory = factory
        self.abi = abi
        self.options = options
        self.device = device
        self.reader = GraphReader(abi)
        self.reports = []
        self.infos: dict[int, ComputeInfo] = {}
        self.lock = threading.RLock()
        self.stats = SessionStats(device, options.trace, options.verbose, options.tuning.fault)
        #: the model file and its inputs (the top graph's, at GetCapability): a worker process can make a group's
        #: calls again from them (``runtime/prebuild.py``)
        self.source: ModelSource | None = None
        c = self.c = ffi.new("OrtEp*")
        c.ort_version_supported = abi.struct_version
        c.GetName = lib.ortmlx_ep_get_name
        c.GetCapability = lib.ortmlx_ep_get_capability
        c.Compile = lib.ortmlx_ep_compile
        c.ReleaseNodeComputeInfos = lib.ortmlx_ep_release_node_compute_infos
        self.address = int(ffi.cast("uintptr_t", c))

    # ------------------------------------------------------------------ GetCapability
    def get_capability(self, graph_ptr, support_info) -> None:
        abi, ffi = self.abi, self.abi.ffi
        with self.stats.span("claim"):
            _fault(self, "getcapability")
            graph = self.reader.graph(graph_ptr)
            groups, report = claim(graph, self.device, self.options.disable_ops)
            parent = ffi.new("const OrtNode**")
            abi.check(abi.api.Graph_GetParentNode(graph_ptr, parent))
            if parent[0] == ffi.NULL:
                self.source = ModelSource(abi.call_str(abi.api.Graph_GetModelPath, graph_ptr), tuple(graph.inputs))
            if parent[0] != ffi.NULL and groups:
                # ORT rejects a fused node inside a control-flow body (the body has no opset for the EP);
                # a body runs on MLX only as part of its claimed If/Loop/Scan (partition.bodies_reason)
                why = ("inside a control-flow subgraph (If/Loop/Scan/SequenceMap body): never fused alone; on MLX only "
                       "with its whole control-flow node")
                report.unclaimed.extend(Unclaimed(n.name, n.op_type, why) for g in groups for n in g)
                report.groups, groups = [], []
            bodies = claimed_bodies(groups)
            for r in self.reports:
                if not r.absorbed_by and r.produced in bodies:
                    r.absorb(bodies[r.produced])
            self.reports.append(report)
            REPORTS.append(report)
            del REPORTS[:-_REPORTS_MAX]
            self.stats.report = report
            opts = ffi.new("OrtNodeFusionOptions*")
            opts.ort_version_supported = abi.struct_version
            opts.drop_constant_initializers = True
            for group in groups:
                arr = ffi.new("const OrtNode*[]", [n.handle for n in group])
                abi.check(abi.epapi.EpGraphSupportInfo_AddNodesToFuse(support_info, arr, len(group), opts))

    # ------------------------------------------------------------------ Compile
    def compile(self, graphs, fused_nodes, count, infos_out) -> None:
        made = []
        try:
            for i in range(count):
                fused = self.reader.node(fused_nodes[i], 0, {})
                _fault(self, "compile", fused.name)
                with self.stats.span("compile", group=fused.name):
                    sub: Graph = self.reader.graph(graphs[i])
                    plan = build_plan(sub, fused.name, fused.inputs, fused.outputs)
                    info = ComputeInfo(self, plan)
                made.append(info)
                infos_out[i] = info.c
        except BaseException:
            for info in made:
                info.release()
            raise
        for info in made:
            self.infos[info.address] = info

    def release_infos(self, infos, n) -> None:
        ffi = self.abi.ffi
        for i in range(n):
            info = self.infos.pop(int(ffi.cast("uintptr_t", infos[i])), None)
            if info is not None:
                info.release()

    def release(self) -> None:
        for info in list(self.infos.values()):
            info.release()
        self.infos.clear()
        self.stats.finish()
