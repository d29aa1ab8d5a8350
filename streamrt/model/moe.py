"""K3 "Stable LatentMoE" (spec/MODEL.md §4, §5.1) and the model <-> store protocol.

Axis legend: N rows, D hidden, Dl routed (latent) width, I expert intermediate, E experts,
k experts per token.

    (ids, w) = router(x)                       # fp32 sigmoid on the full x; bias only chooses
    z = routed_expert_down_proj(x)             # [N, Dl]
    u = sum_j w_j E_ids_j(z)                   # fp32, j in order
    y = routed_expert_up_proj(routed_expert_norm(u)) + shared_experts(x)

Inference: routed experts are not parameters. `forward_steps` yields an `ExpertRequest`
and is sent back `RoutedExperts` (expert_weights.py: host ids, unique ids, weights taken one
expert at a time; NVFP4, dequantised inside the op), or a plain {id: ExpertWeights}.
Training: `float_experts=True` makes `experts.{e}.w1/w2/w3.weight` float parameters and
the same forward runs without yielding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Mapping

import torch
from torch import Tensor, nn

from streamrt.expert_weights import ExpertWeights, RoutedExperts, answer_for_layer
from streamrt.model.layers import GLUMLP, RMSNorm, act_betas


@dataclass(frozen=True)
class ExpertRequest:
    """What layer `layer` needs: ids [N, k] (row-wise, by descending biased score),
    weights [N, k] fp32, hidden [N, D] = the FFN input (post-norm) that routed them."""

    layer: int
    ids: Tensor
    weights: Tensor
    hidden: Tensor

    def unique_ids(self) -> list[int]:
        return torch.unique(self.ids).tolist()


ExpertSteps = Generator[ExpertRequest, RoutedExperts | Mapping[int, ExpertWeights], Tensor]


class MoEGate(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))


class FloatExpert(nn.Module):
    """Training form of one routed expert: w1 gate [I, Dl], w3 up [I, Dl], w2 down [Dl, I]."""

    def __init__(self, dl: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(dl, inter, bias=False)
        self.w2 = nn.Linear(inter, dl, bias=False)
        self.w3 = nn.Linear(dl, inter, bias=False)


class LatentMoE(nn.Module):
    def __init__(self, cfg, layer_idx: int, float_experts: bool = False):
        super().__init__()
        D, Dl = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.layer_idx, self.k = layer_idx, cfg.experts_per_token
        self.renormalize, self.scale = cfg.moe_renormalize, cfg.routed_scaling_factor
        self.n_group, self.topk_group = cfg.num_expert_group, cfg.topk_group
        self.beta, self.linear_beta = act_betas(cfg)
        self.gate = MoEGate(cfg)
        self.routed_expert_down_proj = nn.Linear(D, Dl, bias=False)
        self.routed_expert_norm = RMSNorm(Dl, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
        self.routed_expert_up_proj = nn.Linear(Dl, D, bias=False)
        self.shared_experts = (
            GLUMLP(D, cfg.shared_intermediate_size, self.beta, self.linear_beta) if cfg.num_shared_experts else None
        )
        self.experts = (
            nn.ModuleList(FloatExpert(Dl, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
            if float_experts
            else None
        )

    def forward_steps(self, x: Tensor, be, add: tuple[Tensor, ...] = ()) -> ExpertSteps:
        """x [N, D] (post post_attention_layernorm) -> [N, D], then + each of `add` (residuals);
        yields one ExpertRequest unless float experts."""
        ids, w, z, shared_gate_up = self.route(x, be)
        if self.experts is not None:
            u = self._float_expert_ffn(z, ids, w, be)
        else:
            answer = yield ExpertRequest(self.layer_idx, ids, w, x)
            # The runtime and the providers answer with the ids already on the host (RoutedExperts),
            # which keeps this layer free of another device synchronize, or, every expert resident,
            # with the device ids and a pointer table (ResidentExperts); a plain mapping is wrapped.
            experts = answer_for_layer(answer, ids, self.layer_idx)
            u = self.routed_sum(z, w, experts, be)
        return self.combine(u, shared_gate_up, be, add)

    def route(self, x: Tensor, be) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
        """x [N, D] -> (ids [N, k], weights [N, k], z [N, Dl] the latent, the shared experts'
        gate and up [N, I_shared] or [])."""
        kw = {"n_group": self.n_group, "topk_group": self.topk_group} if self.n_group > 1 else {}
        # every projection of x in one backend call: router logits, latent down, shared gate / up
        shared = self.shared_experts
        mats = [self.gate.weight, self.routed_expert_down_proj.weight]
        mats += [shared.gate_proj.weight, shared.up_proj.weight] if shared is not None else []
        logits, z, *shared_gate_up = be.linears(x, mats)  # [N, E], [N, Dl], 2 x [N, I_shared]
        ids, w = be.route(logits, self.gate.e_score_correction_bias, self.k, self.renormalize, self.scale, **kw)
        return ids, w, z, shared_gate_up

    def routed_sum(self, z: Tensor, w: Tensor, experts, be) -> Tensor:
        """sum_j w_j E_ids_j(z) [N, Dl] fp32 with the answer's experts (RoutedExperts for these rows)."""
        return be.expert_ffn(z, experts.ids, w, experts, self.beta, self.linear_beta)

    def combine(self, u: Tensor, shared_gate_up: list[Tensor], be, add: tuple[Tensor, ...] = ()) -> Tensor:
        """The routed sum u [N, Dl] -> [N, D]: latent norm, up projection, the shared experts, + `add`."""
        shared = self.shared_experts
        if self.routed_expert_norm is not None:
            u = self.routed_expert_norm(u, be)
        if shared is None:
            return be.linear(u, self.routed_expert_up_proj.weight, add)  # [N, D]
        y = be.linear(u, self.routed_expert_up_proj.weight)
        return shared.down(*shared_gate_up, be, (y, *add))  # (shared(x) + y) + residuals; shared sees the full-width x

    def _float_expert_ffn(self, z: Tensor, ids: Tensor, w: Tensor, be) -> Tensor:
        """Differentiable routed sum with float experts (same order of combination as expert_ffn)."""
        N, k = ids.shape
        outs = z.new_zeros(N, k, z.shape[-1])  # [N, k, Dl]
        for e in torch.unique(ids).tolist():
            rows, slots = (ids == e).nonzero(as_tuple=True)
            ex = self.experts[e]
            h = be.situ_glu(
                be.linear(z[rows], ex.w1.weight), be.linear(z[rows], ex.w3.weight), self.beta, self.linear_beta
            )
            outs = outs.index_put((rows, slots), be.linear(h, ex.w2.weight))
        acc = outs[:, 0] * w[:, 0:1]
        for j in range(1, k):
            acc = acc + outs[:, j] * w[:, j : j + 1]
        return acc
