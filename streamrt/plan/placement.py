"""What lives on the GPU and what streams: the placement plan for a card of a given size.

Every decoded token touches every layer's dense weights once, but only `experts_per_token` of
a layer's routed experts, so a GPU byte spent on dense weights saves one link byte per token
while a byte of expert slots saves far less (about its hit rate). The plan therefore fills the
card in that order (DESIGN.md, "Where the bytes live"):

1. what must be resident: lm_head, the norms and AttnRes vectors, the caches for the context,
   the activation workspace, every layer's router (the predictor applies layer l+1's router before
   l+1's dense weights are on the link), `buffers` device buffers for streamed layers (each the
   size of the largest streamed layer: 2 double-buffer, 3 triple) and the minimum expert slots
   (`MIN_SLOT_LAYERS` layers' routed experts); the embedding table stays in
   host memory (a decode step gathers one row per token);
2. the longest run of layers from layer 0 whose dense weights fit beside that (every layer is
   used once per token, so which ones is free; contiguous runs keep the copy queue simple; a
   resident layer 0, the dense-FFN layer and the largest, also shrinks the buffers);
3. every byte left becomes expert slots.

Anything not resident streams per layer over the link (runtime/dense_stream.py), ahead of that
layer's expert guesses.
The projection is bytes over the link per token / link rate, under a stated assumption for
expert hits (uniform routing: a slot holds a given expert, so hits = slots / expert files),
plus an HBM-bound compute floor (bytes the GPU reads per token / HBM rate).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamrt.checkpoint.names import dense_layer_specs, global_specs
from streamrt.config import ModelConfig
from streamrt.output_paths import human_bytes
from streamrt.errors import StreamrtError
from streamrt.plan.budget import GIB, expert_bytes_nvfp4, kda_state_scalars, kv_cache_bytes_per_token

WORKSPACE_BYTES = 1 << 30  # activations, logits, kernel scratch: a fixed reserve
STREAM_BUFFERS = 2  # layer l+1 copies in while layer l computes
# Expert slots kept whatever the card, in layers' worth of routed experts: the layer computing
# (pinned), the next layer's staged guesses, the previous layer's slots its queued compute still
# reads, and one layer of slack. Fewer thrash: on an H200 (deep-k3.1-pro) 38 slots, 2.4 layers'
# worth, ran 2.2 s/token against a 0.62 s link floor.
MIN_SLOT_LAYERS = 4
ROUTER_SUFFIXES = ("block_sparse_moe.gate.weight", "block_sparse_moe.gate.e_score_correction_bias")


@dataclass(frozen=True)
class Placement:
    """The plan for one card. Byte counts are exact from the tensor inventory."""

    gpu_bytes: int
    context: int
    resident_layers: tuple[int, ...]
    streamed_layers: tuple[int, ...]
    expert_slots: int
    fixed_bytes: dict[str, int] = field(default_factory=dict)  # what is resident whatever the card
    layer_bytes: tuple[int, ...] = ()  # dense bytes of each layer that can stream (its router excluded)
    host_bytes: dict[str, int] = field(default_factory=dict)  # what stays in host memory
    buffers: int = STREAM_BUFFERS  # device buffers streamed layers rotate through

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
        touched = sum(self.layer_bytes) + self.fixed_bytes["lm_head and norms"] + self.fixed_bytes["routers"]
        touched += cfg.working_set_experts * expert_bytes_nvfp4(cfg)
        compute = touched / (hbm_gbps * 1e9)
        return {"link_s": link, "compute_floor_s": compute, "s_per_token": max(link, compute)}

    def hybrid_s_per_token(self, cfg: ModelConfig, link_gbps: float, cpu_gbps: float,
                           hbm_gbps: float) -> dict[str, float]:
        """The split floor with the host CPUs computing missed experts at `cpu_gbps` of expert bytes:
        streamed dense bytes go over the link; of the missed expert bytes E, x go to the CPU where
        the two roads finish together, x = (link bytes) * cpu / (link + cpu), at most E."""
        base = self.projected_s_per_token(cfg, link_gbps, hbm_gbps)
        total, misses = self.link_bytes_per_token(cfg), self.expert_miss_bytes_per_token(cfg)
        cpu_bytes = min(misses, total * cpu_gbps / (link_gbps + cpu_gbps))
        link_s, cpu_s = (total - cpu_bytes) / (link_gbps * 1e9), cpu_bytes / (cpu_gbps * 1e9)
        return {"cpu_bytes_per_token": cpu_bytes, "hybrid_link_s": link_s, "hybrid_cpu_s": cpu_s,
                "hybrid_s_per_token": max(link_s, cpu_s, base["compute_floor_s"])}


def layer_dense_bytes(cfg: ModelConfig) -> tuple[int, ...]:
    """Dense (non-routed) bytes of each layer that can stream, as stored (F32 where released):
    every tensor but the router's."""
    return tuple(sum(s.nbytes for s in dense_layer_specs(cfg, i) if not s.name.endswith(ROUTER_SUFFIXES))
                 for i in range(cfg.num_layers))


