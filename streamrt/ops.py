"""Tensor functions with one definition, shared by the model and both backends.

Each is arithmetic the spec pins down exactly (spec/MODEL.md, spec/K31_INDEXER.md), so it
lives once: the model calls it where it computes outside a backend op, the torch backend is
built from it, and the NVRTC backend falls back to it where no kernel covers a case.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def sigmoid(x: Tensor) -> Tensor:
    """1 / (1 + exp(-x)) in fp32: the same bits for an element wherever it sits in a buffer
    (torch.sigmoid's scalar tail path differs from its vector path in the last bit)."""
    return torch.reciprocal(torch.exp(-x.float()) + 1.0)


def kda_gate(f: Tensor, a_log: Tensor, dt_bias: Tensor, lower_bound: float) -> Tensor:
    """K3 log-decay g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)); f [N, H, K], a_log [H] -> [N, H, K]."""
    H, K = f.shape[-2:]
    u = f.float() + dt_bias.float().view(H, K)
    return lower_bound * sigmoid(torch.exp(a_log.float())[:, None] * u)


def situ_glu(gate: Tensor, up: Tensor, beta: float, linear_beta: float | None) -> Tensor:
    """SiTU-GLU in fp32: beta*tanh(gate/beta)*sigmoid(gate) * (linear_beta*tanh(up/linear_beta)
    or up); beta = inf gives SiLU (the beta -> inf limit), for Kimi Linear's 'silu'."""
    g, u = gate.float(), up.float()
    if math.isinf(beta):
        ga = g * sigmoid(g)
    else:
        ga = beta * torch.tanh(g / beta) * sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return ga * u


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


def route(scores: Tensor, bias: Tensor, k: int, renormalize: bool, scale: float, n_group: int = 1,
          topk_group: int = 1) -> tuple[Tensor, Tensor]:
    """The router's choice on sigmoid scores [T, E] fp32 (spec/MODEL.md, noaux_tc):
    the bias only chooses; with groups, only the topk_group groups with the largest sum of their
    two best biased scores compete; weights are the unbiased scores of the chosen experts,
    renormalised (+1e-20) and scaled. Returns (ids [T, k] by descending biased score, weights [T, k])."""
    choice = scores + bias.float()
    if n_group > 1 and topk_group < n_group:
        T, E = choice.shape
        grp = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(grp, dtype=torch.bool).scatter(1, grp.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = torch.topk(choice, k, dim=-1, sorted=True).indices  # [T, k]
    w = scores.gather(-1, ids)
    if renormalize and k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * scale
