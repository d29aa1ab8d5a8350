"""The host's share of an op-by-op decode step on the nvrtc backend, measured on the CPU.

With experts streaming, a decode step runs op by op (no CUDA graph) and the host's Python sits
between every two routers: when it takes as long as the link, the link no longer sets the speed.
This runs the nvrtc backend's own wrappers (checks, tables, argument packing, the `Kernel`
launch's own Python) on a model of deep-k3.1-pro's exact layer schedule, with every launch
answered by a stub driver instead of run and the router's ids drawn at random. The widths are
narrow (hidden 256), so torch's own CPU work stays small: what is timed is the host's Python,
the driver's launch call excluded.

    python profiling/bench_host_path.py                 # ms of host time per step, three rows each
    python profiling/bench_host_path.py --profile 30    # ... and the 30 heaviest functions

Rows:
  runtime   every expert in a slot (no copies: the host's Python alone): the op by op step
            through the StreamingRuntime on its CPU device, the model's and the backend's
            Python, and the scheduler's per-layer work
  stream    the same with a third of the experts in slots (`--gpu-experts`, as the streaming
            rows of bench_graphs): on top, the scheduler's misses, evictions and slot fills
            (the fills are CPU copies here, of narrow experts)
  segments  every expert in a slot: the host's part of the same step under `--cuda-graphs auto` while experts stream
            (runtime/segment_graphs.py) without its graph replays: the step's requests (recorded
            from one op by op step) yielded to the same runtime in order, each answer placed in
            the pointer table, as SegmentGraphs.steps does between two replays
Each row also counts, for one step, the launches and the torch ops that would run a kernel on a
GPU (views and allocations left out; the CPU device's slot fills count as copies). Numbers are
for this machine's CPU; the GPU machine's cores are faster, and the launch calls (or graph
replays) themselves come on top.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections import Counter
from importlib import resources
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from streamrt.backends import cuda_driver
from streamrt.backends import nvrtc as nvm
from streamrt.checkpoint.reader import open_tree
from streamrt.checkpoint.synth import synth
from streamrt.loader import DirectExpertProvider, load_model
from streamrt.model import run_sync
from streamrt.runtime.options import RuntimeOptions
from streamrt.runtime.scheduler import StreamingRuntime
from streamrt.runtime.segment_graphs import SegmentGraphs

# deep-k3.1-pro's schedule (layers, token mixers, indexer layers, AttnRes blocks, 24 experts,
# top 16, two shared) at widths a CPU runs in no time; head dims stay real.
NARROW = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 2,
          "moe_intermediate_size": 256, "routed_expert_hidden_size": 256, "vocab_size": 512,
          "bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 511}


class StubDriver:
    """cuda.bindings.driver at a launch, every call answered at once: a `Kernel`'s own Python
    (argument checks and packing, the launch config) runs, the driver's launch does not."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUlaunchConfig:
        pass

    @staticmethod
    def CUstream(stream):
        return stream

    @staticmethod
    def cuLaunchKernelEx(cfg, fn, params, extra):
        return (0,)

    @staticmethod
    def cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        return (0,)


class RecordedKernel(cuda_driver.Kernel):
    """A loaded kernel's launch on the stub driver, counted by name; its parameter sizes are the
    first call's (the driver's parameter info, on a GPU)."""

    def __init__(self, name: str, count: Counter):
        self._configure(name, 0, None, None)
        self._count = count

    def set_smem_limit(self, smem: int) -> None:  # a driver attribute on a GPU, once per size
        self.smem_limit = smem

    def __call__(self, grid, block, args, smem=0, stream=None, pdl=False):
        self._count[self.name] += 1
        if self.param_sizes is None:
            self._configure(self.name, 0, None, [len(a) for a in args])
        super().__call__(grid, block, args, smem, stream, pdl)


