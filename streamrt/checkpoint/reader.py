"""Reading a converted (streamrt) tree: `open_tree(path)` (docs/CONTRACTS.md).

The model loader takes `dense_state_dict()` (zero-copy views of private mappings, names
without `language_model.`); the expert store takes `expert_path`, `layout` and
`expert_file.parse_expert` over its own mappings. Opening validates the manifest and the
config gating (the manifest's tensor names must agree with the variant markers).
Checksums are checked under the rule the manifest names (`tree.checksum_rule`): format_version
2 trees use fileio's chunked tree rule, format_version 1 trees (converted before the
tree rule) the whole-file blake2b they were written with.

Dense files are verified like experts: `dense_state_dict()` checks every dense header
against the tensors the config implies (names, dtypes, shapes: `check_dense_header`) and,
the first time a tree is loaded, hashes each file's mapping (the pages the model then reads,
files in parallel, big files chunk-parallel) against the manifest. The result is recorded
next to the tree (`VERIFIED`), keyed by each file's size and mtime, so later loads skip the
hash; a read-only tree (and the packaged default model) keeps its record in the per-user
cache dir instead (`verified_record_path`). A mismatch is a CheckpointError naming the file.
"""

from __future__ import annotations

import mmap
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from typing import TYPE_CHECKING

from streamrt.checkpoint.manifest import FORMAT, MANIFEST, READ_VERSIONS, dense_files, geometry, manifest_rule
from streamrt.checkpoint.expert_file import ExpertLayout, parse_expert
from streamrt.fileio import (buffer_digest, file_digest, new_hash, open_regular, rule_chunk, writable_dir_error,
                             write_bytes_atomic)
from streamrt.checkpoint.names import TensorSpec, dense_specs, expert_relpath, strip_prefix
from streamrt.checkpoint.safetensors_io import STHeader, read_header
from streamrt.config import ModelConfig, load_config
from streamrt.errors import CheckpointError
from streamrt.jsonio import load_json, type_name
from streamrt.tokenizer import TOKENIZER_CONFIG

if TYPE_CHECKING:  # torch loads lazily so `streamrt verify` starts fast
    import torch

    from streamrt.expert_weights import ExpertWeights

TORCH_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "U8": "uint8",
                     "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool"}


def _map_private(path: Path) -> mmap.mmap:
    """Copy-on-write mapping: zero-copy reads, and a stray in-place write cannot reach the file."""
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot map: {e}") from None


@dataclass
class StreamrtTree:
    root: Path
    config: ModelConfig
    layout: ExpertLayout
    manifest: dict

    @cached_property
    def dense_expected(self) -> dict[str, list[TensorSpec]]:
        """relpath -> specs of each dense file the config implies (computed once per tree)."""
        return expected_dense_files(self.config)

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

    def dense_state_dict(self, *, verify: bool = True) -> "dict[str, torch.Tensor]":
        """Every dense tensor (resident + planes), CPU, viewing the file mappings in place.

        verify: check each header against the config and, unless this tree's record says the
        file (same size and mtime) already passed, its checksum against the manifest."""
        import torch

        files = self.dense_files()
        headers = {path: read_header(path) for path in files}
        maps = {path: _map_private(path) for path, hdr in headers.items() if hdr.file_size}
        if verify:
            for path, hdr in headers.items():
                check_dense_header(self, path.relative_to(self.root).as_posix(), hdr)
            self.verify_dense(maps)
        out: dict[str, torch.Tensor] = {}
        for path in files:
            hdr = headers[path]
            buf = torch.frombuffer(maps[path], dtype=torch.uint8) if path in maps else None
            for name, e in hdr.entries.items():
                dt = getattr(torch, TORCH_DTYPE_NAMES[e.dtype])
                raw = buf[e.begin : e.end] if buf is not None else torch.empty(0, dtype=torch.uint8)
                if e.begin % torch.empty(0, dtype=dt).element_size():
                    raw = raw.clone()  # misaligned (not written by us): copy rather than fail
                out[name] = raw.view(dt).view(e.shape)
        return out

    def verify_dense(self, maps: "dict[Path, mmap.mmap]") -> None:
        """Checksum each mapped dense file against the manifest, skipping files this tree's
        record lists with the same size, mtime and manifest checksum; record what passed."""
        record_path, notice = verified_record_path(self.root)
        record = _read_record(record_path)
        entries = record.get("files", {})
        todo = {}
        for path, data in maps.items():
            rel = path.relative_to(self.root).as_posix()
            want = self.manifest["files"].get(rel, {}).get("blake2b")
            if want is None:
                raise CheckpointError(f"{path}: not listed in {self.root / MANIFEST}; re-run `streamrt convert`")
            key = _stat_key(path)
            if entries.get(rel) != {**key, "blake2b": want}:
                todo[path] = (rel, key, want, data)
        if not todo:
            return
        with ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1)) as ex:
            got = dict(zip(todo, ex.map(lambda p: self.digest(data=todo[p][3]), todo)))
        for path, (rel, key, want, _) in sorted(todo.items()):
            if got[path] != want:
                raise CheckpointError(f"{path}: checksum mismatch (manifest {want}, file {got[path]}); "
                                      "run `streamrt verify --full` or re-run `streamrt convert`")
            entries[rel] = {**key, "blake2b": want}
        record = {"format": "streamrt-verified", "root": str(self.root.resolve()), "files": entries}
        try:
            write_bytes_atomic(record_path, (json_dumps(record) + "\n").encode())
        except (OSError, CheckpointError):
            return  # no record: the next load hashes again, nothing is wrong with the tree
        if notice:
            print(f"streamrt: {self.root} is read-only; dense checksums recorded in {record_path}", file=sys.stderr)

    def check_side_files(self) -> None:
        """The small files the manifest lists outside dense/ and experts/ (config.json, the
        tokenizer files): present, with the listed size and checksum. The tokenizer loader falls
        back to bytes when tiktoken.model is absent, and config.json is read unhashed, so a
        deleted or edited file would otherwise run as a different model without a word. The
        checks are `streamrt verify`'s, with the checksum."""
        from streamrt.checkpoint.verify import check_file  # verify reads trees through this module

        for rel, entry in sorted(self.manifest["files"].items()):
            if rel.startswith(("dense/", "experts/")) or rel in USER_EDITABLE:
                continue
            path = self.root / rel
            reason = check_file(self, path, rel, entry, full=entry["size"] <= SIDE_FILE_HASH_BYTES)
            if reason:
                raise CheckpointError(f"{path}: {reason} (listed in {self.root / MANIFEST}); run `streamrt verify "
                                      "--full` or re-run `streamrt convert`")

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


