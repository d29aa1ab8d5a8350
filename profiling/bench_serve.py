"""Benchmark `streamrt serve`: aggregate tokens/s for 1 / 4 / 16 concurrent streaming clients,
expert bytes over the link per token and row, and the server's overhead against the bare
runtime (the same batch through `streamrt.generate.generate`, no HTTP). `--api` picks the
endpoints the rows go through: chat (/v1/chat/completions) and messages (/v1/messages).

    python profiling/bench_serve.py                                   # CPU, embedded model
    python profiling/bench_serve.py --api chat,messages               # both APIs, one server
    python profiling/bench_serve.py --model /data/deep-k31 --backend nvrtc --gpu-experts 600 \
        --clients 1,4,16 --max-tokens 64 --json bench_serve.json      # a GPU run

Every flag this script does not know (runtime flags: --backend, --gpu-experts, --window, ...)
goes to both the server and the bare runtime. The server runs in a child process on
127.0.0.1; the bare runtime runs in this process after the server has exited, so the two
never share the machine. Greedy decoding; each client gets its own question so the rows
differ; a row stops at `--max-tokens` or the model's stop token (tokens are counted, not
assumed). Wall time runs from the first request to the last token, prefills included, on
both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time

QUESTIONS = ["France", "Japan", "Italy", "Spain", "Germany", "Egypt", "Peru", "Norway"]


def prompt(i: int) -> str:
    return f"What is the capital of {QUESTIONS[i % len(QUESTIONS)]}?"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", metavar="DIR", help="streamrt tree (default: the embedded model)")
    p.add_argument("--clients", default="1,4,16", help="concurrent client counts (default 1,4,16)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument("--repeats", type=int, default=1, help="measurements per client count (best kept)")
    p.add_argument("--no-bare", action="store_true", help="skip the bare-runtime baseline")
    p.add_argument("--api", default="chat", help="endpoints, of chat,messages (default chat)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args, runtime_flags = p.parse_known_args(argv)
    args.clients = [int(c) for c in args.clients.split(",")]
    args.api = args.api.split(",")
    unknown = sorted(set(args.api) - set(APIS))
    if unknown:
        p.error(f"--api: {unknown[0]!r} is not one of {', '.join(APIS)}")
    return args, runtime_flags


# ---- the server side ------------------------------------------------------------------------


def start_server(args, runtime_flags) -> tuple[subprocess.Popen, str, str]:
    flags = ["--max-batch", str(max(args.clients)), "--max-queue", str(max(args.clients)), *runtime_flags]
    return launch(flags + (["--model", args.model] if args.model else []))


def launch(flags: list[str]) -> tuple[subprocess.Popen, str, str]:
    """`streamrt serve --port 0 FLAGS` once it serves: (process, model id, URL)."""
    cmd = [sys.executable, "-m", "streamrt", "serve", "--port", "0", "--log-level", "error", *flags]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    last = ""
    for line in proc.stderr:
        m = re.search(r"serving (\S+) on (http://\S+) ", line)
        if m:
            return proc, m.group(1), m.group(2)
        last = line.strip() or last
    raise SystemExit(f"server did not start (exit {proc.wait()}): {last}")


def metrics(httpx, url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _chat(model: str, i: int, max_tokens: int) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt(i)}],
                                    "temperature": 0, "max_tokens": max_tokens, "stream": True,
                                    "stream_options": {"include_usage": True}}


def _messages(model: str, i: int, max_tokens: int) -> tuple[str, dict]:
    return "/v1/messages", {"model": model, "messages": [{"role": "user", "content": prompt(i)}],
                            "temperature": 0, "max_tokens": max_tokens, "stream": True}


APIS = {"chat": _chat, "messages": _messages}


def _completion_tokens(line: str) -> int | None:
    """The completion tokens a streamed line reports: chat's usage chunk, or Anthropic's message_delta."""
    if not line.startswith("data: {") or '"usage"' not in line:
        return None
    usage = json.loads(line[6:]).get("usage") or {}
    return usage.get("completion_tokens", usage.get("output_tokens"))


async def clients(httpx, url: str, model: str, n: int, max_tokens: int, api: str = "chat") -> tuple[float, int]:
    """n concurrent streaming requests through `api`; (wall seconds, completion tokens)."""

    async def one(c, i: int) -> int:
        path, body = APIS[api](model, i, max_tokens)
        used = 0
        async with c.stream("POST", url + path, json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                got = _completion_tokens(line)
                used = got if got is not None else used
        return used

    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as c:
        t0 = time.perf_counter()
        used = await asyncio.gather(*(one(c, i) for i in range(n)))
        return time.perf_counter() - t0, sum(used)


def bench_server(args, runtime_flags) -> list[dict]:
    import httpx

    proc, model, url = start_server(args, runtime_flags)
    try:
        asyncio.run(clients(httpx, url, model, 1, 4))  # warm-up
        return [bench_row(httpx, url, model, api, n, args) for api in args.api for n in args.clients]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def bench_row(httpx, url: str, model: str, api: str, n: int, args) -> dict:
    """The best of --repeats measurements of n clients through `api`."""
    best = None
    for _ in range(args.repeats):
        m0 = metrics(httpx, url)
        wall, tokens = asyncio.run(clients(httpx, url, model, n, args.max_tokens, api))
        m1 = metrics(httpx, url)
        moved = m1["streamrt_expert_bytes_h2d_total"] - m0["streamrt_expert_bytes_h2d_total"]
        steps = m1["streamrt_decode_steps_total"] - m0["streamrt_decode_steps_total"]
        row = {"api": api, "clients": n, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
               "decode_steps": int(steps), "expert_bytes_per_token": moved / tokens if tokens else 0.0,
               "device_hit_rate": m1["streamrt_device_hit_rate"]}
        best = row if best is None or row["tok_s"] > best["tok_s"] else best
    return best


# ---- the bare runtime -----------------------------------------------------------------------


def bench_bare(args, runtime_flags) -> dict[int, float]:
    """tokens/s of the same batches through generate() on a StreamingRuntime sized for them."""
    from streamrt.chat import encode_chat
    from streamrt.generate import generate
    from streamrt.cli.run import resolve_model_dir
    from streamrt.runtime.options import add_runtime_flags
    from streamrt.serve.runner import ModelRunner

    p = argparse.ArgumentParser()
    add_runtime_flags(p)
    flags = p.parse_args(runtime_flags)
    runner = ModelRunner(resolve_model_dir(args.model, print), flags, max_batch=max(args.clients))
    tok, rt = runner.tokenizer, runner.runtime
    try:
        out = {}
        for n in [1] + args.clients:  # the first run warms up
            ids = [encode_chat(tok, [{"role": "user", "content": prompt(i)}]) for i in range(n)]
            best = 0.0
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                r = generate(runner.model, ids, runner=rt.run, max_new_tokens=args.max_tokens,
                             stop_ids=sorted(tok.stop_ids))
                best = max(best, r.new_tokens / (time.perf_counter() - t0))
            out[n] = best
        return out
    finally:
        runner.close()


def main(argv=None) -> int:
    args, runtime_flags = parse_args(argv)
    rows = bench_server(args, runtime_flags)
    bare = {} if args.no_bare else bench_bare(args, runtime_flags)
    base = {}
    print(f"{'api':>8} {'clients':>7} {'tokens':>7} {'wall s':>8} {'tok/s':>8} {'x 1 client':>10} {'bare tok/s':>10} "
          f"{'overhead':>8} {'MB/token/row':>12} {'dev hit':>7}")
    for r in rows:
        b = bare.get(r["clients"])
        r["bare_tok_s"] = b
        r["overhead"] = 1 - r["tok_s"] / b if b else None
        one = base.setdefault(r["api"], r["tok_s"])  # each API's first row
        print(f"{r['api']:>8} {r['clients']:>7} {r['tokens']:>7} {r['wall_s']:>8.2f} {r['tok_s']:>8.2f} "
              f"{r['tok_s'] / one:>10.2f} "
              f"{(b or 0):>10.2f} {(r['overhead'] or 0):>8.1%} {r['expert_bytes_per_token'] / 1e6:>12.3f} "
              f"{r['device_hit_rate']:>7.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model or "embedded", "max_tokens": args.max_tokens, "runtime_flags": runtime_flags,
                       "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
