"""The nvrtc backend's dense linears: the GEMV kernels (`kernels/gemv.cu`) for decode, one GEMM
through torch for prefill.

Up to `rowwise_max` rows: the GEMV kernel, 8 rows of x per block, so a row's result is
bit-identical alone or in a batch. bf16 weights take the tensor-core kernel (every 8-row group
of x and up to GEMV_TC_MATS matrices sharing x in one launch, a residual folded into its
epilogue); fp32 weights, and bf16 before sm_80, the CUDA-core kernels, a launch per group
(`gemv_plan.py` picks the entry point). More rows (prefill): one GEMM over all rows, bf16
weights as three bf16 tensor-core GEMMs with fp32 accuracy (`bf16x3.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from streamrt.backends.bf16x3 import mm_bf16x3
from streamrt.backends.cuda_driver import Kernel
from streamrt.backends.gemv_plan import GEMV_CUDA_CORE_KERNELS, GEMV_TC_KERNELS, gemv_tc_split
from streamrt.backends.kernel_defines import GEMV_TC_COLS, GEMV_TC_MATS, GEMV_TC_ROWS, GEMV_WARPS
from streamrt.backends.kernel_host import KernelHost
from streamrt.backends.nvrtc_args import aligned, as_act, as_weight, i32, ptr

GEMV_TC_STAGES = 2  # the tensor-core GEMV's ring stages per warp (srt_gemv_tc_*_s2)


@dataclass(frozen=True)
class GemvLaunch:
    """A tensor-core GEMV launch of fixed matrices at one x shape, built and checked once: its
    GemvMats table holds the weights' addresses, sizes and row blocks; a call fills in its
    outputs' and addends' addresses. `items`: which of a `_linears` call's matrices it takes."""

    kernel: Kernel
    grid: tuple[int]
    block: tuple[int]
    smem: int
    ks: int
    table: np.ndarray
    items: tuple[int, ...] = ()