def router_bytes(cfg: ModelConfig) -> int:
    """Every layer's router (gate weight and score-correction bias): always resident."""
    return sum(
        s.nbytes for i in range(cfg.num_layers) for s in dense_layer_specs(cfg, i) if s.name.endswith(ROUTER_SUFFIXES)
    )


def min_expert_slots(cfg: ModelConfig, batch: int = 1) -> int:
    """The slots a plan keeps whatever the card: MIN_SLOT_LAYERS layers' unique routed experts."""
    return MIN_SLOT_LAYERS * min(cfg.num_experts, batch * cfg.experts_per_token)


def plan_placement(
    cfg: ModelConfig, gpu_bytes: int, *, context: int = 4096, batch: int = 1, buffers: int = STREAM_BUFFERS
) -> Placement:
    """The placement for a card with `gpu_bytes` free; StreamrtError naming the shortfall when
    even streaming every layer cannot fit the working buffers."""
    if gpu_bytes <= 0:
        raise StreamrtError(f"--gpu-mem must be > 0, got {gpu_bytes}")
    if context < 1 or batch < 1:
        raise StreamrtError(f"context and batch must be >= 1, got {context} and {batch}")
    if buffers < 2:
        raise StreamrtError(
            f"dense streaming needs at least 2 device buffers (layer l+1 copies while l computes), got {buffers}"
        )
    glob = {s.name.rsplit(".", 2)[-2]: s.nbytes for s in global_specs(cfg)}
    embed = glob.pop("embed_tokens")
    layers = layer_dense_bytes(cfg)
    fixed = {
        "lm_head and norms": sum(glob.values()),
        "routers": router_bytes(cfg),
        "KV cache": kv_cache_bytes_per_token(cfg) * context * batch,
        "KDA state": kda_state_scalars(cfg) * 4 * batch,
        "workspace": WORKSPACE_BYTES,
        "minimum expert slots": min_expert_slots(cfg, batch) * expert_bytes_nvfp4(cfg),
    }
    r, prefix, suffix_max, need = _resident_prefix(cfg, gpu_bytes, fixed, layers, buffers, context)
    n = len(layers)
    resident, streamed = tuple(range(r)), tuple(range(r, n))
    if streamed:
        fixed["stream buffers"] = buffers * suffix_max[r]
    free = gpu_bytes - need[r]
    host = {"embedding": embed, "streamed dense": sum(layers[i] for i in streamed)}
    if not streamed and embed <= free:  # nothing streams: the embedding may move in
        free -= embed
        fixed["embedding"] = host.pop("embedding")
    slots = min_expert_slots(cfg, batch) + int(free // expert_bytes_nvfp4(cfg))
    slots = min(slots, cfg.expert_files)
    return Placement(gpu_bytes=gpu_bytes, context=context, resident_layers=resident, streamed_layers=streamed,
                     expert_slots=slots, fixed_bytes=fixed, layer_bytes=layers, host_bytes=host, buffers=buffers)


def _resident_prefix(cfg: ModelConfig, gpu_bytes: int, fixed: dict, layers: list[int], buffers: int, context: int):
    """Layers 0..r-1 resident, r.. streamed through buffers sized by the largest streamed layer:
    the largest r that fits (more memory never streams more: the feasible set only grows), with
    the prefix sums, suffix maxima and need per r; StreamrtError naming the shortfall if none fits."""
    n, base = len(layers), sum(fixed.values())
    prefix = [0] * (n + 1)
    for i, b in enumerate(layers):
        prefix[i + 1] = prefix[i] + b
    suffix_max = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix_max[i] = max(layers[i], suffix_max[i + 1])
    need = [base + prefix[r] + buffers * suffix_max[r] for r in range(n + 1)]
    fits = [r for r in range(n + 1) if need[r] <= gpu_bytes]
    if not fits:
        r = min(range(n + 1), key=need.__getitem__)
        parts = {"dense of resident layers": prefix[r]} if r else {}
        parts = {**fixed, "stream buffers": buffers * suffix_max[r], **parts}
        parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in parts.items())
        raise StreamrtError(
            f"{cfg.name} cannot run in {human_bytes(gpu_bytes)} of GPU memory even streaming every layer: "
            f"it needs {human_bytes(need[r])} ({parts}) at context {context}; "
            f"{human_bytes(need[r] - gpu_bytes)} short"
        )
    return max(fits), prefix, suffix_max, need


