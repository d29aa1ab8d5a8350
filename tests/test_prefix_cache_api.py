"""The prefix cache behind the Python API and `streamrt serve` (the embedded model). API: a chat's
second turn resumes at the first turn's prompt end, and answers as with the cache off. Serve,
through the official `openai` client: the second
request of a conversation resumes at the first request's prompt end and reports it as
`usage.prompt_tokens_details.cached_tokens`; its answer equals a server with the cache off
(`--prefix-cache-mem 0`); `/metrics` counts the cached tokens and the snapshot bytes. Requests
sharing a prefix that queue together resume from the first one's prefill of it."""

from __future__ import annotations

import re

import pytest
import serve_process

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

STARTUP_S = 300


@pytest.fixture(scope="module")
def servers():
    procs = {"on": serve_process.start("--prefix-cache-mem", "256M"),
             "off": serve_process.start("--prefix-cache-mem", "0")}
    try:
        yield {k: serve_process.ready(p, STARTUP_S).url for k, p in procs.items()}
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(timeout=30)


def _conversation(url: str):
    """Two turns: the second resends the first with its reply and asks again."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = c.models.list().data[0].id
    first = [{"role": "user", "content": "What is the capital of France?"}]
    r1 = c.chat.completions.create(model=model, messages=first, temperature=0, max_tokens=40)
    m1 = r1.choices[0].message
    second = first + [{"role": "assistant", "content": m1.content, "reasoning_content": m1.reasoning_content},
                      {"role": "user", "content": "What is the capital of Spain?"}]
    r2 = c.chat.completions.create(model=model, messages=second, temperature=0, max_tokens=40)
    return r1, r2


def test_second_turn_reports_cached_tokens_and_answers_as_without_cache(servers):
    on1, on2 = _conversation(servers["on"])
    off1, off2 = _conversation(servers["off"])
    assert on1.usage.prompt_tokens_details.cached_tokens == 0
    assert on2.usage.prompt_tokens_details.cached_tokens == on1.usage.prompt_tokens  # the first prompt's end
    assert off2.usage.prompt_tokens_details.cached_tokens == 0
    assert on2.usage.prompt_tokens == off2.usage.prompt_tokens > on1.usage.prompt_tokens
    for a, b in ((on1, off1), (on2, off2)):
        assert a.choices[0].message.content == b.choices[0].message.content
        assert a.choices[0].message.reasoning_content == b.choices[0].message.reasoning_content
        assert a.usage.completion_tokens == b.usage.completion_tokens

    text = httpx.get(servers["on"] + "/metrics", timeout=30).text
    cached = float(re.search(r"^streamrt_prompt_cached_tokens_total (\S+)$", text, re.M).group(1))
    held = float(re.search(r"^streamrt_prefix_cache_bytes (\S+)$", text, re.M).group(1))
    assert cached == on1.usage.prompt_tokens and held > 0
    assert "streamrt_prefix_cache_bytes" not in httpx.get(servers["off"] + "/metrics", timeout=30).text


def test_api_chat_second_turn_resumes_and_answers_as_without_cache():
    import streamrt

    first = [{"role": "user", "content": "What is the capital of France?"}]
    replies = {}
    for label, mem in (("on", "64M"), ("off", 0)):
        with streamrt.load(prefix_cache_mem=mem) as engine:
            m1 = engine.chat(first, max_new_tokens=40)
            s1 = engine.stats
            second = first + [m1, {"role": "user", "content": "What is the capital of Spain?"}]
            m2 = engine.chat(second, max_new_tokens=40)
            replies[label] = (m1, m2, s1, engine.stats)
    (a1, a2, on1, on2), (b1, b2, off1, off2) = replies["on"], replies["off"]
    assert (a1, a2) == (b1, b2)
    assert (on1.cached_tokens, off2.cached_tokens) == (0, 0)
    assert on2.cached_tokens == on1.prompt_tokens and on2.prompt_tokens == off2.prompt_tokens
    assert (on1.logits_hash, on2.logits_hash) == (off1.logits_hash, off2.logits_hash)  # every step, bit for bit
    assert f"({on2.cached_tokens} cached)" in on2.line()


def _chat_run(model_dir, lines: str, *flags: str, monkeypatch, capsys) -> list[dict]:
    import io
    import json

    from streamrt.cli.main import main

    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert main(["run", "--model", str(model_dir), "--chat", "--json", "--max-new-tokens", "40", *flags]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_chat_keeps_its_history_as_a_cached_prefix(default_model_copy, monkeypatch, capsys):
    """`run --chat` on a tree that holds multi-turn context: turn 2 resumes at turn 1's prompt end,
    and every reply and step's logits equal a run with the cache off."""
    import json

    config = default_model_copy / "tokenizer_config.json"
    cfg = json.loads(config.read_text())
    cfg["streamrt_chat"] = {**cfg.get("streamrt_chat", {}), "multi_turn": True}
    config.write_text(json.dumps(cfg))
    lines = "What is the capital of France?\nWhat is the capital of Spain?\n"
    on = _chat_run(default_model_copy, lines, monkeypatch=monkeypatch, capsys=capsys)
    off = _chat_run(default_model_copy, lines, "--prefix-cache-mem", "0", monkeypatch=monkeypatch, capsys=capsys)
    assert [r["stats"]["cached_tokens"] for r in on] == [0, on[0]["stats"]["prompt_tokens"]]
    assert [r["stats"]["cached_tokens"] for r in off] == [0, 0]
    assert [(r["content"], r["thinking"], r["stats"]["logits_hash"]) for r in on] == \
        [(r["content"], r["thinking"], r["stats"]["logits_hash"]) for r in off]


