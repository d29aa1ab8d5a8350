"""The `.nvfp4` expert file, format version 1 (docs/CONTRACTS.md).

One routed expert: gate, up, down in NVFP4 behind a 4096-byte header. Every section starts
at a 4096-aligned offset so a mapping can be page-locked and DMA'd whole, and O_DIRECT reads
work. Header (little-endian): magic b"SRTNVFP4", version u32, layer u32, expert u32,
hidden u32 (Dl), inter u32 (I), global_mode u32 (0: one global per matrix repeated per row,
1: one per row), then 9 (offset u64, nbytes u64) records: gate.packed, gate.scales,
gate.global, up.*, down.*. Parsing returns zero-copy torch views of the buffer.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from typing import TYPE_CHECKING

import numpy as np

from streamrt.fileio import AtomicWriter
from streamrt.config import ModelConfig
from streamrt.errors import CheckpointError

if TYPE_CHECKING:  # torch is imported lazily: `streamrt convert` / `verify` never need it
    import torch

    from streamrt.expert_weights import ExpertWeights

MAGIC = b"SRTNVFP4"
VERSION = 1
PAGE = 4096
HEADER_BYTES = 4096
_FIXED = struct.Struct("<8s6I")  # magic, version, layer, expert, hidden, inter, global_mode
_SECTION = struct.Struct("<QQ")
MATRICES = ("gate", "up", "down")
PARTS = ("packed", "scales", "global")
SECTIONS = tuple(f"{m}.{p}" for m in MATRICES for p in PARTS)
GLOBAL_PER_MATRIX, GLOBAL_PER_ROW = 0, 1


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


@dataclass(frozen=True)
class ExpertLayout:
    """Section offsets of one expert file for a geometry (Dl = hidden, I = inter)."""

    hidden: int
    inter: int
    sections: tuple[tuple[int, int], ...]  # (offset, nbytes) per SECTIONS entry
    file_bytes: int

    @classmethod
    def for_config(cls, cfg: ModelConfig) -> "ExpertLayout":
        return cls.for_shape(cfg.routed_expert_hidden_size, cfg.moe_intermediate_size)

    @classmethod
    def for_shape(cls, hidden: int, inter: int) -> "ExpertLayout":
        if hidden % 32 or inter % 32:
            raise ValueError(f"expert dims must be multiples of 32, got hidden={hidden} inter={inter}")
        secs, pos = [], HEADER_BYTES
        for m in MATRICES:
            out, inn = cls.matrix_shape_of(m, hidden, inter)
            for nbytes in (out * inn // 2, out * inn // 16, out * 4):
                secs.append((pos, nbytes))
                pos = _align(pos + nbytes)
        return cls(hidden, inter, tuple(secs), pos)

    @staticmethod
    def matrix_shape_of(m: str, hidden: int, inter: int) -> tuple[int, int]:
        return (hidden, inter) if m == "down" else (inter, hidden)

    def matrix_shape(self, m: str) -> tuple[int, int]:
        """[out, in] of 'gate' / 'up' ([I, Dl]) or 'down' ([Dl, I])."""
        return self.matrix_shape_of(m, self.hidden, self.inter)

    @property
    def offsets(self) -> dict[str, tuple[int, int]]:
        """{'gate.packed': (offset, nbytes), ...} in file order."""
        return dict(zip(SECTIONS, self.sections))

    def section(self, m: str, part: str) -> tuple[int, int]:
        return self.sections[SECTIONS.index(f"{m}.{part}")]

    def header(self, layer: int, expert: int, global_mode: int) -> bytes:
        h = _FIXED.pack(MAGIC, VERSION, layer, expert, self.hidden, self.inter, global_mode)
        h += b"".join(_SECTION.pack(o, n) for o, n in self.sections)
        return h + bytes(HEADER_BYTES - len(h))


@dataclass(frozen=True)
class ExpertHeader:
    layer: int
    expert: int
    hidden: int
    inter: int
    global_mode: int


def parse_header(
    head, layout: ExpertLayout, *, name: str = "expert file", file_size: int | None = None
) -> ExpertHeader:
    """Validate the first 4096 bytes against `layout`; CheckpointError naming the file."""
    mv = memoryview(head[:HEADER_BYTES].numpy()) if hasattr(head, "numpy") else memoryview(head).cast("B")
    if len(mv) < HEADER_BYTES:
        raise CheckpointError(
            f"{name}: truncated expert file: {len(mv)} bytes, shorter than the {HEADER_BYTES}-byte header"
        )
    magic, ver, layer, expert, hidden, inter, mode = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CheckpointError(f"{name}: not a streamrt expert file (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if ver != VERSION:
        raise CheckpointError(f"{name}: expert file version {ver}, this streamrt reads version {VERSION}")
    if (hidden, inter) != (layout.hidden, layout.inter):
        raise CheckpointError(
            f"{name}: expert geometry hidden={hidden} inter={inter} disagrees with the config "
            f"(hidden={layout.hidden} inter={layout.inter})"
        )
    if mode not in (GLOBAL_PER_MATRIX, GLOBAL_PER_ROW):
        raise CheckpointError(f"{name}: invalid global_mode {mode} (expected 0 or 1)")
    secs = tuple(_SECTION.unpack_from(mv, _FIXED.size + i * _SECTION.size) for i in range(len(SECTIONS)))
    if secs != layout.sections:
        bad = next(SECTIONS[i] for i, s in enumerate(secs) if s != layout.sections[i])
        raise CheckpointError(f"{name}: corrupt expert header: section {bad} record disagrees with the format")
    if any(mv[_FIXED.size + len(SECTIONS) * _SECTION.size : HEADER_BYTES]):
        raise CheckpointError(f"{name}: corrupt expert header: reserved bytes are not zero")
    if file_size is not None and file_size != layout.file_bytes:
        raise CheckpointError(f"{name}: expert file is {file_size} bytes, expected {layout.file_bytes}")
    return ExpertHeader(layer, expert, hidden, inter, mode)


def _as_u8_tensor(buf) -> "torch.Tensor":
    import torch

    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise TypeError("expected a 1-D uint8 tensor")
        return buf
    if isinstance(buf, np.ndarray):
        return torch.from_numpy(buf.reshape(-1).view(np.uint8))
    with warnings.catch_warnings():  # a read-only mapping is fine: we never write through it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def parse_expert(
    buf,
    layout: ExpertLayout,
    *,
    name: str = "expert file",
    expect: tuple[int, int] | None = None,
    validate: bool = True,
) -> "ExpertWeights":
    """Zero-copy views of one expert file's bytes (bytes-like, mmap, or uint8 tensor, on any
    device). `expect=(layer, expert)` also checks the header's ids. `validate=False` skips
    the header check: for a GPU slot whose host copy was already validated, reading the
    header back would cost a device sync."""
    import torch

    from streamrt.expert_weights import ExpertWeights, NVFP4Matrix

    t = _as_u8_tensor(buf)
    if t.numel() != layout.file_bytes:
        raise CheckpointError(f"{name}: expert file is {t.numel()} bytes, expected {layout.file_bytes}")
    if validate:
        head = t[:HEADER_BYTES].cpu() if t.device.type != "cpu" else t
        h = parse_header(head, layout, name=name, file_size=t.numel())
    if validate and expect is not None and (h.layer, h.expert) != tuple(expect):
        raise CheckpointError(
            f"{name}: header says layer {h.layer} expert {h.expert}, expected layer {expect[0]} expert {expect[1]}"
        )
    mats = {}
    for m in MATRICES:
        out, inn = layout.matrix_shape(m)
        (po, pn), (so, sn), (go, gn) = (layout.section(m, p) for p in PARTS)
        mats[m] = NVFP4Matrix(
            packed=t[po : po + pn].view(out, inn // 2),
            scales=t[so : so + sn].view(out, inn // 16),
            global_scale=t[go : go + gn].view(torch.float32),
        )
    return ExpertWeights(**mats)


def _numpy_triple(m) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if hasattr(m, "global_scale"):  # an NVFP4Matrix
        m = (m.packed, m.scales, m.global_scale)
    p, s, g = (x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x) for x in m)
    return p, s, g


def write_expert_file(
    path: Path,
    weights: "ExpertWeights | Mapping[str, tuple]",
    *,
    layer: int = 0,
    expert: int = 0,
    global_mode: int = GLOBAL_PER_MATRIX,
    layout: ExpertLayout | None = None,
    on_bytes=None,
    defer_commit: bool = False,
) -> "tuple[int, str] | AtomicWriter":
    """Write one expert atomically. `weights` is an ExpertWeights or a mapping
    {'gate'|'up'|'down': (packed uint8 [out, in/2], scales uint8 [out, in/16], global float32 [out] or scalar)}.
    Returns (size, checksum hex under fileio's rule); with `defer_commit`, the finished but
    uncommitted AtomicWriter instead (the caller commits or aborts it, e.g. on another thread)."""
    get = (lambda m: weights[m]) if isinstance(weights, Mapping) else (lambda m: getattr(weights, m))
    trip = {m: _numpy_triple(get(m)) for m in MATRICES}
    if layout is None:
        out, inn = trip["gate"][0].shape[0], trip["gate"][0].shape[1] * 2
        layout = ExpertLayout.for_shape(inn, out)
    parts = []
    for m in MATRICES:
        out, inn = layout.matrix_shape(m)
        p, s, g = trip[m]
        g = np.broadcast_to(np.asarray(g, dtype=np.float32), (out,))
        if p.shape != (out, inn // 2) or s.shape != (out, inn // 16) or p.dtype != np.uint8 or s.dtype != np.uint8:
            raise ValueError(f"{path}: {m}: packed {p.shape} / scales {s.shape} do not match [out={out}, in={inn}]")
        parts += [p, s, g]
    with AtomicWriter(Path(path), on_bytes, defer_commit=defer_commit) as w:
        w.write(layout.header(layer, expert, global_mode))
        for (off, n), arr in zip(layout.sections, parts):
            w.pad_to(off)
            a = np.ascontiguousarray(arr)
            assert a.nbytes == n
            w.write(a)
        w.pad_to(layout.file_bytes)
    return w if defer_commit else (w.size, w.digest)  # type: ignore[return-value]
