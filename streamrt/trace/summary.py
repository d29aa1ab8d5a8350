"""`streamrt trace summarize`: the per-layer table (compute, copy, stall, bytes, next-copy
hidden), the critical path of each step on the compute stream, and the command."""

from __future__ import annotations

import argparse
import bisect
from typing import Any

from streamrt.errors import StreamrtError
from streamrt.trace.chrome import check_trace, load_trace
from streamrt.trace.overlap import (
    index_spans,
    intersect,
    layer_overlap,
    layers_of,
    length,
    overall_overlap,
    span_args,
    steps_of,
    union,
)


def _spans(trace: dict, track: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == track]


def layer_table(trace: dict) -> list[dict]:
    """Per layer, summed over steps: compute, copy, stall (ms of merged spans), bytes copied,
    and `next_copy_hidden` = overlap_fraction(trace, layer)."""
    idx = index_spans(trace)
    nbytes: dict[int, int] = {}
    for e in _spans(trace, "copy"):
        a = span_args(e)
        if isinstance(a.get("layer"), int):
            nbytes[a["layer"]] = nbytes.get(a["layer"], 0) + int(a.get("bytes", 0))

    def ms(track: str, layer: int) -> float:
        return sum(length(idx.get((track, s, layer), [])) for s in steps_of(idx)) / 1e3

    rows = []
    for layer in layers_of(idx):
        hidden, total = layer_overlap(idx, layer)
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
            by_step.setdefault(span_args(e).get("step"), {}).setdefault(e.get("cat"), []).append(e)
    out = []
    for step in sorted(by_step, key=lambda s: (s is None, s if s is not None else 0)):
        tracks = by_step[step]
        everything = [e for evs in tracks.values() for e in evs]
        if tracks.get("step"):
            st = tracks["step"][0]
            t0, t1 = st["ts"], st["ts"] + st["dur"]
        else:
            t0, t1 = min(e["ts"] for e in everything), max(e["ts"] + e["dur"] for e in everything)
        comp = union((e["ts"], e["ts"] + e["dur"]) for e in tracks.get("compute", []))
        stall = union((e["ts"], e["ts"] + e["dur"]) for e in tracks.get("stall", []))
        busy = length(comp)
        stalled = length(stall) - intersect(stall, comp)
        copies = sorted(tracks.get("copy", []), key=lambda c: c["ts"] + c["dur"])
        ends = [c["ts"] + c["dur"] for c in copies]
        reads = {(span_args(r).get("layer"), span_args(r).get("expert")) for r in tracks.get("host-io", [])}
        blame: dict[str, float] = {}
        for s in tracks.get("stall", []):
            s_end = s["ts"] + s["dur"]
            k = bisect.bisect_right(ends, s_end + 1.0)  # 1 us slack: event resolution
            if k == 0:
                key = "unattributed"
            else:
                c = copies[k - 1]
                a = span_args(c)
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