def describe(cfg: ModelConfig, p: Placement, link_gbps: float, hbm_gbps: float) -> list[tuple[str, str]]:
    """Rows for `streamrt inspect --gpu-mem` and the start of `streamrt run`."""
    proj = p.projected_s_per_token(cfg, link_gbps, hbm_gbps)
    n_res, n_str = len(p.resident_layers), len(p.streamed_layers)
    return [
        ("GPU memory", f"{p.gpu_bytes / GIB:,.1f} GiB (context {p.context:,} tokens)"),
        (
            "resident",
            f"lm_head and norms {p.fixed_bytes['lm_head and norms'] / GIB:.2f} GiB, routers "
            f"{p.fixed_bytes['routers'] / GIB:.2f} GiB, caches "
            f"{(p.fixed_bytes['KV cache'] + p.fixed_bytes['KDA state']) / GIB:.2f} GiB, dense of {n_res} layers "
            f"{p.resident_dense_bytes / GIB:.2f} GiB",
        ),
        (
            "streamed per layer",
            f"{n_str} layers, {p.streamed_bytes_per_token / GIB:.2f} GiB per token"
            + (
                f" (layers {layer_ranges(p.streamed_layers)}; {p.buffers} device buffers "
                f"{p.fixed_bytes['stream buffers'] / GIB:.2f} GiB)"
                if n_str
                else ""
            ),
        ),
        (
            "expert slots",
            f"{p.expert_slots:,} of {cfg.expert_files:,} ({p.expert_slots * expert_bytes_nvfp4(cfg) / GIB:.1f} GiB)",
        ),
        (
            "host memory",
            ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in p.host_bytes.items()) + ", plus the expert store",
        ),
        (
            f"projected @ {link_gbps:g} GB/s link",
            f"{proj['s_per_token']:.3f} s/token (link {proj['link_s']:.3f} s: "
            f"{p.link_bytes_per_token(cfg) / GIB:.2f} GiB/token with uniform expert hits; "
            f"compute floor {proj['compute_floor_s']:.3f} s at {hbm_gbps:g} GB/s HBM)",
        ),
    ]


def format_plan(cfg: ModelConfig, p: Placement, link_gbps: float = 55.0, hbm_gbps: float = 3350.0) -> str:
    """The plan as `streamrt inspect --gpu-mem` and the start of `streamrt run` print it."""
    rows = describe(cfg, p, link_gbps, hbm_gbps)
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"{cfg.name}: placement"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def layer_ranges(xs) -> str:
    """(0, 1, 2, 5) -> '0-2, 5'."""
    out, i, xs = [], 0, list(xs)
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out) or "-"
