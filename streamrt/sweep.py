"""Throughput sweep: one fresh `streamrt run` per point, one table, one plot, one identity check.

    streamrt sweep --model DIR   (or: python profiling/sweep.py --model DIR)
        [--points 0.35 1 1.4 large] [--tokens N] [--out DIR]

Groups of points (one knob moved at a time from the defaults, `--groups` picks):

    window    host window at fractions of the per-token working set (`large` = max(65536,
              all expert files): everything retained); the seed's cliff lives here
    device    --gpu-experts at fractions of the working set, for every --gpu-policy,
              window large
    copies    --copies async (the default) and sync (the seed's first engine: the baseline),
              window large
    failure   the seed's failure modes: --preparse, --prefetch discard (window large),
              --evict sync (window at the smallest point, so evictions happen)

Each point runs `streamrt run --model DIR --prompt P --greedy --max-new-tokens N --json
--stats-json F <flags>` in its own process (no cache or page-locking carried over), and
its stats JSON and log land in OUT/points/. Every point is measured `--repeats` times
(default 3), each in a fresh process, in rounds (every point once, then again), so a load
spike on the machine hits one sample of several points rather than every sample of one:
the CSV, table and plot give the median with its spread (min and max: error bars), and a
point whose spread is wide says so instead of drawing a crossover. Writes OUT/sweep.csv and
OUT/sweep.png (atomically: temp name + rename), prints the table, and checks that the
logits hash is the same at every point and every repeat: window, cache, policy and copies
change timing, never arithmetic. Exit 1 if any point failed or any hash differs; OUT is
checked before the first point (exit 2 if it cannot be written).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from streamrt.fileio import atomic_write
from streamrt.output_paths import check_output_path
from streamrt.errors import StreamrtError
from streamrt.sweep_plot import num as _num, plot

STATS_KEYS = ("tokens", "s_per_token", "host_hits", "host_misses", "device_hits", "device_misses",
              "bytes_h2d", "bytes_read", "evictions", "retired", "released", "full_synchronizes",
              "stall_s", "predicted_recall", "effective_gbps")
POINT_COLUMNS = ("point", "group", "label", "window", "window_frac", "gpu_experts", "gpu_policy", "flags")
DERIVED_COLUMNS = ("host_hit_rate", "device_hit_rate", "logits_hash", "wall_s", "rc")
# Timed values vary run to run: the row holds their median over the repeats (under the plain
# key) and the extremes; counters come from the first repeat (the same in every repeat).
TIMED_KEYS = ("s_per_token", "effective_gbps", "stall_s", "wall_s")
SPREAD_COLUMNS = ("repeats", *(f"{k}_{w}" for k in TIMED_KEYS for w in ("min", "max")))
COLUMNS = POINT_COLUMNS + STATS_KEYS + DERIVED_COLUMNS + SPREAD_COLUMNS
DEFAULT_REPEATS, MAX_REPEATS = 3, 100
GROUPS = ("window", "device", "copies", "failure")
RENAMED_GROUPS = {"staging": "copies"}
LARGE_WINDOW = 65536  # the seed's shipped window
DEFAULT_PROMPT = "What's the weather in Paris?"


@dataclass
class Point:
    group: str
    label: str
    window: int
    window_frac: float | None
    flags: list[str] = field(default_factory=list)
    gpu_experts: int | None = None
    gpu_policy: str | None = None

    def argv(self) -> list[str]:
        out = ["--window", str(self.window)]
        if self.gpu_experts is not None:
            out += ["--gpu-experts", str(self.gpu_experts)]
        if self.gpu_policy is not None:
            out += ["--gpu-policy", self.gpu_policy]
        return out + self.flags


def _policies() -> list[str]:
    try:
        from streamrt.store.policies import POLICIES
    except ImportError:
        return ["lru", "lfu"]
    return list(POLICIES)


def plan_points(working_set: int, expert_files: int, points: list[str], cache_fracs: list[float],
                groups: list[str]) -> list[Point]:
    """The sweep's points, in run order. Windows are rounded to whole experts, at least 1."""
    large = max(LARGE_WINDOW, expert_files)

    def window_of(p: str) -> tuple[int, float | None]:
        if p == "large":
            return large, None
        return max(1, round(float(p) * working_set)), float(p)

    windows = [window_of(p) for p in points]
    small = min(windows)
    out: list[Point] = []
    # A device tier of half the working set (as bench_decode) for every point but the device
    # group's own: with every expert resident on the device, the window, copies and failure
    # switches would only matter for the first touch.
    m = max(1, working_set // 2)
    if "window" in groups:
        for w, frac in windows:
            out.append(Point("window", f"window {w}" + (f" ({frac:g} ws)" if frac is not None else " (large)"),
                             w, frac, gpu_experts=m))
    if "device" in groups:
        for policy in _policies():
            for f in cache_fracs:
                slots = max(1, round(f * working_set))
                out.append(Point("device", f"gpu {slots} ({f:g} ws) {policy}", large, None,
                                 gpu_experts=slots, gpu_policy=policy))
    if "copies" in groups:
        out.append(Point("copies", "copies async", large, None, gpu_experts=m))
        out.append(Point("copies", "copies sync", large, None, ["--copies", "sync"], gpu_experts=m))
    if "failure" in groups:
        out.append(Point("failure", "preparse", large, None, ["--preparse"], gpu_experts=m))
        out.append(Point("failure", "prefetch discard", large, None, ["--prefetch", "discard"], gpu_experts=m))
        out.append(Point("failure", f"evict sync, window {small[0]}", small[0], small[1], ["--evict", "sync"],
                         gpu_experts=m))
    return out


def find_logits_hash(stats: dict, stdout: str) -> str | None:
    """The hash from the stats file, else from `--json` stdout (one object or JSON lines)."""
    if isinstance(stats.get("logits_hash"), str):
        return stats["logits_hash"]
    docs = []
    try:
        docs.append(json.loads(stdout))
    except json.JSONDecodeError:
        for line in stdout.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    docs.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    found = None
    for doc in docs:  # the last one wins: a final summary line follows streamed tokens
        h = _find_key(doc, "logits_hash")
        found = h if h is not None else found
    return found


def _find_key(doc, key: str):
    if isinstance(doc, dict):
        if isinstance(doc.get(key), str):
            return doc[key]
        doc = list(doc.values())
    if isinstance(doc, list):
        for v in doc:
            h = _find_key(v, key)
            if h is not None:
                return h
    return None


def _rate(hits, misses) -> float | str:
    try:
        total = float(hits) + float(misses)
    except (TypeError, ValueError):
        return ""
    return float(hits) / total if total else ""


def run_once(i: int, k: int, p: Point, args: argparse.Namespace, pts_dir: Path) -> dict:
    """Repeat k of point i in a fresh process: its stats, hash, wall time, rc and error."""
    stem = f"{i:02d}-{p.group}.r{k}"
    stats_path, log_path = pts_dir / f"{stem}.stats.json", pts_dir / f"{stem}.log"
    stats_path.unlink(missing_ok=True)
    cmd = [*args.streamrt, "run", "--model", str(args.model), "--prompt", args.prompt, "--greedy",
           "--max-new-tokens", str(args.tokens), "--json", "--stats-json", str(stats_path), *p.argv()]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        # TimeoutExpired carries bytes even with text=True
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        rc, out, err = 124, text(e.stdout), text(e.stderr) + f"\ntimed out after {args.timeout} s"
    wall = time.perf_counter() - t0
    log_path.write_text(f"$ {shlex.join(cmd)}\n# rc {rc}, {wall:.2f} s\n--- stdout\n{out}\n--- stderr\n{err}")
    stats: dict = {}
    if rc == 0:
        try:
            stats = json.loads(stats_path.read_text())
        except (OSError, ValueError) as e:
            rc, err = 3, f"no readable stats JSON at {stats_path}: {e}"
        if not isinstance(stats, dict):
            rc, err, stats = 3, f"stats JSON at {stats_path} is not an object", {}
    return {"stats": stats, "hash": find_logits_hash(stats, out) or "", "wall_s": round(wall, 3), "rc": rc,
            "error": "" if rc == 0 else (err.strip().splitlines() or ["(no output)"])[-1]}


def point_row(i: int, p: Point, runs: list[dict]) -> dict:
    """One CSV row from a point's repeats: medians and extremes of the timed values, counters
    of the first repeat, the hash every repeat agreed on (or each distinct one, '|'-joined, so
    the identity check fails), the first failure's rc and error."""
    row = {"point": i, "group": p.group, "label": p.label, "window": p.window,
           "window_frac": "" if p.window_frac is None else p.window_frac,
           "gpu_experts": "" if p.gpu_experts is None else p.gpu_experts,
           "gpu_policy": p.gpu_policy or "", "flags": " ".join(p.flags), "repeats": len(runs)}
    failed = [r for r in runs if r["rc"] != 0]
    first = runs[0]["stats"] if not failed else {}
    row.update({k: first.get(k, "") for k in STATS_KEYS})
    row.update(host_hit_rate=_rate(first.get("host_hits"), first.get("host_misses")),
               device_hit_rate=_rate(first.get("device_hits"), first.get("device_misses")))
    for key in TIMED_KEYS:
        vals = [] if failed else [_num(r["wall_s"] if key == "wall_s" else r["stats"].get(key)) for r in runs]
        vals = [v for v in vals if v is not None]
        row[key] = statistics.median(vals) if vals else ("" if key != "wall_s" else runs[-1]["wall_s"])
        row[f"{key}_min"], row[f"{key}_max"] = (min(vals), max(vals)) if vals else ("", "")
    row["logits_hash"] = "|".join(dict.fromkeys(r["hash"] for r in runs)) if not failed else ""
    row["rc"] = failed[0]["rc"] if failed else 0
    row["_error"] = failed[0]["error"] if failed else ""
    return row


def write_csv(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue().encode())


def _fmt(v, spec: str) -> str:
    n = _num(v)
    return "-" if n is None or v == "" else format(n, spec)


def format_table(rows: list[dict]) -> str:
    head = (f"{'#':>2} {'point':<34} {'s/token':>9} {'min-max':>15} {'GB/s':>7} {'host hit':>8} {'dev hit':>8} "
            f"{'evict':>7} {'syncs':>5} {'stall s':>8} {'hash':<18}")
    lines = [head]
    for r in rows:
        pct = lambda v: "-" if _num(v) is None or v == "" else f"{100 * float(v):.1f}%"  # noqa: E731
        if r["rc"] != 0:
            lines.append(f"{r['point']:>2} {r['label']:<34} FAILED rc {r['rc']}: {r.get('_error', '')}")
            continue
        spread = f"{_fmt(r.get('s_per_token_min'), '.4f')}-{_fmt(r.get('s_per_token_max'), '.4f')}"
        lines.append(f"{r['point']:>2} {r['label']:<34} {_fmt(r['s_per_token'], '.4f'):>9} {spread:>15} "
                     f"{_fmt(r['effective_gbps'], '.2f'):>7} {pct(r['host_hit_rate']):>8} "
                     f"{pct(r['device_hit_rate']):>8} {_fmt(r['evictions'], '.0f'):>7} "
                     f"{_fmt(r['full_synchronizes'], '.0f'):>5} {_fmt(r['stall_s'], '.3f'):>8} "
                     f"{r['logits_hash'] or '(none)':<18}")
    return "\n".join(lines)


def identity_verdict(rows: list[dict]) -> tuple[bool, str]:
    done = [r for r in rows if r["rc"] == 0]
    if not done:
        return False, "logits: no point finished, nothing to compare"
    missing = [r["label"] for r in done if not r["logits_hash"]]
    if missing:
        return False, (f"logits: no logits_hash reported at {len(missing)} point(s) ({missing[0]}, ...); "
                       "cannot check identity")
    hashes: dict[str, list[str]] = {}
    for r in done:
        hashes.setdefault(r["logits_hash"], []).append(r["label"])
    if len(hashes) == 1:
        return True, f"logits: bit-identical across all {len(done)} points (logits_hash {done[0]['logits_hash']})"
    groups = "; ".join(f"{h}: {', '.join(labels)}" for h, labels in hashes.items())
    return False, f"logits: DIFFER across points ({len(hashes)} distinct hashes) — {groups}"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line naming the flag, as every streamrt user error
        raise StreamrtError(f"sweep: {message} (see streamrt sweep --help)")


def _fraction(text: str, flag: str) -> float:
    x = _num(text)  # a finite number > 0, at most 1000 working sets (more is no longer a sweep)
    if x is None or not 0 < x <= 1000:
        raise StreamrtError(f"{flag} takes numbers > 0 and at most 1000 (fractions of the working set), "
                            f"got {text!r}")
    return x


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, each checked here: a bad value is one `streamrt: ...` line (StreamrtError)."""
    from streamrt.cli.args import parse_float, parse_int

    ap = _Parser(prog="streamrt sweep", description=__doc__.splitlines()[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", required=True, type=Path, help="converted streamrt tree")
    ap.add_argument("--points", nargs="+", default=["0.35", "1.0", "1.4", "large"],
                    help="host windows as fractions of the per-token working set, or 'large'")
    ap.add_argument("--cache-points", nargs="+", default=["0.25", "0.5", "1.0"],
                    help="--gpu-experts as fractions of the working set (device group)")
    ap.add_argument("--groups", default=",".join(GROUPS), help=f"comma list of {', '.join(GROUPS)}")
    ap.add_argument("--tokens", default="8", help="new tokens per point (default 8)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--out", type=Path, default=None, help="output folder (default sweep-results/<model>)")
    ap.add_argument("--timeout", default="3600", help="seconds per run of a point")
    ap.add_argument("--repeats", default=str(DEFAULT_REPEATS),
                    help=f"runs per point, each in a fresh process (default {DEFAULT_REPEATS}): the CSV and "
                         "plot give the median and the min-max spread")
    ap.add_argument("--streamrt", default=None, help="command that runs streamrt (default: this Python's -m streamrt)")
    args = ap.parse_args(argv)
    args.groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    renamed = [g for g in args.groups if g in RENAMED_GROUPS]
    if renamed:
        raise StreamrtError(f"--groups: {renamed[0]} was renamed {RENAMED_GROUPS[renamed[0]]}")
    bad = [g for g in args.groups if g not in GROUPS]
    if bad or not args.groups:
        raise StreamrtError(f"--groups: unknown group {', '.join(bad) or '(none given)'}; "
                            f"give a comma list of {', '.join(GROUPS)}")
    for p in args.points:
        if p != "large":
            _fraction(p, "--points")
    args.cache_points = [_fraction(c, "--cache-points") for c in args.cache_points]
    args.tokens = parse_int(args.tokens, "--tokens", 1, 1 << 20)
    args.repeats = parse_int(args.repeats, "--repeats", 1, MAX_REPEATS)
    args.timeout = parse_float(args.timeout, "--timeout")
    if not args.timeout > 0:
        raise StreamrtError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if not str(args.prompt).strip():
        raise StreamrtError("--prompt is empty; give the text of a user message")
    args.streamrt = _streamrt_command(args.streamrt)
    return args


def _streamrt_command(text: str | None) -> list[str]:
    try:
        cmd = [sys.executable, "-m", "streamrt"] if text is None else shlex.split(text)
    except ValueError as e:  # an unbalanced quote
        raise StreamrtError(f"--streamrt {text!r}: {e}") from None
    if not cmd:
        raise StreamrtError("--streamrt is empty; give the command that runs streamrt")
    return cmd


def missing_flags(streamrt: list[str], points: list[Point]) -> list[str]:
    """Flags the sweep needs that `streamrt run --help` does not list (fail before point 1)."""
    try:
        proc = subprocess.run([*streamrt, "run", "--help"], capture_output=True, text=True)
    except OSError as e:  # no such program, not executable
        raise StreamrtError(f"--streamrt {shlex.join(streamrt)}: cannot run it: {e.strerror or e}") from None
    need = ["--model", "--prompt", "--greedy", "--max-new-tokens", "--json", "--stats-json"]
    need += [f for p in points for f in p.argv() if f.startswith("--")]
    return [f for f in dict.fromkeys(need) if f not in proc.stdout]


def register(sub) -> None:
    """`streamrt sweep ...`: the same flags as profiling/sweep.py."""
    p = sub.add_parser("sweep", help="throughput sweep over window, cache, policy and copies",
                       description=__doc__.splitlines()[0], add_help=False)
    p.add_argument("sweep_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: main(a.sweep_args))


def _prepare_out(out: Path, *, given: bool) -> None:
    """The output folder and its points/: a given --out is made only in an existing folder."""
    try:
        if given and out.exists() and not out.is_dir():
            raise StreamrtError(f"--out {out}: is not a directory; give a folder")
        if given and not out.is_dir():
            check_output_path(out, "--out")
        out.mkdir(parents=not given, exist_ok=True)
        for f in (out / "sweep.csv", out / "sweep.png"):
            check_output_path(f, "--out")
        (out / "points").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StreamrtError(f"--out {out}: cannot create {out / 'points'}: {e.strerror or e}") from None


def main(argv: list[str] | None = None) -> int:
    from streamrt.config import load_config

    try:
        args = parse_args(argv)
        cfg = load_config(args.model, check_tensors=False)
    except StreamrtError as e:
        print(f"streamrt: {e}", file=sys.stderr)
        return 2
    out = args.out or Path("sweep-results") / args.model.name
    pts_dir = out / "points"
    try:  # before any point runs: a sweep that cannot write its results must not start
        _prepare_out(out, given=args.out is not None)
    except StreamrtError as e:
        print(f"streamrt: {e}", file=sys.stderr)
        return 2
    points = plan_points(cfg.working_set_experts, cfg.expert_files, args.points, args.cache_points, args.groups)
    try:
        missing = missing_flags(args.streamrt, points)
    except StreamrtError as e:
        print(f"streamrt: {e}", file=sys.stderr)
        return 2
    if missing:
        print(f"streamrt: `{shlex.join(args.streamrt)} run` has no {', '.join(missing)}; the sweep needs "
              "the runtime flags (streamrt/runtime/options.py)", file=sys.stderr)
        return 2
    n_runs = len(points) * args.repeats
    print(f"sweep: {cfg.name} ({cfg.variant}), working set {cfg.working_set_experts} experts/token, "
          f"{cfg.expert_files} expert files; {len(points)} points x {args.repeats} repeats x {args.tokens} tokens "
          f"-> {out}", flush=True)

    runs: list[list[dict]] = [[] for _ in points]
    rows: list[dict] = []
    t_start = time.perf_counter()
    done = 0
    for k in range(args.repeats):  # rounds: every point once, then again (a load spike hits one sample)
        for i, p in enumerate(points):
            done += 1
            rep = f" (repeat {k + 1}/{args.repeats})" if args.repeats > 1 else ""
            print(f"[{done}/{n_runs}] {p.label}{rep} ...", end=" ", flush=True)
            r = run_once(i, k, p, args, pts_dir)
            runs[i].append(r)
            status = (f"{_fmt(r['stats'].get('s_per_token'), '.4f')} s/token" if r["rc"] == 0
                      else f"FAILED rc {r['rc']}: {r['error']}")
            print(f"{status} ({r['wall_s']:.1f} s; {time.perf_counter() - t_start:.0f} s total)", flush=True)
        rows = [point_row(i, p, runs[i]) for i, p in enumerate(points)]
        write_csv(out / "sweep.csv", rows)  # kept current: an interrupted sweep still leaves a table

    plot(out / "sweep.png", rows, f"streamrt sweep: {cfg.name}, {args.tokens} tokens, "
                                  f"working set {cfg.working_set_experts}")
    print()
    print(format_table(rows))
    ok, verdict = identity_verdict(rows)
    print(verdict)
    print(f"wrote {out / 'sweep.csv'} and {out / 'sweep.png'}")
    failed = [r for r in rows if r["rc"] != 0]
    if failed:
        print(f"{len(failed)} point(s) failed; logs in {pts_dir}", file=sys.stderr)
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
