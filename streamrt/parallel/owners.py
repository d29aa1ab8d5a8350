"""`ExpertOwners`: which rank holds, fetches and computes each routed expert.

The rule, one round-robin deal over the whole model:

    owner(layer, e) = (m * E + e) mod N        m = the layer's index among the MoE layers,
                                               E experts per layer, N ranks

Per layer that is a round-robin with a rotation of m * E mod N, so every layer's experts
split ⌊E/N⌋ / ⌈E/N⌉ over the ranks, and over all (layer, expert) keys no rank holds more
than one expert above another (when N divides E the rotation is 0: rank r owns the
experts e ≡ r mod N of every layer). A pure function of (config, N): every rank computes
the same map on its own, with nothing exchanged.
"""

from __future__ import annotations

from functools import cached_property

import torch

from streamrt.errors import StreamrtError
from streamrt.store.keys import ExpertKey


class ExpertOwners:
    def __init__(self, moe_layers: tuple[int, ...], num_experts: int, world: int) -> None:
        if world < 1:
            raise StreamrtError(f"expert parallelism needs at least 1 rank, got {world}")
        if world > num_experts:
            raise StreamrtError(f"{world} ranks for {num_experts} experts per layer: a rank would own none")
        self.moe_layers, self.num_experts, self.world = tuple(moe_layers), num_experts, world
        self._index = {layer: m for m, layer in enumerate(self.moe_layers)}

    @classmethod
    def for_config(cls, cfg, world: int) -> "ExpertOwners":
        return cls(tuple(cfg.moe_layers), cfg.num_experts, world)

    def rank_of(self, layer: int, expert: int) -> int:
        return (self._index[layer] * self.num_experts + expert) % self.world

    def owns(self, rank: int, key: ExpertKey) -> bool:
        return self.rank_of(key.layer, key.expert) == rank

    def experts_of(self, layer: int, rank: int) -> list[int]:
        """The experts of `layer` that `rank` owns, ascending."""
        first = (rank - self._index[layer] * self.num_experts) % self.world
        return list(range(first, self.num_experts, self.world))

    @cached_property
    def table(self) -> dict[int, torch.Tensor]:
        """layer -> owner rank of each expert, LongTensor [E] (CPU; `ShardPredictor` moves it)."""
        e = torch.arange(self.num_experts)
        return {layer: (m * self.num_experts + e) % self.world for layer, m in self._index.items()}

    def counts(self, rank: int) -> int:
        """How many (layer, expert) keys `rank` owns."""
        return sum(len(self.experts_of(layer, rank)) for layer in self.moe_layers)
