"""`ModelConfig`: the language model of a KimiLinear checkpoint as one frozen dataclass (0-based
layer schedule, derived sizes), with the K3.1 Pro indexer and the vision tower's geometry."""

from __future__ import annotations

from dataclasses import dataclass, field

K3 = "kimi-k3"
K31_PRO = "kimi-k3.1-pro"

# Tensor-name suffixes of the Lightning Indexer, under `…layers.{i}.self_attn.indexer.`
INDEXER_TENSORS = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


@dataclass(frozen=True)
class IndexerConfig:
    """The K3.1 Pro Lightning Indexer (spec/K31_INDEXER.md)."""

    n_heads: int
    head_dim: int
    topk: int
    rope_dim: int
    layers: tuple[int, ...]  # 0-based
    k_norm_eps: float = 1e-6


@dataclass(frozen=True)
class VisionConfig:
    """The wrapper's `vision_config`: streamrt does not run the vision tower; the geometry
    only sizes the tensors a release carries (checkpoint/names.py `vision_specs`)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    patch_size: int
    merge_tokens: int  # patches merged into one projector input (2 x 2)


@dataclass(frozen=True)
class ModelConfig:
    """The language model of a KimiLinear checkpoint. All layer indices are 0-based."""

    name: str
    variant: str  # K3 or K31_PRO
    wrapper_model_type: str

    hidden_size: int
    num_layers: int
    vocab_size: int
    rms_norm_eps: float
    intermediate_size: int  # dense FFN (layers below first_k_dense_replace)
    hidden_act: str
    situ_beta: float
    situ_linear_beta: float | None
    tie_word_embeddings: bool

    # MLA (NoPE, gated)
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool
    mla_use_output_gate: bool
    mla_norm_eps: float  # q_a_layernorm / kv_a_layernorm are built without eps: 1e-6

    # KDA
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int
    gate_lower_bound: float
    a_log_stored_len: int  # A_log is stored zero-padded to a multiple of head_dim (MODEL.md §2.5)

    # MoE
    num_experts: int
    experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    latent_moe_use_norm: bool
    routed_scaling_factor: float
    moe_renormalize: bool
    first_k_dense_replace: int
    moe_layer_freq: int
    num_expert_group: int
    topk_group: int

    attn_res_block_size: int

    bos_token_id: int
    eos_token_id: int
    pad_token_id: int

    # Schedule (0-based)
    mla_layers: tuple[int, ...]
    kda_layers: tuple[int, ...]
    moe_layers: tuple[int, ...]
    dense_layers: tuple[int, ...]
    attnres_block_starts: tuple[int, ...]

    max_position_embeddings: int = 4096
    architecture: str | None = None
    vision: VisionConfig | None = None
    indexer: IndexerConfig | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    # ---- derived -------------------------------------------------------------------

    @property
    def is_k31(self) -> bool:
        return self.variant == K31_PRO

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        return self.indexer.layers if self.indexer else ()

    def layer_kind(self, i: int) -> str:
        """'kda' or 'mla' for 0-based layer i."""
        return "mla" if i in self._mla_set else "kda"

    def is_moe(self, i: int) -> bool:
        return i in self._moe_set

    def has_indexer(self, i: int) -> bool:
        return self.indexer is not None and i in self.indexer.layers

    @property
    def _mla_set(self) -> frozenset[int]:
        return frozenset(self.mla_layers)

    @property
    def _moe_set(self) -> frozenset[int]:
        return frozenset(self.moe_layers)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def attnres_groups(self) -> int:
        return len(self.attnres_block_starts)

    @property
    def working_set_experts(self) -> int:
        """Distinct routed experts one decoded token touches (a cyclic scan over the MoE layers)."""
        return len(self.moe_layers) * self.experts_per_token

    @property
    def expert_files(self) -> int:
        return len(self.moe_layers) * self.num_experts


def expected_indexer_tensors(cfg: ModelConfig, prefix: str = "language_model.model.") -> list[str]:
    """Release-layout names of every indexer tensor the config implies."""
    return [f"{prefix}layers.{i}.self_attn.indexer.{s}" for i in cfg.indexer_layers for s in INDEXER_TENSORS]
