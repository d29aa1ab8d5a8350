"""What one expert-FFN call of the nvrtc backend (`nvrtc_moe.py`) hands its launches: the entry
points of its kind of pointer table, the call's operands, and one launch's pair tables."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class MoeEntries:
    """The expert-FFN entry points for one kind of pointer table (kernels/nvfp4_moe.cu)."""

    gateup: str  # CUDA-core
    down: str
    gateup_tc: str  # 8-row tensor-core blocks
    down_tc: str
    gateup_staged: str  # from staged rows
    down_staged: str


HOST_TABLES = MoeEntries("srt_nvfp4_gateup", "srt_nvfp4_down", "srt_nvfp4_gateup_tc2x2", "srt_nvfp4_down_tc2x2",
                         "srt_nvfp4_gateup_st2x1", "srt_nvfp4_down_st2x1")
DEVICE_TABLES = MoeEntries("srt_nvfp4_gateup_dt", "srt_nvfp4_down_dt", "srt_nvfp4_gateup_tc2x2_dt",
                           "srt_nvfp4_down_tc2x2_dt", "srt_nvfp4_gateup_st2x1_dt", "srt_nvfp4_down_st2x1_dt")


@dataclass(frozen=True)
class FfnCall:
    """One expert_ffn call, as its launches share it: z [T, Dl], h [P, I], y [P, Dl]; `act` the
    SiTU constants; `ready` the per-pair gate+up counts (None: the down blocks wait for the
    whole gate+up grid); `staged` `_staged_rows(z)` or None; `tc` whether the tensor-core
    kernels take it; `entries` the kernels of its kind of table."""

    z: Tensor
    h: Tensor
    y: Tensor
    act: list[bytes]
    ready: Tensor | None
    staged: tuple[Tensor, Tensor] | None
    tc: bool
    entries: MoeEntries

    @property
    def T(self) -> int:
        return self.z.shape[0]

    @property
    def I(self) -> int:  # noqa: E743
        return self.h.shape[1]

    @property
    def Dl(self) -> int:
        return self.z.shape[1]


@dataclass(frozen=True)
class PairTables:
    """Up to MOE_MAXP (host) or MOE_MAXP_DT (device) pairs of a call: their gate+up and down
    tables (struct bytes, or a device table's address); `groups`: srt_moe_tables' list of
    groups and the most it can hold (device tables with staged rows), else None;
    `pdl_gateup`: whether gate+up may launch programmatically."""

    gate_up: bytes
    down: bytes
    pairs: int
    pdl_gateup: bool
    groups: tuple[Tensor, int] | None = None
