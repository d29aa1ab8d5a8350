"""The three-term bf16 split of the nvrtc prefill GEMM (backends/bf16x3.py), on the CPU: the
terms sum to x exactly, so the GEMM's only error is the accumulators' (the GEMM itself needs
CUDA: tests/test_kernels_gpu.py)."""

import torch

from streamrt.backends.bf16x3 import bf16_terms


def test_three_bf16_terms_sum_to_x_exactly():
    gen = torch.Generator().manual_seed(11)
    mant = torch.randn(4096, generator=gen)
    expo = torch.randint(-60, 60, (4096,), generator=gen).float()
    x = (mant * torch.exp2(expo)).float()  # values over 36 decades, every mantissa bit random
    hi, mid, lo = bf16_terms(x)
    assert hi.dtype == mid.dtype == lo.dtype == torch.bfloat16
    total = hi.double() + mid.double() + lo.double()
    assert torch.equal(total, x.double())
    assert not torch.equal(hi.double(), x.double())  # the split is not the identity on these values
    assert float((mid.double().abs() / x.double().abs()).max()) <= 2.0**-8
