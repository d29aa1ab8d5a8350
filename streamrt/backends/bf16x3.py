"""An fp32-accurate prefill GEMM on bf16 tensor cores: x [T, K] fp32 times w [N, K] bf16.

x is split into three bf16 terms, hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid).
Each difference is exact in fp32 and each term keeps 8 of x's 24 significant bits, so
hi + mid + lo == x (barring bf16 underflow below ~1e-38). The products of bf16 values are
exact in the tensor cores' fp32 accumulators, so x @ w.T = lo @ w.T + mid @ w.T + hi @ w.T
differs from an fp32 GEMM only by fp32 rounding: three bf16 tensor-core GEMMs instead of one
fp32 GEMM on the CUDA cores (an H200's datasheet: 989 against 67 TFLOP/s dense), and no fp32
copy of the weights.
"""

from __future__ import annotations

import torch
from torch import Tensor


def bf16_terms(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x fp32 -> (hi, mid, lo) bf16 with hi + mid + lo == x."""
    hi = x.bfloat16()
    r = x - hi.float()
    mid = r.bfloat16()
    lo = (r - mid.float()).bfloat16()
    return hi, mid, lo


def mm_bf16x3(x: Tensor, w: Tensor) -> Tensor:
    """x [T, K] fp32, w [N, K] bf16 (CUDA) -> [T, N] fp32; smallest term first."""
    hi, mid, lo = bf16_terms(x)
    wt = w.T
    out = torch.mm(lo, wt, out_dtype=torch.float32)
    out += torch.mm(mid, wt, out_dtype=torch.float32)
    out += torch.mm(hi, wt, out_dtype=torch.float32)
    return out
