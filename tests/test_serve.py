"""`streamrt serve` end to end: the embedded model behind the server, the official `openai`
client in front, 127.0.0.1 only. One server per module; the functional replies are requested
together (so they share decode steps), the references come from `streamrt run` itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import serve_process

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # conftest.py sets the thread count for subprocesses too
CAPITALS = ["France", "Japan", "Italy", "Spain"]
STARTUP_S = 180
CUT = 40  # tokens per reply in the 16-client test: past the think channel into the response


def _question(country: str) -> str:
    return f"What is the capital of {country}?"


@pytest.fixture(scope="module")
def reference():
    """`streamrt run --chat --json --max-new-tokens CUT` over the four questions (/reset between
    them): one process, started first so it runs while the server loads."""
    stdin = "".join(f"{_question(c)}\n/reset\n" for c in CAPITALS)
    cmd = [sys.executable, "-m", "streamrt", "run", "--chat", "--json", "--max-new-tokens", str(CUT)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    box = {}
    threading.Thread(target=lambda: box.update(out=proc.communicate(stdin, timeout=STARTUP_S)), daemon=True).start()

    def get() -> dict:
        for _ in range(STARTUP_S * 10):
            if "out" in box:
                break
            time.sleep(0.1)
        out, err = box["out"]
        assert proc.returncode == 0, err
        replies = [json.loads(line) for line in out.splitlines() if line.strip()]
        return dict(zip(CAPITALS, replies, strict=True))

    return get


@pytest.fixture(scope="module")
def server(reference):
    s = serve_process.serve("--max-batch", "20", "--max-queue", "32", startup_s=STARTUP_S)
    yield {"url": s.url, "model": s.model}
    s.stop()


def _client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _tokenizer():
    """The embedded model's tokenizer, without loading the model."""
    from streamrt.default_model import default_model_dir
    from streamrt.tokenizer import load_tokenizer

    root = default_model_dir()
    cfg = json.loads((root / "config.json").read_text())["text_config"]
    return load_tokenizer(root, cfg["vocab_size"], cfg.get("eos_token_id"))


def _weather() -> dict:
    return json.loads((EXAMPLES / "weather.json").read_text())


def _tool_result_messages() -> list[dict]:
    """examples/weather_result.json's turn as an OpenAI client sends it back (ids and string arguments)."""
    data = json.loads((EXAMPLES / "weather_result.json").read_text())
    user, call, result = data["messages"]
    call_id = "functions.get_weather:0"
    assistant = {"role": "assistant", "content": "", "reasoning_content": call["reasoning"],
                 "tool_calls": [{"id": call_id, "type": "function", "function": {
                     "name": "get_weather", "arguments": json.dumps(call["tool_calls"][0]["function"]["arguments"])}}]}
    return [user, assistant, {"role": "tool", "tool_call_id": call_id, "content": result["content"]}]


