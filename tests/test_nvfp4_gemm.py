"""The prefill expert FFN as grouped GEMMs (backends/nvfp4_gemm.py), on its CPU twin, against
float64 references written from the math: the fp16 expansion of NVFP4 weights is exact (gate
and up stacked alike), the single fp16 row mode stays within its documented bound and the hi + lo
split within fp32 accuracy, the pairs land at their rows of y, and late experts come last, each
taken just before its own GEMMs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import reference as ref
from streamrt.backends.nvfp4_gemm import TORCH_FP16, TorchFp16, grouped_expert_pairs, mm16, mm_nvfp4
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix, RoutedExperts

U16, U32 = 2.0**-11, 2.0**-24  # unit roundoff of fp16 and fp32


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


def _pow2_scale(x: np.ndarray) -> np.ndarray:
    """[n, c] -> [n, 1]: the smallest power of two >= max |row| (1 for a zero row)."""
    amax = np.abs(x).max(axis=1, keepdims=True)
    return np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.where(amax > 0, amax, 1.0))), 1.0)


def _fp16_rows64(x: np.ndarray) -> np.ndarray:
    """The single mode's rows as the module doc defines them: s * fp16(x / s)."""
    s = _pow2_scale(x)
    return (x / s).astype(np.float16).astype(np.float64) * s


def _product_bound(x: np.ndarray, w: np.ndarray, rel: float) -> np.ndarray:
    """Bound on |x @ w.T - exact| with each input element held to `rel` of itself (and 2^-25 s
    absolute below fp16's normal range), plus fp32 accumulation over n terms and two scalings."""
    n = x.shape[1]
    s = _pow2_scale(x)
    ax, aw = np.abs(x), np.abs(w)
    return rel * ax @ aw.T + 2.0**-25 * s * aw.sum(axis=1)[None, :] + (n + 2) * U32 * (1 + U16) * (ax @ aw.T)


def test_fp16_expansion_is_exact_and_gate_up_stack():
    g = torch.Generator().manual_seed(1)
    m, m2 = _nvfp4(g, 48, 256), _nvfp4(g, 32, 256)
    w16 = TORCH_FP16.fp16_weights(m).double().numpy()
    assert np.array_equal(w16 * m.global_scale.double().numpy()[:, None], _f64(m))
    both = TORCH_FP16.fp16_weights(m, m2)
    assert torch.equal(both, torch.cat((TORCH_FP16.fp16_weights(m), TORCH_FP16.fp16_weights(m2))))


def test_single_rows_within_their_bound_and_not_split_accurate():
    g = torch.Generator().manual_seed(2)
    m = _nvfp4(g, 40, 192)
    w = _f64(m)
    x = torch.randn(10, 192, generator=g) * torch.logspace(-6, 6, 10)[:, None]  # rows far out of fp16's range
    x[4] = 0.0  # a zero row (scale 1)
    # row 9: every element just below a rounding midpoint, signs with output 0's weights: the
    # fp16 error is 0.49 ulp of every element, all in one direction
    x[9] = torch.from_numpy(np.sign(w[0]) * 0.5 * (1 + 0.98 * U16))
    x64 = x.double().numpy()
    got = mm_nvfp4(x, m, "fp16").double().numpy()
    err = np.abs(got - x64 @ w.T)
    assert not got[4].any()
    assert (err <= _product_bound(x64, w, U16)).all(), (err / _product_bound(x64, w, U16)).max()
    assert (err > _product_bound(x64, w, 2.0**-22)).any(), "single fp16 rows as accurate as the split: not rounded once"
    assert err[9, 0] > 0.45 * U16 * np.abs(x64[9]) @ np.abs(w[0])
    # the same rows rounded as documented, then multiplied exactly: only fp32 accumulation apart
    want = _fp16_rows64(x64) @ w.T
    assert (np.abs(got - want) <= _product_bound(x64, w, 0.0)).all()


def test_split_rows_are_fp32_accurate_over_a_wide_range():
    g = torch.Generator().manual_seed(3)
    m = _nvfp4(g, 40, 192)
    w = _f64(m)
    x = torch.randn(9, 192, generator=g) * torch.logspace(-6, 6, 9)[:, None]
    x[4] = 0.0
    x64 = x.double().numpy()
    got = mm_nvfp4(x, m, "split").double().numpy()
    want = x64 @ w.T
    assert not got[4].any()
    assert (np.abs(got - want) <= _product_bound(x64, w, 2.0**-22)).all()
    keep = [i for i in range(9) if i != 4]
    err = np.abs(got[keep] - want[keep]).max(axis=1) / np.abs(want[keep]).max(axis=1)
    assert (err < 2e-6).all(), err


def test_bad_row_mode_is_refused():
    g = torch.Generator().manual_seed(4)
    with pytest.raises(ValueError, match="prefill_rows"):
        mm_nvfp4(torch.randn(2, 32, generator=g), _nvfp4(g, 16, 32), "bf16")


