"""Prefill benchmark: time-to-first-token, prefill tokens/s and peak memory against prompt length.

    python profiling/bench_prefill.py                                     # embedded model, CPU
    python profiling/bench_prefill.py --lengths 256,512,1024,2048 --prefill-chunk 512
    python profiling/bench_prefill.py --config slice-k3.1-pro --workdir /tmp/streamrt-bench \\
        --lengths 512,4096,32768,131072 --device cuda --backend nvrtc [--gpu-experts N]

One fresh process per length (`--child`), so each peak is that prompt's own: peak RSS
(ru_maxrss, CPU) or peak allocated device memory (CUDA), beside the RSS / device memory after
loading and the KV + KDA cache's bytes. The prompt is seeded random token ids, prefilled
through the streaming runtime with the same flags `streamrt run` takes (--window, --gpu-experts,
--backend, ... are passed through). TTFT = the prefill up to the first token's logits.
Prints a table, the slope of peak memory over length (MB per 1k tokens, least squares) and
the same for the cache, and then shows that a prompt one token past the model's context
(max_position_embeddings) gets `streamrt run`'s one-line refusal (exit 2). --warmup N first
prefills another N-token prompt in the same process (its time is the warm-up column), so TTFT
and the link bytes are a warm server's: without it, TTFT includes reading every expert into the
host window and the kernels' first load.

--model DIR: a converted streamrt tree (default: the embedded model). --config NAME: a bundled
geometry, synthesised once as a streamrt tree under --workdir.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def model_dir(args) -> Path:
    if args.model:
        return Path(args.model)
    if args.config:
        root = Path(args.workdir) / args.config
        if not (root / "manifest.json").is_file():
            from streamrt.checkpoint.synth import synth

            if root.exists() and any(root.iterdir()):
                raise SystemExit(f"{root} exists but holds no manifest.json; remove it or pick another --workdir")
            synth(args.config, root, fmt="streamrt", seed=0, progress=sys.stderr.isatty())
        return root
    from streamrt.default_model import default_model_dir

    return default_model_dir(lambda m: print(m, file=sys.stderr))


def child(args, rest: list[str]) -> None:
    """One length in this process: load, prefill once, print one JSON line."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from streamrt.checkpoint.reader import open_tree
    from streamrt.loader import load_model
    from streamrt.runtime.options import RuntimeOptions, add_runtime_flags
    from streamrt.runtime.scheduler import StreamingRuntime
    from streamrt.runtime.streams import make_device

    rp = argparse.ArgumentParser()
    add_runtime_flags(rp)
    opts = RuntimeOptions.from_args(rp.parse_args(rest))
    tree = open_tree(Path(args.model))
    cfg = tree.config
    device = make_device(opts.device)
    model = load_model(tree, device.torch_device, backend=opts.make_backend(device))
    model.prefill_chunk = args.prefill_chunk
    rt = StreamingRuntime(tree, model, opts, device=device)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (args.length,), generator=gen)
    cuda = device.torch_device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        dev_base = torch.cuda.memory_allocated()
    rss_loaded = _rss_bytes()
    warm_s, h2d_before = None, 0
    if args.warmup:  # another prompt first: the host window and device slots fill, kernels load
        wids = torch.randint(0, cfg.vocab_size, (args.warmup,), generator=torch.Generator().manual_seed(args.seed + 1))
        with torch.no_grad():
            t0 = time.perf_counter()
            rt.run(model.forward_steps(wids.to(device.torch_device), model.new_cache(1), last_only=True)).reshape(
                -1
            ).argmax().item()
            warm_s = time.perf_counter() - t0
        h2d_before = rt.stats.bytes_h2d
    cache = model.new_cache(1)
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = rt.run(model.forward_steps(ids.to(device.torch_device), cache, last_only=True))
        top1 = int(logits.reshape(-1).argmax())  # the first token: its logits are on the host now
        ttft = time.perf_counter() - t0
    try:
        from streamrt.model.model import default_prefill_chunk

        chunk = args.prefill_chunk or default_prefill_chunk(cfg, device.torch_device)
    except ImportError:  # a build without chunked prefill (for a before / after table)
        chunk = "-"
    out = {
        "length": args.length,
        "chunk": chunk,
        "ttft_s": ttft,
        "tok_s": args.length / ttft,
        "rss_loaded": rss_loaded,
        "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "cache_bytes": cache.nbytes(),
        "top1": top1,
        "threads": torch.get_num_threads(),
        "warmup_s": warm_s,
        "bytes_h2d": rt.stats.bytes_h2d - h2d_before,  # expert bytes over the link during this prefill
        "device_misses": rt.stats.device_misses,
    }
    if cuda:
        from bench_decode import pinned_rate  # (this script's folder is on sys.path when run)

        out.update(
            dev_loaded=dev_base, dev_peak=torch.cuda.max_memory_allocated(), link_gbps=pinned_rate(device, 1 << 30)
        )
    rt.close()
    print("RESULT " + json.dumps(out), flush=True)


