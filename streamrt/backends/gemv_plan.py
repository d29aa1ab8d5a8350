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


def gemv_tc_split(N: int, K: int) -> int:
    """Warps sharing a 32-row block of the tensor-core GEMV, each a slice of K: enough warps in
    flight for a matrix of N rows (a warp alone issues too few bytes per cycle to keep up with
    HBM); 1 for big N, where blocks are plenty. A function of the shape only: the split sets the
    order of the sum, so a row's bits must not depend on T (nor on the GPU)."""
    return 8 if N <= 2048 else 4 if N <= 8192 else 2 if N <= 32768 else 1


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