@contextlib.contextmanager
def stub_driver():
    """The driver plumbing a launch calls, the stub's while the block runs, then the real one
    again (a process that imports this, such as the test suite, may launch on a GPU later)."""
    stubs = {"driver": lambda: StubDriver, "make_current": lambda device_index: None,
             "current_stream": lambda device_index: 0, "_pdl_attr": lambda: None}
    real = {name: getattr(cuda_driver, name) for name in stubs}
    try:
        for name, f in stubs.items():
            setattr(cuda_driver, name, f)
        yield
    finally:
        for name, f in real.items():
            setattr(cuda_driver, name, f)


class Launches:
    """Stands in for every loaded kernel: launches through the stub driver (`stub_driver`),
    counted by name."""

    def __init__(self):
        self.count = Counter()
        self._kernels: dict[str, RecordedKernel] = {}

    def kernel(self, program, name):
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = RecordedKernel(name, self.count)
        return k


# aten ops that move no data (a GPU runs no kernel for them)
NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "reshape", "as_strided", "unsqueeze", "squeeze", "expand", "t",
             "transpose", "permute", "alias", "detach", "split", "unbind", "narrow", "empty", "empty_strided",
             "is_same_size", "lift_fresh", "_local_scalar_dense"}


class TorchOps(TorchDispatchMode):
    """Counts the torch ops of a step that would run kernels on a GPU (views, allocations and
    the harness's own stand-in for the router's outputs left out)."""

    def __init__(self):
        super().__init__()
        self.count, self.paused = Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in NO_KERNEL:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


class HostOnlyNvrtc(nvm.NvrtcBackend):
    """The nvrtc backend's host side on CPU tensors: launches recorded, router ids drawn."""

    def __init__(self, launches: Launches, experts: int, seed: int = 0):
        # not NvrtcBackend.__init__ (it needs a CUDA device): an H200's properties
        self._configure(torch.device("cpu"), 64, "tc", capability=(9, 0), smem_optin=227 * 1024, sms=132)
        self._launches, self._experts = launches, experts
        # routed ids from a pool of random permutations drawn once: the harness's own work per
        # route is one copy, not a draw per row
        gen = torch.Generator().manual_seed(seed)
        self._perms = torch.stack([torch.randperm(experts, generator=gen) for _ in range(4096)])
        self._next = 0
        self.counting: TorchOps | None = None  # the torch op count of the step being counted

    def _k(self, program, name):
        return self._launches.kernel(program, name)

    def _empty(self, *shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype)

    def route(self, logits, bias, k, *args, **kw):
        ids, wts = super().route(logits, bias, k, *args, **kw)
        ops = self.counting
        if ops is not None:  # on a GPU the router's kernel writes these
            ops.paused = True
        T = ids.shape[0]
        if self._next + T > len(self._perms):
            self._next = 0
        ids.copy_(self._perms[self._next : self._next + T, :k])
        self._next += T
        wts.fill_(1.0 / k)
        if ops is not None:
            ops.paused = False
        return ids, wts


def recorded(gen, requests: list):
    """`gen` passed through, its requests kept (the tensors a chain's replays would leave)."""
    try:
        req = next(gen)
        while True:
            requests.append(req)
            req = gen.send((yield req))
    except StopIteration as stop:
        return stop.value


def between_replays(segments: SegmentGraphs, requests: list, ids):
    """SegmentGraphs.steps' replay loop with the replays left out: the host's part of the step."""
    model = segments.model
    if model.step_hint is not None:
        model.step_hint(model.embed(ids))
    for req in requests:
        segments._place(req, (yield req))
    return None


def narrow_config(path: Path) -> Path:
    cfg = json.loads(resources.files("streamrt").joinpath("configs", "deep-k3.1-pro.json").read_text())
    cfg["_streamrt_name"] = "deep-k3.1-pro-narrow"
    cfg.update({k: v for k, v in NARROW.items() if k in cfg})
    t = cfg["text_config"]
    t.update({k: v for k, v in NARROW.items() if k in t})
    t["linear_attn_config"]["num_heads"] = 2
    t["dsa_config"]["index_n_heads"] = 2
    path.write_text(json.dumps(cfg))
    return path