def test_scatter_rows_land_at_their_pairs():
    g = torch.Generator().manual_seed(5)
    m, cols = 7, 24
    pairs = torch.randperm(20, generator=g)[:m]
    hs = torch.exp2(torch.randint(-5, 5, (m,), generator=g).float())
    glob = torch.rand(cols, generator=g) + 0.5
    for split in (False, True):
        d = torch.randn((1 + split) * m, cols, generator=g)
        y = torch.full((20, cols), float("nan"))
        TORCH_FP16.scatter_rows(d, hs, glob, pairs, y, split)
        d64 = d.double().numpy()
        rows = d64[:m] + d64[m:] if split else d64
        want = rows * hs.double().numpy()[:, None] * glob.double().numpy()[None, :]
        np.testing.assert_allclose(y[pairs].double().numpy(), want, rtol=3 * U32, atol=0)
        others = torch.ones(20, dtype=torch.bool)
        others[pairs] = False
        assert torch.isnan(y[others]).all(), "rows of no pair were written"


def _experts(g, E, Dl, I):
    return {e: ExpertWeights(_nvfp4(g, I, Dl), _nvfp4(g, I, Dl), _nvfp4(g, Dl, I)) for e in range(E)}


def _ffn64(z64, ew, round_rows: bool) -> np.ndarray:
    """One expert on rows z64 in float64; round_rows: its inputs rounded as the single mode's."""
    w1, w3, w2 = _f64(ew.gate), _f64(ew.up), _f64(ew.down)
    x = _fp16_rows64(z64) if round_rows else z64
    h = ref.situ_glu(x @ w1.T, x @ w3.T, 4.0, 25.0)
    return (_fp16_rows64(h) if round_rows else h) @ w2.T


@pytest.mark.parametrize("rows", ["fp16", "split"])
def test_grouped_pairs_match_the_float64_experts(rows):
    g = torch.Generator().manual_seed(6)
    E, T, k, Dl, I = 6, 11, 3, 64, 96
    experts = _experts(g, E, Dl, I)
    ids = [torch.randperm(E, generator=g)[:k].tolist() for _ in range(T)]
    z = torch.randn(T, Dl, generator=g) * torch.logspace(-2, 1.5, T)[:, None]
    routed = RoutedExperts(experts, torch.tensor(ids))
    y = grouped_expert_pairs(z, ids, routed, 4.0, 25.0, late={2}, rows=rows).double().numpy()  # [T*k, Dl]
    z64 = z.double().numpy()
    worst_exact = 0.0
    for t in range(T):
        for j, e in enumerate(ids[t]):
            got = y[t * k + j]
            exact = _ffn64(z64[t : t + 1], experts[e], False)[0]
            scale = np.abs(exact).max()
            if rows == "split":
                assert np.abs(got - exact).max() <= 1e-5 * scale, (t, j, e)
                continue
            # the documented roundings emulated in float64: apart only by fp32 arithmetic (and
            # the fp16 rounding of an h element that sits at a midpoint within it)
            emulated = _ffn64(z64[t : t + 1], experts[e], True)[0]
            assert np.abs(got - emulated).max() <= 2e-5 * scale, (t, j, e)
            assert np.abs(got - exact).max() <= 8 * U16 * scale, (t, j, e)
            worst_exact = max(worst_exact, np.abs(got - exact).max() / scale)
    if rows == "fp16":
        assert worst_exact > 1e-5, "single fp16 rows as accurate as the split: not rounded once"


def test_gate_up_as_one_gemm_equals_two():
    g = torch.Generator().manual_seed(7)
    Dl, I, m = 64, 96, 5
    ew = _experts(g, 1, Dl, I)[0]
    x16, _ = TORCH_FP16.fp16_rows(torch.randn(m, Dl, generator=g), False)
    gu = mm16(x16, TORCH_FP16.fp16_weights(ew.gate, ew.up))
    gate, up = mm16(x16, TORCH_FP16.fp16_weights(ew.gate)), mm16(x16, TORCH_FP16.fp16_weights(ew.up))
    # the same exact products: fp32 sums of one order apart at most by accumulation
    bound = Dl * U32 * (x16.float().abs() @ TORCH_FP16.fp16_weights(ew.gate, ew.up).float().abs().T)
    assert ((gu - torch.cat((gate, up), dim=1)).abs() <= bound).all()


class _Log(TorchFp16):
    def __init__(self, log):
        self.log = log

    def fp16_weights(self, *mats):
        self.log.append(("weights", len(mats)))
        return super().fp16_weights(*mats)


class _Streamed(RoutedExperts):
    def __init__(self, experts, ids, late, log):
        super().__init__(experts, ids)
        self.late, self.log = late, log

    def pending(self, e):
        return e in self.late

    def take(self, e):
        self.log.append(("take", e))
        return super().take(e)


def test_late_experts_last_each_taken_before_its_own_gemms():
    g = torch.Generator().manual_seed(8)
    E, T, k, Dl, I = 8, 5, 4, 32, 48
    experts = _experts(g, E, Dl, I)
    ids = [torch.randperm(E, generator=g)[:k].tolist() for _ in range(T)]
    used = sorted({e for r in ids for e in r})
    late = {used[0], used[2]}
    log: list = []
    z = torch.randn(T, Dl, generator=g)
    grouped_expert_pairs(z, ids, _Streamed(experts, torch.tensor(ids), late, log), 4.0, 25.0, late=late, conv=_Log(log))
    order = [e for e in used if e not in late] + sorted(late)
    assert log == [ev for e in order for ev in (("take", e), ("weights", 2), ("weights", 1))]