def _collect_stream(stream) -> dict:
    """Reassemble streamed chunks the way a client does (content, reasoning, tool-call deltas)."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "usage": None, "roles": []}
    for chunk in stream:
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for ch in chunk.choices:
            d = ch.delta
            out["roles"] += [d.role] if d.role else []
            out["content"] += d.content or ""
            out["reasoning"] += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                call = out["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            out["finish"] = ch.finish_reason or out["finish"]
    return out


@pytest.fixture(scope="module")
def replies(server):
    """Every generating request of the module, sent at once so they decode in one batch: the
    functional ones and 16 streaming clients (so each row shares its steps with unlike rows)."""
    c, model = _client(server), server["model"]
    weather = _weather()
    france = [{"role": "user", "content": _question("France")}]
    jobs = {
        "plain": lambda: c.chat.completions.create(model=model, messages=france, temperature=0),
        "tool": lambda: c.chat.completions.create(model=model, messages=weather["messages"], tools=weather["tools"],
                                                  temperature=0),
        "tool_stream": lambda: _collect_stream(c.chat.completions.create(
            model=model, messages=weather["messages"], tools=weather["tools"], temperature=0, stream=True)),
        "result": lambda: c.chat.completions.create(model=model, messages=_tool_result_messages(),
                                                    tools=weather["tools"], temperature=0),
    }
    for i in range(16):
        jobs[f"client{i}"] = lambda i=i: _capital_stream(c, model, CAPITALS[i % len(CAPITALS)])
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {k: pool.submit(f) for k, f in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


def _capital_stream(c, model: str, country: str) -> dict:
    s = c.chat.completions.create(model=model, messages=[{"role": "user", "content": _question(country)}],
                                  temperature=0, max_tokens=CUT, stream=True, stream_options={"include_usage": True})
    return {"country": country, **_collect_stream(s)}


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server["url"] + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# ---- the API's surface ------------------------------------------------------------------------


def test_models_and_health(server):
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [server["model"]]
    assert _client(server).models.retrieve(server["model"]).id == server["model"]
    r = httpx.get(server["url"] + "/v1/models/gpt-4o", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    health = httpx.get(server["url"] + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["model"] == server["model"]


def test_plain_chat_answers_paris_with_reasoning_and_usage(replies):
    from streamrt.chat import encode_chat

    r = replies["plain"]
    msg = r.choices[0].message
    assert msg.content == "The capital of France is Paris."
    assert msg.reasoning_content == "France: Paris."
    assert r.choices[0].finish_reason == "stop" and msg.tool_calls is None
    prompt = encode_chat(_tokenizer(), [{"role": "user", "content": _question("France")}])
    assert r.usage.prompt_tokens == len(prompt) == 94
    assert r.usage.completion_tokens == 82  # README: `streamrt run` answers in 82 tokens
    assert r.usage.total_tokens == 94 + 82


def test_weather_tool_call(replies):
    r = replies["tool"]
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.id == "functions.get_weather:0" and call.type == "function"
    assert call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris"}'
    assert msg.reasoning_content == "I need the weather in Paris."
    assert r.usage.prompt_tokens == 418 and r.usage.completion_tokens == 170  # README's `streamrt run` figures


def test_weather_tool_call_streamed_as_deltas(replies):
    s = replies["tool_stream"]
    assert s["finish"] == "tool_calls"
    assert s["calls"] == {0: {"id": "functions.get_weather:0", "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert s["reasoning"] == "I need the weather in Paris."


def test_tool_result_turn_answers_with_the_temperature(replies):
    r = replies["result"]
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and not msg.tool_calls
    assert "26" in msg.content and "Paris" in msg.content
    assert msg.reasoning_content


def test_raw_completion(server):
    c = _client(server)
    r = c.completions.create(model=server["model"], prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    chunks = c.completions.create(model=server["model"], prompt="The capital of France is", max_tokens=6,
                                  temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text


# ---- batching -----------------------------------------------------------------------------------


def test_sixteen_concurrent_streams_equal_streamrt_run(server, replies, reference):
    results, refs = [replies[f"client{i}"] for i in range(16)], reference()
    for r in results:
        ref = refs[r["country"]]
        assert (r["reasoning"], r["content"]) == (ref["thinking"], ref["content"]), r["country"]
        assert r["content"].startswith("The capit")  # the cut reaches the response channel
        assert r["roles"] == ["assistant"] and r["finish"] == "length" == ref["finish_reason"]
        assert (r["usage"].prompt_tokens, r["usage"].completion_tokens) == (ref["stats"]["prompt_tokens"], CUT)
    m = _metrics(server)
    assert m["streamrt_decode_batch_rows_count"] - m['streamrt_decode_batch_rows_bucket{le="16.0"}'] > 0, \
        "no decode step ever held more than 16 rows"
    assert m["streamrt_batch_size"] == 0 and m["streamrt_queue_depth"] == 0


def test_client_cut_mid_stream_frees_its_row(server):
    full = 82  # the whole reply (README)
    before = _metrics(server)["streamrt_completion_tokens_total"]
    body = {"model": server["model"], "messages": [{"role": "user", "content": _question("France")}],
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server["url"] + "/v1/chat/completions", json=body, timeout=60) as resp:
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("data: ")
            if seen == 4:
                assert _metrics(server)["streamrt_batch_size"] == 1
                break
    for _ in range(300):  # the row goes at the next step boundary
        m = _metrics(server)
        if m["streamrt_batch_size"] == 0:
            break
        time.sleep(0.1)
    assert m["streamrt_batch_size"] == 0
    time.sleep(0.5)
    generated = _metrics(server)["streamrt_completion_tokens_total"] - before
    assert 3 <= generated < full / 2, f"{generated} tokens generated for a client that left after 3"


# ---- errors -------------------------------------------------------------------------------------


def _bad_requests(model: str) -> list[tuple[str, object, str | None, str | None]]:
    """(endpoint, body, param, code): each a 400."""
    ok = [{"role": "user", "content": "hi"}]
    chat = "/v1/chat/completions"
    return [
        (chat, b'{"model": "x", "messages": [', None, "invalid_json"),
        (chat, {"model": model, "messages": ok, "temperature": "hot"}, "temperature", "invalid_value"),
        (chat, {"model": model, "messages": "hi"}, "messages", "invalid_value"),
        (chat, {"model": model}, "messages", "missing_required_parameter"),
        (chat, {"model": model, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role",
         "invalid_value"),
        (chat, {"model": model, "messages": [{"role": "user", "content": "x" * 3000}]}, "messages",
         "context_length_exceeded"),
        (chat, {"model": model, "messages": ok, "max_tokens": 0}, "max_tokens", "invalid_value"),
        (chat, {"model": model, "messages": ok, "max_completion_tokens": -3}, "max_completion_tokens", "invalid_value"),
        (chat, {"model": model, "messages": ok, "max_tokens": 10**6}, "max_tokens", "context_length_exceeded"),
        (chat, {"model": model, "messages": ok, "n": 2}, "n", "invalid_value"),
        (chat, {"model": model, "messages": ok, "tool_choice": "required"}, "tool_choice", None),
        (chat, {"model": model, "messages": [{"role": "tool", "content": "26 C"}]}, "messages[0]", None),
        ("/v1/completions", {"model": model, "prompt": "x" * 3000}, "prompt", "context_length_exceeded"),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": -1}, "max_tokens", "invalid_value"),
        (chat, {"model": model, "messages": ok, "seed": 2**63}, "seed", "invalid_value"),  # was a 500
        (chat, {"model": model, "messages": [{"role": "user"}]}, "messages[0].content", "invalid_value"),
        (chat, {"model": model, "messages": ok, "response_format": "junk"}, "response_format", "invalid_value"),
        (chat, {"model": model, "messages": ok, "logprobs": True}, "logprobs", "invalid_value"),
        ("/v1/completions", {"model": model, "prompt": "hi", "echo": True}, "echo", "invalid_value"),
        ("/v1/completions", {"model": model, "prompt": "hi", "seed": 10**30}, "seed", "invalid_value"),
    ]


def test_bad_requests_are_400s_naming_the_field(server):
    for endpoint, body, param, code in _bad_requests(server["model"]):
        kw = ({"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes)
              else {"json": body})
        r = httpx.post(server["url"] + endpoint, timeout=30, **kw)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["param"], err["code"]) == (param, code), (body, err)
        assert err["type"] == "invalid_request_error" and "Traceback" not in err["message"]
    r = httpx.post(server["url"] + "/v1/chat/completions",
                   json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    err = r.json()["error"]
    assert r.status_code == 404 and (err["param"], err["code"]) == ("model", "model_not_found")
    with pytest.raises(openai.BadRequestError) as e:  # and as the official client sees it
        _client(server).chat.completions.create(model=server["model"], messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    r = httpx.post(server["url"] + "/v1/completions", content=b"x" * (5 << 20), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # a temperature so small that sampling would overflow: argmax, not a failed batch
    r = _client(server).chat.completions.create(model=server["model"], max_tokens=3, temperature=5e-324,
                                                messages=[{"role": "user", "content": _question("France")}])
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"  # still answering


# ---- the queue bound (in process: no model needed) -----------------------------------------------


class _IdleRunner:
    """A runner whose engine never runs: every request stays queued."""

    name, max_context, stats = "idle", 2048, None

    def __init__(self):
        self.tokenizer = _tokenizer()


@pytest.mark.parametrize("max_queue", [0, 1])
def test_full_queue_answers_503_with_retry_after(max_queue):
    """The batch's one row takes a request, max_queue more wait for it, the next is a 503
    (a request submitted while a row is free does not count against the queue)."""
    from streamrt.serve.app import create_app
    from streamrt.cli.serve import build_state

    runner = _IdleRunner()
    state = build_state(runner, max_batch=1, max_queue=max_queue)
    body = {"model": "idle", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def go():
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            taken = [asyncio.ensure_future(c.post("/v1/chat/completions", json=body)) for _ in range(1 + max_queue)]
            for _ in range(100):
                if state.engine.queue_depth == len(taken):
                    break
                await asyncio.sleep(0.01)
            over = await c.post("/v1/chat/completions", json=body)
            waiting = sum(not t.done() for t in taken)
            for t in taken:
                t.cancel()
            return over, waiting

    r, waiting = asyncio.run(go())
    assert waiting == 1 + max_queue
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"


def test_api_key_guards_v1_only():
    from streamrt.serve.app import create_app
    from streamrt.cli.serve import build_state

    state = build_state(_IdleRunner(), max_batch=1, max_queue=1, api_key="sesame")

    async def go():
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return (await c.get("/v1/models"), await c.get("/v1/models", headers={"Authorization": "Bearer sesame"}),
                    await c.get("/health"), await c.get("/v1/models", headers={"Authorization": "bearer sesame"}),
                    await c.get("/v1/models", headers={"Authorization": "Bearer sesame2"}))

    denied, allowed, health, lower, wrong = asyncio.run(go())
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert denied.headers["www-authenticate"] == "Bearer"
    assert allowed.status_code == 200 and allowed.json()["data"][0]["id"] == "idle"
    assert health.status_code == 200
    assert lower.status_code == 200 and wrong.status_code == 401  # the scheme is case-insensitive, the key is not


def test_empty_api_key_and_too_long_context_are_refused():
    from streamrt.cli.main import main
    from streamrt.errors import StreamrtError
    from streamrt.cli.serve import build_state

    assert main(["serve", "--api-key", ""]) == 2  # before any model is loaded
    with pytest.raises(StreamrtError, match="--max-context"):
        build_state(_IdleRunner(), max_batch=1, max_queue=1, max_context=4096)


# ---- Anthropic Messages, OpenAI Responses, an agent framework: each a full tool loop ------------


def _weather_result() -> str:
    return json.loads((EXAMPLES / "weather_result.json").read_text())["messages"][2]["content"]


def _anthropic_loop(server, stream: bool) -> dict:
    """A tool_use turn, then its tool_result turn, through the official `anthropic` client."""
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=server["url"], api_key="unused", max_retries=0, timeout=300)
    fn = _weather()["tools"][0]["function"]
    kw = dict(model=server["model"], max_tokens=1024, extra_body={"temperature": 0}, tools=[
        {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}])
    messages = [{"role": "user", "content": _weather()["messages"][0]["content"]}]

    def ask():
        if not stream:
            return c.messages.create(**kw, messages=messages)
        with c.messages.stream(**kw, messages=messages) as s:
            return s.get_final_message()

    first = ask()
    use = next(b for b in first.content if b.type == "tool_use")
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": _weather_result()}]}]
    return {"first": first, "second": ask()}


def _responses_loop(server, stream: bool) -> dict:
    """A function_call, then its function_call_output, through the official client's `responses.create`."""
    c = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)
    fn = _weather()["tools"][0]["function"]
    kw = dict(model=server["model"], temperature=0, tools=[{"type": "function", **fn}])
    items: list = [{"role": "user", "content": _weather()["messages"][0]["content"]}]

    def ask():
        if not stream:
            return c.responses.create(**kw, input=items)
        events = list(c.responses.create(**kw, input=items, stream=True))
        assert events[-1].type == "response.completed", events[-1]
        return events[-1].response

    first = ask()
    call = next(o for o in first.output if o.type == "function_call")
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": _weather_result()})
    return {"first": first, "second": ask()}


