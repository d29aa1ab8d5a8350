"""Runtime flags shared by `run`, `selfcheck` and the profiling scripts.

    add_runtime_flags(parser)          adds the flags: one per RuntimeOptions field, made from its `Flag`
    RuntimeOptions.from_args(args)     validates them (StreamrtError naming the flag)

Each flag's default, choices and help are stated once, on its field; the tiers take the
validated values and do not check them again.
    opts.resolve(cfg, file_bytes, device)  -> ResolvedSizes(window, gpu_experts)

The failure-mode switches reproduce the seed's engine for the sweep and are off by default:
`--preparse`, `--prefetch discard`, `--evict sync`, `--copies sync` (pageable, unstaged: the
baseline). Any of them selects the seed baseline runtime (runtime/seed_baseline.py) in place
of the production scheduler (`RuntimeOptions.seed_baseline`).
"""

from __future__ import annotations

import dataclasses

import argparse
import re
from dataclasses import dataclass, field, fields
from typing import Callable

from streamrt.errors import StreamrtError
from streamrt.store.disk_reader import DEFAULT_READ_THREADS
from streamrt.store.policies import DEFAULT_POLICY, POLICIES

DEFAULT_WINDOW_FLOOR = 65536
CPU_SLAB_BYTES = 2 << 30  # default device-tier budget of the CPU twin
GPU_RESERVE_BYTES = 6 << 30  # left free for activations, caches and workspace by default
DEFAULT_STAGE_DEPTH = 2  # staged copies in flight on the copy stream at once (--stage-depth), op by op
SEGMENT_STAGE_DEPTH = 1  # the same while segment graphs replay (the host idles, so every guess it may goes out)
# Upper limits of the integer flags: far beyond any machine (a K3.1 Pro tree has ~60k expert
# files), low enough that a typo is one line here and not an allocation failure later.
MAX_WINDOW = 1 << 24  # open expert mappings
MAX_GPU_EXPERTS = 1 << 20  # device slots
MAX_STAGE = 1 << 16  # --stage-max / --stage-depth
MAX_BYTES = 1 << 50  # --host-mem / --gpu-mem: 1 PiB

MAX_READ_THREADS = 256


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


MAX_CPU_THREADS = 1024


def parse_cpu_experts(text) -> str:
    """'--cpu-experts': 'off', 'auto', or a share of the routed experts in [0, 1] ('0.25' or '25%'),
    returned as 'off', 'auto' or the share's repr."""
    t = str(text if text is not None else "off").strip().lower()
    if t in ("off", "auto"):
        return t
    try:
        share = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        share = float("nan")
    if not 0.0 <= share <= 1.0:
        raise StreamrtError(f"--cpu-experts: expected off, auto or a share in [0, 1] (e.g. 0.25 or 25%), "
                            f"got {str(text)[:40]!r}")
    return repr(share)


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


@dataclass(frozen=True)
class Flag:
    """How a RuntimeOptions field is a command-line flag (`--` + its name, dashed). The flag's
    default is the field's unless `default` names another (a string the field's `parse` reads);
    `parse` turns the parsed flag value into the field's (default: as it is); `choices`, when
    the field holds one of them, are also checked on construction."""

    help: str
    choices: tuple | None = None
    metavar: str | None = None
    type: Callable | None = None
    action: str | None = None
    default: object = None  # None: the field's
    parse: Callable | None = None


def _flag(value, help: str, **kw):
    """A field whose default is `value`, and its flag."""
    return field(default=value, metadata={"flag": Flag(help, **kw)})


def _bytes_of(flag: str) -> Callable:
    return lambda text: parse_bytes(text, flag) if text is not None else None


def _bytes_or_off(flag: str) -> Callable:
    """As `_bytes_of`, and 0 (off) allowed."""
    return lambda text: 0 if text is not None and str(text).strip() == "0" else _bytes_of(flag)(text)


class _Renamed(argparse.Action):
    """A flag's old spelling: refused with one line naming the new one."""

    def __init__(self, option_strings, dest, hint: str, **kw) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kw)
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} was renamed: {self.hint}")


RENAMED_FLAGS = {"--staging": "use --copies async (was on) or --copies sync (was off)"}


def _one_of(choices) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1]


def flag_name(f) -> str:
    return "--" + f.name.replace("_", "-")


