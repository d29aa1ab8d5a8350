"""The routed expert FFN of a prefill chunk as grouped GEMMs on the tensor cores (cuBLAS).

A prefill chunk routes hundreds to thousands of rows to each expert; the decode kernels
(one GEMV per (row, expert) pair) read the expert's weights once per 64 pairs. Here each
expert is expanded once per call and its rows go through two GEMMs, gate|up and down:

  weights  e2m1 * e4m3 is exact in fp16 (at most 6 significant bits, 2^-10 .. 2688), so the
           expanded matrix loses nothing; gate and up are stacked into one [2I, Dl] matrix; the
           per-row global scales are applied to the fp32 products, as the decode kernels do.
  rows     each row x (a token's z, a pair's SiTU output h) is scaled by its power-of-two
           row scale s = 2^ceil(log2 max|x|), so |x / s| <= 1, and goes in as fp16, with fp32
           accumulation and output. Two modes (`PREFILL_ROWS`, the backend's `prefill_rows`):
    "fp16"   (default) rounded once: v = x / s, |fp16(v) - v| <= 2^-11 |v| (|v| >= 2^-14) or
             <= 2^-25 (fp16 subnormals), so an output sum_i w_i x_i is off by at most
             2^-11 sum_i |w_i x_i| + 2^-25 s sum_i |w_i|, plus the fp32 accumulation's own.
             Per element that is an eighth of the bf16 rounding (2^-8) of the hidden state
             that the model's bf16 runs make anyway; h is rounded the same way (2^-11 of
             each element) before the down GEMM.
    "split"  two halves hi = fp16(v), lo = fp16(v - hi), about 22 significant bits (2^-22 of
             each element, 2^-25 s absolute): the decode path's accuracy at twice the flops.

Once per chunk: the row scale and fp16 rounding of each token's z (not per pair), and one
gather of those rows into expert order, so each expert's GEMM reads a contiguous slice. Per
expert: the gate|up expansion and GEMM, one kernel for SiTU -> the down GEMM's fp16 rows, the
down expansion and GEMM, one kernel that scales the result and writes it to the pairs' rows
of y. Same arithmetic as the kernels of the nvrtc backend (`kernels/nvfp4_gemm.cu`) up to the
order of the fp32 accumulation; the result per (row, slot) pair goes to the same fixed-order
weighted sum as decode.
"""

from __future__ import annotations

import torch
from torch import Tensor

from streamrt.expert_weights import NVFP4Matrix, RoutedExperts
from streamrt.fp4 import E2M1_VALUES
from streamrt.ops import situ_glu

PREFILL_ROWS = ("fp16", "split")  # the row modes (module doc); the first is the default

_LUT: dict[torch.device, Tensor] = {}


def _row_scale(x: Tensor) -> Tensor:
    """[n, c] -> [n] fp32: 2^ceil(log2 max|row|), 1 for a zero row."""
    amax = x.abs().amax(dim=1)
    fr, e = torch.frexp(amax)  # amax = fr * 2^e, fr in [0.5, 1), as the kernels do
    e = torch.where(fr == 0.5, e - 1, e)
    # 2^e from its bits (exact on every device): normal, else subnormal (amax < 2^-126)
    one = torch.ones_like(e)
    bits = torch.where(e >= -126, (e + 127).clamp(max=255) << 23, one << (e + 149).clamp(min=0))
    return torch.where(amax > 0, bits.view(torch.float32), 1.0)


def _fp16(v: Tensor, split: bool) -> Tensor:
    """v [n, c] fp32, |v| <= 1 -> [n, c] fp16, or split [2n, c] (hi rows, then lo rows)."""
    hi = v.to(torch.float16)
    return torch.cat((hi, (v - hi.float()).to(torch.float16))) if split else hi


def _halves_sum(y: Tensor, n: int, split: bool) -> Tensor:
    return y[:n] + y[n:] if split else y


