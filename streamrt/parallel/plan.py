"""The placement of an expert-parallel run, per rank: `streamrt inspect --gpus N --gpu-mem 141G`.

Dense weights are replicated (every rank holds the one-card plan's resident layers and streams
the rest over its own link); the routed experts are sharded by `ExpertOwners`, so each rank's
device tier holds slots for its own shard only and its link carries 1/N of a token's expert
misses. Per rank, uniform routing (the tier's hit rate is slots / experts owned):

    expert bytes / token   = working set * (experts owned / all experts) * expert bytes
    link bytes / token     = streamed dense / token + expert bytes / token * (1 - hit)
    s / token              = max over ranks of max(link bytes / link, touched bytes / HBM)
                             + MoE layers * all-reduce latency (k * Dl fp32 per row and layer)
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrt.parallel.owners import ExpertOwners
from streamrt.placement import Placement, plan_placement
from streamrt.plan import GIB, expert_bytes_nvfp4

ALLREDUCE_US = 20.0  # one small NCCL all-reduce within a host (an assumption until measured on the GPUs)


@dataclass(frozen=True)
class RankPlan:
    rank: int
    experts: int  # (layer, expert) keys owned
    slots: int  # device slots for them
    expert_bytes_per_token: float
    link_bytes_per_token: float
    touched_bytes_per_token: float

    @property
    def hit(self) -> float:
        return min(1.0, self.slots / self.experts)


def plan_ranks(
    cfg, gpu_bytes: int, world: int, *, context: int = 4096, buffers: int = 2
) -> tuple[Placement, list[RankPlan]]:
    """(the one-card dense plan every rank runs, each rank's share of the experts)."""
    p = plan_placement(cfg, gpu_bytes, context=context, buffers=buffers)
    owners, eb = ExpertOwners.for_config(cfg, world), expert_bytes_nvfp4(cfg)
    dense = sum(p.layer_bytes) + p.fixed_bytes["lm_head and norms"] + p.fixed_bytes["routers"]
    ranks = []
    for r in range(world):
        owned = owners.counts(r)
        slots = min(p.expert_slots, owned)
        per_token = cfg.working_set_experts * owned / cfg.expert_files * eb
        miss = per_token * (1.0 - min(1.0, slots / owned))
        ranks.append(RankPlan(r, owned, slots, per_token, p.streamed_bytes_per_token + miss, dense + per_token))
    return p, ranks


def projected_s_per_token(cfg, ranks: list[RankPlan], link_gbps: float, hbm_gbps: float,
                          allreduce_us: float = ALLREDUCE_US) -> dict[str, float]:
    link = max(r.link_bytes_per_token for r in ranks) / (link_gbps * 1e9)
    compute = max(r.touched_bytes_per_token for r in ranks) / (hbm_gbps * 1e9)
    reduce = len(cfg.moe_layers) * allreduce_us * 1e-6 if len(ranks) > 1 else 0.0
    return {"link_s": link, "compute_floor_s": compute, "allreduce_s": reduce,
            "s_per_token": max(link, compute) + reduce,
            "summed_link_bytes_per_token": sum(r.link_bytes_per_token for r in ranks)}


def format_rank_plan(cfg, gpu_bytes: int, world: int, link_gbps: float, hbm_gbps: float, *, context: int = 4096,
                     buffers: int = 2) -> str:
    p, ranks = plan_ranks(cfg, gpu_bytes, world, context=context, buffers=buffers)
    proj = projected_s_per_token(cfg, ranks, link_gbps, hbm_gbps)
    lines = [
        f"{cfg.name} on {world} x {gpu_bytes / GIB:g} GiB (context {context:,}, link {link_gbps:g} GB/s per GPU, "
        f"HBM {hbm_gbps:g} GB/s, uniform routing): dense replicated ({len(p.resident_layers)} of {cfg.num_layers} "
        f"layers resident, {p.streamed_bytes_per_token / GIB:.1f} GiB streamed per token per rank), "
        f"experts sharded (m * E + e) mod {world}",
        "| rank | experts owned | device slots | hit | expert bytes / token | link bytes / token |",
        "|---|---|---|---|---|---|",
    ]
    for r in ranks:
        lines.append(
            f"| {r.rank} | {r.experts:,} | {r.slots:,} | {r.hit:.1%} | {r.expert_bytes_per_token / GIB:.2f} GiB "
            f"| {r.link_bytes_per_token / GIB:.2f} GiB |"
        )
    lines.append(f"projected {proj['s_per_token']:.3f} s/token (link {proj['link_s']:.3f} s, compute floor "
                 f"{proj['compute_floor_s']:.3f} s, {len(cfg.moe_layers)} all-reduces {proj['allreduce_s']:.3f} s at "
                 f"{ALLREDUCE_US:g} us each); {proj['summed_link_bytes_per_token'] / GIB:.1f} GiB per token over "
                 f"{world} links")
    return "\n".join(lines)
