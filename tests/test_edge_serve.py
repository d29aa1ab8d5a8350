"""The HTTP API as hostile or unusual clients (and unusual model output) exercise it, in process
(no model: a scripted runner behind the real engine, routes and tokenizer)."""

from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

import torch  # noqa: E402

from streamrt.model import ModelCache  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    from streamrt.default_model import default_model_dir
    from streamrt.tokenizer import load_tokenizer

    root = default_model_dir()
    cfg = json.loads((root / "config.json").read_text())["text_config"]
    return load_tokenizer(root, cfg["vocab_size"], cfg.get("eos_token_id"))


class _Runner:
    """Logits that pick the next token of `script` (one request at a time; its last token
    repeats), else token 0; the prompts it prefills are kept in `prompts`."""

    name, max_context, stats = "org/model", 2048, None

    def __init__(self, tokenizer, script: list[int] | None = None):
        self.tokenizer = tokenizer
        self.script, self._at = script, 0
        self.prompts: list[list[int]] = []

    def new_cache(self) -> ModelCache:
        return ModelCache([], [0])

    def _logits(self) -> torch.Tensor:
        tok = 0
        if self.script:
            tok = self.script[min(self._at, len(self.script) - 1)]
            self._at += 1
        # peaked enough that any temperature samples the scripted token
        return torch.nn.functional.one_hot(torch.tensor(tok), self.tokenizer.vocab_size).float() * 1e4

    async def step(self, last, cache, prefills):
        if prefills:
            self._at = 0  # a new request: its script starts over
        self.prompts += [list(ids) for ids, _ in prefills]
        await asyncio.sleep(0)
        decoded = torch.stack([self._logits() for _ in last]) if last else None
        return decoded, [self._logits() for _ in prefills]


def _serve(runner, requests):
    """Run `requests(client)` against an app whose engine runs on the same loop."""
    from streamrt.serve.app import create_app
    from streamrt.cli.serve import build_state

    state = build_state(runner, max_batch=4, max_queue=4)

    async def go():
        engine = asyncio.ensure_future(state.engine.run())
        try:
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                return await requests(c)
        finally:
            state.engine.stop()
            await engine

    return asyncio.run(asyncio.wait_for(go(), 30))


def test_completion_prompt_as_a_batch_of_one_or_token_ids(tok):
    """OpenAI's prompt may be token ids or a list of prompts; LangChain's OpenAI LLM always sends
    a list (of one). A batch of several, or an id outside the vocabulary, is a 400 on `prompt`."""
    runner = _Runner(tok)
    ids = tok.encode("The capital of France is")

    async def requests(c):
        out = []
        for prompt in ("The capital of France is", ["The capital of France is"], ids, [ids],
                       ["a", "b"], [tok.vocab_size], [-1], [], [[]]):
            out.append(await c.post("/v1/completions", json={"model": "org/model", "prompt": prompt, "max_tokens": 2}))
        return out

    *good, several, past, negative, empty, empty_ids = _serve(runner, requests)
    for r in good:
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 2, "total_tokens": len(ids) + 2,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
    assert runner.prompts == [ids] * 4
    for r in several, past, negative, empty, empty_ids:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt"
    assert "one prompt" in several.json()["error"]["message"]


def test_model_card_of_an_id_with_a_slash(tok):
    """`--served-model-name org/model` (Hugging Face style) must be retrievable, as the official
    client does it: GET /v1/models/org/model."""

    async def requests(c):
        return await c.get("/v1/models/org/model"), await c.get("/v1/models/org/other")

    card, other = _serve(_Runner(tok), requests)
    assert card.status_code == 200 and card.json()["id"] == "org/model"
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


def test_client_gone_before_its_body_is_in_is_not_a_server_error(tok):
    """A client that hangs up mid-upload was a ClientDisconnect escaping as a logged 500 with
    a traceback; the next request must still be served."""
    from streamrt.serve.app import create_app
    from streamrt.cli.serve import build_state

    state = build_state(_Runner(tok), max_batch=1, max_queue=1)
    app = create_app(state)
    body = b'{"model": "org/model", "messages": [{"role": "user", "content": "hi"}]}'
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("test", 80)}

    async def go():
        incoming = [{"type": "http.request", "body": body[:10], "more_body": True}, {"type": "http.disconnect"}]
        sent = []

        async def receive():
            return incoming.pop(0) if incoming else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return sent, await c.get("/v1/models")

    sent, after = asyncio.run(asyncio.wait_for(go(), 30))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert after.status_code == 200
    assert b'status="500"' not in state.metrics.render()


