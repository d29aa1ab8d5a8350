"""One MoE layer's routed experts for a prefill chunk on the GPU: the grouped-GEMM path (the
nvrtc backend's prefill view, backends/nvfp4_gemm.py) beside the per-pair GEMV kernels it
replaces, and the tensor-core rate measured in the same run (a plain fp16 GEMM with fp32
output, the shape of one expert's gate for 2 x the average rows per expert).

    python profiling/bench_prefill_experts.py                       # deep-k3.1-pro's layer: 24 experts, k 16
    python profiling/bench_prefill_experts.py --experts 256 --tokens 4096,16384

Rate = 2 * 3 * I * Dl * T * k flop / time (the FFN's three matrices for every (token, expert)
pair); "of tc" is that rate over the measured tensor-core rate.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamrt.expert_weights import ExpertWeights, NVFP4Matrix  # noqa: E402


def rand_nvfp4(g, rows: int, cols: int) -> NVFP4Matrix:
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, device="cuda").to(torch.uint8)
    scales = torch.randint(0x28, 0x49, (rows, cols // 16), generator=g, device="cuda").to(torch.uint8)
    glob = torch.rand(rows, generator=g, device="cuda") * (0.6 / math.sqrt(cols)) + 0.01
    return NVFP4Matrix(packed, scales, glob)


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=24)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=3072, help="Dl (expert input width)")
    ap.add_argument("--inter", type=int, default=3584, help="I (expert intermediate width)")
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-gemv", action="store_true", help="skip the per-pair GEMV rows (slow at 4k tokens)")
    args = ap.parse_args(argv)
    from streamrt.backends.nvrtc import NvrtcBackend

    E, k, Dl, I = args.experts, args.k, args.hidden, args.inter
    g = torch.Generator(device="cuda").manual_seed(0)
    experts = {e: ExpertWeights(rand_nvfp4(g, I, Dl), rand_nvfp4(g, I, Dl), rand_nvfp4(g, Dl, I)) for e in range(E)}
    be = NvrtcBackend()
    pre = be.for_prefill()
    print(f"{torch.cuda.get_device_name(0)}; {E} experts of {I}x{Dl}, k {k}")
    print("| tokens | path | ms/layer | TFLOP/s | of tc | GB/s of weights | tc rate TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for T in [int(t) for t in args.tokens.split(",")]:
        ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(T)]).cpu()
        w = torch.rand(T, k, generator=g, device="cuda") + 0.01
        z = torch.randn(T, Dl, generator=g, device="cuda")
        m = max(1, 2 * T * k // E)
        a = torch.randn(m, Dl, device="cuda").half()
        b = torch.randn(I, Dl, device="cuda").half()
        t_tc = timed(lambda: torch.mm(a, b.T, out_dtype=torch.float32), args.reps)
        tc = 2 * m * Dl * I / t_tc / 1e12
        flop = 2 * 3 * I * Dl * T * k
        wbytes = E * 3 * I * Dl * (0.5 + 1 / 16)
        paths = [("grouped GEMM", pre)] + ([] if args.no_gemv else [("per-pair GEMV", be)])
        for name, b_ in paths:
            t = timed(lambda: b_.expert_ffn(z, ids, w, experts, 4.0, 25.0), args.reps)
            print(f"| {T} | {name} | {t * 1e3:.2f} | {flop / t / 1e12:.1f} | {flop / t / 1e12 / tc:.2f} | "
                  f"{wbytes / t / 1e9:.0f} | {tc:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
