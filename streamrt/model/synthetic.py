"""Random, well-scaled weights for a model and its NVFP4 experts (tests, benchmarks).

Deterministic in `seed`. Linear weights ~ N(0, 1/in); norm gains ~ 1 + 0.1 N; A_log has
its per-head entries log U(1, 16) and zero padding; NVFP4 experts are random nibbles with
E4M3 block scales in [2^-2, 2^2) and a per-row global scale of about 1/(4 sqrt(in)).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from streamrt.expert_weights import ExpertWeights, NVFP4Matrix


def init_random_(model, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Fill every parameter and buffer of `model` in place (fp32 draws, stored as dtype)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    H = cfg.kda_num_heads
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            t.copy_(_draw(name, tuple(t.shape), gen, H).to(dtype))


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator, kda_heads: int) -> Tensor:
    randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    if name.endswith("A_log"):
        a = torch.zeros(shape)
        a[:kda_heads] = torch.log(1 + 15 * torch.rand(kda_heads, generator=gen))
        return a
    if name.endswith("dt_bias"):
        return 0.5 * randn(*shape)
    if name.endswith("e_score_correction_bias"):
        return 0.05 * randn(*shape)
    if name.endswith("k_norm.bias"):
        return 0.1 * randn(*shape)
    if "norm" in name.rsplit(".", 2)[-2] and name.endswith("weight"):  # every *norm.weight
        return 1 + 0.1 * randn(*shape)
    if "conv1d" in name:
        return randn(*shape) / math.sqrt(shape[-1])
    if name.endswith("embed_tokens.weight"):
        return randn(*shape)
    return randn(*shape) / math.sqrt(shape[-1])  # [out, in] linear, incl. AttnRes [1, D] pseudo-queries


def random_nvfp4(out: int, inn: int, gen: torch.Generator) -> NVFP4Matrix:
    """Random valid NVFP4: any nibble; E4M3 scales 2^-2..2^2 (never NaN); positive global per row."""
    packed = torch.randint(0, 256, (out, inn // 2), dtype=torch.uint8, generator=gen)
    exp = torch.randint(5, 9, (out, inn // 16), generator=gen)  # exponent field, bias 7
    man = torch.randint(0, 8, (out, inn // 16), generator=gen)
    scales = ((exp << 3) | man).to(torch.uint8)
    glob = (0.5 + torch.rand(out, generator=gen)) / (4 * math.sqrt(inn))
    return NVFP4Matrix(packed, scales, glob.float())


def random_experts(cfg, seed: int = 0) -> dict[tuple[int, int], ExpertWeights]:
    """Every routed expert of every MoE layer (tiny geometries only)."""
    gen = torch.Generator().manual_seed(seed)
    I, Dl = cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    return {
        (layer, e): ExpertWeights(random_nvfp4(I, Dl, gen), random_nvfp4(I, Dl, gen), random_nvfp4(Dl, I, gen))
        for layer in cfg.moe_layers
        for e in range(cfg.num_experts)
    }