def test_clients_sharing_a_prefix_sent_together_resume_from_the_first():
    """A one-row server, its row held by an unrelated stream while four completions that share a
    200-token prefix queue up; the stream goes away: the first of the four prefills the prefix,
    the other three resume where it ends (`cached_tokens`), and every answer equals the cache-off
    server's for the same prompt."""
    import asyncio
    import random

    rng = random.Random(5)
    shared = [rng.randrange(300) for _ in range(200)]
    prompts = [shared + [300 + i] + [rng.randrange(300) for _ in range(9 + 3 * i)] for i in range(4)]
    server = serve_process.serve("--max-batch", "1", "--prefix-cache-mem", "256M", startup_s=STARTUP_S)
    off = serve_process.serve("--prefix-cache-mem", "0", startup_s=STARTUP_S)

    def body(model, prompt, **kw):
        return {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, **kw}

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            async with c.stream("POST", "/v1/completions", json=body(server.model, [301] * 30, max_tokens=1500,
                                                                         stream=True)) as blocker:
                lines = blocker.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass  # the unrelated stream holds the row
                sent = [asyncio.ensure_future(c.post("/v1/completions", json=body(server.model, p))) for p in prompts]
                for _ in range(3000):
                    text = (await c.get("/metrics")).text
                    if re.search(r"^streamrt_queue_depth 4(\.0)?$", text, re.M):
                        break
                    await asyncio.sleep(0.01)
            replies = [(await r).json() for r in sent]
            return replies, (await c.get("/metrics")).text

    try:
        got, metrics = asyncio.run(go())
        ref = [httpx.post(off.url + "/v1/completions", json=body(off.model, p), timeout=300).json() for p in prompts]
    finally:
        server.stop()
        off.stop()
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in got]
    assert sorted(cached) == [0, 200, 200, 200], cached
    assert re.search(r"^streamrt_prefix_followers_total 3(\.0)?$", metrics, re.M), metrics  # each waited once
    assert [r["choices"][0]["text"] for r in got] == [r["choices"][0]["text"] for r in ref]
    assert [r["usage"]["completion_tokens"] for r in got] == [r["usage"]["completion_tokens"] for r in ref]
