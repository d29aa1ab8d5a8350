"""The reference Backend: plain torch, CPU or GPU, fp32 arithmetic.

Every op follows the docstring of `backends/base.py`. Axis legend: T rows (tokens or
sequences), D hidden, H heads, K/V head dims, R MLA latent rank, n cached positions,
k top-k, E experts, P = H*K.

Batch invariance. Decode ops are row-wise: a row's result depends only on that row. For
elementwise and last-dim reductions that holds by construction. For matrix products it
does not (a GEMM's blocking depends on the row count), so `linear` runs one GEMV per row
while T <= `rowwise_max`; bigger T (prefill) and anything autograd tracks (training) take
one GEMM, which is faster but only equal to the row-wise result within rounding. Prefill is therefore run per sequence
(see `streamrt.generate`), so a row never depends on its batch companions.

All ops are differentiable (no in-place writes on inputs) except the two that update a
decode cache in place by contract: `short_conv_step` and `kda_step`.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from streamrt.expert_weights import ExpertWeights, NVFP4Matrix

# E2M1 nibble -> value: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_LUT_CACHE: dict[torch.device, Tensor] = {}


def _e2m1_lut(device: torch.device) -> Tensor:
    lut = _LUT_CACHE.get(device)
    if lut is None:
        lut = _LUT_CACHE[device] = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return lut


def dequant_nvfp4(m: NVFP4Matrix) -> Tensor:
    """One NVFP4 matrix -> fp32 [out, in]: e2m1(nibble) * e4m3(scale) * global[row].

    The product e2m1 * e4m3 is exact in fp32; the global scale is the one rounding step.
    """
    out, half = m.packed.shape
    lut = _e2m1_lut(m.packed.device)
    p = m.packed.to(torch.int64)
    vals = torch.stack((lut[p & 15], lut[p >> 4]), dim=-1).view(out, half * 2 // 16, 16)  # [out, in/16, 16]
    s = m.scales.view(torch.float8_e4m3fn).float()  # [out, in/16]
    w = (vals * s[..., None]).view(out, half * 2)  # [out, in]
    return w * m.global_scale.float()[:, None]


def situ_glu(gate: Tensor, up: Tensor, beta: float, linear_beta: float | None) -> Tensor:
    """SiTU-GLU in fp32; beta = inf gives SiLU (the beta -> inf limit), for Kimi Linear's 'silu'."""
    g, u = gate.float(), up.float()
    if math.isinf(beta):
        ga = g * torch.sigmoid(g)
    else:
        ga = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return ga * u


