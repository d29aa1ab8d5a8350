"""CLI sub-commands of the checkpoint pipeline: `synth`, `convert`, `verify`."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from streamrt.errors import StreamrtError

MAX_WORKERS = 1024  # threads; far above any machine's cores
MAX_SEED = 2**63 - 1  # torch.Generator's range


def _check_int(value: int | None, flag: str, lo: int, hi: int) -> None:
    if value is not None and not lo <= value <= hi:
        raise StreamrtError(f"{flag} must be between {lo} and {hi}, got {value}")


def _check_dst(dst: str) -> None:
    """DST must be a directory we can create files in (or creatable): one line, before any work."""
    from streamrt.output_paths import nearest_existing, writable_dir_error

    path = Path(dst)
    try:
        if path.exists() and not path.is_dir():
            raise StreamrtError(f"{dst}: DST exists and is not a directory")
        parent = nearest_existing(path)
    except OSError as e:  # e.g. a name longer than the file system allows
        raise StreamrtError(f"{dst}: DST cannot be created: {e.strerror or e}") from None
    if not parent.is_dir():
        raise StreamrtError(f"{dst}: DST cannot be created: {parent} is not a directory")
    if parent not in (path, path.parent):  # a typo must not build a tree of directories
        raise StreamrtError(f"{dst}: directory {path.parent} does not exist; create it first")
    why = writable_dir_error(parent)
    if why:
        where = "DST" if parent == path else f"its parent {parent}"
        raise StreamrtError(f"{dst}: cannot write in {where}: {why}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "synth",
        help="write a seeded random checkpoint in the release (or converted) layout",
        description="Generate a release tree (wrapper config.json, sharded safetensors, index) with seeded random "
        "weights of realistic scale; routed experts quantised to MXFP4. Uses the GPU when torch sees one. "
        "Same seed, same bytes on a device kind.",
    )
    p.add_argument("--config", required=True, metavar="NAME|PATH", help="bundled config name or a config.json")
    p.add_argument("--out", metavar="DIR", help="output directory (must be empty or absent)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float, default=1.0, help="router bias skew: 0 = even expert popularity (default 1)")
    p.add_argument("--dry-run", action="store_true", help="print tensor count and bytes, write nothing")
    p.add_argument("--format", choices=("release", "streamrt"), default="release",
                   help="release tree (default) or a converted streamrt tree directly")
    p.add_argument("--shards", type=int, default=None, metavar="N",
                   help="release shards (default: 96 as released at full geometry; smaller geometries one per 4 GiB)")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--device", default=None, help="torch device for generation (default: cuda if available)")
    p.set_defaults(func=_synth)

    p = sub.add_parser(
        "convert",
        help="convert a release tree into a streamrt tree (NVFP4 expert files, manifest)",
        description="Repack the release's MXFP4 routed experts losslessly into one NVFP4 file per expert and "
        "regroup the dense tensors. Parallel, resumable (re-run the same command), crash-safe.",
    )
    p.add_argument("src", metavar="SRC", help="release tree")
    p.add_argument("dst", metavar="DST", help="output directory: empty, absent, or a partial conversion of SRC")
    p.add_argument("--workers", type=int, default=None, help="threads (default: min(16, cores))")
    p.add_argument("--commit-threads", type=int, default=None, metavar="N",
                   help="threads that fsync, rename and journal finished files, so the --workers threads never wait "
                   "on the disk (default: as many as --workers; 0: each worker commits its own files)")
    p.add_argument("--allow-per-row", action="store_true",
                   help="when a matrix's exponent span exceeds 17 octaves, keep one global scale per row (still exact) "
                   "instead of failing")
    p.add_argument("--verify-source", action="store_true",
                   help="hash every source shard's bytes (reads the whole release once more); a re-run then also "
                   "re-converts files of a shard rewritten in place with its size, header and mtime unchanged")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_convert)

    p = sub.add_parser(
        "verify",
        help="check a converted tree: sizes and headers, or checksums with --full",
        description="Lists every bad file by path; exit status 1 if any.",
    )
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--full", action="store_true", help="re-hash every file against the manifest")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_verify)


def _synth(args: argparse.Namespace) -> int:
    from streamrt.checkpoint.synth import synth

    _check_int(args.shards, "--shards", 1, 100_000)
    _check_int(args.workers, "--workers", 1, MAX_WORKERS)
    _check_int(args.seed, "--seed", 0, MAX_SEED)
    if not math.isfinite(args.skew):
        raise StreamrtError(f"--skew must be finite, got {args.skew}")
    if args.device is not None:  # before --out is created: a bad device failed mid-write
        from streamrt.cli.args import check_device

        if args.device == "auto":
            raise StreamrtError("--device: expected cpu, cuda or cuda:N (leave it out for cuda if available), "
                                "got 'auto'")
        check_device(args.device)
    s = synth(
        args.config,
        args.out,
        seed=args.seed,
        skew=args.skew,
        fmt=args.format,
        dry_run=args.dry_run,
        shards=args.shards,
        workers=args.workers,
        device=args.device,
    )
    where = "would write" if args.dry_run else "wrote"
    extra = (f" ({s['text_tensors']:,} text) in {s['shards']} shards" if "shards" in s
             else f" ({s['expert_files']:,} expert files)")
    line = (f"{s['config']} ({s['variant']}, {s['format']}): {s['tensors']:,} tensors, {s['bytes']:,} bytes "
            f"({s['bytes'] / 2**30:,.2f} GiB){extra}")
    print(f"{line}; {where}" + (f" {s['out']} in {s['seconds']:.1f} s on {s['device']}" if not args.dry_run else ""))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from streamrt.checkpoint.convert import convert

    _check_int(args.workers, "--workers", 1, MAX_WORKERS)
    _check_int(args.commit_threads, "--commit-threads", 0, MAX_WORKERS)
    for name, value in (("SRC", args.src), ("DST", args.dst)):
        if not str(value).strip():  # an unset shell variable: Path("") is the current directory
            raise StreamrtError(f"convert: {name} is empty; give a directory")
    _check_dst(args.dst)
    convert(
        args.src,
        args.dst,
        workers=args.workers,
        allow_per_row=args.allow_per_row,
        progress=False if args.no_progress else None,
        log=print,
        commit_threads=args.commit_threads,
        verify_source=args.verify_source,
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from streamrt.checkpoint.verify import verify_tree

    _check_int(args.workers, "--workers", 1, MAX_WORKERS)
    bad, n = verify_tree(args.dir, full=args.full, workers=args.workers, progress=False if args.no_progress else None)
    mode = "sizes, headers and checksums" if args.full else "sizes and headers"
    for rel, reason in bad:
        print(f"BAD {args.dir.rstrip('/')}/{rel}: {reason}", file=sys.stderr)
    if bad:
        print(f"verify: {len(bad)} bad file(s) of {n} ({mode})")
        return 1
    print(f"verify: OK, {n} files ({mode})")
    return 0
