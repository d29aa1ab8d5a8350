"""Decode steps as CUDA graphs, once every routed expert is resident.

A decode step on the NVRTC backend is some 5,000 small launches; issued from Python one by one
they take many times the GPU's own time. With every routed expert in a device slot that does
not move, nothing in a step needs the host: the cache lengths live on the device
(`ModelCache.device_lengths`), the expert FFN gathers its pointers on the GPU from an
`ExpertTable` (the layer's answer is `ResidentExperts`), and the token ids come in through one
buffer. So a step is captured once and replayed:

    first step of a shape   op by op (compiles kernels, allocates the backend's lasting
                            buffers), then the same step captured (captured work does not run)
    every later step        ids copied in, the graph replayed, the host lengths counted

A graph holds the addresses of the cache tensors: it is kept per (ids shape, last_only, cache
addresses). The MLA caches grow by doubling before a step (`ModelCache.reserve`), which moves
them, so a context that doubles captures once more; at most `keep` graphs stay (least recently
used first out). A replay runs the kernels of the op-by-op step with the same arguments: the
same bits (tests/test_decode_graphs_gpu.py).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Mapping

import torch
from torch import Tensor

from streamrt.backends.expert_pointers import ExpertTable
from streamrt.expert_weights import ExpertWeights, ResidentExperts
from streamrt.model.cache import ModelCache
from streamrt.model.model import run_sync


class StepGraphs:
    """What whole-step and segment graphs share: captures kept per (ids shape, last_only, cache
    addresses), at most `keep` (least recently used first out), and a replay's bookkeeping."""

    def __init__(self, model, keep: int, stats):
        if not getattr(model.backend, "captures_decode", False):
            raise ValueError("decode graphs need a backend that captures decode steps (nvrtc; the torch backend "
                             "reads ids on the host)")
        self.model, self.keep = model, keep
        self.stats = stats  # RuntimeStats: graph_steps counts the replays
        self._kept: OrderedDict[tuple, tuple] = OrderedDict()
        self.captures = self.replays = 0

    def _lookup(self, ids: Tensor, cache: ModelCache, last_only: bool) -> tuple[tuple, tuple | None]:
        """(the step's key, what was captured for it or None)."""
        # growth moves the caches: before the key is taken, and one position ahead, so that the
        # capture after a first step (one position later) never grows them inside the graph
        cache.reserve(max(cache.lengths) + 2)
        key = (tuple(ids.shape), last_only, cache.tensor_addresses())
        entry = self._kept.get(key)
        if entry is not None:
            self._kept.move_to_end(key)
        return key, entry

    def _keep(self, key: tuple, entry: tuple) -> None:
        while len(self._kept) >= self.keep:
            self._kept.popitem(last=False)
        self._kept[key] = entry
        self.captures += 1

    def _replayed(self, cache: ModelCache, logits: Tensor) -> Tensor:
        """After a replay: the host lengths counted (the graph advanced the device's), the
        replay counted, and the logits copied out (the next replay overwrites its own)."""
        cache.advance(1, on_device=False)
        self.replays += 1
        if self.stats is not None:
            self.stats.graph_steps += 1
        return logits.clone()


@contextlib.contextmanager
def lengths_taken_back(cache: ModelCache):
    """Capturing runs a step's Python but not its kernels: the host lengths it counted are
    taken back, whatever happens in the block."""
    before = cache.lengths[0]
    try:
        yield
    finally:
        counted = cache.lengths[0] - before
        if counted:
            cache.advance(-counted, on_device=False)


class DecodeGraphs(StepGraphs):
    """A runtime's `Forward.graphs` once every routed expert is resident (the model's forward
    replays through `decode`): every MoE layer's experts in `views` ({layer: {expert: device
    views}}) and placed in `table`."""

    def __init__(self, model, table: ExpertTable, views: Mapping[int, Mapping[int, ExpertWeights]], *, keep: int = 4,
                 stats=None):
        super().__init__(model, keep, stats)
        if not table.complete():
            raise ValueError("decode graphs need every routed expert placed in the expert table")
        self.table, self.views = table, views
        self.tensor_core = table.tensor_core_ready()
        table.upload()

    def answer(self, req) -> ResidentExperts:
        """A layer's experts: its table and views, the router's ids left on the device."""
        return ResidentExperts(self.views[req.layer], self.table.layer(req.layer), self.table.inter, req.ids,
                               req.layer, self.tensor_core)

    def steps(self, ids: Tensor, cache: ModelCache, last_only: bool, step_hint=None):
        """The model's forward generator for this step: a whole-step replay asks for no experts
        (and stages nothing: `step_hint` is not called)."""
        return self.decode(ids, cache, last_only)
        yield  # (unreached: makes this a generator, as every forward is)

    def decode(self, ids: Tensor, cache: ModelCache, last_only: bool) -> Tensor:
        """One decode step of ids [B, 1] (checked, on the device) -> logits [B, 1, V]."""
        key, entry = self._lookup(ids, cache, last_only)
        if entry is None:
            logits = run_sync(self.model.forward_chunk(ids, cache, last_only), self.answer)
            self._capture(key, ids, cache, last_only)
            return logits
        static_ids, graph, logits = entry
        static_ids.copy_(ids)
        graph.replay()  # on the current stream, behind whatever the caller queued there
        return self._replayed(cache, logits)

    def _capture(self, key: tuple, ids: Tensor, cache: ModelCache, last_only: bool) -> None:
        """Capture the step for ids' shape on this cache."""
        static_ids = ids.clone()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(ids.device)  # capture needs a stream other than the default
        side.wait_stream(torch.cuda.current_stream(ids.device))
        with lengths_taken_back(cache):
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                logits = run_sync(self.model.forward_chunk(static_ids, cache, last_only), self.answer)
        torch.cuda.current_stream(ids.device).wait_stream(side)
        self._keep(key, (static_ids, graph, logits))