class LinearOps(KernelHost):
    """`linear` and `linears` of the nvrtc backend (see the module doc)."""

    def _init_linear(self, rowwise_max: int) -> None:
        self.rowwise_max = rowwise_max
        self._mma = self.props.capability >= (8, 0)  # bf16 mma.sync
        self._mm_bf16x3 = True  # False once torch.mm has refused out_dtype (the fp32 GEMM then)
        self._gemv_choice: dict[tuple, str] = {}
        self._gemv_launches: dict[tuple, tuple[list[int], list[GemvLaunch]]] = {}  # see _linears

    def linear(self, x: Tensor, w: Tensor, add: Sequence[Tensor] = ()) -> Tensor:
        """x [..., in] fp32 (or bf16), w [out, in] bf16 or fp32 -> [..., out] fp32, fp32 accumulation;
        `add`: up to two [..., out] tensors added in order, (x w^T + add[0]) + add[1] (a residual,
        folded into the tensor-core GEMV's epilogue)."""
        return self._linears(x, [(w, tuple(add))])[0]

    def linears(self, x: Tensor, ws: Sequence[Tensor]) -> list[Tensor]:
        """[linear(x, w) for w in ws]: the tensor-core GEMVs run as one launch (up to
        GEMV_TC_MATS matrices) whose K split follows all its rows (`gemv_tc_split`), so a
        matrix's bits depend on the matrices beside it in `ws`, never on T."""
        return self._linears(x, [(w, ()) for w in ws])

    def _linears(self, x: Tensor, items: list[tuple[Tensor, tuple[Tensor, ...]]]) -> list[Tensor]:
        dev = self.device
        if x.device != dev:
            raise ValueError(f"linear: x on {x.device}, expected {dev}")
        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        x2 = x2.contiguous()
        T = x2.shape[0]
        x_bf16 = int(x2.dtype == torch.bfloat16)
        if K % 8 == 0 and T <= self.rowwise_max and not aligned(x2, 16):
            x2 = x2.clone()
        # a call of matrices seen before (same addresses, shapes, dtypes) at this x shape reuses
        # its launches, checked and built the first time: only x, the outputs and the addends change
        key = (T, K, x_bf16, self.rowwise_max,
               tuple((w.data_ptr(), w.shape, w.dtype, w.is_contiguous(), len(add)) for w, add in items))
        known = self._gemv_launches.get(key)
        if known is not None:
            outs = [self._empty(T, n) for n in known[0]]
            adds = [self._addends(add, lead, n, T) for (_, add), n in zip(items, known[0])]
            for launch in known[1]:
                self._run_gemv(launch, x2, [(outs[i], adds[i]) for i in launch.items])
            return [o.view(*lead, n) for o, n in zip(outs, known[0])]
        outs, batch = [], []  # batch: [(item, w, out, adds)] for the tensor-core launches
        for i, (w, add) in enumerate(items):
            if w.device != dev:
                raise ValueError(f"linear: x on {x.device}, w on {w.device}, expected {dev}")
            if w.dim() != 2 or K != w.shape[1]:
                raise ValueError(f"linear: x {tuple(x.shape)} and w {tuple(w.shape)} do not match (w is [out, in])")
            outs.append(self._linear_into(x2, x_bf16, w, self._addends(add, lead, w.shape[0], T), batch, i))
        launches = []
        for m0 in range(0, len(batch), GEMV_TC_MATS):
            chunk = batch[m0 : m0 + GEMV_TC_MATS]
            launch = self._gemv_tc_launch(T, K, x_bf16, [w for _, w, _, _ in chunk], [i for i, *_ in chunk])
            self._run_gemv(launch, x2, [(out, add) for _, _, out, add in chunk])
            launches.append(launch)
        if len(batch) == len(items):  # every matrix in tensor-core launches
            if len(self._gemv_launches) >= 4096:
                self._gemv_launches.clear()
            self._gemv_launches[key] = ([o.shape[1] for o in outs], launches)
        return [o.view(*lead, o.shape[1]) for o in outs]

    def _addends(self, add: tuple[Tensor, ...], lead, N: int, T: int) -> tuple[Tensor, ...]:
        if len(add) > 2 or any(a.shape != (*lead, N) for a in add):
            raise ValueError(f"linear: add {[tuple(a.shape) for a in add]} (up to two) must each be {(*lead, N)}")
        return tuple(as_act(a, "linear.add", self.device).view(T, N) for a in add)

    def _linear_into(
        self, x2: Tensor, x_bf16: int, w: Tensor, add: tuple[Tensor, ...], batch: list, item: int
    ) -> Tensor:
        """One matrix of `_linears`: its output, computed now, or left to the tensor-core launch
        of `batch` (every 8-row group of x in that one launch)."""
        (T, K), N = x2.shape, w.shape[0]
        if T > self.rowwise_max:
            return self._added(self._linear_gemm(x2.float(), w), add)
        w, w_bf16 = as_weight(w, "linear.w", self.device)
        out = self._empty(T, N, dtype=torch.float32)
        if T == 0 or N == 0:
            return out
        groups = [(t0, min(8, T - t0)) for t0 in range(0, T, 8)]  # (first row, rows) of each 8-row group
        if not (K % 8 == 0 and aligned(w, 16)):
            k = self._k("gemv", "srt_gemv_scalar")
            for t0, tn in groups:
                k(
                    (math.ceil(N / 8),),
                    (256,),
                    [
                        ptr(x2[t0 : t0 + 8]),
                        i32(x_bf16),
                        i32(tn),
                        ptr(w),
                        i32(w_bf16),
                        ptr(out[t0 : t0 + 8]),
                        i32(N),
                        i32(K),
                    ],
                )
            return self._added(out, add)
        if w_bf16 and self._mma:
            batch.append((item, w, out, add))
            return out
        dt = "bf16" if w_bf16 else "f32"
        for t0, tn in groups:
            name, rpw = self._gemv_cuda_core(dt, 1 if tn == 1 else 2 if tn == 2 else 4 if tn <= 4 else 8, N)
            self._k("gemv", name)(
                (math.ceil(N / (GEMV_WARPS * rpw)),),
                (GEMV_WARPS * 32,),
                [ptr(x2[t0 : t0 + 8]), i32(x_bf16), i32(tn), ptr(w), ptr(out[t0 : t0 + 8]), i32(N), i32(K)],
            )
        return self._added(out, add)

    @staticmethod
    def _added(out: Tensor, add: tuple[Tensor, ...]) -> Tensor:
        for a in add:  # in order, each sum rounded: the tensor-core epilogue's bits
            out.add_(a)
        return out

    def _gemv_tc_launch(self, T: int, K: int, x_bf16: int, ws: list[Tensor], items=()) -> GemvLaunch:
        """The launch of a tensor-core GEMV of up to GEMV_TC_MATS matrices `ws` sharing an x of T
        rows: a block per 32 rows of a w and 8 rows of x, K split among its warps as
        `gemv_tc_split` gives for all the matrices' row blocks (a function of the matrices only:
        a row's bits do not depend on T)."""
        row_blocks = [math.ceil(w.shape[0] / GEMV_TC_ROWS) for w in ws]
        # at most 8 warps, one stage each, and as many as fit shared memory with 2 stages of the
        # largest x (8 fp32 rows): a cap that does not depend on this call's T
        smem_optin = self.props.smem_optin
        fit = (smem_optin + 8 * 32 * 4) // (2 * (GEMV_TC_ROWS * GEMV_TC_COLS * 2 + 8 * GEMV_TC_COLS * 4) + 8 * 32 * 4)
        ks = max(1, min(gemv_tc_split(sum(row_blocks)), 8, fit, math.ceil(K / GEMV_TC_COLS)))
        stage = GEMV_TC_ROWS * GEMV_TC_COLS * 2 + min(T, 8) * GEMV_TC_COLS * (2 if x_bf16 else 4)
        smem = ks * GEMV_TC_STAGES * stage + (ks - 1) * 8 * 32 * 4  # the warps' rings, then the other warps' sums
        # GemvMats (kernels/gemv.cu): w, out, add0, add1 [GEMV_TC_MATS] u64; n, block0 [+1], m int32
        table = np.zeros(4 * GEMV_TC_MATS + (2 * GEMV_TC_MATS + 2) // 2, dtype=np.uint64)
        ints = table[4 * GEMV_TC_MATS :].view(np.int32)
        blocks = 0
        for i, (w, rb) in enumerate(zip(ws, row_blocks)):
            table[i] = w.data_ptr()
            ints[i], ints[GEMV_TC_MATS + i] = w.shape[0], blocks
            blocks += rb
        ints[GEMV_TC_MATS + len(ws)], ints[2 * GEMV_TC_MATS + 1] = blocks, len(ws)
        k = self._k("gemv", GEMV_TC_KERNELS[x_bf16])
        return GemvLaunch(k, (blocks * math.ceil(T / 8),), (32 * ks,), smem, ks, table, tuple(items))

    def _run_gemv(self, launch: GemvLaunch, x: Tensor, outs: list[tuple[Tensor, tuple[Tensor, ...]]]) -> None:
        """`launch` on x, its matrices' outputs and addends (in its table's order) filled in."""
        table = launch.table.copy()
        for i, (out, add) in enumerate(outs):
            table[GEMV_TC_MATS + i] = out.data_ptr()
            for j, a in enumerate(add):
                table[(2 + j) * GEMV_TC_MATS + i] = a.data_ptr()
        T, K = x.shape
        launch.kernel(launch.grid, launch.block, [table.tobytes(), ptr(x), i32(T), i32(K), i32(launch.ks)],
                      smem=launch.smem, pdl=self.pdl)

    def _gemv_cuda_core(self, dt: str, nt: int, N: int) -> tuple[str, int]:
        """The CUDA-core GEMV (entry point, rows per warp) for weights of dtype `dt`, a T bucket
        `nt` and N rows: at T=1 the candidate whose grid fills its last wave best (blocks /
        (waves * resident slots)), else the one."""
        key = (dt, nt, N)
        if key not in self._gemv_choice:
            cands = GEMV_CUDA_CORE_KERNELS[(dt, nt)]

            def fill(cand: tuple[str, int]) -> float:
                blocks = math.ceil(N / (GEMV_WARPS * cand[1]))
                slots = self.props.sms * self._k("gemv", cand[0]).blocks_per_sm(GEMV_WARPS * 32)
                return blocks / (math.ceil(blocks / slots) * slots)

            self._gemv_choice[key] = max(cands, key=fill) if len(cands) > 1 else cands[0]
        return self._gemv_choice[key]

    def _linear_gemm(self, x: Tensor, w: Tensor, block_elems: int = 1 << 24) -> Tensor:
        """x [T, K] fp32 -> [T, N] fp32. bf16 w: three bf16 tensor-core GEMMs (`bf16x3.py`, fp32
        accuracy); where this torch has no bf16 -> fp32 `mm`, and for fp32 w, fp32 GEMMs with the
        weights converted in row blocks."""
        if w.dtype == torch.bfloat16 and self._mm_bf16x3:
            try:
                return mm_bf16x3(x, w)
            except (TypeError, NotImplementedError):  # a torch without bf16 -> fp32 mm
                self._mm_bf16x3 = False
        rows = max(1, block_elems // max(1, w.shape[1]))
        parts = [x @ w[r0 : r0 + rows].float().T for r0 in range(0, w.shape[0], rows)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
