"""Model configuration: one frozen dataclass built from a HF-style `config.json`.

The release `config.json` is a multimodal wrapper: its `model_type` names the variant
("kimi_k3" for K3, "kimi_k31" for K3.1 Pro) and the language model's fields live in
`text_config` (spec/MODEL.md §1, §9). K3.1 Pro adds `text_config.dsa_config` and five
indexer tensors per full-attention layer. A loader that reads one marker alone turns
K3.1 Pro into K3 and still answers fluently, so the variant is gated on all three
markers, in both directions, and every partial combination is an error.

Layer lists in the config are 1-based; they become 0-based here, in `_layer_schedule`,
and nowhere else.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

from streamrt.errors import ConfigError

K3 = "kimi-k3"
K31_PRO = "kimi-k3.1-pro"
K31_WRAPPER_TYPE = "kimi_k31"
TEXT_MODEL_TYPE = "kimi_linear"
BUNDLED = ("kimi-k3", "kimi-k3.1-pro", "tiny-k3", "tiny-k3.1-pro", "slice-k3.1-pro", "small-k3.1-pro")

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


# ---- loading -----------------------------------------------------------------------


def load_config(source: str | Path, *, check_tensors: bool = True) -> ModelConfig:
    """Load a ModelConfig from a bundled name, a `config.json`, or a checkpoint directory.

    For a checkpoint directory the variant gate also checks the indexer tensors against
    the tree's tensor index (release `model.safetensors.index.json` or streamrt
    `manifest.json`), unless `check_tensors` is False.
    """
    path = Path(source)
    tensor_names: set[str] | None = None
    if str(source) in BUNDLED and not path.exists():
        text = resources.files("streamrt").joinpath("configs", f"{source}.json").read_text()
        cfg_path = f"<bundled {source}>"
        name = str(source)
    elif path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"{path}: not a checkpoint directory (no config.json)")
        text, cfg_path, name = _read(cfg_file), str(cfg_file), path.name
        if check_tensors:
            tensor_names = tensor_names_of_tree(path)
    elif path.is_file():
        text, cfg_path, name = _read(path), str(path), path.stem
    else:
        hint = f" (bundled configs: {', '.join(BUNDLED)})" if "/" not in str(source) else ""
        raise ConfigError(f"{source}: no such config file or checkpoint directory{hint}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return config_from_dict(data, name=name, source=cfg_path, tensor_names=tensor_names)


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read: {e}") from None


def tensor_names_of_tree(path: Path) -> set[str] | None:
    """Tensor names listed by a checkpoint tree's index, or None if it has none."""
    for index_name in ("model.safetensors.index.json", "manifest.json"):
        f = path / index_name
        if not f.is_file():
            continue
        try:
            idx = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{f}: cannot read tensor index: {e}") from None
        if index_name == "model.safetensors.index.json":
            wm = idx.get("weight_map")
            if not isinstance(wm, dict):
                raise ConfigError(f"{f}: field 'weight_map' missing or not an object")
            return set(wm)
        names = idx.get("tensor_names")
        if isinstance(names, list):
            return set(names)
        raise ConfigError(f"{f}: field 'tensor_names' missing or not a list")
    single = path / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(single), "np") as fh:
                return set(fh.keys())
        except Exception as e:  # safetensors raises several types for a bad header
            raise ConfigError(f"{single}: cannot read safetensors header: {e}") from None
    return None


class _Fields:
    """Typed field access that names the field path in every error."""

    def __init__(self, data: dict, prefix: str, source: str):
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: {prefix or 'config'} must be a JSON object")
        self.d, self.prefix, self.source = data, prefix, source

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def err(self, key: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.path(key)}: {msg}")

    def has(self, key: str) -> bool:
        return key in self.d and self.d[key] is not None

    def int(self, key: str, default: Any = ..., *, min_value: int = 1) -> int:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.err(key, f"expected an integer, got {json.dumps(v)}")
        if v < min_value:
            raise self.err(key, f"must be >= {min_value}, got {v}")
        return v

    def float(self, key: str, default: Any = ..., *, positive: bool = False) -> float:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.err(key, f"expected a number, got {json.dumps(v)}")
        if positive and v <= 0:
            raise self.err(key, f"must be > 0, got {v}")
        return float(v)

    def bool(self, key: str, default: Any = ...) -> bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise self.err(key, f"expected true or false, got {json.dumps(v)}")
        return v

    def str(self, key: str, default: Any = ...) -> str:
        v = self._get(key, default)
        if not isinstance(v, str):
            raise self.err(key, f"expected a string, got {json.dumps(v)}")
        return v

    def int_list(self, key: str) -> list[int]:
        v = self._get(key, ...)
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise self.err(key, "expected a list of integers")
        return v

    def sub(self, key: str) -> "_Fields":
        v = self._get(key, ...)
        if not isinstance(v, dict):
            raise self.err(key, "expected an object")
        return _Fields(v, self.path(key), self.source)

    def _get(self, key: str, default: Any) -> Any:
        if key in self.d and self.d[key] is not None:
            return self.d[key]
        if default is ...:
            raise self.err(key, "missing")
        return default


