"""Which CUDA graphs a runtime's decode steps replay, chosen again at every decode step.

Decode steps run as CUDA graphs unless --cuda-graphs off, the backend does not capture decode
steps (`captures_decode`), dense layers stream, or a trace wants per-layer spans. Once every
routed expert sits in a device slot, nothing is left to fetch: whole steps replay
(runtime/decode_graphs.py) and skip `serve`; the table of slot pointers is checked once, and a
slot refilled later drops those graphs. Before that, under --cuda-graphs auto, the stretches
between routers replay (runtime/segment_graphs.py) and `serve` answers each router as before.
The graphs point into the runtime's slots: the runtime owns them and drops them at close.
"""

from __future__ import annotations

from streamrt.backends.expert_pointers import ExpertTable
from streamrt.expert_weights import ExpertWeights
from streamrt.model.model import ResidentWeights
from streamrt.runtime.decode_graphs import DecodeGraphs
from streamrt.runtime.segment_graphs import SegmentGraphs


class GraphChoice:
    def __init__(self, rt) -> None:
        self.rt = rt
        self.refused: str | None = None  # why decode stays op by op with every expert resident

    @property
    def graphs(self):
        return self.rt.forward.graphs

    @graphs.setter
    def graphs(self, value) -> None:
        self.rt.forward.graphs = value

    def wanted(self) -> bool:
        rt = self.rt
        return (rt.options.cuda_graphs != "off" and rt.device.kind == "cuda"
                and getattr(rt.model.backend, "captures_decode", False)
                and isinstance(rt.model.layer_weights, ResidentWeights)
                and not rt.tracer.enabled and rt.stats.trace is None)

    def update(self) -> None:
        """At a decode step's start: keep the graphs in place while they fit, else choose again."""
        if self.refused is not None:
            return
        rt = self.rt
        current, resident = self.graphs, len(rt.gpu) >= rt.cfg.expert_files
        if isinstance(current, DecodeGraphs) or (current is not None and not resident):
            return  # the graphs in place still fit
        self.graphs = None
        if not self.wanted():
            return
        if not resident:
            if rt.options.cuda_graphs == "auto":
                # slots and transient buffers start page-aligned: the layout decides the alignment
                aligned = rt.layout.file_bytes % 8 == 0 and all(off % 8 == 0 for off, _ in rt.layout.sections)
                self.graphs = SegmentGraphs(rt.model, tensor_core=aligned, stats=rt.stats)
            return
        self.graphs = self._resident()

    def _resident(self) -> DecodeGraphs | None:
        """Whole-step graphs over every expert's slot; None (and `refused` said) when the slot
        table's kernels cannot take an expert."""
        rt, cfg = self.rt, self.rt.cfg
        table = ExpertTable(cfg.moe_layers, cfg.num_experts, cfg.routed_expert_hidden_size, rt.device.torch_device)
        views: dict[int, dict[int, ExpertWeights]] = {}
        try:
            for key in rt.every_key():
                ew = rt.gpu.views(rt.gpu.slot_of(key))
                table.place(key.layer, key.expert, ew)
                views.setdefault(key.layer, {})[key.expert] = ew
        except ValueError as e:  # an expert the table's kernels cannot take: op by op, as before
            self.refused = str(e)
            return None
        return DecodeGraphs(rt.model, table, views, stats=rt.stats)

    @property
    def replaying_segments(self) -> bool:
        graphs = self.graphs
        return isinstance(graphs, SegmentGraphs) and graphs.refused is None

    @property
    def line(self) -> str | None:
        """Why decode steps run op by op although CUDA graphs were asked for (the slot table
        refused an expert, or a segment graph capture failed); None otherwise."""
        reason = self.refused or getattr(self.graphs, "refused", None)
        return None if reason is None else f"CUDA graphs refused, decode steps run op by op: {reason}"

    def slot_refilled(self) -> None:
        """Whole-step graphs point into the slots (segment graphs do not)."""
        if isinstance(self.graphs, DecodeGraphs):
            self.graphs = None

    def drop(self) -> None:
        self.graphs = None
