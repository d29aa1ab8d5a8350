"""FP4 formats against float64 references written here from the spec (INDEXER_FP4.md §B),
independent of streamrt.fp4's tables."""

from __future__ import annotations

import os

import numpy as np
import pytest

from streamrt import fp4
from streamrt.errors import StreamrtError

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure


@pytest.fixture
def rng(request):
    seed = SEED + hash(request.node.name) % 1000
    print(f"seed={seed}")
    return np.random.default_rng(seed)


# ---- references (float64), straight from the bit layouts -----------------------------


def ref_e2m1(code):
    code = np.asarray(code, dtype=np.int64)
    s = np.where(code & 8, -1.0, 1.0)
    e, m = (code >> 1) & 3, code & 1
    mag = np.where(e == 0, m * 0.5, (1 + m / 2.0) * 2.0 ** (e - 1.0))
    return s * mag  # code 8 -> -0.0


def ref_e4m3(byte):
    b = np.asarray(byte, dtype=np.int64)
    s = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    return np.where((e == 15) & (m == 7), np.nan, s * mag)


def ref_e8m0(s):
    s = np.asarray(s, dtype=np.int64)
    return np.where(s == 255, np.nan, np.ldexp(1.0, s - 127))


def ref_nibbles(packed):
    p = np.asarray(packed, dtype=np.int64)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.int64)
    out[..., 0::2], out[..., 1::2] = p & 15, p >> 4  # low nibble = even element
    return out


def ref_mx_decode(packed, scales):
    v = ref_e2m1(ref_nibbles(packed))
    return v * np.repeat(ref_e8m0(scales), 32, axis=1)


def ref_nv_decode(packed, scales, glob):
    v = ref_e2m1(ref_nibbles(packed))
    g = np.asarray(glob, dtype=np.float64)
    g = g[:, None] if g.ndim else g
    return v * np.repeat(ref_e4m3(scales), 16, axis=1) * g


def bits(x):
    with np.errstate(over="ignore"):  # 6 * 2^127 overflows fp32 in every decoder alike
        return np.asarray(x, dtype=np.float32).view(np.int32)


LEGAL_E4M3_POW2 = {0x01, 0x02, 0x04} | set(range(0x08, 0x79, 8))


# ---- helpers ------------------------------------------------------------------------


