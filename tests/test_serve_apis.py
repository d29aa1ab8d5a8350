"""/v1/messages (Anthropic) and /v1/responses (OpenAI Responses) in process: a scripted runner
behind the real engine, routes, template and parser; the official clients over ASGI. Streamed
tool input arrives as written; refused fields are 400s naming them; fuzzed bodies never 500."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

httpx = pytest.importorskip("httpx")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from test_edge_serve import _Runner  # noqa: E402
from test_fuzz import mutate_doc  # noqa: E402

from streamrt.chat import encode_segments, render  # noqa: E402

USER = {"role": "user", "content": "Write the notes file."}
TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}]
A_TOOLS = [{"name": "write_file", "description": "Write a file.", "input_schema": TOOLS[0]["function"]["parameters"]}]


class _LongRunner(_Runner):
    max_context = 16384  # a 4-5 KB argument of random characters is thousands of tokens


@pytest.fixture(scope="module")
def tok():
    from streamrt.default_model import default_model_dir
    from streamrt.tokenizer import load_tokenizer

    root = default_model_dir()
    cfg = json.loads((root / "config.json").read_text())["text_config"]
    return load_tokenizer(root, cfg["vocab_size"], cfg.get("eos_token_id"))


def _generated(tok, assistant: dict, tools=TOOLS) -> list[int]:
    """The ids a model emits after the generation prompt to produce `assistant` (then its stop token)."""
    prompt = encode_segments(tok, render([USER], tools))
    whole = encode_segments(tok, render([USER, assistant], tools, add_generation_prompt=False))
    return whole[len(prompt):] + [sorted(tok.stop_ids)[0]]


def _long_call(text: str) -> dict:
    return {"role": "assistant", "reasoning_content": "Write it.", "content": "",
            "tool_calls": [{"function": {"name": "write_file", "arguments": {"path": "notes.txt", "content": text}}}]}


def _serve(runner, requests):
    """Run `requests(client, app)` against an app whose engine runs on the same loop."""
    from streamrt.serve.app import create_app
    from streamrt.cli.serve import build_state

    state = build_state(runner, max_batch=4, max_queue=4)

    async def go():
        engine = asyncio.ensure_future(state.engine.run())
        try:
            app = create_app(state)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
                c.app = app  # for the official clients, which take httpx2 clients
                return await requests(c)
        finally:
            state.engine.stop()
            await engine

    return asyncio.run(asyncio.wait_for(go(), 120))


def _sdk_http(c):
    """An httpx2 client (the official clients' HTTP library) on the same app."""
    httpx2 = pytest.importorskip("httpx2")
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=c.app), base_url="http://test")


def _text(n: int) -> str:
    rng = random.Random()
    return "".join(rng.choice("abcdefgh ijk\n\"\\é{}") for _ in range(n))


def test_anthropic_client_streams_a_long_tool_input_as_written(tok):
    text = _text(5000)
    runner = _LongRunner(tok, _generated(tok, _long_call(text)))

    async def requests(c):
        client = anthropic.AsyncAnthropic(base_url="http://test", api_key="x", http_client=_sdk_http(c),
                                          max_retries=0)
        kw = dict(model="org/model", max_tokens=8000, tools=A_TOOLS, messages=[USER])
        stream = await client.messages.create(**kw, stream=True)
        return [e async for e in stream]

    events = _serve(runner, requests)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    tool_index = next(e.index for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use")
    parts = [i for i, e in enumerate(events) if e.type == "content_block_delta" and e.index == tool_index]
    stop = next(i for i, e in enumerate(events) if e.type == "content_block_stop" and e.index == tool_index)
    assert len(parts) > 10 and parts[0] < parts[1] < stop  # many input_json_deltas, before the block closes
    streamed = "".join(events[i].delta.partial_json for i in parts)
    assert json.loads(streamed) == {"path": "notes.txt", "content": text}
    assert events[-2].delta.stop_reason == "tool_use"
    start = next(e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use")
    assert (start.content_block.id, start.content_block.name) == ("functions.write_file:0", "write_file")
    thinking = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                       and e.delta.type == "thinking_delta")
    assert thinking == "Write it."


def test_responses_client_streams_an_argument_as_written(tok):
    text = _text(600)
    runner = _LongRunner(tok, _generated(tok, _long_call(text)))
    tools = [{"type": "function", "name": "write_file", "parameters": TOOLS[0]["function"]["parameters"]}]

    async def requests(c):
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=_sdk_http(c), max_retries=0)
        plain = await client.responses.create(model="org/model", input="Write the notes file.", tools=tools)
        events = [e async for e in await client.responses.create(model="org/model", input="Write the notes file.",
                                                                 tools=tools, stream=True)]
        return plain, events

    plain, events = _serve(runner, requests)
    assert [o.type for o in plain.output] == ["reasoning", "function_call"] and plain.status == "completed"
    call = plain.output[1]
    assert call.name == "write_file" and json.loads(call.arguments) == {"path": "notes.txt", "content": text}
    deltas = [i for i, e in enumerate(events) if e.type == "response.function_call_arguments.delta"]
    done = next(i for i, e in enumerate(events) if e.type == "response.function_call_arguments.done")
    assert len(deltas) > 10 and deltas[1] < done
    assert "".join(events[i].delta for i in deltas) == events[done].arguments == call.arguments
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [o.type for o in events[-1].response.output] == ["reasoning", "function_call"]


