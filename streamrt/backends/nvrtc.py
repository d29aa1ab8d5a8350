"""The nvrtc Backend: the decode path as NVRTC-compiled CUDA kernels, launched with cuda-python.

Kernels live in the top-level `kernels/*.cu` (raw pointers, no torch; `cuda_compile.kernel_dir`
finds them in a checkout or an installed wheel); `cuda_compile.py` turns them into cubins for
the device's arch (cached on disk); `cuda_driver.py` loads them into torch's primary context and
launches them on torch's current stream with `t.data_ptr()` pointers, so they order with torch's
own work and the caching allocator. Launch geometry shared with the kernels: `kernel_defines.py`.

Each wrapper validates dtype / device / shape / alignment (`nvrtc_args.py`), allocates its
output, launches and returns. Strided activations are made contiguous (a copy); a strided tensor
updated in place (`conv_state`, `state`) is updated through a contiguous copy that is written
back. Signatures and math: `backends/base.py` (the torch backend is the reference the GPU tests
hold these kernels to). The router and expert FFN: `nvrtc_moe.py`; the GEMV variants:
`gemv_plan.py`.

Prefill: `linear` with more than `rowwise_max` rows runs one GEMM through torch, bf16 weights
as three bf16 tensor-core GEMMs with fp32 accuracy (`bf16x3.py`); up to `rowwise_max` rows it
runs the GEMV kernel 8 rows at a time, so a row's result is bit-identical alone or in a batch.
The prefill view (`for_prefill`) runs the routed experts as grouped GEMMs (`nvfp4_gemm.py`) once
a chunk gives each expert enough rows, else the decode kernels.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from streamrt.backends.bf16x3 import mm_bf16x3
from streamrt.backends.cuda_driver import SMEM_DEFAULT, CudaError, Kernel, kernel
from streamrt.backends.expert_pointers import ExpertPointerCache
from streamrt.backends.gemv_plan import GEMV_VARIANTS, gemv_plan, gemv_tc_split
from streamrt.backends.kernel_defines import (
    ATTNRES_MAXS,
    ATTNRES_SLICE,
    GEMV_TC_COLS,
    GEMV_TC_MATS,
    GEMV_TC_ROWS,
    GEMV_WARPS,
    IDX_PPW,
    IDX_WARPS,
    KDA_MAXK,
    KDA_WARPS,
    MLA_CHUNK,
    MLA_HG,
    MLA_THREADS,
    MOE_MAXP,
    TOPK_THREADS,
)
from streamrt.backends.nvrtc_args import aligned, as_act, as_rows, as_weight, block_threads, f32, i32, i64, inplace_buf, ptr, situ_args
from streamrt.backends.nvrtc_moe import NVFP4_IMPLS, TC_PIPES, TC_SHAPE, TC_SHAPE_BATCH, TC_STAGED_SHAPE, MoeOps, tc_smem
from streamrt.backends.torch_backend import TorchBackend

# what tests and benchmarks import from here (defined in the modules above)
__all__ = ["NvrtcBackend", "CudaError", "GEMV_VARIANTS", "gemv_plan", "gemv_tc_split", "MOE_MAXP", "NVFP4_IMPLS",
           "TC_PIPES", "TC_SHAPE", "TC_SHAPE_BATCH", "TC_STAGED_SHAPE", "tc_smem"]


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


class NvrtcBackend(MoeOps):
    """Backend ops on NVRTC kernels (CUDA tensors only). `rowwise_max`: see the module doc; the
    router and expert FFN come from `MoeOps`."""

    name = "nvrtc"
    captures_decode = True  # decode steps replay as CUDA graphs (runtime/graph_choice.py)
    grouped_prefill = False  # True on the prefill view (for_prefill): expert FFN as grouped GEMMs
    _mm_bf16x3 = True  # False once torch.mm has refused out_dtype (the fp32 GEMM then)

    def __init__(self, device: torch.device | str | int | None = None, rowwise_max: int = 64, nvfp4_impl: str | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("NvrtcBackend needs a CUDA device")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type != "cuda":
            raise ValueError(f"NvrtcBackend runs on CUDA devices, not {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        self._configure(torch.device("cuda", index), rowwise_max, nvfp4_impl, capability=(props.major, props.minor),
                        smem_optin=getattr(props, "shared_memory_per_block_optin", SMEM_DEFAULT),
                        sms=props.multi_processor_count)

    def _configure(self, device: torch.device, rowwise_max: int, nvfp4_impl: str | None, *,
                   capability: tuple[int, int], smem_optin: int, sms: int) -> None:
        """Every setting of the backend from the device's properties; no CUDA call (the host
        side alone runs on a CPU device given a GPU's properties)."""
        self.device = device
        self.rowwise_max = rowwise_max
        self._dev = device.index or 0
        # NVFP4 expert GEMVs: "tc" (tensor cores, default) or "cuda_core" (fp32 FMA); same math
        self.nvfp4_impl = nvfp4_impl or "tc"
        if self.nvfp4_impl not in NVFP4_IMPLS:
            raise ValueError(f"nvfp4_impl must be one of {NVFP4_IMPLS}, got {self.nvfp4_impl!r}")
        self.tc_shape = TC_SHAPE  # (warps gate+up, warps down, stages, blocks per stage)
        self.tc_shape_batch = TC_SHAPE_BATCH  # ... once a block takes TC_BATCH_ROWS rows or more
        self.tc_staged_shape = TC_STAGED_SHAPE  # ... and gate+up from rows staged once per call (None: off)
        # Rows of one expert a tensor-core block takes: 8, or 16 (a batch's rows share one decode
        # of the weights; the activation staged in phases of `tc_phase_blocks` column blocks,
        # None: the fewest phases that fit). The same bits either way.
        self.tc_rows, self.tc_phase_blocks = 8, None
        # Programmatic dependent launch (sm_90+; False: plain launches). Each decode kernel lets
        # the next one start at once and waits for the one before (pdl_begin, common.cuh), so a
        # launch's ramp hides behind its predecessor; the tensor-core GEMV and gate+up kernels
        # pull their first weight stages while they wait, the down kernel's blocks take the SM
        # slots the gate+up grid's last wave leaves free, and the weighted sum queues behind it.
        self.pdl = capability[0] >= 9
        # The tensor-core down kernel's blocks start on a pair once its gate+up blocks are done
        # (per-pair counts), not once the whole gate+up grid is: the first experts' down work
        # runs while the last experts' gate+up does.
        self.pair_ready = True
        self._ready, self._ready_outgrown = None, []
        self._ptr_cache = ExpertPointerCache(self.device)
        self._torch_attention = TorchBackend()  # runs mla_prefill (see below)
        self.gemv_plan: dict[tuple[str, int], str] = {}  # forced variants (tests, benchmarks): gemv_plan.gemv_plan
        self._gemv_choice: dict[tuple, str] = {}
        self._gemv_launches: dict[tuple, tuple[list[int], list[GemvLaunch]]] = {}  # see _linears
        self.gemv_tc_ks: int | None = None  # K split of the tensor-core GEMV (None: gemv_tc_split's; changes bits)
        self._cc = capability
        self._mma = self._cc >= (8, 0)  # bf16 mma.sync
        self._smem_optin = smem_optin
        self._sms = sms

    def _k(self, program: str, name: str) -> Kernel:
        return kernel(program, name, self._dev)

    def for_prefill(self) -> "NvrtcBackend":
        """This backend for a prefill chunk: the routed experts as grouped GEMMs (one per expert
        and matrix, weights read once per chunk) instead of per-pair GEMVs. Decode stays on the
        per-pair kernels (batch-invariant)."""
        view = copy.copy(self)
        view.grouped_prefill = True
        return view


    def _empty(self, *shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """Every output and scratch buffer comes from here (tests poison it to prove full writes)."""
        return torch.empty(*shape, dtype=dtype, device=self.device)

    # ---- dense ---------------------------------------------------------------------------------

    def linear(self, x: Tensor, w: Tensor, add: Sequence[Tensor] = ()) -> Tensor:
        """x [..., in] fp32 (or bf16), w [out, in] bf16 or fp32 -> [..., out] fp32, fp32 accumulation;
        `add`: up to two [..., out] tensors added in order, (x w^T + add[0]) + add[1] (a residual,
        folded into the tensor-core GEMV's epilogue).

        Up to `rowwise_max` rows: the GEMV kernel, 8 rows per block (batch-invariant; the tensor-core
        one takes every group of 8 in one launch, the CUDA-core ones a launch per group). More rows
        (prefill): one GEMM over all rows (`_linear_gemm`).
        """
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
        # its launches, checked and built the first time: only x, the outputs and the addends
        # change (forced variants, tests and benchmarks, always take the checked path)
        key = (T, K, x_bf16, self.gemv_tc_ks, self.rowwise_max,
               tuple((w.data_ptr(), w.shape, w.dtype, w.is_contiguous(), len(add)) for w, add in items))
        known = None if self.gemv_plan else self._gemv_launches.get(key)
        if known is not None:
            outs = [self._empty(T, n) for n in known[0]]
            adds = [self._addends(add, lead, n, T) for (_, add), n in zip(items, known[0])]
            for launch in known[1]:
                self._run_gemv(launch, x2, [(outs[i], adds[i]) for i in launch.items])
            return [o.view(*lead, n) for o, n in zip(outs, known[0])]
        outs, batch = [], {}  # batch: stages -> [(item, w, out, adds)] for the tensor-core launches
        for i, (w, add) in enumerate(items):
            if w.device != dev:
                raise ValueError(f"linear: x on {x.device}, w on {w.device}, expected {dev}")
            if w.dim() != 2 or K != w.shape[1]:
                raise ValueError(f"linear: x {tuple(x.shape)} and w {tuple(w.shape)} do not match (w is [out, in])")
            outs.append(self._linear_into(x2, x_bf16, w, self._addends(add, lead, w.shape[0], T), batch, i))
        launches = []
        for stages, mats in batch.items():
            for m0 in range(0, len(mats), GEMV_TC_MATS):
                chunk = mats[m0 : m0 + GEMV_TC_MATS]
                launch = self._gemv_tc_launch(T, K, x_bf16, [w for _, w, _, _ in chunk], stages, [i for i, *_ in chunk])
                self._run_gemv(launch, x2, [(out, add) for _, _, out, add in chunk])
                launches.append(launch)
        if sum(len(m) for m in batch.values()) == len(items):  # every matrix in tensor-core launches
            if len(self._gemv_launches) >= 4096:
                self._gemv_launches.clear()
            self._gemv_launches[key] = ([o.shape[1] for o in outs], launches)
        return [o.view(*lead, o.shape[1]) for o in outs]

    def _addends(self, add: tuple[Tensor, ...], lead, N: int, T: int) -> tuple[Tensor, ...]:
        if len(add) > 2 or any(a.shape != (*lead, N) for a in add):
            raise ValueError(f"linear: add {[tuple(a.shape) for a in add]} (up to two) must each be {(*lead, N)}")
        return tuple(as_act(a, "linear.add", self.device).view(T, N) for a in add)

    def _linear_into(self, x2: Tensor, x_bf16: int, w: Tensor, add: tuple[Tensor, ...], batch: dict, item: int) -> Tensor:
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
                k((math.ceil(N / 8),), (256,),
                  [ptr(x2[t0 : t0 + 8]), i32(x_bf16), i32(tn), ptr(w), i32(w_bf16), ptr(out[t0 : t0 + 8]), i32(N), i32(K)])
            return self._added(out, add)
        dt = "bf16" if w_bf16 else "f32"
        buckets = [1 if tn == 1 else 2 if tn == 2 else 4 if tn <= 4 else 8 for _, tn in groups]
        variants = [self._gemv_variant(dt, nt, N) for nt in buckets]
        if all(v.startswith("tc") for v in variants):
            batch.setdefault(int(variants[0][2:]), []).append((item, w, out, add))
            return out
        for (t0, tn), nt, v in zip(groups, buckets, variants):
            xt, ot = x2[t0 : t0 + 8], out[t0 : t0 + 8]
            if v.startswith("tc"):
                self._gemv_tc(xt, x_bf16, [(w, ot, ())], int(v[2:]))
            else:
                k = self._k("gemv", f"srt_gemv_{dt}_t{nt}_{v}")
                k((math.ceil(N / (GEMV_WARPS * int(v[1:]))),), (GEMV_WARPS * 32,),
                  [ptr(xt), i32(x_bf16), i32(tn), ptr(w), ptr(ot), i32(N), i32(K)])
        return self._added(out, add)

    @staticmethod
    def _added(out: Tensor, add: tuple[Tensor, ...]) -> Tensor:
        for a in add:  # in order, each sum rounded: the tensor-core epilogue's bits
            out.add_(a)
        return out

    def _gemv_tc(self, x: Tensor, x_bf16: int, mats: list[tuple[Tensor, Tensor, tuple[Tensor, ...]]], stages: int) -> None:
        """The tensor-core GEMV of up to GEMV_TC_MATS (w, out, addends) sharing x."""
        T, K = x.shape
        self._run_gemv(self._gemv_tc_launch(T, K, x_bf16, [w for w, _, _ in mats], stages), x,
                       [(out, add) for _, out, add in mats])

    def _gemv_tc_launch(self, T: int, K: int, x_bf16: int, ws: list[Tensor], stages: int, items=()) -> "GemvLaunch":
        """The launch of a tensor-core GEMV of up to GEMV_TC_MATS matrices `ws` sharing an x of T
        rows: a block per 32 rows of a w and 8 rows of x, K split among its warps as
        `gemv_tc_split` gives for all the matrices' row blocks (a function of the matrices only:
        a row's bits do not depend on T)."""
        row_blocks = [math.ceil(w.shape[0] / GEMV_TC_ROWS) for w in ws]
        # at most 8 warps, one stage each, and as many as fit shared memory with 2 stages of the
        # largest x (8 fp32 rows): a cap that does not depend on this call's T
        fit = (self._smem_optin + 8 * 32 * 4) // (2 * (GEMV_TC_ROWS * GEMV_TC_COLS * 2 + 8 * GEMV_TC_COLS * 4) + 8 * 32 * 4)
        ks = max(1, min(self.gemv_tc_ks or gemv_tc_split(sum(row_blocks)), 8, fit, math.ceil(K / GEMV_TC_COLS)))
        stage = GEMV_TC_ROWS * GEMV_TC_COLS * 2 + min(T, 8) * GEMV_TC_COLS * (2 if x_bf16 else 4)

        def smem_of(stages: int) -> int:  # the warps' rings, then the other warps' sums
            return ks * stages * stage + (ks - 1) * 8 * 32 * 4

        # fewer stages where the rings would not fit a block's shared memory (same bits; 2 always fit)
        while stages > 2 and smem_of(stages) > self._smem_optin:
            stages -= 1
        smem = smem_of(stages)
        # GemvMats (kernels/gemv.cu): w, out, add0, add1 [GEMV_TC_MATS] u64; n, block0 [+1], m int32
        table = np.zeros(4 * GEMV_TC_MATS + (2 * GEMV_TC_MATS + 2) // 2, dtype=np.uint64)
        ints = table[4 * GEMV_TC_MATS :].view(np.int32)
        blocks = 0
        for i, (w, rb) in enumerate(zip(ws, row_blocks)):
            table[i] = w.data_ptr()
            ints[i], ints[GEMV_TC_MATS + i] = w.shape[0], blocks
            blocks += rb
        ints[GEMV_TC_MATS + len(ws)], ints[2 * GEMV_TC_MATS + 1] = blocks, len(ws)
        k = self._k("gemv", f"srt_gemv_tc_x{'bf16' if x_bf16 else 'f32'}_s{stages}")
        return GemvLaunch(k, (blocks * math.ceil(T / 8),), (32 * ks,), smem, ks, table, tuple(items))

    def _run_gemv(self, launch: "GemvLaunch", x: Tensor, outs: list[tuple[Tensor, tuple[Tensor, ...]]]) -> None:
        """`launch` on x, its matrices' outputs and addends (in its table's order) filled in."""
        table = launch.table.copy()
        for i, (out, add) in enumerate(outs):
            table[GEMV_TC_MATS + i] = out.data_ptr()
            for j, a in enumerate(add):
                table[(2 + j) * GEMV_TC_MATS + i] = a.data_ptr()
        T, K = x.shape
        launch.kernel(launch.grid, launch.block, [table.tobytes(), ptr(x), i32(T), i32(K), i32(launch.ks)], smem=launch.smem, pdl=self.pdl)

    def _gemv_variant(self, dt: str, nt: int, N: int) -> str:
        """The override if any; else for bf16 weights the tensor-core kernel where the device has
        bf16 mma (sm_80+); else at T=1 the CUDA-core variant with the fullest last wave (blocks /
        (waves * resident slots)), else the first."""
        forced = self.gemv_plan.get((dt, nt))
        key = (dt, nt, N, forced)
        if key not in self._gemv_choice:
            cands = [v for v in GEMV_VARIANTS[(dt, nt)] if self._mma or not v.startswith("tc")]
            if forced:
                if forced.startswith("tc") and not self._mma:
                    raise ValueError(f"gemv_plan: {forced} needs bf16 mma (sm_80+), this GPU has sm_{self._cc[0]}{self._cc[1]}")
                best = forced
            elif cands[0].startswith("tc"):
                best = cands[0]
            else:

                def fill(v: str) -> float:
                    blocks = math.ceil(N / (GEMV_WARPS * int(v[1:])))
                    slots = self._sms * self._k("gemv", f"srt_gemv_{dt}_t{nt}_{v}").blocks_per_sm(GEMV_WARPS * 32)
                    return blocks / (math.ceil(blocks / slots) * slots)

                best = max(cands, key=fill) if nt == 1 and len(cands) > 1 else cands[0]
            self._gemv_choice[key] = best
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

    def _rows(self, name: str, x: Tensor, D: int) -> int:
        if x.shape[-1] != D:
            raise ValueError(f"{name}: last dim {x.shape[-1]} != {D}")
        return x.numel() // D if D else 0

    def rmsnorm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        """x [..., D], w [D] -> w * (x * rsqrt(mean(x^2) + eps)) [..., D] fp32. A 2-D x is read
        with its row stride (kv_a's latent columns: no copy)."""
        x = as_rows(x, "rmsnorm.x", self.device) if x.dim() == 2 else as_act(x, "rmsnorm.x", self.device)
        w, wb = as_weight(w, "rmsnorm.w", self.device)
        D = w.numel()
        rows = self._rows("rmsnorm", x, D)
        out = self._empty(*x.shape)
        if rows:
            x_rs = x.stride(0) if x.dim() == 2 else D
            self._k("norms", "srt_rmsnorm")((rows,), (block_threads(D, 512),), [ptr(x), i64(x_rs), ptr(w), i32(wb), ptr(out), i32(D), f32(eps)],
                                            pdl=self.pdl)
        return out

    def gated_rmsnorm(self, o: Tensor, gate: Tensor, w: Tensor, eps: float) -> Tensor:
        """o, gate [..., V], w [V] -> rmsnorm(o) * w * sigmoid(gate) per row of V."""
        o = as_act(o, "gated_rmsnorm.o", self.device)
        gate = as_act(gate, "gated_rmsnorm.gate", self.device)
        if gate.shape != o.shape:
            raise ValueError(f"gated_rmsnorm: gate {tuple(gate.shape)} != o {tuple(o.shape)}")
        w, wb = as_weight(w, "gated_rmsnorm.w", self.device)
        V = w.numel()
        rows = self._rows("gated_rmsnorm", o, V)
        out = self._empty(*o.shape)
        if rows:
            self._k("norms", "srt_gated_rmsnorm")(
                (rows,), (block_threads(V, 256),), [ptr(o), ptr(gate), ptr(w), i32(wb), ptr(out), i32(V), f32(eps)], pdl=self.pdl
            )
        return out

    def layernorm(self, x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
        """x [..., D], w [D], b [D] -> (x - mean) * rsqrt(var + eps) * w + b."""
        x = as_act(x, "layernorm.x", self.device)
        w, wb = as_weight(w, "layernorm.w", self.device)
        b, bb = as_weight(b, "layernorm.b", self.device)
        if wb != bb:
            w, b, wb = w.float(), b.float(), 0
        D = w.numel()
        if b.numel() != D:
            raise ValueError(f"layernorm: w has {D} elements, b {b.numel()}")
        rows = self._rows("layernorm", x, D)
        out = self._empty(*x.shape)
        if rows:
            self._k("norms", "srt_layernorm")(
                (rows,), (block_threads(D, 512),), [ptr(x), ptr(w), ptr(b), i32(wb), ptr(out), i32(D), f32(eps)], pdl=self.pdl
            )
        return out

    def l2norm(self, x: Tensor, eps: float, scale: float = 1.0) -> Tensor:
        """x [..., D] -> (x * rsqrt(sum(x^2) + eps)) * scale over the last dim."""
        x = as_act(x, "l2norm.x", self.device)
        D = x.shape[-1]
        rows = x.numel() // D if D else 0
        out = self._empty(*x.shape)
        if rows:
            self._k("norms", "srt_l2norm")((rows,), (block_threads(D, 512),), [ptr(x), ptr(out), i32(D), f32(eps), f32(scale)], pdl=self.pdl)
        return out

    def sigmoid_mul(self, x: Tensor, gate: Tensor) -> Tensor:
        """x, gate [...] -> x * sigmoid(gate)."""
        return self._elementwise2("srt_sigmoid_mul", ("sigmoid_mul.x", x), ("sigmoid_mul.gate", gate))

    def situ_glu(self, gate: Tensor, up: Tensor, beta: float, linear_beta: float | None) -> Tensor:
        """gate, up [...] -> beta*tanh(gate/beta)*sigmoid(gate) * (linear_beta*tanh(up/linear_beta) or up)."""
        return self._elementwise2("srt_situ_glu", ("situ_glu.gate", gate), ("situ_glu.up", up), situ_args(beta, linear_beta))

    def _elementwise2(self, kernel: str, a: tuple[str, Tensor], b: tuple[str, Tensor], extra: list = ()) -> Tensor:
        """A grid-stride kernel of two (name, tensor) inputs of one shape: kernel(a, b, out, n, *extra)."""
        (an, a), (bn, b) = a, b
        a, b = as_act(a, an, self.device), as_act(b, bn, self.device)
        if a.shape != b.shape:
            raise ValueError(f"{an.split('.')[0]}: {an} {tuple(a.shape)} and {bn} {tuple(b.shape)} differ in shape")
        out = self._empty(*a.shape)
        n = a.numel()
        if n:
            self._k("norms", kernel)((min(math.ceil(n / 256), 8192),), (256,), [ptr(a), ptr(b), ptr(out), i64(n), *extra], pdl=self.pdl)
        return out

    # ---- KDA -----------------------------------------------------------------------------------

    def short_conv_step(self, z: Tensor, conv_state: Tensor, w: Tensor) -> Tensor:
        """z [T, P]; conv_state [T, P, W] rolled left + z written last (in place); w [P, W] (or
        [P, 1, W]) -> SiLU(sum_j state * w) [T, P]."""
        z = as_act(z, "short_conv_step.z", self.device)
        T, P = z.shape
        W = conv_state.shape[-1]
        buf = inplace_buf(conv_state, "short_conv_step.conv_state", self.device, (T, P, W))
        w, wb = as_weight(w.reshape(P, W), "short_conv_step.w", self.device)
        out = self._empty(*z.shape)
        if T * P:
            self._k("norms", "srt_short_conv_step")(
                (math.ceil(T * P / 256),), (256,), [ptr(z), ptr(buf), ptr(w), i32(wb), ptr(out), i32(T), i32(P), i32(W)], pdl=self.pdl
            )
            if buf is not conv_state:
                conv_state.copy_(buf)
        return out

    def kda_conv_step(self, zs: Sequence[Tensor], states: Sequence[Tensor], ws: Sequence[Tensor], K: int, eps: float,
                      q_scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """zs 3 x [T, H*K], states 3 x [T, H*K, W] (in place), ws 3 x [H*K, W] -> q, k (L2-normed per
        head, q * q_scale), v [T, H, K]: one launch."""
        dev = self.device
        if not len(zs) == len(states) == len(ws) == 3:
            raise ValueError("kda_conv_step: takes q, k and v (three of each)")
        zs = [as_act(z, f"kda_conv_step.z[{i}]", dev) for i, z in enumerate(zs)]
        T, P = zs[0].shape
        if P % K or any(z.shape != (T, P) for z in zs):
            raise ValueError(f"kda_conv_step: z {[tuple(z.shape) for z in zs]} must be 3 x [T, H*{K}]")
        W = states[0].shape[-1]
        bufs = [inplace_buf(st, f"kda_conv_step.state[{i}]", dev, (T, P, W)) for i, st in enumerate(states)]
        wts = [as_weight(w.reshape(P, W), f"kda_conv_step.w[{i}]", dev) for i, w in enumerate(ws)]
        outs = [self._empty(T, P // K, K) for _ in range(3)]
        table = np.zeros(14, dtype=np.uint64)  # KdaConvTab: z, state, w, out [3] u64, w_bf16 [3] int32 (padded)
        flags = table[12:].view(np.int32)
        for i in range(3):
            table[i], table[3 + i], table[6 + i], table[9 + i] = zs[i].data_ptr(), bufs[i].data_ptr(), wts[i][0].data_ptr(), outs[i].data_ptr()
            flags[i] = wts[i][1]
        if T * P:
            self._k("norms", "srt_kda_conv_step")(
                (T * (P // K), 3), (block_threads(K, 512),), [table.tobytes(), i32(P // K), i32(K), i32(W), f32(eps), f32(q_scale)], pdl=self.pdl)
            for buf, st in zip(bufs, states):
                if buf is not st:
                    st.copy_(buf)
        return outs[0], outs[1], outs[2]

    def kda_gates(self, f: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor, lower_bound: float) -> tuple[Tensor, Tensor]:
        """f [N, H, K], b [N, H], a_log [H], dt_bias [H*K] -> (g [N, H, K], beta [N, H]), one launch."""
        dev = self.device
        f, b = as_act(f, "kda_gates.f", dev), as_act(b, "kda_gates.b", dev)
        N, H, K = f.shape
        if b.shape != (N, H):
            raise ValueError(f"kda_gates: b {tuple(b.shape)} does not match f {tuple(f.shape)} (want [N, H])")
        a_log, ab = as_weight(a_log.reshape(-1), "kda_gates.a_log", dev)
        dt_bias, db = as_weight(dt_bias.reshape(-1), "kda_gates.dt_bias", dev)
        if a_log.numel() != H or dt_bias.numel() != H * K:
            raise ValueError(f"kda_gates: a_log has {a_log.numel()} entries (want H={H}), dt_bias {dt_bias.numel()} (want H*K={H * K})")
        g, beta = self._empty(N, H, K), self._empty(N, H)
        if N * H * K:
            self._k("norms", "srt_kda_gates")(
                (math.ceil(N * H * K / 256),), (256,),
                [ptr(f), ptr(b), ptr(a_log), i32(ab), ptr(dt_bias), i32(db), ptr(g), ptr(beta), i32(N), i32(H), i32(K), f32(lower_bound)], pdl=self.pdl)
        return g, beta

    def kda_step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
        """q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; state [T, H, K, V] fp32 (in place) -> o [T, H, V]."""
        dev = self.device
        q, k, g = (as_act(t, f"kda_step.{n}", dev) for t, n in ((q, "q"), (k, "k"), (g, "g")))
        v, beta = as_act(v, "kda_step.v", dev), as_act(beta, "kda_step.beta", dev)
        T, H, K = q.shape
        V = v.shape[-1]
        if k.shape != q.shape or g.shape != q.shape or v.shape != (T, H, V) or beta.shape != (T, H):
            raise ValueError(
                f"kda_step: shapes q {tuple(q.shape)} k {tuple(k.shape)} g {tuple(g.shape)} v {tuple(v.shape)} "
                f"beta {tuple(beta.shape)} do not agree"
            )
        if K > KDA_MAXK:
            raise ValueError(f"kda_step: head dim K={K} > {KDA_MAXK} (the kernel keeps a state column in registers)")
        buf = inplace_buf(state, "kda_step.state", dev, (T, H, K, V))
        out = self._empty(T, H, V, dtype=torch.float32)
        if T * H * V:
            self._k("kda", "srt_kda_step")(
                (math.ceil(V / 32), H, T), (32 * KDA_WARPS,),
                [ptr(q), ptr(k), ptr(v), ptr(g), ptr(beta), ptr(buf), ptr(out), i32(H), i32(K), i32(V)], pdl=self.pdl
            )
            if buf is not state:
                state.copy_(buf)
        return out

    # ---- MLA + indexer -------------------------------------------------------------------------

    def mla_decode(
        self, q_lat: Tensor, q_rot: Tensor, c_cache: Tensor, kr_cache: Tensor, scale: float, select: Tensor | None,
        length: Tensor | None = None,
    ) -> Tensor:
        """q_lat [B, H, R], q_rot [B, H, Dr], c_cache [B, n, R], kr_cache [B, n, Dr] (fp32 or bf16),
        select [B, m] positions or None -> softmax((q_lat.c + q_rot.kr) * scale) @ c  [B, H, R] fp32;
        one row may drop the leading B. length: int32 [B] on the device, the valid positions of
        each row (base.py); the grid is then sized for the capacity n (or m) and the kernels stop
        at the length (graph-capturable). Rows run side by side in one launch, each with its
        one-row bits."""
        dev = self.device
        q_lat, q_rot = as_act(q_lat, "mla_decode.q_lat", dev), as_rows(q_rot, "mla_decode.q_rot", dev)  # q_rot: a view of q
        one = q_lat.dim() == 2
        if one:
            q_lat, q_rot, c_cache, kr_cache = q_lat[None], q_rot[None], c_cache[None], kr_cache[None]
            select = None if select is None else select.reshape(1, -1)
        B, H, R = q_lat.shape
        Dr = q_rot.shape[-1]
        if (q_rot.dim() != 3 or q_rot.shape[:2] != (B, H) or c_cache.dim() != 3 or c_cache.shape[0] != B or c_cache.shape[-1] != R
                or kr_cache.shape[-1] != Dr or c_cache.shape[:2] != kr_cache.shape[:2]):
            raise ValueError(
                f"mla_decode: q_lat {tuple(q_lat.shape)} q_rot {tuple(q_rot.shape)} c {tuple(c_cache.shape)} "
                f"kr {tuple(kr_cache.shape)} do not agree"
            )
        if c_cache.dtype != kr_cache.dtype or c_cache.dtype not in (torch.float32, torch.bfloat16):
            c_cache, kr_cache = c_cache.float(), kr_cache.float()
        c_cache, kr_cache = c_cache.contiguous(), kr_cache.contiguous()
        cb = int(c_cache.dtype == torch.bfloat16)
        n = c_cache.shape[1]
        if select is not None:
            if select.device != dev:
                raise ValueError(f"mla_decode: select on {select.device}, expected {dev}")
            if select.dim() != 2 or select.shape[0] != B:
                raise ValueError(f"mla_decode: select {tuple(select.shape)} for {B} rows")
            select = select.to(torch.int64).contiguous()
            m = select.shape[1]
        else:
            m = n
        if m == 0:
            raise ValueError("mla_decode: no positions to attend to")
        length = self._lengths(length, B, "mla_decode")
        S = math.ceil(m / MLA_CHUNK)
        part_acc = self._empty(B, S, H, R, dtype=torch.float32)
        part_ml = self._empty(B, S, H, 2, dtype=torch.float32)
        out = self._empty(B, H, R, dtype=torch.float32)
        smem = MLA_HG * (R + Dr) * 4
        self._k("attention", "srt_mla_partial")(
            (S, math.ceil(H / MLA_HG), B), (MLA_THREADS,),
            [ptr(q_lat), ptr(q_rot), ptr(c_cache), ptr(kr_cache), i32(n), i32(cb), ptr(select), i32(m), ptr(length), i32(H),
             i32(R), i32(Dr), i64(q_rot.stride(0)), i64(q_rot.stride(1)), f32(scale), ptr(part_acc), ptr(part_ml)],
            smem=smem, pdl=self.pdl
        )
        self._k("attention", "srt_mla_combine")(
            (H, B), (block_threads(R, 256),), [ptr(part_acc), ptr(part_ml), ptr(out), i32(S), i32(H), i32(R), i32(m), ptr(length)], pdl=self.pdl)
        return out[0] if one else out

    def _lengths(self, length: Tensor | None, rows: int, what: str) -> Tensor | None:
        if length is not None and (length.device != self.device or length.dtype != torch.int32 or length.numel() != rows):
            raise ValueError(f"{what}: length must be {rows} int32 on {self.device} (one per row), "
                             f"got {length.dtype} {tuple(length.shape)} on {length.device}")
        return length

    def mla_absorb(self, q_nope: Tensor, w_uk: Tensor) -> Tensor:
        """q_nope [B, H, dn] (a view of q: read in place), w_uk [H, dn, R] (a view of kv_b_proj, bf16
        or fp32) -> q_lat [B, H, R] fp32."""
        q, (w, wb, hs) = as_rows(q_nope, "mla_absorb.q_nope", self.device), self._head_weight(w_uk, "mla_absorb.w_uk")
        B, H, dn = q.shape
        if w.shape[:2] != (H, dn):
            raise ValueError(f"mla_absorb: q_nope {tuple(q.shape)} and w_uk {tuple(w.shape)} do not agree")
        R = w.shape[2]
        out = self._empty(B, H, R, dtype=torch.float32)
        if B:
            self._k("attention", "srt_mla_absorb")(
                (math.ceil(R / 32), H), (256,), [ptr(q), i64(q.stride(0)), i64(q.stride(1)), ptr(w), i32(wb), i64(hs), ptr(out), i32(B), i32(H), i32(dn), i32(R)],
                pdl=self.pdl)
        return out

    def mla_expand(self, o_lat: Tensor, w_uv: Tensor) -> Tensor:
        """o_lat [B, H, R], w_uv [H, dv, R] (a view of kv_b_proj, bf16 or fp32) -> [B, H, dv] fp32."""
        x, (w, wb, hs) = as_act(o_lat, "mla_expand.o_lat", self.device), self._head_weight(w_uv, "mla_expand.w_uv")
        B, H, R = x.shape
        if w.shape[0] != H or w.shape[2] != R:
            raise ValueError(f"mla_expand: o_lat {tuple(x.shape)} and w_uv {tuple(w.shape)} do not agree")
        dv = w.shape[1]
        out = self._empty(B, H, dv, dtype=torch.float32)
        if B:
            self._k("attention", "srt_mla_expand")(
                (math.ceil(dv / 8), H), (256,), [ptr(x), ptr(w), i32(wb), i64(hs), ptr(out), i32(B), i32(H), i32(dv), i32(R)], pdl=self.pdl)
        return out

    def _head_weight(self, w: Tensor, name: str) -> tuple[Tensor, int, int]:
        """A per-head weight [H, rows, R]: (tensor, is_bf16, head stride); the heads may be strided
        (a slice of kv_b_proj), each head's rows must be dense."""
        if w.device != self.device or w.dim() != 3:
            raise ValueError(f"{name}: expected [H, rows, R] on {self.device}, got {tuple(w.shape)} on {w.device}")
        if w.dtype not in (torch.float32, torch.bfloat16) or w.stride(2) != 1 or w.stride(1) != w.shape[2]:
            w = w.float().contiguous()
        return w, int(w.dtype == torch.bfloat16), w.stride(0)

    def indexer_scores(self, q: Tensor, w: Tensor, k_cache: Tensor, length: Tensor | None = None, w_scale: float = 1.0) -> Tensor:
        """q [B, Hi, Di], w [B, Hi], k_cache [B, n, Di] (fp32 or bf16) -> I [B, n] =
        sum_h (w[h] * w_scale) relu(q[h].k[s]) fp32; one row may drop the leading B. length: int32
        [B] on the device (mla_decode's)."""
        dev = self.device
        q, w = as_act(q, "indexer_scores.q", dev), as_act(w, "indexer_scores.w", dev)
        one = q.dim() == 2
        if one:
            q, k_cache = q[None], k_cache[None]
        B, Hi, Di = q.shape
        if w.numel() != B * Hi or k_cache.dim() != 3 or k_cache.shape[0] != B or k_cache.shape[-1] != Di:
            raise ValueError(f"indexer_scores: q {tuple(q.shape)} w {tuple(w.shape)} k_cache {tuple(k_cache.shape)} do not agree")
        k_cache, kb = as_weight(k_cache, "indexer_scores.k_cache", dev)
        n = k_cache.shape[1]
        length = self._lengths(length, B, "indexer_scores")
        out = self._empty(B, n, dtype=torch.float32)
        if n and B:
            smem = (Hi * (Di + 1) + IDX_WARPS * Di) * 4
            self._k("attention", "srt_indexer_scores")(
                (math.ceil(n / (IDX_WARPS * IDX_PPW)), B), (IDX_WARPS * 32,),
                [ptr(q), ptr(w), ptr(k_cache), i32(kb), ptr(out), i32(n), ptr(length), i32(Hi), i32(Di), f32(w_scale)], smem=smem, pdl=self.pdl
            )
        return out[0] if one else out

    def select_topk(self, scores: Tensor, k: int, length: Tensor | None = None) -> Tensor:
        """Exact top-k positions with the tie rule: scores [n] (or [rows, n]) -> LongTensor [min(k, n)]
        (or [rows, min(k, n)]): positions above the threshold ascending, then the boundary group
        from the lowest position up. length int32 [rows]: row r of scores[r, :length[r]]; its first
        min(k, length[r]) entries are the result (base.py)."""
        s = as_act(scores, "select_topk.scores", self.device)
        one = s.dim() == 1
        if s.dim() not in (1, 2):
            raise ValueError(f"select_topk: scores must be 1-D or 2-D, got {tuple(s.shape)}")
        s2 = s.view(1, -1) if one else s
        rows, n = s2.shape
        kk = min(int(k), n)
        length = self._lengths(length, rows, "select_topk")
        out = self._empty(rows, max(kk, 0), dtype=torch.int64)
        if kk > 0 and rows:
            self._k("topk", "srt_select_topk")((rows,), (TOPK_THREADS,), [ptr(s2), ptr(out), i32(n), i32(kk), ptr(length)], pdl=self.pdl)
        return out[0] if one else out

    # Prefill attention on a cache: the torch reference (fixed query tiles x key blocks, online
    # softmax, gathered top-k; TorchBackend.mla_prefill) on this device until a kernel replaces it.
    def tiles(self, device) -> tuple[int, int, int]:
        return self._torch_attention.tiles(self.device)

    def mla_prefill(self, q_nope, q_rot, w_uk, w_uv, c_cache, kr_cache, start, scale, index=None):
        return self._torch_attention.mla_prefill(q_nope, q_rot, w_uk, w_uv, c_cache, kr_cache, start, scale, index)

    # ---- AttnRes -------------------------------------------------------------------------------

    def cache_append(self, dsts: Sequence[Tensor], srcs: Sequence[Tensor], lengths: Tensor) -> None:
        """dst [B, cap, W] fp32 (in place, contiguous), src [B, W], lengths int32 [B]: one launch."""
        dev = self.device
        if not 1 <= len(dsts) == len(srcs) <= 4:
            raise ValueError(f"cache_append: {len(dsts)} caches, {len(srcs)} rows (1..4 pairs)")
        B, cap = dsts[0].shape[:2]
        if lengths is None:
            raise ValueError("cache_append: lengths (int32 [B] on the device) is required")
        lengths = self._lengths(lengths, B, "cache_append")
        # rows read in place where they are fp32 with unit column stride (kr is a slice of kv)
        srcs = [v if v.dtype == torch.float32 and v.dim() == 2 and v.stride(1) == 1 and v.device == dev
                else as_act(v, "cache_append.src", dev) for v in srcs]
        table = np.zeros(12, dtype=np.uint64)  # CacheAppend: dst[4], src[4] u64, width[4], stride[4] int32
        width, stride = table[8:10].view(np.int32), table[10:].view(np.int32)
        for i, (d, v) in enumerate(zip(dsts, srcs)):
            if d.device != dev or d.dtype != torch.float32 or not d.is_contiguous() or d.shape[:2] != (B, cap) \
                    or v.shape != (B, d.shape[2]):
                raise ValueError(f"cache_append: cache {i} {d.dtype} {tuple(d.shape)} (contiguous fp32 [B, cap, W] on {dev}) "
                                 f"and row {tuple(v.shape)} do not fit")
            table[i], table[4 + i], width[i], stride[i] = d.data_ptr(), v.data_ptr(), d.shape[2], v.stride(0)
        if B:
            self._k("norms", "srt_cache_append")((B, len(dsts)), (256,), [table.tobytes(), ptr(lengths), i32(cap)], pdl=self.pdl)

    def attnres_mix(self, prefix: Tensor, blocks: Sequence[Tensor], norm_w: Tensor, proj_w: Tensor, eps: float,
                    out_w: Tensor | None = None, out_eps: float = 0.0) -> Tensor:
        """prefix [T, D], blocks nb x [T, D], norm_w, proj_w [D] -> sum_s softmax_s(rmsnorm(V_s) . wq) V_s
        [T, D] with sources V = (blocks..., prefix) read in place (a pointer table) and wq =
        norm_w * proj_w formed in the kernel; with out_w, then rmsnorm(., out_w, out_eps). Two
        kernels over ATTNRES_SLICE-wide slices of each row (kernels/norms.cu)."""
        dev = self.device
        srcs = [as_act(v, f"attnres_mix.{'prefix' if i == len(blocks) else f'blocks[{i}]'}", dev)
                for i, v in enumerate((*blocks, prefix))]
        T, D = srcs[-1].shape
        for i, v in enumerate(srcs[:-1]):
            if v.shape != (T, D):
                raise ValueError(f"attnres_mix: blocks[{i}] {tuple(v.shape)} vs prefix {(T, D)}")
        if len(srcs) > ATTNRES_MAXS:
            raise ValueError(f"attnres_mix: {len(srcs)} sources > {ATTNRES_MAXS}")
        norm_w, nb = as_weight(norm_w.reshape(-1), "attnres_mix.norm_w", dev)
        proj_w, pb = as_weight(proj_w.reshape(-1), "attnres_mix.proj_w", dev)
        if norm_w.numel() != D or proj_w.numel() != D:
            raise ValueError(f"attnres_mix: norm_w has {norm_w.numel()} entries, proj_w {proj_w.numel()}, want D={D}")
        ow = None if out_w is None else as_weight(out_w.reshape(-1), "attnres_mix.out_w", dev)[0]
        if ow is not None and ow.numel() != D:
            raise ValueError(f"attnres_mix: out_w has {ow.numel()} entries, want D={D}")
        table = b"".join([ptr(v) for v in srcs]).ljust(8 * ATTNRES_MAXS, b"\0")  # the sources' addresses, by value
        S, slices = len(srcs), math.ceil(D / ATTNRES_SLICE)
        out = self._empty(T, D, dtype=torch.float32)
        if T and D:
            stats = self._empty(T * S * slices * 2, dtype=torch.float32)
            grid = (T * slices,), (ATTNRES_SLICE,)
            self._k("norms", "srt_attnres_stats")(
                *grid, [table, i32(S), ptr(norm_w), i32(nb), ptr(proj_w), i32(pb), ptr(stats), i32(D)], pdl=self.pdl)
            self._k("norms", "srt_attnres_apply")(
                *grid, [table, i32(S), ptr(stats), ptr(out), i32(D), f32(eps)], pdl=self.pdl)
        return out if ow is None else self.rmsnorm(out, ow, out_eps)
