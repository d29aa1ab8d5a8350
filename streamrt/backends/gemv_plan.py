"""The dense GEMV plan: which `kernels/gemv.cu` variant a (weight dtype, T bucket) may run, how
the tensor-core kernel splits K, and forced variants for tests and benchmarks.

Every variant of one family gives the same bits for a row. bf16 weights: "tc<S>", the
tensor-core kernel with an S-stage cp.async ring per warp (sm_80+), then "r<R>", the CUDA-core
kernel with R rows per warp (the fallback before sm_80; at T=1 the one whose grid wastes least
of its last wave). Two stages always fit; more are cut where they would not. Measurements
behind the order: `profiling/RESULTS.md` (bench_kernels.py --variants).
"""

from __future__ import annotations

# GEMV variants per (weight dtype, T bucket), best first
GEMV_TC_FAMILY = ("tc2", "tc3", "tc4")
GEMV_VARIANTS = {("bf16", 1): GEMV_TC_FAMILY + ("r2", "r1", "r4"), ("bf16", 2): GEMV_TC_FAMILY + ("r2", "r4"),
                 ("bf16", 4): GEMV_TC_FAMILY + ("r2", "r4"), ("bf16", 8): GEMV_TC_FAMILY + ("r4", "r2"),
                 ("f32", 1): ("r2",), ("f32", 2): ("r2",), ("f32", 4): ("r2",), ("f32", 8): ("r2",)}


GEMV_TC_WARPS_WANTED = 512  # warps a tensor-core GEMV launch wants in flight (fewer: HBM idles)


def gemv_tc_split(row_blocks: int) -> int:
    """Warps sharing a 32-row block of the tensor-core GEMV, each a slice of K, for a launch of
    `row_blocks` such blocks (all its matrices'): the fewest, as a power of two up to 8, that
    put GEMV_TC_WARPS_WANTED warps in flight, so a launch of few rows still streams at HBM rate
    and one of many keeps its blocks' K slices long. The deep-k3.1-pro decode groups on the
    H200 (profiling/RESULTS.md §17): the MoE layer's four matrices of x (495 blocks) 28.8 us at
    splits 8 and 4 against 18.6 at 2; KDA's six (133 blocks) 11.0 at 8 against 8.6 at 4. The
    split sets the order of a row's sum: it depends on the launch's matrices (fixed by the
    caller) and never on T."""
    ks = 1
    while ks < 8 and row_blocks * ks < GEMV_TC_WARPS_WANTED:
        ks *= 2
    return ks


def gemv_plan(spec: str) -> dict[tuple[str, int], str]:
    """Forced GEMV variants from "bf16:8=tc3,f32:1=r2" (benchmarks, tests; set as a backend's
    `gemv_plan`); empty = automatic."""
    plan = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        try:
            key, variant = item.split("=")
            dt, nt = key.split(":")
            k = (dt, int(nt))
        except ValueError:
            raise ValueError(f"gemv_plan: cannot parse {item!r} (want e.g. bf16:8=tc3)") from None
        if variant not in GEMV_VARIANTS.get(k, ()):
            raise ValueError(f"gemv_plan: {item!r}: variants for {k} are {GEMV_VARIANTS.get(k, ())}")
        plan[k] = variant
    return plan
