"""The prefill expert FFN as grouped GEMMs (backends/nvfp4_gemm.py), on its CPU twin: the fp16
expansion of NVFP4 weights is exact, the hi + lo activation split keeps about fp32 accuracy, and
the per-pair outputs match a float64 reference of the routed experts."""

from __future__ import annotations

import math

import numpy as np
import torch

import reference as ref
from streamrt.backends.nvfp4_gemm import TORCH_FP16, grouped_expert_pairs, mm_nvfp4
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix, RoutedExperts


def _nvfp4(g, rows: int, cols: int) -> NVFP4Matrix:
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g).to(torch.uint8)
    normal = torch.randint(0x28, 0x49, (rows, cols // 16), generator=g)
    sub = torch.randint(0x01, 0x08, (rows, cols // 16), generator=g)  # subnormal block scales too
    u = torch.rand(rows, cols // 16, generator=g)
    sc = torch.where(u < 0.1, sub, normal) | torch.where(u > 0.97, 0x80, 0)  # and a few negative
    glob = (0.5 + torch.rand(rows, generator=g)) * (0.6 / math.sqrt(cols))
    return NVFP4Matrix(packed, sc.to(torch.uint8), glob.float())


def _f64(m: NVFP4Matrix) -> np.ndarray:
    return ref.dequant_nvfp4(m.packed.numpy(), m.scales.numpy(), m.global_scale.numpy())


def test_fp16_expansion_is_exact():
    g = torch.Generator().manual_seed(1)
    m = _nvfp4(g, 48, 256)
    w16 = TORCH_FP16.fp16_weights(m).double().numpy()
    assert np.array_equal(w16 * m.global_scale.double().numpy()[:, None], _f64(m))


def test_split_product_is_fp32_accurate_over_a_wide_range():
    g = torch.Generator().manual_seed(2)
    m = _nvfp4(g, 40, 192)
    x = torch.randn(9, 192, generator=g) * torch.logspace(-6, 6, 9)[:, None]  # rows far out of fp16's range
    x[4] = 0.0  # a zero row (scale 1)
    got = mm_nvfp4(x, m).double().numpy()
    want = x.double().numpy() @ _f64(m).T
    assert not got[4].any()
    keep = [i for i in range(9) if i != 4]
    err = np.abs(got[keep] - want[keep]).max(axis=1) / np.abs(want[keep]).max(axis=1)
    assert (err < 2e-6).all(), err


def test_grouped_pairs_match_the_float64_experts():
    g = torch.Generator().manual_seed(3)
    E, T, k, Dl, I = 6, 11, 3, 64, 96
    experts = {e: ExpertWeights(_nvfp4(g, I, Dl), _nvfp4(g, I, Dl), _nvfp4(g, Dl, I)) for e in range(E)}
    ids = [torch.randperm(E, generator=g)[:k].tolist() for _ in range(T)]
    z = torch.randn(T, Dl, generator=g)
    routed = RoutedExperts(experts, torch.tensor(ids))
    y = grouped_expert_pairs(z, ids, routed, 4.0, 25.0, late={2}).double().numpy()  # [T*k, Dl]
    f64 = {e: (_f64(w.gate), _f64(w.up), _f64(w.down)) for e, w in experts.items()}
    for t in range(T):
        for j, e in enumerate(ids[t]):
            w1, w3, w2 = f64[e]
            want = w2 @ ref.situ_glu(w1 @ z[t].double().numpy(), w3 @ z[t].double().numpy(), 4.0, 25.0)
            assert np.abs(y[t * k + j] - want).max() <= 1e-5 * np.abs(want).max(), (t, j, e)
