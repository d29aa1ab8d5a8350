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
`--baseline SRC` builds another version of the kernel's C source (e.g. `git show
REV:streamrt/backends/cpu_expert/nvfp4_expert.c > old.c`) for this host and times it in the same
run, its passes alternating with this kernel's, so a noisy or shared host slows both alike.

    python profiling/bench_cpu_experts.py --threads 1 2 --rows 1 4 16 --experts 16
    python profiling/bench_cpu_experts.py --threads 1 4 8 16 --rows 1 4 16 --experts 64 --batch 8 --torch
    python profiling/bench_cpu_experts.py --threads 1 2 --rows 1 4 16 --experts 48 --batch 8 --baseline old.c
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from streamrt.backends.cpu_expert import build, kernel
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


def kernel_ms(experts: list[ExpertWeights], z: torch.Tensor, threads: int, reps: int, batch: int = 1,
              entries: tuple = (None,)) -> list[float]:
    """Best over `reps` passes of the mean ms per expert (each pass calls every expert once, `batch`
    experts per kernel call as a layer request's CPU experts go), as the RAM rate is its best pass;
    one figure per entry (a bound kernel library; None: this one), their passes alternating."""
    groups = [experts[i : i + batch] for i in range(0, len(experts), batch)]
    best = [float("inf")] * len(entries)
    for rep in range(reps + 1):  # the first round warms up (and builds)
        for k, entry in enumerate(entries):
            with _entry_of(entry):
                t = _timed(lambda: [kernel.experts_ffn_rows([z] * len(g), g, 4.0, 25.0, threads) for g in groups])
            if rep:
                best[k] = min(best[k], 1e3 * t / len(experts))
    return best


class _entry_of:
    """Calls of the kernel go to `entry` (a library `kernel.bind` bound) inside the block; None: no change."""

    def __init__(self, entry):
        self.entry, self.saved = entry, kernel._entry

    def __enter__(self):
        if self.entry is not None:
            kernel._entry = lambda: self.entry

    def __exit__(self, *exc):
        kernel._entry = self.saved


def baseline_entry(source: Path, folder: Path):
    """Another version of the kernel's C source, built as this host's own build is, and bound."""
    cc, lib = build.compiler(), folder / "baseline.so"
    err = build.compile_to(cc, (*build.COMMON, "-march=native", "-fopenmp"), lib, source)
    if err:
        raise SystemExit(f"bench_cpu_experts: --baseline {source}: {err.splitlines()[-1]}")
    return kernel.bind(ctypes.CDLL(str(lib)))


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
    ap.add_argument("--baseline", type=Path, metavar="SRC",
                    help="another version of nvfp4_expert.c, timed in the same run (passes alternating)")
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
    entries = (None,) if args.baseline is None else (None, baseline_entry(args.baseline, Path(tempfile.mkdtemp())))
    extra_cols = (" torch ms |" if args.torch else "") + (" baseline ms/expert | baseline ratio | speed-up |"
                                                          if args.baseline else "")
    print("| threads | rows | ms/expert | expert GB/s | RAM GB/s | ratio |" + extra_cols)
    print("|---|---|---|---|---|---|" + "---|" * extra_cols.count("|"))
    for threads in args.threads:
        ram = ram_read_gbps(threads, args.ram_mib)
        for m in args.rows:
            z = torch.from_numpy(rng.standard_normal((m, args.dl)).astype(np.float32))
            ms = kernel_ms(experts, z, threads, args.reps, args.batch, entries)
            gbps = [nbytes / (t * 1e-3) / 1e9 for t in ms]
            extra = f" {torch_ms(experts, z, threads):.4g} |" if args.torch else ""
            if args.baseline:
                extra += f" {ms[1]:.4g} | {gbps[1] / ram:.2g} | {ms[1] / ms[0]:.2f}x |"
            print(f"| {threads} | {m} | {ms[0]:.4g} | {gbps[0]:.3g} | {ram:.3g} | {gbps[0] / ram:.2g} |{extra}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
