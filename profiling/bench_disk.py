"""Disk-tier benchmark: decode with the expert tree larger than RAM, against the
drive's raw parallel O_DIRECT rate measured in the same run.

    python profiling/bench_disk.py --config deep-k3.1-pro --host-mem 6G --cgroup-mem 14G     # H200 machine
    python profiling/bench_disk.py --config tiny-k3.1-pro --device cpu --host-mem 2M --tokens 4   # smoke

In this order, in this one process:

  tree       --tree DIR, or synthesised (streamrt format) under --workdir if absent
  reference  decode in RAM (mapped tier, every expert file read into the page cache first),
             before any memory limit: the logits every other run must match bit for bit
  ram-check  (--ram-check) the pool tier holding the whole tree against mapped, both in RAM:
             the "no regression when it fits" check
  cgroup     (--cgroup-mem) create /sys/fs/cgroup/srt-bench with memory.max, move this process
             in; skipped with a note where cgroups are not writable
  raw        page cache dropped (drop_caches where allowed, else POSIX_FADV_DONTNEED per
             file), then parallel whole-file O_DIRECT reads over --raw-files expert files at
             4/8/16/32 threads: the raw rate is the best of them
  pool       caches dropped, decode with --host-tier pool under --host-mem
  mapped     caches dropped, decode with --host-tier mapped under the same --host-mem

For pool and mapped: s/token, bytes from disk per token (the runtime's bytes_from_disk counter, and
/proc/self/io read_bytes beside it), ratio = s/token / (disk bytes per token / raw rate)
(target <= 1.15), disk throughput / raw rate (target >= 0.85), logits identical to the
reference. A CPU run on a tiny tree is a smoke test of the mechanics, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import decode_run, ensure_tree, git_commit, machine, warm_page_cache  # noqa: E402

from streamrt.checkpoint.reader import open_tree  # noqa: E402
from streamrt.loader import load_model  # noqa: E402
from streamrt.runtime.options import RuntimeOptions, parse_bytes, parse_read_threads  # noqa: E402
from streamrt.runtime.streams import make_device  # noqa: E402
from streamrt.store.disk_reader import FileReader, measure_read_rate  # noqa: E402

CGROUP = Path("/sys/fs/cgroup/srt-bench")


def enter_cgroup(limit: int) -> str:
    """Move this process into a cgroup v2 with memory.max = limit. Returns a note."""
    root = Path("/sys/fs/cgroup")
    if not (root / "cgroup.controllers").is_file():
        return "cgroup: skipped (no cgroup v2 at /sys/fs/cgroup)"
    try:
        try:
            (root / "cgroup.subtree_control").write_text("+memory")
        except OSError:
            pass  # already on, or not ours to change: memory.max tells
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "memory.max").write_text(str(limit))
        (CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        return f"cgroup: skipped ({CGROUP}: {e.strerror or e})"
    return f"cgroup: {CGROUP} memory.max {limit / 2**30:.1f} GiB, this process moved in"


def drop_caches(paths) -> str:
    """Empty the page cache of the expert files: drop_caches where allowed, and per file
    POSIX_FADV_DONTNEED (unprivileged; clean pages only)."""
    how = []
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        how.append("drop_caches")
    except OSError:
        pass
    n = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
        except OSError:
            pass
    how.append(f"fadvise DONTNEED on {n} files")
    return " + ".join(how)


def proc_read_bytes() -> int:
    try:
        for line in open("/proc/self/io"):
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def raw_rate(paths, nbytes: int, threads=(4, 8, 16, 32)) -> tuple[float, dict[int, float]]:
    """The drive's parallel O_DIRECT rate (bytes/s): best over thread counts, each over the same
    files (O_DIRECT bypasses the page cache, so every pass reads the drive)."""
    reader = FileReader(notice=lambda m: print(f"  raw: {m}", flush=True))
    rates = {n: measure_read_rate(paths, nbytes, n, reader=reader) for n in threads}
    if not reader.direct:
        print("  raw: buffered reads (O_DIRECT refused): the rate is the page cache's or the drive's, not known which")
    return max(rates.values()), rates


def sample_paths(tree, count: int) -> list[Path]:
    cfg = tree.config
    keys = [(l, e) for l in cfg.moe_layers for e in range(cfg.num_experts)]
    step = max(1, len(keys) // count)
    return [tree.expert_path(l, e) for l, e in keys[::step][:count]]


def timed_run(name, tree, model, device, opts, prompt, cont, warmup, raw, ref_logits, *, cold: bool, all_paths) -> dict:
    if cold:
        print(f"  {name}: page cache: {drop_caches(all_paths)}", flush=True)
    io0, t = proc_read_bytes(), time.perf_counter()
    r = decode_run(tree, model, device, opts, prompt, cont, warmup, warm_host=not cold)
    p = r["payload"]
    tokens = max(1, p["tokens"])
    disk_per_token = p.get("bytes_from_disk", 0) / tokens
    row = {
        "name": name, "s_per_token": p["s_per_token"], "disk_bytes_per_token": disk_per_token,
        "proc_read_bytes_run": proc_read_bytes() - io0, "host_tier": p.get("host_tier", "?"),
        "pool_hits": p.get("pool_hits", 0), "pool_misses": p.get("pool_misses", 0),
        "readahead_reads": p.get("readahead_reads", 0), "readahead_used": p.get("readahead_used", 0),
        "bytes_from_page_cache": p.get("bytes_from_page_cache", 0), "staged": p.get("staged", 0),
        "stage_dropped": p.get("stage_dropped", 0),
        "identical": ref_logits is not None and len(r["logits"]) == len(ref_logits)
        and all(torch.equal(a, b) for a, b in zip(r["logits"], ref_logits)),
        "logits": r["logits"],
    }
    floor = disk_per_token / raw if raw else 0.0
    row["floor_s"] = floor
    row["ratio"] = p["s_per_token"] / floor if floor else float("nan")
    row["disk_gbps"] = disk_per_token / p["s_per_token"] / 1e9 if p["s_per_token"] else 0.0
    row["disk_share"] = disk_per_token / p["s_per_token"] / raw if raw and p["s_per_token"] else float("nan")
    print(f"  {name}: {p['s_per_token']:.3f} s/token, {disk_per_token / 1e9:.3f} GB/token from disk "
          f"(runtime counter; /proc/self/io read_bytes {row['proc_read_bytes_run'] / 1e9:.2f} GB over the run), "
          f"ratio {row['ratio']:.2f}, disk {row['disk_gbps']:.2f} GB/s = {row['disk_share']:.2f} of raw, "
          f"logits identical {row['identical']} ({time.perf_counter() - t:.1f} s)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/streamrt-bench"))
    ap.add_argument("--config", default="deep-k3.1-pro")
    ap.add_argument("--tree", type=Path, default=None, help="an existing streamrt tree (else synthesised)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tokens", type=int, default=6, help="decode steps timed per run")
    ap.add_argument("--warmup", type=int, default=2, help="decode steps before timing (the pool fills)")
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--host-mem", default="6G", help="RAM budget of the runs under the limit (default 6G)")
    ap.add_argument(
        "--gpu-experts", type=int, default=None, help="device slots (default: a quarter of the working set)"
    )
    ap.add_argument("--read-threads", default="16", help="pool reader threads, N or auto (default 16)")
    ap.add_argument("--cgroup-mem", default=None, metavar="BYTES",
                    help="move into /sys/fs/cgroup/srt-bench with this memory.max (e.g. 14G) before the cold runs")
    ap.add_argument("--raw-files", type=int, default=128, help="expert files read for the raw rate (default 128)")
    ap.add_argument("--ram-check", action="store_true",
                    help="also compare pool (holding the whole tree) against mapped with everything in RAM")
    ap.add_argument("--skip-mapped", action="store_true", help="no cold mapped run (it is the slow one)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    host_mem = parse_bytes(args.host_mem, "--host-mem")
    device = make_device(args.device)
    if args.tree is not None:
        tree = open_tree(args.tree)
    else:
        args.workdir.mkdir(parents=True, exist_ok=True)
        tree = ensure_tree(args.workdir, args.config)
    cfg, fb = tree.config, tree.layout.file_bytes
    all_paths = [tree.expert_path(l, e) for l in cfg.moe_layers for e in range(cfg.num_experts)]
    tree_bytes = len(all_paths) * fb
    print(f"tree {tree.root}: {cfg.name}, {len(all_paths)} expert files x {fb / 2**20:.2f} MiB = "
          f"{tree_bytes / 2**30:.1f} GiB; --host-mem {host_mem / 2**30:.2f} GiB", flush=True)
    dtype = torch.bfloat16 if device.kind == "cuda" else None
    model = load_model(tree, device.torch_device, dtype=dtype)
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg.vocab_size - 256, (args.prompt_len,), generator=g).tolist()
    cont = torch.randint(0, cfg.vocab_size - 256, (args.warmup + args.tokens,), generator=g).tolist()
    slots = args.gpu_experts or max(cfg.experts_per_token, cfg.working_set_experts // 4)
    base = dict(device=args.device, gpu_experts=slots, read_threads=parse_read_threads(args.read_threads))
    print(f"device slots {slots} (of {cfg.working_set_experts} experts per token)", flush=True)

    # reference: in RAM, before any limit
    t = time.perf_counter()
    print(
        f"reference: page cache filled with {warm_page_cache(tree):.1f} GB in {time.perf_counter() - t:.1f} s",
        flush=True,
    )
    ref = decode_run(tree, model, device, RuntimeOptions(**base, host_tier="mapped"), prompt, cont, args.warmup)
    ref_logits = ref["logits"]
    print(f"  reference (mapped, in RAM): {ref['payload']['s_per_token']:.3f} s/token", flush=True)
    rows = []
    if args.ram_check:
        for name, tier in (("ram-mapped", "mapped"), ("ram-pool", "pool")):
            opts = RuntimeOptions(**base, host_tier=tier, host_mem=tree_bytes)
            rows.append(timed_run(name, tree, model, device, opts, prompt, cont, args.warmup, 0.0, ref_logits,
                                  cold=False, all_paths=all_paths))
        print(f"  in RAM: pool / mapped s/token = {rows[-1]['s_per_token'] / rows[-2]['s_per_token']:.3f} "
              f"(target <= 1.05)", flush=True)

    print(enter_cgroup(parse_bytes(args.cgroup_mem, "--cgroup-mem")) if args.cgroup_mem else
          "cgroup: not asked (--cgroup-mem)", flush=True)
    print(f"raw: page cache: {drop_caches(all_paths)}", flush=True)
    raw, rates = raw_rate(sample_paths(tree, args.raw_files), fb)
    print("raw O_DIRECT: " + ", ".join(f"{n} threads {r / 1e9:.2f} GB/s" for n, r in rates.items())
          + f"; raw rate {raw / 1e9:.2f} GB/s", flush=True)
    plan = [("pool", "pool")] + ([] if args.skip_mapped else [("mapped", "mapped")])
    for name, tier in plan:
        opts = RuntimeOptions(**base, host_tier=tier, host_mem=host_mem)
        rows.append(timed_run(name, tree, model, device, opts, prompt, cont, args.warmup, raw, ref_logits,
                              cold=True, all_paths=all_paths))

    print()
    print(f"### Disk tier, {cfg.name} ({tree_bytes / 2**30:.1f} GiB of experts), --host-mem {args.host_mem}, "
          f"cgroup {args.cgroup_mem or 'none'} ({datetime.date.today()}, commit {git_commit()})")
    print(f"{machine()}; raw O_DIRECT {raw / 1e9:.2f} GB/s; {args.tokens} timed tokens after {args.warmup}")
    print()
    print(
        "| run | tier | s/token | GB/token from disk | floor s/token | ratio (<= 1.15) | disk GB/s | of raw (>= 0.85) "
        "| pool hits / misses | read-ahead used / read | identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['host_tier']} | {r['s_per_token']:.3f} | {r['disk_bytes_per_token'] / 1e9:.3f} | "
            f"{r['floor_s']:.3f} | {r['ratio']:.2f} | {r['disk_gbps']:.2f} | {r['disk_share']:.2f} | "
            f"{r['pool_hits']} / {r['pool_misses']} | {r['readahead_used']} / {r['readahead_reads']} | "
                f"{r['identical']} |"
        )
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