def slope(xs, ys) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def run_length(mdir: Path, length: int, args, rest: list[str]) -> dict:
    cmd = [
        sys.executable,
        str(HERE),
        "--child",
        "--model",
        str(mdir),
        "--length",
        str(length),
        "--seed",
        str(args.seed),
    ]
    if args.prefill_chunk:
        cmd += ["--prefill-chunk", str(args.prefill_chunk)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.warmup:
        cmd += ["--warmup", str(args.warmup)]
    p = subprocess.run(cmd + rest, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"length {length}: child failed (rc {p.returncode}):\n{p.stderr[-3000:]}")


def refusal(mdir: Path, context: int) -> tuple[int, str]:
    """`streamrt run` on a prompt of more than `context` tokens: (exit code, stderr)."""
    text = "the " * (context + 8)  # byte-level or BPE: at least one token per word
    argv = [sys.executable, "-m", "streamrt", "run", "--model", str(mdir), "--prompt", text, "--max-new-tokens", "1"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stderr.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", help="streamrt tree (default: the embedded model)")
    src.add_argument("--config", metavar="NAME", help="bundled config, synthesised under --workdir")
    ap.add_argument("--workdir", default="/tmp/streamrt-bench")
    ap.add_argument(
        "--lengths",
        default=None,
        help="comma-separated prompt lengths (default 256,512,1024,2048 capped at the context)",
    )
    ap.add_argument("--prefill-chunk", type=int, default=None, metavar="N", help="tokens per chunk (default: auto)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads per child (default: torch's)")
    ap.add_argument("--warmup", type=int, default=0, metavar="N",
                    help="prefill another N-token prompt first in each child, so TTFT is a warm server's "
                         "(experts in host memory and slots, kernels loaded); 0: TTFT includes that first load")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--no-refusal", action="store_true", help="skip the past-the-context check")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)  # the rest: runtime flags, passed to each child
    if args.child:
        child(args, rest)
        return 0

    from streamrt.checkpoint.reader import open_tree

    mdir = model_dir(args)
    cfg = open_tree(mdir).config
    context = getattr(cfg, "max_position_embeddings", None) or (getattr(cfg, "raw", None) or {}).get(
        "text_config", {}
    ).get("max_position_embeddings")
    lengths = (
        [int(x) for x in args.lengths.split(",")]
        if args.lengths
        else [n for n in (256, 512, 1024, 2048) if n <= (context or 2048)]
    )
    rows = []
    print(f"bench_prefill {cfg.name} ({mdir}), context {context}, runtime flags {' '.join(rest) or '(defaults)'}, "
          f"threads {args.threads or 'torch default'}")
    hdr = (
        f"{'tokens':>8} {'chunk':>6} {'warm-up s':>9} {'TTFT s':>8} {'tok/s':>9} {'RSS load MB':>12} "
        f"{'RSS peak MB':>12} {'cache MB':>9}"
    )
    cuda = any(r == "cuda" or r.startswith("cuda") for r in rest)
    if cuda:
        hdr += f" {'dev peak MB':>12} {'link GB':>8} {'link GB/s':>9} {'floor s':>8}"
    print(hdr)
    for n in lengths:
        r = run_length(mdir, n, args, rest)
        rows.append(r)
        warm = "-" if r.get("warmup_s") is None else f"{r['warmup_s']:.2f}"
        line = (
            f"{n:>8} {r['chunk']:>6} {warm:>9} {r['ttft_s']:>8.2f} {r['tok_s']:>9.1f} {r['rss_loaded'] / 1e6:>12.1f} "
            f"{r['rss_peak'] / 1e6:>12.1f} {r['cache_bytes'] / 1e6:>9.2f}"
        )
        if "dev_peak" in r:
            floor = r["bytes_h2d"] / 1e9 / r["link_gbps"]  # the expert bytes at the measured link rate
            line += f" {r['dev_peak'] / 1e6:>12.1f} {r['bytes_h2d'] / 1e9:>8.2f} {r['link_gbps']:>9.1f} {floor:>8.2f}"
        print(line, flush=True)
    if len(rows) > 1:
        xs = [r["length"] / 1000 for r in rows]
        key = "dev_peak" if "dev_peak" in rows[0] else "rss_peak"
        print(
            f"slope: peak {'device memory' if key == 'dev_peak' else 'RSS'} "
                f"{slope(xs, [r[key] / 1e6 for r in rows]):.2f} MB per 1k tokens; "
            f"cache {slope(xs, [r['cache_bytes'] / 1e6 for r in rows]):.2f} MB per 1k tokens"
        )
        a, b = rows[0], rows[-1]
        print(f"peak growth {a['length']} -> {b['length']} tokens: {(b[key] - a[key]) / 1e6:.1f} MB "
              f"(of which cache {(b['cache_bytes'] - a['cache_bytes']) / 1e6:.1f} MB)")
    if not args.no_refusal and context:
        rc, err = refusal(mdir, context)
        print(f"past the context ({context} + 8 words): exit {rc}: {err.splitlines()[-1] if err else '(no message)'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
