"""`ExpertParallel`: this process's part of an expert-parallel run, in one object.

    ep = ExpertParallel.join(ranks, cfg, device)   # the group forms here (NCCL on CUDA, else gloo)
    options = ep.rank_options(options)          # cuda:LOCAL_RANK; --stats-json / --trace per rank
    model = load_model(tree, device, backend=ep.wrap(inner_backend))
    options = ep.shard_slots(options)           # no device slot for another rank's expert
    rt = StreamingRuntime(tree, model, options, predictor=ep.predictor(model))
    logits = rt.run(ep.shard(model.forward_steps(ids, cache)))

What a session (`streamrt run --gpus N`) adds to its single-process path; everything else
(the tree, the dense model, the scheduler, generate) is the same code on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

import torch

from streamrt.parallel.backend import ExpertParallelBackend
from streamrt.parallel.group import DEFAULT_TIMEOUT_S, Ranks, init_group
from streamrt.parallel.owners import ExpertOwners
from streamrt.parallel.shard import ShardPredictor, shard


@dataclass
class ExpertParallel:
    ranks: Ranks
    owners: ExpertOwners
    group: object
    timeout_s: float = DEFAULT_TIMEOUT_S
    backend: ExpertParallelBackend | None = None  # set by `wrap`

    @classmethod
    def join(cls, ranks: Ranks, cfg, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S,
             group=None) -> "ExpertParallel":
        """Form the process group on `device`'s kind (NCCL for CUDA, else gloo), or use `group`."""
        group = group if group is not None else init_group(ranks, timeout_s, device)
        return cls(ranks, ExpertOwners.for_config(cfg, ranks.world), group, timeout_s)

    @classmethod
    def for_options(cls, ranks: Ranks, cfg, options, timeout_s: float = DEFAULT_TIMEOUT_S) -> "ExpertParallel":
        """`join` on the device this rank's RuntimeOptions run on (see `rank_options`)."""
        return cls.join(ranks, cfg, torch.device(_rank_device(options.device, ranks)), timeout_s)

    def wrap(self, inner=None) -> ExpertParallelBackend:
        """The model's backend: `inner` (None: the torch reference) with the sharded expert sum."""
        if inner is None:
            from streamrt.backends.torch_backend import TorchBackend

            inner = TorchBackend()
        self.backend = ExpertParallelBackend(
            inner, self.group, rank=self.rank, timeout=timedelta(seconds=self.timeout_s)
        )
        return self.backend

    @property
    def rank(self) -> int:
        return self.ranks.rank

    def shard(self, gen):
        return shard(gen, self.owners, self.ranks.rank)

    def predictor(self, model) -> ShardPredictor:
        from streamrt.runtime.predictor import Predictor

        return ShardPredictor(Predictor.from_model(model), self.owners, self.ranks.rank)

    def rank_options(self, options):
        """RuntimeOptions for this rank: its own GPU (cuda:LOCAL_RANK unless --device cpu), and
        its own --stats-json / --trace files (FILE.rankR; rank 0 keeps FILE)."""
        per = (lambda p: p if p is None or self.rank == 0 else f"{p}.rank{self.rank}")  # noqa: E731
        return replace(options, device=_rank_device(options.device, self.ranks), stats_json=per(options.stats_json),
                       trace=per(options.trace))

    def shard_slots(self, options):
        """--gpu-experts (or the placement plan's slots) capped at the experts this rank owns:
        a slot for another rank's expert would never be filled. Unset stays unset (the runtime
        sizes it from free memory)."""
        if options.gpu_experts is None:
            return options
        return replace(options, gpu_experts=min(options.gpu_experts, self.owners.counts(self.rank)))

    def line(self) -> str:
        """The start line: where this rank sits and what it holds."""
        mine, total = self.owners.counts(self.rank), len(self.owners.moe_layers) * self.owners.num_experts
        return (f"expert parallel: rank {self.rank} of {self.ranks.world} holds {mine:,} of {total:,} routed experts "
                f"((m * E + e) mod {self.ranks.world}); one all-reduce per MoE layer")


def _rank_device(device: str, ranks: Ranks) -> str:
    """--device for a rank: the CPU when asked (or without GPUs), else cuda:LOCAL_RANK."""
    if device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return str(ranks.device())