class TorchBackend:
    """Reference ops. `rowwise_max`: up to this many rows, `linear` runs one GEMV per row."""

    name = "torch"

    def __init__(self, rowwise_max: int = 64, block_elems: int = 1 << 24):
        self.rowwise_max = rowwise_max
        self.block_elems = block_elems  # weights above this are converted to fp32 in row blocks

    # ---- dense ---------------------------------------------------------------------

    def linear(self, x: Tensor, w: Tensor) -> Tensor:
        """x [T, in] fp32, w [out, in] -> [T, out] fp32 (fp32 accumulation)."""
        x = x.float()
        out = w.shape[0]
        rows = max(1, self.block_elems // max(1, w.shape[1]))  # depends on w only, never on T
        parts = []
        for r0 in range(0, out, rows):
            w32 = w[r0 : r0 + rows].float()  # [out_blk, in]
            if x.shape[0] <= self.rowwise_max and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
                parts.append(torch.stack([torch.mv(w32, x[t]) for t in range(x.shape[0])]) if x.shape[0] else x.new_zeros(0, w32.shape[0]))
            else:
                parts.append(x @ w32.T)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def rmsnorm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        x = x.float()
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.float()

    def gated_rmsnorm(self, o: Tensor, gate: Tensor, w: Tensor, eps: float) -> Tensor:
        return self.rmsnorm(o, w, eps) * torch.sigmoid(gate.float())

    def layernorm(self, x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
        x = x.float()
        mu = x.mean(-1, keepdim=True)
        xc = x - mu
        return xc * torch.rsqrt(xc.square().mean(-1, keepdim=True) + eps) * w.float() + b.float()

    def l2norm(self, x: Tensor, eps: float) -> Tensor:
        x = x.float()
        return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)

    def situ_glu(self, gate: Tensor, up: Tensor, beta: float, linear_beta: float | None) -> Tensor:
        return situ_glu(gate, up, beta, linear_beta)

    # ---- KDA -----------------------------------------------------------------------

    def short_conv_step(self, z: Tensor, conv_state: Tensor, w: Tensor) -> Tensor:
        """z [T, P]; conv_state [T, P, W] updated in place; w [P, W] -> SiLU(conv) [T, P]."""
        conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
        conv_state[..., -1] = z
        return F.silu((conv_state * w.float()).sum(-1))

    def kda_step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
        """One delta-rule step, in place on state [T, H, K, V]; returns o = S^T q [T, H, V]."""
        state.mul_(torch.exp(g)[..., None])  # S <- diag(exp g) S
        pred = (state * k[..., None]).sum(-2)  # [T, H, V] = S^T k
        state.add_((beta[..., None, None] * k[..., None]) * (v - pred)[..., None, :])
        return (state * q[..., None]).sum(-2)  # [T, H, V], from the updated state

    # ---- MLA + indexer -------------------------------------------------------------

    def mla_decode(
        self, q_lat: Tensor, q_rot: Tensor, c_cache: Tensor, kr_cache: Tensor, scale: float, select: Tensor | None
    ) -> Tensor:
        """q_lat [H, R], q_rot [H, Dr], c_cache [n, R], kr_cache [n, Dr] -> sum_t p c_t [H, R]."""
        if select is not None:
            c_cache, kr_cache = c_cache[select], kr_cache[select]  # [m, R], [m, Dr]
        s = (q_lat @ c_cache.T + q_rot @ kr_cache.T) * scale  # [H, m]
        p = torch.softmax(s, dim=-1)
        return p @ c_cache  # [H, R]

    def indexer_scores(self, q: Tensor, w: Tensor, k_cache: Tensor) -> Tensor:
        """q [Hi, Di], w [Hi], k_cache [n, Di] -> I [n] = sum_h w[h] relu(q[h].k[s])."""
        return (torch.relu(q @ k_cache.T) * w[:, None]).sum(0)

    def select_topk(self, scores: Tensor, k: int) -> Tensor:
        from streamrt.model.indexer import select_topk

        return select_topk(scores, k)

    # ---- MoE -----------------------------------------------------------------------

    def router(
        self,
        x: Tensor,
        w_gate: Tensor,
        bias: Tensor,
        k: int,
        renormalize: bool,
        scale: float,
        n_group: int = 1,
        topk_group: int = 1,
    ) -> tuple[Tensor, Tensor]:
        """x [T, D] -> (ids [T, k] by descending biased score, weights [T, k] fp32, unbiased)."""
        s = torch.sigmoid(self.linear(x, w_gate))  # [T, E] fp32
        choice = s + bias.float()  # bias only chooses
        if n_group > 1 and topk_group < n_group:
            T, E = choice.shape
            grp = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(grp, dtype=torch.bool).scatter(1, grp.topk(topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
        ids = torch.topk(choice, k, dim=-1, sorted=True).indices  # [T, k]
        w = s.gather(-1, ids)
        if renormalize and k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * scale

    def expert_ffn(
        self,
        z: Tensor,
        ids: Tensor,
        weights: Tensor,
        experts: Mapping[int, ExpertWeights],
        beta: float,
        linear_beta: float | None,
    ) -> Tensor:
        """z [T, Dl]; out[t] = sum_j (in order j = 0..k-1) weights[t, j] * E_ids[t,j](z_t) -> [T, Dl].

        Each expert used is dequantised once (one at a time: the bank never is).
        """
        ids = ids.to(z.device)  # ids may arrive on the host (the model passes the provider's copy)
        T, k = ids.shape
        outs = z.new_zeros(T, k, z.shape[-1], dtype=torch.float32)  # [T, k, Dl]
        for e in torch.unique(ids).tolist():
            rows, slots = (ids == e).nonzero(as_tuple=True)
            ew = experts[e]
            zr = z[rows]  # [m, Dl]
            h = situ_glu(self.linear(zr, dequant_nvfp4(ew.gate)), self.linear(zr, dequant_nvfp4(ew.up)), beta, linear_beta)
            outs = outs.index_put((rows, slots), self.linear(h, dequant_nvfp4(ew.down)))  # [m, Dl]
        w = weights.float()
        acc = outs[:, 0] * w[:, 0:1]
        for j in range(1, k):
            acc = acc + outs[:, j] * w[:, j : j + 1]
        return acc

    # ---- AttnRes -------------------------------------------------------------------

    def attnres_mix(self, prefix: Tensor, blocks: Tensor, wq: Tensor, eps: float) -> Tensor:
        """prefix [T, D], blocks [T, nb, D], wq [D] -> softmax-weighted sum of raw sources [T, D]."""
        v = torch.cat((blocks.float(), prefix.float()[:, None, :]), dim=1)  # [T, nb+1, D]
        kn = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)  # weightless RMSNorm keys
        p = torch.softmax((kn * wq.float()).sum(-1), dim=-1)  # [T, nb+1]
        return (p[..., None] * v).sum(1)  # [T, D]
