"""The release tensor layout a config implies (spec/MODEL.md §9.1, spec/K31_INDEXER.md).

Names carry the `language_model.` prefix. Dense tensors are BF16 except A_log and dt_bias
(FP32); routed experts are MXFP4 `weight_packed` / `weight_scale` uint8; the K3.1 Pro
indexer adds five BF16 tensors per indexer layer. Vision tensors are out of scope.

At full geometry this is ~500k specs, so the expert block is built with plain tuples.
"""

from __future__ import annotations

from typing import NamedTuple

from streamrt.config import INDEXER_TENSORS, ModelConfig

PREFIX = "language_model."
BF16, F32, U8 = "BF16", "F32", "U8"
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "F64": 8, "I32": 4, "I64": 8, "I16": 2, "BOOL": 1}


class TensorSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def layer_prefix(i: int) -> str:
    return f"{PREFIX}model.layers.{i}."


def expert_prefix(layer: int, expert: int) -> str:
    return f"{layer_prefix(layer)}block_sparse_moe.experts.{expert}."


def expert_matrix_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of w1 (gate), w3 (up), w2 (down) in the routed expert."""
    i, dl = cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    return {"w1": (i, dl), "w3": (i, dl), "w2": (dl, i)}


def expert_specs(cfg: ModelConfig, layer: int, expert: int) -> list[TensorSpec]:
    p = expert_prefix(layer, expert)
    out = []
    for w, (o, k) in expert_matrix_shapes(cfg).items():
        out.append(TensorSpec(f"{p}{w}.weight_packed", (o, k // 2), U8))
        out.append(TensorSpec(f"{p}{w}.weight_scale", (o, k // 32), U8))
    return out


def is_expert_tensor(name: str) -> bool:
    return ".block_sparse_moe.experts." in name


def dense_layer_specs(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    """Every non-expert tensor of layer i."""
    D = cfg.hidden_size
    p = layer_prefix(i)
    s: list[TensorSpec] = []
    add = lambda n, shape, dt=BF16: s.append(TensorSpec(p + n, tuple(shape), dt))  # noqa: E731
    for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
        add(f"{n}.weight", (D,))
    add("self_attention_res_proj.weight", (1, D))
    add("mlp_res_proj.weight", (1, D))

    a = "self_attn."
    if cfg.layer_kind(i) == "kda":
        P, K, H, W = cfg.kda_proj_dim, cfg.kda_head_dim, cfg.kda_num_heads, cfg.short_conv_kernel_size
        for n in ("q_proj", "k_proj", "v_proj", "g_proj"):  # K3: full-rank output gate only
            add(f"{a}{n}.weight", (P, D))
        add(f"{a}o_proj.weight", (D, P))
        add(f"{a}f_a_proj.weight", (K, D))
        add(f"{a}f_b_proj.weight", (P, K))
        add(f"{a}b_proj.weight", (H, D))
        for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
            add(f"{a}{n}.weight", (P, 1, W))
        add(f"{a}A_log", (cfg.a_log_stored_len,), F32)  # first H entries live, rest zero padding
        add(f"{a}dt_bias", (P,), F32)
        add(f"{a}o_norm.weight", (K,))
    else:
        nh = cfg.num_attention_heads
        add(f"{a}q_a_proj.weight", (cfg.q_lora_rank, D))
        add(f"{a}q_a_layernorm.weight", (cfg.q_lora_rank,))
        add(f"{a}q_b_proj.weight", (nh * cfg.qk_head_dim, cfg.q_lora_rank))
        add(f"{a}kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, D))
        add(f"{a}kv_a_layernorm.weight", (cfg.kv_lora_rank,))
        add(f"{a}kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank))
        add(f"{a}o_proj.weight", (D, nh * cfg.v_head_dim))
        if cfg.mla_use_output_gate:
            add(f"{a}g_proj.weight", (nh * cfg.v_head_dim, D))
        if cfg.has_indexer(i):
            ix = cfg.indexer
            shapes = {
                "wq_b.weight": (ix.n_heads * ix.head_dim, cfg.q_lora_rank),
                "wk.weight": (ix.head_dim, D),
                "k_norm.weight": (ix.head_dim,),
                "k_norm.bias": (ix.head_dim,),
                "weights_proj.weight": (ix.n_heads, D),
            }
            for n in INDEXER_TENSORS:
                add(f"{a}indexer.{n}", shapes[n])

    if cfg.is_moe(i):
        m = "block_sparse_moe."
        E, Dl, Is = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.shared_intermediate_size
        add(f"{m}gate.weight", (E, D))
        add(f"{m}gate.e_score_correction_bias", (E,))
        add(f"{m}routed_expert_down_proj.weight", (Dl, D))
        if cfg.latent_moe_use_norm:
            add(f"{m}routed_expert_norm.weight", (Dl,))
        add(f"{m}routed_expert_up_proj.weight", (D, Dl))
        if Is:
            add(f"{m}shared_experts.gate_proj.weight", (Is, D))
            add(f"{m}shared_experts.up_proj.weight", (Is, D))
            add(f"{m}shared_experts.down_proj.weight", (D, Is))
    else:
        add("mlp.gate_proj.weight", (cfg.intermediate_size, D))
        add("mlp.up_proj.weight", (cfg.intermediate_size, D))
        add("mlp.down_proj.weight", (D, cfg.intermediate_size))
    return s


def global_specs(cfg: ModelConfig) -> list[TensorSpec]:
    D, V = cfg.hidden_size, cfg.vocab_size
    m = f"{PREFIX}model."
    s = [
        TensorSpec(f"{m}embed_tokens.weight", (V, D), BF16),
        TensorSpec(f"{m}norm.weight", (D,), BF16),
        TensorSpec(f"{m}output_attn_res_proj.weight", (1, D), BF16),
        TensorSpec(f"{m}output_attn_res_norm.weight", (D,), BF16),
    ]
    if not cfg.tie_word_embeddings:
        s.append(TensorSpec(f"{PREFIX}lm_head.weight", (V, D), BF16))
    return s


def dense_specs(cfg: ModelConfig) -> list[TensorSpec]:
    out = global_specs(cfg)
    for i in range(cfg.num_layers):
        out.extend(dense_layer_specs(cfg, i))
    return out


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """The full release layout, in file order: per layer, dense tensors then its experts."""
    out = global_specs(cfg)
    # (suffix, shape, dtype) per expert; tuple.__new__ skips NamedTuple's slow keyword path
    parts = []
    for w, (o, k) in expert_matrix_shapes(cfg).items():
        parts += [(f".{w}.weight_packed", (o, k // 2)), (f".{w}.weight_scale", (o, k // 32))]
    new = tuple.__new__
    for i in range(cfg.num_layers):
        out.extend(dense_layer_specs(cfg, i))
        if cfg.is_moe(i):
            p = f"{layer_prefix(i)}block_sparse_moe.experts."
            out.extend(
                new(TensorSpec, (f"{p}{e}{suffix}", shape, U8)) for e in range(cfg.num_experts) for suffix, shape in parts
            )
    return out


# ---- the converted tree's dense grouping ------------------------------------------------

PLANE_PARTS = (
    "block_sparse_moe.routed_expert_down_proj.",
    "block_sparse_moe.routed_expert_up_proj.",
    "block_sparse_moe.routed_expert_norm.",
    "block_sparse_moe.shared_experts.",
    "block_sparse_moe.gate.",
)


def expert_relpath(layer: int, expert: int) -> str:
    """Path of one routed expert inside a converted tree."""
    return f"experts/L{layer:03d}/E{expert:04d}.nvfp4"


def strip_prefix(name: str) -> str:
    return name[len(PREFIX) :] if name.startswith(PREFIX) else name


def dense_group(name: str) -> str:
    """'resident' or 'plane.L{layer:03d}' for a release dense tensor name."""
    if any(part in name for part in PLANE_PARTS):
        layer = int(name.split(".layers.", 1)[1].split(".", 1)[0])
        return f"plane.L{layer:03d}"
    return "resident"
