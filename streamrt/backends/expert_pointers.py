"""An NVFP4 expert's device pointers, checked once, and the tables the MoE kernels take.

`ExpertPointers` names the nine section pointers (gate, up, down: packed nibbles, E4M3
scales, fp32 global scale) and the intermediate size; `ExpertPointerCache` checks an
`ExpertWeights` once per object; `tables` packs up to `MOE_MAXP` (pair, row, expert) entries
into the `GateUpTable` / `DownTable` structs of `kernels/nvfp4_moe.cu` (passed by value).
`ExpertTable` keeps every resident expert's pointers on the device, from which the kernel
`srt_moe_tables` builds the same structs of `MOE_MAXP_DT` entries on the GPU (a CUDA graph of
a step replays for any ids).
"""

from __future__ import annotations

import weakref
from typing import Mapping, NamedTuple

import numpy as np
import torch

from streamrt.backends.kernel_defines import EXPERT_COLS, MOE_MAXP
from streamrt.backends.nvrtc_args import aligned
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix


class ExpertPointers(NamedTuple):
    """Device addresses of one expert's sections, in the kernels' table order, and I."""

    gate_packed: int
    gate_scales: int
    gate_global: int
    up_packed: int
    up_scales: int
    up_global: int
    down_packed: int
    down_scales: int
    down_global: int
    inter: int  # intermediate size I (rows of gate and up, columns of down)


GATE_UP = slice(0, 6)  # the ExpertPointers fields a GateUpTable column holds, in order
DOWN = slice(6, 9)  # ... and a DownTable column


