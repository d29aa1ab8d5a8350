"""Runtime flags shared by `run`, `selfcheck` and the profiling scripts.

    add_runtime_flags(parser)          adds the flags below
    RuntimeOptions.from_args(args)     validates them (StreamrtError naming the flag)
    opts.resolve(cfg, file_bytes, device)  -> ResolvedSizes(window, gpu_experts)

The failure-mode switches reproduce the seed's engine for the sweep and are off by default:
`--preparse`, `--prefetch discard`, `--evict sync`, `--staging off` (pageable, unstaged: the
baseline).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from streamrt.errors import StreamrtError
from streamrt.store.policies import DEFAULT_POLICY, POLICIES

DEFAULT_WINDOW_FLOOR = 65536
CPU_SLAB_BYTES = 2 << 30  # default device-tier budget of the CPU twin
GPU_RESERVE_BYTES = 6 << 30  # left free for activations, caches and workspace by default
DEFAULT_STAGE_DEPTH = 2  # staged copies in flight on the copy stream at once (--stage-depth)
# Upper limits of the integer flags: far beyond any machine (a K3.1 Pro tree has ~60k expert
# files), low enough that a typo is one line here and not an allocation failure later.
MAX_WINDOW = 1 << 24  # open expert mappings
MAX_GPU_EXPERTS = 1 << 20  # device slots
MAX_STAGE = 1 << 16  # --stage-max / --stage-depth
MAX_BYTES = 1 << 50  # --host-mem / --gpu-mem: 1 PiB

MAX_READ_THREADS = 256
DEFAULT_READ_THREADS = 16  # store/disk_reader.py: 16 whole-file reads in flight


def parse_read_threads(text) -> int:
    """'--read-threads': 'auto' -> -1, None -> 0 (the default), else 1..MAX_READ_THREADS."""
    if text is None:
        return 0
    if str(text).strip().lower() == "auto":
        return -1
    try:
        n = int(str(text).strip())
    except ValueError:
        raise StreamrtError(f"--read-threads: expected a thread count or auto, got {str(text)[:40]!r}") from None
    if not 1 <= n <= MAX_READ_THREADS:
        raise StreamrtError(f"--read-threads must be auto or 1..{MAX_READ_THREADS}, got {n}")
    return n


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_bytes(text: str, flag: str) -> int:
    """'64G', '512MiB', '1.5TB', '1000000' -> bytes (K/M/G/T alone are binary)."""
    m = re.fullmatch(r"\s*([0-9]{0,20}\.?[0-9]{1,20})\s*([a-zA-Z]*)\s*", str(text)[:100])
    if not m or m.group(2).lower() not in _UNITS:
        raise StreamrtError(f"{flag}: expected a size like 64G, 512MiB or 1.5TB, got {str(text)[:60]!r}")
    x = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not x < MAX_BYTES + 1:
        raise StreamrtError(f"{flag}: at most {MAX_BYTES} bytes (1 PiB), got {text!r}")
    n = int(x)
    if n <= 0:
        raise StreamrtError(f"{flag}: must be positive, got {text!r}")
    return n


def add_runtime_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("streaming runtime")
    g.add_argument("--window", type=int, default=None, metavar="N",
                   help="expert mappings kept open in host memory (LRU); default max(2 x working set, 65536), "
                        "capped by --host-mem")
    g.add_argument("--host-mem", default=None, metavar="BYTES", help="cap on mapped expert bytes (e.g. 96G)")
    g.add_argument("--gpu-experts", type=int, default=None, metavar="M",
                   help="expert slots on the device; default from --gpu-mem or free device memory")
    g.add_argument("--gpu-mem", default=None, metavar="BYTES", help="device memory for expert slots (e.g. 40G)")
    g.add_argument("--gpu-policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                   help=f"device-tier replacement policy (default {DEFAULT_POLICY}: frequency with aging)")
    g.add_argument("--staging", default="on", choices=("on", "off"),
                   help="on: copy stream, page-locked mappings, stage predicted experts of the next layer; "
                        "off: pageable synchronous copies, no staging (the baseline)")
    g.add_argument("--stage-max", type=int, default=None, metavar="N",
                   help="queue at most the N most confident guesses for the next layer for staging (default: "
                        "every guess that fits in free device slots); a wrong guess that is "
                        "issued costs link time and a device slot")
    g.add_argument("--stage-depth", type=int, default=DEFAULT_STAGE_DEPTH, metavar="N",
                   help="staged guesses in flight on the copy stream at once (default %(default)s): the rest wait "
                        "in a queue, most confident first, and are issued one by one as earlier copies finish; "
                        "those still waiting when the layer's router speaks are dropped (a routed one is then "
                        "fetched as an ordinary miss), so real misses queue behind at most N guesses")
    g.add_argument("--preparse", action="store_true", help="failure mode: eagerly map and parse experts at load")
    g.add_argument("--prefetch", default="none", choices=("none", "discard"),
                   help="failure mode 'discard': read each routed file into a throwaway buffer first")
    g.add_argument("--evict", default="event", choices=("event", "sync"),
                   help="event: retire evicted mappings behind a copy-stream event (FIFO); "
                        "sync: synchronize the device per eviction (failure mode)")
    g.add_argument("--stats-json", default=None, metavar="FILE", help="write runtime counters as JSON")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="write a Chrome-trace JSON of every step (open in Perfetto; `streamrt trace summarize FILE`)")
    g.add_argument("--verify-experts", default="first", choices=("first", "off"),
                   help="first (default): check each expert file's checksum against the manifest the first "
                        "time this process maps it, on the I/O pool, so a corrupt file is an error, never "
                        "wrong numbers; off: header checks only")
    g.add_argument("--host-tier", default="auto", choices=("auto", "mapped", "pool"),
                   help="mapped: expert files mapped and page-locked in place (the store fits in RAM); pool: a "
                        "pool of page-locked buffers under --host-mem filled by O_DIRECT reads (checkpoints "
                        "bigger than RAM); auto (default): mapped when the experts fit in --host-mem or in "
                        "the memory available, else pool")
    g.add_argument("--read-threads", default=str(DEFAULT_READ_THREADS), metavar="N|auto",
                   help="pool tier: reader threads, each one whole-file O_DIRECT read in flight (default "
                        "%(default)s; auto: the fewest of 4/8/16/32 within 5%% of the best, measured at start)")
    g.add_argument("--gds", default="auto", choices=("auto", "on", "off"),
                   help="pool tier: GPUDirect Storage through kvikio/cuFile where present (auto), required "
                        "(on) or not used (off); the start line says which path runs")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--backend", default="torch", choices=("torch", "nvrtc"),
                   help="ops backend: torch (reference, CPU and GPU) or nvrtc (CUDA kernels compiled at run "
                        "time; decode path; prefill GEMMs stay on cuBLAS)")
    return parser


@dataclass(frozen=True)
class ResolvedSizes:
    window: int
    gpu_experts: int


@dataclass(frozen=True)
class RuntimeOptions:
    window: int | None = None
    host_mem: int | None = None
    gpu_experts: int | None = None
    gpu_mem: int | None = None
    gpu_policy: str = DEFAULT_POLICY
    staging: bool = True
    stage_max: int | None = None
    stage_depth: int = DEFAULT_STAGE_DEPTH
    preparse: bool = False
    prefetch: str = "none"
    evict: str = "event"
    stats_json: str | None = None
    trace: str | None = None
    verify_experts: str = "first"
    device: str = "auto"
    backend: str = "torch"
    host_tier: str = "auto"  # issue 21: mapped | pool | auto
    read_threads: int = 0  # 0: DEFAULT_READ_THREADS; -1: auto-tuned at start
    gds: str = "auto"

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise StreamrtError(f"--window must be >= 1 (expert mappings kept open), got {self.window}")
        if self.gpu_experts is not None and self.gpu_experts < 1:
            raise StreamrtError(f"--gpu-experts must be >= 1, got {self.gpu_experts}")
        if self.stage_max is not None and self.stage_max < 0:
            raise StreamrtError(f"--stage-max must be >= 0 (guesses staged per layer), got {self.stage_max}")
        if self.stage_depth < 1:
            raise StreamrtError(f"--stage-depth must be >= 1 (staged copies in flight), got {self.stage_depth}")
        for flag, value, hi in (("--window", self.window, MAX_WINDOW), ("--gpu-experts", self.gpu_experts, MAX_GPU_EXPERTS),
                                ("--stage-max", self.stage_max, MAX_STAGE), ("--stage-depth", self.stage_depth, MAX_STAGE)):
            if value is not None and value > hi:
                raise StreamrtError(f"{flag} must be at most {hi}, got {value}")
        if self.gpu_policy not in POLICIES:
            raise StreamrtError(f"--gpu-policy: unknown policy {self.gpu_policy!r}; choose one of {', '.join(POLICIES)}")
        if self.prefetch not in ("none", "discard"):
            raise StreamrtError(f"--prefetch: expected none or discard, got {self.prefetch!r}")
        if self.backend not in ("torch", "nvrtc"):
            raise StreamrtError(f"--backend: expected torch or nvrtc, got {self.backend!r}")
        if self.evict not in ("event", "sync"):
            raise StreamrtError(f"--evict: expected event or sync, got {self.evict!r}")
        if self.host_tier not in ("auto", "mapped", "pool"):
            raise StreamrtError(f"--host-tier: expected auto, mapped or pool, got {self.host_tier!r}")
        if self.gds not in ("auto", "on", "off"):
            raise StreamrtError(f"--gds: expected auto, on or off, got {self.gds!r}")
        if not -1 <= self.read_threads <= MAX_READ_THREADS:
            raise StreamrtError(f"--read-threads must be auto or 1..{MAX_READ_THREADS}, got {self.read_threads}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RuntimeOptions":
        staging = getattr(args, "staging", "on")
        if staging not in ("on", "off", True, False):
            raise StreamrtError(f"--staging: expected on or off, got {staging!r}")
        host_mem = getattr(args, "host_mem", None)
        gpu_mem = getattr(args, "gpu_mem", None)
        return cls(
            window=getattr(args, "window", None),
            host_mem=parse_bytes(host_mem, "--host-mem") if host_mem is not None else None,
            gpu_experts=getattr(args, "gpu_experts", None),
            gpu_mem=parse_bytes(gpu_mem, "--gpu-mem") if gpu_mem is not None else None,
            gpu_policy=getattr(args, "gpu_policy", DEFAULT_POLICY),
            staging=staging in ("on", True),
            stage_max=getattr(args, "stage_max", None),
            stage_depth=getattr(args, "stage_depth", DEFAULT_STAGE_DEPTH),
            preparse=bool(getattr(args, "preparse", False)),
            prefetch=getattr(args, "prefetch", "none"),
            evict=getattr(args, "evict", "event"),
            stats_json=getattr(args, "stats_json", None),
            trace=getattr(args, "trace", None),
            verify_experts=getattr(args, "verify_experts", "first"),
            device=getattr(args, "device", "auto"),
            backend=getattr(args, "backend", "torch"),
            host_tier=getattr(args, "host_tier", "auto"),
            read_threads=parse_read_threads(getattr(args, "read_threads", None)),
            gds=getattr(args, "gds", "auto"),
        )

    def check_output_paths(self) -> "RuntimeOptions":
        """Before any work: --stats-json and --trace must be writable files (one line, exit 2)."""
        from streamrt.checkpoint.fileio import check_output_path

        for flag, path in (("--stats-json", self.stats_json), ("--trace", self.trace)):
            if path is not None:
                check_output_path(path, flag)
        return self

    def make_backend(self, device):
        """The ops backend for `device` (a streams.Device); None means the model's default (torch)."""
        if self.backend == "torch":
            return None
        if device.kind != "cuda":
            raise StreamrtError("--backend nvrtc needs a CUDA device (this machine has none, or --device cpu)")
        from streamrt.backends.nvrtc import NvrtcBackend

        return NvrtcBackend(device.torch_device)

    def resolve(self, cfg, file_bytes: int, device, *, batch: int = 1) -> ResolvedSizes:
        """Concrete window and slot count for a model config and device."""
        working_set = cfg.working_set_experts
        window = self.window if self.window is not None else max(2 * working_set, DEFAULT_WINDOW_FLOOR)
        if self.host_mem is not None:
            cap = self.host_mem // file_bytes
            if cap < 1:
                raise StreamrtError(f"--host-mem {self.host_mem} bytes holds no {file_bytes}-byte expert file")
            window = min(window, cap)
        window = min(window, cfg.expert_files) if self.window is None else window

        per_layer = min(cfg.num_experts, batch * cfg.experts_per_token)
        if self.gpu_experts is not None:
            slots = self.gpu_experts
        else:
            if self.gpu_mem is not None:
                budget = self.gpu_mem
            elif device.kind == "cuda":
                budget = max(0, (device.free_bytes() or 0) - GPU_RESERVE_BYTES)
            else:
                budget = CPU_SLAB_BYTES
            slots = min(cfg.expert_files, budget // file_bytes)
        if slots < per_layer:
            raise StreamrtError(
                f"--gpu-experts {slots}: one layer request needs up to {per_layer} expert slots "
                f"(batch {batch} x top-{cfg.experts_per_token}); raise --gpu-experts or --gpu-mem"
            )
        return ResolvedSizes(window=window, gpu_experts=slots)
