"""Soak and fault test for `streamrt serve`: N clients for M minutes against the embedded model.

    python profiling/soak_serve.py --minutes 30 --clients 8 --seed 0 --json soak.json

Each client loops until the time is up, picking a request class at random:

    normal      chat completion, greedy: the reply must equal `streamrt run`'s (content,
                thinking, tool calls) for the same messages and token limit
    stream      the same, streamed (SSE); the deltas reassembled must equal `streamrt run`'s
    tool        the weather tool-call conversation (examples/weather.json), streamed or not
    cancel      a streamed request whose client hangs up after its first chunks
    oversized   a Content-Length past the server's body limit (413), or max_tokens past the
                context (400)
    malformed   broken JSON, wrong field types, missing fields, a bad role (400)
    slow_body   a greedy request whose body trickles in over about a second; checked like normal

The server runs in a launcher process (this file, `--launch`), which wraps the engine's step
(`ModelRunner.step`) in random delays, some blocking the loop, some yielding it, before handing
over to `streamrt serve`: the production code carries no hook for it.

Reported: requests by class, errors by class (5xx, lost: no complete answer, wrong: a 2xx that
differs from `streamrt run` or an answer of the wrong status), p50 / p99 latency, and the
server's RSS and open files sampled through the run (growth: the last tenth against the tenth
after warm-up). Exit 1 when any request was 5xx, lost or wrong, or RSS grew 5 % or more.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ("normal", "stream", "tool", "cancel", "oversized", "malformed", "slow_body")
WEIGHTS = (30, 25, 10, 10, 8, 10, 7)
QUESTIONS = [f"What is the capital of {c}?" for c in ("France", "Japan", "Italy", "Spain")]
RSS_LIMIT = 0.05


# ---- the launcher: `streamrt serve` with the engine's step randomly delayed ------------------


def launch(argv: list[str]) -> int:
    """Child process: wrap ModelRunner.step in random delays, then run `streamrt serve`."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay-p", type=float, default=0.3)
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ns, rest = ap.parse_known_args(argv)
    import asyncio

    from streamrt.cli import main
    from streamrt.serve import runner

    rng = random.Random(ns.seed)
    step = runner.ModelRunner.step

    async def delayed(self, *a, **k):
        if rng.random() < ns.delay_p:
            d = rng.uniform(0, ns.delay_ms) / 1e3
            if rng.random() < 0.5:
                time.sleep(d)  # a slow step: the loop is blocked, requests queue in the kernel
            else:
                await asyncio.sleep(d)  # the HTTP side runs in the middle of a step
        return await step(self, *a, **k)

    runner.ModelRunner.step = delayed
    return main(["serve", *rest])


# ---- references from `streamrt run` -----------------------------------------------------------


def reference(messages: list[dict], tools: list | None, tokens: int, env: dict) -> dict:
    """`streamrt run --messages F --json --greedy --max-new-tokens N`: what every greedy reply to
    the same conversation must equal."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"messages": messages, "tools": tools} if tools else messages, f)
    try:
        cmd = [sys.executable, "-m", "streamrt", "run", "--messages", f.name, "--json", "--greedy",
               "--max-new-tokens", str(tokens)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    finally:
        os.unlink(f.name)
    if out.returncode:
        raise SystemExit(f"soak_serve: reference run failed: {out.stderr.strip()[-500:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return norm(r.get("content"), r.get("thinking"), r.get("tool_calls"))


def norm(content, thinking, calls) -> dict:
    """The comparable part of a reply: text, thinking, and tool calls as (name, arguments)."""
    out = []
    for c in calls or []:
        fn = c.get("function", c)
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # compared as the text it is
        out.append([fn.get("name"), args])
    return {"content": content or "", "thinking": thinking or "", "tool_calls": out}


# ---- one request of each class -------------------------------------------------------------


class Outcome(Exception):
    """A request that ended badly: kind in (5xx, lost, wrong)."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind = kind


