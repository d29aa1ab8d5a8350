"""One MoE layer's routed experts for a prefill chunk: the grouped-GEMM path (the nvrtc
backend's prefill view, backends/nvfp4_gemm.py) in both row modes, single fp16 rows ("fp16",
the default) and hi + lo halves ("split"), beside the per-pair GEMV kernels it replaces, and the
tensor-core rate measured in the same run (a plain fp16 GEMM with fp32 output, the shape of one
expert's gate for 2 x the average rows per expert).

    python profiling/bench_prefill_experts.py                       # deep-k3.1-pro's layer: 24 experts, k 16
    python profiling/bench_prefill_experts.py --experts 256 --tokens 4096,16384
    python profiling/bench_prefill_experts.py --cpu                 # the CPU twin, a small layer (a dry run)

Rate = 2 * 3 * I * Dl * T * k flop / time (the FFN's three matrices for every (token, expert)
pair); "of tc" is that rate over the measured tensor-core rate; "vs split" is the grouped
result's max |difference| from the split mode's over its max |value| (the single rounding's cost).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamrt.backends.nvfp4_gemm import PREFILL_ROWS, TORCH_FP16, grouped_expert_pairs, mm16  # noqa: E402
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix, RoutedExperts  # noqa: E402


def rand_nvfp4(g, rows: int, cols: int) -> NVFP4Matrix:
    dev = g.device
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, device=dev).to(torch.uint8)
    scales = torch.randint(0x28, 0x49, (rows, cols // 16), generator=g, device=dev).to(torch.uint8)
    glob = torch.rand(rows, generator=g, device=dev) * (0.6 / math.sqrt(cols)) + 0.01
    return NVFP4Matrix(packed, scales, glob)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int, dev: torch.device) -> float:
    fn()
    sync(dev)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


class TwinFfn:
    """The grouped path on TorchFp16 (the CPU twin) with the k slots summed in torch: --cpu."""

    def __init__(self, rows: str):
        self.rows = rows

    def expert_ffn(self, z, ids, w, experts, beta, linear_beta):
        T, k = ids.shape
        y = grouped_expert_pairs(
            z, ids, RoutedExperts(experts, ids), beta, linear_beta, conv=TORCH_FP16, rows=self.rows
        )
        return (w[..., None] * y.view(T, k, -1)).sum(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, help="default 24 (--cpu: 8)")
    ap.add_argument("--k", type=int, help="default 16 (--cpu: 4)")
    ap.add_argument("--hidden", type=int, help="Dl, the expert input width: default 3072 (--cpu: 128)")
    ap.add_argument("--inter", type=int, help="I, the expert intermediate width: default 3584 (--cpu: 256)")
    ap.add_argument("--tokens", help="default 512,4096 (--cpu: 64)")
    ap.add_argument(
        "--rows", default=",".join(PREFILL_ROWS), help=f"grouped row modes to run, of {','.join(PREFILL_ROWS)}"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-gemv", action="store_true", help="skip the per-pair GEMV rows (slow at 4k tokens)")
    ap.add_argument("--cpu", action="store_true",
                    help="run the CPU twin (TorchFp16) instead of the nvrtc kernels, on a small layer; no GEMV rows")
    args = ap.parse_args(argv)
    modes = args.rows.split(",")
    if any(r not in PREFILL_ROWS for r in modes):
        ap.error(f"--rows: each of {PREFILL_ROWS}, got {args.rows!r}")
    for name, gpu, cpu in (
        ("experts", 24, 8),
        ("k", 16, 4),
        ("hidden", 3072, 128),
        ("inter", 3584, 256),
        ("tokens", "512,4096", "64"),
    ):
        if getattr(args, name) is None:
            setattr(args, name, cpu if args.cpu else gpu)
    dev = torch.device("cpu" if args.cpu else "cuda")

    E, k, Dl, I = args.experts, args.k, args.hidden, args.inter
    g = torch.Generator(device=dev).manual_seed(0)
    experts = {e: ExpertWeights(rand_nvfp4(g, I, Dl), rand_nvfp4(g, I, Dl), rand_nvfp4(g, Dl, I)) for e in range(E)}
    paths: list[tuple[str, object]] = []
    if args.cpu:
        paths += [(f"grouped GEMM, {r} rows (CPU twin)", TwinFfn(r)) for r in modes]
        device_name = "CPU"
    else:
        from streamrt.backends.nvrtc import NvrtcBackend

        be = NvrtcBackend()
        for r in modes:
            pre = be.for_prefill()
            pre.prefill_rows = r
            pre.grouped_min_pairs = 0  # grouped at every token count: the small ones show the crossover
            paths.append((f"grouped GEMM, {r} rows", pre))
        if not args.no_gemv:
            paths.append(("per-pair GEMV", be))
        device_name = torch.cuda.get_device_name(0)
    print(f"{device_name}; {E} experts of {I}x{Dl}, k {k}")
    print("| tokens | path | ms/layer | TFLOP/s | of tc | GB/s of weights | vs split | tc rate TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for T in [int(t) for t in args.tokens.split(",")]:
        ids = torch.stack([torch.randperm(E, generator=g, device=dev)[:k] for _ in range(T)]).cpu()
        w = torch.rand(T, k, generator=g, device=dev) + 0.01
        z = torch.randn(T, Dl, generator=g, device=dev)
        m = max(1, 2 * T * k // E)
        a = torch.randn(m, Dl, generator=g, device=dev).half()
        b = torch.randn(I, Dl, generator=g, device=dev).half()
        t_tc = timed(lambda: mm16(a, b), args.reps, dev)
        tc = 2 * m * Dl * I / t_tc / 1e12
        flop = 2 * 3 * I * Dl * T * k
        wbytes = E * 3 * I * Dl * (0.5 + 1 / 16)
        split = next((p for name, p in paths if "split" in name), None)
        split_out = None if split is None else split.expert_ffn(z, ids, w, experts, 4.0, 25.0)
        for name, b_ in paths:
            out = b_.expert_ffn(z, ids, w, experts, 4.0, 25.0)
            t = timed(lambda: b_.expert_ffn(z, ids, w, experts, 4.0, 25.0), args.reps, dev)
            vs = "" if split_out is None else f"{float((out - split_out).abs().max() / split_out.abs().max()):.2e}"
            print(f"| {T} | {name} | {t * 1e3:.2f} | {flop / t / 1e12:.3g} | {flop / t / 1e12 / tc:.2f} | "
                  f"{wbytes / t / 1e9:.0f} | {vs} | {tc:.3g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
