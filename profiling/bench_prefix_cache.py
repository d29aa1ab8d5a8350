"""Prefix cache benchmark: what a turn costs when only its new tokens are prefilled.

    python profiling/bench_prefix_cache.py --config tiny-k3.1-pro                   # CPU, tiny sizes
    python profiling/bench_prefix_cache.py --config deep-k3.1-pro --workdir /tmp/streamrt-bench \\
        --part conversation --first 16384 --new 512 --reply 64 --device cuda --backend nvrtc --gpu-experts 736
    python profiling/bench_prefix_cache.py --config deep-k3.1-pro --workdir /tmp/streamrt-bench \\
        --part fanout --system 4096 --clients 16 --device cuda --backend nvrtc --gpu-experts 736

conversation (one process, the streaming runtime, no HTTP): turn 1 is `--first` seeded random
token ids; turn k+1 is turn k's prompt + a `--reply`-token reply + `--new` new user tokens (the
reply's tokens are prefilled again: a decoded reply's state is not the prefill's, bit for bit).
For turns 2 and 3 it times the first token (TTFT) three ways, in this order: no prefix cache
(the whole history), the turn's new tokens alone on an empty cache (the floor), and with the
cache (resumed at the previous prompt's end); each row also gives the expert bytes over the link
and checks that the cached first-token logits equal the uncached ones bit for bit.

fanout (two `streamrt serve` children, the cache on then off, in the same run): `--clients`
concurrent streaming /v1/completions requests, each a shared `--system`-token prefix plus its
own `--suffix` tokens, `--max-tokens` each, all sent at once after one warm-up request with an
unrelated prefix (so nothing of the system prefix is cached before they arrive): with the cache
on, the first to be admitted prefills the system prefix and the others wait for its snapshot
there, then prefill only their suffixes (serve/engine.py). Reports TTFT p50 / max, aggregate
tok/s, the cached tokens and the expert bytes over the link from /metrics.

Runtime flags this script does not know (--device, --backend, --gpu-experts, ...) go to the
runtime in-process and to both servers. --model DIR: a converted tree; --config NAME: a bundled
geometry synthesised once under --workdir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from bench_serve import launch, metrics  # the same server start and /metrics scrape


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="a converted streamrt tree")
    src.add_argument("--config", metavar="NAME", help="bundled config, synthesised under --workdir")
    p.add_argument("--workdir", default="/tmp/streamrt-bench")
    p.add_argument("--part", default="conversation,fanout", help="conversation, fanout or both (default)")
    p.add_argument("--first", type=int, default=512, help="turn 1's prompt tokens (default 512)")
    p.add_argument("--reply", type=int, default=32, help="tokens of each assistant reply (default 32)")
    p.add_argument("--new", type=int, default=64, help="new user tokens of turns 2 and 3 (default 64)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="tokens per prefill chunk (default 256)")
    p.add_argument("--system", type=int, default=256, help="fanout: shared prefix tokens (default 256)")
    p.add_argument("--suffix", type=int, default=32, help="fanout: each client's own tokens (default 32)")
    p.add_argument("--clients", type=int, default=4, help="fanout: concurrent clients (default 4)")
    p.add_argument("--max-tokens", type=int, default=8, help="fanout: tokens per request (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args, runtime_flags = p.parse_known_args(argv)
    args.part = args.part.split(",")
    if unknown := sorted(set(args.part) - {"conversation", "fanout"}):
        p.error(f"--part: {unknown[0]!r} is not conversation or fanout")
    if args.prefill_chunk < 64 or args.prefill_chunk % 64:
        p.error(f"--prefill-chunk must be a positive multiple of 64, got {args.prefill_chunk}")
    return args, runtime_flags


def model_dir(args) -> Path:
    if args.model:
        return Path(args.model)
    root = Path(args.workdir) / args.config
    if not (root / "manifest.json").is_file():
        from streamrt.checkpoint.synth import synth

        if root.exists() and any(root.iterdir()):
            raise SystemExit(f"{root} exists but holds no manifest.json; remove it or pick another --workdir")
        root.parent.mkdir(parents=True, exist_ok=True)
        synth(args.config, root, fmt="streamrt", seed=0, progress=sys.stderr.isatty())
    return root


def random_ids(vocab: int, n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- conversation: in-process -------------------------------------------------------------


def conversation(args, root: Path, runtime_flags: list[str]) -> list[dict]:
    import torch

    from streamrt.checkpoint.reader import open_tree
    from streamrt.generate import generate
    from streamrt.loader import load_model
    from streamrt.model.prefix_cache import PrefixCache
    from streamrt.runtime.options import RuntimeOptions, add_runtime_flags
    from streamrt.runtime.scheduler import StreamingRuntime
    from streamrt.runtime.streams import make_device

    opts = RuntimeOptions.from_args(add_runtime_flags(argparse.ArgumentParser()).parse_args(runtime_flags))
    tree = open_tree(root)
    device = make_device(opts.device)
    model = load_model(tree, device.torch_device, backend=opts.make_backend(device))
    rt = StreamingRuntime(tree, model, opts, device=device)
    vocab = tree.config.vocab_size
    pc = PrefixCache(1 << 60)  # the budget is not what this measures

    def first_token(ids, prefix):
        h2d = rt.stats.bytes_h2d
        t0 = time.perf_counter()
        with torch.no_grad():
            r = generate(model, ids, runner=rt.run, max_new_tokens=1, prefill_chunk=args.prefill_chunk,
                         prefix_cache=prefix)
        return time.perf_counter() - t0, rt.stats.bytes_h2d - h2d, r

    prompt = random_ids(vocab, args.first, args.seed)
    rows = []
    ttft, h2d, _ = first_token(prompt, pc)
    rows.append({"turn": 1, "way": "cache (miss)", "prompt": len(prompt), "cached": 0, "ttft_s": ttft,
                 "bytes_h2d": h2d})
    for turn in (2, 3):
        new = random_ids(vocab, args.reply + args.new, args.seed + turn)
        prompt = prompt + new
        t_off, b_off, off = first_token(prompt, None)
        t_new, b_new, _ = first_token(new, None)
        t_on, b_on, on = first_token(prompt, pc)
        same = bool(torch.equal(on.prefill_logits, off.prefill_logits))  # torch backend: always (nvrtc: tolerance)
        rel = float((on.prefill_logits - off.prefill_logits).norm() / off.prefill_logits.norm())
        exact = {"bit_identical": same, "rel_diff": rel}
        for way, t, b, cached in (("no cache", t_off, b_off, 0), ("new tokens alone", t_new, b_new, 0),
                                  ("cache", t_on, b_on, on.cached_tokens[0])):
            rows.append({"turn": turn, "way": way, "prompt": len(new) if way.startswith("new") else len(prompt),
                         "cached": cached, "ttft_s": t, "bytes_h2d": b, **(exact if cached else {})})
    rt.close()
    print_conversation(args, rows, pc)
    return rows


def print_conversation(args, rows: list[dict], pc) -> None:
    print(f"\nconversation: first turn {args.first} tokens, then {args.reply} reply + {args.new} new tokens a turn; "
          f"prefill chunk {args.prefill_chunk}; snapshots held {len(pc)} ({pc.nbytes / 2**20:.1f} MiB)")
    print(f"{'turn':>4}  {'way':<17}{'prompt':>8}{'cached':>8}{'TTFT s':>9}{'link GB':>9}  ratio to new alone")
    for r in rows:
        floor = next((x["ttft_s"] for x in rows if x["turn"] == r["turn"] and x["way"] == "new tokens alone"), None)
        ratio = f"{r['ttft_s'] / floor:.2f}x" if floor else ""
        mark = "" if "bit_identical" not in r else (
            "  logits bit-identical" if r["bit_identical"] else f"  logits rel {r['rel_diff']:.1e}")
        print(f"{r['turn']:>4}  {r['way']:<17}{r['prompt']:>8}{r['cached']:>8}{r['ttft_s']:>9.3f}"
              f"{r['bytes_h2d'] / 1e9:>9.2f}  {ratio}{mark}")


# ---- fan-out: two servers -------------------------------------------------------------------


def start_server(root: Path, args, flags: list[str]):
    n = str(args.clients + 1)
    return launch(["--model", str(root), "--max-batch", n, "--max-queue", n, "--prefill-chunk",
                   str(args.prefill_chunk), *flags])


async def one_request(client, url: str, model: str, ids: list[int], max_tokens: int) -> tuple[float, int, int]:
    """(seconds to the first streamed token, tokens, cached prompt tokens) of one streamed completion."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, first, tokens, cached = time.perf_counter(), None, 0, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return first if first is not None else time.perf_counter() - t0, tokens, cached