class Client:
    def __init__(self, host: str, port: int, model: str, refs: dict, timeout: float):
        self.host, self.port, self.model, self.refs, self.timeout = host, port, model, refs, timeout

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def _post(self, body: bytes) -> tuple[int, bytes]:
        c = self._conn()
        try:
            c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, r.read()
        except (OSError, http.client.HTTPException) as e:
            raise Outcome("lost", f"{type(e).__name__}: {e}") from None
        finally:
            c.close()

    def body(self, key: str, stream: bool = False) -> dict:
        ref = self.refs[key]
        b = {"model": self.model, "messages": ref["messages"], "temperature": 0, "max_tokens": ref["tokens"],
             "stream": stream}
        if ref["tools"]:
            b["tools"] = ref["tools"]
        return b

    def check(self, key: str, got: dict) -> None:
        want = self.refs[key]["reply"]
        if got != want:
            raise Outcome("wrong", f"{key}: got {json.dumps(got)[:300]}, streamrt run gave {json.dumps(want)[:300]}")

    @staticmethod
    def status_check(status: int, data: bytes, expect: tuple[int, ...]) -> None:
        if status >= 500:
            raise Outcome("5xx", f"{status}: {data[:200]!r}")
        if status not in expect:
            raise Outcome("wrong", f"status {status}, expected {expect}: {data[:200]!r}")

    def plain(self, key: str) -> None:
        status, data = self._post(json.dumps(self.body(key)).encode())
        self.status_check(status, data, (200,))
        msg = json.loads(data)["choices"][0]["message"]
        self.check(key, norm(msg.get("content"), msg.get("reasoning_content"), msg.get("tool_calls")))

    def streamed(self, key: str, hang_up_after: int | None = None) -> None:
        c = self._conn()
        try:
            c.request("POST", "/v1/chat/completions", json.dumps(self.body(key, stream=True)).encode(),
                      {"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                self.status_check(r.status, r.read(), (200,))
            text, thinking, calls, done, seen = "", "", {}, False, 0
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                seen += 1
                if hang_up_after is not None and seen >= hang_up_after:
                    c.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
                    return
                if line == b"data: [DONE]":
                    done = True
                    break
                for ch in json.loads(line[6:]).get("choices", []):
                    d = ch.get("delta", {})
                    text += d.get("content") or ""
                    thinking += d.get("reasoning_content") or ""
                    for tc in d.get("tool_calls") or []:
                        call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                        fn = tc.get("function") or {}
                        call["name"] += fn.get("name") or ""
                        call["arguments"] += fn.get("arguments") or ""
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise Outcome("lost", f"{type(e).__name__}: {e}") from None
        finally:
            c.close()
        if hang_up_after is not None:
            return  # the reply ended before the client hung up: fine
        if not done:
            raise Outcome("lost", f"{key}: stream ended without [DONE]")
        self.check(key, norm(text, thinking, [{"name": v["name"], "arguments": v["arguments"]}
                                              for _, v in sorted(calls.items())]))

    def oversized(self, rng: random.Random, limit: int) -> None:
        if rng.random() < 0.5:  # a body past the limit, announced: 413 before it is read
            s = socket.create_connection((self.host, self.port), timeout=self.timeout)
            try:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n{\"model\": \"" % (limit + 1 + rng.randrange(1 << 20)))
                status, data = read_status(s)
            except OSError as e:
                raise Outcome("lost", f"{type(e).__name__}: {e}") from None
            finally:
                s.close()
            self.status_check(status, data, (413,))
        else:  # a completion past the context: 400
            b = self.body("q0")
            b["max_tokens"] = 1 << 30
            status, data = self._post(json.dumps(b).encode())
            self.status_check(status, data, (400,))

    def malformed(self, rng: random.Random) -> None:
        good = self.body("q0")
        bad = rng.choice([
            b"{\"model\": ",
            b"not json at all",
            json.dumps({**good, "temperature": "hot"}).encode(),
            json.dumps({**good, "messages": "hello"}).encode(),
            json.dumps({k: v for k, v in good.items() if k != "messages"}).encode(),
            json.dumps({**good, "messages": [{"role": "wizard", "content": "hi"}]}).encode(),
            json.dumps({**good, "max_tokens": -3}).encode(),
            b"\xff\xfe\x00garbage",
        ])
        status, data = self._post(bad)
        self.status_check(status, data, (400, 422))

    def slow_body(self, rng: random.Random, key: str) -> None:
        body = json.dumps(self.body(key)).encode()
        s = socket.create_connection((self.host, self.port), timeout=self.timeout)
        try:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
            pieces = rng.randint(3, 8)
            step = -(-len(body) // pieces)
            for i in range(0, len(body), step):
                s.sendall(body[i:i + step])
                time.sleep(rng.uniform(0.05, 0.3))
            status, data = read_status(s, whole=True)
        except OSError as e:
            raise Outcome("lost", f"{type(e).__name__}: {e}") from None
        finally:
            s.close()
        self.status_check(status, data, (200,))
        msg = json.loads(data)["choices"][0]["message"]
        self.check(key, norm(msg.get("content"), msg.get("reasoning_content"), msg.get("tool_calls")))


def read_status(s: socket.socket, whole: bool = False) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 response read from a raw socket (Content-Length bodies)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        got = s.recv(65536)
        if not got:
            raise ConnectionError(f"connection closed after {len(buf)} bytes of response")
        buf += got
    head, _, rest = buf.partition(b"\r\n\r\n")
    m = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    if not m:
        raise ConnectionError(f"not an HTTP response: {head[:80]!r}")
    n = re.search(rb"(?i)content-length: *(\d+)", head)
    want = int(n.group(1)) if n else None
    while want is not None and len(rest) < want:
        got = s.recv(65536)
        if not got:
            break
        rest += got
    return int(m.group(1)), rest


# ---- the soak ---------------------------------------------------------------------------------


def start_server(args, env: dict) -> tuple[subprocess.Popen, str, int, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--launch", "--port", "0", "--max-batch", str(args.max_batch),
           "--log-level", "error"]
    env = {**env, "SOAK_DELAY": f"{args.delay_p},{args.delay_ms},{args.seed}"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    lines, deadline = [], time.monotonic() + args.startup_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"serving (\S+) on http://([\d.]+):(\d+)", line)
        if m:
            tail: list[str] = []
            threading.Thread(target=lambda: tail.extend(proc.stderr), daemon=True).start()  # keep the pipe drained
            proc.stderr_tail = tail
            return proc, m.group(2), int(m.group(3)), m.group(1)
    proc.kill()
    raise SystemExit("soak_serve: the server did not start:\n" + "".join(lines[-20:]))


def proc_sample(pid: int) -> tuple[int, int] | None:
    """(RSS bytes, open file descriptors) of a live process."""
    try:
        rss = next(int(x.split()[1]) * 1024 for x in open(f"/proc/{pid}/status") if x.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


def client_loop(i: int, client: Client, deadline: float, args, results: list, lock: threading.Lock) -> None:
    rng = random.Random(args.seed * 1000 + i)
    questions = [k for k in client.refs if k.startswith("q")]
    while time.monotonic() < deadline:
        cls = rng.choices(CLASSES, WEIGHTS)[0]
        t0, kind, why = time.monotonic(), "ok", ""
        try:
            if cls == "normal":
                client.plain(rng.choice(questions))
            elif cls == "stream":
                client.streamed(rng.choice(questions))
            elif cls == "tool":
                client.streamed("tool") if rng.random() < 0.5 else client.plain("tool")
            elif cls == "cancel":
                client.streamed(rng.choice(questions), hang_up_after=rng.randint(1, 3))
            elif cls == "oversized":
                client.oversized(rng, args.max_body)
            elif cls == "malformed":
                client.malformed(rng)
            else:
                client.slow_body(rng, rng.choice(questions))
        except Outcome as e:
            kind, why = e.kind, str(e)
        except Exception as e:  # a reply this script cannot read (bad JSON, missing fields) is a wrong one
            kind, why = "wrong", f"{type(e).__name__}: {e}"
        with lock:
            results.append({"class": cls, "kind": kind, "s": time.monotonic() - t0, "why": why, "t": t0})


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def growth(samples: list[tuple[float, int, int]], col: int) -> dict:
    """The last tenth of the run against the tenth after warm-up (10-20 %), medians."""
    n = len(samples)
    if n < 10:
        return {"base": None, "end": None, "growth": None}
    base = statistics.median(s[col] for s in samples[n // 10: max(n // 10 + 1, n // 5)])
    end = statistics.median(s[col] for s in samples[n - max(1, n // 10):])
    return {"base": base, "end": end, "growth": (end - base) / base if base else None}


def summarize(results: list[dict], samples: list, args, extra: dict) -> dict:
    by = {}
    for cls in CLASSES:
        rs = [r for r in results if r["class"] == cls]
        ok = [r["s"] for r in rs if r["kind"] == "ok"]
        bad = {k: sum(r["kind"] == k for r in rs) for k in ("5xx", "lost", "wrong")}
        by[cls] = {"requests": len(rs), "ok": len(ok), **bad,
                   "p50_s": pct(ok, 0.5), "p99_s": pct(ok, 0.99)}
    ok_all = [r["s"] for r in results if r["kind"] == "ok"]
    errors = [r for r in results if r["kind"] != "ok"]
    rss, fds = growth(samples, 1), growth(samples, 2)
    return {"minutes": args.minutes, "clients": args.clients, "seed": args.seed, "requests": len(results),
            "completed_ok": len(ok_all), **{k: sum(r["kind"] == k for r in results) for k in ("5xx", "lost", "wrong")},
            "p50_s": pct(ok_all, 0.5), "p99_s": pct(ok_all, 0.99), "by_class": by,
            "rss": rss, "open_files": fds, "rss_max": max((s[1] for s in samples), default=None),
            "first_errors": [{k: r[k] for k in ("class", "kind", "why")} for r in errors[:20]], **extra}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE", help="write the report here too")
    ap.add_argument("--tokens", type=int, default=12, help="max_tokens of the question requests (default 12)")
    ap.add_argument("--tool-tokens", type=int, default=180,
                    help="max_tokens of the tool-call requests (default 180: the reply reaches its call)")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--delay-p", type=float, default=0.3, help="share of engine steps delayed (default 0.3)")
    ap.add_argument("--delay-ms", type=float, default=20.0, help="longest step delay (default 20 ms)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout, seconds")
    ap.add_argument("--startup-s", type=float, default=600.0)
    ap.add_argument("--sample-s", type=float, default=2.0, help="RSS / open-file sampling interval")
    args = ap.parse_args(argv)
    for name in ("minutes", "clients", "tokens", "tool_tokens", "max_batch", "timeout", "sample_s"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def references(args, env: dict) -> dict:
    """Every conversation the clients send and its `streamrt run` reply, computed in parallel."""
    weather = json.loads((ROOT / "examples" / "weather.json").read_text())
    convs = {f"q{i}": ([{"role": "user", "content": q}], None, args.tokens) for i, q in enumerate(QUESTIONS)}
    convs["tool"] = (weather["messages"], weather["tools"], args.tool_tokens)
    out: dict = {}

    def one(key):
        m, tools, n = convs[key]
        out[key] = {"messages": m, "tools": tools, "tokens": n, "reply": reference(m, tools, n, env)}

    threads = [threading.Thread(target=one, args=(k,)) for k in convs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    missing = set(convs) - set(out)
    if missing:
        raise SystemExit(f"soak_serve: no reference for {sorted(missing)}")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--launch"]:
        p, ms, seed = os.environ.get("SOAK_DELAY", "0.3,20,0").split(",")
        return launch(["--delay-p", p, "--delay-ms", ms, "--seed", seed, *argv[1:]])
    args = parse_args(argv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t_start = time.monotonic()
    box: dict = {}
    ref_thread = threading.Thread(target=lambda: box.update(refs=references(args, env)))
    ref_thread.start()  # the references run while the server loads
    proc, host, port, model = start_server(args, env)
    ref_thread.join()
    if "refs" not in box:
        proc.kill()
        return 1
    from streamrt.serve.routes import BODY_BYTES_PER_TOKEN, MIN_BODY_BYTES

    samples: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def monitor():
        while not stop.wait(args.sample_s):
            s = proc_sample(proc.pid)
            if s:
                samples.append((time.monotonic(), *s))

    results: list[dict] = []
    lock = threading.Lock()
    try:
        http_get(host, port, "/health")  # answers before the clients start
        args.max_body = max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * context_of(env))
        client = Client(host, port, model, box["refs"], args.timeout)
        threading.Thread(target=monitor, daemon=True).start()
        deadline = time.monotonic() + 60 * args.minutes
        workers = [threading.Thread(target=client_loop, args=(i, client, deadline, args, results, lock))
                   for i in range(args.clients)]
        t_soak = time.monotonic()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        soak_s = time.monotonic() - t_soak
        after = {"alive": proc.poll() is None}
        try:
            client.plain("q0")
            after["final_request"] = "ok"
        except Outcome as e:
            after["final_request"] = f"{e.kind}: {e}"
    finally:
        stop.set()
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the server's own shutdown
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    report = summarize(results, samples, args, {
        "soak_s": soak_s, "total_s": time.monotonic() - t_start, "server_exit": rc, **after,
        "server_stderr_tail": "".join(getattr(proc, "stderr_tail", [])[-10:])[-2000:],
        "delay": {"p": args.delay_p, "ms": args.delay_ms}, "tokens": args.tokens, "tool_tokens": args.tool_tokens,
        "references": {k: v["reply"] for k, v in box["refs"].items()}})
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    bad = report["5xx"] + report["lost"] + report["wrong"]
    rss_g = report["rss"]["growth"]
    failed = bad or not after["alive"] or after["final_request"] != "ok" or (rss_g is not None and rss_g >= RSS_LIMIT)
    return 1 if failed else 0


def http_get(host: str, port: int, path: str) -> bytes:
    c = http.client.HTTPConnection(host, port, timeout=60)
    try:
        c.request("GET", path)
        return c.getresponse().read()
    finally:
        c.close()


def context_of(env: dict) -> int:
    """The embedded model's max_position_embeddings (the server's default context)."""
    from streamrt.default_model import default_model_dir

    cfg = json.loads((default_model_dir() / "config.json").read_text())
    return cfg.get("text_config", cfg)["max_position_embeddings"]


def print_report(r: dict) -> None:
    def f(x):
        return "-" if x is None else f"{x:.2f}"

    print(f"soak: {r['clients']} clients, {r['soak_s'] / 60:.1f} min, {r['requests']} requests, "
          f"{r['completed_ok']} ok; 5xx {r['5xx']}, lost {r['lost']}, wrong {r['wrong']}; "
          f"latency p50 {f(r['p50_s'])} s, p99 {f(r['p99_s'])} s")
    print(f"{'class':<10} {'n':>6} {'ok':>6} {'5xx':>4} {'lost':>5} {'wrong':>5} {'p50 s':>7} {'p99 s':>7}")
    for cls, c in r["by_class"].items():
        print(f"{cls:<10} {c['requests']:>6} {c['ok']:>6} {c['5xx']:>4} {c['lost']:>5} {c['wrong']:>5} "
              f"{f(c['p50_s']):>7} {f(c['p99_s']):>7}")
    rss, fd = r["rss"], r["open_files"]
    if rss["base"]:
        print(f"server RSS {rss['base'] / 2**20:.0f} -> {rss['end'] / 2**20:.0f} MiB ({100 * rss['growth']:+.1f} %), "
              f"open files {fd['base']:.0f} -> {fd['end']:.0f}; alive {r['alive']}, "
              f"final request {r['final_request']}, exit {r['server_exit']}")
    for e in r["first_errors"][:5]:
        print(f"  {e['class']} {e['kind']}: {e['why'][:200]}")


if __name__ == "__main__":
    sys.exit(main())
