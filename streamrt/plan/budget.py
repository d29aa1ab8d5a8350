"""Budgets derived from a config: the seed-001 walkthrough done by the program.

Every figure here is arithmetic on the configuration (no measurement): bytes per expert in
each format, the per-token working set, cache and state sizes, parameter counts. The
`streamrt inspect` command prints them; tests hold them to the seeds' numbers.
"""

from __future__ import annotations

from streamrt.config import ModelConfig

MIB = 1 << 20
GIB = 1 << 30

# What this runtime keeps per cached token: activations and caches are float32.
CACHE_DTYPE_BYTES = 4


def expert_matrix_weights(cfg: ModelConfig) -> int:
    """Weights of one routed expert: gate and up [I, Dl], down [Dl, I]."""
    return 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size


def expert_bytes_nvfp4(cfg: ModelConfig) -> int:
    """Nibbles plus one E4M3 scale per 16 weights (the per-matrix global scale is noise)."""
    n = expert_matrix_weights(cfg)
    return n // 2 + n // 16


def expert_bytes_mxfp4(cfg: ModelConfig) -> int:
    """Nibbles plus one E8M0 scale per 32 weights, as released."""
    n = expert_matrix_weights(cfg)
    return n // 2 + n // 32


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = CACHE_DTYPE_BYTES) -> int:
    """What this runtime caches per token across layers: the MLA latent, the un-rotated
    shared key dims, and (K3.1 Pro) the indexer key."""
    per_mla = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    idx = cfg.indexer.head_dim * len(cfg.indexer.layers) if cfg.indexer else 0
    return (len(cfg.mla_layers) * per_mla + idx) * dtype_bytes


def kda_state_scalars(cfg: ModelConfig) -> int:
    return len(cfg.kda_layers) * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim


def budget(cfg: ModelConfig, tensor_count: int | None = None) -> dict:
    """The figures `streamrt inspect --json` prints."""
    per_layer = cfg.num_experts * expert_matrix_weights(cfg)
    out = {
        "name": cfg.name,
        "variant": cfg.variant,
        "num_layers": cfg.num_layers,
        "kda_layers": list(cfg.kda_layers),
        "mla_layers": list(cfg.mla_layers),
        "indexer_layers": list(cfg.indexer_layers),
        "moe_layers": list(cfg.moe_layers),
        "dense_ffn_layers": list(cfg.dense_layers),
        "attnres_block_starts": list(cfg.attnres_block_starts),
        "attnres_groups": cfg.attnres_groups,
        "experts_per_layer": cfg.num_experts,
        "experts_per_token": cfg.experts_per_token,
        "working_set_experts": cfg.working_set_experts,
        "expert_bytes_nvfp4": expert_bytes_nvfp4(cfg),
        "expert_bytes_mxfp4": expert_bytes_mxfp4(cfg),
        "expert_bytes_per_token": cfg.working_set_experts * expert_bytes_nvfp4(cfg),
        "expert_files": cfg.expert_files,
        "routed_bytes_total_nvfp4": cfg.expert_files * expert_bytes_nvfp4(cfg),
        "mla_latent_bytes_per_token_idealized": len(cfg.mla_layers) * cfg.kv_lora_rank * 2,
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg),
        "kda_state_bytes": {"bf16": kda_state_scalars(cfg) * 2, "fp32": kda_state_scalars(cfg) * 4},
        "routed_params_per_layer": per_layer,
        "active_routed_params_per_token_per_layer": cfg.experts_per_token * expert_matrix_weights(cfg),
    }
    if tensor_count is not None:
        out["tensor_count"] = tensor_count
    return out


def link_floor_s_per_token(cfg: ModelConfig, link_gbps: float, miss_fraction: float = 1.0) -> float:
    """Lower bound on s/token when `miss_fraction` of the working set crosses a link of
    `link_gbps` (1e9 bytes/s) every token."""
    return cfg.working_set_experts * expert_bytes_nvfp4(cfg) * miss_fraction / (link_gbps * 1e9)