async def fanout_run(url: str, model: str, prompts: list[list[int]], warm: list[int], max_tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=None) as client:
        if warm:
            await one_request(client, url, model, warm, 1)
        before = metrics(httpx, url)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one_request(client, url, model, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
        after = metrics(httpx, url)
    ttfts, h2d = [r[0] for r in res], "streamrt_expert_bytes_h2d_total"
    return {"ttft_p50_s": statistics.median(ttfts), "ttft_max_s": max(ttfts), "wall_s": wall,
            "tok_s": sum(r[1] for r in res) / wall, "cached_tokens": sum(r[2] for r in res),
            "bytes_h2d": after.get(h2d, 0) - before.get(h2d, 0)}


def fanout(args, root: Path, runtime_flags: list[str]) -> dict:
    from streamrt.checkpoint.reader import open_tree

    vocab = open_tree(root).config.vocab_size
    system = random_ids(vocab, args.system, args.seed + 100)
    prompts = [system + random_ids(vocab, args.suffix, args.seed + 200 + i) for i in range(args.clients)]
    warm = random_ids(vocab, args.system + args.suffix, args.seed + 199)  # same size, shares nothing
    out = {}
    for label, flags in (("cache on", []), ("cache off", ["--prefix-cache-mem", "0"])):
        proc, model, url = start_server(root, args, runtime_flags + flags)
        try:
            out[label] = asyncio.run(fanout_run(url, model, prompts, warm, args.max_tokens))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"\nfanout: {args.clients} clients, shared {args.system} + own {args.suffix} tokens, {args.max_tokens} "
          f"tokens each, sent together")
    print(f"{'':<10}{'TTFT p50 s':>11}{'TTFT max s':>11}{'tok/s':>9}{'cached':>9}{'link GB':>9}")
    for label, r in out.items():
        print(f"{label:<10}{r['ttft_p50_s']:>11.3f}{r['ttft_max_s']:>11.3f}{r['tok_s']:>9.2f}{r['cached_tokens']:>9}"
              f"{r['bytes_h2d'] / 1e9:>9.2f}")
    return out


def main(argv=None) -> None:
    args, runtime_flags = parse_args(argv)
    root = model_dir(args)
    results = {}
    if "conversation" in args.part:
        results["conversation"] = conversation(args, root, runtime_flags)
    if "fanout" in args.part:
        results["fanout"] = fanout(args, root, runtime_flags)
    if args.json:
        from streamrt.fileio import atomic_write

        atomic_write(args.json, json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
