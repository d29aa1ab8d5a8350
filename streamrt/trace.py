"""Chrome-trace / Perfetto recorder for the decode step, and the tools that read its output.

Where every millisecond and every byte goes: spans on named tracks, counters, instants,
written as Chrome trace JSON (`{"traceEvents": [...]}`, microseconds) that opens in
Perfetto (ui.perfetto.dev) or chrome://tracing.

Recording (the runtime calls this)::

    tracer = Tracer() if args.trace else NullTracer()
    tracer.begin_step()
    with tracer.span("compute", "experts", stream=compute_stream, layer=l):
        ...
    with tracer.span("copy", "expert", stream=copy_stream, layer=l + 1, expert=e, bytes=n):
        copy_stream-side work
    tracer.instant("store", "evict", layer=l, expert=e)
    tracer.counter("bytes_in_flight", n)
    tracer.end_step()            # resolves GPU timestamps, closes the step span
    tracer.write("decode.json")  # atomic (temp file + rename)

Tracks and span names (the convention `summarize` and `overlap_fraction` read):

    track     what                                       name               args
    compute   compute stream, one span per layer and/or  "L{l}", op name    layer
              per op (nesting is fine)                   ("attn", "router",
                                                          "experts", ...)
    copy      one H2D transfer on the copy stream        "expert", "plane"  layer, expert, bytes
    host-io   host reads / maps / registers              "read", "map", ... layer, expert, bytes
    disk      pool tier: one file read from the drive    "read"             layer, expert, bytes,
              on a reader thread (Tracer.record)                            direct, guess
    stall     compute waiting on an event (on GPU: a     "wait"             layer, expert
              span around stream.wait_event, recorded
              on the compute stream)
    store     evictions, retirements, releases           "evict", "retire"  layer, expert
    asyncio   task wakeups of the scheduler              task name          anything
    step      owned by the tracer: one span per step     "step {n}"         step

Counters: `bytes_in_flight`, `device_slots_used`, `retire_fifo_depth` (any name works).

Timing. `stream=None`: host time (time.perf_counter). `stream=<torch.cuda.Stream>` on a
CUDA machine: two CUDA events (enable_timing=True) recorded on that stream, so the span
is the stream's execution, not the host's issue; they are resolved in `flush_step()`,
which `end_step()` calls. `flush_step` is the only place that synchronizes, and only a
real `Tracer` has one. Spans on one track that overlap without nesting (e.g. parallel
host reads) are laid out on extra lanes (Perfetto threads "host-io #1", ...) when written.

Tracing off is `NullTracer`: the same API, `enabled = False`, every method a no-op and
`span()` returns one shared no-op context manager. Hot paths that build costly args should
guard with `if tracer.enabled:`.

Each event carries `cat` = its track, so readers never parse names.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from streamrt.errors import StreamrtError

TRACKS = ("step", "compute", "copy", "host-io", "stall", "store", "asyncio")
COUNTER_PID = len(TRACKS) + 1  # counters get their own process, after the tracks


def _pid(track: str) -> int:
    return TRACKS.index(track) + 1 if track in TRACKS else _extra_pid(track)


_EXTRA: dict[str, int] = {}


def _extra_pid(track: str) -> int:
    # Unknown tracks are allowed (experiments); they get stable ids after the counters.
    return _EXTRA.setdefault(track, COUNTER_PID + 1 + len(_EXTRA))


# ---- recording -----------------------------------------------------------------------


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
            anchor = self._event_factory()
            before = self._clock()
            anchor.record(stream)
            anchor.synchronize()
            anchors[dev] = (anchor, (before + self._clock()) / 2)
        for track, name, ev0, ev1, stream, args in self._pending:
            anchor, t_anchor = anchors[getattr(stream, "device", None)]
            start = t_anchor - ev0.elapsed_time(anchor) / 1e3
            end = t_anchor - ev1.elapsed_time(anchor) / 1e3
            self._spans.append((track, name, start, end, args))
        self._pending.clear()

    # -- output --

    @property
    def events(self) -> list[dict]:
        """Chrome trace events, metadata first (resolves pending stream spans)."""
        self.flush_step()
        return to_chrome(self._spans, self._instants, self._counters, self._t0)

    def write(self, path: str | os.PathLike) -> Path:
        return write_trace(path, {"traceEvents": self.events, "displayTimeUnit": "ms"})


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def to_chrome(spans: Iterable[tuple], instants: Iterable[tuple], counters: Iterable[tuple],
              t0: float) -> list[dict]:
    """Lay spans out on lanes (so no track has partially overlapping spans) and emit events."""
    by_track: dict[str, list[tuple[float, float, str, dict]]] = {}
    for track, name, start, end, args in spans:
        ts = _us(start, t0)
        by_track.setdefault(track, []).append((ts, max(0.0, round(_us(end, t0) - ts, 3)), name, args))

    instants = list(instants)
    out: list[dict] = []
    meta: list[dict] = []
    for track in sorted(set(by_track) | {i[0] for i in instants}, key=_pid):
        pid = _pid(track)
        meta += [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": track}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
        ]
        if track not in by_track:  # instants only
            meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": track}})
            continue
        # Longest first at equal start, so a parent precedes the children it contains.
        items = sorted(by_track[track], key=lambda s: (s[0], -s[1]))
        lanes: list[list[float]] = []  # per lane: stack of open span ends
        for ts, dur, name, args in items:
            end = ts + dur
            lane = _fit_lane(lanes, ts, end)
            out.append({"ph": "X", "name": name, "cat": track, "ts": ts, "dur": dur,
                        "pid": pid, "tid": lane, "args": args})
        for lane in range(len(lanes)):
            label = track if lane == 0 else f"{track} #{lane}"
            meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane, "args": {"name": label}})

    for track, name, t, args in instants:
        out.append({"ph": "i", "s": "t", "name": name, "cat": track, "ts": _us(t, t0),
                    "pid": _pid(track), "tid": 0, "args": args})
    if counters:
        meta.append({"ph": "M", "name": "process_name", "pid": COUNTER_PID, "tid": 0, "args": {"name": "counters"}})
    for name, t, value in counters:
        out.append({"ph": "C", "name": name, "cat": "counter", "ts": _us(t, t0),
                    "pid": COUNTER_PID, "tid": 0, "args": {"value": value}})
    out.sort(key=lambda e: e["ts"])
    return meta + out


def _fit_lane(lanes: list[list[float]], ts: float, end: float) -> int:
    """First lane where [ts, end) either follows the open spans or nests inside the top one."""
    for i, stack in enumerate(lanes):
        while stack and stack[-1] <= ts:
            stack.pop()
        if not stack or end <= stack[-1]:
            stack.append(end)
            return i
    lanes.append([end])
    return len(lanes) - 1


def write_trace(path: str | os.PathLike, trace: dict) -> Path:
    """Write JSON atomically (fileio.atomic_write: temp name in the same directory, fsync,
    rename); a failure is one StreamrtError naming the file."""
    from streamrt.checkpoint.fileio import atomic_write

    return atomic_write(path, json.dumps(trace, separators=(",", ":")))


# ---- reading ---------------------------------------------------------------------------


def load_trace(path: str | os.PathLike) -> dict:
    """Read a trace file; any problem is a one-line StreamrtError naming the file."""
    from streamrt.jsonio import load_json

    p = Path(path)
    if not p.exists():
        raise StreamrtError(f"trace {p}: no such file")
    data = load_json(p, what="JSON", name=f"trace {p}", error=StreamrtError, max_bytes=4 << 30)
    if isinstance(data, list):  # the Chrome format also allows a bare event array
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise StreamrtError(f"trace {p}: no 'traceEvents' list; not a Chrome trace")
    return data


def check_trace(trace: dict) -> list[str]:
    """Problems with a trace: spans missing ph/ts/dur/pid/tid, or partially overlapping
    spans on one (pid, tid). Empty when valid."""
    problems: list[str] = []
    lanes: dict[tuple, list[tuple[float, float, str]]] = {}
    for i, ev in enumerate(trace.get("traceEvents", [])):
        if ev.get("ph") != "X":
            continue
        missing = [k for k in ("ph", "ts", "dur", "pid", "tid") if k not in ev]
        if missing:
            problems.append(f"event {i} ({ev.get('name')}): missing {', '.join(missing)}")
            continue
        if ev["dur"] < 0:
            problems.append(f"event {i} ({ev.get('name')}): negative dur")
        lanes.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + ev["dur"], ev.get("name", "")))
    for key, items in lanes.items():
        items.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[float, float, str]] = []
        for s in items:
            while stack and stack[-1][1] <= s[0]:
                stack.pop()
            if stack and s[1] > stack[-1][1]:
                problems.append(f"pid {key[0]} tid {key[1]}: span {s[2]!r} [{s[0]}, {s[1]}) partially "
                                f"overlaps {stack[-1][2]!r} [{stack[-1][0]}, {stack[-1][1]})")
            stack.append(s)
    return problems


def _spans(trace: dict, track: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == track]


def _args(e: dict) -> dict:
    a = e.get("args")
    return a if isinstance(a, dict) else {}


def _index(trace: dict) -> dict[tuple, list[tuple[float, float]]]:
    """(track, step, layer) -> merged intervals in us; step / layer None when absent. Built
    once per call so summaries stay linear in the number of events."""
    raw: dict[tuple, list[tuple[float, float]]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        a = _args(e)
        key = (e.get("cat"), a.get("step"), a.get("layer"))
        raw.setdefault(key, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    return {k: _union(v) for k, v in raw.items()}


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(u: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in u)


def _intersect(u: list[tuple[float, float]], v: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(u) and j < len(v):
        lo, hi = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        total += max(0.0, hi - lo)
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total


def _steps(idx: dict) -> list:
    return sorted({k[1] for k in idx}, key=lambda s: (s is None, s if s is not None else 0))


def _layers(idx: dict) -> list[int]:
    return sorted({k[2] for k in idx if isinstance(k[2], int)})


def _layer_overlap(idx: dict, layer: int) -> tuple[float, float]:
    """(us of layer+1 copies under layer compute, us of layer+1 copies), summed over steps."""
    hidden = total = 0.0
    for step in _steps(idx):
        copy = idx.get(("copy", step, layer + 1), [])
        hidden += _intersect(copy, idx.get(("compute", step, layer), []))
        total += _length(copy)
    return hidden, total


def overlap_fraction(trace: dict, layer: int) -> float | None:
    """Fraction of the time spent copying layer+1's data (copy spans with args.layer ==
    layer+1) during which layer `layer` computes (compute spans with args.layer == layer).
    Intervals are merged per track first, so nesting and parallel lanes do not double
    count; steps are kept apart. None when layer+1 has no copy spans."""
    hidden, total = _layer_overlap(_index(trace), layer)
    return hidden / total if total > 0 else None


def overlap_by_layer(trace: dict) -> list[tuple[int, float, float]]:
    """(layer l, us of layer l+1 copies, us of those under layer l compute) for every layer
    whose successor has copies."""
    idx = _index(trace)
    rows = [(layer, *_layer_overlap(idx, layer)[::-1]) for layer in [l - 1 for l in _layers(idx)]]
    return [r for r in rows if r[1] > 0]


def overall_overlap(trace: dict, idx: dict | None = None) -> float | None:
    """Copy time hidden under the previous layer's compute, over all copy time with a layer."""
    idx = _index(trace) if idx is None else idx
    hidden = total = 0.0
    for layer in _layers(idx):
        h, t = _layer_overlap(idx, layer - 1)
        hidden, total = hidden + h, total + t
    return hidden / total if total > 0 else None


