"""How fast can a read-only kernel stream a weight matrix, by access pattern? (diagnostic, one GPU)

The NVFP4 expert kernels read each warp's 32 rows a piece at a time (128 bytes of every row per
pipeline stage); the BF16 GEMV reads 512 contiguous bytes of a row per load. This times plain
16-byte loads (no math, results folded so they cannot be dropped) over one matrix shaped like a
slice layer's 16 down projections ([16 * 3584, 1536] bytes), for several (bytes per row per
step, rows per warp, resident warps per SM), against the HBM copy rate of the same run. If the
row-piece patterns stream near the copy rate, the expert kernels' loss is elsewhere.

    python profiling/bench_access.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import copy_rate, graph_time  # noqa: E402
from streamrt.backends import cuda_compile as cc  # noqa: E402
from streamrt.backends import cuda_driver as drv  # noqa: E402
from streamrt.backends.nvrtc_args import i32, ptr  # noqa: E402

# (bytes per row per step, rows per warp)
PATTERNS = ((64, 32), (128, 32), (256, 16), (256, 32), (512, 8), (512, 16), (1536, 4))

SOURCE = r"""
#include "common.cuh"
// Each warp reads rows [w * RW, w * RW + RW) in steps of PB bytes per row; lane l takes 16-byte
// chunks l, l + 32, ... of the step's RW * PB bytes (chunk c: row c / (PB / 16)).
template <int PB, int RW>
SRT_DEV void read_rows(const u8* __restrict__ W, int rb, int nrows, u32* sink) {
  constexpr int CPR = PB / 16, PER = (RW * CPR + 31) / 32;
  const int lane = threadIdx.x & 31;
  const long long row0 = (long long)((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * RW;
  if (row0 >= nrows) return;
  u32 acc = 0;
#pragma unroll 2
  for (int off = 0; off < rb; off += PB) {
    u32x4 v[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int c = min(lane + 32 * i, RW * CPR - 1);
      v[i] = ld_stream16(W + (row0 + c / CPR) * rb + off + (c % CPR) * 16);
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // practically never: keeps every load alive
}
#define READ_ENTRY(PB, RW) \
  extern "C" __global__ void __launch_bounds__(256) read_##PB##_##RW(const u8* W, int rb, int n, u32* s) { \
    read_rows<PB, RW>(W, rb, n, s); }
""" + "\n".join(f"READ_ENTRY({pb}, {rw})" for pb, rw in PATTERNS) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_access: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.cuda.current_device()
    cu = drv.driver()
    drv.make_current(dev)
    cubin = cc.nvrtc_compile(SOURCE, "bench_access.cu", cc._options(drv.device_arch(dev), ()))
    mod = drv.check(cu.cuModuleLoadData(cubin), "cuModuleLoadData")
    copy, _ = copy_rate(4 << 30, args.trials)
    rows, rb = 16 * 3584, 1536
    W = torch.randint(0, 256, (rows, rb), dtype=torch.uint8, device="cuda")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"# bench_access: {torch.cuda.get_device_name(dev)}, matrix {rows} x {rb} B ({W.numel() / 1e6:.1f} MB), "
          f"copy rate {copy / 1e9:.0f} GB/s")
    print("| bytes/row/step | rows/warp | warps/SM | us | GB/s | / copy |\n|---:|---:|---:|---:|---:|---:|")
    kargs = [ptr(W), i32(rb), i32(rows), ptr(sink)]
    for pb, rw in PATTERNS:
        kern = drv.Kernel("bench_access", f"read_{pb}_{rw}", dev, module=mod)
        warps = rows // rw
        blocks = (warps + 7) // 8
        seen = set()
        for per_sm in (16, 32, None):  # None: as many as the registers allow
            # dynamic shared memory (unused) caps the resident 8-warp blocks per SM
            smem = (228 * 1024) // (per_sm // 8) - 1024 if per_sm else 0
            if smem > kern.smem_limit:
                kern.set_smem_limit(smem)
            resident = kern.blocks_per_sm(256, smem) * 8
            if resident in seen:
                continue
            seen.add(resident)
            t = graph_time(lambda: kern((blocks,), (256,), kargs, smem=smem), args.reps, args.trials)  # runs now
            print(
                f"| {pb} | {rw} | {resident} | {t * 1e6:.1f} | {W.numel() / t / 1e9:.0f} | {W.numel() / t / copy:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
