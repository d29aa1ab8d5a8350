"""The nvrtc backend's MoE ops: the router and the routed NVFP4 expert FFN.

`MoeOps` is a base of `NvrtcBackend` (it uses the backend's `device`, `_k`, `_empty`, `linear`
and the expert-FFN settings `nvfp4_impl`, `tc_shape`, `tc_shape_batch`, `tc_staged_shape`, `tc_rows`,
`tc_phase_blocks`, `pdl`, `pair_ready`, `grouped_prefill` the backend sets; `prefill_rows` is its
own). Decode runs the NVFP4 kernels over (row, expert) pairs, a tensor-core block taking up to
`TC_TOKENS` pairs of one expert (one weight read for them; each row's bits its own:
batch-invariant); from `TC_BATCH_ROWS` rows on, up to `TC_ROWS16` from rows staged once per call
(`tc_staged_shape`), or with `tc_rows = 16` staged by each block in phases; the prefill view
(`for_prefill`) runs grouped GEMMs per expert (`nvfp4_gemm.py`).
Per launch up to `MOE_MAXP` (row, expert) pairs, their pointers in by-value tables, or in a
CUDA graph up to `MOE_MAXP_DT` in tables built on the GPU (`expert_pointers.py`); the kernels:
`kernels/nvfp4_moe.cu`. Measurements behind `TC_SHAPE`: `profiling/RESULTS.md`
(bench_kernels.py --variants).
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import Tensor

from streamrt.backends.cuda_driver import SMEM_DEFAULT
from streamrt.backends.expert_pointers import down_table_bytes, gate_up_table_bytes, scales_aligned8, tables
from streamrt.backends.kernel_defines import (
    MOE_MAXP,
    MOE_MAXP_DT,
    MOE_WARPS,
    ROUTER_THREADS,
    TC_ROWS16,
    TC_SBYTES,
    TC_STAGED_DOWN_THREADS,
    TC_STAGED_THREADS,
    TC_TOKENS,
    TC_WBYTES,
    TC_XSTRIDE,
)
from streamrt.backends.nvfp4_gemm import PREFILL_ROWS, TORCH_FP16, grouped_expert_pairs
from streamrt.backends.nvrtc_args import aligned, as_act, as_weight, f32, i32, ptr, situ_args
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix, ResidentExperts, RoutedExperts, as_routed
from streamrt.ops import route, sigmoid

# Tensor-core NVFP4 kernels: warps per block (gate+up, down), cp.async stages per warp, 128-column
# blocks per stage; entry points exist for TC_PIPES. Every shape gives the same bits. Seven down
# warps make 16 x 16 = 256 blocks at the slice layer (16 experts, T=1), which fit the 264
# two-per-SM slots of an H200 in one wave.
TC_SHAPE = (8, 7, 2, 2)
# Once a block takes TC_BATCH_ROWS rows of an expert, their staged activation leaves shared
# memory for one block an SM: 16 warps sharing it (a one-stage ring each) keep four warps a
# scheduler to hide the decode's latencies, where 8 keep two. H200, deep-k3.1-pro's expert
# shape, 16 of 24 experts a row (RESULTS.md §23): at T=16 0.86-0.89x the time of TC_SHAPE, and
# B=16 decode 0.92x; at T=4 1.03x, at T=1 1.45x (TC_SHAPE's two blocks an SM keep more bytes in
# flight).
TC_SHAPE_BATCH = (16, 14, 2, 1)
TC_BATCH_ROWS = 8
# From TC_BATCH_ROWS rows on, gate+up reads its activation from rows staged once per call
# (srt_moe_stage_rows) instead of a copy in each block: a block takes up to TC_ROWS16 rows of an
# expert (one decode of its weights for them), its shared memory holds only the weight rings.
# (gate+up warps, down warps, stages, blocks per stage). Down warps 0: the down kernel keeps
# TC_SHAPE_BATCH's blocks of 8 that stage their own rows of h; else h's rows are staged too, once
# the gate+up grid is done, and down blocks take gate+up's groups. H200, deep-k3.1-pro's expert
# shape, T=16 x 16 of 24 experts (RESULTS.md §24): 0.72-0.75x the time of TC_SHAPE_BATCH's
# blocks; 8 gate+up warps take 1.15x the time of 12, 4 or 8 down warps the same; B=16 decode 0.81x.
TC_STAGED_SHAPE = (12, 4, 2, 1)
TC_STAGED_PIPES = ((2, 1), (4, 1), (6, 1))
TC_PIPES = ((2, 2), (3, 2), (4, 1), (2, 1))
TC_STAGE_SMEM = TC_WBYTES + TC_SBYTES  # one 128-column block of one warp
# "tc": tensor cores where the shape allows (in % 128 == 0), else CUDA cores; "cuda_core": always
NVFP4_IMPLS = ("tc", "cuda_core")


TC16_PIPE = (2, 2)  # the 16-row blocks' one pipeline shape (stages, blocks per stage)
TC16_MAX_WARPS = 8  # their accumulators take more than 128 registers a thread: 256 threads a block
TC16_STATIC_SMEM = (32 + 2) * TC_ROWS16 * 4  # their static shared memory: the row max reduction, scales


def most_groups(pairs: int, experts: int, cap: int) -> int:
    """The most groups `pairs` (row, expert) pairs of up to `experts` experts make when each
    expert's run is cut into groups of up to `cap`: sum_e ceil(n_e / cap) <= sum_e ((n_e - 1) //
    cap + 1), largest with the most experts present, each but one holding a single pair."""
    present = min(experts, pairs)
    return present + (pairs - present) // cap


def tc_smem(in_features: int, warps: int, stages: int, blocks: int, rows: int = 1) -> int:
    """Dynamic shared memory of a tensor-core NVFP4 block that takes up to `rows` pairs of one
    expert: each row's staged activation (fp16 hi + lo arrays of `tc_xwords` u32 words, as
    kernels/nvfp4_moe.cu lays them out) and each warp's cp.async ring."""
    words = in_features // 32 * TC_XSTRIDE
    words += 16 if words % 32 == 0 else 0  # tc_xwords' padding: a multiple of 16, not of 32
    return rows * 8 * words + warps * stages * blocks * TC_STAGE_SMEM


