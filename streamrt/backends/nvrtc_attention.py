"""The nvrtc backend's attention ops: MLA decode (split over positions, then combined), the
latent absorb / expand per head, the indexer's scores and the exact top-k
(`kernels/attention.cu`, `kernels/topk.cu`). Prefill attention on a cache runs the torch
reference (`TorchBackend.mla_prefill`) on this device until a kernel replaces it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from streamrt.backends.kernel_defines import IDX_PPW, IDX_WARPS, MLA_CHUNK, MLA_HG, MLA_THREADS, TOPK_THREADS
from streamrt.backends.kernel_host import KernelHost
from streamrt.backends.nvrtc_args import as_act, as_rows, as_weight, block_threads, f32, i32, i64, ptr
from streamrt.backends.torch_backend import TorchBackend


class AttentionOps(KernelHost):
    """MLA, the indexer and top-k of the nvrtc backend (see the module doc)."""

    def _init_attention(self) -> None:
        self._torch_attention = TorchBackend()  # runs mla_prefill (see below)

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
        one, q_lat, q_rot, c_cache, kr_cache, select = self._mla_operands(q_lat, q_rot, c_cache, kr_cache, select)
        B, H, R = q_lat.shape
        Dr = q_rot.shape[-1]
        n = c_cache.shape[1]
        m = n if select is None else select.shape[1]
        if m == 0:
            raise ValueError("mla_decode: no positions to attend to")
        cb = int(c_cache.dtype == torch.bfloat16)
        length = self._lengths(length, B, "mla_decode")
        S = math.ceil(m / MLA_CHUNK)
        part_acc = self._empty(B, S, H, R, dtype=torch.float32)
        part_ml = self._empty(B, S, H, 2, dtype=torch.float32)
        out = self._empty(B, H, R, dtype=torch.float32)
        smem = MLA_HG * (R + Dr) * 4
        self._k("attention", "srt_mla_partial")(
            (S, math.ceil(H / MLA_HG), B),
            (MLA_THREADS,),
            [
                ptr(q_lat),
                ptr(q_rot),
                ptr(c_cache),
                ptr(kr_cache),
                i32(n),
                i32(cb),
                ptr(select),
                i32(m),
                ptr(length),
                i32(H),
                i32(R),
                i32(Dr),
                i64(q_rot.stride(0)),
                i64(q_rot.stride(1)),
                f32(scale),
                ptr(part_acc),
                ptr(part_ml),
            ],
            smem=smem,
            pdl=self.pdl,
        )
        self._k("attention", "srt_mla_combine")(
            (H, B),
            (block_threads(R, 256),),
            [ptr(part_acc), ptr(part_ml), ptr(out), i32(S), i32(H), i32(R), i32(m), ptr(length)],
            pdl=self.pdl,
        )
        return out[0] if one else out

    def _mla_operands(
        self, q_lat: Tensor, q_rot: Tensor, c_cache: Tensor, kr_cache: Tensor, select: Tensor | None,
    ) -> tuple[bool, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """mla_decode's operands checked and batched (and whether it was one row): a row axis added to one row, the
        caches one dtype (fp32 or bf16) and contiguous, select int64 contiguous."""
        dev = self.device
        q_lat, q_rot = (
            as_act(q_lat, "mla_decode.q_lat", dev),
            as_rows(q_rot, "mla_decode.q_rot", dev),
        )  # q_rot: a view of q
        one = q_lat.dim() == 2
        if one:
            q_lat, q_rot, c_cache, kr_cache = q_lat[None], q_rot[None], c_cache[None], kr_cache[None]
            select = None if select is None else select.reshape(1, -1)
        B, H, R = q_lat.shape
        Dr = q_rot.shape[-1]
        if (
            q_rot.dim() != 3
            or q_rot.shape[:2] != (B, H)
            or c_cache.dim() != 3
            or c_cache.shape[0] != B
            or c_cache.shape[-1] != R
            or kr_cache.shape[-1] != Dr
            or c_cache.shape[:2] != kr_cache.shape[:2]
        ):
            raise ValueError(
                f"mla_decode: q_lat {tuple(q_lat.shape)} q_rot {tuple(q_rot.shape)} c {tuple(c_cache.shape)} "
                f"kr {tuple(kr_cache.shape)} do not agree"
            )
        if c_cache.dtype != kr_cache.dtype or c_cache.dtype not in (torch.float32, torch.bfloat16):
            c_cache, kr_cache = c_cache.float(), kr_cache.float()
        c_cache, kr_cache = c_cache.contiguous(), kr_cache.contiguous()
        if select is not None:
            if select.device != dev:
                raise ValueError(f"mla_decode: select on {select.device}, expected {dev}")
            if select.dim() != 2 or select.shape[0] != B:
                raise ValueError(f"mla_decode: select {tuple(select.shape)} for {B} rows")
            select = select.to(torch.int64).contiguous()
        return one, q_lat, q_rot, c_cache, kr_cache, select

    def _lengths(self, length: Tensor | None, rows: int, what: str) -> Tensor | None:
        if length is not None and (
            length.device != self.device or length.dtype != torch.int32 or length.numel() != rows
        ):
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
                (math.ceil(R / 32), H),
                (256,),
                [
                    ptr(q),
                    i64(q.stride(0)),
                    i64(q.stride(1)),
                    ptr(w),
                    i32(wb),
                    i64(hs),
                    ptr(out),
                    i32(B),
                    i32(H),
                    i32(dn),
                    i32(R),
                ],
                pdl=self.pdl,
            )
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
                (math.ceil(dv / 8), H),
                (256,),
                [ptr(x), ptr(w), i32(wb), i64(hs), ptr(out), i32(B), i32(H), i32(dv), i32(R)],
                pdl=self.pdl,
            )
        return out

    def _head_weight(self, w: Tensor, name: str) -> tuple[Tensor, int, int]:
        """A per-head weight [H, rows, R]: (tensor, is_bf16, head stride); the heads may be strided
        (a slice of kv_b_proj), each head's rows must be dense."""
        if w.device != self.device or w.dim() != 3:
            raise ValueError(f"{name}: expected [H, rows, R] on {self.device}, got {tuple(w.shape)} on {w.device}")
        if w.dtype not in (torch.float32, torch.bfloat16) or w.stride(2) != 1 or w.stride(1) != w.shape[2]:
            w = w.float().contiguous()
        return w, int(w.dtype == torch.bfloat16), w.stride(0)

    def indexer_scores(
        self, q: Tensor, w: Tensor, k_cache: Tensor, length: Tensor | None = None, w_scale: float = 1.0
    ) -> Tensor:
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
            raise ValueError(
                f"indexer_scores: q {tuple(q.shape)} w {tuple(w.shape)} k_cache {tuple(k_cache.shape)} do not agree"
            )
        k_cache, kb = as_weight(k_cache, "indexer_scores.k_cache", dev)
        n = k_cache.shape[1]
        length = self._lengths(length, B, "indexer_scores")
        out = self._empty(B, n, dtype=torch.float32)
        if n and B:
            smem = (Hi * (Di + 1) + IDX_WARPS * Di) * 4
            self._k("attention", "srt_indexer_scores")(
                (math.ceil(n / (IDX_WARPS * IDX_PPW)), B),
                (IDX_WARPS * 32,),
                [ptr(q), ptr(w), ptr(k_cache), i32(kb), ptr(out), i32(n), ptr(length), i32(Hi), i32(Di), f32(w_scale)],
                smem=smem,
                pdl=self.pdl,
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
            self._k("topk", "srt_select_topk")(
                (rows,), (TOPK_THREADS,), [ptr(s2), ptr(out), i32(n), i32(kk), ptr(length)], pdl=self.pdl
            )
        return out[0] if one else out

    # Prefill attention on a cache: the torch reference (fixed query tiles x key blocks, online
    # softmax, gathered top-k; TorchBackend.mla_prefill) on this device until a kernel replaces it.
    def tiles(self, device) -> tuple[int, int, int]:
        return self._torch_attention.tiles(self.device)

    def mla_prefill(self, q_nope, q_rot, w_uk, w_uv, c_cache, kr_cache, start, scale, index=None):
        return self._torch_attention.mla_prefill(q_nope, q_rot, w_uk, w_uv, c_cache, kr_cache, start, scale, index)

