"""Reading a release tree (what a user downloads), validated before anything is trusted.

`open_release(dir)` checks, in order: the config and its variant gating (which also checks
the indexer tensors against the index), the index json, every shard's safetensors header
(our own parser: truncation, offsets overlapping or running past the file), then every
tensor the config implies: present, in the shard the index names, with the dtype and
shape the config implies. Each failure is one `CheckpointError` naming file and tensor.
Tensor bytes are then served zero-copy from read-only mappings.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from streamrt.checkpoint.names import TensorSpec, expert_prefix, tensor_specs
from streamrt.checkpoint.safetensors_io import STEntry, STHeader, read_header
from streamrt.config import ModelConfig, load_config
from streamrt.errors import CheckpointError
from streamrt.fp4 import E8M0_NAN

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
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
    specs: list[TensorSpec]
    _maps: dict[str, mmap.mmap] = field(default_factory=dict, repr=False)
    _fds: dict[str, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def shards(self) -> list[str]:
        return sorted(self.headers)

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


def _read_index(root: Path) -> dict[str, str]:
    idx = root / INDEX
    if not idx.is_file():
        if (root / SINGLE).is_file():
            hdr = read_header(root / SINGLE)
            return {n: SINGLE for n in hdr.entries}
        raise CheckpointError(f"{root}: not a release tree (no {INDEX} or {SINGLE})")
    try:
        data = json.loads(idx.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{idx}: cannot read index: {e}") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{idx}: field 'weight_map' missing or not an object of name -> shard file")
    for shard in set(wm.values()):
        if "/" in shard or shard.startswith("."):
            raise CheckpointError(f"{idx}: shard name {shard!r} is not a plain file name")
    return wm


def open_release(path: str | Path, *, check_tensors: bool = True) -> ReleaseTree:
    """Open and validate a release tree. `check_tensors=False` skips the per-tensor
    dtype/shape comparison (headers are still parsed and bounds-checked)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such release directory")
    cfg = load_config(root)  # variant gating against the index's names, both directions
    wm = _read_index(root)
    headers: dict[str, STHeader] = {}
    for shard in sorted(set(wm.values())):
        f = root / shard
        if not f.is_file():
            first = next(n for n, s in wm.items() if s == shard)
            raise CheckpointError(f"{f}: shard missing (index maps tensor {first} and others to it)")
        headers[shard] = read_header(f)
    for name, shard in wm.items():
        if name not in headers[shard].entries:
            raise CheckpointError(f"{root / shard}: tensor {name} is listed in {INDEX} but missing from the shard")
    specs = tensor_specs(cfg)
    if check_tensors:
        _check_specs(root, cfg, specs, wm, headers)
    return ReleaseTree(root, cfg, wm, headers, specs)


def _check_specs(root: Path, cfg: ModelConfig, specs: list[TensorSpec], wm: dict, headers: dict) -> None:
    missing = [s.name for s in specs if s.name not in wm]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{root}: tensor {missing[0]} missing from the release{more}; the {cfg.variant} config implies it")
    for s in specs:
        shard = wm[s.name]
        e = headers[shard].entries[s.name]
        if e.dtype != s.dtype or e.shape != s.shape:
            what = "dtype" if e.dtype != s.dtype else "shape"
            raise CheckpointError(
                f"{root / shard}: tensor {s.name}: {what} {e.dtype} {list(e.shape)} disagrees with the config "
                f"({s.dtype} {list(s.shape)})"
            )


def release_fingerprint(root: Path) -> str:
    """Identifies a source tree cheaply: config + index bytes and every shard's name and size."""
    from streamrt.checkpoint.fileio import new_hash

    h = new_hash()
    for name in ("config.json", INDEX):
        f = root / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        h.update(f"{f.name}\0{os.path.getsize(f)}\0".encode())
    return h.hexdigest()


__all__ = ["ReleaseTree", "open_release", "release_fingerprint", "INDEX", "TOKENIZER_FILES"]
