"""The K3.1 Pro Lightning Indexer (spec/K31_INDEXER.md): scores and key cache (the exact
top-k with its tie rule is `streamrt.ops.select_topk` / `topk_mask`).

Constructed only on `cfg.indexer.layers`; K3 never builds one. Axis legend: B sequences,
T new tokens, n cached positions, Hi indexer heads, Di indexer head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from streamrt.model.layers import LayerNorm


class LightningIndexer(nn.Module):
    """wq_b [Hi*Di, q_lora], wk [Di, D], k_norm (LayerNorm w+b), weights_proj [Hi, D]."""

    def __init__(self, cfg):
        super().__init__()
        ic = cfg.indexer
        self.n_heads, self.head_dim, self.topk, self.eps = ic.n_heads, ic.head_dim, ic.topk, ic.k_norm_eps
        self.w_scale = ic.n_heads**-0.5 * ic.head_dim**-0.5  # both scales of the head weights
        self.wq_b = nn.Linear(cfg.q_lora_rank, ic.n_heads * ic.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, ic.head_dim, bias=False)
        self.k_norm = LayerNorm(ic.head_dim, eps=ic.k_norm_eps)
        self.weights_proj = nn.Linear(cfg.hidden_size, ic.n_heads, bias=False)

    def from_projections(self, q: Tensor, k: Tensor, w: Tensor, be) -> tuple[Tensor, Tensor, Tensor]:
        """Its projections cq wq_b [N, Hi*Di], x wk [N, Di], x weights_proj [N, Hi] (MLA computes
        them with its own projections of x and cq) -> q [N, Hi, Di], k [N, Di] (k_norm'd),
        w [N, Hi] as projected: the head weight is w * `w_scale`, which decode's score kernel
        applies itself (one launch fewer a layer) and prefill multiplies in (`head_weights`)."""
        q = q.view(q.shape[0], self.n_heads, self.head_dim)  # no rotary (index_rope_dim 0)
        k = be.layernorm(k, self.k_norm.weight, self.k_norm.bias, self.eps)  # [N, Di]
        return q, k, w

    def head_weights(self, w: Tensor) -> Tensor:
        """weights_proj's output [..., Hi] -> the head weights [..., Hi], both scales folded in."""
        return w * self.w_scale

    @staticmethod
    def prefill_scores(q: Tensor, w: Tensor, k_all: Tensor, start: int) -> Tensor:
        """q [B, T, Hi, Di], w [B, T, Hi], k_all [B, n, Di] (positions 0..n-1, queries at
        start..start+T-1) -> I [B, T, n] fp32 with -inf at s > t (causal)."""
        T, n = q.shape[1], k_all.shape[1]
        dots = torch.relu(torch.einsum("bthd,bsd->bths", q, k_all))  # [B, T, Hi, n]
        scores = (dots * w[..., None]).sum(2)  # [B, T, n]
        pos = torch.arange(n, device=q.device)
        causal = pos[None, :] <= (start + torch.arange(T, device=q.device))[:, None]  # [T, n]
        return scores.masked_fill(~causal, float("-inf"))