def random_mx(rng, n, k, s_lo, span, zero_half_frac=0.1):
    """Random MXFP4 [n, k] with E8M0 in [s_lo, s_lo+span], both extremes in non-zero halves,
    some all-zero half-blocks (with any scale) and signed zeros sprinkled in."""
    codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    scales = rng.integers(s_lo, s_lo + span + 1, size=(n, k // 32)).astype(np.uint8)
    halves = codes.reshape(n, k // 16, 16)
    dead = rng.random((n, k // 16)) < zero_half_frac
    halves[dead] = rng.choice(np.array([0, 8], dtype=np.uint8), size=(int(dead.sum()), 16))
    # pin both extremes on block 0 / block 1 of row 0, first half non-zero
    halves[0, 0, 0], halves[0, 2, 0] = 7, 15
    scales[0, 0], scales[0, 1] = s_lo, s_lo + span
    codes = halves.reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, scales


def assert_repack_exact(packed, scales, **kw):
    p2, s2, g = fp4.mxfp4_to_nvfp4(packed, scales, **kw)
    assert p2.tobytes() == packed.tobytes()  # nibbles verbatim
    assert set(np.unique(s2).tolist()) <= LEGAL_E4M3_POW2
    assert g.dtype == np.float32
    ref_mx = ref_mx_decode(packed, scales)
    ref_nv = ref_nv_decode(p2, s2, g)
    np.testing.assert_array_equal(bits(ref_nv), bits(ref_mx))  # signed zeros included
    np.testing.assert_array_equal(bits(fp4.nvfp4_dequant(p2, s2, g)), bits(ref_mx))
    np.testing.assert_array_equal(bits(fp4.mxfp4_dequant(packed, scales)), bits(ref_mx))
    return p2, s2, g


# ---- tables --------------------------------------------------------------------------


def test_e2m1_table_matches_spec():
    np.testing.assert_array_equal(bits(fp4.E2M1_VALUES), bits(ref_e2m1(np.arange(16))))
    assert np.signbit(fp4.E2M1_VALUES[8])


def test_e4m3_table_and_pow2_bytes():
    ref = ref_e4m3(np.arange(256))
    np.testing.assert_array_equal(np.isnan(fp4.E4M3_VALUES), np.isnan(ref))
    ok = ~np.isnan(ref)
    np.testing.assert_array_equal(bits(fp4.E4M3_VALUES[ok]), bits(ref[ok]))
    e = np.arange(-9, 9)
    b = fp4.e4m3_pow2_byte(e)
    np.testing.assert_array_equal(ref_e4m3(b), 2.0**e)
    assert b[-1] == 0x78 and b[0] == 0x01 and b[e.tolist().index(0)] == 0x38
    with pytest.raises(ValueError):
        fp4.e4m3_pow2_byte(9)
    with pytest.raises(ValueError):
        fp4.e4m3_pow2_byte(-10)


# ---- dequantisation ------------------------------------------------------------------


def test_mxfp4_dequant_full_exponent_range(rng):
    packed = rng.integers(0, 256, size=(16, 64), dtype=np.uint8)
    scales = rng.integers(0, 255, size=(16, 4), dtype=np.uint8)  # 0..254: 2^-127..2^127
    scales[0, 0], scales[1, 1] = 0, 254
    np.testing.assert_array_equal(bits(fp4.mxfp4_dequant(packed, scales)), bits(ref_mx_decode(packed, scales)))
    scales[2, 2] = 255
    out = fp4.mxfp4_dequant(packed, scales)
    assert np.isnan(out[2, 64:96]).all() and not np.isnan(out[3]).any()


def test_nvfp4_dequant_scalar_and_per_row(rng):
    packed = rng.integers(0, 256, size=(8, 32), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, size=(8, 4), dtype=np.uint8)  # every finite positive E4M3
    g = np.float32(rng.uniform(0.5, 2.0))
    np.testing.assert_array_equal(
        bits(fp4.nvfp4_dequant(packed, scales, g)), bits(ref_nv_decode(packed, scales, np.float32(g)))
    )
    gr = np.ldexp(np.float32(1), rng.integers(-20, 20, size=8)).astype(np.float32)
    np.testing.assert_array_equal(bits(fp4.nvfp4_dequant(packed, scales, gr)), bits(ref_nv_decode(packed, scales, gr)))


# ---- lossless repack -----------------------------------------------------------------


def test_repack_bit_exact_across_legal_window(rng):
    for trial in range(40):
        span = int(rng.integers(0, fp4.MAX_SPAN + 1)) if trial % 4 else fp4.MAX_SPAN
        s_lo = int(rng.integers(0, 255 - span))
        if trial == 0:
            s_lo = 0  # bottom of E8M0: fp32 subnormal results
        if trial == 1:
            s_lo = 254 - span  # top of E8M0
        n, k = int(rng.integers(1, 9)), 32 * int(rng.integers(1, 5))
        packed, scales = random_mx(rng, max(n, 1), max(k, 64), s_lo, span)
        p2, s2, g = assert_repack_exact(packed, scales)
        assert g.shape == () and g == np.float32(2.0 ** (s_lo + span - 135))
        assert s2.max() == 0x78  # the largest scale lands on 2^8


def test_repack_rejects_span_just_outside(rng):
    packed, scales = random_mx(rng, 4, 64, 100, fp4.MAX_SPAN + 1, zero_half_frac=0)
    with pytest.raises(fp4.FP4RangeError, match="experts.7.w1") as ei:
        fp4.mxfp4_to_nvfp4(packed, scales, name="experts.7.w1")
    assert isinstance(ei.value, StreamrtError) and "18" in str(ei.value) and "\n" not in str(ei.value)


def test_repack_excludes_all_zero_half_blocks(rng):
    packed, scales = random_mx(rng, 4, 64, 100, 10, zero_half_frac=0)
    # block 1 of row 1: out-of-window scale, but both halves only ±0 -> must not count
    scales[1, 1] = 3
    codes = ref_nibbles(packed)
    codes[1, 32:64] = rng.choice([0, 8], size=32)
    # block 0 of row 2: low half live (scale in window), high half ±0 with the same byte
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    p2, s2, g = assert_repack_exact(packed, scales)
    assert (s2[1, 2:4] == fp4.E4M3_FILL).all()
    # a single live nibble in that block brings the span to 107 -> rejected
    packed[1, 16] = 0x01
    with pytest.raises(fp4.FP4RangeError, match="span"):
        fp4.mxfp4_to_nvfp4(packed, scales)


def test_repack_half_block_granularity(rng):
    """A 32-block whose first half is live and second half ±0: only the live half constrains."""
    packed, scales = random_mx(rng, 2, 64, 120, 17, zero_half_frac=0)
    codes = ref_nibbles(packed)
    codes[1, 48:64] = 8  # second half of block 1, row 1 -> -0 only
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    assert_repack_exact(packed, scales)


def test_repack_rejects_nan_scale(rng):
    packed, scales = random_mx(rng, 3, 64, 110, 5)
    scales[2, 1] = 0xFF
    with pytest.raises(fp4.FP4RangeError, match=r"w2.*NaN.*row 2, block 1"):
        fp4.mxfp4_to_nvfp4(packed, scales, name="w2")
    packed[2] = 0  # even an all-zero block with a NaN scale is NaN by the MX spec
    with pytest.raises(fp4.FP4RangeError, match="NaN"):
        fp4.mxfp4_to_nvfp4(packed, scales, per_row=True)


def test_repack_per_row_when_span_too_wide(rng):
    n = 6
    parts = [random_mx(rng, 1, 64, 20 * r + 10, int(rng.integers(0, 18)), zero_half_frac=0) for r in range(n)]
    packed = np.concatenate([p for p, _ in parts])
    scales = np.concatenate([s for _, s in parts])
    with pytest.raises(fp4.FP4RangeError, match="per-row"):
        fp4.mxfp4_to_nvfp4(packed, scales)
    p2, s2, g = assert_repack_exact(packed, scales, per_row=True)
    assert g.shape == (n,)
    packed_, scales_, g_, used = fp4.repack_expert_matrix(packed, scales, allow_per_row=True, name="x")
    assert used and np.array_equal(g_, g)
    with pytest.raises(fp4.FP4RangeError):
        fp4.repack_expert_matrix(packed, scales, allow_per_row=False, name="x")
    # a single row that is itself too wide fails even per row, naming the row
    scales[3, 0], scales[3, 1] = 10, 29
    packed[3, 0], packed[3, 16] = 0x11, 0x11
    with pytest.raises(fp4.FP4RangeError, match="row 3"):
        fp4.mxfp4_to_nvfp4(packed, scales, per_row=True)


def test_repack_all_zero_tensor():
    packed = np.zeros((2, 32), np.uint8)
    packed[1] = 0x88  # -0
    scales = np.array([[0, 254], [255 - 1, 3]], np.uint8)
    p2, s2, g = assert_repack_exact(packed, scales)
    assert (s2 == fp4.E4M3_FILL).all()


# ---- quantisers ----------------------------------------------------------------------


def _nearest_code_ok(q, codes):
    """Each code is a nearest E2M1 value to q (saturating at 6), ties to the even code."""
    grid = ref_e2m1(np.arange(8))  # magnitudes
    m = np.minimum(np.abs(q), 6.0)
    d = np.abs(m[..., None] - grid)  # [..., 8]
    best = d.min(axis=-1)
    mag = codes & 7
    chosen = np.take_along_axis(d, mag[..., None].astype(np.int64), -1)[..., 0]
    assert np.all(chosen == best)
    tie = (d == best[..., None]).sum(-1) > 1
    assert np.all(mag[tie] % 2 == 0)
    nonzero = m > 0
    np.testing.assert_array_equal((codes >> 3)[nonzero] == 1, (q < 0)[nonzero])


def test_quantize_mxfp4_reference(rng):
    x = (rng.standard_normal((16, 128)) * 0.02 * np.exp2(rng.integers(-6, 6, size=(16, 1)))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    x[1, 3] = -0.0
    x[2, :32] = np.linspace(-3, 3, 32) * 2.0**-5  # exact grid points and midpoints
    packed, scales = fp4.quantize_mxfp4(x)
    assert packed.shape == (16, 64) and scales.shape == (16, 4)
    amax = np.abs(x.astype(np.float64)).reshape(16, 4, 32).max(-1)
    live = amax > 0
    sc = ref_e8m0(scales)
    # smallest power of two with amax / s <= 6
    assert np.all(amax[live] / sc[live] <= 6) and np.all(amax[live] / (sc[live] / 2) > 6)
    q = x.reshape(16, 4, 32) / sc[..., None]
    _nearest_code_ok(q, ref_nibbles(packed).reshape(16, 4, 32))


def test_quantize_nvfp4_reference(rng):
    x = (rng.standard_normal((8, 64)) * 0.02).astype(np.float32)
    packed, scales, g = fp4.quantize_nvfp4(x)
    amax = np.abs(x).max()
    assert g == np.float32(amax / np.float32(6 * 448))
    # scale byte: E4M3 round-to-nearest of block_amax / (6 g), from the reference table
    pos = ref_e4m3(np.arange(0x7F))
    want = np.abs(x).reshape(8, 4, 16).max(-1) / (np.float32(6) * g)
    d = np.abs(want[..., None].astype(np.float64) - pos)
    assert np.all(np.take_along_axis(d, scales[..., None].astype(np.int64), -1)[..., 0] == d.min(-1))
    q = x.reshape(8, 4, 16) / (ref_e4m3(scales)[..., None] * np.float64(g))
    _nearest_code_ok(q, ref_nibbles(packed).reshape(8, 4, 16))
    err = np.abs(fp4.nvfp4_dequant(packed, scales, g) - x)
    assert err.max() <= np.abs(x).max() / 6  # sanity: within one grid step of the largest block


def test_mxfp4_quantize_roundtrips_through_nvfp4(rng):
    x = (rng.standard_normal((32, 96)) * 0.02 * np.exp2(rng.normal(0, 0.7, size=(32, 1)))).astype(np.float32)
    packed, scales = fp4.quantize_mxfp4(x)
    assert_repack_exact(packed, scales)
