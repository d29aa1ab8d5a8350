"""CLI sub-commands of the checkpoint pipeline: `synth`, `convert`, `verify`."""

from __future__ import annotations

import argparse
import sys

from streamrt.errors import StreamrtError


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
    p.add_argument("--shard-gib", type=float, default=4.0, help="release shard size (default 4 GiB)")
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

    if args.shard_gib <= 0:
        raise StreamrtError(f"--shard-gib must be > 0, got {args.shard_gib}")
    s = synth(
        args.config, args.out, seed=args.seed, skew=args.skew, fmt=args.format, dry_run=args.dry_run,
        shard_bytes=int(args.shard_gib * 2**30), workers=args.workers, device=args.device,
    )
    where = "would write" if args.dry_run else "wrote"
    extra = f" in {s['shards']} shards" if "shards" in s else f" ({s['expert_files']:,} expert files)"
    line = f"{s['config']} ({s['variant']}, {s['format']}): {s['tensors']:,} tensors, {s['bytes']:,} bytes ({s['bytes'] / 2**30:,.2f} GiB){extra}"
    print(f"{line}; {where}" + (f" {s['out']} in {s['seconds']:.1f} s on {s['device']}" if not args.dry_run else ""))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from streamrt.checkpoint.convert import convert

    convert(args.src, args.dst, workers=args.workers, allow_per_row=args.allow_per_row,
            progress=False if args.no_progress else None, log=print, commit_threads=args.commit_threads)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from streamrt.checkpoint.verify import verify_tree

    bad, n = verify_tree(args.dir, full=args.full, workers=args.workers, progress=False if args.no_progress else None)
    mode = "sizes, headers and checksums" if args.full else "sizes and headers"
    for rel, reason in bad:
        print(f"BAD {args.dir.rstrip('/')}/{rel}: {reason}", file=sys.stderr)
    if bad:
        print(f"verify: {len(bad)} bad file(s) of {n} ({mode})")
        return 1
    print(f"verify: OK, {n} files ({mode})")
    return 0