# tokenizer_config.json's `streamrt_chat` block is the user's to set (docs/CONTRACTS.md), and
# ChatProfile validates what it reads there
USER_EDITABLE = frozenset({TOKENIZER_CONFIG})
SIDE_FILE_HASH_BYTES = 64 << 20  # config and tokenizer files are hashed at every open (a few MB at most)
VERIFIED = ".streamrt-verified.json"  # dense files that passed their checksum, by size and mtime


def verified_record_path(root: Path) -> tuple[Path, bool]:
    """Where a tree's dense-verification record lives, and whether that is the fallback for a
    read-only tree (to be said to the user). Next to the tree when it is writable; in the
    per-user cache dir (`$STREAMRT_CACHE/verified/`) for a read-only tree and for the packaged
    default model (package data is not ours to write)."""
    from streamrt.default_model import cache_root, packaged_model_dir

    packaged = packaged_model_dir()
    own = packaged is not None and root.resolve() == packaged.resolve()
    if not own and writable_dir_error(root) is None:
        return root / VERIFIED, False
    key = new_hash()
    key.update(str(root.resolve()).encode())
    return cache_root() / "verified" / f"{key.hexdigest()}.json", not own


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read_record(path: Path) -> dict:
    """A verification record, or {} when absent or unreadable (then everything is re-hashed)."""
    if not path.is_file():
        return {}
    try:
        rec = load_json(path, what="verification record", expect=dict, max_bytes=16 << 20)
    except CheckpointError:
        return {}
    return rec if isinstance(rec.get("files"), dict) else {}


def json_dumps(obj) -> str:
    import json

    return json.dumps(obj, indent=1, sort_keys=True)


# Dtypes a converted tree may hold where names.py now says otherwise: tensors that names.py
# specs as F32 were BF16 in trees converted before the release's F32 list was known (conv1d
# weights, o_norm, the router bias); the loader widens them exactly. Anything else must match.
LEGACY_DTYPES = {"F32": ("BF16",)}


def expected_dense_files(cfg: ModelConfig) -> dict[str, list[TensorSpec]]:
    """Converted-tree relpath -> the specs (release names) it must hold, for this config."""
    return dense_files(dense_specs(cfg))


