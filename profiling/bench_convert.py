"""Convert throughput vs a raw copy of the same bytes, measured in one run.

    python profiling/bench_convert.py --workdir /data/bench [--config slice-k3.1-pro] [--workers 16]
                                      [--commit-threads 0 16 ...]

1. Synthesises the release tree (`streamrt synth --format release`, GPU when present) into
   WORKDIR/release-CONFIG unless it is already there.
2. Warms the page cache over the source once, so both contenders read it alike.
3. Raw copy: every source byte copied with the same thread count (64 MiB pread/pwrite
   ranges, one fsync per file, no checksums): the I/O floor. Deleted before step 4, so the
   slice run peaks at about 2x its 25.5 GB on disk, not 3x.
4. `convert` into WORKDIR/converted (checksums, fsync, rename; experts repacked) and
   `verify --full` on the result, once per --commit-threads value (default: convert's own
   default), the tree deleted in between; each is compared with the same run's raw copy.
Prints a table and a markdown block for profiling/RESULTS.md (also appended to --results).
Target: convert >= 0.7 x raw copy.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamrt.checkpoint.convert import convert  # noqa: E402
from streamrt.checkpoint.release import INDEX  # noqa: E402
from streamrt.checkpoint.synth import synth  # noqa: E402
from streamrt.checkpoint.verify import verify_tree  # noqa: E402

RANGE = 64 << 20


def tree_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def warm(files: list[Path], workers: int) -> float:
    def read(p: Path) -> int:
        n = 0
        with open(p, "rb", buffering=0) as f:
            buf = bytearray(RANGE)
            while k := f.readinto(buf):
                n += k
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(read, files))
    return time.perf_counter() - t0


def raw_copy(src: Path, dst: Path, workers: int) -> tuple[int, float]:
    """Copy every file of src to dst: 64 MiB ranges in parallel, fsync per file."""
    files = tree_files(src)
    jobs = []
    for f in files:
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        size = f.stat().st_size
        with open(out, "wb") as o:
            o.truncate(size)
        jobs += [(f, out, off, min(RANGE, size - off)) for off in range(0, size, RANGE)]
    remaining = {f: -(-f.stat().st_size // RANGE) for f in files}
    lock = threading.Lock()

    def one(job) -> int:
        f, out, off, n = job
        fi, fo = os.open(f, os.O_RDONLY), os.open(out, os.O_WRONLY)
        try:
            buf = os.pread(fi, n, off)
            done = 0
            while done < n:
                done += os.pwrite(fo, memoryview(buf)[done:], off + done)
            with lock:
                remaining[f] -= 1
                last = remaining[f] == 0
            if last:
                os.fsync(fo)
        finally:
            os.close(fi)
            os.close(fo)
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        total = sum(ex.map(one, jobs))
    return total, time.perf_counter() - t0


def machine() -> str:
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", {torch.cuda.get_device_name(0)}"
    except Exception:
        pass
    return f"{platform.node()} ({os.cpu_count()} cores{gpu})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--config", default="slice-k3.1-pro")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit-threads", type=int, nargs="+", default=[None], metavar="N",
                    help="convert once per value (0: commit inside the writing job); default: convert's default")
    ap.add_argument("--keep", action="store_true",
                    help="keep the (last) converted tree (the release is always kept)")
    ap.add_argument("--results", type=Path, help="append the markdown block to this file")
    args = ap.parse_args(argv)

    wd = args.workdir
    wd.mkdir(parents=True, exist_ok=True)
    release, copy_dir, conv = wd / f"release-{args.config}", wd / "rawcopy", wd / "converted"
    for d in (copy_dir, conv):
        shutil.rmtree(d, ignore_errors=True)

    synth_s = None
    if not (release / INDEX).is_file():
        shutil.rmtree(release, ignore_errors=True)
        s = synth(args.config, release, seed=args.seed, fmt="release", progress=None)
        synth_s = s["seconds"]
        print(
            f"synth: {s['bytes'] / 1e9:.2f} GB in {synth_s:.1f} s on {s['device']} ({s['bytes'] / synth_s / 1e9:.2f} "
                f"GB/s)"
        )
    src_bytes = sum(p.stat().st_size for p in tree_files(release))
    free = shutil.disk_usage(wd).free
    if free < src_bytes * 1.1:
        print(
            f"bench_convert: {wd}: needs ~{src_bytes * 1.1 / 2**30:.1f} GiB free for the copy/convert, has "
                f"{free / 2**30:.1f}"
        )
        return 2

    warm_s = warm(tree_files(release), args.workers)
    copied, copy_s = raw_copy(release, copy_dir, args.workers)
    shutil.rmtree(copy_dir)

    runs = []  # (summary, verify seconds, bad, nfiles) per --commit-threads value
    for i, ct in enumerate(args.commit_threads):
        shutil.rmtree(conv, ignore_errors=True)  # disk: one converted tree at a time
        if i:  # the previous run and its verify may have pushed the source out of the page cache
            warm(tree_files(release), args.workers)
        summary = convert(release, conv, workers=args.workers, progress=None, commit_threads=ct)
        t0 = time.perf_counter()
        bad, nfiles = verify_tree(conv, full=True, workers=args.workers, progress=False)
        runs.append((summary, time.perf_counter() - t0, bad, nfiles))
        if not args.keep or i < len(args.commit_threads) - 1:
            shutil.rmtree(conv)

    copy_gbs = copied / copy_s / 1e9
    rows = [("raw copy (pread/pwrite 64 MiB ranges, fsync per file)", copied, copy_s, copy_gbs)]
    ratios = []
    for summary, verify_s, bad, nfiles in runs:
        conv_s, conv_bytes, ct = summary["seconds"], summary["bytes_written"], summary["commit_threads"]
        conv_gbs = conv_bytes / conv_s / 1e9
        rows += [
            (f"convert ({summary['files']} files, blake2b, fsync+rename, {ct} commit threads)", conv_bytes, conv_s,
             conv_gbs),
            (f"verify --full ({nfiles} files, {'OK' if not bad else f'{len(bad)} BAD'})", conv_bytes, verify_s,
             conv_bytes / verify_s / 1e9),
        ]
        ratios.append((ct, conv_gbs / copy_gbs))
    summary = runs[0][0]
    bad = [b for r in runs for b in r[2]]
    when = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    md = [
        f"### convert throughput: {args.config}, {args.workers} workers — {machine()}, {when}",
        "",
        "| step | bytes | seconds | GB/s |",
        "|---|---:|---:|---:|",
        *[f"| {n} | {b:,} | {s:.2f} | {g:.2f} |" for n, b, s, g in rows],
        *[f"| **convert / raw copy**{f', {ct} commit threads' if len(ratios) > 1 else ''} | | | **{r:.2f}** "
          "(target >= 0.70) |" for ct, r in ratios],
        "",
        f"Source warmed in the page cache first ({warm_s:.1f} s), same for both. "
        + (f"Release synthesised in {synth_s:.1f} s. " if synth_s else "Release reused from an earlier run. ")
        + f"Expert global scales: {summary['expert_files_per_matrix_global']} per matrix, "
        f"{summary['expert_files_per_row_global']} per row.",
        "",
    ]
    text = "\n".join(md)
    print()
    print(text)
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n" + text)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
