"""The torch backend with a share of the routed experts computed by the host CPU kernel.

`HostExpertBackend(on_cpu, threads)`: every op is the torch backend's, except that a routed
expert for which `on_cpu(layer, expert)` holds runs on `kernel.expert_ffn_rows`, straight
from its NVFP4 bytes, instead of being dequantised. The routed sum keeps its fixed order
(torch_backend.expert_ffn), so an answer depends on which experts took which road, and that
is `on_cpu`'s to fix: the runtime passes a function of the key and the share
(runtime/expert_split.cpu_home), never of timing. Each expert's output is within the kernel's
stated tolerance of the float64 reference on either road (tests/test_cpu_expert_kernel.py).

Counters (`counts`): experts and rows computed on the CPU, and the seconds the kernel took; with a
tracer, one span per layer request's CPU experts on a "cpu experts" track. A layer request's CPU
experts run in one kernel call, computed before the torch path's (one team of threads, two
barriers per layer); the routed sum then takes them in its fixed order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from streamrt.backends.cpu_expert import kernel
from streamrt.backends.torch_backend import TorchBackend
from streamrt.expert_weights import ExpertWeights, as_routed
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
        self._ready: dict[int, Tensor] = {}  # this layer request's CPU-computed experts, by id

    def line(self) -> str:
        """What `run` and `serve` print at start: which experts, which kernel build, how many threads."""
        n = self.threads
        threads = f"{n} thread{'s' if n > 1 else ''}" if n else "one thread per core"
        return f"CPU experts: {self.which or 'on_cpu(layer, expert)'}; kernel {kernel.simd_path()}, {threads}"

    def expert_ffn(self, z: Tensor, ids: Tensor, weights: Tensor, experts, beta: float,
                   linear_beta: float | None) -> Tensor:
        """The torch backend's routed sum, its CPU experts computed first, all in one kernel call
        (one team of threads per layer request); `expert_rows` then hands their outputs back."""
        routed = as_routed(experts, ids)
        mine = [e for e in routed.unique if self.on_cpu(routed.layer, e)] if z.device.type == "cpu" else []
        if mine:
            host = routed.host_ids
            zs = [z[(host == e).nonzero(as_tuple=True)[0]].float().contiguous() for e in mine]  # rows, ascending
            t0 = time.perf_counter()
            with self.tracer.span("cpu experts", f"L{routed.layer} x{len(mine)}", layer=routed.layer,
                                  experts=len(mine), rows=sum(x.shape[0] for x in zs)):
                ys = kernel.experts_ffn_rows(zs, [routed.take(e) for e in mine], beta, linear_beta, self.threads)
            self.counts.experts += len(mine)
            self.counts.rows += sum(x.shape[0] for x in zs)
            self.counts.seconds += time.perf_counter() - t0
            self._ready = dict(zip(mine, ys))
        try:
            return super().expert_ffn(z, ids, weights, routed, beta, linear_beta)
        finally:
            self._ready = {}

    def expert_rows(self, zr: Tensor, ew: ExpertWeights, beta: float, linear_beta: float | None, layer: int,
                    expert: int) -> Tensor:
        ready = self._ready.get(expert)
        return ready if ready is not None else super().expert_rows(zr, ew, beta, linear_beta, layer, expert)
