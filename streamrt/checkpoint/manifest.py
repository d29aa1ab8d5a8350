"""The converted tree's format: its constants, the dense files' grouping and the manifest.

Everything that reads or writes a streamrt tree (convert, synth, the reader, verify) takes
the layout from here, so the writer and the readers cannot disagree (docs/CONTRACTS.md,
"streamrt tree").
"""

from __future__ import annotations

import json
from pathlib import Path

from streamrt.checkpoint.expert_file import ExpertLayout
from streamrt.fileio import LEGACY_RULE, rule_name, write_bytes_atomic
from streamrt.checkpoint.names import TensorSpec, dense_group
from streamrt.checkpoint.safetensors_io import order_for_alignment
from streamrt.config import ModelConfig

FORMAT, FORMAT_VERSION = "streamrt", 2
READ_VERSIONS = (1, 2)  # 1: whole-file blake2b (fileio.LEGACY_RULE); 2: top-level "checksum" names the rule
MANIFEST = "manifest.json"


def dense_files(specs: list[TensorSpec]) -> dict[str, list[TensorSpec]]:
    """Relative path -> the release specs it holds, in file order (aligned for in-place views)."""
    groups: dict[str, list[TensorSpec]] = {}
    for s in specs:
        groups.setdefault(f"dense/{dense_group(s.name)}.safetensors", []).append(s)
    return {rel: order_for_alignment(v) for rel, v in sorted(groups.items())}


def geometry(cfg: ModelConfig) -> dict:
    return {
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "num_experts": cfg.num_experts,
        "experts_per_token": cfg.experts_per_token,
        "moe_layers": list(cfg.moe_layers),
        "routed_expert_hidden_size": cfg.routed_expert_hidden_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "expert_file_bytes": ExpertLayout.for_config(cfg).file_bytes,
        "indexer_layers": list(cfg.indexer_layers),
    }


def manifest_rule(m: dict) -> str | None:
    """The checksum rule a manifest's "blake2b" values follow (None if it names none)."""
    return LEGACY_RULE if m.get("format_version") == 1 else m.get("checksum")


def write_manifest(
    root: Path, cfg: ModelConfig, files: dict, tensor_names: list[str], *, source: dict, modes: dict
) -> None:
    """`files` values: {"size", "blake2b"} computed under the current rule (fileio.rule_name())."""
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "checksum": rule_name(),
        "variant": cfg.variant,
        "geometry": geometry(cfg),
        "expert_global_modes": {"per_matrix": modes.get(0, 0), "per_row": modes.get(1, 0)},
        "source": source,
        "files": {k: files[k] for k in sorted(files)},
        "tensor_names": tensor_names,
    }
    write_bytes_atomic(root / MANIFEST, json.dumps(manifest, indent=1).encode())
