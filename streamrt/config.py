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
from streamrt.jsonio import load_json

K3 = "kimi-k3"
K31_PRO = "kimi-k3.1-pro"
K3_WRAPPER_TYPE, K31_WRAPPER_TYPE = "kimi_k3", "kimi_k31"
TEXT_MODEL_TYPE = "kimi_linear"
# The wrapper's `architectures` entry per variant (K3.1 Pro's from llama.cpp b12180).
ARCHITECTURES = {K3: "KimiK3ForConditionalGeneration", K31_PRO: "KimiK31ForConditionalGeneration"}
# Routed experts as released: compressed-tensors MXFP4, E8M0 scales per 32 (REAL_RELEASE.md).
MXFP4_FORMAT, MXFP4_GROUP = "mxfp4-pack-quantized", 32

# Plausibility limits: far above any released geometry (K3: 93 layers, 896 experts, hidden
# 7168), low enough that a typo is refused before a schedule, a tensor list or a message
# is built from it.
MAX_LAYERS, MAX_EXPERTS, MAX_DIM, MAX_VOCAB = 1024, 16384, 1 << 17, 1 << 22
MAX_MODEL_BYTES = 1 << 50  # 1 PiB: no machine holds more
MAX_CONFIG_BYTES = 16 << 20  # a release config.json is ~10 KB
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own header limit
BUNDLED = ("kimi-k3", "kimi-k3.1-pro", "tiny-k3", "tiny-k3.1-pro", "slice-k3.1-pro", "deep-k3.1-pro", "small-k3.1-pro")

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
        raw: Path | bytes = resources.files("streamrt").joinpath("configs", f"{source}.json").read_bytes()
        cfg_path = f"<bundled {source}>"
        name = str(source)
    elif path.is_dir():
        raw = path / "config.json"
        if not raw.is_file():
            raise ConfigError(f"{path}: not a checkpoint directory (no config.json)")
        cfg_path, name = str(raw), path.name
        if check_tensors:
            tensor_names = tensor_names_of_tree(path)
    elif path.is_file():
        raw, cfg_path, name = path, str(path), path.stem
    else:
        hint = f" (bundled configs: {', '.join(BUNDLED)})" if "/" not in str(source) else ""
        raise ConfigError(f"{source}: no such config file or checkpoint directory{hint}")
    data = load_json(raw, what="config", name=cfg_path, expect=dict, max_bytes=MAX_CONFIG_BYTES, error=ConfigError)
    return config_from_dict(data, name=name, source=cfg_path, tensor_names=tensor_names)


def tensor_names_of_tree(path: Path) -> set[str] | None:
    """Tensor names listed by a checkpoint tree's index, or None if it has none."""
    for index_name in ("model.safetensors.index.json", "manifest.json"):
        f = path / index_name
        if not f.is_file():
            continue
        idx = load_json(f, what="tensor index", expect=dict, error=ConfigError)
        key, kind = ("weight_map", dict) if index_name == "model.safetensors.index.json" else ("tensor_names", list)
        names = idx.get(key)
        if not isinstance(names, kind) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"{f}: field {key!r} missing or not {'an object' if kind is dict else 'a list'} of tensor names")
        return set(names)
    single = path / "model.safetensors"
    if single.is_file():
        return _safetensors_names(single)
    return None


