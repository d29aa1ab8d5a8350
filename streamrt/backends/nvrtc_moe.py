"""The nvrtc backend's MoE ops: the router and the routed NVFP4 expert FFN.

Decode runs the NVFP4 kernels (`kernels/nvfp4_moe.cu`) over (row, expert) pairs. Below
`TC_STAGED_MIN_ROWS` rows a tensor-core block takes up to `TC_TOKENS` pairs of one expert and
stages their activation itself (one weight read for them; each row's bits its own:
batch-invariant); from there on gate+up reads rows staged once per call and a block takes up to
`TC_STAGED_ROWS` pairs. Shapes the tensor-core kernels do not take (a width not a multiple of
128, unaligned scale rows) run the CUDA-core kernels, one pair a block; the same bits. The
prefill view (`for_prefill`) runs grouped GEMMs per expert (`nvfp4_gemm.py`).
Per launch up to `MOE_MAXP` pairs, their pointers in by-value tables, or in a CUDA graph up to
`MOE_MAXP_DT` in tables built on the GPU (`expert_pointers.py`). Measurements behind the block
shapes: `profiling/RESULTS.md` (bench_kernels.py).
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import Tensor

from streamrt.backends.cuda_driver import SMEM_DEFAULT
from streamrt.backends.expert_pointers import (
    ExpertPointerCache,
    down_table_bytes,
    gate_up_table_bytes,
    scales_aligned8,
    tables,
)
from streamrt.backends.kernel_defines import (
    MOE_MAXP,
    MOE_MAXP_DT,
    MOE_WARPS,
    ROUTER_THREADS,
    TC_SBYTES,
    TC_STAGED_DOWN_THREADS,
    TC_STAGED_THREADS,
    TC_TOKENS,
    TC_WBYTES,
    TC_XSTRIDE,
)
from streamrt.backends.kernel_host import KernelHost
from streamrt.backends.nvfp4_gemm import PREFILL_ROWS, TORCH_FP16, grouped_expert_pairs
from streamrt.backends.nvrtc_args import aligned, as_act, as_weight, f32, i32, ptr, situ_args
from streamrt.backends.nvrtc_moe_calls import DEVICE_TABLES, HOST_TABLES, FfnCall, PairTables
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix, ResidentExperts, RoutedExperts, as_routed
from streamrt.ops import route, sigmoid

# The 8-row tensor-core blocks (srt_nvfp4_{gateup,down}_tc2x2): warps per block (gate+up, down),
# cp.async stages per warp, 128-column blocks per stage. Every shape gives the same bits. Seven
# down warps make 16 x 16 = 256 blocks at the slice layer (16 experts, T=1), which fit the 264
# two-per-SM slots of an H200 in one wave.
TC_SHAPE = (8, 7, 2, 2)
# From TC_STAGED_MIN_ROWS rows on, gate+up reads its activation from rows staged once per call
# (srt_moe_stage_rows) instead of a copy in each block, and down reads h's rows staged after the
# gate+up grid: a block takes up to TC_STAGED_ROWS rows of an expert (one decode of its weights
# for them), its shared memory holds only the weight rings (srt_nvfp4_{gateup,down}_st2x1).
# (gate+up warps, down warps, stages, blocks per stage); at T=16 x 16 of 24 experts of
# deep-k3.1-pro's shape it takes about three quarters of the time of 8-row blocks.
TC_STAGED_SHAPE = (12, 4, 2, 1)
TC_STAGED_MIN_ROWS = 8
TC_STAGED_ROWS = 16  # a multiple of TC_TOKENS, at most 16 (four sets of 4 rows per decoded weight fragment)
TC_STAGE_SMEM = TC_WBYTES + TC_SBYTES  # one 128-column block of one warp
assert TC_STAGED_SHAPE[0] * 32 <= TC_STAGED_THREADS and TC_STAGED_SHAPE[1] * 32 <= TC_STAGED_DOWN_THREADS


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


def router_smem_bytes(experts: int) -> int:
    """Dynamic shared memory of srt_router_topk (kernels/topk.cu): per expert its score, key and
    candidate slot, per chunk of 32 its maximum key."""
    return experts * 12 + (experts + 31) // 32 * 4


class MoeOps(KernelHost):
    """The router and expert FFN of the nvrtc backend (see the module doc); its state is set by
    `_init_moe`, the rest comes from `KernelHost`."""

    def _init_moe(self) -> None:
        self.grouped_prefill = False  # True on the prefill view (for_prefill): expert FFN as grouped GEMMs
        self.prefill_rows = PREFILL_ROWS[0]  # the grouped prefill GEMMs' row mode: "fp16" or "split" (nvfp4_gemm.py)
        # A prefill chunk takes the grouped GEMMs only with at least this many (row, expert) pairs
        # per routed expert: each expert costs a weight expansion and about six launches there,
        # against a per-pair weight read on the decode kernels (bench_prefill_experts.py: one
        # deep-k3.1-pro layer is faster per-pair at 32 pairs an expert, grouped at 85).
        self.grouped_min_pairs = 64
        self._ptr_cache = ExpertPointerCache(self.device)
        self._ready: Tensor | None = None
        self._ready_outgrown: list[Tensor] = []  # earlier, smaller `_ready` sets

    def _ready_counts(self, n: int) -> Tensor:
        """Per pair of an expert-FFN call, how many gate+up blocks are done (the down kernel's
        blocks wait on their pair's count: the first experts' down work runs while the last
        experts' gate+up does). Zero between calls: the weighted sum zeroes them. One set per
        backend: calls on one stream (the runtime's compute stream)."""
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
            raise ValueError(
                f"route: E={E} experts need {router_smem_bytes(E)} bytes of the router kernel's shared memory, "
                f"over its {SMEM_DEFAULT} (at most 4053 experts)"
            )
        ids = self._empty(T, k, dtype=torch.int64)
        wts = self._empty(T, k, dtype=torch.float32)
        if T:
            self._k("topk", "srt_router_topk")(
                (T,),
                (ROUTER_THREADS,),
                [
                    ptr(logits),
                    ptr(bias),
                    i32(bb),
                    ptr(ids),
                    ptr(wts),
                    i32(E),
                    i32(k),
                    i32(bool(renormalize)),
                    f32(scale),
                ],
                smem=router_smem_bytes(E),
                pdl=self.pdl,
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
        z = as_act(z, "expert_ffn.z", self.device)
        if not aligned(z, 16):
            z = z.clone()
        T, Dl = z.shape
        if ids.shape[0] != T or weights.shape != ids.shape:
            raise ValueError(
                f"expert_ffn: z {tuple(z.shape)}, ids {tuple(ids.shape)}, weights {tuple(weights.shape)} do not agree"
            )
        k = ids.shape[1]
        w = as_act(weights, "expert_ffn.weights", self.device)
        if isinstance(experts, ResidentExperts) and ids is experts.ids and not self.grouped_prefill:
            return self._expert_ffn_table(z, experts, w, beta, linear_beta)
        experts = as_routed(experts, ids)
        missing = experts.missing()
        if missing:
            raise KeyError(f"expert_ffn: experts {missing} were routed to but not provided")
        # Experts whose copy is still in flight (a streamed layer) go last: the compute stream
        # waits for their events only after the resident ones are queued (overlap within the layer).
        late = {e for e in experts.unique if experts.pending(e)}
        out = self._empty(T, Dl, dtype=torch.float32)
        if T * k == 0:
            return out.zero_()
        if self.grouped_prefill and T * k >= self.grouped_min_pairs * len(experts.unique):
            # a prefill chunk with many rows per expert: one GEMM per expert and matrix (nvfp4_gemm.py)
            y = grouped_expert_pairs(z, experts.host_ids, experts, beta, linear_beta, late, conv=self,
                                     rows=self.prefill_rows)
            self._combine(y, w, out, T, k, Dl, None)
            return out
        ready = self._ready_counts(T * k) if k <= Dl else None
        try:
            y = self._expert_pairs_host(z, experts, late, k, situ_args(beta, linear_beta), ready)
        except BaseException:
            if ready is not None:  # the sum that zeroes the counts will not run (queued after any launch made)
                ready.zero_()
            raise
        self._combine(y, w, out, T, k, Dl, ready)
        return out

    def _expert_pairs_host(self, z: Tensor, experts: RoutedExperts, late: set, k: int, act: list[bytes],
                           ready: Tensor | None) -> Tensor:
        """y [T*k, Dl] of expert_ffn's pairs, their tables built on the host and passed by value:
        the resident experts' pairs first, then the late ones', each group by expert (as
        srt_moe_tables orders them: a batch's pairs of one expert adjacent; a pair's bits do not
        depend on its place). The sum counts into `ready` are zeroed by the caller's sum."""
        T, Dl = z.shape
        staged = self._staged_rows(z) if self._takes_staged(T) else None
        pairs = [(p, t, e) for t, row in enumerate(experts.host_ids.tolist()) for p, e in enumerate(row, start=t * k)]
        groups = [sorted((q for q in pairs if (q[2] in late) == is_late), key=lambda q: (q[2], q[0]))
                  for is_late in (False, True)]
        ptrs, I, h, y = {}, None, None, None
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
                h, y = self._empty(T * k, I, dtype=torch.float32), self._empty(T * k, Dl, dtype=torch.float32)
            for c0 in range(0, len(group), MOE_MAXP):
                chunk = group[c0 : c0 + MOE_MAXP]
                gtab, dtab = (t.tobytes() for t in tables(chunk, ptrs))
                # (slot sections are 4096-byte aligned, so every chunk of a layer takes the same kernels)
                tc = Dl % 128 == 0 and I % 128 == 0 and scales_aligned8(chunk, ptrs)
                call = FfnCall(z, h, y, act, ready, staged, tc, HOST_TABLES)
                self._launch_pairs(call, PairTables(gtab, dtab, len(chunk), pdl_gateup=not late_group))
        return y

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
        tc = Dl % 128 == 0 and I % 128 == 0 and experts.tensor_core
        gtab = self._empty(chunks, gate_up_table_bytes(MOE_MAXP_DT), dtype=torch.uint8)
        dtab = self._empty(chunks, down_table_bytes(MOE_MAXP_DT), dtype=torch.uint8)
        # The staged blocks take their groups from a list (a block row per group there can be);
        # the others a block row per pair, the pairs that lead no group exiting at once.
        groups = self._empty(chunks, MOE_MAXP_DT + 2, dtype=torch.int32) if tc and staged is not None else None
        threads = MOE_MAXP_DT if groups is not None else min(1024, 32 * math.ceil(P / 32))
        self._k("nvfp4_moe", "srt_moe_tables")(
            (1,), (threads,),
            [ptr(ids), ptr(experts.table), i32(P), i32(k), ptr(gtab), ptr(dtab), i32(TC_STAGED_ROWS), ptr(groups)])
        h, y = self._empty(P, I, dtype=torch.float32), self._empty(P, Dl, dtype=torch.float32)
        ready = self._ready_counts(P) if k <= Dl else None
        call = FfnCall(z, h, y, situ_args(beta, linear_beta), ready, staged, tc, DEVICE_TABLES)
        for c in range(chunks):
            n = min(MOE_MAXP_DT, P - c * MOE_MAXP_DT)
            chunk_groups = (
                None if groups is None else (groups[c], most_groups(n, experts.table.shape[0], TC_STAGED_ROWS))
            )
            # the gate+up kernel reads its table before pdl_wait(), and the table is the kernel
            # before's output here: a plain launch (the down kernel and the sum stay programmatic)
            self._launch_pairs(call, PairTables(ptr(gtab[c]), ptr(dtab[c]), n, pdl_gateup=False, groups=chunk_groups))
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
            (min(math.ceil(words / 256), 8192),),
            (256,),
            [
                ptr(m0.packed),
                ptr(m0.scales),
                ptr(m1.packed),
                ptr(m1.scales),
                ptr(w16),
                i32(words0 if len(mats) > 1 else words),
                i32(words),
                i32(in2 // 4),
            ],
        )
        return w16

    def fp16_rows(self, x: Tensor, split: bool) -> tuple[Tensor, Tensor]:
        x = x.contiguous()
        n, cols = x.shape
        rows = self._empty((1 + split) * n, cols, dtype=torch.float16)
        scale = self._empty(n, dtype=torch.float32)
        if n:
            self._k("nvfp4_gemm", "srt_f16_rows")(
                (n,), (256,), [ptr(x), ptr(rows), ptr(scale), i32(n), i32(cols), i32(split)]
            )
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
        return T >= TC_STAGED_MIN_ROWS

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

    def _launch_pairs(self, call: FfnCall, tabs: PairTables) -> None:
        """The gate+up and down kernels for `tabs.pairs` pairs of `call`. A tensor-core block
        takes up to min(TC_TOKENS, T) pairs of one expert (an expert has at most one pair per
        row; TC_STAGED_ROWS in the staged blocks, given `call.staged`) and counts into `ready`;
        the CUDA-core kernels take one pair per block and leave `ready` alone."""
        if call.tc and call.staged is not None:
            self._launch_staged(call, tabs)
            return
        (T, Dl), I, E, act, ready = call.z.shape, call.I, call.entries, call.act, call.ready
        hp, yp = ptr(call.h), ptr(call.y)
        if call.tc:
            tg, td, st, kbs = TC_SHAPE
            cap = min(TC_TOKENS, T)
            gu_blocks = math.ceil(I / (16 * tg))  # 16 rows per warp (gate+up tiles), 32 rows per warp (down)
            self._k("nvfp4_moe", E.gateup_tc)(
                (gu_blocks, tabs.pairs), (tg * 32,),
                [tabs.gate_up, ptr(call.z), hp, i32(I), i32(Dl), *act, ptr(ready), i32(cap)],
                smem=tc_smem(Dl, tg, st, kbs, cap),
                # programmatic: reads z after pdl_wait(); before it only weights, and only of
                # resident experts (a late expert's copy is waited for by an event before this)
                pdl=self.pdl and tabs.pdl_gateup)
            self._k("nvfp4_moe", E.down_tc)(
                (math.ceil(Dl / (32 * td)), tabs.pairs), (td * 32,),
                [tabs.down, hp, yp, i32(Dl), i32(I), ptr(ready), i32(gu_blocks), i32(cap), i32(cap)],
                smem=tc_smem(I, td, st, kbs, cap), pdl=self.pdl)
            return
        self._k("nvfp4_moe", E.gateup)(
            (math.ceil(I / (MOE_WARPS * 2)), tabs.pairs), (MOE_WARPS * 32,),
            [tabs.gate_up, ptr(call.z), hp, i32(I), i32(Dl), *act], smem=Dl * 4)
        self._k("nvfp4_moe", E.down)(
            (math.ceil(Dl / (MOE_WARPS * 4)), tabs.pairs), (MOE_WARPS * 32,), [tabs.down, hp, yp, i32(Dl), i32(I)],
            smem=I * 4)

    def _launch_staged(self, call: FfnCall, tabs: PairTables) -> None:
        """_launch_pairs' staged kernels: gate+up over groups of up to TC_STAGED_ROWS pairs,
        then h's rows staged (all of them: on the host tables each chunk of pairs stages them
        again, as it has written its own) and down over gate+up's groups, once the whole
        gate+up grid is done (no per-pair counts). With the device tables a block row takes a
        group of srt_moe_tables' list (a block row per group there can be), else the group a
        pair leads."""
        gw, dw, st, kbs = TC_STAGED_SHAPE
        (T, Dl), I, E = call.z.shape, call.I, call.entries
        xs, unscale = call.staged
        rows, listed = (tabs.pairs, []) if tabs.groups is None else (tabs.groups[1], [ptr(tabs.groups[0])])
        self._k("nvfp4_moe", E.gateup_staged)(
            (math.ceil(I / (16 * gw)), rows), (gw * 32,),
            [tabs.gate_up, ptr(xs), ptr(unscale), i32(T), ptr(call.h), i32(I), i32(Dl), *call.act, ptr(None),
             i32(TC_STAGED_ROWS), *listed],
            smem=gw * st * kbs * TC_STAGE_SMEM, pdl=self.pdl and tabs.pdl_gateup)
        hs, h_unscale = self._staged_rows(call.h)  # every row of h (P): the zero row is P
        self._k("nvfp4_moe", E.down_staged)(
            (math.ceil(Dl / (32 * dw)), rows),
            (dw * 32,),
            [
                tabs.down,
                ptr(hs),
                ptr(h_unscale),
                i32(call.h.shape[0]),
                ptr(call.y),
                i32(Dl),
                i32(I),
                i32(TC_STAGED_ROWS),
                *listed,
            ],
            smem=dw * st * kbs * TC_STAGE_SMEM,
            pdl=self.pdl,
        )