def _refused(model: str) -> list[tuple[str, dict, str]]:
    """(endpoint, body, the field the 400 must name)."""
    m = [{"role": "user", "content": "hi"}]
    msg = {"model": model, "max_tokens": 8, "messages": m}
    resp = {"model": model, "input": "hi"}
    return [
        ("/v1/messages", {**msg, "top_k": 0}, "top_k"),
        ("/v1/messages", {"model": model, "messages": m}, "max_tokens"),
        ("/v1/messages", {**msg, "max_tokens": 0}, "max_tokens"),
        ("/v1/messages", {**msg, "temperature": 1.5}, "temperature"),
        ("/v1/messages", {**msg, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
         "messages[0].content[0]"),
        ("/v1/messages", {**msg, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
        ("/v1/messages", {**msg, "tool_choice": {"type": "tool", "name": "nope"}, "tools": A_TOOLS},
         "tool_choice.name"),
        ("/v1/messages", {**msg, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ("/v1/messages", {**msg, "stop_sequences": [""]}, "stop_sequences"),
        ("/v1/messages", {**msg, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "26 C"}]}]}, "messages[0]"),
        ("/v1/messages/count_tokens", {"model": model, "messages": []}, "messages"),
        ("/v1/responses", {**resp, "previous_response_id": "resp_1"}, "previous_response_id"),
        ("/v1/responses", {**resp, "store": True}, "store"),
        ("/v1/responses", {**resp, "background": True}, "background"),
        ("/v1/responses", {**resp, "conversation": "conv_1"}, "conversation"),
        ("/v1/responses", {**resp, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input[0].content[0].type"),
        ("/v1/responses", {**resp, "tools": [{"type": "web_search"}]}, "tools[0]"),
        ("/v1/responses", {**resp, "max_output_tokens": 0}, "max_output_tokens"),
        ("/v1/responses", {**resp, "tool_choice": "required"}, "tool_choice"),
        ("/v1/responses", {**resp, "input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
         "input[0]"),
        ("/v1/responses", {**resp, "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ]


def test_refused_fields_are_400s_naming_them(tok):
    async def requests(c):
        out = [(endpoint, field, await c.post(endpoint, json=body)) for endpoint, body, field in _refused("org/model")]
        out.append(("/v1/messages", "model", await c.post("/v1/messages", json={
            "model": "claude-x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})))
        return out

    for endpoint, field, r in _serve(_Runner(tok), requests):
        body = r.json()
        if endpoint.startswith("/v1/messages"):
            assert r.status_code == (404 if field == "model" else 400), (field, body)
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
            assert body["error"]["type"] == ("not_found_error" if field == "model" else "invalid_request_error")
            assert field in body["error"]["message"], body
        else:
            assert r.status_code == 400, (field, body)
            assert body["error"]["param"] == field and body["error"]["type"] == "invalid_request_error", body


def test_anthropic_turns_render_as_the_chat_messages_they_are(tok):
    """A tool_use turn and its tool_result render exactly as the same conversation sent as chat
    completions messages (the reference encoder's framing), and count_tokens counts that prompt."""
    from streamrt.chat import encode_chat

    chat = [{"role": "system", "content": "Be brief."}, USER,
            {"role": "assistant", "content": "", "reasoning_content": "Write it.",
             "tool_calls": [{"id": "toolu_1", "type": "function",
                             "function": {"name": "write_file", "arguments": {"path": "a", "content": "b"}}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "written"}]
    body = {"model": "org/model", "system": "Be brief.", "tools": A_TOOLS, "messages": [
        USER,
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Write it.", "signature": ""},
                                          {"type": "tool_use", "id": "toolu_1", "name": "write_file",
                                           "input": {"path": "a", "content": "b"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "written"}]}]}
    tools = [{"type": "function", "function": {"name": "write_file", "description": "Write a file.",
                                               "parameters": TOOLS[0]["function"]["parameters"]}}]
    want = encode_chat(tok, chat, tools)
    runner = _Runner(tok, [sorted(tok.stop_ids)[0]])

    async def requests(c):
        return (await c.post("/v1/messages/count_tokens", json=body),
                await c.post("/v1/messages", json={**body, "max_tokens": 4}))

    count, reply = _serve(runner, requests)
    assert count.json() == {"input_tokens": len(want)}
    assert reply.status_code == 200 and runner.prompts == [want]
    assert reply.json()["usage"]["input_tokens"] == len(want)


def test_responses_items_render_as_the_chat_messages_they_are(tok):
    from streamrt.chat import encode_chat

    call = {"id": "call_1", "type": "function", "function": {"name": "write_file", "arguments": '{"path": "a"}'}}
    chat = [{"role": "system", "content": "Be brief."}, USER,
            {"role": "assistant", "content": "", "reasoning_content": "Write it.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "written"}]
    items = [USER, {"type": "reasoning", "id": "rs_1", "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Write it."}]},
             {"type": "function_call", "call_id": "call_1", "name": "write_file", "arguments": '{"path": "a"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "written"}]
    tools = [{"type": "function", "name": "write_file", "parameters": TOOLS[0]["function"]["parameters"]}]
    runner = _Runner(tok, [sorted(tok.stop_ids)[0]])

    async def requests(c):
        return await c.post("/v1/responses", json={"model": "org/model", "instructions": "Be brief.",
                                                   "input": items, "tools": tools, "max_output_tokens": 4})

    r = _serve(runner, requests)
    assert r.status_code == 200, r.text
    assert runner.prompts == [encode_chat(tok, chat, TOOLS)]


def test_fuzzed_bodies_are_never_a_500(tok):
    """A few hundred mutated bodies per endpoint, streamed and not (structure and bytes): 200 or a
    4xx, never a 500, and a streamed 200 ends with its closing event."""
    bases = {
        "/v1/messages": {"model": "org/model", "max_tokens": 4, "system": "s", "tools": A_TOOLS, "stream": False,
                         "tool_choice": {"type": "auto"}, "stop_sequences": ["x"], "messages": [
                             USER, {"role": "assistant", "content": [
                                 {"type": "thinking", "thinking": "t", "signature": ""},
                                 {"type": "tool_use", "id": "t1", "name": "write_file", "input": {"path": "a"}}]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                                 {"type": "text", "text": "ok"}]}, {"type": "text", "text": "go on"}]}]},
        "/v1/responses": {"model": "org/model", "max_output_tokens": 4, "instructions": "s", "input": [
            USER, {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
            {"type": "function_call", "call_id": "c1", "name": "write_file", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
            "tools": [{"type": "function", "name": "write_file", "parameters": {"type": "object"}}],
            "tool_choice": "auto", "reasoning": {"effort": "low"}, "text": {"format": {"type": "text"}}},
    }
    bases["/v1/messages/count_tokens"] = {k: v for k, v in bases["/v1/messages"].items() if k != "max_tokens"}
    rng = random.Random()
    bodies = [(e, mutate_doc(b, rng)) for e, b in bases.items() for _ in range(200 if "count" in e else 300)]
    bodies += [(e, mutate_doc({**bases[e], "stream": True}, rng)) for e in ("/v1/messages", "/v1/responses")
               for _ in range(100)]

    async def requests(c):
        out = []
        for endpoint, raw in bodies:
            r = await c.post(endpoint, content=raw, headers={"content-type": "application/json"})
            out.append((endpoint, raw, r.status_code, r.text))
        return out

    runner = _Runner(tok, [sorted(tok.stop_ids)[0]])
    results = _serve(runner, requests)
    bad = [(e, raw[:300], status, text[:300]) for e, raw, status, text in results if status >= 500]
    assert not bad, bad[:5]
    assert {s for *_, s, _ in results} >= {200, 400}
    assert any(s == 200 and t.startswith("event: ") for *_, s, t in results)  # streamed ones among them
    for e, _, status, text in results:
        if status >= 400 and e.startswith("/v1/messages"):
            assert json.loads(text)["type"] == "error"
        if status == 200 and text.startswith("event: "):
            last = text.strip().rsplit("\n", 1)[-1]
            assert last.startswith("data: ") and json.loads(last[6:])["type"] in (
                "message_stop", "response.completed", "response.incomplete"), last


def test_stop_sequence_ends_the_message_and_is_named(tok):
    said = {"role": "assistant", "reasoning_content": "Easy.", "content": "Paris. END of the answer."}
    runner = _Runner(tok, _generated(tok, said, tools=None))
    body = {"model": "org/model", "max_tokens": 200, "messages": [USER], "stop_sequences": ["END"]}

    async def requests(c):
        return (await c.post("/v1/messages", json=body), await c.post("/v1/messages", json={**body, "stream": True}))

    plain, streamed = _serve(runner, requests)
    msg = plain.json()
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "END")
    assert msg["content"] == [{"type": "thinking", "thinking": "Easy.", "signature": ""},
                              {"type": "text", "text": "Paris. "}]
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta") == "Paris. "
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert [e["type"] for e in events][-1] == "message_stop"


def test_api_key_as_x_api_key_and_anthropic_shaped_401(tok):
    from streamrt.serve.app import create_app
    from streamrt.cli.serve import build_state

    state = build_state(_Runner(tok), max_batch=1, max_queue=1, api_key="sesame")
    body = {"model": "org/model", "messages": [{"role": "user", "content": "hi"}]}

    async def go():
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            url = "/v1/messages/count_tokens"
            return (await c.post(url, json=body), await c.post(url, json=body, headers={"x-api-key": "sesame"}),
                    await c.post(url, json=body, headers={"x-api-key": "sesam"}),
                    await c.post(url, json=body, headers={"Authorization": "Bearer sesame"}),
                    await c.post("/v1/responses", json={"model": "org/model", "input": "hi"}))

    denied, keyed, wrong, bearer, responses = asyncio.run(go())
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert keyed.status_code == 200 and keyed.json()["input_tokens"] > 0
    assert wrong.status_code == 401 and bearer.status_code == 200
    assert responses.status_code == 401 and responses.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape
    counted = state.metrics.render().decode()
    assert 'endpoint="/v1/messages/count_tokens",status="200"} 2.0' in counted
    assert 'endpoint="/v1/responses",status="401"} 1.0' in counted


class _FailingRunner(_Runner):
    """Scripted tokens, then a forward that raises after `good` decode steps."""

    def __init__(self, tokenizer, script, good: int):
        super().__init__(tokenizer, script)
        self.good = good

    async def step(self, last, cache, prefills):
        if last and not prefills:
            if self.good == 0:
                raise RuntimeError("the device fell off the bus")
            self.good -= 1
        return await super().step(last, cache, prefills)


def _sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_a_failed_forward_ends_every_stream_in_its_api_shape_and_frees_the_row(tok):
    """Each API's stream ends in its own error form after the tokens already sent; no row is left."""
    script = _generated(tok, {"role": "assistant", "content": "Lisbon is the capital of Portugal."})
    msgs = [USER]
    bodies = {"/v1/chat/completions": {"model": "org/model", "messages": msgs, "stream": True},
              "/v1/completions": {"model": "org/model", "prompt": "The capital", "stream": True},
              "/v1/messages": {"model": "org/model", "messages": msgs, "max_tokens": 64, "stream": True},
              "/v1/responses": {"model": "org/model", "input": "Write the notes file.", "stream": True}}
    from streamrt.cli.serve import build_state
    from streamrt.serve.app import create_app

    for path, body in bodies.items():
        state = build_state(_FailingRunner(tok, script, good=30), max_batch=4, max_queue=4)  # 30: past the frame

        async def go(path=path, body=body, state=state):
            engine = asyncio.ensure_future(state.engine.run())
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)),
                                             base_url="http://test") as c:
                    r = await c.post(path, json=body)
                    return r.status_code, r.text, (state.engine.batch_size, state.engine.queue_depth)
            finally:
                state.engine.stop()
                await engine

        status, text, left = asyncio.run(asyncio.wait_for(go(), 120))
        assert status == 200 and left == (0, 0), (path, text, left)
        data = _sse_events(text)
        if path in ("/v1/chat/completions", "/v1/completions"):
            assert data[-1] == "[DONE]" and "device fell off the bus" in json.loads(data[-2])["error"]["message"]
            assert len(data) >= 4, (path, data)  # tokens came before the failure
        elif path == "/v1/messages":
            last = json.loads(data[-1])
            assert last["type"] == "error" and "device fell off the bus" in last["error"]["message"], data
            assert json.loads(data[0])["type"] == "message_start"
            assert not any(json.loads(d)["type"] == "message_stop" for d in data)
        else:
            last = json.loads(data[-1])
            assert last["type"] == "response.failed", data
            assert last["response"]["status"] == "failed"
            assert "device fell off the bus" in last["response"]["error"]["message"]