def tc16_phase_blocks(in_features: int, warps: int, rows: int, smem_limit: int, forced: int | None = None) -> int | None:
    """Column blocks per phase of a 16-row block over `in_features` columns: the fewest phases
    whose staged rows and ring fit `smem_limit` (a phase other than the last a whole number of
    stages), or `forced` (ValueError if it does not fit); None if not even one stage's columns fit."""
    nkb = in_features // 128
    _, kbs = TC16_PIPE
    smem = lambda kbp: tc_smem(kbp * 128, warps, *TC16_PIPE, rows) + TC16_STATIC_SMEM  # noqa: E731
    fits = lambda kbp: smem(kbp) <= smem_limit  # noqa: E731
    if forced is not None:
        if forced < kbs or forced % kbs:
            raise ValueError(f"tc_phase_blocks {forced}: a positive multiple of {kbs} column blocks")
        if not fits(min(forced, nkb)):  # said, not a quiet fall back to the 8-row blocks
            raise ValueError(f"tc_phase_blocks {forced}: {rows} rows of {min(forced, nkb)} column blocks need "
                             f"{smem(min(forced, nkb))} B of shared memory, over the block's {smem_limit}")
        return min(forced, nkb)
    for phases in range(1, nkb + 1):
        per = -(-nkb // phases)  # ceil(nkb / phases)
        kbp = nkb if phases == 1 else -(-per // kbs) * kbs  # whole stages
        if fits(kbp):
            return kbp
    return None


def router_smem_bytes(experts: int) -> int:
    """Dynamic shared memory of srt_router_topk (kernels/topk.cu): per expert its score, key and
    candidate slot, per chunk of 32 its maximum key."""
    return experts * 12 + (experts + 31) // 32 * 4


class MoeOps:
    """The router and expert FFN of `NvrtcBackend` (see the module doc)."""

    prefill_rows = PREFILL_ROWS[0]  # the grouped prefill GEMMs' row mode: "fp16" or "split" (nvfp4_gemm.py)
    # A prefill chunk takes the grouped GEMMs only with at least this many (row, expert) pairs per
    # routed expert: each expert costs a weight expansion and about six launches there, against a
    # per-pair weight read on the decode kernels. One deep-k3.1-pro layer on the H200
    # (bench_prefill_experts.py, 2026-12-02): 32 pairs per expert 8.6 ms grouped against 4.3 ms
    # per-pair, 85 pairs 8.7 against 10.8.
    grouped_min_pairs = 64
    _ready_outgrown: list  # earlier, smaller `ready` sets (the backend sets it)

    def _ready_counts(self, n: int) -> Tensor:
        """Per pair of an expert-FFN call, how many gate+up blocks are done (the down kernel's
        blocks wait on their pair's count). Zero between calls: the weighted sum zeroes them.
        One set per backend: calls on one stream (the runtime's compute stream)."""
        if self._ready is None or self._ready.numel() < n:
            if self._ready is not None:  # a captured CUDA graph may point at it: kept, not freed
                self._ready_outgrown.append(self._ready)
            self._ready = torch.zeros(max(n, 1024), dtype=torch.int32, device=self.device)
        return self._ready

    def route(
        self,
        logits: Tensor,
        bias: Tensor,
        k: int,
        renormalize: bool,
        scale: float,
        n_group: int = 1,
        topk_group: int = 1,
    ) -> tuple[Tensor, Tensor]:
        """logits [T, E] fp32, bias [E] -> (ids [T, k] int64 by descending s + bias, ties to the
        lower id; weights [T, k] fp32 = sigmoid scores, renormalised (+1e-20), * scale)."""
        logits = as_act(logits, "route.logits", self.device)
        if logits.dim() != 2:
            raise ValueError(f"route: logits must be [T, E], got {tuple(logits.shape)}")
        T, E = logits.shape
        if n_group > 1 and topk_group < n_group:  # group-limited routing: no kernel, the shared definition
            return route(sigmoid(logits), bias, k, renormalize, scale, n_group, topk_group)
        if not 1 <= k <= min(E, 256):
            raise ValueError(f"route: k={k} must be in 1..min(E={E}, 256)")
        bias, bb = as_weight(bias.reshape(-1), "route.bias", self.device)
        if bias.numel() != E:
            raise ValueError(f"route: bias has {bias.numel()} entries, logits {E} experts")
        if router_smem_bytes(E) > SMEM_DEFAULT:
            raise ValueError(f"route: E={E} experts need {router_smem_bytes(E)} bytes of the router kernel's shared memory, "
                             f"over its {SMEM_DEFAULT} (at most 4053 experts)")
        ids = self._empty(T, k, dtype=torch.int64)
        wts = self._empty(T, k, dtype=torch.float32)
        if T:
            self._k("topk", "srt_router_topk")(
                (T,), (ROUTER_THREADS,),
                [ptr(logits), ptr(bias), i32(bb), ptr(ids), ptr(wts), i32(E), i32(k), i32(bool(renormalize)), f32(scale)],
                smem=router_smem_bytes(E), pdl=self.pdl
            )
        return ids, wts

    def expert_ffn(
        self,
        z: Tensor,
        ids: Tensor,
        weights: Tensor,
        experts: RoutedExperts | Mapping[int, ExpertWeights],
        beta: float,
        linear_beta: float | None,
    ) -> Tensor:
        """Routed NVFP4 experts straight from their device slots: z [T, Dl] fp32, ids / weights
        [T, k] -> out[t] = sum_j (j ascending) weights[t, j] * down(situ_glu(gate z_t, up z_t)) [T, Dl].

        Per launch up to 64 (t, j) pairs (all of one token's experts at decode): gate+up+SiTU
        into h [T*k, I], down into y [T*k, Dl], then a fixed-order weighted sum. `ids` may live on
        the host (no sync; CUDA-graph capturable) or on the device (one sync for the ids);
        `experts` is RoutedExperts (the model's) or a plain {id: ExpertWeights}.
        """
        dev = self.device
        z = as_act(z, "expert_ffn.z", dev)
        if not aligned(z, 16):
            z = z.clone()
        T, Dl = z.shape
        if ids.shape[0] != T or weights.shape != ids.shape:
            raise ValueError(f"expert_ffn: z {tuple(z.shape)}, ids {tuple(ids.shape)}, weights {tuple(weights.shape)} do not agree")
        k = ids.shape[1]
        w = as_act(weights, "expert_ffn.weights", dev)
        if isinstance(experts, ResidentExperts) and ids is experts.ids and not self.grouped_prefill:
            return self._expert_ffn_table(z, experts, w, beta, linear_beta)
        experts = as_routed(experts, ids)
        missing = experts.missing()
        if missing:
            raise KeyError(f"expert_ffn: experts {missing} were routed to but not provided")
        # Experts whose copy is still in flight (a streamed layer) go last: the compute stream
        # waits for their events only after the resident ones are queued (overlap within the layer).
        late = {e for e in experts.unique if experts.pending(e)}
        P = T * k
        out = self._empty(T, Dl, dtype=torch.float32)
        if P == 0:
            return out.zero_()
        if self.grouped_prefill and P >= self.grouped_min_pairs * len(experts.unique):
            # a prefill chunk with many rows per expert: one GEMM per expert and matrix (nvfp4_gemm.py)
            y = grouped_expert_pairs(z, experts.host_ids, experts, beta, linear_beta, late, conv=self,
                                     rows=self.prefill_rows)
            self._combine(y, w, out, T, k, Dl, None)
            return out
        staged = self._staged_rows(z) if self._takes_staged(T) else None
        id_rows = experts.host_ids.tolist()
        pairs = [(p, t, e) for t, row in enumerate(id_rows) for p, e in enumerate(row, start=t * k)]
        # by expert within each group, as srt_moe_tables orders them (a batch's pairs of one expert
        # adjacent; a pair's bits do not depend on its place)
        groups = [sorted((q for q in pairs if (q[2] in late) == is_late), key=lambda q: (q[2], q[0]))
                  for is_late in (False, True)]
        ptrs, I = {}, None
        act = situ_args(beta, linear_beta)
        h = y = None
        # Per-pair gate+up counts for the tensor-core kernels; the sum zeroes them for the next
        # call with its first T * k threads of T * Dl (k <= Dl).
        ready = self._ready_counts(P) if self.pair_ready and k <= Dl else None
        try:
            for late_group, group in enumerate(groups):
                if not group:
                    continue
                for e in sorted({q[2] for q in group}):  # taking a late expert queues its event wait
                    ptrs[e] = self._ptr_cache.get(experts.take(e), e, Dl)
                    if I is None:
                        I = ptrs[e].inter
                    elif ptrs[e].inter != I:
                        raise ValueError(f"expert_ffn: expert {e} has intermediate size {ptrs[e].inter}, another has {I}")
                if h is None:
                    h, y = self._empty(P, I, dtype=torch.float32), self._empty(P, Dl, dtype=torch.float32)
                for c0 in range(0, len(group), MOE_MAXP):
                    chunk = group[c0 : c0 + MOE_MAXP]
                    self._launch_experts(chunk, ptrs, z, h, y, I, Dl, act, ready, T, staged,
                                         pdl_gateup=not late_group)
        except BaseException:
            if ready is not None:  # the sum that zeroes the counts will not run (queued after any launch made)
                ready.zero_()
            raise
        self._combine(y, w, out, T, k, Dl, ready)
        return out

    def _expert_ffn_table(self, z: Tensor, experts: ResidentExperts, w: Tensor, beta: float,
                          linear_beta: float | None) -> Tensor:
        """expert_ffn with the pairs' pointers gathered on the GPU from the layer's table
        (`srt_moe_tables`): nothing on this path reads the ids on the host, so it is captured in
        a CUDA graph once and replays for any routing. One launch takes up to `MOE_MAXP_DT` pairs
        (the host path: `MOE_MAXP`), so a batch's rows of one expert share its weight reads; a
        pair's bits do not depend on its launch or group: the host path's bits."""
        ids = experts.ids.contiguous()
        if ids.device != self.device or ids.dtype != torch.int64:
            raise ValueError(f"expert_ffn: device ids must be int64 on {self.device}, got {ids.dtype} on {ids.device}")
        (T, Dl), k, I = z.shape, ids.shape[1], experts.inter
        P = T * k
        out = self._empty(T, Dl, dtype=torch.float32)
        if P == 0:
            return out.zero_()
        chunks = math.ceil(P / MOE_MAXP_DT)
        staged = self._staged_rows(z) if self._takes_staged(T) else None  # before the tables: see below
        tc = self.nvfp4_impl == "tc" and Dl % 128 == 0 and I % 128 == 0 and experts.tensor_core
        gtab = self._empty(chunks, gate_up_table_bytes(MOE_MAXP_DT), dtype=torch.uint8)
        dtab = self._empty(chunks, down_table_bytes(MOE_MAXP_DT), dtype=torch.uint8)
        # The staged blocks take their groups from a list (a block row per group there can be);
        # the others a block row per pair, the pairs that lead no group exiting at once.
        groups = self._empty(chunks, MOE_MAXP_DT + 2, dtype=torch.int32) if tc and staged is not None else None
        threads = MOE_MAXP_DT if groups is not None else min(1024, 32 * math.ceil(P / 32))
        self._k("nvfp4_moe", "srt_moe_tables")(
            (1,), (threads,),
            [ptr(ids), ptr(experts.table), i32(P), i32(k), ptr(gtab), ptr(dtab), i32(TC_ROWS16), ptr(groups)])
        h, y = self._empty(P, I, dtype=torch.float32), self._empty(P, Dl, dtype=torch.float32)
        ready = self._ready_counts(P) if self.pair_ready and k <= Dl else None
        act = situ_args(beta, linear_beta)
        for c in range(chunks):
            n = min(MOE_MAXP_DT, P - c * MOE_MAXP_DT)
            g, d = ptr(gtab[c]), ptr(dtab[c])
            chunk_groups = None if groups is None else (groups[c], most_groups(n, experts.table.shape[0], TC_ROWS16))
            # the gate+up kernel reads its table before pdl_wait(), and the table is the kernel
            # before's output here: a plain launch (the down kernel and the sum stay programmatic)
            self._launch_pairs(g, d, n, z, h, y, I, Dl, act, ready, tc, T, staged, pdl_gateup=False, suffix="_dt",
                               groups=chunk_groups)
        self._combine(y, w, out, T, k, Dl, ready)
        return out

    # ---- the grouped prefill GEMM's conversions (kernels/nvfp4_gemm.cu; TorchFp16's contract) ----

    def fp16_weights(self, *mats: NVFP4Matrix) -> Tensor:
        in2 = mats[0].packed.shape[1]
        if not all(m.packed.shape[1] == in2 and m.packed.is_contiguous() and m.scales.is_contiguous()
                   and aligned(m.packed, 4) for m in mats) or in2 % 8 or len(mats) > 2:
            return TORCH_FP16.fp16_weights(*mats)
        m0, m1 = mats[0], mats[-1]
        rows = sum(m.packed.shape[0] for m in mats)
        w16 = self._empty(rows, in2 * 2, dtype=torch.float16)
        words0, words = m0.packed.numel() // 4, rows * in2 // 4
        self._k("nvfp4_gemm", "srt_nvfp4_to_f16")(
            (min(math.ceil(words / 256), 8192),), (256,),
            [ptr(m0.packed), ptr(m0.scales), ptr(m1.packed), ptr(m1.scales), ptr(w16), i32(words0 if len(mats) > 1 else words),
             i32(words), i32(in2 // 4)])
        return w16

    def fp16_rows(self, x: Tensor, split: bool) -> tuple[Tensor, Tensor]:
        x = x.contiguous()
        n, cols = x.shape
        rows = self._empty((1 + split) * n, cols, dtype=torch.float16)
        scale = self._empty(n, dtype=torch.float32)
        if n:
            self._k("nvfp4_gemm", "srt_f16_rows")((n,), (256,), [ptr(x), ptr(rows), ptr(scale), i32(n), i32(cols), i32(split)])
        return rows, scale

    def situ_rows(self, gu: Tensor, xscale: Tensor, gate_glob: Tensor, up_glob: Tensor, beta: float,
                  linear_beta: float | None, split: bool) -> tuple[Tensor, Tensor]:
        m, I = xscale.shape[0], gate_glob.shape[0]
        gu, xscale = gu.contiguous(), xscale.contiguous()
        gate_glob, up_glob = gate_glob.float().contiguous(), up_glob.float().contiguous()
        rows = self._empty((1 + split) * m, I, dtype=torch.float16)
        hscale = self._empty(m, dtype=torch.float32)
        if m:
            self._k("nvfp4_gemm", "srt_situ_f16_rows")(
                (m,), (256,),
                [ptr(gu), ptr(xscale), ptr(gate_glob), ptr(up_glob), ptr(rows), ptr(hscale), i32(m), i32(I), i32(split),
                 *situ_args(beta, linear_beta)],
                smem=I * 4)
        return rows, hscale

    def scatter_rows(self, d: Tensor, hscale: Tensor, glob: Tensor, pairs: Tensor, y: Tensor, split: bool) -> None:
        m, cols = pairs.shape[0], y.shape[1]
        d, hscale, glob, pairs = d.contiguous(), hscale.contiguous(), glob.float().contiguous(), pairs.contiguous()
        if m:
            self._k("nvfp4_gemm", "srt_scatter_rows")(
                (m,), (256,), [ptr(d), ptr(hscale), ptr(glob), ptr(pairs), ptr(y), i32(m), i32(cols), i32(split)])

    def _combine(self, y: Tensor, w: Tensor, out: Tensor, T: int, k: int, Dl: int, ready: Tensor | None) -> None:
        """out[t] = sum_j (j ascending) w[t, j] * y[t*k + j] (and the pair counts zeroed)."""
        n = T * Dl
        self._k("nvfp4_moe", "srt_moe_combine")(
            (min(math.ceil(n / 256), 4096),), (256,),
            [ptr(y), ptr(w), ptr(out), i32(T), i32(k), i32(Dl), ptr(ready)],
            pdl=self.pdl,  # only y is the kernel before's output: read after pdl_wait()
        )

    def _takes_staged(self, T: int) -> bool:
        """Whether a T-row call's gate+up reads rows staged once per call (TC_STAGED_SHAPE)."""
        return self.nvfp4_impl == "tc" and self.tc_staged_shape is not None and T >= TC_BATCH_ROWS

    def _staged_rows(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """z [T, Dl] as the staged gate+up blocks read it (srt_moe_stage_rows): per row its
        prescaled fp16 hi / lo words [T + 1, Dl] (row T zeros) and its unscale [T + 1]. A
        programmatic launch: z is read after pdl_wait(). Where Dl % 128 != 0 (the CUDA-core
        kernels) the launch is skipped and the buffers go unused."""
        T, Dl = z.shape
        xs = self._empty(T + 1, Dl, dtype=torch.int32)
        unscale = self._empty(T + 1, dtype=torch.float32)
        if Dl % 128 == 0:
            self._k("nvfp4_moe", "srt_moe_stage_rows")(
                (T + 1,), (256,), [ptr(z), i32(T), i32(Dl), ptr(xs), ptr(unscale)], pdl=self.pdl)
        return xs, unscale

    def _launch_experts(self, chunk, ptrs, z, h, y, I, Dl, act, ready, T, staged, pdl_gateup) -> None:
        """gate+up+SiTU into h and down into y for up to 64 pairs, their tables by value."""
        gtab, dtab = (t.tobytes() for t in tables(chunk, ptrs))
        # (slot sections are 4096-byte aligned, so every chunk of a layer takes the same kernels)
        tc = self.nvfp4_impl == "tc" and Dl % 128 == 0 and I % 128 == 0 and scales_aligned8(chunk, ptrs)
        self._launch_pairs(gtab, dtab, len(chunk), z, h, y, I, Dl, act, ready, tc, T, staged, pdl_gateup)

    def _launch_pairs(self, gtab, dtab, np_, z, h, y, I, Dl, act, ready, tc, T, staged, pdl_gateup, suffix="",
                      groups=None) -> None:
        """The gate+up and down kernels for np_ pairs of a T-row call: tables by value (the
        struct bytes), or `suffix="_dt"` and pointers to tables in device memory. A tensor-core
        block takes up to min(TC_TOKENS, T) pairs of one expert (an expert has at most one pair
        per row; min(TC_ROWS16, T) in the 16-row blocks, `_tc16_phases`; TC_ROWS16 in the staged
        gate+up blocks, given `staged` = `_staged_rows(z)`) and counts into `ready`; the
        CUDA-core kernels take one pair per block and leave `ready` alone. `groups`: see
        `_launch_staged`."""
        if tc and staged is not None:
            self._launch_staged(gtab, dtab, np_, staged, h, y, I, Dl, act, ready, T, pdl_gateup, suffix, groups)
            return
        hp, yp = ptr(h), ptr(y)
        if tc:
            phases = self._tc16_phases(I, Dl, T)
            batch = phases is None and min(TC_TOKENS, T) >= TC_BATCH_ROWS
            # 16 rows per warp (gate+up tiles), 32 rows per warp (down)
            tg, td, st, kbs = self._tc_shape("tc_shape_batch" if batch else "tc_shape")
            if phases is not None:  # 16-row blocks: phases of column blocks, one more argument each
                kernel, cap, (kbp_gu, kbp_dn) = "r16", min(TC_ROWS16, T), phases
                gu_in, dn_in, gu_extra, dn_extra = kbp_gu * 128, kbp_dn * 128, [i32(kbp_gu)], [i32(kbp_dn)]
            else:
                kernel, cap = f"tc{st}x{kbs}", min(TC_TOKENS, T)
                gu_in, dn_in, gu_extra, dn_extra = Dl, I, [], []
            gu_blocks = math.ceil(I / (16 * tg))
            self._k("nvfp4_moe", f"srt_nvfp4_gateup_{kernel}{suffix}")(
                (gu_blocks, np_), (tg * 32,), [gtab, ptr(z), hp, i32(I), i32(Dl), *act, ptr(ready), i32(cap), *gu_extra],
                smem=tc_smem(gu_in, tg, st, kbs, cap),
                # programmatic: reads z after pdl_wait(); before it only weights, and only of
                # resident experts (a late expert's copy is waited for by an event before this)
                pdl=self.pdl and pdl_gateup)
            self._k("nvfp4_moe", f"srt_nvfp4_down_{kernel}{suffix}")(
                (math.ceil(Dl / (32 * td)), np_), (td * 32,),
                [dtab, hp, yp, i32(Dl), i32(I), ptr(ready), i32(gu_blocks), i32(cap), i32(cap), *dn_extra],
                smem=tc_smem(dn_in, td, st, kbs, cap), pdl=self.pdl)
            return
        self._k("nvfp4_moe", f"srt_nvfp4_gateup{suffix}")(
            (math.ceil(I / (MOE_WARPS * 2)), np_), (MOE_WARPS * 32,),
            [gtab, ptr(z), hp, i32(I), i32(Dl), *act], smem=Dl * 4)
        self._k("nvfp4_moe", f"srt_nvfp4_down{suffix}")(
            (math.ceil(Dl / (MOE_WARPS * 4)), np_), (MOE_WARPS * 32,), [dtab, hp, yp, i32(Dl), i32(I)], smem=I * 4)

    def _tc_shape(self, setting: str) -> tuple[int, int, int, int]:
        """The backend's `tc_shape` or `tc_shape_batch` (gate+up warps, down warps, stages, blocks
        per stage), checked against the kernels there are (TC_PIPES)."""
        tg, td, st, kbs = getattr(self, setting)
        if not (1 <= tg <= 16 and 1 <= td <= 16 and (st, kbs) in TC_PIPES):
            raise ValueError(f"{setting} {(tg, td, st, kbs)}: warps 1..16, (stages, blocks) one of {TC_PIPES}")
        return tg, td, st, kbs

    def _launch_staged(self, gtab, dtab, np_, staged, h, y, I, Dl, act, ready, T, pdl_gateup, suffix,
                       groups=None) -> None:
        """_launch_pairs' staged gate+up (groups of up to TC_ROWS16 pairs, `tc_staged_shape`),
        then either h's rows staged (all of them: on the host tables each chunk of pairs stages
        them again, as it has written its own) and the staged down kernel over gate+up's groups,
        or (down warps 0) the down kernel of `tc_shape_batch`: groups of up to TC_TOKENS, each
        inside one gate+up group (TC_ROWS16 is a multiple of TC_TOKENS), whose blocks wait on it.
        `groups` (the device tables'): srt_moe_tables' list of groups and the most it can hold; a
        block row of the staged kernels takes a group of the list (else the group a pair leads)."""
        gw, dw, st, kbs = self.tc_staged_shape
        if not (1 <= gw <= TC_STAGED_THREADS // 32 and 0 <= dw <= TC_STAGED_DOWN_THREADS // 32
                and (st, kbs) in TC_STAGED_PIPES):
            raise ValueError(f"tc_staged_shape {self.tc_staged_shape}: gate+up warps 1..{TC_STAGED_THREADS // 32}, "
                             f"down warps 0..{TC_STAGED_DOWN_THREADS // 32}, (stages, blocks) one of {TC_STAGED_PIPES}")
        _, td, st_d, kbs_d = self._tc_shape("tc_shape_batch") if dw == 0 else self.tc_shape_batch
        xs, unscale = staged
        cap, cap_gu = min(TC_TOKENS, T), TC_ROWS16
        gu_blocks = math.ceil(I / (16 * gw))
        # the device tables' kernels take their groups from a list: a block row per group there can be
        rows, listed = (np_, []) if groups is None else (groups[1], [ptr(groups[0])])
        if dw:
            ready = None  # the down kernel reads h staged after the whole gate+up grid
        self._k("nvfp4_moe", f"srt_nvfp4_gateup_st{st}x{kbs}{suffix}")(
            (gu_blocks, rows), (gw * 32,),
            [gtab, ptr(xs), ptr(unscale), i32(T), ptr(h), i32(I), i32(Dl), *act, ptr(ready), i32(cap_gu), *listed],
            smem=gw * st * kbs * TC_STAGE_SMEM, pdl=self.pdl and pdl_gateup)
        if dw:
            hs, h_unscale = self._staged_rows(h)  # every row of h (P): the zero row is P
            self._k("nvfp4_moe", f"srt_nvfp4_down_st{st}x{kbs}{suffix}")(
                (math.ceil(Dl / (32 * dw)), rows), (dw * 32,),
                [dtab, ptr(hs), ptr(h_unscale), i32(h.shape[0]), ptr(y), i32(Dl), i32(I), i32(cap_gu), *listed],
                smem=dw * st * kbs * TC_STAGE_SMEM, pdl=self.pdl)
            return
        self._k("nvfp4_moe", f"srt_nvfp4_down_tc{st_d}x{kbs_d}{suffix}")(
            (math.ceil(Dl / (32 * td)), np_), (td * 32,),
            [dtab, ptr(h), ptr(y), i32(Dl), i32(I), ptr(ready), i32(gu_blocks), i32(cap), i32(cap_gu)],
            smem=tc_smem(I, td, st_d, kbs_d, cap), pdl=self.pdl)

    def _tc16_phases(self, I: int, Dl: int, T: int) -> tuple[int, int] | None:
        """Column blocks per phase of the 16-row gate+up and down blocks (a group takes up to
        min(TC_ROWS16, T) pairs of one expert), for a call of more than TC_TOKENS rows where
        `tc_rows` asks for them and the shape allows them; None: the 8-row blocks (the same bits)."""
        tg, td, st, kbs = self.tc_shape
        if self.tc_rows != TC_ROWS16 or T <= TC_TOKENS or max(tg, td) > TC16_MAX_WARPS or (st, kbs) != TC16_PIPE:
            return None
        cap = min(TC_ROWS16, T)
        kbp_gu = tc16_phase_blocks(Dl, tg, cap, self._smem_optin, self.tc_phase_blocks)
        kbp_dn = tc16_phase_blocks(I, td, cap, self._smem_optin, self.tc_phase_blocks)
        return None if kbp_gu is None or kbp_dn is None else (kbp_gu, kbp_dn)