def add_runtime_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The runtime flags, one per RuntimeOptions field, in its order, under one group."""
    g = parser.add_argument_group("streaming runtime")
    for f in fields(RuntimeOptions):
        spec: Flag = f.metadata["flag"]
        kw = {k: v for k, v in (("choices", spec.choices), ("metavar", spec.metavar), ("type", spec.type))
              if v is not None}
        if spec.action is not None:
            kw["action"] = spec.action
        else:
            kw["default"] = f.default if spec.default is None else spec.default
        g.add_argument(flag_name(f), help=spec.help, **kw)
    for old, hint in RENAMED_FLAGS.items():
        g.add_argument(old, action=_Renamed, hint=hint, dest="_renamed_" + old.strip("-"), default=argparse.SUPPRESS)
    return parser


@dataclass(frozen=True)
class ResolvedSizes:
    window: int
    gpu_experts: int


@dataclass(frozen=True)
class RuntimeOptions:
    window: int | None = _flag(
        None, "expert mappings kept open in host memory (LRU); default max(2 x working set, 65536), "
              "capped by --host-mem", type=int, metavar="N")
    host_mem: int | None = _flag(None, "cap on mapped expert bytes (e.g. 96G)", metavar="BYTES",
                                 parse=_bytes_of("--host-mem"))
    gpu_experts: int | None = _flag(None, "expert slots on the device; default from --gpu-mem or free device memory",
                                    type=int, metavar="M")
    gpu_mem: int | None = _flag(None, "device memory streamrt may use (e.g. 40G): the placement plan keeps the dense "
                                      "weights that fit resident, streams the other layers' through device buffers and "
                                      "makes the rest expert slots (`streamrt inspect --gpu-mem` prints it)",
                                metavar="BYTES", parse=_bytes_of("--gpu-mem"))
    gpu_policy: str = _flag(DEFAULT_POLICY, f"device-tier replacement policy (default {DEFAULT_POLICY}: frequency with "
                                            f"aging)", choices=tuple(sorted(POLICIES)))
    copies: str = _flag("async", "async (default): expert copies on the copy stream from page-locked memory, the next "
                                 "layer's predicted experts staged ahead; sync: pageable synchronous copies, nothing "
                                 "staged (the seed's engine, a failure mode for the sweep)", choices=("async", "sync"))
    stage_max: int | None = _flag(
        None, "queue at most the N most confident guesses for the next layer for staging (default: every guess "
              "that fits in free device slots); a wrong guess that is issued costs link time and a device slot",
        type=int, metavar="N")
    stage_depth: int | None = _flag(
        None, f"staged guesses in flight on the copy stream at once (default {DEFAULT_STAGE_DEPTH} op by op, "
        f"{SEGMENT_STAGE_DEPTH} while decode steps replay as graphs): the rest wait in a queue, most confident "
        "first, and are issued one by one as earlier copies finish; those still waiting when the layer's router "
        "speaks are dropped (a routed one is then fetched as an ordinary miss), so real misses queue behind at "
        "most N guesses", type=int, metavar="N")
    preparse: bool = _flag(False, "failure mode: eagerly map and parse experts at load", action="store_true",
                           parse=bool)
    prefetch: str = _flag("none", "failure mode 'discard': read each routed file into a throwaway buffer first",
                          choices=("none", "discard"))
    evict: str = _flag("event", "event: retire evicted mappings behind a copy-stream event (FIFO); "
                                "sync: synchronize the device per eviction (failure mode)", choices=("event", "sync"))
    stats_json: str | None = _flag(None, "write runtime counters as JSON", metavar="FILE")
    trace: str | None = _flag(None, "write a Chrome-trace JSON of every step (open in Perfetto; `streamrt trace "
                                    "summarize FILE`)", metavar="FILE")
    verify_experts: str = _flag(
        "first", "first (default): check each expert file's checksum against the manifest the first time this "
                 "process maps it, on the I/O pool, so a corrupt file is an error, never wrong numbers; off: header "
                 "checks only", choices=("first", "off"))
    host_tier: str = _flag(
        "auto", "mapped: expert files mapped and page-locked in place (the store fits in RAM); pool: a pool of "
                "page-locked buffers under --host-mem filled by O_DIRECT reads (checkpoints bigger than RAM); auto "
                "(default): mapped when the experts fit in --host-mem or in the memory available, else pool",
        choices=("auto", "mapped", "pool"))
    read_threads: int = _flag(  # 0: DEFAULT_READ_THREADS; -1: auto-tuned at start
        0, "pool tier: reader threads, each one whole-file O_DIRECT read in flight (default %(default)s; auto: the "
           "fewest of 4/8/16/32 within 5%% of the best, measured at start)",
        default=str(DEFAULT_READ_THREADS), metavar="N|auto", parse=parse_read_threads)
    gds: str = _flag("auto", "pool tier: GPUDirect Storage through kvikio/cuFile where present (auto), required "
                             "(on) or not used (off); the start line says which path runs",
                     choices=("auto", "on", "off"))
    cuda_graphs: str = _flag(
        "auto", "with the nvrtc backend and the dense layers resident, decode steps replay CUDA graphs. auto "
                "(default): a whole step as one graph once every routed expert sits in a device slot, and while "
                "experts stream the work between two routers as one graph each; resident: only the former (op by op "
                "while experts stream); off: op by op (the same tokens, more host time)",
        choices=("auto", "resident", "off"))
    prefill_order: str = _flag(
        "layer", "a prompt longer than one prefill chunk: layer (default) runs each layer over the whole prompt, so "
                 "each MoE layer fetches the prompt's routed experts once; chunk runs each chunk through every layer "
                 "(each chunk fetches its experts again). The same logits bit for bit", choices=("layer", "chunk"))
    prefix_cache_mem: int | None = _flag(
        None, "host memory for prefix-cache snapshots (e.g. 16G; page-locked on CUDA): a request resumes from the "
              "state after the longest prefix of its tokens an earlier prompt left and prefills only the rest, "
              "bit-identically; default an eighth of the available memory, 0: off", metavar="BYTES",
        parse=_bytes_or_off("--prefix-cache-mem"))
    cpu_experts: str = _flag(
        "off", "compute a share of the routed experts on the host CPUs with the NVFP4 CPU kernel (built on first use "
               "with the system C compiler). SHARE in [0, 1] (or N%%): an expert's home is a fixed function of its "
               "key and the share, so answers stay a function of the routing and the configuration; auto: on a "
               "machine without a GPU, every routed expert (the torch path shares the same cores and is slower); "
               "off (default): none", metavar="off|auto|SHARE", parse=parse_cpu_experts)
    cpu_threads: int = _flag(0, "threads of the CPU expert kernel (default: OpenMP's, one per core)", type=int,
                             metavar="N")
    device: str = _flag("auto", "auto, cpu, cuda or cuda:N")
    backend: str = _flag("torch", "ops backend: torch (reference, CPU and GPU) or nvrtc (CUDA kernels compiled at run "
                                  "time; decode path; prefill GEMMs stay on cuBLAS)", choices=("torch", "nvrtc"))

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise StreamrtError(f"--window must be >= 1 (expert mappings kept open), got {self.window}")
        if self.gpu_experts is not None and self.gpu_experts < 1:
            raise StreamrtError(f"--gpu-experts must be >= 1, got {self.gpu_experts}")
        if self.stage_max is not None and self.stage_max < 0:
            raise StreamrtError(f"--stage-max must be >= 0 (guesses staged per layer), got {self.stage_max}")
        if self.stage_depth is not None and self.stage_depth < 1:
            raise StreamrtError(f"--stage-depth must be >= 1 (staged copies in flight), got {self.stage_depth}")
        for flag, value, hi in (("--window", self.window, MAX_WINDOW),
                                ("--gpu-experts", self.gpu_experts, MAX_GPU_EXPERTS),
                                ("--stage-max", self.stage_max, MAX_STAGE),
                                ("--stage-depth", self.stage_depth, MAX_STAGE)):
            if value is not None and value > hi:
                raise StreamrtError(f"{flag} must be at most {hi}, got {value}")
        if self.gpu_policy not in POLICIES:
            raise StreamrtError(f"--gpu-policy: unknown policy {self.gpu_policy!r}; choose one of "
                                f"{', '.join(POLICIES)}")
        for f in fields(self):
            choices, value = f.metadata["flag"].choices, getattr(self, f.name)
            if choices and isinstance(value, str) and f.name != "gpu_policy" and value not in choices:
                raise StreamrtError(f"{flag_name(f)}: expected {_one_of(choices)}, got {value!r}")
        if not 0 <= self.cpu_threads <= MAX_CPU_THREADS:
            raise StreamrtError(f"--cpu-threads must be 0 (one per core) .. {MAX_CPU_THREADS}, got {self.cpu_threads}")
        parse_cpu_experts(self.cpu_experts)
        if not -1 <= self.read_threads <= MAX_READ_THREADS:
            raise StreamrtError(f"--read-threads must be auto or 1..{MAX_READ_THREADS}, got {self.read_threads}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RuntimeOptions":
        """The options from parsed runtime flags (a flag the parser lacks keeps the field's default)."""
        values = {}
        for f in fields(cls):
            if hasattr(args, f.name):
                parse = f.metadata["flag"].parse
                value = getattr(args, f.name)
                values[f.name] = parse(value) if parse is not None else value
        return cls(**values)

    @property
    def seed_baseline(self) -> bool:
        """Whether a failure mode of the seed is asked for: the runtime is then the seed baseline."""
        return self.copies == "sync" or self.preparse or self.prefetch == "discard" or self.evict == "sync"

    def check_output_paths(self) -> "RuntimeOptions":
        """Before any work: --stats-json and --trace must be writable files (one line, exit 2)."""
        from streamrt.output_paths import check_output_path

        for flag, path in (("--stats-json", self.stats_json), ("--trace", self.trace)):
            if path is not None:
                check_output_path(path, flag)
        return self

    def with_plan(self, plan) -> "RuntimeOptions":
        """These options with a placement plan's expert slots (an explicit --gpu-experts wins)."""
        if plan is None:
            return self
        return dataclasses.replace(self, gpu_experts=self.gpu_experts or plan.expert_slots)

    def make_prefix_cache(self):
        """The prefix cache these options ask for (model/prefix_cache.py); budget 0 when off."""
        from streamrt.model.prefix_cache import PrefixCache, default_budget

        return PrefixCache(default_budget() if self.prefix_cache_mem is None else self.prefix_cache_mem)
    @property
    def cpu_share(self) -> float:
        """The share of routed experts homed on the CPU (0 with --cpu-experts off; auto: all of them,
        which is what it means on a machine without a GPU, the only one it runs on yet)."""
        mode = parse_cpu_experts(self.cpu_experts)
        return 0.0 if mode == "off" else 1.0 if mode == "auto" else float(mode)

    def make_backend(self, device):
        """The ops backend for `device` (a streams.Device); None means the model's default (torch)."""
        if self.cpu_experts != "off":
            return self._host_expert_backend(device)
        if self.backend == "torch":
            return None
        if device.kind != "cuda":
            raise StreamrtError("--backend nvrtc needs a CUDA device (this machine has none, or --device cpu)")
        from streamrt.backends.nvrtc import NvrtcBackend

        return NvrtcBackend(device.torch_device)

    def _host_expert_backend(self, device):
        if device.kind != "cpu" or self.backend != "torch":
            raise StreamrtError("--cpu-experts runs with --backend torch on a machine without a GPU (or --device "
                                "cpu) for now; the hybrid executor beside the link is not built yet")
        from streamrt.backends.cpu_expert.backend import HostExpertBackend
        from streamrt.backends.cpu_expert.build import load_library
        from streamrt.runtime.expert_split import cpu_home

        load_library()  # no compiler, or no build: one line now, before any weights
        share = self.cpu_share
        which = "every routed expert" if share >= 1 else f"a share of {share:g} of the routed experts, by key"
        return HostExpertBackend(lambda layer, expert: cpu_home(layer, expert, share), threads=self.cpu_threads,
                                 which=which)

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

        per_layer = min(cfg.num_experts, batch * cfg.experts_per_token) if cfg.expert_files else 0  # no MoE layer
        if self.gpu_experts is not None:
            slots = self.gpu_experts
        elif self.gpu_mem is not None:  # the card's budget: the placement plan's slots
            from streamrt.plan.placement import plan_placement

            slots = plan_placement(cfg, self.gpu_mem, batch=batch).expert_slots
        else:
            if device.kind == "cuda":
                budget = max(0, (device.free_bytes() or 0) - GPU_RESERVE_BYTES)
            else:
                budget = CPU_SLAB_BYTES
            slots = min(cfg.expert_files, budget // file_bytes)
        slots = min(slots, cfg.expert_files)  # a slot past the last expert is never filled, only allocated
        if slots < per_layer:
            raise StreamrtError(
                f"--gpu-experts {slots}: one layer request needs up to {per_layer} expert slots "
                f"(batch {batch} x top-{cfg.experts_per_token}); raise --gpu-experts or --gpu-mem"
            )
        return ResolvedSizes(window=window, gpu_experts=slots)
