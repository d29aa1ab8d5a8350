"""Interval arithmetic over a trace: spans merged per (track, step, layer), and how much of
layer l+1's copy time is hidden under layer l's compute."""

from __future__ import annotations

from typing import Iterable


def span_args(e: dict) -> dict:
    a = e.get("args")
    return a if isinstance(a, dict) else {}


def index_spans(trace: dict) -> dict[tuple, list[tuple[float, float]]]:
    """(track, step, layer) -> merged intervals in us; step / layer None when absent. Built
    once per call so summaries stay linear in the number of events."""
    raw: dict[tuple, list[tuple[float, float]]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        a = span_args(e)
        key = (e.get("cat"), a.get("step"), a.get("layer"))
        raw.setdefault(key, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    return {k: union(v) for k, v in raw.items()}


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def length(u: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in u)


def intersect(u: list[tuple[float, float]], v: list[tuple[float, float]]) -> float:
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


def steps_of(idx: dict) -> list:
    return sorted({k[1] for k in idx}, key=lambda s: (s is None, s if s is not None else 0))


def layers_of(idx: dict) -> list[int]:
    return sorted({k[2] for k in idx if isinstance(k[2], int)})


def layer_overlap(idx: dict, layer: int) -> tuple[float, float]:
    """(us of layer+1 copies under layer compute, us of layer+1 copies), summed over steps."""
    hidden = total = 0.0
    for step in steps_of(idx):
        copy = idx.get(("copy", step, layer + 1), [])
        hidden += intersect(copy, idx.get(("compute", step, layer), []))
        total += length(copy)
    return hidden, total


def overlap_fraction(trace: dict, layer: int) -> float | None:
    """Fraction of the time spent copying layer+1's data (copy spans with args.layer ==
    layer+1) during which layer `layer` computes (compute spans with args.layer == layer).
    Intervals are merged per track first, so nesting and parallel lanes do not double
    count; steps are kept apart. None when layer+1 has no copy spans."""
    hidden, total = layer_overlap(index_spans(trace), layer)
    return hidden / total if total > 0 else None


def overlap_by_layer(trace: dict) -> list[tuple[int, float, float]]:
    """(layer l, us of layer l+1 copies, us of those under layer l compute) for every layer
    whose successor has copies."""
    idx = index_spans(trace)
    rows = [(layer, *layer_overlap(idx, layer)[::-1]) for layer in [l - 1 for l in layers_of(idx)]]
    return [r for r in rows if r[1] > 0]


def overall_overlap(trace: dict, idx: dict | None = None) -> float | None:
    """Copy time hidden under the previous layer's compute, over all copy time with a layer."""
    idx = index_spans(trace) if idx is None else idx
    hidden = total = 0.0
    for layer in layers_of(idx):
        h, t = layer_overlap(idx, layer - 1)
        hidden, total = hidden + h, total + t
    return hidden / total if total > 0 else None
