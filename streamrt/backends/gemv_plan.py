"""The dense GEMV plan: which `kernels/gemv.cu` entry point a (weight dtype, T bucket) runs and
how the tensor-core kernel splits K.

Every entry point of one family gives the same bits for a row. bf16 weights run the
tensor-core kernel (sm_80+) with a two-stage cp.async ring per warp (two stages always fit a
block's shared memory); fp32 weights, and bf16 before sm_80, the CUDA-core kernel with R rows per
warp (at T=1 the R whose grid wastes least of its last wave). `profiling/bench_kernels.py`
measures each entry point against the copy rate.
"""

from __future__ import annotations

# the tensor-core GEMV by x dtype (bf16 x?)
GEMV_TC_KERNELS = {0: "srt_gemv_tc_xf32_s2", 1: "srt_gemv_tc_xbf16_s2"}
# the CUDA-core GEMV per (weight dtype, T bucket): (entry point, rows per warp), best first; at T=1
# the candidates are compared by how full their grid's last wave is
GEMV_CUDA_CORE_KERNELS = {
    ("bf16", 1): (("srt_gemv_bf16_t1_r2", 2), ("srt_gemv_bf16_t1_r1", 1), ("srt_gemv_bf16_t1_r4", 4)),
    ("bf16", 2): (("srt_gemv_bf16_t2_r2", 2),),
    ("bf16", 4): (("srt_gemv_bf16_t4_r2", 2),),
    ("bf16", 8): (("srt_gemv_bf16_t8_r4", 4),),
    ("f32", 1): (("srt_gemv_f32_t1_r2", 2),),
    ("f32", 2): (("srt_gemv_f32_t2_r2", 2),),
    ("f32", 4): (("srt_gemv_f32_t4_r2", 2),),
    ("f32", 8): (("srt_gemv_f32_t8_r2", 2),),
}

GEMV_TC_WARPS_WANTED = 512  # warps a tensor-core GEMV launch wants in flight (fewer: HBM idles)


def gemv_tc_split(row_blocks: int) -> int:
    """Warps sharing a 32-row block of the tensor-core GEMV, each a slice of K, for a launch of
    `row_blocks` such blocks (all its matrices'): the fewest, as a power of two up to 8, that
    put GEMV_TC_WARPS_WANTED warps in flight, so a launch of few rows still streams at HBM rate
    and one of many keeps its blocks' K slices long (the deep-k3.1-pro decode groups: the MoE
    layer's four matrices of x, 495 blocks, run fastest at 2; KDA's six, 133 blocks, at 4). The
    split sets the order of a row's sum: it depends on the launch's matrices (fixed by the
    caller) and never on T."""
    ks = 1
    while ks < 8 and row_blocks * ks < GEMV_TC_WARPS_WANTED:
        ks *= 2
    return ks