def check_dense_header(tree: "StreamrtTree", rel: str, hdr: STHeader) -> None:
    """CheckpointError naming the file and tensor unless `hdr` holds exactly the tensors the
    config implies for `rel`, with their shapes and dtypes (names.py's specs)."""
    path = tree.root / rel
    expected = tree.dense_expected.get(rel)
    if expected is None:
        raise CheckpointError(f"{path}: not a dense file the {tree.config.variant} config implies")
    want = {strip_prefix(sp.name): sp for sp in expected}
    missing = sorted(set(want) - set(hdr.entries))
    extra = sorted(set(hdr.entries) - set(want))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{path}: tensor {missing[0]} missing{more}; the config implies it")
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{path}: tensor {extra[0]} is not one the config implies{more}")
    for name, sp in want.items():
        e = hdr.entries[name]
        dtype_ok = e.dtype == sp.dtype or e.dtype in LEGACY_DTYPES.get(sp.dtype, ())
        if not dtype_ok or tuple(e.shape) != tuple(sp.shape):
            what = "dtype" if not dtype_ok else "shape"
            raise CheckpointError(f"{path}: tensor {name}: {what} {e.dtype} {list(e.shape)} disagrees with the "
                                  f"config ({sp.dtype} {list(sp.shape)}); re-run `streamrt convert`")


def _show(v, limit: int = 40) -> str:
    """repr of a value from a file, cut to `limit` characters (a manifest can hold anything)."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


# kimi-k3.1-pro's manifest: about 50 MB (82,432 expert files, ~500k tensor names, at the tiny
# tree's bytes per entry). The cap bounds what a corrupt one costs: parsed, small JSON values
# take up to ~20x their bytes.
MANIFEST_MAX_BYTES = 256 << 20


def read_manifest(root: Path) -> dict:
    """The tree's manifest.json, decoded and type-checked: one CheckpointError naming the file
    and field for anything malformed (bit flips, wrong types, deep nesting)."""
    f = root / MANIFEST
    if not f.is_file():
        raise CheckpointError(f"{f}: missing: not a converted streamrt tree (run `streamrt convert` first)")
    m = load_json(f, what="manifest", expect=dict, max_bytes=MANIFEST_MAX_BYTES, max_depth=16)
    if m.get("format") != FORMAT:
        raise CheckpointError(f"{f}: not a streamrt manifest (format {_show(m.get('format'))})")
    version = m.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(f"{f}: format_version is {_show(version)}, not an integer")
    if version not in READ_VERSIONS:
        raise CheckpointError(f"{f}: format_version {_show(version)}, this streamrt reads "
                              f"{' and '.join(map(str, READ_VERSIONS))} (a newer streamrt wrote it?)")
    rule = manifest_rule(m)
    try:
        if not isinstance(rule, str):
            raise ValueError(rule)
        rule_chunk(rule)
    except ValueError:
        raise CheckpointError(f"{f}: unknown checksum rule {_show(m.get('checksum'))}") from None
    for key, typ in (("files", dict), ("tensor_names", list), ("geometry", dict)):
        if not isinstance(m.get(key), typ):
            raise CheckpointError(f"{f}: field {key!r} missing or not a {typ.__name__}")
    for rel, entry in m["files"].items():
        if not isinstance(entry, dict):
            raise CheckpointError(f"{f}: files[{rel[:200]!r}] is a JSON {type_name(entry)}, not an object")
        size, digest = entry.get("size"), entry.get("blake2b")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CheckpointError(f"{f}: files[{rel[:200]!r}].size is {_show(size)}, not a byte count")
        if not isinstance(digest, str) or len(digest) != 16 or any(c not in "0123456789abcdef" for c in digest):
            raise CheckpointError(f"{f}: files[{rel[:200]!r}].blake2b is {_show(digest)}, not 16 hex digits")
        # \n: one-line errors
        if not rel or rel.startswith("/") or ".." in rel.split("/") or any(ord(ch) < 32 for ch in rel):
            raise CheckpointError(f"{f}: files key {rel[:200]!r} is not a path inside the tree")
    if not all(isinstance(n, str) for n in m["tensor_names"]):
        raise CheckpointError(f"{f}: field 'tensor_names' holds a non-string")
    return m


def open_tree(path: str | Path) -> StreamrtTree:
    root = Path(path)
    try:
        is_dir = root.is_dir()
    except OSError as e:  # e.g. a name longer than the file system allows
        raise CheckpointError(f"{root}: cannot read: {e.strerror or e}") from None
    if not is_dir:
        raise CheckpointError(f"{root}: no such directory")
    manifest = read_manifest(root)
    cfg = load_config(root)  # gating against manifest.tensor_names
    want = geometry(cfg)
    got = manifest["geometry"]
    bad = sorted(k for k in want if got.get(k) != want[k])
    if bad:
        raise CheckpointError(
            f"{root / MANIFEST}: geometry field {bad[0]!r} is {str(got.get(bad[0]))[:80]}, config.json implies "
                f"{want[bad[0]]!r}"
        )
    if manifest.get("variant") != cfg.variant:
        raise CheckpointError(
            f"{root / MANIFEST}: variant {str(manifest.get('variant'))[:40]!r} but config.json is {cfg.variant!r}"
        )
    return StreamrtTree(root, cfg, ExpertLayout.for_config(cfg), manifest)
