"""The K3.1 Pro Lightning Indexer (spec/K31_INDEXER.md): scores, exact top-k, key cache.

Constructed only on `cfg.indexer.layers`; K3 never builds one. Axis legend: B sequences,
T new tokens, n cached positions, Hi indexer heads, Di indexer head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from streamrt.model.layers import LayerNorm


def select_topk(scores: Tensor, k: int) -> Tensor:
    """Exact top-k positions of a 1-D score vector, in the emitted order.

    k' = min(k, n); v = the k'-th largest score; emit every position with score > v in
    ascending order, then positions with score == v from the lowest up until k' are out.
    """
    if scores.dim() != 1:
        raise ValueError(f"select_topk: scores must be 1-D, got shape {tuple(scores.shape)}")
    n = scores.shape[0]
    k = min(int(k), n)
    if k <= 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    v = torch.topk(scores, k, sorted=True).values[-1]  # the threshold value (ties do not matter here)
    above = (scores > v).nonzero().flatten()  # ascending
    equal = (scores == v).nonzero().flatten()[: k - above.numel()]  # boundary group, lowest first
    return torch.cat((above, equal))


def topk_mask(scores: Tensor, counts: Tensor, k: int) -> Tensor:
    """The set `select_topk` picks, for many rows at once, as a boolean mask.

    scores [..., n] with -inf at non-candidates; counts [...] candidates per row (the
    candidates must be exactly the finite entries). Returns bool [..., n].
    """
    kk = counts.clamp(max=k).clamp(min=1)  # [...]
    v = scores.sort(dim=-1, descending=True).values.gather(-1, (kk - 1)[..., None])  # [..., 1] threshold
    above = scores > v
    equal = scores == v
    need = kk[..., None] - above.sum(-1, keepdim=True)
    return above | (equal & (equal.cumsum(-1) <= need))


class LightningIndexer(nn.Module):
    """wq_b [Hi*Di, q_lora], wk [Di, D], k_norm (LayerNorm w+b), weights_proj [Hi, D]."""

    def __init__(self, cfg):
        super().__init__()
        ic = cfg.indexer
        self.n_heads, self.head_dim, self.topk, self.eps = ic.n_heads, ic.head_dim, ic.topk, ic.k_norm_eps
        self.wq_b = nn.Linear(cfg.q_lora_rank, ic.n_heads * ic.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, ic.head_dim, bias=False)
        self.k_norm = LayerNorm(ic.head_dim, eps=ic.k_norm_eps)
        self.weights_proj = nn.Linear(cfg.hidden_size, ic.n_heads, bias=False)

    def forward(self, x: Tensor, cq: Tensor, be) -> tuple[Tensor, Tensor, Tensor]:
        """x [N, D] attention input, cq [N, q_lora] normalised q latent ->
        q [N, Hi, Di], k [N, Di], w [N, Hi] (head weight with both scales folded in)."""
        N = x.shape[0]
        q = be.linear(cq, self.wq_b.weight).view(N, self.n_heads, self.head_dim)  # no rotary (index_rope_dim 0)
        k = be.layernorm(be.linear(x, self.wk.weight), self.k_norm.weight, self.k_norm.bias, self.eps)  # [N, Di]
        w = be.linear(x, self.weights_proj.weight) * (self.n_heads**-0.5 * self.head_dim**-0.5)  # [N, Hi]
        return q, k, w

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
