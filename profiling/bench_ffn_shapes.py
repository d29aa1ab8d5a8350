"""The NVFP4 expert FFN's block shapes side by side, on the path the model's CUDA graphs run.

One layer of deep-k3.1-pro's expert shape (24 experts of gate/up 3072 x 3584, down 3584 x 3072,
random NVFP4 weights), every expert in the layer's device pointer table (ResidentExperts), so a
call is one launch of T x 16 pairs whose blocks take up to 8 (or 16) rows of one expert. Rows:
T = 1, 4, 16 rows each through 16 experts drawn uniformly, and T = 16 drawn with weight exp(-e/6)
(the synthesised routers favour some experts: the popular ones get 16 rows). For each shape
(tc_shape = tc_shape_batch = (gate+up warps, down warps, stages, blocks a stage), and 8- or 16-row
blocks, and gate+up from rows staged once per call (tc_staged_shape) or not) the time of one call (CUDA-graph replay of
20 calls, best of two medians of five) and the
distinct experts' bytes over it; every shape's output bits against the first shape's.

    python profiling/bench_ffn_shapes.py [--kernel-dir OLD_KERNELS] [--save out.pt]

--kernel-dir compiles the kernels from another copy of kernels/ (an older version, for a
before/after in two processes); --save writes each row's output of the first shape, so two runs'
bits can be compared (torch.equal).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import streamrt.backends.cuda_compile as cuda_compile  # noqa: E402
from bench_kernels import graph_time, nbytes, rand_nvfp4  # noqa: E402
from streamrt.backends.expert_pointers import ExpertTable  # noqa: E402
from streamrt.backends.nvrtc import NvrtcBackend  # noqa: E402
from streamrt.expert_weights import ExpertWeights, ResidentExperts  # noqa: E402

DL, INTER, K, E = 3584, 3072, 16, 24
# (tc_shape = tc_shape_batch, rows a block stages itself, tc_staged_shape: gate+up from staged rows or None)
SHAPES = [((16, 14, 2, 1), 8, None), ((16, 14, 2, 1), 8, (12, 0, 2, 1)), ((16, 14, 2, 1), 8, (12, 4, 2, 1)),
          ((16, 14, 2, 1), 8, (12, 8, 2, 1)), ((16, 14, 2, 1), 8, (12, 4, 4, 1)), ((16, 14, 2, 1), 8, (8, 4, 2, 1)),
          ((16, 14, 2, 1), 8, (6, 4, 2, 1)), ((8, 7, 2, 2), 8, None)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel-dir", type=Path, default=None, help="compile the kernels from this copy of kernels/")
    ap.add_argument("--save", type=Path, default=None, help="write each row's output of the first shape here")
    ap.add_argument("--rows", type=lambda v: [int(t) for t in v.split(",")], default=[1, 4, 16],
                    help="T of the uniform cases (the skewed case has 16)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ffn_shapes: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.kernel_dir is not None:
        if not (args.kernel_dir / "nvfp4_moe.cu").is_file():
            print(f"bench_ffn_shapes: --kernel-dir {args.kernel_dir}: no nvfp4_moe.cu there", file=sys.stderr)
            return 2
        kdir = args.kernel_dir.resolve()
        cuda_compile.kernel_dir = lambda: kdir  # before any kernel loads: one module per process
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    experts = {e: ExpertWeights(rand_nvfp4(INTER, DL), rand_nvfp4(INTER, DL), rand_nvfp4(DL, INTER)) for e in range(E)}
    per_expert = sum(nbytes(m) for m in (experts[0].gate, experts[0].up, experts[0].down))
    table = ExpertTable([0], E, DL, dev)
    for e, ew in experts.items():
        table.place(0, e, ew)
    table.upload()
    popular = torch.exp(-torch.arange(E, dtype=torch.float) / 6)
    cases = [(f"T={T} uniform", torch.stack([torch.randperm(E)[:K] for _ in range(T)])) for T in args.rows]
    cases.append(("T=16 skewed", torch.stack([torch.multinomial(popular, K) for _ in range(16)])))
    saved = {}
    for name, ids in cases:
        T, ids = ids.shape[0], ids.to(dev)
        w = torch.softmax(torch.randn(T, K, device=dev), -1)
        z = torch.randn(T, DL, device=dev)
        resident = ResidentExperts(experts, table.layer(0), table.inter, ids, 0)
        distinct = len(set(ids.flatten().tolist()))
        most = int(torch.bincount(ids.flatten(), minlength=E).max())
        print(f"{name}: {distinct} experts, at most {most} rows of one", flush=True)
        for shape, rows, staged in SHAPES:
            nv = NvrtcBackend(dev)
            nv.tc_shape = nv.tc_shape_batch = shape
            nv.tc_rows, nv.tc_staged_shape = rows, staged
            out = nv.expert_ffn(z, ids, w, resident, 4.0, 25.0)
            saved.setdefault(name, out.cpu())
            same = torch.equal(out.cpu(), saved[name])
            t = min(graph_time(lambda: nv.expert_ffn(z, ids, w, resident, 4.0, 25.0), 20, 5) for _ in range(2))
            label = f"{shape} {rows}-row" + (f", gate+up staged {staged}" if staged else "")
            print(f"    {label}: {t * 1e6:7.1f} us ({distinct * per_expert / t / 1e9:5.0f} GB/s)"
                  f"{'' if same else '  BITS DIFFER from the first shape'}", flush=True)
    if args.save is not None:
        torch.save(saved, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
