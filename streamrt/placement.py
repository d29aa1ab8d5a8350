"""What lives on the GPU and what streams: the placement plan for a card of a given size.

Every decoded token touches every layer's dense weights once, but only `experts_per_token` of
a layer's routed experts, so a GPU byte spent on dense weights saves one link byte per token
while a byte of expert slots saves far less (about its hit rate). The plan therefore fills the
card in that order (DESIGN.md, "Where the bytes live"):

1. what must be resident: lm_head, the norms and AttnRes vectors, the caches for the context,
   the activation workspace, a double buffer for streamed layers (sized by the largest one)
   and the minimum expert slots (this layer's routed experts and the next layer's staged ones);
   the embedding table stays in host memory (a decode step gathers one row per token);
2. as many layers' dense weights as fit, in layer order (every layer is used once per token,
   so which ones is free; contiguous runs keep the copy queue simple);
3. every byte left becomes expert slots.

Anything not resident streams per layer over the link, ahead of that layer's expert guesses.
The projection is bytes over the link per token / link rate, under a stated assumption for
expert hits (uniform routing: a slot holds a given expert, so hits = slots / expert files),
plus an HBM-bound compute floor (bytes the GPU reads per token / HBM rate).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamrt.checkpoint.names import dense_layer_specs, global_specs
from streamrt.config import ModelConfig
from streamrt.errors import StreamrtError
from streamrt.plan import GIB, expert_bytes_nvfp4, kda_state_scalars, kv_cache_bytes_per_token

WORKSPACE_BYTES = 1 << 30  # activations, logits, kernel scratch: a fixed reserve
STREAM_BUFFERS = 2  # layer l+1 copies in while layer l computes


@dataclass(frozen=True)
class Placement:
    """The plan for one card. Byte counts are exact from the tensor inventory."""

    gpu_bytes: int
    context: int
    resident_layers: tuple[int, ...]
    streamed_layers: tuple[int, ...]
    expert_slots: int
    fixed_bytes: dict[str, int] = field(default_factory=dict)  # what is resident whatever the card
    layer_bytes: tuple[int, ...] = ()  # dense bytes of each layer
    host_bytes: dict[str, int] = field(default_factory=dict)  # what stays in host memory

    @property
    def streamed_bytes_per_token(self) -> int:
        return sum(self.layer_bytes[i] for i in self.streamed_layers)

    @property
    def resident_dense_bytes(self) -> int:
        return sum(self.layer_bytes[i] for i in self.resident_layers)

    def expert_miss_bytes_per_token(self, cfg: ModelConfig) -> float:
        hit = min(1.0, self.expert_slots / cfg.expert_files)
        return cfg.working_set_experts * expert_bytes_nvfp4(cfg) * (1.0 - hit)

    def link_bytes_per_token(self, cfg: ModelConfig) -> float:
        return self.streamed_bytes_per_token + self.expert_miss_bytes_per_token(cfg)

    def projected_s_per_token(self, cfg: ModelConfig, link_gbps: float, hbm_gbps: float) -> dict[str, float]:
        link = self.link_bytes_per_token(cfg) / (link_gbps * 1e9)
        touched = sum(self.layer_bytes) + self.fixed_bytes["lm_head and norms"]
        touched += cfg.working_set_experts * expert_bytes_nvfp4(cfg)
        compute = touched / (hbm_gbps * 1e9)
        return {"link_s": link, "compute_floor_s": compute, "s_per_token": max(link, compute)}


def layer_dense_bytes(cfg: ModelConfig) -> tuple[int, ...]:
    """Dense (non-routed) bytes of each layer, as stored (F32 where released)."""
    return tuple(sum(s.nbytes for s in dense_layer_specs(cfg, i)) for i in range(cfg.num_layers))


def plan_placement(cfg: ModelConfig, gpu_bytes: int, *, context: int = 4096, batch: int = 1) -> Placement:
    """The placement for a card with `gpu_bytes` free; StreamrtError naming the shortfall when
    even streaming every layer cannot fit the working buffers."""
    if gpu_bytes <= 0:
        raise StreamrtError(f"--gpu-mem must be > 0, got {gpu_bytes}")
    if context < 1 or batch < 1:
        raise StreamrtError(f"context and batch must be >= 1, got {context} and {batch}")
    glob = {s.name.rsplit(".", 2)[-2]: s.nbytes for s in global_specs(cfg)}
    embed = glob.pop("embed_tokens")
    layers = layer_dense_bytes(cfg)
    fixed = {
        "lm_head and norms": sum(glob.values()),
        "KV cache": kv_cache_bytes_per_token(cfg) * context * batch,
        "KDA state": kda_state_scalars(cfg) * 4 * batch,
        "workspace": WORKSPACE_BYTES,
        "stream buffers": STREAM_BUFFERS * max(layers),
        "minimum expert slots": 2 * cfg.experts_per_token * expert_bytes_nvfp4(cfg),
    }
    need = sum(fixed.values())
    if need > gpu_bytes:
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in fixed.items())
        raise StreamrtError(
            f"{cfg.name} cannot run in {gpu_bytes / GIB:.1f} GiB of GPU memory even streaming every layer: "
            f"it needs {need / GIB:.1f} GiB ({parts} GiB) at context {context}; "
            f"{(need - gpu_bytes) / GIB:.1f} GiB short (a shorter --context shrinks the KV cache)"
        )
    free = gpu_bytes - need
    resident: list[int] = []
    for i, b in enumerate(layers):
        if b > free:
            break
        resident.append(i)
        free -= b
    streamed = tuple(i for i in range(cfg.num_layers) if i not in set(resident))
    host = {"embedding": embed, "streamed dense": sum(layers[i] for i in streamed)}
    if not streamed:  # nothing streams: the double buffer is free, and the embedding may move in
        free += fixed.pop("stream buffers")
        if embed <= free:
            free -= embed
            fixed["embedding"] = host.pop("embedding")
    slots = 2 * cfg.experts_per_token + int(free // expert_bytes_nvfp4(cfg))
    slots = min(slots, cfg.expert_files)
    return Placement(
        gpu_bytes=gpu_bytes,
        context=context,
        resident_layers=tuple(resident),
        streamed_layers=streamed,
        expert_slots=slots,
        fixed_bytes=fixed,
        layer_bytes=layers,
        host_bytes=host,
    )


def describe(cfg: ModelConfig, p: Placement, link_gbps: float, hbm_gbps: float) -> list[tuple[str, str]]:
    """Rows for `streamrt inspect --gpu-mem` and the start of `streamrt run`."""
    proj = p.projected_s_per_token(cfg, link_gbps, hbm_gbps)
    n_res, n_str = len(p.resident_layers), len(p.streamed_layers)
    return [
        ("GPU memory", f"{p.gpu_bytes / GIB:,.1f} GiB (context {p.context:,} tokens)"),
        ("resident", f"lm_head and norms {p.fixed_bytes['lm_head and norms'] / GIB:.2f} GiB, caches "
                     f"{(p.fixed_bytes['KV cache'] + p.fixed_bytes['KDA state']) / GIB:.2f} GiB, dense of {n_res} layers "
                     f"{p.resident_dense_bytes / GIB:.2f} GiB"),
        ("streamed per layer", f"{n_str} layers, {p.streamed_bytes_per_token / GIB:.2f} GiB per token"
                               + (f" (double buffer {p.fixed_bytes['stream buffers'] / GIB:.2f} GiB)" if n_str else "")),
        ("expert slots", f"{p.expert_slots:,} of {cfg.expert_files:,} ({p.expert_slots * expert_bytes_nvfp4(cfg) / GIB:.1f} GiB)"),
        ("host memory", ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in p.host_bytes.items()) + ", plus the expert store"),
        (f"projected @ {link_gbps:g} GB/s link", f"{proj['s_per_token']:.3f} s/token (link {proj['link_s']:.3f} s: "
                                                  f"{p.link_bytes_per_token(cfg) / GIB:.2f} GiB/token with uniform expert hits; "
                                                  f"compute floor {proj['compute_floor_s']:.3f} s at {hbm_gbps:g} GB/s HBM)"),
    ]