def timed_steps(step, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per row")
    ap.add_argument("--repeats", type=int, default=3, help="rows per mode (the spread)")
    ap.add_argument("--modes", default="runtime,stream,segments", help="comma-separated: runtime, stream, segments")
    ap.add_argument(
        "--profile", type=int, default=0, metavar="N", help="cProfile one row per mode, print the N heaviest"
    )
    ap.add_argument(
        "--workdir", type=Path, default=None, help="where the narrow tree is synthesised (default: a temp dir)"
    )
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in ("runtime", "stream", "segments")]:
        ap.error(f"--modes: unknown {bad}")
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp, stub_driver():
        work = args.workdir or Path(tmp)
        tree_dir = work / "deep-narrow"
        if not (tree_dir / "config.json").exists():
            synth(str(narrow_config(work / "deep-narrow.json")), tree_dir, fmt="streamrt", seed=0, progress=False)
        tree = open_tree(tree_dir)
        cfg = tree.config
        launches = Launches()
        backend = HostOnlyNvrtc(launches, cfg.num_experts)
        model = load_model(tree, "cpu", dtype=torch.bfloat16, backend=backend)
        # on the CPU the weights are views into the mapped files, at any offset; on a GPU each is
        # its own allocation (aligned), which the tensor-core GEMV needs, else a scalar one runs
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                t.data = t.data.clone()
        print(f"config: {cfg.num_layers} layers, {len(cfg.moe_layers)} MoE layers of {cfg.num_experts} experts, "
              f"top {cfg.experts_per_token}; torch {torch.__version__}, 1 thread")

        rt = StreamingRuntime(tree, model, RuntimeOptions(device="cpu", gpu_experts=cfg.expert_files), workers=2)
        rt.preload()
        cache = model.new_cache(1)
        with torch.no_grad():
            run_sync(
                model.forward_steps(torch.tensor([[1, 2, 3, 4]]), cache, last_only=True), DirectExpertProvider(tree)
            )
            requests = []
            rt.run(recorded(model.forward_steps(torch.tensor([[5]]), cache), requests), tokens=1)
            segments = SegmentGraphs(model, tensor_core=True)
            for mode in modes:
                streaming = None
                if mode == "runtime":
                    step = lambda: rt.run(model.forward_steps(torch.tensor([[5]]), cache), tokens=1)  # noqa: E731
                elif mode == "stream":  # a runtime of its own: a third of the experts in slots, filled on demand
                    streaming = StreamingRuntime(
                        tree, model, RuntimeOptions(device="cpu", gpu_experts=cfg.expert_files // 3), workers=2
                    )
                    step = lambda: streaming.run(model.forward_steps(torch.tensor([[5]]), cache), tokens=1)  # noqa: E731
                else:
                    step = lambda: rt.run(between_replays(segments, requests, torch.tensor([[5]])), tokens=1)  # noqa: E731
                step()  # warm: first-call caches
                launches.count.clear()
                stats = (streaming or rt).stats
                h2d = stats.bytes_h2d
                ops = backend.counting = TorchOps()
                with ops:
                    step()
                backend.counting = None
                per_step = sum(launches.count.values())
                fills = f", {(stats.bytes_h2d - h2d) / 2**20:.1f} MiB of slot fills" if streaming else ""
                rows = [statistics.median(timed_steps(step, args.steps)) for _ in range(args.repeats)]
                print(
                    f"{mode:8s} host ms/step (median of {args.steps} steps), rows: "
                    + ", ".join(f"{r:.1f}" for r in rows)
                    + f"; spread {100 * (max(rows) - min(rows)) / min(rows):.1f} %; {per_step} launches + "
                      f"{sum(ops.count.values())} torch ops/step{fills}"
                )
                if args.profile:
                    prof = cProfile.Profile()
                    prof.enable()
                    timed_steps(step, args.steps)
                    prof.disable()
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
                    print(out.getvalue())
                if streaming is not None:
                    streaming.close()
        rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