def test_more_tool_calls_than_the_context_are_refused_before_rendering(tok):
    """90k calls in one assistant message (under the body limit) took seconds of the server's one
    loop to render before the context check refused them."""
    from streamrt.serve import schemas as S
    from streamrt.serve.errors import ApiError
    from streamrt.serve.routes import ServerState, render_chat

    state = ServerState(engine=None, tokenizer=tok, model_id="m", max_context=64, metrics=None)
    calls = [{"function": {"name": "f", "arguments": "{}"}}] * 65
    req = S.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"},
                                                                   {"role": "assistant", "tool_calls": calls}]})
    with pytest.raises(ApiError) as e:
        render_chat(state, req)
    assert (e.value.param, e.value.code) == ("messages", "context_length_exceeded")
    assert "65 tool calls" in e.value.message


@pytest.mark.parametrize("as_string", [False, True])
def test_more_call_arguments_than_the_context_stop_the_rendering(tok, as_string):
    """One call of 360k tiny arguments (3.5 MB, under the body limit) rendered 5.4M segments on
    the server's one loop (seconds, every other client stalled) before the context check: the
    rendering now stops past max_context segments (each at least one token)."""
    from streamrt.chat.render import ConversationTooLong, render
    from streamrt.serve import schemas as S
    from streamrt.serve.errors import ApiError
    from streamrt.serve.routes import ServerState, render_chat

    args = {format(i, "x"): 0 for i in range(360_000)}
    call = {"id": "1", "function": {"name": "f", "arguments": json.dumps(args) if as_string else args}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}]
    state = ServerState(engine=None, tokenizer=tok, model_id="m", max_context=2048, metrics=None)
    req = S.ChatRequest.model_validate({"model": "m", "messages": messages})
    with pytest.raises(ApiError) as e:
        render_chat(state, req)
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "context_length_exceeded")
    assert "more than 2048 tokens" in e.value.message  # raised by the bound, at segment 2049
    with pytest.raises(ConversationTooLong):
        render(messages, max_segments=2048)
    small = [{"role": "user", "content": "x"}]
    assert render(small, max_segments=len(render(small))) == render(small)  # exactly at the bound: fine


def test_a_body_that_stops_coming_is_a_408(monkeypatch):
    """A client that declares 100 bytes and sends 8 held its connection (and what it sent) for
    ever: the body must be in within BODY_SECONDS."""
    from streamrt.serve import routes
    from streamrt.serve.errors import ApiError

    class Stalled:
        headers = {"content-length": "100"}

        async def stream(self):
            yield b'{"model"'
            await asyncio.sleep(3600)

    monkeypatch.setattr(routes, "BODY_SECONDS", 0.05)
    with pytest.raises(ApiError) as e:
        asyncio.run(routes.read_body(Stalled(), 4 << 20))
    assert (e.value.status, e.value.code) == (408, "request_timeout")
    assert "(8 bytes came)" in e.value.message


def test_a_generated_lone_surrogate_in_call_arguments_is_a_valid_reply(tok):
    """A model that escapes a lone surrogate in a typed argument (`["\\ud800"]`) made the call's
    arguments a str no UTF-8 body can carry: a 500 (or a stream cut mid-way) for that reply."""
    import dataclasses

    from streamrt.chat import encode_segments, render

    user = {"role": "user", "content": "tag it"}
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"function": {"name": "tag", "arguments": {"tags": ["PLACEHOLDER"]}}}]}
    segments = [dataclasses.replace(s, text=s.text.replace("PLACEHOLDER", "\\ud800"))
                for s in render([user, call], add_generation_prompt=False)]
    prompt = encode_segments(tok, render([user]))
    generated = encode_segments(tok, segments)[len(prompt):]
    tools = [{"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array"}}}}}]
    body = {"model": "org/model", "messages": [user], "tools": tools}

    async def requests(c):
        return (await c.post("/v1/chat/completions", json=body),
                await c.post("/v1/chat/completions", json={**body, "stream": True}))

    plain, streamed = _serve(_Runner(tok, generated), requests)
    assert plain.status_code == 200, plain.text
    args = plain.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(args) == {"tags": ["\ud800"]}
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert '"finish_reason": "tool_calls"' in streamed.text
