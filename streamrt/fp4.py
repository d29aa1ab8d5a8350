"""FP4 formats: the E2M1 grid, MXFP4 and NVFP4 dequantisation and quantisation, and the
lossless MXFP4 -> NVFP4 repack (spec/INDEXER_FP4.md §B).

Conventions (docs/CONTRACTS.md): packed `uint8 [out, in/2]`, low nibble = even element.
MXFP4 scales `uint8 [out, in/32]`, E8M0 (2^(S-127), 0xFF = NaN). NVFP4 scales
`uint8 [out, in/16]` holding E4M3 bits, times a float32 global scale (scalar or per row).

The repack is integer work only: nibbles are copied, each E8M0 byte becomes one E4M3 power
of two duplicated into the two 16-wide halves of its 32-block, and the exponent bias goes
into a power-of-two global scale. E4M3 holds 2^-9..2^8 exactly (18 octaves), so a tensor
repacks with one global scale iff its E8M0 span over non-zero half-blocks is <= 17.
Everything is vectorised numpy; nothing loops per element.
"""

from __future__ import annotations

import numpy as np

from streamrt.errors import StreamrtError

MX_BLOCK = 32  # elements per E8M0 scale
NV_BLOCK = 16  # elements per E4M3 scale
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E4M3_MAX = 448.0
MAX_SPAN = 17  # octaves a single global scale can absorb: E4M3 powers of two 2^-9..2^8
E4M3_POW2_MIN, E4M3_POW2_MAX = -9, 8
E4M3_FILL = 0x01  # scale for an all-zero half-block: any in-window value decodes ±0 to ±0

# E2M1 code -> value; codes 8..15 are the negatives (8 = -0.0).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)


class FP4RangeError(StreamrtError):
    """A tensor cannot be represented losslessly (NaN scale, or an exponent span too wide)."""


def _e4m3_table() -> np.ndarray:
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * np.exp2(e - 7.0))
    v = sign * mag
    v[(e == 15) & (m == 7)] = np.nan  # 0x7F / 0xFF; e4m3fn has no Inf
    return v.astype(np.float32)


E4M3_VALUES = _e4m3_table()  # byte -> float32


def e4m3_pow2_byte(e: np.ndarray | int) -> np.ndarray:
    """E4M3 byte of 2^e for integer e in [-9, 8] (normals (e+7)<<3; subnormals 0x04/0x02/0x01)."""
    e = np.asarray(e, dtype=np.int32)
    if e.size and (e.min() < E4M3_POW2_MIN or e.max() > E4M3_POW2_MAX):
        raise ValueError("power of two outside E4M3's exact range 2^-9..2^8")
    sub = np.left_shift(1, np.clip(e + 9, 0, 2))  # -9 -> 1, -8 -> 2, -7 -> 4
    return np.where(e >= -6, (e + 7) << 3, sub).astype(np.uint8)


# ---- nibbles -------------------------------------------------------------------------


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n/2] -> uint8 codes [..., n] (low nibble is the even element)."""
    p = np.asarray(packed, dtype=np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [..., n] -> uint8 [..., n/2]."""
    c = np.asarray(codes, dtype=np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """Round float -> E2M1 code, nearest with ties to even code, saturating at ±6; keeps -0."""
    m = np.abs(x)
    # Thresholds between neighbouring magnitudes; `>=` where the tie goes to the upper
    # (even) code, `>` where it goes to the lower one.
    code = (
        (m > 0.25).astype(np.uint8)
        + (m >= 0.75)
        + (m > 1.25)
        + (m >= 1.75)
        + (m > 2.5)
        + (m >= 3.5)
        + (m > 5.0)
    ).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 3)


# ---- dequantisation --------------------------------------------------------------------