@pytest.fixture(scope="module")
def loops(server):
    """The tool loops, run together (their turns share decode steps)."""
    jobs = {"anthropic": lambda: _anthropic_loop(server, False),
            "anthropic_stream": lambda: _anthropic_loop(server, True),
            "responses": lambda: _responses_loop(server, False),
            "responses_stream": lambda: _responses_loop(server, True),
            "agent": lambda: _agent_loop(server)}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {k: pool.submit(f) for k, f in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


@pytest.mark.parametrize("kind", ["anthropic", "anthropic_stream"])
def test_anthropic_client_tool_loop(loops, kind):
    first, second = loops[kind]["first"], loops[kind]["second"]
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    assert first.content[0].thinking == "I need the weather in Paris."
    use = first.content[1]
    assert (use.id, use.name, use.input) == ("functions.get_weather:0", "get_weather", {"city": "Paris"})
    # as chat completions counts them; Anthropic's input_tokens leave out the prompt-cache reads
    assert (first.usage.input_tokens + first.usage.cache_read_input_tokens, first.usage.output_tokens) == (418, 170)
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["thinking", "text"]
    assert "26" in second.content[1].text and "Paris" in second.content[1].text


@pytest.mark.parametrize("kind", ["responses", "responses_stream"])
def test_responses_client_tool_loop(loops, kind):
    first, second = loops[kind]["first"], loops[kind]["second"]
    assert [o.type for o in first.output] == ["reasoning", "function_call"] and first.status == "completed"
    assert first.output[0].content[0].text == "I need the weather in Paris."
    call = first.output[1]
    assert (call.call_id, call.name, call.arguments) == ("functions.get_weather:0", "get_weather", '{"city": "Paris"}')
    assert (first.usage.input_tokens, first.usage.output_tokens) == (418, 170)
    assert [o.type for o in second.output] == ["reasoning", "message"] and second.status == "completed"
    assert "26" in second.output_text and "Paris" in second.output_text


def _agent_loop(server) -> dict:
    """An `openai-agents` Agent with one function tool, on its Responses model, run to its end."""
    agents = pytest.importorskip("agents")
    fn = _weather()["tools"][0]["function"]
    calls = []

    async def get_weather(ctx, arguments: str) -> str:
        calls.append(json.loads(arguments))
        return _weather_result()

    agents.set_tracing_disabled(True)
    tool = agents.FunctionTool(name=fn["name"], description=fn["description"], params_json_schema=fn["parameters"],
                               on_invoke_tool=get_weather, strict_json_schema=False)
    client = openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)
    agent = agents.Agent(name="weather", tools=[tool], model=agents.OpenAIResponsesModel(server["model"], client),
                         model_settings=agents.ModelSettings(temperature=0))
    result = asyncio.run(agents.Runner.run(agent, _weather()["messages"][0]["content"]))
    return {"calls": calls, "final": result.final_output}


def test_openai_agents_run_a_tool_loop_unchanged(loops):
    assert loops["agent"]["calls"] == [{"city": "Paris"}]
    assert "26" in loops["agent"]["final"] and "Paris" in loops["agent"]["final"]
