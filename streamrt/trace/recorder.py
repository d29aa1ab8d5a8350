"""Recording: `Tracer` (host-timed spans, CUDA-event-timed stream spans, instants, counters,
one span per step) and `NullTracer`, the same API doing nothing."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable

from streamrt.trace.chrome import to_chrome, write_trace


class NullTracer:
    """Tracing off: records nothing, costs one attribute lookup and a no-op `with`."""

    enabled = False
    events: tuple = ()
    _NULL_SPAN = contextlib.nullcontext()

    def span(self, track: str, name: str, *, stream: Any = None, **args: Any):
        return self._NULL_SPAN

    def instant(self, track: str, name: str, **args: Any) -> None:
        pass

    def record(self, track: str, name: str, start_s: float, end_s: float, **args: Any) -> None:
        pass

    def counter(self, name: str, value: float) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def end_step(self, flush: bool = True) -> None:
        pass

    def flush_step(self) -> None:
        pass

    def write(self, path: str | os.PathLike) -> None:
        pass


def make_tracer(enabled: bool) -> "Tracer | NullTracer":
    """`Tracer()` when tracing is asked for (e.g. `--trace FILE`), else the no-op `NullTracer`."""
    return Tracer() if enabled else NullTracer()


class _HostSpan:
    __slots__ = ("tr", "track", "name", "args", "t0")

    def __init__(self, tr: "Tracer", track: str, name: str, args: dict):
        self.tr, self.track, self.name, self.args = tr, track, name, args

    def __enter__(self):
        self.t0 = self.tr._clock()
        return self

    def __exit__(self, *exc):
        self.tr._spans.append((self.track, self.name, self.t0, self.tr._clock(), self.args))
        return False


class _StreamSpan:
    __slots__ = ("tr", "track", "name", "args", "stream", "ev0")

    def __init__(self, tr: "Tracer", track: str, name: str, args: dict, stream: Any):
        self.tr, self.track, self.name, self.args, self.stream = tr, track, name, args, stream

    def __enter__(self):
        self.ev0 = self.tr._event_factory()
        self.ev0.record(self.stream)
        return self

    def __exit__(self, *exc):
        ev1 = self.tr._event_factory()
        ev1.record(self.stream)
        self.tr._pending.append((self.track, self.name, self.ev0, ev1, self.stream, self.args))
        return False


def _cuda_event_factory() -> Callable[[], Any] | None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if not torch.cuda.is_available():
        return None
    return lambda: torch.cuda.Event(enable_timing=True)


# An anchor's round trip this short is taken at once; else the tightest of ANCHOR_TRIES.
ANCHOR_TIGHT_S = 50e-6
ANCHOR_TRIES = 5


def _cuda_synchronize(device: Any) -> None:
    import torch

    torch.cuda.synchronize(device)


class Tracer:
    """Records spans, instants and counters; see the module docstring for the conventions.

    `event_factory` / `synchronize` default to CUDA events and torch.cuda.synchronize when
    CUDA is available; tests pass fakes. Without them, `stream=` is ignored (host timing).
    """

    enabled = True

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.perf_counter,
        event_factory: Callable[[], Any] | None = ...,  # type: ignore[assignment]
        synchronize: Callable[[Any], None] = _cuda_synchronize,
    ):
        self._clock = clock
        self._t0 = clock()
        self._event_factory = _cuda_event_factory() if event_factory is ... else event_factory
        self._synchronize = synchronize
        self._spans: list[tuple] = []  # (track, name, start_s, end_s, args)
        self._pending: list[tuple] = []  # (track, name, ev0, ev1, stream, args)
        self._instants: list[tuple] = []  # (track, name, t_s, args)
        self._counters: list[tuple] = []  # (name, t_s, value)
        self._step = -1
        self._step_t0: float | None = None
        self._step_first = 0  # index in _spans where the current step's spans begin

    # -- the recording API --

    def span(self, track: str, name: str, *, stream: Any = None, **args: Any):
        if self._step >= 0:
            args.setdefault("step", self._step)
        if stream is not None and self._event_factory is not None:
            return _StreamSpan(self, track, name, args, stream)
        return _HostSpan(self, track, name, args)

    def instant(self, track: str, name: str, **args: Any) -> None:
        if self._step >= 0:
            args.setdefault("step", self._step)
        self._instants.append((track, name, self._clock(), args))

    def record(self, track: str, name: str, start_s: float, end_s: float, **args: Any) -> None:
        """A span measured elsewhere (a reader thread's time.perf_counter() before and after a
        read), added from the recording thread. Times are on the tracer's clock (perf_counter)."""
        if self._step >= 0:
            args.setdefault("step", self._step)
        self._spans.append((track, name, start_s, end_s, args))

    def counter(self, name: str, value: float) -> None:
        self._counters.append((name, self._clock(), value))

    def begin_step(self) -> None:
        self._step += 1
        self._step_t0 = self._clock()
        self._step_first = len(self._spans)

    def end_step(self, flush: bool = True) -> None:
        """Close the step span and (by default) resolve its stream spans. The host issues
        GPU work ahead of the device, so the step ends at the later of now and its last
        resolved span: the step's wall time is the device's, not the launcher's."""
        t1 = self._clock()
        if flush:
            self.flush_step()
        if self._step_t0 is not None:
            ends = [sp[3] for sp in self._spans[self._step_first:] if sp[4].get("step") == self._step]
            self._spans.append(("step", f"step {self._step}", self._step_t0, max([t1, *ends]),
                                {"step": self._step}))
            self._step_t0 = None

    def flush_step(self) -> None:
        """Resolve stream spans to host time. Synchronizes each device once, then anchors
        its event clock to perf_counter with one event recorded on an idle device."""
        if not self._pending:
            return
        anchors: dict[Any, tuple[Any, float]] = {}
        for _, _, _, _, stream, _ in self._pending:
            dev = getattr(stream, "device", None)
            if dev in anchors:
                continue
            self._synchronize(dev)
            anchors[dev] = self._anchor(stream)
        for track, name, ev0, ev1, stream, args in self._pending:
            anchor, t_anchor = anchors[getattr(stream, "device", None)]
            start = t_anchor - ev0.elapsed_time(anchor) / 1e3
            end = t_anchor - ev1.elapsed_time(anchor) / 1e3
            self._spans.append((track, name, start, end, args))
        self._pending.clear()

    def _anchor(self, stream) -> tuple[Any, float]:
        """An event recorded on the idle device and the host time it ran at: the midpoint of the
        tightest of a few record-and-wait round trips. Another process's kernels on the same GPU
        can hold one anchor back by a time slice; the midpoint's error is at most half its trip."""
        best = None
        for _ in range(ANCHOR_TRIES):
            anchor = self._event_factory()
            before = self._clock()
            anchor.record(stream)
            anchor.synchronize()
            trip = self._clock() - before
            if best is None or trip < best[2]:
                best = (anchor, before + trip / 2, trip)
            if trip <= ANCHOR_TIGHT_S:
                break
        return best[0], best[1]

    # -- output --

    @property
    def events(self) -> list[dict]:
        """Chrome trace events, metadata first (resolves pending stream spans)."""
        self.flush_step()
        return to_chrome(self._spans, self._instants, self._counters, self._t0)

    def write(self, path: str | os.PathLike) -> Path:
        return write_trace(path, {"traceEvents": self.events, "displayTimeUnit": "ms"})
