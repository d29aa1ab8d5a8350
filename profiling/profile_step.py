"""Where one decode step's time goes: host (Python) vs GPU, per op (one run, one GPU).

Runs the streaming runtime on a `slice` tree with every expert resident (no link traffic), so
the step time is compute plus host overhead only, and reports:
  * wall ms/step, GPU busy ms/step (sum of kernel times from the CUDA profiler), kernels/step;
  * the top GPU kernels by time and the top host functions by own time (cProfile).
If GPU busy is far below wall, the step is host-bound: the fix is fewer launches / less Python
per op, not faster kernels.

    python profiling/profile_step.py --workdir /tmp/streamrt-bench [--backend nvrtc] [--steps 6]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import ensure_tree  # noqa: E402

from streamrt.loader import load_model  # noqa: E402
from streamrt.runtime.options import RuntimeOptions  # noqa: E402
from streamrt.runtime.scheduler import StreamingRuntime  # noqa: E402
from streamrt.runtime.streams import make_device  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/streamrt-bench"))
    ap.add_argument("--config", default="slice-k3.1-pro")
    ap.add_argument("--backend", default="nvrtc", choices=("nvrtc", "torch"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--gpu-experts", type=int, default=None, help="default: all (resident)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (torch backend)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("profile_step: needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    device = make_device(args.device)
    tree = ensure_tree(args.workdir, args.config)
    cfg = tree.config
    backend = None
    if args.backend == "nvrtc" and cuda:
        from streamrt.backends.nvrtc import NvrtcBackend

        backend = NvrtcBackend(device.torch_device)
    model = load_model(tree, device.torch_device, dtype=torch.bfloat16 if cuda else None, backend=backend)
    slots = args.gpu_experts or cfg.expert_files
    rt = StreamingRuntime(tree, model, RuntimeOptions(device=args.device, gpu_experts=slots), device=device)
    if slots >= cfg.expert_files:
        rt.preload()
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, cfg.vocab_size - 256, (4 + 3 + 3 * args.steps,), generator=g).tolist()
    cache = model.new_cache(1)
    it = iter(toks[4:])

    def step():
        return rt.run(model.forward_steps(torch.tensor([[next(it)]]), cache), tokens=1)

    with torch.no_grad():
        rt.run(model.forward_steps(torch.tensor([toks[:4]]), cache, last_only=True))
        for _ in range(3):
            step()
        sync()
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        wall = (time.perf_counter() - t) / args.steps
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                      + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
        with prof:
            for _ in range(args.steps):
                step()
            sync()
        cp = cProfile.Profile()
        cp.enable()
        for _ in range(args.steps):
            step()
        sync()
        cp.disable()
    rt.close()

    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kern) / 1e3 / args.steps  # ms
    print(f"profile_step: {args.config}, backend {args.backend}, {slots} device slots, {args.steps} steps")
    print(f"wall {wall * 1e3:.2f} ms/step (no profiler); GPU kernels {busy:.2f} ms/step busy; "
          f"{len(kern) / args.steps:.0f} kernels/step; GPU busy / wall = {busy / (wall * 1e3):.2f}")
    by = {}
    for e in kern:
        n, c = by.get(e.name, (0, 0.0))
        by[e.name] = (n + 1, c + e.device_time)
    print("\ntop GPU kernels (per step):  calls   ms")
    for name, (n, c) in sorted(by.items(), key=lambda kv: -kv[1][1])[:18]:
        print(f"  {name[:60]:60s} {n / args.steps:6.1f} {c / 1e3 / args.steps:7.3f}")
    s = io.StringIO()
    pstats.Stats(cp, stream=s).sort_stats("tottime").print_stats(28)
    print("\nhost functions by own time (cProfile, all steps; cProfile slows Python ~1.5-2x):")
    print("\n".join(s.getvalue().splitlines()[4:40]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
