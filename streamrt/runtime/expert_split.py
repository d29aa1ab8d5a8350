"""Which of a layer's routed experts the host CPU computes, and which go over the link.

A routed expert that is not in a device slot can be copied over the link and run by the
device's kernel, or computed where its bytes lie by the host CPU kernel (backends/cpu_expert).
The two roads run at once, so a layer's expert time is max(link time, CPU time); the link's
cost of an expert is its bytes over the link rate whatever its rows, the CPU's grows with them.

Two modes (`--cpu-experts`):

- SHARE, a fraction in [0, 1]: an expert's home is a function of its key and the share alone
  (`cpu_home`: a fixed hash of (layer, expert) against the share). Which road an expert takes
  never depends on timing, load, window, slots or staging, so neither do the answers: they are
  a function of the routing and the configuration, bit-identical across runs.
- auto: each layer is split to minimise its critical path under rates measured during the run
  (`RateMeter`: smoothed link GB/s and CPU GB/s per row count; `SplitPlanner`). The CPU gets
  nothing unless that shortens the layer under the current estimates (a safety margin on the
  CPU's), and it is probed with one small expert now and then so a CPU that speeds up again is
  seen. Its answers depend on which experts the CPU took, hence on timing: each expert's output
  is within the stated tolerance of the float64 reference on either road, and replaying with
  `--cpu-experts SHARE` pins every bit.

Everything here is arithmetic on numbers it is given: it reads no clock and runs nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

_MASK = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a fixed, platform-independent scramble of a 64-bit integer."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def key_rank(layer: int, expert: int) -> float:
    """A fixed number in [0, 1) per expert key, uniform over keys."""
    return _mix64((layer & 0xFFFFFFFF) << 32 | (expert & 0xFFFFFFFF)) / 2.0**64


def cpu_home(layer: int, expert: int, share: float) -> bool:
    """SHARE mode: whether expert (layer, expert) is computed on the host CPU. Monotone in
    `share`: an expert homed on the CPU at one share stays there at any larger share."""
    return key_rank(layer, expert) < share


@dataclass(frozen=True)
class Split:
    """One layer's split: expert ids per road (ascending) and the predicted seconds of each."""

    cpu: tuple[int, ...]
    link: tuple[int, ...]
    cpu_s: float
    link_s: float

    @property
    def critical_s(self) -> float:
        return max(self.cpu_s, self.link_s)


def choose_split(missed: Sequence[tuple[int, int]], link_s: float, cpu_s: Callable[[int], float],
                 margin: float = 1.0) -> Split:
    """The split of `missed` ((expert, rows) pairs) minimising max(link time, CPU time).

    `link_s`: seconds the link takes per expert; `cpu_s(rows)`: seconds the CPU takes for an
    expert with that many rows (CPU costs are weighed `margin` times, a guard against an
    optimistic estimate). Every expert costs the link the same, so for a given number n sent to
    the CPU the n cheapest on the CPU (fewest rows; ties by id) are best, and the best n is
    found by trying each. Ties between n go to the smaller: the CPU gets nothing unless that
    shortens the layer."""
    order = sorted(missed, key=lambda er: (er[1], er[0]))
    costs = [cpu_s(rows) * margin for _, rows in order]
    best_n, best, cpu_total, prefix = 0, len(order) * link_s, 0.0, 0.0
    for n in range(1, len(order) + 1):
        prefix += costs[n - 1]
        t = max(prefix, (len(order) - n) * link_s)
        if t < best:
            best_n, best, cpu_total = n, t, prefix
    cpu = tuple(sorted(e for e, _ in order[:best_n]))
    link = tuple(sorted(e for e, _ in order[best_n:]))
    return Split(cpu, link, cpu_total / margin if margin else cpu_total, len(link) * link_s)


def row_bucket(rows: int) -> int:
    """CPU rates are kept per power-of-two row count: 1 | 2 | 3-4 | 5-8 | 9-16 | ..."""
    return max(0, math.ceil(math.log2(max(1, rows))))


class RateMeter:
    """Smoothed rates of the two roads, from what they delivered during the run.

    Each observation moves the estimate of seconds per byte by `alpha` of the way (an
    exponential average: a CPU that slows down is followed within a few layers). CPU rates are
    per row bucket; a bucket with no observation is estimated from the nearest measured one,
    scaled up linearly with rows from a smaller bucket (compute grows with rows) and taken as
    is from a larger one (fewer rows never cost more)."""

    def __init__(self, alpha: float = 0.25):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._link: float | None = None  # seconds per byte
        self._cpu: dict[int, float] = {}  # row bucket -> seconds per byte

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def observe_link(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self._link = self._blend(self._link, seconds / nbytes)

    def observe_cpu(self, nbytes: int, rows: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            b = row_bucket(rows)
            self._cpu[b] = self._blend(self._cpu.get(b), seconds / nbytes)

    def link_seconds(self, nbytes: int) -> float | None:
        return None if self._link is None else self._link * nbytes

    def cpu_seconds(self, nbytes: int, rows: int) -> float | None:
        if not self._cpu:
            return None
        b = row_bucket(rows)
        if b in self._cpu:
            return self._cpu[b] * nbytes
        below = [k for k in self._cpu if k < b]
        if below:
            k = max(below)
            return self._cpu[k] * nbytes * 2.0 ** (b - k)
        return self._cpu[min(self._cpu)] * nbytes

    def link_gbps(self) -> float | None:
        return None if self._link is None else 1e-9 / self._link

    def cpu_gbps(self, rows: int) -> float | None:
        s = self.cpu_seconds(1, rows)
        return None if s is None else 1e-9 / s


class SplitPlanner:
    """auto mode: each layer's split from the meter's current rates.

    Until the link has been measured everything goes over it. When the CPU has had no work for
    `probe_every` layers (or was never measured), the expert with the fewest rows goes to it
    once, so its rate is measured again: a probe costs at most one expert's CPU time."""

    def __init__(self, meter: RateMeter, expert_bytes: int, margin: float = 1.25, probe_every: int = 32):
        self.meter, self.expert_bytes = meter, expert_bytes
        self.margin, self.probe_every = margin, probe_every
        self._idle = probe_every  # layers since the CPU last had work: probe at the first chance

    def split(self, missed: Sequence[tuple[int, int]]) -> Split:
        link_s = self.meter.link_seconds(self.expert_bytes)
        if not missed or link_s is None:
            return Split((), tuple(sorted(e for e, _ in missed)), 0.0, len(missed) * (link_s or 0.0))
        cpu_est = self.meter.cpu_seconds(self.expert_bytes, 1)
        if cpu_est is None:
            plan = Split((), tuple(sorted(e for e, _ in missed)), 0.0, len(missed) * link_s)
        else:
            plan = choose_split(missed, link_s, lambda r: self.meter.cpu_seconds(self.expert_bytes, r),
                                self.margin)
        if plan.cpu:
            self._idle = 0
            return plan
        self._idle += 1
        if self._idle > self.probe_every and len(missed) > 1:
            self._idle = 0
            e, rows = min(missed, key=lambda er: (er[1], er[0]))
            cpu_s = self.meter.cpu_seconds(self.expert_bytes, rows) or 0.0
            link = tuple(sorted(x for x, _ in missed if x != e))
            return Split((e,), link, cpu_s, len(link) * link_s)
        return plan