# ---- summary -----------------------------------------------------------------------------


def layer_table(trace: dict) -> list[dict]:
    """Per layer, summed over steps: compute, copy, stall (ms of merged spans), bytes copied,
    and `next_copy_hidden` = overlap_fraction(trace, layer)."""
    idx = _index(trace)
    nbytes: dict[int, int] = {}
    for e in _spans(trace, "copy"):
        a = _args(e)
        if isinstance(a.get("layer"), int):
            nbytes[a["layer"]] = nbytes.get(a["layer"], 0) + int(a.get("bytes", 0))

    def ms(track: str, layer: int) -> float:
        return sum(_length(idx.get((track, s, layer), [])) for s in _steps(idx)) / 1e3

    rows = []
    for layer in _layers(idx):
        hidden, total = _layer_overlap(idx, layer)
        rows.append({
            "layer": layer,
            "compute_ms": ms("compute", layer),
            "copy_ms": ms("copy", layer),
            "stall_ms": ms("stall", layer),
            "copy_bytes": nbytes.get(layer, 0),
            "next_copy_hidden": hidden / total if total > 0 else None,
        })
    return rows


def critical_path(trace: dict) -> list[dict]:
    """Per step, what the compute stream's timeline was made of, which is what bounds the
    step: busy computing, stalled (each stall blamed on the copy that finished last before
    it ended, or on the host read of that expert when the copy only began during the stall),
    or idle (host overhead: launches, bookkeeping, Python). Steps come from the `step`
    track; without one the whole trace is one step."""
    by_step: dict[Any, dict[str, list[dict]]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            by_step.setdefault(_args(e).get("step"), {}).setdefault(e.get("cat"), []).append(e)
    out = []
    for step in sorted(by_step, key=lambda s: (s is None, s if s is not None else 0)):
        tracks = by_step[step]
        everything = [e for evs in tracks.values() for e in evs]
        if tracks.get("step"):
            st = tracks["step"][0]
            t0, t1 = st["ts"], st["ts"] + st["dur"]
        else:
            t0, t1 = min(e["ts"] for e in everything), max(e["ts"] + e["dur"] for e in everything)
        comp = _union((e["ts"], e["ts"] + e["dur"]) for e in tracks.get("compute", []))
        stall = _union((e["ts"], e["ts"] + e["dur"]) for e in tracks.get("stall", []))
        busy = _length(comp)
        stalled = _length(stall) - _intersect(stall, comp)
        copies = sorted(tracks.get("copy", []), key=lambda c: c["ts"] + c["dur"])
        ends = [c["ts"] + c["dur"] for c in copies]
        reads = {(_args(r).get("layer"), _args(r).get("expert")) for r in tracks.get("host-io", [])}
        blame: dict[str, float] = {}
        for s in tracks.get("stall", []):
            s_end = s["ts"] + s["dur"]
            k = bisect.bisect_right(ends, s_end + 1.0)  # 1 us slack: event resolution
            if k == 0:
                key = "unattributed"
            else:
                c = copies[k - 1]
                a = _args(c)
                key = f"copy L{a.get('layer', '?')}"
                if c["ts"] > s["ts"] and (a.get("layer"), a.get("expert")) in reads:
                    key = f"host-io L{a.get('layer', '?')}"
            blame[key] = blame.get(key, 0.0) + s["dur"] / 1e3
        out.append({
            "step": step, "wall_ms": (t1 - t0) / 1e3, "compute_ms": busy / 1e3,
            "stall_ms": stalled / 1e3, "idle_ms": max(0.0, (t1 - t0) - busy - stalled) / 1e3,
            "stall_blame": dict(sorted(blame.items(), key=lambda kv: -kv[1])),
        })
    return out


def format_summary(trace: dict) -> str:
    rows = layer_table(trace)
    lines = [f"{'layer':>5} {'compute ms':>11} {'copy ms':>9} {'stall ms':>9} {'copy MB':>9} "
             f"{'next-copy hidden':>17}"]
    for r in rows:
        hid = "-" if r["next_copy_hidden"] is None else f"{100 * r['next_copy_hidden']:.1f} %"
        lines.append(f"{r['layer']:>5} {r['compute_ms']:>11.3f} {r['copy_ms']:>9.3f} {r['stall_ms']:>9.3f} "
                     f"{r['copy_bytes'] / 1e6:>9.2f} {hid:>17}")
    if rows:
        tot = {k: sum(r[k] for r in rows) for k in ("compute_ms", "copy_ms", "stall_ms", "copy_bytes")}
        ov = overall_overlap(trace)
        lines.append(f"{'all':>5} {tot['compute_ms']:>11.3f} {tot['copy_ms']:>9.3f} {tot['stall_ms']:>9.3f} "
                     f"{tot['copy_bytes'] / 1e6:>9.2f} {'-' if ov is None else f'{100 * ov:.1f} %':>17}")
        lines.append("next-copy hidden: share of layer l+1's copy time spent under layer l's compute")
    else:
        lines.append("(no spans with a 'layer' arg)")
    lines.append("")
    lines.append("critical path (compute stream):")
    for cp in critical_path(trace):
        name = "trace" if cp["step"] is None else f"step {cp['step']}"
        lines.append(f"  {name}: {cp['wall_ms']:.3f} ms = compute {cp['compute_ms']:.3f} + stalled "
                     f"{cp['stall_ms']:.3f} + idle/host {cp['idle_ms']:.3f}")
        if cp["stall_blame"]:
            top = ", ".join(f"{k} {v:.3f} ms" for k, v in list(cp["stall_blame"].items())[:5])
            lines.append(f"    stalls waited on: {top}")
    problems = check_trace(trace)
    if problems:
        lines.append(f"warning: {len(problems)} malformed span(s); first: {problems[0]}")
    return "\n".join(lines)


# ---- CLI -------------------------------------------------------------------------------------


def _summarize(args: argparse.Namespace) -> int:
    trace = load_trace(args.file)
    try:
        text = format_summary(trace)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StreamrtError(f"trace {args.file}: malformed event ({e.__class__.__name__}: {e})") from None
    print(text)
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("trace", help="read Chrome traces written by `streamrt run --trace`")
    sub = p.add_subparsers(dest="trace_command", required=True)
    s = sub.add_parser("summarize", help="per-layer compute / copy / stall / overlap and the critical path")
    s.add_argument("file", help="trace JSON")
    s.set_defaults(func=_summarize)
    return p


if __name__ == "__main__":
    from streamrt.cli import main

    raise SystemExit(main(["trace", *sys.argv[1:]]))
