"""`config_from_dict`: a parsed wrapper `config.json` -> a validated `ModelConfig`.

One function per part of the geometry, each checking what its fields must agree on. The
fields are read in one fixed order, so a config with several faults always names the same
one first. Layer lists in the config are 1-based; they become 0-based in `_layer_schedule`
and nowhere else.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Iterable

from streamrt.config.fields import MAX_DIM, MAX_EXPERTS, MAX_LAYERS, MAX_MODEL_BYTES, MAX_VOCAB, Fields, few, show
from streamrt.config.model import K31_PRO, IndexerConfig, ModelConfig, VisionConfig
from streamrt.config.variant import check_architecture, check_quantization, gate_variant, text_config
from streamrt.errors import ConfigError


def config_from_dict(
    data: dict, *, name: str = "config", source: str = "config.json", tensor_names: Iterable[str] | None = None
) -> ModelConfig:
    """Build and validate a ModelConfig from the parsed wrapper `config.json`.

    Read in this order: the variant markers and the quantization; the layer schedule (token
    mixers, FFNs, AttnRes blocks); the experts; the vocabulary; what streamrt implements; the
    indexer; then the remaining fields in the dataclass's order."""
    w = Fields(data, "", source)
    t, wrapper_type = text_config(w)
    variant = gate_variant(w, t, wrapper_type, set(tensor_names) if tensor_names is not None else None)
    architecture = check_architecture(w, variant)
    check_quantization(w, t)
    hidden = t.int("hidden_size", max_value=MAX_DIM)
    n_layers = t.int("num_hidden_layers", max_value=MAX_LAYERS)
    la = t.sub("linear_attn_config")
    mixers = _token_mixers(la, n_layers)
    ffns = _ffn_schedule(t, n_layers)
    block = t.int("attn_res_block_size")
    experts = _expert_geometry(t, ffns["num_experts"], ffns["experts_per_token"])
    vocab = _vocabulary(t)
    implemented = _implemented_choices(t)
    q_lora = t.int("q_lora_rank", max_value=MAX_DIM)
    indexer = _indexer(t.sub("dsa_config"), mixers["mla_layers"], n_layers) if variant == K31_PRO else None
    cfg = ModelConfig(
        name=name,
        variant=variant,
        wrapper_model_type=wrapper_type,
        hidden_size=hidden,
        num_layers=n_layers,
        **mixers,
        **ffns,
        attn_res_block_size=block,
        attnres_block_starts=tuple(range(0, n_layers, block)),
        **experts,
        **vocab,
        **implemented,
        q_lora_rank=q_lora,
        **_norm_and_dense_ffn(t),
        **_mla_fields(t),
        **_kda_fields(la, mixers["kda_num_heads"], mixers["kda_head_dim"]),
        **_moe_fields(t),
        max_position_embeddings=t.int("max_position_embeddings", max_value=1 << 30),
        architecture=architecture,
        vision=_vision_config(w),
        indexer=indexer,
        raw=data,
    )
    _check_plausible_size(cfg, source)
    return cfg


# ---- the layer schedule -----------------------------------------------------------------


def _token_mixers(la: Fields, n_layers: int) -> dict[str, Any]:
    """Which layers are MLA and which KDA, and the KDA heads."""
    mla, kda = _layer_schedule(la, n_layers)
    return {
        "mla_layers": mla,
        "kda_layers": kda,
        "kda_num_heads": la.int("num_heads", max_value=MAX_DIM),
        "kda_head_dim": la.int("head_dim", max_value=MAX_DIM),
    }


def _check_one_based(f: Fields, key: str, values: list[int], n_layers: int) -> None:
    bad = [v for v in values if not 1 <= v <= n_layers]
    if bad:
        raise f.err(key, f"entries {few(bad)} are out of range: the list is 1-based over 1..{n_layers}")
    if len(set(values)) != len(values):
        raise f.err(key, "has duplicate entries")