def _check_shapes(packed: np.ndarray, scales: np.ndarray, block: int) -> tuple[int, int]:
    if packed.ndim != 2 or scales.ndim != 2:
        raise ValueError(f"expected 2-D packed and scales, got {packed.shape} and {scales.shape}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if scales.shape != (n, k // block) or k % block:
        raise ValueError(f"scales {scales.shape} do not match packed {packed.shape} with blocks of {block}")
    return n, k


def mxfp4_dequant(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 -> float32 [out, in]: E2M1 * 2^(S-127); a NaN scale (0xFF) gives NaN."""
    packed, scales = np.asarray(packed, np.uint8), np.asarray(scales, np.uint8)
    n, k = _check_shapes(packed, scales, MX_BLOCK)
    v = E2M1_VALUES[unpack_nibbles(packed)].reshape(n, k // MX_BLOCK, MX_BLOCK)
    exp = scales.astype(np.int32) - E8M0_BIAS
    with np.errstate(over="ignore"):  # 6 * 2^127 is beyond fp32: inf, as in any fp32 decode
        out = np.ldexp(v, exp[..., None]).astype(np.float32)  # exact: 2 significant bits
    out[scales == E8M0_NAN] = np.nan
    return out.reshape(n, k)


def nvfp4_dequant(packed: np.ndarray, scales: np.ndarray, global_scale) -> np.ndarray:
    """NVFP4 -> float32 [out, in]: E2M1 * E4M3(scale per 16) * global (scalar or [out])."""
    packed, scales = np.asarray(packed, np.uint8), np.asarray(scales, np.uint8)
    n, k = _check_shapes(packed, scales, NV_BLOCK)
    g = np.asarray(global_scale, dtype=np.float32)
    if g.ndim:
        g = g.reshape(n, 1, 1)
    v = E2M1_VALUES[unpack_nibbles(packed)].reshape(n, k // NV_BLOCK, NV_BLOCK)
    with np.errstate(over="ignore"):
        out = v * E4M3_VALUES[scales][..., None] * g
    return out.astype(np.float32).reshape(n, k)


# ---- lossless repack -------------------------------------------------------------------


_LIVE_ROWS = 256  # rows per step of the live-half scan: keeps its uint64 temporary ~1 MB


def nonzero_halves(packed: np.ndarray) -> np.ndarray:
    """bool [out, in/16]: which 16-element half-blocks hold a nibble other than ±0.

    A half-block is 8 packed bytes, so one uint64 per half; 0x7 masks drop the signs.
    Scanned in row chunks with one reused scratch buffer: large short-lived temporaries
    cost page faults and munmap()s, which serialise a multi-threaded converter.
    """
    p = np.ascontiguousarray(packed, dtype=np.uint8)
    n = p.shape[0]
    words = p.view(np.uint64).reshape(n, -1)
    out = np.empty(words.shape, dtype=bool)
    tmp = np.empty((min(n, _LIVE_ROWS), words.shape[1]), dtype=np.uint64)
    mask = np.uint64(0x7777777777777777)
    for r in range(0, n, _LIVE_ROWS):
        w = words[r : r + _LIVE_ROWS]
        t = tmp[: len(w)]
        np.bitwise_and(w, mask, out=t)
        np.not_equal(t, 0, out=out[r : r + _LIVE_ROWS])
    return out


def mxfp4_to_nvfp4(
    packed: np.ndarray, scales: np.ndarray, *, per_row: bool = False, name: str = "tensor"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Repack MXFP4 losslessly into NVFP4. Returns (packed, scales_e4m3, global_scale).

    `packed` is returned as is (nibbles verbatim). `global_scale` is float32 of shape ()
    (one power of two for the tensor) or [out] when `per_row` (one per row, each row
    needing span <= 17 only). Raises FP4RangeError naming `name` for a NaN scale byte or
    a span the chosen mode cannot hold. Integer work on uint8 arrays only.
    """
    packed, scales = np.asarray(packed, np.uint8), np.asarray(scales, np.uint8)
    n, k = _check_shapes(packed, scales, MX_BLOCK)
    nan = scales == E8M0_NAN
    if nan.any():
        r, j = (int(i) for i in np.argwhere(nan)[0])
        raise FP4RangeError(
            f"{name}: E8M0 scale byte 0xFF (NaN) at row {r}, block {j} ({int(nan.sum())} NaN scales); "
            "NVFP4 has no equivalent"
        )
    live = nonzero_halves(packed)  # [n, k/16] bool
    # Both halves of block j as one uint16: non-zero iff the block has a live half. The
    # same view of the output below keeps half 0 <-> byte 0 whatever the endianness.
    live16 = live.view(np.uint16)  # [n, k/32]
    blk = live16 != 0
    if per_row:
        s_max = np.where(blk, scales, np.uint8(0)).max(axis=1).astype(np.int32)
        s_min = np.where(blk, scales, np.uint8(255)).min(axis=1).astype(np.int32)
        any_live = blk.any(axis=1)
    else:
        sel = scales[blk]
        any_live = np.array([sel.size > 0])
        s_max = np.array([sel.max() if sel.size else 0], np.int32)
        s_min = np.array([sel.min() if sel.size else 0], np.int32)
    s_max = np.where(any_live, s_max, E8M0_BIAS + E4M3_POW2_MAX)  # nothing live: G = 0
    s_min = np.where(any_live, s_min, s_max)
    span = s_max - s_min
    if (span > MAX_SPAN).any():
        r = int(np.argmax(span))
        where = f"row {r}: " if per_row else ""
        hint = "" if per_row else "; enable per-row global scales to repack it exactly"
        raise FP4RangeError(
            f"{name}: {where}E8M0 exponent span {int(span[r])} octaves (2^{int(s_min[r]) - E8M0_BIAS}.."
            f"2^{int(s_max[r]) - E8M0_BIAS}) over non-zero half-blocks exceeds {MAX_SPAN}: E4M3 scales hold "
            f"2^{E4M3_POW2_MIN}..2^{E4M3_POW2_MAX}{hint}"
        )
    g = s_max - (E8M0_BIAS + E4M3_POW2_MAX)  # G = S_max - 135: the largest scale lands on 2^8
    if per_row:
        e = np.clip(scales.astype(np.int32) - E8M0_BIAS - g[:, None], E4M3_POW2_MIN, E4M3_POW2_MAX)
        byte = e4m3_pow2_byte(e)  # [n, k/32]
    else:  # one 256-entry table E8M0 byte -> E4M3 byte for this G
        lut = e4m3_pow2_byte(np.clip(np.arange(256) - E8M0_BIAS - int(g[0]), E4M3_POW2_MIN, E4M3_POW2_MAX))
        byte = lut[scales]
    # Live halves are inside the window (span checked), so the clip only touches dead
    # ones, which get the fill byte: each E4M3 byte duplicated into both halves, masked.
    m16 = live16 * np.uint16(0xFF)  # 0xFF in the byte of every live half
    dup = byte.astype(np.uint16) * np.uint16(0x0101)
    out16 = (dup & m16) | (np.uint16(E4M3_FILL * 0x0101) & ~m16)
    scales_e4m3 = out16.view(np.uint8).reshape(n, k // NV_BLOCK)
    glob = np.ldexp(np.float32(1.0), g).astype(np.float32)  # exact, subnormal down to 2^-149
    return packed, scales_e4m3, glob if per_row else glob.reshape(())


def repack_expert_matrix(
    packed: np.ndarray, scales: np.ndarray, *, allow_per_row: bool, name: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """One global scale if the tensor fits, else per-row (if allowed). Returns
    (packed, scales_e4m3, global [out] float32, used_per_row)."""
    wide = allow_per_row and not (np.asarray(scales) == E8M0_NAN).any()  # NaN fails either way
    try:
        p, s, g = mxfp4_to_nvfp4(packed, scales, per_row=False, name=name)
        return p, s, np.full(p.shape[0], g, dtype=np.float32), False
    except FP4RangeError:
        if not wide:
            raise
    p, s, g = mxfp4_to_nvfp4(packed, scales, per_row=True, name=name)
    return p, s, g, True


# ---- quantisation (synthetic checkpoints, tests) ----------------------------------------


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % block:
        raise ValueError(f"expected [out, in] with in a multiple of {block}, got {x.shape}")
    return x.reshape(x.shape[0], -1, block)


def mxfp4_scale_exponent(amax: np.ndarray) -> np.ndarray:
    """E8M0 byte: the smallest power of two s with amax / s <= 6 (no saturation); 127 for 0."""
    m, e = np.frexp(amax / np.float32(6.0))  # amax/6 = m * 2^e, m in [0.5, 1)
    k = np.where(m == 0.5, e - 1, e)  # ceil(log2(amax/6))
    return np.where(amax > 0, np.clip(k + E8M0_BIAS, 0, 254), E8M0_BIAS).astype(np.uint8)


def quantize_mxfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> (packed uint8 [out, in/2], E8M0 scales uint8 [out, in/32])."""
    b = _blocks(x, MX_BLOCK)
    s = mxfp4_scale_exponent(np.abs(b).max(axis=-1))
    q = np.ldexp(b, -(s.astype(np.int32) - E8M0_BIAS)[..., None])  # exact power-of-two division
    codes = e2m1_encode(q).reshape(b.shape[0], -1)
    return pack_nibbles(codes), s


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float -> E4M3 byte, round to nearest (ties to even code), saturating at ±448."""
    x = np.asarray(x, dtype=np.float32)
    pos = E4M3_VALUES[:0x7F]  # bytes 0x00..0x7E, ascending, finite
    m = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.clip(np.searchsorted(pos, m, side="left"), 0, len(pos) - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = m - pos[lo], pos[hi] - m
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 7)


def quantize_nvfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float [out, in] -> (packed, E4M3 scales [out, in/16], global float32 scalar); ModelOpt recipe:
    global = amax/(6*448), block scale = E4M3(block_amax/(6*global)) with 0 -> 1.0."""
    b = _blocks(x, NV_BLOCK)
    amax = np.float32(np.abs(b).max()) if b.size else np.float32(0)
    glob = np.float32(amax / (6 * E4M3_MAX)) if amax > 0 else np.float32(1.0)
    sc = e4m3_encode(np.abs(b).max(axis=-1) / (np.float32(6) * glob))
    sc = np.where(sc == 0, np.uint8(0x38), sc).astype(np.uint8)
    q = b / (E4M3_VALUES[sc][..., None] * glob)
    codes = e2m1_encode(q).reshape(b.shape[0], -1)
    return pack_nibbles(codes), sc, np.asarray(glob, dtype=np.float32)
