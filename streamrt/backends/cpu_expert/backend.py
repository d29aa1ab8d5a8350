"""The torch backend with a share of the routed experts computed by the host CPU kernel.

`HostExpertBackend(on_cpu, threads)`: every op is the torch backend's, except that a routed
expert for which `on_cpu(layer, expert)` holds runs on `kernel.expert_ffn_rows`, straight
from its NVFP4 bytes, instead of being dequantised. The routed sum keeps its fixed order
(torch_backend.expert_ffn), so an answer depends on which experts took which road, and that
is `on_cpu`'s to fix: the runtime passes a function of the key and the share
(runtime/expert_split.cpu_home), never of timing. Each expert's output is within the kernel's
stated tolerance of the float64 reference on either road (tests/test_cpu_expert_kernel.py).

Counters (`counts`): experts and rows computed on the CPU, and the seconds the kernel took; with a
tracer, one span per expert on a "cpu experts" track.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from streamrt.backends.cpu_expert import kernel
from streamrt.backends.torch_backend import TorchBackend
from streamrt.expert_weights import ExpertWeights
from streamrt.trace.recorder import NullTracer


@dataclass
class CpuExpertCounts:
    experts: int = 0  # routed experts computed by the CPU kernel (one per layer request each)
    rows: int = 0  # their rows
    seconds: float = 0.0  # wall time inside the kernel

    def reset(self) -> None:
        self.experts, self.rows, self.seconds = 0, 0, 0.0

    def as_dict(self) -> dict:
        return {"cpu_experts": self.experts, "cpu_expert_rows": self.rows, "cpu_expert_s": round(self.seconds, 6)}


class HostExpertBackend(TorchBackend):
    name = "torch+cpu-experts"

    def __init__(self, on_cpu: Callable[[int, int], bool], threads: int = 0, which: str = "", **kw):
        super().__init__(**kw)
        self.on_cpu, self.threads, self.which = on_cpu, threads, which
        self.counts = CpuExpertCounts()
        self.tracer = NullTracer()  # the session's, when it has one: a "cpu experts" track

    def line(self) -> str:
        """What `run` and `serve` print at start: which experts, which kernel build, how many threads."""
        n = self.threads
        threads = f"{n} thread{'s' if n > 1 else ''}" if n else "one thread per core"
        return f"CPU experts: {self.which or 'on_cpu(layer, expert)'}; kernel {kernel.simd_path()}, {threads}"

    def expert_rows(self, zr: Tensor, ew: ExpertWeights, beta: float, linear_beta: float | None, layer: int,
                    expert: int) -> Tensor:
        if zr.device.type != "cpu" or not self.on_cpu(layer, expert):
            return super().expert_rows(zr, ew, beta, linear_beta, layer, expert)
        t0 = time.perf_counter()
        with self.tracer.span("cpu experts", f"L{layer} E{expert}", layer=layer, expert=expert, rows=zr.shape[0]):
            y = kernel.expert_ffn_rows(zr.float().contiguous(), ew, beta, linear_beta, threads=self.threads)
        self.counts.experts += 1
        self.counts.rows += zr.shape[0]
        self.counts.seconds += time.perf_counter() - t0
        return y
