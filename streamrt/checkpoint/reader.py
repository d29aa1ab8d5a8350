"""Reading a converted (streamrt) tree: `open_tree(path)` (docs/CONTRACTS.md).

The model loader takes `dense_state_dict()` (zero-copy views of private mappings, names
without `language_model.`); the expert store takes `expert_path`, `layout` and
`expert_file.parse_expert` over its own mappings. Opening validates the manifest and the
config gating (the manifest's tensor names must agree with the variant markers).
Checksums are checked under the rule the manifest names (`tree.checksum_rule`): format_version
2 trees use fileio's chunked tree rule, format_version 1 trees (converted before the
tree rule) the whole-file blake2b they were written with.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from streamrt.checkpoint.manifest import FORMAT, MANIFEST, READ_VERSIONS, geometry, manifest_rule
from streamrt.checkpoint.expert_file import ExpertLayout, parse_expert
from streamrt.checkpoint.fileio import buffer_digest, file_digest, rule_chunk
from streamrt.checkpoint.names import expert_relpath
from streamrt.checkpoint.safetensors_io import read_header
from streamrt.config import ModelConfig, load_config
from streamrt.errors import CheckpointError

if TYPE_CHECKING:  # torch loads lazily so `streamrt verify` starts fast
    import torch

    from streamrt.expert_weights import ExpertWeights

TORCH_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "U8": "uint8",
                     "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool"}


def _map_private(path: Path) -> mmap.mmap:
    """Copy-on-write mapping: zero-copy reads, and a stray in-place write cannot reach the file."""
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot map: {e}") from None


@dataclass
class StreamrtTree:
    root: Path
    config: ModelConfig
    layout: ExpertLayout
    manifest: dict

    @property
    def checksum_rule(self) -> str:
        """The rule the manifest's "blake2b" values follow (validated by open_tree)."""
        return manifest_rule(self.manifest)

    def digest(self, path: Path | None = None, *, data=None) -> str:
        """Checksum of a file (read) or of its bytes already in memory (`data`, e.g. the mapping
        the runtime just made: no second read), under this tree's rule."""
        if data is not None:
            return buffer_digest(data.numpy() if hasattr(data, "numpy") else data, self.checksum_rule)
        return file_digest(path, self.checksum_rule)

    def dense_files(self) -> list[Path]:
        return sorted(self.root / rel for rel in self.manifest["files"] if rel.startswith("dense/"))

    def dense_state_dict(self) -> "dict[str, torch.Tensor]":
        """Every dense tensor (resident + planes), CPU, viewing the file mappings in place."""
        import torch

        out: dict[str, torch.Tensor] = {}
        for path in self.dense_files():
            hdr = read_header(path)
            buf = torch.frombuffer(_map_private(path), dtype=torch.uint8) if hdr.file_size else None
            for name, e in hdr.entries.items():
                dt = getattr(torch, TORCH_DTYPE_NAMES[e.dtype])
                raw = buf[e.begin : e.end] if buf is not None else torch.empty(0, dtype=torch.uint8)
                if e.begin % torch.empty(0, dtype=dt).element_size():
                    raw = raw.clone()  # misaligned (not written by us): copy rather than fail
                out[name] = raw.view(dt).view(e.shape)
        return out

    def expert_path(self, layer: int, expert: int) -> Path:
        if not self.config.is_moe(layer) or not 0 <= expert < self.config.num_experts:
            raise CheckpointError(f"{self.root}: no routed expert ({layer}, {expert}) in this model")
        return self.root / expert_relpath(layer, expert)

    def load_expert(self, layer: int, expert: int) -> "ExpertWeights":
        """CPU views of the expert's mapping; header validated (not the checksum)."""
        path = self.expert_path(layer, expert)
        if not path.is_file():
            raise CheckpointError(f"{path}: expert file missing")
        return parse_expert(_map_private(path), self.layout, name=str(path), expect=(layer, expert))

    def expert_checksum(self, layer: int, expert: int) -> str | None:
        entry = self.manifest["files"].get(expert_relpath(layer, expert))
        return entry.get("blake2b") if entry else None

    def check_expert(self, layer: int, expert: int, data=None) -> None:
        """Re-hash one expert file (or its mapped bytes `data`: bytes-like or uint8 tensor)
        against the manifest; CheckpointError on a mismatch or when the file is not listed."""
        path, want = self.expert_path(layer, expert), self.expert_checksum(layer, expert)
        if want is None:
            raise CheckpointError(f"{path}: not listed in {self.root / MANIFEST}; re-run `streamrt convert`")
        got = self.digest(path, data=data)
        if got != want:
            raise CheckpointError(f"{path}: checksum mismatch (manifest {want}, file {got}); "
                                  "run `streamrt verify --full` or re-run `streamrt convert`")


def read_manifest(root: Path) -> dict:
    f = root / MANIFEST
    if not f.is_file():
        raise CheckpointError(f"{f}: missing: not a converted streamrt tree (run `streamrt convert` first)")
    try:
        m = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: cannot read manifest: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{f}: not a streamrt manifest (format {m.get('format') if isinstance(m, dict) else None!r})")
    if m.get("format_version") not in READ_VERSIONS:
        raise CheckpointError(f"{f}: format_version {m.get('format_version')!r}, this streamrt reads "
                              f"{' and '.join(map(str, READ_VERSIONS))} (a newer streamrt wrote it?)")
    try:
        rule_chunk(manifest_rule(m))
    except ValueError:
        raise CheckpointError(f"{f}: unknown checksum rule {m.get('checksum')!r}") from None
    for key, typ in (("files", dict), ("tensor_names", list), ("geometry", dict)):
        if not isinstance(m.get(key), typ):
            raise CheckpointError(f"{f}: field {key!r} missing or not a {typ.__name__}")
    return m


def open_tree(path: str | Path) -> StreamrtTree:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such directory")
    manifest = read_manifest(root)
    cfg = load_config(root)  # gating against manifest.tensor_names
    want = geometry(cfg)
    got = manifest["geometry"]
    bad = sorted(k for k in want if got.get(k) != want[k])
    if bad:
        raise CheckpointError(f"{root / MANIFEST}: geometry field {bad[0]!r} is {got.get(bad[0])!r}, config.json implies {want[bad[0]]!r}")
    if manifest.get("variant") != cfg.variant:
        raise CheckpointError(f"{root / MANIFEST}: variant {manifest.get('variant')!r} but config.json is {cfg.variant!r}")
    return StreamrtTree(root, cfg, ExpertLayout.for_config(cfg), manifest)