def _layer_schedule(la: Fields, n_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The one place 1-based layer lists become 0-based. Returns (mla, kda)."""
    full = la.int_list("full_attn_layers")
    kda = la.int_list("kda_layers")
    _check_one_based(la, "full_attn_layers", full, n_layers)
    _check_one_based(la, "kda_layers", kda, n_layers)
    both = sorted(set(full) & set(kda))
    if both:
        raise la.err("full_attn_layers", f"layers {few(both)} (1-based) are also in kda_layers")
    missing = sorted(set(range(1, n_layers + 1)) - set(full) - set(kda))
    if missing:
        raise la.err(
            "full_attn_layers", f"full_attn_layers and kda_layers must partition 1..{n_layers}; missing {few(missing)}"
        )
    return tuple(sorted(i - 1 for i in full)), tuple(sorted(i - 1 for i in kda))


def _ffn_schedule(t: Fields, n_layers: int) -> dict[str, Any]:
    """Which layers are MoE and which dense, and how many experts a token is routed to."""
    n_exp = t.int("num_experts", max_value=MAX_EXPERTS)
    topk = t.int("num_experts_per_token")
    if topk > n_exp:
        raise t.err("num_experts_per_token", f"{topk} exceeds num_experts {n_exp}")
    first_dense = t.int("first_k_dense_replace", 1, min_value=0)
    freq = t.int("moe_layer_freq", 1)
    if first_dense > n_layers:
        raise t.err("first_k_dense_replace", f"{first_dense} exceeds num_hidden_layers {n_layers}")
    moe = tuple(i for i in range(n_layers) if i >= first_dense and i % freq == 0)
    return {
        "num_experts": n_exp,
        "experts_per_token": topk,
        "first_k_dense_replace": first_dense,
        "moe_layer_freq": freq,
        "moe_layers": moe,
        "dense_layers": tuple(i for i in range(n_layers) if i not in set(moe)),
    }


# ---- experts, vocabulary, implemented choices, indexer ----------------------------------


def _expert_geometry(t: Fields, n_exp: int, topk: int) -> dict[str, int]:
    """Expert groups (they must divide the experts, and the groups kept must hold the experts a
    token takes) and expert sizes (multiples of the MXFP4 block)."""
    n_group = t.int("num_expert_group", 1)
    topk_group = t.int("topk_group", 1)
    if n_exp % n_group:
        raise t.err("num_expert_group", f"{n_group} does not divide num_experts {n_exp}")
    if topk_group > n_group:
        raise t.err("topk_group", f"{topk_group} exceeds num_expert_group {n_group}")
    if topk_group * (n_exp // n_group) < topk:
        raise t.err(
            "topk_group",
            f"{topk_group} groups of {n_exp // n_group} experts hold fewer than the "
            f"{topk} experts a token takes (num_experts_per_token)",
        )
    routed_hidden = t.int("routed_expert_hidden_size", max_value=MAX_DIM)
    moe_inter = t.int("moe_intermediate_size", max_value=MAX_DIM)
    for key, v in (("routed_expert_hidden_size", routed_hidden), ("moe_intermediate_size", moe_inter)):
        if v % 32:
            raise t.err(key, f"{v} is not a multiple of 32 (the MXFP4 block along the reduction dimension)")
    return {
        "num_expert_group": n_group,
        "topk_group": topk_group,
        "routed_expert_hidden_size": routed_hidden,
        "moe_intermediate_size": moe_inter,
    }


def _vocabulary(t: Fields) -> dict[str, int]:
    """vocab_size and the special token ids, each inside the vocabulary."""
    vocab = t.int("vocab_size", max_value=MAX_VOCAB)
    ids = {k: t.int(k, min_value=0) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    for k, v in ids.items():
        if v >= vocab:
            raise t.err(k, f"{v} is outside the vocabulary (vocab_size {vocab})")
    return {"vocab_size": vocab, **ids}


def _implemented_choices(t: Fields) -> dict[str, Any]:
    """The activation and the MLA kind: streamrt implements SiTU / SiLU and the NoPE MLA only."""
    act = t.str("hidden_act")
    if act not in ("situ", "silu"):
        raise t.err("hidden_act", f"expected 'situ' or 'silu', got {act!r}")
    use_nope = t.bool("mla_use_nope", True)
    if not use_nope:
        raise t.err("mla_use_nope", "streamrt implements the NoPE MLA of K3 only; got false")
    return {"hidden_act": act, "mla_use_nope": use_nope}


def _indexer(d: Fields, mla: tuple[int, ...], n_layers: int) -> IndexerConfig:
    """K3.1 Pro's `dsa_config`: the Lightning Indexer, on full-attention layers only."""
    dsa = d.int_list("dsa_layers")
    if not dsa:  # a K3.1 Pro without indexer layers is neither K3.1 Pro nor K3 (which has no dsa_config)
        raise d.err("dsa_layers", "empty; K3.1 Pro has the indexer on some full-attention layers")
    _check_one_based(d, "dsa_layers", dsa, n_layers)
    not_full = sorted(set(dsa) - set(i + 1 for i in mla))
    if not_full:
        raise d.err("dsa_layers", f"layers {few(not_full)} (1-based) are not full-attention layers")
    rope = d.int("index_rope_dim", 0, min_value=0)
    if rope != 0:
        raise d.err("index_rope_dim", f"streamrt's indexer has no rotary (0); got {rope}")
    return IndexerConfig(
        n_heads=d.int("index_n_heads", max_value=MAX_DIM),
        head_dim=d.int("index_head_dim", max_value=MAX_DIM),
        topk=d.int("index_topk"),
        rope_dim=rope,
        layers=tuple(sorted(i - 1 for i in dsa)),
    )


# ---- the remaining fields, in the dataclass's order --------------------------------------


def _norm_and_dense_ffn(t: Fields) -> dict[str, Any]:
    return {
        "rms_norm_eps": t.float("rms_norm_eps", 1e-5, positive=True),
        "intermediate_size": t.int("intermediate_size", max_value=MAX_DIM),
        "situ_beta": t.float("activation_situ_beta", 1.0, positive=True),
        "situ_linear_beta": (
            t.float("activation_situ_linear_beta", positive=True) if t.has("activation_situ_linear_beta") else None
        ),
        "tie_word_embeddings": t.bool("tie_word_embeddings", False),
    }


def _mla_fields(t: Fields) -> dict[str, Any]:
    return {
        "num_attention_heads": t.int("num_attention_heads", max_value=MAX_DIM),
        "kv_lora_rank": t.int("kv_lora_rank", max_value=MAX_DIM),
        "qk_nope_head_dim": t.int("qk_nope_head_dim", max_value=MAX_DIM),
        "qk_rope_head_dim": t.int("qk_rope_head_dim", max_value=MAX_DIM),
        "v_head_dim": t.int("v_head_dim", max_value=MAX_DIM),
        "mla_use_output_gate": t.bool("mla_use_output_gate", True),
        "mla_norm_eps": 1e-6,
    }


def _kda_fields(la: Fields, heads: int, head_dim: int) -> dict[str, Any]:
    return {
        "short_conv_kernel_size": la.int("short_conv_kernel_size", 4),
        "gate_lower_bound": la.float("gate_lower_bound", -5.0),
        "a_log_stored_len": math.ceil(heads / head_dim) * head_dim,
    }


def _moe_fields(t: Fields) -> dict[str, Any]:
    return {
        "num_shared_experts": t.int("num_shared_experts", 0, min_value=0),
        "latent_moe_use_norm": t.bool("latent_moe_use_norm", True),
        "routed_scaling_factor": t.float("routed_scaling_factor", 1.0, positive=True),
        "moe_renormalize": t.bool("moe_renormalize", True),
    }


_WARNED: set[str] = set()


def _vision_config(w: Fields) -> VisionConfig | None:
    """The vision geometry, which only synth and inspect use (streamrt never runs the tower):
    a field missing or malformed there is a warning and no geometry, never a refused release."""
    if not w.has("vision_config"):
        return None
    try:
        return _vision_geometry(w.sub("vision_config"))
    except ConfigError as e:
        if str(e) not in _WARNED:
            _WARNED.add(str(e))
            print(f"streamrt: warning: {e}; ignored (streamrt does not run the vision tower)", file=sys.stderr)
        return None


def _vision_geometry(v: Fields) -> VisionConfig:
    merge = v.d.get("merge_kernel_size", [2, 2])
    if not (
        isinstance(merge, list)
        and len(merge) == 2
        and all(isinstance(m, int) and not isinstance(m, bool) and 0 < m <= 64 for m in merge)
    ):
        raise v.err("merge_kernel_size", f"expected two positive integers, got {show(merge)}")
    return VisionConfig(
        hidden_size=v.int("hidden_size", max_value=MAX_DIM),
        intermediate_size=v.int("intermediate_size", max_value=MAX_DIM),
        num_hidden_layers=v.int("num_hidden_layers", max_value=MAX_LAYERS),
        patch_size=v.int("patch_size", max_value=1024),
        merge_tokens=merge[0] * merge[1],
    )


def _check_plausible_size(cfg: ModelConfig, source: str) -> None:
    """Refuse a geometry no machine holds before anything is sized from it (a rough count:
    MXFP4 experts, embeddings and lm_head, and a generous bound for each layer's dense weights)."""
    experts = (
        len(cfg.moe_layers) * cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size * 17 // 32
    )
    dense = 4 * cfg.vocab_size * cfg.hidden_size + cfg.num_layers * 64 * cfg.hidden_size * max(
        cfg.hidden_size, cfg.intermediate_size
    )
    if experts + dense > MAX_MODEL_BYTES:
        raise ConfigError(
            f"{source}: the geometry implies about {(experts + dense) / 2**50:,.1f} PiB of weights "
            f"({cfg.num_layers} layers, {cfg.num_experts} experts, hidden {cfg.hidden_size}); no machine holds that"
        )
