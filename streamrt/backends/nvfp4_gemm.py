"""The routed expert FFN of a prefill chunk as grouped GEMMs on the tensor cores (cuBLAS).

A prefill chunk routes hundreds to thousands of rows to each expert; the decode kernels
(one GEMV per (row, expert) pair) read the expert's weights once per 64 pairs. Here each
expert is expanded once per call and its rows are gathered into one GEMM per matrix:

  weights  e2m1 * e4m3 is exact in fp16 (at most 6 significant bits, 2^-10 .. 2688), so the
           expanded matrix loses nothing; the per-row global scale is applied to the fp32
           product, as the decode kernels do.
  rows     fp32 activations as two fp16 halves (hi + lo, after a power-of-two row scale that
           keeps them in range: about 22 significant bits), stacked into one GEMM of 2m rows
           with fp32 accumulation and output; the halves are summed in fp32.

Same arithmetic as the decode path up to the order of the fp32 accumulation (a tolerance,
not bits; `tests/test_kernels_gpu.py`). The result per (row, slot) pair goes to the same
fixed-order weighted sum as decode.
"""

from __future__ import annotations

import torch
from torch import Tensor

from streamrt.expert_weights import NVFP4Matrix, RoutedExperts
from streamrt.fp4 import E2M1_VALUES
from streamrt.ops import situ_glu

_LUT: dict[torch.device, Tensor] = {}


class TorchFp16:
    """The two conversions in torch ops (any device; the CPU twin). The nvrtc backend has a
    kernel for each (kernels/nvfp4_gemm.cu) with the same methods and the same results."""

    def fp16_weights(self, m: NVFP4Matrix) -> Tensor:
        """[out, in] fp16 = e2m1(nibble) * e4m3(block scale), exact; the global scale is left out."""
        lut = _LUT.get(m.packed.device)
        if lut is None:
            lut = _LUT[m.packed.device] = torch.tensor(E2M1_VALUES, dtype=torch.float16, device=m.packed.device)
        out, half = m.packed.shape
        p = m.packed.to(torch.int32)
        vals = torch.stack((lut[p & 15], lut[p >> 4]), dim=-1).view(out, half // 8, 16)
        scales = m.scales.view(torch.float8_e4m3fn).to(torch.float16)  # [out, in/16]
        return (vals * scales[..., None]).view(out, half * 2)

    def fp16_halves(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [n, in] fp32 -> (hi and lo rows [2n, in] fp16, row scale [n, 1] fp32): x = s * (hi + lo)."""
        amax = x.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax))), torch.ones_like(amax))
        xs = x / scale  # |xs| <= 1
        hi = xs.to(torch.float16)
        return torch.cat((hi, (xs - hi.float()).to(torch.float16))), scale


TORCH_FP16 = TorchFp16()


def mm_nvfp4(x: Tensor, m: NVFP4Matrix, conv=TORCH_FP16) -> Tensor:
    """x [n, in] fp32 @ m.T -> [n, out] fp32 on the tensor cores (see the module doc)."""
    return mm_halves(conv.fp16_halves(x), m, conv)


def mm_halves(split: tuple[Tensor, Tensor], m: NVFP4Matrix, conv=TORCH_FP16) -> Tensor:
    """mm_nvfp4 of rows already split (`conv.fp16_halves(x)`): one split serves every matrix
    that reads the same rows (an expert's gate and up)."""
    halves, scale = split
    n = scale.shape[0]
    w16 = conv.fp16_weights(m)
    if halves.is_cuda:
        y = torch.mm(halves, w16.T, out_dtype=torch.float32)  # [2n, out]
    else:  # the CPU twin (tests): the same fp16 operands, every product exact in fp32
        y = halves.float() @ w16.float().T
    return (y[:n] + y[n:]) * scale * m.global_scale.float()[None, :]


def grouped_expert_pairs(
    z: Tensor, id_rows: list[list[int]], experts: RoutedExperts, beta: float, linear_beta: float | None,
    late: set[int] = frozenset(), conv=TORCH_FP16,
) -> Tensor:
    """z [T, Dl] fp32, id_rows [T][k] (host) -> y [T*k, Dl] fp32: y[t*k + j] = E_ids[t][j](z_t).
    Experts in `late` (copies still in flight) are computed last; `conv` does the two fp16
    conversions (TorchFp16, or the nvrtc backend's kernels)."""
    T, Dl = z.shape
    k = len(id_rows[0]) if id_rows else 0
    by_expert: dict[int, list[int]] = {}
    for t, row in enumerate(id_rows):
        for j, e in enumerate(row):
            by_expert.setdefault(e, []).append(t * k + j)
    order = sorted(by_expert, key=lambda e: (e in late, e))
    flat = torch.tensor([p for e in order for p in by_expert[e]], dtype=torch.int64).to(z.device, non_blocking=True)
    y = torch.empty(T * k, Dl, dtype=torch.float32, device=z.device)
    at = 0
    for e in order:
        pairs = flat[at : at + len(by_expert[e])]
        at += len(by_expert[e])
        ew = experts.take(e)  # a streamed expert: the compute stream waits for its copy here
        zr = conv.fp16_halves(z.index_select(0, pairs // k))  # split once for gate and up
        h = situ_glu(mm_halves(zr, ew.gate, conv), mm_halves(zr, ew.up, conv), beta, linear_beta)
        y.index_copy_(0, pairs, mm_nvfp4(h, ew.down, conv))
    return y