class TorchFp16:
    """The conversions around the GEMMs in torch ops (any device; the CPU twin). The nvrtc
    backend has a kernel for each (kernels/nvfp4_gemm.cu) with the same methods and results."""

    def fp16_weights(self, *mats: NVFP4Matrix) -> Tensor:
        """Matrices [out_i, in] -> [sum out_i, in] fp16 = e2m1(nibble) * e4m3(block scale),
        stacked by rows, exact; the global scales are left out."""
        return torch.cat([self._fp16_weight(m) for m in mats]) if len(mats) > 1 else self._fp16_weight(mats[0])

    def _fp16_weight(self, m: NVFP4Matrix) -> Tensor:
        lut = _LUT.get(m.packed.device)
        if lut is None:
            lut = _LUT[m.packed.device] = torch.tensor(E2M1_VALUES, dtype=torch.float16, device=m.packed.device)
        out, half = m.packed.shape
        p = m.packed.to(torch.int32)
        vals = torch.stack((lut[p & 15], lut[p >> 4]), dim=-1).view(out, half // 8, 16)
        scales = m.scales.view(torch.float8_e4m3fn).to(torch.float16)  # [out, in/16]
        return (vals * scales[..., None]).view(out, half * 2)

    def fp16_rows(self, x: Tensor, split: bool) -> tuple[Tensor, Tensor]:
        """x [n, c] fp32 -> (rows [n, c] fp16, or [2n, c] hi then lo; row scale [n] fp32):
        x = s * rows (or s * (hi + lo)) up to the rounding of the module doc."""
        s = _row_scale(x)
        return _fp16(x / s[:, None], split), s

    def situ_rows(self, gu: Tensor, xscale: Tensor, gate_glob: Tensor, up_glob: Tensor, beta: float,
                  linear_beta: float | None, split: bool) -> tuple[Tensor, Tensor]:
        """gu [m or 2m, 2I] fp32 (the gate|up GEMM of m pairs' rows), xscale [m] -> the down
        GEMM's rows of h = situ_glu(gate, up) and their row scales (as `fp16_rows`)."""
        m = xscale.shape[0]
        I = gate_glob.shape[0]
        g = _halves_sum(gu, m, split) * xscale[:, None]
        h = situ_glu(g[:, :I] * gate_glob[None, :], g[:, I:] * up_glob[None, :], beta, linear_beta)
        return self.fp16_rows(h, split)

    def scatter_rows(self, d: Tensor, hscale: Tensor, glob: Tensor, pairs: Tensor, y: Tensor, split: bool) -> None:
        """y[pairs[r]] = d[r] (+ d[m + r] when split) * hscale[r] * glob, for the m = len(pairs) rows."""
        y.index_copy_(0, pairs, _halves_sum(d, pairs.shape[0], split) * hscale[:, None] * glob[None, :])


TORCH_FP16 = TorchFp16()


def mm16(rows: Tensor, w16: Tensor) -> Tensor:
    """rows [n, in] fp16 @ w16 [out, in].T -> [n, out] fp32 (fp32 accumulation)."""
    if rows.is_cuda:
        return torch.mm(rows, w16.T, out_dtype=torch.float32)
    return rows.float() @ w16.float().T  # the CPU twin: the same fp16 operands, every product exact in fp32


def mm_nvfp4(x: Tensor, m: NVFP4Matrix, rows: str = PREFILL_ROWS[0], conv=TORCH_FP16) -> Tensor:
    """x [n, in] fp32 @ m.T -> [n, out] fp32 on the tensor cores, rows in mode `rows`: the
    grouped path's conversions for one matrix."""
    split = _split(rows)
    x16, s = conv.fp16_rows(x, split)
    y = torch.empty(x.shape[0], m.shape[0], dtype=torch.float32, device=x.device)
    rows = torch.arange(x.shape[0], device=x.device)
    conv.scatter_rows(mm16(x16, conv.fp16_weights(m)), s, m.global_scale, rows, y, split)
    return y


def _split(rows: str) -> bool:
    if rows not in PREFILL_ROWS:
        raise ValueError(f"prefill_rows must be one of {PREFILL_ROWS}, got {rows!r}")
    return rows == "split"


def grouped_expert_pairs(
    z: Tensor, ids, experts: RoutedExperts, beta: float, linear_beta: float | None,
    late: set[int] = frozenset(), conv=TORCH_FP16, rows: str = PREFILL_ROWS[0],
) -> Tensor:
    """z [T, Dl] fp32, ids [T, k] on the host (a tensor or lists) -> y [T*k, Dl] fp32:
    y[t*k + j] = E_ids[t, j](z_t). Experts in `late` (copies still in flight) are computed last;
    `conv` does the conversions (TorchFp16, or the nvrtc backend's kernels); `rows` is the row
    mode (module doc)."""
    split = _split(rows)
    T, Dl = z.shape
    ids = torch.as_tensor(ids, dtype=torch.int64).reshape(T, -1)
    k = ids.shape[1]
    z16, zs = conv.fp16_rows(z, split)  # once per token: [T or 2T, Dl], [T]; queued before the host work below
    # Pairs (t*k + j) in expert order, late experts last, ascending within an expert: host
    # tensor ops (a chunk has tens of thousands of pairs; the sort key is small, so int16 keys
    # take the radix sort, and a count per key gives the experts and their sizes).
    flat = ids.reshape(-1)
    span = int(flat.max()) + 1
    key = flat + span * torch.isin(flat, torch.tensor(sorted(late), dtype=torch.int64)) if late else flat
    pairs_h = torch.sort(key.to(torch.int16) if 2 * span <= 32767 else key, stable=True)[1]  # [P]
    sizes = torch.bincount(key)
    keys = sizes.nonzero().view(-1)
    order, counts = (keys % span).tolist(), sizes[keys].tolist()
    # An expert's rows are one slice [f*a, f*b) of the gathered rows (f = 2 when split: its hi
    # rows, then its lo rows, taken from the token rows' hi and lo halves).
    tok = pairs_h // k
    P = pairs_h.shape[0]
    if split:  # sorted pair i of an expert's [a, b): its hi row at a + i, its lo row at b + i
        n = torch.tensor(counts)
        hi_at = torch.arange(P) + torch.repeat_interleave(n.cumsum(0) - n, n)
        gather_h = torch.empty(2 * P, dtype=torch.int64)
        gather_h[hi_at] = tok
        gather_h[hi_at + torch.repeat_interleave(n, n)] = tok + T
    else:
        gather_h = tok
    idx = torch.cat((pairs_h, tok, gather_h))
    if z.is_cuda:  # page-locked, so the copy queues behind the row conversion instead of waiting for it
        idx = idx.pin_memory()
    idx = idx.to(z.device, non_blocking=True)
    pairs, tok, gather = idx[:P], idx[P : 2 * P], idx[2 * P :]
    x16 = z16.index_select(0, gather)  # [P or 2P, Dl], expert-sorted
    xs = zs.index_select(0, tok)  # [P] the pairs' row scales
    f = 2 if split else 1
    y = torch.empty(T * k, Dl, dtype=torch.float32, device=z.device)
    a = 0
    for e, n in zip(order, counts):
        b = a + n
        ew = experts.take(e)  # a streamed expert: the compute stream waits for its copy here
        gu = mm16(x16[f * a : f * b], conv.fp16_weights(ew.gate, ew.up))  # [f n, 2I]
        h16, hs = conv.situ_rows(gu, xs[a:b], ew.gate.global_scale, ew.up.global_scale, beta, linear_beta, split)
        conv.scatter_rows(mm16(h16, conv.fp16_weights(ew.down)), hs, ew.down.global_scale, pairs[a:b], y, split)
        a = b
    return y