def config_from_dict(
    data: dict, *, name: str = "config", source: str = "config.json", tensor_names: Iterable[str] | None = None
) -> ModelConfig:
    """Build and validate a ModelConfig from the parsed wrapper `config.json`."""
    w = _Fields(data, "", source)
    if not w.has("text_config"):
        raise w.err("text_config", "missing (streamrt reads the wrapper config.json of a Kimi K3 / K3.1 Pro release)")
    t = w.sub("text_config")
    wrapper_type = w.str("model_type")
    text_type = t.str("model_type")
    if text_type != TEXT_MODEL_TYPE:
        raise t.err("model_type", f"expected {TEXT_MODEL_TYPE!r}, got {text_type!r}")

    names = set(tensor_names) if tensor_names is not None else None
    variant = _gate_variant(w, t, wrapper_type, names)

    hidden = t.int("hidden_size")
    n_layers = t.int("num_hidden_layers")
    la = t.sub("linear_attn_config")
    mla, kda = _layer_schedule(la, n_layers)

    kda_heads = la.int("num_heads")
    kda_hd = la.int("head_dim")
    n_exp = t.int("num_experts")
    topk = t.int("num_experts_per_token")
    if topk > n_exp:
        raise t.err("num_experts_per_token", f"{topk} exceeds num_experts {n_exp}")
    first_dense = t.int("first_k_dense_replace", 1, min_value=0)
    freq = t.int("moe_layer_freq", 1)
    if first_dense > n_layers:
        raise t.err("first_k_dense_replace", f"{first_dense} exceeds num_hidden_layers {n_layers}")
    moe = tuple(i for i in range(n_layers) if i >= first_dense and i % freq == 0)
    dense = tuple(i for i in range(n_layers) if i not in set(moe))
    block = t.int("attn_res_block_size")
    starts = tuple(range(0, n_layers, block))

    n_group = t.int("num_expert_group", 1)
    topk_group = t.int("topk_group", 1)
    if n_exp % n_group:
        raise t.err("num_expert_group", f"{n_group} does not divide num_experts {n_exp}")
    if topk_group > n_group:
        raise t.err("topk_group", f"{topk_group} exceeds num_expert_group {n_group}")

    routed_hidden = t.int("routed_expert_hidden_size")
    moe_inter = t.int("moe_intermediate_size")
    for key, v in (("routed_expert_hidden_size", routed_hidden), ("moe_intermediate_size", moe_inter)):
        if v % 32:
            raise t.err(key, f"{v} is not a multiple of 32 (the MXFP4 block along the reduction dimension)")

    vocab = t.int("vocab_size")
    ids = {k: t.int(k, min_value=0) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    for k, v in ids.items():
        if v >= vocab:
            raise t.err(k, f"{v} is outside the vocabulary (vocab_size {vocab})")

    act = t.str("hidden_act")
    if act not in ("situ", "silu"):
        raise t.err("hidden_act", f"expected 'situ' or 'silu', got {act!r}")
    use_nope = t.bool("mla_use_nope", True)
    if not use_nope:
        raise t.err("mla_use_nope", "streamrt implements the NoPE MLA of K3 only; got false")
    q_lora = t.int("q_lora_rank")

    indexer = None
    if variant == K31_PRO:
        d = t.sub("dsa_config")
        dsa = d.int_list("dsa_layers")
        _check_one_based(d, "dsa_layers", dsa, n_layers)
        not_full = sorted(set(dsa) - set(i + 1 for i in mla))
        if not_full:
            raise d.err("dsa_layers", f"layers {not_full} (1-based) are not full-attention layers")
        rope = d.int("index_rope_dim", 0, min_value=0)
        if rope != 0:
            raise d.err("index_rope_dim", f"streamrt's indexer has no rotary (0); got {rope}")
        indexer = IndexerConfig(
            n_heads=d.int("index_n_heads"),
            head_dim=d.int("index_head_dim"),
            topk=d.int("index_topk"),
            rope_dim=rope,
            layers=tuple(sorted(i - 1 for i in dsa)),
        )

    return ModelConfig(
        name=name,
        variant=variant,
        wrapper_model_type=wrapper_type,
        hidden_size=hidden,
        num_layers=n_layers,
        vocab_size=vocab,
        rms_norm_eps=t.float("rms_norm_eps", 1e-5, positive=True),
        intermediate_size=t.int("intermediate_size"),
        hidden_act=act,
        situ_beta=t.float("activation_situ_beta", 1.0, positive=True),
        situ_linear_beta=t.float("activation_situ_linear_beta", positive=True) if t.has("activation_situ_linear_beta") else None,
        tie_word_embeddings=t.bool("tie_word_embeddings", False),
        num_attention_heads=t.int("num_attention_heads"),
        q_lora_rank=q_lora,
        kv_lora_rank=t.int("kv_lora_rank"),
        qk_nope_head_dim=t.int("qk_nope_head_dim"),
        qk_rope_head_dim=t.int("qk_rope_head_dim"),
        v_head_dim=t.int("v_head_dim"),
        mla_use_nope=use_nope,
        mla_use_output_gate=t.bool("mla_use_output_gate", True),
        mla_norm_eps=1e-6,
        kda_num_heads=kda_heads,
        kda_head_dim=kda_hd,
        short_conv_kernel_size=la.int("short_conv_kernel_size", 4),
        gate_lower_bound=la.float("gate_lower_bound", -5.0),
        a_log_stored_len=math.ceil(kda_heads / kda_hd) * kda_hd,
        num_experts=n_exp,
        experts_per_token=topk,
        num_shared_experts=t.int("num_shared_experts", 0, min_value=0),
        moe_intermediate_size=moe_inter,
        routed_expert_hidden_size=routed_hidden,
        latent_moe_use_norm=t.bool("latent_moe_use_norm", True),
        routed_scaling_factor=t.float("routed_scaling_factor", 1.0, positive=True),
        moe_renormalize=t.bool("moe_renormalize", True),
        first_k_dense_replace=first_dense,
        moe_layer_freq=freq,
        num_expert_group=n_group,
        topk_group=topk_group,
        attn_res_block_size=block,
        mla_layers=mla,
        kda_layers=kda,
        moe_layers=moe,
        dense_layers=dense,
        attnres_block_starts=starts,
        indexer=indexer,
        raw=data,
        **ids,
    )


def _check_one_based(f: _Fields, key: str, values: list[int], n_layers: int) -> None:
    bad = [v for v in values if not 1 <= v <= n_layers]
    if bad:
        raise f.err(key, f"entries {bad} are out of range: the list is 1-based over 1..{n_layers}")
    if len(set(values)) != len(values):
        raise f.err(key, "has duplicate entries")


def _layer_schedule(la: _Fields, n_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The one place 1-based layer lists become 0-based. Returns (mla, kda)."""
    full = la.int_list("full_attn_layers")
    kda = la.int_list("kda_layers")
    _check_one_based(la, "full_attn_layers", full, n_layers)
    _check_one_based(la, "kda_layers", kda, n_layers)
    both = sorted(set(full) & set(kda))
    if both:
        raise la.err("full_attn_layers", f"layers {both} (1-based) are also in kda_layers")
    missing = sorted(set(range(1, n_layers + 1)) - set(full) - set(kda))
    if missing:
        raise la.err("full_attn_layers", f"full_attn_layers and kda_layers must partition 1..{n_layers}; missing {missing}")
    return tuple(sorted(i - 1 for i in full)), tuple(sorted(i - 1 for i in kda))


def _gate_variant(w: _Fields, t: _Fields, wrapper_type: str, names: set[str] | None) -> str:
    """K3.1 Pro iff wrapper marker AND nested dsa_config AND (for a tree) indexer tensors."""
    marker = wrapper_type == K31_WRAPPER_TYPE
    nested = t.has("dsa_config")
    if w.has("dsa_config"):
        where = "and text_config.dsa_config is also present" if nested else "but it belongs inside text_config"
        raise w.err("dsa_config", f"found at the top level of the wrapper config, {where}")
    tensors = None if names is None else any(".self_attn.indexer." in n for n in names)
    present, absent = [], []
    for label, v in (
        (f"model_type {K31_WRAPPER_TYPE!r}", marker),
        ("text_config.dsa_config", nested),
        ("indexer tensors", tensors),
    ):
        if v is not None:
            (present if v else absent).append(label)
    if not present:
        return K3
    if not absent:
        return K31_PRO
    raise ConfigError(
        f"{w.source}: inconsistent variant markers: {', '.join(present)} present but {', '.join(absent)} missing "
        f"(model_type is {wrapper_type!r}); K3.1 Pro needs all of them and K3 none"
    )


def expected_indexer_tensors(cfg: ModelConfig, prefix: str = "language_model.model.") -> list[str]:
    """Release-layout names of every indexer tensor the config implies."""
    return [f"{prefix}layers.{i}.self_attn.indexer.{s}" for i in cfg.indexer_layers for s in INDEXER_TENSORS]