def _safetensors_names(path: Path) -> set[str]:
    """The tensor names in a single-file checkpoint's header (8-byte length, then JSON)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            raw = f.read(n) if 0 <= n <= MAX_HEADER_BYTES else b""
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    if n < 0 or len(raw) != n:
        raise ConfigError(f"{path}: truncated safetensors header")
    hdr = load_json(raw, what="safetensors header", name=str(path), expect=dict, max_bytes=MAX_HEADER_BYTES, error=ConfigError)
    return {k for k in hdr if k != "__metadata__"}


def _show(v: Any, limit: int = 60) -> str:
    """A value for a message, cut to `limit` characters (a config can hold anything)."""
    if isinstance(v, int) and not isinstance(v, bool):
        digits = len(str(abs(v))) if abs(v) < 10**limit else limit + 1
        text = str(v) if digits <= limit else f"an integer of more than {limit} digits"
    elif isinstance(v, (dict, list)):
        text = f"a JSON {'object' if isinstance(v, dict) else 'array'} of {len(v)} entries"
    else:
        text = json.dumps(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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

    def int(self, key: str, default: Any = ..., *, min_value: int = 1, max_value: int | None = None) -> int:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.err(key, f"expected an integer, got {_show(v)}")
        if v < min_value:
            raise self.err(key, f"must be >= {min_value}, got {_show(v)}")
        if max_value is not None and v > max_value:
            raise self.err(key, f"{_show(v)} is implausible (streamrt accepts at most {max_value:,})")
        return v

    def float(self, key: str, default: Any = ..., *, positive: bool = False) -> float:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.err(key, f"expected a number, got {_show(v)}")
        if positive and v <= 0:
            raise self.err(key, f"must be > 0, got {v}")
        return float(v)

    def bool(self, key: str, default: Any = ...) -> bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise self.err(key, f"expected true or false, got {_show(v)}")
        return v

    def str(self, key: str, default: Any = ...) -> str:
        v = self._get(key, default)
        if not isinstance(v, str):
            raise self.err(key, f"expected a string, got {_show(v)}")
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

    if wrapper_type not in (K3_WRAPPER_TYPE, K31_WRAPPER_TYPE):
        raise w.err("model_type", f"{wrapper_type!r}: expected {K3_WRAPPER_TYPE!r} (Kimi K3) or {K31_WRAPPER_TYPE!r} (Kimi K3.1 Pro)")
    names = set(tensor_names) if tensor_names is not None else None
    variant = _gate_variant(w, t, wrapper_type, names)
    architecture = _check_architecture(w, variant)
    _check_quantization(w, t)

    hidden = t.int("hidden_size", max_value=MAX_DIM)
    n_layers = t.int("num_hidden_layers", max_value=MAX_LAYERS)
    la = t.sub("linear_attn_config")
    mla, kda = _layer_schedule(la, n_layers)

    kda_heads = la.int("num_heads", max_value=MAX_DIM)
    kda_hd = la.int("head_dim", max_value=MAX_DIM)
    n_exp = t.int("num_experts", max_value=MAX_EXPERTS)
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

    routed_hidden = t.int("routed_expert_hidden_size", max_value=MAX_DIM)
    moe_inter = t.int("moe_intermediate_size", max_value=MAX_DIM)
    for key, v in (("routed_expert_hidden_size", routed_hidden), ("moe_intermediate_size", moe_inter)):
        if v % 32:
            raise t.err(key, f"{v} is not a multiple of 32 (the MXFP4 block along the reduction dimension)")

    vocab = t.int("vocab_size", max_value=MAX_VOCAB)
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
    q_lora = t.int("q_lora_rank", max_value=MAX_DIM)

    indexer = None
    if variant == K31_PRO:
        d = t.sub("dsa_config")
        dsa = d.int_list("dsa_layers")
        _check_one_based(d, "dsa_layers", dsa, n_layers)
        not_full = sorted(set(dsa) - set(i + 1 for i in mla))
        if not_full:
            raise d.err("dsa_layers", f"layers {_few(not_full)} (1-based) are not full-attention layers")
        rope = d.int("index_rope_dim", 0, min_value=0)
        if rope != 0:
            raise d.err("index_rope_dim", f"streamrt's indexer has no rotary (0); got {rope}")
        indexer = IndexerConfig(
            n_heads=d.int("index_n_heads", max_value=MAX_DIM),
            head_dim=d.int("index_head_dim", max_value=MAX_DIM),
            topk=d.int("index_topk"),
            rope_dim=rope,
            layers=tuple(sorted(i - 1 for i in dsa)),
        )

    cfg = ModelConfig(
        name=name,
        variant=variant,
        wrapper_model_type=wrapper_type,
        hidden_size=hidden,
        num_layers=n_layers,
        vocab_size=vocab,
        rms_norm_eps=t.float("rms_norm_eps", 1e-5, positive=True),
        intermediate_size=t.int("intermediate_size", max_value=MAX_DIM),
        hidden_act=act,
        situ_beta=t.float("activation_situ_beta", 1.0, positive=True),
        situ_linear_beta=t.float("activation_situ_linear_beta", positive=True) if t.has("activation_situ_linear_beta") else None,
        tie_word_embeddings=t.bool("tie_word_embeddings", False),
        num_attention_heads=t.int("num_attention_heads", max_value=MAX_DIM),
        q_lora_rank=q_lora,
        kv_lora_rank=t.int("kv_lora_rank", max_value=MAX_DIM),
        qk_nope_head_dim=t.int("qk_nope_head_dim", max_value=MAX_DIM),
        qk_rope_head_dim=t.int("qk_rope_head_dim", max_value=MAX_DIM),
        v_head_dim=t.int("v_head_dim", max_value=MAX_DIM),
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
        max_position_embeddings=t.int("max_position_embeddings", max_value=1 << 30),
        architecture=architecture,
        vision=_vision_config(w),
        indexer=indexer,
        raw=data,
        **ids,
    )
    _check_plausible_size(cfg, source)
    return cfg


def _few(values: list[int], n: int = 8) -> str:
    """A list for a message: at most n entries, then how many more."""
    head = ", ".join(str(v) for v in values[:n])
    return f"[{head}{f', ... ({len(values) - n} more)' if len(values) > n else ''}]"


def _check_one_based(f: _Fields, key: str, values: list[int], n_layers: int) -> None:
    bad = [v for v in values if not 1 <= v <= n_layers]
    if bad:
        raise f.err(key, f"entries {_few(bad)} are out of range: the list is 1-based over 1..{n_layers}")
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
        raise la.err("full_attn_layers", f"layers {_few(both)} (1-based) are also in kda_layers")
    missing = sorted(set(range(1, n_layers + 1)) - set(full) - set(kda))
    if missing:
        raise la.err("full_attn_layers", f"full_attn_layers and kda_layers must partition 1..{n_layers}; missing {_few(missing)}")
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


def _check_architecture(w: _Fields, variant: str) -> str | None:
    """`architectures` as a consistency check on the variant markers (absent: nothing to check)."""
    if not w.has("architectures"):
        return None
    archs = w.d["architectures"]
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise w.err("architectures", f"expected a list of one class name, got {_show(archs)}")
    arch, want = archs[0], ARCHITECTURES[variant]
    if arch not in ARCHITECTURES.values():
        raise w.err("architectures", f"{arch!r} is not a Kimi K3 / K3.1 Pro architecture ({', '.join(ARCHITECTURES.values())})")
    if arch != want:
        raise w.err(
            "architectures",
            f"{arch!r} disagrees with the variant markers, which say {variant} (model_type {w.d.get('model_type')!r}); "
            f"{variant} is {want!r}",
        )
    return arch


def _check_quantization(w: _Fields, t: _Fields) -> None:
    """The routed experts must be MXFP4 in groups of 32. The release keeps the block inside
    text_config (ports lift it from there); trees written before that carry it on the wrapper."""
    where = t if t.has("quantization_config") else w if w.has("quantization_config") else None
    if where is None:
        raise t.err("quantization_config", f"missing: streamrt reads releases whose routed experts are {MXFP4_FORMAT}, group {MXFP4_GROUP}")
    q = where.sub("quantization_config")
    method = q.str("quant_method")
    if method != "compressed-tensors":
        raise q.err("quant_method", f"{method!r}: streamrt reads compressed-tensors {MXFP4_FORMAT} experts only")
    if q.has("config_groups"):
        groups = q.sub("config_groups")
        if not groups.d:
            raise groups.err("", "empty: no quantization group describes the experts")
        for name in groups.d:
            g = groups.sub(name)
            fmt = g.str("format", q.d.get("format", ...))
            wt = g.sub("weights")
            _expect(g, "format", fmt, MXFP4_FORMAT)
            _expect(wt, "num_bits", wt.int("num_bits"), 4)
            _expect(wt, "group_size", wt.int("group_size"), MXFP4_GROUP)
            _expect(wt, "type", wt.str("type"), "float")
    else:  # the flat form of trees written before the release layout was known
        _expect(q, "format", q.str("format"), MXFP4_FORMAT)
        _expect(q, "bits", q.int("bits"), 4)
        _expect(q, "group_size", q.int("group_size"), MXFP4_GROUP)


def _expect(f: _Fields, key: str, got: Any, want: Any) -> None:
    if got != want:
        raise f.err(key, f"{_show(got)}: streamrt reads {MXFP4_FORMAT} experts in groups of {MXFP4_GROUP} (expected {_show(want)})")


def _vision_config(w: _Fields) -> VisionConfig | None:
    if not w.has("vision_config"):
        return None
    v = w.sub("vision_config")
    merge = v.d.get("merge_kernel_size", [2, 2])
    if not (isinstance(merge, list) and len(merge) == 2 and all(isinstance(m, int) and not isinstance(m, bool) and 0 < m <= 64 for m in merge)):
        raise v.err("merge_kernel_size", f"expected two positive integers, got {_show(merge)}")
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
    experts = len(cfg.moe_layers) * cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size * 17 // 32
    dense = 4 * cfg.vocab_size * cfg.hidden_size + cfg.num_layers * 64 * cfg.hidden_size * max(cfg.hidden_size, cfg.intermediate_size)
    if experts + dense > MAX_MODEL_BYTES:
        raise ConfigError(
            f"{source}: the geometry implies about {(experts + dense) / 2**50:,.1f} PiB of weights "
            f"({cfg.num_layers} layers, {cfg.num_experts} experts, hidden {cfg.hidden_size}); no machine holds that"
        )


def expected_indexer_tensors(cfg: ModelConfig, prefix: str = "language_model.model.") -> list[str]:
    """Release-layout names of every indexer tensor the config implies."""
    return [f"{prefix}layers.{i}.self_attn.indexer.{s}" for i in cfg.indexer_layers for s in INDEXER_TENSORS]
