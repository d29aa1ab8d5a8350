"""The Chrome trace format: tracks as processes, overlapping spans laid out on lanes, the
atomic write, the reader, and the validity check (every span complete, none partially
overlapping another on its lane)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from streamrt.errors import StreamrtError

TRACKS = ("step", "compute", "copy", "host-io", "stall", "store", "asyncio")
COUNTER_PID = len(TRACKS) + 1  # counters get their own process, after the tracks


def _pid(track: str) -> int:
    return TRACKS.index(track) + 1 if track in TRACKS else _extra_pid(track)


_EXTRA: dict[str, int] = {}


def _extra_pid(track: str) -> int:
    # Unknown tracks are allowed (experiments); they get stable ids after the counters.
    return _EXTRA.setdefault(track, COUNTER_PID + 1 + len(_EXTRA))


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
    from streamrt.fileio import atomic_write

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
