"""Which model a wrapper `config.json` describes: the wrapper and text model types, the K3.1 Pro
gate on all three markers (both directions), `architectures` against them, and the routed
experts' quantization (MXFP4, group 32)."""

from __future__ import annotations

from typing import Any

from streamrt.config.fields import Fields, show
from streamrt.config.model import K3, K31_PRO
from streamrt.errors import ConfigError

K3_WRAPPER_TYPE, K31_WRAPPER_TYPE = "kimi_k3", "kimi_k31"
TEXT_MODEL_TYPE = "kimi_linear"
# The wrapper's `architectures` entry per variant (K3.1 Pro's from llama.cpp b12180).
ARCHITECTURES = {K3: "KimiK3ForConditionalGeneration", K31_PRO: "KimiK31ForConditionalGeneration"}
# Routed experts as released: compressed-tensors MXFP4, E8M0 scales per 32 (REAL_RELEASE.md).
MXFP4_FORMAT, MXFP4_GROUP = "mxfp4-pack-quantized", 32


def text_config(w: Fields) -> tuple[Fields, str]:
    """The wrapper's `text_config` and `model_type`, both checked (the wrapper's type names the variant)."""
    if not w.has("text_config"):
        raise w.err("text_config", "missing (streamrt reads the wrapper config.json of a Kimi K3 / K3.1 Pro release)")
    t = w.sub("text_config")
    wrapper_type = w.str("model_type")
    text_type = t.str("model_type")
    if text_type != TEXT_MODEL_TYPE:
        raise t.err("model_type", f"expected {TEXT_MODEL_TYPE!r}, got {text_type!r}")
    if wrapper_type not in (K3_WRAPPER_TYPE, K31_WRAPPER_TYPE):
        raise w.err(
            "model_type",
            f"{wrapper_type!r}: expected {K3_WRAPPER_TYPE!r} (Kimi K3) or {K31_WRAPPER_TYPE!r} (Kimi K3.1 Pro)",
        )
    return t, wrapper_type


def gate_variant(w: Fields, t: Fields, wrapper_type: str, names: set[str] | None) -> str:
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


def check_architecture(w: Fields, variant: str) -> str | None:
    """`architectures` as a consistency check on the variant markers (absent: nothing to check)."""
    if not w.has("architectures"):
        return None
    archs = w.d["architectures"]
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise w.err("architectures", f"expected a list of one class name, got {show(archs)}")
    arch, want = archs[0], ARCHITECTURES[variant]
    if arch not in ARCHITECTURES.values():
        raise w.err(
            "architectures", f"{arch!r} is not a Kimi K3 / K3.1 Pro architecture ({', '.join(ARCHITECTURES.values())})"
        )
    if arch != want:
        raise w.err(
            "architectures",
            f"{arch!r} disagrees with the variant markers, which say {variant} (model_type {w.d.get('model_type')!r}); "
            f"{variant} is {want!r}",
        )
    return arch


def check_quantization(w: Fields, t: Fields) -> None:
    """The routed experts must be MXFP4 in groups of 32. The release keeps the block inside
    text_config (ports lift it from there); trees written before that carry it on the wrapper.
    Both present is fine only as identical copies: picking one would hide which the author meant."""
    both = t.has("quantization_config") and w.has("quantization_config")
    if both and t.d["quantization_config"] != w.d["quantization_config"]:
        raise ConfigError(
            f"{w.source}: quantization_config (top level) and text_config.quantization_config disagree; "
            "the release keeps it inside text_config: remove or correct the top-level copy"
        )
    where = t if t.has("quantization_config") else w if w.has("quantization_config") else None
    if where is None:
        raise t.err(
            "quantization_config",
            f"missing: streamrt reads releases whose routed experts are {MXFP4_FORMAT}, group {MXFP4_GROUP}",
        )
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


def _expect(f: Fields, key: str, got: Any, want: Any) -> None:
    if got != want:
        raise f.err(
            key,
            f"{show(got)}: streamrt reads {MXFP4_FORMAT} experts in groups of {MXFP4_GROUP} (expected {show(want)})",
        )
