"""The safetensors container, read and written by hand.

Format: 8-byte little-endian header length N, N bytes of JSON
(`name -> {dtype, shape, data_offsets: [begin, end]}` relative to the data section, plus an
optional `__metadata__`), then the data. Our own parser validates every offset before any
library touches the file, so a truncated or corrupt shard is a one-line error naming the
file and tensor instead of a crash. The writer streams: the header is computed from shapes,
then tensor bytes arrive chunk by chunk, so a 2 GB tensor never sits in memory.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

from streamrt import fileio
from streamrt.fileio import AtomicWriter, open_regular
from streamrt.checkpoint.names import DTYPE_BYTES
from streamrt.errors import CheckpointError, clip
from streamrt.jsonio import load_json

MAX_HEADER = 100 << 20  # the safetensors library's own limit
ALIGN = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}


class STEntry(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


class STHeader(NamedTuple):
    path: Path
    file_size: int
    data_start: int
    entries: dict[str, STEntry]
    metadata: dict


def read_header(path: Path, *, head: bytes | None = None, file_size: int | None = None) -> STHeader:
    """Parse and validate a safetensors header; CheckpointError naming the file (and tensor)."""
    path = Path(path)
    try:
        size = os.path.getsize(path) if file_size is None else file_size
        if head is None:
            with os.fdopen(open_regular(path), "rb") as f:
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
                raw = f.read(n) if n is not None and 8 + n <= size and n <= MAX_HEADER else b""
        else:
            n = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else None
            raw = head[8 : 8 + n] if n is not None else b""
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    if n is None:
        raise CheckpointError(f"{path}: truncated safetensors: {size} bytes, shorter than the 8-byte header length")
    if n > MAX_HEADER or 8 + n > size:
        raise CheckpointError(
            f"{path}: truncated or corrupt safetensors: header length {n} runs past the end of the file ({size} bytes)"
        )
    if len(raw) != n:
        raise CheckpointError(f"{path}: truncated safetensors header ({len(raw)} of {n} bytes)")
    hdr = load_json(raw, what="corrupt safetensors header", name=str(path), expect=dict, max_bytes=MAX_HEADER,
                    unique_keys=True)
    data_start = 8 + n
    data_len = size - data_start
    meta = hdr.pop("__metadata__", None) or {}
    entries: dict[str, STEntry] = {}
    for name, e in hdr.items():
        if not name.isprintable():  # a newline in a name would split every message that names it
            raise CheckpointError(
                f"{path}: corrupt safetensors header: tensor name {clip(repr(name))} holds a control character"
            )
        bad = lambda msg: CheckpointError(f"{path}: tensor {clip(name)}: {msg}")  # noqa: E731
        if not isinstance(e, dict):
            raise bad("header entry is not an object")
        dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise bad(f"unknown dtype {clip(repr(dtype))}")
        if not isinstance(shape, list) or len(shape) > 8 or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"invalid shape {clip(repr(shape))}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
            raise bad(f"invalid data_offsets {clip(repr(offs))}")
        b, en = offs
        need = DTYPE_BYTES[dtype]
        for d in shape:
            need *= d
        if not 0 <= b <= en:
            raise bad(f"invalid data_offsets [{b}, {en}]")
        if en - b != need:
            raise bad(f"data_offsets [{b}, {en}] span {en - b} bytes but {dtype} {shape} needs {need}")
        if en > data_len:
            raise CheckpointError(
                f"{path}: truncated safetensors: tensor {clip(name)} ends at data byte {en} but the file holds only "
                f"{max(data_len, 0)} data bytes"
            )
        entries[name] = STEntry(name, dtype, tuple(shape), data_start + b, data_start + en)
    # Zero-byte tensors share no bytes, and one sorted between two overlapping tensors hid their
    # overlap; without them, any overlap shows between neighbours in offset order.
    ordered = sorted((x for x in entries.values() if x.end > x.begin), key=lambda x: (x.begin, x.end))
    for prev, cur in zip(ordered, ordered[1:]):
        if cur.begin < prev.end:
            raise CheckpointError(
                f"{path}: corrupt safetensors header: tensor {clip(cur.name)} (bytes {cur.begin - data_start}.."
                f"{cur.end - data_start}) overlaps tensor {clip(prev.name)} (bytes "
                    f"{prev.begin - data_start}..{prev.end - data_start})"
            )
    return STHeader(path, size, data_start, entries, meta if isinstance(meta, dict) else {})


def order_for_alignment(specs: list) -> list:
    """Widest dtypes first, so every tensor is aligned to its element size (the header is
    padded to 8) and torch can view the mapped bytes in place. Stable within a dtype."""
    return sorted(specs, key=lambda s: -ALIGN.get(s.dtype, 1))


def build_header(specs: Iterable, metadata: dict | None = None) -> tuple[bytes, list[tuple[int, int]]]:
    """Header bytes (length prefix included, padded to 8) and each spec's data offsets, in order."""
    hdr: dict = {}
    if metadata:
        hdr["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offs, pos = [], 0
    for s in specs:
        n = s.nbytes
        hdr[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + n]}
        offs.append((pos, pos + n))
        pos += n
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw, offs


def write_stream(
    path: Path,
    specs: list,
    chunks: Iterable,
    *,
    metadata: dict | None = None,
    on_bytes: Callable[[int], None] | None = None,
    background_hash: bool | None = None,
) -> tuple[int, str]:
    """Write a safetensors file atomically from `specs` (in file order) and the concatenated
    tensor bytes `chunks` (any buffers). Returns (size, checksum hex under fileio's rule)."""
    header, offs = build_header(specs, metadata)
    total = offs[-1][1] if offs else 0
    if background_hash is None:  # more than one checksum chunk: hash chunks on all cores while writing
        background_hash = len(header) + total > fileio.CHUNK_BYTES
    with AtomicWriter(path, on_bytes, background_hash=background_hash) as w:
        w.write(header)
        for c in chunks:
            w.write(c)
        if w.size != len(header) + total:
            raise AssertionError(f"{path}: wrote {w.size - len(header)} data bytes, header declares {total}")
    return w.size, w.digest  # type: ignore[return-value]
