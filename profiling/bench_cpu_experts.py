"""GB/s of expert bytes the host CPU expert kernel reads, per thread count and row count, beside
the same host's RAM read rate measured in the same run at the same thread count.

Experts are random NVFP4 at the routed shape (default kimi-k3.1-pro's Dl 3584 x I 3072: 18.6 MB
of packed nibbles, scale bytes and globals), held in host memory like a pool buffer. The run
cycles through `--experts` distinct experts, so each call reads its bytes from RAM, not from the
last-level cache (keep experts x 18.6 MB well above the LLC). The RAM rate is a torch sum over a
buffer of `--ram-mib` float32 at the same thread count (a read-only stream, vectorised).

One markdown row per (threads, rows): ms per expert, expert GB/s, RAM GB/s, and their ratio
(the target: >= 0.8 at the thread count used). `--torch` adds the torch path's ms per
expert (dequantise + GEMV, what the runtime runs on a CPU today) at the same rows.

    python profiling/bench_cpu_experts.py --threads 1 2 --rows 1 4 16 --experts 16
    python profiling/bench_cpu_experts.py --threads 1 4 8 16 --rows 1 4 16 --experts 64 --batch 8 --torch
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np
import torch

from streamrt.backends.cpu_expert import kernel
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix


def random_matrix(rng: np.random.Generator, out: int, inp: int) -> NVFP4Matrix:
    packed = rng.integers(0, 256, (out, inp // 2), dtype=np.uint8)
    scales = rng.integers(0x28, 0x48, (out, inp // 16), dtype=np.uint8)
    glob = (2.0 ** rng.uniform(-9, -6, out)).astype(np.float32)
    return NVFP4Matrix(torch.from_numpy(packed), torch.from_numpy(scales), torch.from_numpy(glob))


def expert_bytes(ew: ExpertWeights) -> int:
    return sum(t.numel() * t.element_size() for m in (ew.gate, ew.up, ew.down)
               for t in (m.packed, m.scales, m.global_scale))


def ram_read_gbps(threads: int, mib: int, reps: int = 5) -> float:
    """Best of `reps` torch sums over `mib` MiB of float32 at `threads` threads, in GB/s."""
    torch.set_num_threads(threads)
    buf = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in
    best = min(_timed(lambda: buf.sum()) for _ in range(reps))
    return buf.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def kernel_ms(experts: list[ExpertWeights], z: torch.Tensor, threads: int, reps: int, batch: int = 1) -> float:
    """Best over `reps` passes of the mean ms per expert (each pass calls every expert once, `batch`
    experts per kernel call as a layer request's CPU experts go), as the RAM rate is its best pass."""
    groups = [experts[i : i + batch] for i in range(0, len(experts), batch)]
    kernel.experts_ffn_rows([z] * len(groups[0]), groups[0], 4.0, 25.0, threads)  # warm-up (and the build)
    passes = []
    for _ in range(reps):
        t = _timed(lambda: [kernel.experts_ffn_rows([z] * len(g), g, 4.0, 25.0, threads) for g in groups])
        passes.append(1e3 * t / len(experts))
    return float(min(passes))


def torch_ms(experts: list[ExpertWeights], z: torch.Tensor, threads: int) -> float:
    from streamrt.backends.torch_backend import TorchBackend

    torch.set_num_threads(threads)
    be, m = TorchBackend(), z.shape[0]
    ids, w = torch.zeros(m, 1, dtype=torch.long), torch.ones(m, 1)
    n = min(len(experts), 4)
    t = _timed(lambda: [be.expert_ffn(z, ids, w, {0: ew}, 4.0, 25.0) for ew in experts[:n]])
    return 1e3 * t / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--experts", type=int, default=16, help="distinct experts cycled through")
    ap.add_argument("--dl", type=int, default=3584, help="routed width (Dl)")
    ap.add_argument("--inter", type=int, default=3072, help="expert intermediate size (I)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1, help="experts per kernel call (a layer request's CPU experts)")
    ap.add_argument("--ram-mib", type=int, default=1024)
    ap.add_argument("--torch", action="store_true", help="also time the torch path (dequantise + GEMV)")
    ap.add_argument("--kernel-first", action="store_true",
                    help="call the kernel at the most threads before torch's first parallel op (the RAM rate): "
                         "on a loaded 2-core host its OpenMP team ran 5-8x slower at 2 threads when torch's team "
                         "had started first; this run shows whether the order matters on this host")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    experts = [ExpertWeights(random_matrix(rng, args.inter, args.dl), random_matrix(rng, args.inter, args.dl),
                             random_matrix(rng, args.dl, args.inter)) for _ in range(args.experts)]
    nbytes = expert_bytes(experts[0])
    if args.kernel_first:
        z = torch.zeros(1, args.dl)
        kernel.expert_ffn_rows(z, experts[0], 4.0, 25.0, threads=max(args.threads))
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, kernel {kernel.simd_path()}; "
          f"{args.experts} experts of {nbytes / 1e6:.2f} MB (Dl {args.dl}, I {args.inter}), {args.batch} per call"
          f"{'; kernel team started first' if args.kernel_first else ''}")
    print("| threads | rows | ms/expert | expert GB/s | RAM GB/s | ratio |" + (" torch ms |" if args.torch else ""))
    print("|---|---|---|---|---|---|" + ("---|" if args.torch else ""))
    for threads in args.threads:
        ram = ram_read_gbps(threads, args.ram_mib)
        for m in args.rows:
            z = torch.from_numpy(rng.standard_normal((m, args.dl)).astype(np.float32))
            ms = kernel_ms(experts, z, threads, args.reps, args.batch)
            gbps = nbytes / (ms * 1e-3) / 1e9
            extra = f" {torch_ms(experts, z, threads):.4g} |" if args.torch else ""
            print(f"| {threads} | {m} | {ms:.4g} | {gbps:.3g} | {ram:.3g} | {gbps / ram:.2g} |{extra}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