def _check_mat(m: NVFP4Matrix, what: str, rows: int, cols: int, dev: torch.device) -> tuple[int, int, int]:
    if cols % 32:
        raise ValueError(f"{what}: input dim {cols} must be a multiple of 32 for the NVFP4 kernel")
    for t, name, dt, shape in (
        (m.packed, "packed", torch.uint8, (rows, cols // 2)),
        (m.scales, "scales", torch.uint8, (rows, cols // 16)),
        (m.global_scale, "global_scale", torch.float32, (rows,)),
    ):
        if t.device != dev or t.dtype != dt or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(
                f"{what}.{name}: need a contiguous {dt} {shape} on {dev}, got {t.dtype} {tuple(t.shape)} "
                f"on {t.device} (contiguous={t.is_contiguous()})"
            )
    if not (aligned(m.packed, 16) and aligned(m.scales, 2) and aligned(m.global_scale, 4)):
        raise ValueError(f"{what}: packed must be 16-byte aligned, scales 2-byte aligned")
    return m.packed.data_ptr(), m.scales.data_ptr(), m.global_scale.data_ptr()


def expert_pointers(ew: ExpertWeights, e: int, Dl: int, dev: torch.device) -> ExpertPointers:
    """Expert `e`'s pointers after checking every section's dtype, shape, device and alignment."""
    I = ew.gate.packed.shape[0]
    g = _check_mat(ew.gate, f"expert {e} gate", I, Dl, dev)
    u = _check_mat(ew.up, f"expert {e} up", I, Dl, dev)
    d = _check_mat(ew.down, f"expert {e} down", Dl, I, dev)
    return ExpertPointers(*g, *u, *d, I)


class ExpertPointerCache:
    """An expert's pointers, checked once per ExpertWeights object (frozen views: the same object
    has the same tensors). Checking 9 tensors was most of an expert-FFN call's host time, and a
    decode step on the NVRTC kernels is bound by host time."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cache: dict[int, tuple] = {}  # id(ExpertWeights) -> (weak ref, Dl, pointers)

    def get(self, ew: ExpertWeights, e: int, Dl: int) -> ExpertPointers:
        hit = self._cache.get(id(ew))
        if hit is not None and hit[0]() is ew and hit[1] == Dl:
            return hit[2]
        ptrs = expert_pointers(ew, e, Dl, self.device)
        if len(self._cache) >= 8192:  # entries of views that are gone
            self._cache.clear()
        self._cache[id(ew)] = (weakref.ref(ew), Dl, ptrs)
        return ptrs


def scales_aligned8(chunk: list[tuple[int, int, int]], ptrs: dict[int, ExpertPointers]) -> bool:
    """The pipelined kernels copy scale rows 8 bytes at a time (cp.async)."""
    return all(
        pe.gate_scales % 8 == 0 and pe.up_scales % 8 == 0 and pe.down_scales % 8 == 0
        for pe in (ptrs[e] for _, _, e in chunk)
    )


def gate_up_table_bytes(n: int) -> int:
    """sizeof(GateUpTableN<n>): 6 x n u64 + 2 x n int32."""
    return 6 * n * 8 + 2 * n * 4


def down_table_bytes(n: int) -> int:
    """sizeof(DownTableN<n>): 3 x n u64 + n int32."""
    return 3 * n * 8 + n * 4


def tables(chunk: list[tuple[int, int, int]], ptrs: dict[int, ExpertPointers],
           n: int = MOE_MAXP) -> tuple[np.ndarray, np.ndarray]:
    """The GateUpTableN<n> and DownTableN<n> bytes (n = MOE_MAXP: by value) for pairs (pair
    index = h / y row, token row, expert)."""
    g = np.zeros(gate_up_table_bytes(n), dtype=np.uint8)
    gp = g[: 6 * n * 8].view(np.uint64).reshape(6, n)
    gi = g[6 * n * 8 :].view(np.int32).reshape(2, n)
    d = np.zeros(down_table_bytes(n), dtype=np.uint8)
    dp = d[: 3 * n * 8].view(np.uint64).reshape(3, n)
    di = d[3 * n * 8 :].view(np.int32)
    for i, (p, t, e) in enumerate(chunk):
        pe = ptrs[e]
        gp[:, i] = pe[GATE_UP]
        gi[0, i], gi[1, i] = t, p
        dp[:, i] = pe[DOWN]
        di[i] = p
    return g, d


class ExpertTable:
    """Every MoE layer's expert pointers on the device: `layer(l)` is int64 [E, EXPERT_COLS] in
    ExpertPointers' order, each row checked once when its expert is placed (`place`), so the
    per-step work is one gather on the GPU. Valid while the experts stay where they were placed
    (the all-resident runtime never moves them); `upload` makes the device copy current. A
    streamed step, whose experts move between steps, rewrites one layer's rows and copies them
    behind the queued work instead (`refresh`)."""

    def __init__(self, moe_layers: list[int], num_experts: int, routed_width: int, device: torch.device):
        self.device, self.routed_width, self.num_experts = torch.device(device), routed_width, num_experts
        self._row = {layer: i for i, layer in enumerate(moe_layers)}
        # page-locked on CUDA: `refresh` copies a layer's rows without blocking the host
        self._host = torch.zeros(len(moe_layers), num_experts, EXPERT_COLS, dtype=torch.int64,
                                 pin_memory=self.device.type == "cuda")
        self._rows = self._host.numpy()  # the same memory: rows written without a tensor op each
        self._placed = torch.zeros(len(moe_layers), num_experts, dtype=torch.bool)
        self._device = torch.zeros_like(self._host, device=self.device)
        self._copied: list = [None] * len(moe_layers)  # per layer, the event after its last refresh copy
        self.inter: int | None = None

    def place(self, layer: int, e: int, ew: ExpertWeights) -> None:
        """Expert e of `layer` is `ew` (device views) until the table is dropped: checked here."""
        if layer not in self._row:
            raise ValueError(f"expert table: layer {layer} is not a MoE layer")
        if not 0 <= e < self.num_experts:
            raise ValueError(f"expert table: expert {e} outside 0..{self.num_experts - 1}")
        p = expert_pointers(ew, e, self.routed_width, self.device)
        if self.inter is not None and p.inter != self.inter:
            raise ValueError(
                f"expert table: layer {layer} expert {e} has intermediate size {p.inter}, others {self.inter}"
            )
        self.inter = p.inter
        self._host[self._row[layer], e] = torch.tensor(p[:EXPERT_COLS], dtype=torch.int64)
        self._placed[self._row[layer], e] = True

    def complete(self) -> bool:
        """Every expert of every MoE layer is placed."""
        return bool(self._placed.all())

    def tensor_core_ready(self) -> bool:
        """The tensor-core kernels' alignment holds for every placed expert (scales 8-byte aligned)."""
        scales = self._host[..., [1, 4, 7]][self._placed]
        return bool((scales % 8 == 0).all())

    def upload(self) -> None:
        self._device.copy_(self._host)

    def refresh(self, layer: int, pointers: Mapping[int, ExpertPointers]) -> None:
        """Rewrite `layer`'s rows of these experts (their pointers already checked, e.g. by an
        ExpertPointerCache) and copy the layer's table to the device behind the work queued on
        the current stream. The host rows are rewritten only once the layer's previous copy
        has run (normally long before: a decode step ends with the GPU)."""
        i = self._row[layer]
        if self._copied[i] is not None:
            self._copied[i].synchronize()
        if pointers:
            self._rows[i, list(pointers)] = [p[:EXPERT_COLS] for p in pointers.values()]  # one numpy write
        self._device[i].copy_(self._host[i], non_blocking=True)
        if self.device.type == "cuda":
            self._copied[i] = torch.cuda.Event()
            # the copy's stream, whatever device is current
            self._copied[i].record(torch.cuda.current_stream(self.device))

    def layer(self, layer: int) -> torch.Tensor:
        return self._device[self._row[layer]]
