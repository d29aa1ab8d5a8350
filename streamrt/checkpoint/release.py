"""Reading a release tree (what a user downloads), validated before anything is trusted.

`open_release(dir)` checks, in order: the config and its variant gating (which also checks
the indexer tensors against the index), the index json, every shard's safetensors header
(our own parser: truncation, offsets overlapping or running past the file), that index and
headers agree (each tensor in exactly the shard the index names, no shard outside the index),
then every text tensor the config implies: present, with the shape the config implies and
the dtype the release stores (names.accepted_dtypes), and no text tensor the config does
not imply. Tensors outside `language_model.` (the vision tower and projector) are headers
checked and otherwise left alone: `ReleaseTree.skipped` lists them for convert to report.
Each failure is one `CheckpointError` naming file and tensor. Tensor bytes are then served
zero-copy from read-only mappings.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from streamrt.checkpoint.names import TensorSpec, accepted_dtypes, expert_prefix, is_text_tensor, tensor_specs
from streamrt.checkpoint.safetensors_io import MAX_HEADER, STEntry, STHeader, read_header
from streamrt.config import ModelConfig, load_config
from streamrt.errors import CheckpointError, clip
from streamrt.fp4 import E8M0_NAN
from streamrt.jsonio import load_json

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD_GLOB = "model-*-of-*.safetensors"
TOKENIZER_FILES = (
    "tiktoken.model",
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
EXPERT_WEIGHTS = ("w1", "w3", "w2")  # gate, up, down


@dataclass
class ReleaseTree:
    root: Path
    config: ModelConfig
    weight_map: dict[str, str]  # name -> shard file name
    headers: dict[str, STHeader]  # shard file name -> parsed header
    specs: list[TensorSpec]  # text tensors, with the dtype each is stored in
    skipped: list[str] = field(default_factory=list)  # tensors outside language_model. (vision, projector)
    _maps: dict[str, mmap.mmap] = field(default_factory=dict, repr=False)
    _fds: dict[str, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def shards(self) -> list[str]:
        return sorted(self.headers)

    @property
    def skipped_bytes(self) -> int:
        return sum(e.end - e.begin for e in (self.entry(n)[1] for n in self.skipped))

    def entry(self, name: str) -> tuple[str, STEntry]:
        shard = self.weight_map[name]
        return shard, self.headers[shard].entries[name]

    def _map(self, shard: str) -> mmap.mmap:
        with self._lock:  # converter threads share one read-only mapping per shard
            m = self._maps.get(shard)
            if m is None:
                with open(self.root / shard, "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self._maps[shard] = m
            return m

    def _fd(self, shard: str) -> int:
        with self._lock:
            fd = self._fds.get(shard)
            if fd is None:
                fd = self._fds[shard] = os.open(self.root / shard, os.O_RDONLY)
            return fd

    def read_into(self, name: str, buf, start: int = 0) -> memoryview:
        """Copy the tensor's bytes [start, start + len) into `buf` with pread (all of them
        when `buf` is at least that large): no page faults on a shared mapping, which is
        what lets many converter threads scale."""
        shard, e = self.entry(name)
        n = min(len(memoryview(buf).cast("B")), e.end - e.begin - start)
        mv = memoryview(buf).cast("B")[:n]
        fd, done = self._fd(shard), 0
        while done < n:
            try:
                k = os.preadv(fd, [mv[done:]], e.begin + start + done)
            except OSError as err:
                raise CheckpointError(f"{self.root / shard}: tensor {name}: read failed: {err.strerror}") from None
            if k == 0:
                raise CheckpointError(f"{self.root / shard}: tensor {name}: file ended early (truncated while open?)")
            done += k
        return mv

    def raw(self, name: str) -> memoryview:
        """The tensor's bytes, zero-copy from the shard mapping."""
        shard, e = self.entry(name)
        return memoryview(self._map(shard))[e.begin : e.end]

    def array(self, name: str) -> np.ndarray:
        """A uint8 [*shape[:-1], last*itemsize] view for U8 tensors, else the raw byte vector."""
        shard, e = self.entry(name)
        a = np.frombuffer(self._map(shard), dtype=np.uint8, count=e.end - e.begin, offset=e.begin)
        return a.reshape(e.shape) if e.dtype == "U8" else a

    def expert_mxfp4(self, layer: int, expert: int, buffers=None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{'w1'|'w3'|'w2': (packed [out, in/2], E8M0 scales [out, in/32])}; NaN scales rejected.

        Views of the shard mapping, or, with `buffers(key, nbytes) -> writable buffer`,
        of those buffers filled by pread (the converter's per-thread scratch)."""
        p = expert_prefix(layer, expert)
        out = {}

        def get(name: str, key: str) -> np.ndarray:
            if buffers is None:
                return self.array(name)
            shape = self.entry(name)[1].shape
            mv = self.read_into(name, buffers(key, int(np.prod(shape))))
            return np.frombuffer(mv, dtype=np.uint8).reshape(shape)

        for w in EXPERT_WEIGHTS:
            sname = f"{p}{w}.weight_scale"
            scales = get(sname, f"{w}.scales")
            if (scales == E8M0_NAN).any():
                r, j = (int(i) for i in np.argwhere(scales == E8M0_NAN)[0])
                raise CheckpointError(
                    f"{self.root / self.weight_map[sname]}: tensor {sname}: E8M0 scale byte 0xFF (NaN) at row {r}, "
                    f"block {j}; the expert cannot be repacked"
                )
            out[w] = (get(f"{p}{w}.weight_packed", f"{w}.packed"), scales)
        return out

    def tokenizer_files(self) -> list[Path]:
        return [self.root / f for f in TOKENIZER_FILES if (self.root / f).is_file()]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a caller still holds a view; the mapping dies with it
                pass
        self._maps.clear()


def read_index(root: Path) -> dict[str, str]:
    idx = root / INDEX
    if not idx.is_file():
        if (root / SINGLE).is_file():
            hdr = read_header(root / SINGLE)
            return {n: SINGLE for n in hdr.entries}
        raise CheckpointError(f"{root}: not a release tree (no {INDEX} or {SINGLE})")
    data = load_json(idx, what="index", expect=dict, unique_keys=True)
    wm = data.get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{idx}: field 'weight_map' missing or not an object of name -> shard file")
    for shard in set(wm.values()):
        if "/" in shard or shard.startswith(".") or not shard or not shard.isprintable():
            raise CheckpointError(f"{idx}: shard name {clip(repr(shard))} is not a plain file name")
    for name in wm:
        if not name.isprintable():  # a newline in a name would split every message that names it
            raise CheckpointError(f"{idx}: tensor name {clip(repr(name))} in 'weight_map' holds a control character")
    return wm


def open_release(path: str | Path, *, check_tensors: bool = True) -> ReleaseTree:
    """Open and validate a release tree. `check_tensors=False` skips the per-tensor
    dtype/shape comparison (headers are still parsed, bounds-checked and held to the index)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such release directory")
    cfg = load_config(root)  # variant gating against the index's names, both directions
    wm = read_index(root)
    headers: dict[str, STHeader] = {}
    for shard in sorted(set(wm.values())):
        f = root / shard
        try:
            present = f.is_file()
        except OSError as e:  # e.g. a name longer than the file system allows
            raise CheckpointError(f"{root / INDEX}: shard name {clip(repr(shard))}: {e.strerror or e}") from None
        if not present:
            first = next(n for n, s in wm.items() if s == shard)
            what = "shard missing" if not (f.exists() or f.is_symlink()) else "shard is not a regular file"
            raise CheckpointError(f"{f}: {what} (index maps tensor {clip(first)} and others to it)")
        headers[shard] = read_header(f)
    _check_index_agrees(root, wm, headers)
    specs = tensor_specs(cfg)
    if check_tensors:
        specs = _check_specs(root, cfg, specs, wm, headers)
    skipped = [n for n in wm if not is_text_tensor(n)]
    return ReleaseTree(root, cfg, wm, headers, specs, skipped)


def _check_index_agrees(root: Path, wm: dict[str, str], headers: dict[str, STHeader]) -> None:
    """Every tensor lives in exactly the shard the index names, and every shard is indexed."""
    for name, shard in wm.items():
        if name not in headers[shard].entries:
            raise CheckpointError(
                f"{root / shard}: tensor {clip(name)} is listed in {INDEX} but missing from the shard"
            )
    for shard, hdr in headers.items():
        for name in hdr.entries:
            owner = wm.get(name)
            if owner is None:
                raise CheckpointError(f"{root / shard}: tensor {clip(name)} is in the shard but not in {INDEX}")
            if owner != shard:
                raise CheckpointError(
                    f"{root / shard}: tensor {clip(name)} is also stored here; {INDEX} maps it to {clip(owner)}"
                )
    if (root / INDEX).is_file():
        for f in sorted(root.glob(SHARD_GLOB)):
            if f.name not in headers:
                raise CheckpointError(
                    f"{f}: shard is not named by {INDEX} (a partial download, or an index from another release?)"
                )


def _check_specs(root: Path, cfg: ModelConfig, specs: list[TensorSpec], wm: dict, headers: dict) -> list[TensorSpec]:
    """The config's text tensors against the headers; returns them with their stored dtypes."""
    missing = [s.name for s in specs if s.name not in wm]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{root}: tensor {missing[0]} missing from the release{more}; the {cfg.variant} config implies it"
        )
    implied = {s.name for s in specs}
    extra = [n for n in wm if is_text_tensor(n) and n not in implied]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(
            f"{root / wm[extra[0]]}: tensor {clip(extra[0])}{more} is not part of the {cfg.variant} layout the config "
                f"implies"
        )
    out = []
    for s in specs:
        shard = wm[s.name]
        e = headers[shard].entries[s.name]
        if e.shape != s.shape:
            raise CheckpointError(
                f"{root / shard}: tensor {s.name}: shape {clip(str(list(e.shape)))} disagrees with the config "
                    f"({list(s.shape)})"
            )
        ok = accepted_dtypes(s)
        if e.dtype not in ok:
            raise CheckpointError(
                f"{root / shard}: tensor {s.name}: dtype {e.dtype}, expected {' or '.join(ok)} (as released)"
            )
        out.append(s if e.dtype == s.dtype else TensorSpec(s.name, s.shape, e.dtype))
    return out


def shard_fingerprints(root: Path, shards: list[str]) -> dict[str, dict]:
    """Per shard of the release (`ReleaseTree.shards`): size, mtime and a digest of its header.
    A rewritten shard changes its mtime even when its size and header stay the same. Only the
    shards the release is made of: any other *.safetensors in the tree (a directory, a dangling
    link, a stray file with a lying header length) was never validated and feeds no output."""
    from streamrt.fileio import new_hash

    out = {}
    for name in shards:
        f = root / name
        try:
            st = f.stat()
            with open(f, "rb") as fh:
                head = fh.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else 0
                h = new_hash()
                h.update(head + fh.read(min(n, MAX_HEADER)))  # validated already; the cap is for a shard swapped since
        except OSError as e:
            raise CheckpointError(f"{f}: cannot read: {e.strerror or e}") from None
        out[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "header": h.hexdigest()}
    return out


def release_fingerprint(root: Path) -> str:
    """Identifies a source tree: config and index bytes and every shard's name. What each
    shard holds is tracked apart, per shard (`shard_fingerprints`), so a changed shard
    re-converts only the files made from it."""
    from streamrt.fileio import new_hash

    h = new_hash()
    for name in ("config.json", INDEX):
        f = root / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        h.update(f"{f.name}\0".encode())
    return h.hexdigest()


__all__ = ["ReleaseTree", "open_release", "release_fingerprint", "shard_fingerprints", "INDEX", "TOKENIZER_FILES"]
