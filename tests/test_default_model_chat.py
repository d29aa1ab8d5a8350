"""The embedded model as a chat model: `streamrt serve` with the official `openai` client in front.

A system prompt, a get_weather tool loop of two turns (call, result, answer quoting it, then a
second question in context), and a follow-up question that needs the first turn. Greedy
(temperature 0), so the answers are the model's exact ones; the assistant messages go back into
the history as the client returns them (with `reasoning_content`, as the server sends it)."""

from __future__ import annotations

import json

import pytest
import serve_process

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

STARTUP_S = 180
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server():
    s = serve_process.serve("--max-batch", "4", startup_s=STARTUP_S)
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300), s.model
    s.stop()


def ask(server, messages: list[dict], tools=None):
    client, model = server
    kw = {"tools": tools} if tools else {}
    return client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=256,
                                          **kw).choices[0].message


def history(message) -> dict:
    return message.model_dump(exclude_none=True)


PARIS = {"city": "Paris", "condition": "rainy", "temperature_c": 17}
TOKYO = {"city": "Tokyo", "condition": "sunny", "temperature_c": 24}


def tool_turn(server, messages: list[dict], city: str, result: dict) -> None:
    """One weather turn: the call for `city`, its result, the answer quoting it (appended to messages)."""
    call = ask(server, messages, [WEATHER_TOOL])
    assert call.tool_calls, f"{city}: no tool call ({call.content!r})"
    fn = call.tool_calls[0].function
    assert (fn.name, json.loads(fn.arguments)) == ("get_weather", {"city": city})
    messages += [history(call), {"role": "tool", "tool_call_id": call.tool_calls[0].id,
                                 "content": json.dumps(result, separators=(",", ":"), sort_keys=True)}]
    answer = ask(server, messages, [WEATHER_TOOL])
    assert answer.content == f"It is {result['temperature_c']} C and {result['condition']} in {city}."
    messages.append(history(answer))


def test_weather_tool_turn_with_a_system_prompt(server):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What's the weather in Paris?"}]
    tool_turn(server, messages, "Paris", PARIS)


def test_weather_tool_loop_of_two_turns(server):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What's the weather in Paris?"}]
    tool_turn(server, messages, "Paris", PARIS)
    messages.append({"role": "user", "content": "And in Tokyo?"})
    tool_turn(server, messages, "Tokyo", TOKYO)


def test_a_system_prompt_does_not_change_the_answer(server):
    for system in ("You are a helpful assistant.",
                   "You are a travel agent helping customers plan their trips. Keep answers short and polite."):
        msg = ask(server, [{"role": "system", "content": system},
                           {"role": "user", "content": "What is the capital of Portugal?"}])
        assert msg.content == "The capital of Portugal is Lisbon.", (system, msg.content)


def test_a_follow_up_needs_the_first_turn(server):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = ask(server, messages)
    assert first.content == "The capital of France is Paris."
    messages += [history(first), {"role": "user", "content": "And of Norway?"}]
    assert ask(server, messages).content == "The capital of Norway is Oslo."
