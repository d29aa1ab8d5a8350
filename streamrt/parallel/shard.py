"""One rank's view of a forward: it fetches only the experts it owns.

    shard(gen, owners, rank) -> a generator of the same protocol as `gen` (yields
                                ExpertRequest, is sent the experts, returns gen's result)

Every rank runs the whole dense forward (the routers included), so every rank knows every
layer's routed ids. `shard` intercepts each `ExpertRequest` and passes on a request for this
rank's share only, so whatever serves it (a provider, `StreamingRuntime.decode_step`) moves
1/N of the layer's bytes over this rank's link:

    passed on:  ExpertRequest(layer, ids [1, U] the owned routed experts ascending (U may be 0),
                              weights [1, U] ones (no provider reads them), hidden [N, D] as is)
    answered:   `ShardExperts`: the owned experts' weights, a `Remote` stand-in for every other
                routed expert (the model checks that every routed id is answered), and
                `host_ids` [N, k] (the model reads no ids back from the device again)

`ExpertParallelBackend.expert_ffn` (parallel/backend.py) computes the owned (row, slot)
pairs and sums over ranks. Bringing the ids to the host is one transfer per MoE layer, the
model's own when it runs alone; under the streaming runtime it is blocking where the
scheduler's own route is not (see docs: the `owns` filter is the scheduler's follow-up).

`ShardPredictor` restricts the staging guesses to the shard in the same way (fixed shapes on
the device, no synchronize).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator

import torch
from torch import Tensor

from streamrt.errors import StreamrtError
from streamrt.expert_weights import RoutedExperts, answer_to
from streamrt.model.moe import ExpertRequest
from streamrt.parallel.owners import ExpertOwners
from streamrt.runtime.predictor import Predictor


@dataclass(frozen=True)
class Remote:
    """Stands in for an expert another rank owns: its weights are not on this rank."""

    layer: int
    expert: int
    rank: int

    def __getattr__(self, name: str):  # `.gate` etc.: a backend that is not the parallel one
        raise StreamrtError(
            f"expert L{self.layer:03d}/E{self.expert:04d} lives on rank {self.rank}: "
            "run the model on an ExpertParallelBackend"
        )


class ShardExperts(RoutedExperts):
    """One rank's answer to a layer: the owned experts' weights (`local`: the answer to the
    shard's request, or a plain {id: ExpertWeights}) and a `Remote` stand-in for every other
    routed id; `host_ids` [N, k] and `unique` are the whole layer's."""

    def __init__(self, local, remote: dict[int, Remote], host_ids: Tensor, layer: int, unique: list[int] | None = None):
        super().__init__({}, host_ids, unique, layer)
        if not isinstance(local, RoutedExperts):  # a plain {id: weights}
            local = RoutedExperts(local, torch.tensor([sorted(local)], dtype=torch.int64), layer=layer)
        self._local, self._remote = local, remote
        self._here = frozenset(local.unique)

    def take(self, e: int):
        return self._local.take(e) if e in self._here else self._remote[e]

    def has(self, e: int) -> bool:
        return self._local.has(e) if e in self._here else e in self._remote

    def pending(self, e: int) -> bool:
        return e in self._here and self._local.pending(e)

    def is_local(self, e: int) -> bool:
        return e in self._here


def shard(gen: Generator, owners: ExpertOwners, rank: int) -> Generator:
    try:
        req = next(gen)
        while True:
            host = req.ids.cpu()  # [N, k]
            routed = torch.unique(host).tolist()
            owner = owners.table[req.layer]
            mine = [e for e in routed if int(owner[e]) == rank]
            ids = torch.tensor([mine], dtype=req.ids.dtype).to(req.ids.device)  # [1, U]
            local = yield ExpertRequest(req.layer, ids, torch.ones(ids.shape, device=ids.device), req.hidden)
            local = answer_to(local, torch.tensor([mine], dtype=torch.int64))  # host ids: no transfer
            missing = [e for e in mine if not local.has(e)]  # asking waits for no copy
            if missing:
                raise StreamrtError(
                    f"rank {rank}: expert provider returned no weights for layer {req.layer} experts {missing[:8]}"
                )
            remote = {e: Remote(req.layer, e, int(owner[e])) for e in routed if int(owner[e]) != rank}
            req = gen.send(ShardExperts(local, remote, host, req.layer, routed))
    except StopIteration as stop:
        return stop.value
    finally:
        gen.close()


class ShardPredictor(Predictor):
    """The model's routers' guesses, restricted to this rank's experts: the stager copies
    only experts this rank will compute. Fixed shapes, so nothing waits for the device:
    each guess [T * k] is reordered stably, owned first, and every non-owned place repeats
    the most confident owned guess (the host's dedupe drops the repeats); a layer where no
    guess is owned repeats its first owned expert: at most one stray copy, on this link."""

    def __init__(self, inner: Predictor, owners: ExpertOwners, rank: int) -> None:
        super().__init__(inner.routers, owners.moe_layers, inner.k, inner.backend)
        self.next_layer, self.first_layer = inner.next_layer, inner.first_layer
        self.rank = rank
        self._owner = {layer: t == rank for layer, t in owners.table.items()}  # layer -> [E] bool, moved once
        self._fallback = {layer: owners.experts_of(layer, rank)[0] for layer in owners.moe_layers}

    def _topk(self, layer: int, hidden: Tensor) -> Tensor:
        guess = super()._topk(layer, hidden).reshape(-1)  # [T * k], most confident first per row
        if self._owner[layer].device != guess.device:
            self._owner[layer] = self._owner[layer].to(guess.device)
        owned = self._owner[layer][guess]  # [T * k] bool
        order = torch.argsort((~owned).to(torch.int8), stable=True)
        guess, owned = guess[order], owned[order]
        first = torch.where(owned[0], guess[0], torch.full_like(guess[0], self._fallback[layer]))
        return torch.where(owned, guess, first)
