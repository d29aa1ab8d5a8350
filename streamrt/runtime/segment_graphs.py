"""Streamed decode steps as CUDA graphs, one per stretch between two routers.

While experts stream, a step cannot be one graph: after each MoE router the scheduler needs
the routed ids on the host to fetch the misses. Everything between two routers needs nothing
from the host, though: the layer's expert FFN (its pointers gathered on the GPU from a
per-layer table, `ResidentExperts`), the dense layers after it, the next router. So a step is
captured once as a chain of graphs,

    segment 0       embedding ... the first MoE router
    segment i       MoE layer i-1's expert FFN ... MoE layer i's router
    last segment    the last expert FFN ... logits

and replayed as the model's forward generator, which the scheduler drives as it drives an op by
op step: replay a segment, yield the request it ended on (its tensors are the graph's own
buffers), take the answer's experts (the compute stream waits for their copies), write where
they are into the layer's table and copy it to the device, replay the next segment. Per step the
host then runs one replay and one table copy per MoE layer beside the scheduler's own work,
instead of every op's Python.

A chain holds the addresses of the cache tensors: it is kept per (ids shape, last_only, cache
addresses), as `DecodeGraphs` keeps a step, and its segments share one memory pool (they are
always replayed in the order they were captured). The first step of a shape runs op by op, then
the chain is captured (captured work does not run). The replayed kernels are those of the op by
op step with the table's pointers: the same bits (tests/test_decode_graphs_gpu.py). That first
step already answers every router from the table, so the kernels a capture takes have run (and
loaded) before it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from streamrt.backends.expert_pointers import ExpertPointerCache, ExpertTable
from streamrt.errors import StreamrtError
from streamrt.expert_weights import ResidentExperts, answer_for_layer
from streamrt.model.cache import ModelCache
from streamrt.runtime.decode_graphs import StepGraphs, lengths_taken_back


class SegmentGraphs(StepGraphs):
    """A runtime's `Forward.graphs` while experts stream: steps of shapes seen before replay a chain of
    graphs (kept per key as `StepGraphs` keeps them: static ids, [(graph, request it ends on, or
    None for the last)], static logits). `tensor_core`: the experts' sections meet the
    tensor-core kernels' alignment (a property of the expert layout, checked again on every
    expert that reaches the table)."""

    def __init__(self, model, *, tensor_core: bool, keep: int = 4, stats=None):
        super().__init__(model, keep, stats)
        cfg = model.config
        self.tensor_core = tensor_core
        self.device = model.lm_head.weight.device
        self.routed_width, self.inter = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
        self.table = ExpertTable(cfg.moe_layers, cfg.num_experts, self.routed_width, self.device)
        self._pointers = ExpertPointerCache(self.device)
        self.refused: str | None = None  # why a capture failed: steps stay op by op from then on

    def steps(self, ids: Tensor, cache: ModelCache, last_only: bool, step_hint=None):
        """One decode step of ids [B, 1] (checked, on the device) as the model's forward generator
        -> logits [B, 1, V]; `step_hint` called with its embeddings first (never in a capture)."""
        if self.refused is not None:
            return (yield from self.model.forward_chunk(ids, cache, last_only, step_hint))
        key, chain = self._lookup(ids, cache, last_only)
        if chain is None:
            logits = yield from self._table_answered(self.model.forward_chunk(ids, cache, last_only, step_hint))
            self._capture(key, ids, cache, last_only)
            return logits
        static_ids, segments, logits = chain
        static_ids.copy_(ids)
        if step_hint is not None:  # before segment 0, which runs to the first router
            step_hint(self.model.embed(ids))
        for graph, req in segments:
            graph.replay()  # on the current stream, behind the table copy and the copy waits
            if req is not None:
                self._place(req, (yield req))
        return self._replayed(cache, logits)

    def _table_answered(self, gen):
        """Drive a forward op by op, each request served by the caller and answered from the table:
        the kernels the capture will take run (and load, outside any capture) on real experts."""
        try:
            req = next(gen)
            while True:
                views = self._place(req, (yield req))
                req = gen.send(self._answer(req, views))
        except StopIteration as stop:
            return stop.value
        finally:
            gen.close()

    def _place(self, req, answer) -> dict:
        """Where the answer's experts are, into req's layer of the table (taking each one makes the
        compute stream wait for its copy), then the layer's rows copied to the device. Returns
        the views taken."""
        experts = answer_for_layer(answer, req.ids, req.layer)
        pointers, views = {}, {}
        for e in experts.unique:
            views[e] = experts.take(e)
            p = self._pointers.get(views[e], e, self.routed_width)
            if p.inter != self.inter:
                raise StreamrtError(f"layer {req.layer} expert {e}: intermediate size {p.inter}, "
                                    f"the config's {self.inter}")
            if self.tensor_core and (p.gate_scales | p.up_scales | p.down_scales) % 8:
                raise StreamrtError(f"layer {req.layer} expert {e}: scales not 8-byte aligned, unlike the layout "
                                    "the step's graphs were captured for")
            pointers[e] = p
        self.table.refresh(req.layer, pointers)
        return views

    def _answer(self, req, views=None) -> ResidentExperts:
        """The answer from the table: the layer's rows on the device, the router's ids left there
        (the views beside them, where taken, serve a backend that reads those instead)."""
        return ResidentExperts(views or {}, self.table.layer(req.layer), self.inter, req.ids, req.layer,
                               self.tensor_core)

    def _capture(self, key: tuple, ids: Tensor, cache: ModelCache, last_only: bool) -> None:
        """Capture the step for ids' shape on this cache as a chain of graphs, each ending at a
        router. A failed capture leaves this step's (op by op) logits as they were and
        every later step op by op."""
        static_ids = ids.clone()
        gen = self.model.forward_chunk(static_ids, cache, last_only)  # no step hint: nothing staged in a capture
        with lengths_taken_back(cache):
            try:
                segments, logits = self._record(gen)
            except Exception as e:  # e.g. an op that cannot be captured: op by op from now on
                self.refused = f"{type(e).__name__}: {e}"
                self._kept.clear()
                return
            finally:
                gen.close()
        self._keep(key, (static_ids, segments, logits))

    def _record(self, gen) -> tuple[list, Tensor]:
        """Run `gen` under capture, one graph from each resumption to the next request (or the
        logits), every request answered from the table."""
        torch.cuda.synchronize(self.device)  # as torch.cuda.graph: nothing queued runs into the capture
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)  # capture needs a stream other than the default
        side.wait_stream(current)
        pool = torch.cuda.graph_pool_handle()  # the chain's segments share one pool
        segments, answer, logits = [], None, None
        try:
            with torch.cuda.stream(side):
                while logits is None:
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                    try:
                        req = next(gen) if answer is None else gen.send(answer)
                    except StopIteration as stop:
                        req, logits = None, stop.value
                    except BaseException:
                        _end_quietly(graph)  # the capture's own error is the one to report
                        raise
                    graph.capture_end()
                    segments.append((graph, req))
                    if req is not None:
                        answer = self._answer(req)
        finally:
            current.wait_stream(side)
        return segments, logits


def _end_quietly(graph: torch.cuda.CUDAGraph) -> None:
    """End a capture that failed (ending it is what takes the stream out of capture mode)."""
    try:
        graph.capture_end()
    except Exception:
        pass
