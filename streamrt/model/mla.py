"""MLA, NoPE and gated (spec/MODEL.md §3), with K3.1 Pro's Lightning Indexer selection.

Axis legend: B sequences, T new tokens, N = B*T rows, n cached positions, H heads,
dn / dr / dv nope / "rope" (un-rotated) / value head dims, R latent rank (kv_lora_rank),
rq q-LoRA rank. No rotary anywhere: the dr "rope" key dims are one shared plain vector.

Decode, and prefill on a cache, run the absorbed form over the latent cache (R + dr values
per token):
    q_lat_h = W_UK[h]^T q_nope_h;  p = softmax((q_lat.c + q_rot.kr) * s);  O_h = W_UV[h] (sum p c)
A prefill chunk on a cache goes through `Backend.mla_prefill`: fixed query tiles against fixed
key blocks with an online softmax, and a query past the indexer's top-k over its gathered top-k
keys only, so memory is the cache plus a constant, a long context costs each query topk keys,
and a position's bits do not depend on the chunking. Without a cache (training,
reference) the expanded form (K and V per head from the latent) runs over all T x T at once.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from streamrt.model.cache import MLACache, Step
from streamrt.model.indexer import LightningIndexer
from streamrt.model.layers import RMSNorm
from streamrt.ops import topk_mask


class KimiMLAAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        R, rq = cfg.kv_lora_rank, cfg.q_lora_rank
        self.layer_idx, self.H, self.dn, self.dr, self.dv, self.R = layer_idx, H, dn, dr, dv, R
        self.scale = (dn + dr) ** -0.5
        self.q_a_proj = nn.Linear(D, rq, bias=False)
        self.q_a_layernorm = RMSNorm(rq, cfg.mla_norm_eps)
        self.q_b_proj = nn.Linear(rq, H * (dn + dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, R + dr, bias=False)
        self.kv_a_layernorm = RMSNorm(R, cfg.mla_norm_eps)
        self.kv_b_proj = nn.Linear(R, H * (dn + dv), bias=False)  # rows per head: [k_nope ; v]
        self.o_proj = nn.Linear(H * dv, D, bias=False)
        self.g_proj = nn.Linear(D, H * dv, bias=False) if cfg.mla_use_output_gate else None
        self.indexer = LightningIndexer(cfg) if cfg.has_indexer(layer_idx) else None  # K3: never built
        # Training / test switch: False = dense attention (indexer keys still cached, selection skipped).
        self.sparse = True

    def forward(self, x: Tensor, step: Step, cache: MLACache | None, add: tuple[Tensor, ...] = ()) -> Tensor:
        """x [N, D] (post input_layernorm) -> [N, D], then + each of `add` (residuals, added by the
        output projection)."""
        be, N, H, dn, dr, R = step.be, x.shape[0], self.H, self.dn, self.dr, self.R
        # every projection of x in one backend call, then every one of cq in another
        ix = self.indexer
        mats = [self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight]
        mats += [self.g_proj.weight] if self.g_proj is not None else []
        mats += [ix.wk.weight, ix.weights_proj.weight] if ix is not None else []
        qa, kv, *rest = be.linears(x, mats)
        gate = rest.pop(0) if self.g_proj is not None else None
        cq = self.q_a_layernorm(qa, be)  # [N, rq]
        q, *iq = be.linears(cq, [self.q_b_proj.weight, *([ix.wq_b.weight] if ix is not None else [])])
        q = q.view(N, H, dn + dr)
        q_nope, q_rot = q[..., :dn], q[..., dn:]  # [N, H, dn], [N, H, dr]
        c = self.kv_a_layernorm(kv[:, :R], be)  # [N, R]
        kr = kv[:, R:]  # [N, dr], shared by all heads, not rotated
        # (q [N,Hi,Di], k [N,Di], w [N,Hi] unscaled)
        idx = ix.from_projections(iq[0], *rest, be) if ix is not None else None
        if step.decode:
            o = self._decode(q_nope, q_rot, c, kr, idx, step, cache)
        else:
            o = self._prefill(q_nope, q_rot, c, kr, idx, step, cache)  # [N, H, dv]
        if self.g_proj is not None:
            o = be.sigmoid_mul(o, gate.view(N, H, self.dv))  # gate from the layer input
        return be.linear(o.reshape(N, H * self.dv), self.o_proj.weight, add)  # [N, D]

    def _prefill(self, q_nope, q_rot, c, kr, idx, step: Step, cache: MLACache | None) -> Tensor:
        be, B, T, H, dn, R, s0 = step.be, step.batch, step.seqlen, self.H, self.dn, self.R, step.start
        c, kr = c.view(B, T, R), kr.view(B, T, -1)
        ki = idx[1].view(B, T, -1) if idx is not None else None
        if cache is not None:  # append, then attend chunk-wise over the whole history
            return self._prefill_cached(q_nope, q_rot, c, kr, ki, idx, step, cache)
        c_all, kr_all, ki_all = c, kr, ki
        n = c_all.shape[1]
        kvb = be.linear(c_all.reshape(B * n, R), self.kv_b_proj.weight).view(B, n, H, dn + self.dv)
        k_nope, v = kvb[..., :dn], kvb[..., dn:]  # [B, n, H, dn], [B, n, H, dv]
        qn, qr = q_nope.reshape(B, T, H, dn), q_rot.reshape(B, T, H, -1)
        scores = (torch.einsum("bthd,bshd->bhts", qn, k_nope) + torch.einsum("bthd,bsd->bhts", qr, kr_all)) * self.scale
        pos = torch.arange(n, device=c.device)
        qpos = s0 + torch.arange(T, device=c.device)
        allowed = (pos[None, :] <= qpos[:, None]).expand(B, T, n)  # [B, T, n] causal
        if idx is not None and self.sparse:  # Lightning Indexer: each query keeps its top-k positions
            qi, _, wi = idx
            wi = self.indexer.head_weights(wi)
            I = self.indexer.prefill_scores(qi.view(B, T, *qi.shape[1:]), wi.view(B, T, -1), ki_all, s0)  # [B, T, n]
            allowed = allowed & topk_mask(I, (qpos + 1).expand(B, T), self.indexer.topk)
        p = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)  # [B, H, T, n] fp32
        o = torch.einsum("bhts,bshd->bthd", p, v)  # [B, T, H, dv]
        return o.reshape(B * T, H, self.dv)

    def _prefill_cached(self, q_nope, q_rot, c, kr, ki, idx, step: Step, cache: MLACache) -> Tensor:
        """c [B, T, R], kr [B, T, dr], ki [B, T, Di] | None -> [B*T, H, dv]; writes the cache first."""
        be, B, T, H, dn, s0 = step.be, step.batch, step.seqlen, self.H, self.dn, step.start
        n = s0 + T
        cache.reserve(n)
        cache.c[:, s0:n], cache.kr[:, s0:n] = c.detach(), kr.detach()
        if ki is not None:
            cache.ik[:, s0:n] = ki.detach()
        W = self.kv_b_proj.weight.float().view(H, dn + self.dv, -1)
        W_UK, W_UV = W[:, :dn], W[:, dn:]  # [H, dn, R], [H, dv, R]
        qn, qr = q_nope.reshape(B, T, H, dn), q_rot.reshape(B, T, H, -1)
        outs = []
        wis = self.indexer.head_weights(idx[2]).view(B, T, -1) if idx is not None and self.sparse else None
        for b in range(B):  # one sequence at a time
            index = None
            if wis is not None:
                qi, wi = idx[0].view(B, T, *idx[0].shape[1:])[b], wis[b]
                index = (qi, wi, cache.ik[b, :n], self.indexer.topk)
            outs.append(
                be.mla_prefill(qn[b], qr[b], W_UK, W_UV, cache.c[b, :n], cache.kr[b, :n], s0, self.scale, index)
            )
        return torch.cat(outs)  # [B*T, H, dv]

    def _decode(self, q_nope, q_rot, c, kr, idx, step: Step, cache: MLACache) -> Tensor:
        """One new token per row, each at its own position (the cache's device lengths, so the
        step holds no host length: a CUDA graph of it replays at any length up to the capacity)."""
        be, H, dn, R = step.be, self.H, self.dn, self.R
        cache.reserve(max(step.cache.lengths) + 1)  # growth moves the cache: never inside a graph
        caches, rows = [cache.c, cache.kr], [c, kr]
        if idx is not None:
            caches.append(cache.ik)
            rows.append(idx[1])
        be.cache_append(caches, rows, step.cache.device_lengths)  # row b at its position
        W = self.kv_b_proj.weight.view(H, dn + self.dv, R)  # as stored: the kernels read bf16 themselves
        q_lat = be.mla_absorb(q_nope, W[:, :dn])  # [B, H, R]
        select = None
        if idx is not None and self.sparse:  # every position, ascending, while a row's n <= topk
            # [B, cap], row b valid below its n
            scores = be.indexer_scores(idx[0], idx[2], cache.ik, step.valid, self.indexer.w_scale)
            select = be.select_topk(scores, self.indexer.topk, step.valid)
        o_lat = be.mla_decode(q_lat, q_rot, cache.c, cache.kr, self.scale, select, step.valid)  # [B, H, R]
        return be.mla_expand(o_lat, W[:, dn:])  # [B, H, dv]
