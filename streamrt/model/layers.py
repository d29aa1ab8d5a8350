"""Small parameter holders shared by the blocks: norms and the SiTU-GLU MLP.

Modules own parameters under the checkpoint's names; arithmetic goes through a Backend
(`be`), so the nvrtc backend runs the same model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """KimiRMSNorm: weight * x * rsqrt(mean(x^2) + eps), fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, be) -> Tensor:
        return be.rmsnorm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (the indexer's k_norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor, be) -> Tensor:
        return be.layernorm(x, self.weight, self.bias, self.eps)


class GLUMLP(nn.Module):
    """gate_proj / up_proj / down_proj with SiTU-GLU: the dense layer-0 MLP and the shared experts."""

    def __init__(self, dim: int, inter: int, beta: float, linear_beta: float | None):
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x: Tensor, be, add: tuple[Tensor, ...] = ()) -> Tensor:
        """x [N, D] -> down(situ_glu(gate x, up x)) [N, D], then + each of `add` in order (residuals)."""
        gate, up = be.linears(x, [self.gate_proj.weight, self.up_proj.weight])
        return self.down(gate, up, be, add)

    def down(self, gate: Tensor, up: Tensor, be, add: tuple[Tensor, ...] = ()) -> Tensor:
        """The rest of forward from gate x and up x (computed with the caller's other projections of x)."""
        return be.linear(be.situ_glu(gate, up, self.beta, self.linear_beta), self.down_proj.weight, add)


def act_betas(cfg) -> tuple[float, float | None]:
    """(beta, linear_beta) for the config's hidden_act; SiLU is SiTU's beta -> inf limit."""
    if cfg.hidden_act == "silu":
        return float("inf"), None
    return cfg.situ_beta, cfg.situ_linear_beta
