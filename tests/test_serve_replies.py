"""The server's pieces without a model: generated ids -> OpenAI reply pieces, stop strings,
tool_choice rendering, streamed tool-call deltas, error field names."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

pytest.importorskip("fastapi")

from streamrt.chat import encode_chat, encode_segments, render  # noqa: E402
from streamrt.serve import schemas as S  # noqa: E402
from streamrt.serve.errors import from_validation  # noqa: E402
from streamrt.serve.schemas import field_path  # noqa: E402
from streamrt.chat.tools import prior_calls  # noqa: E402
from streamrt.serve.replies import ChatReply, StopMatcher  # noqa: E402
from streamrt.serve.routes import ServerState, _delta_chunks, render_chat  # noqa: E402

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
USER = {"role": "user", "content": "What's the weather in Paris?"}


@pytest.fixture(scope="module")
def tok():
    from streamrt.default_model import default_model_dir
    from streamrt.tokenizer import load_tokenizer

    root = default_model_dir()
    cfg = json.loads((root / "config.json").read_text())["text_config"]
    return load_tokenizer(root, cfg["vocab_size"], cfg.get("eos_token_id"))


def _generated(tok, assistant: dict, history=(USER,)) -> list[int]:
    """The ids a model emits after the generation prompt to produce `assistant`."""
    prompt = encode_segments(tok, render(list(history)))
    whole = encode_segments(tok, render([*history, assistant], add_generation_prompt=False))
    assert whole[: len(prompt)] == prompt
    return whole[len(prompt) :]


CALLING = {"role": "assistant", "reasoning_content": "I need the weather.", "content": "",
           "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                          {"function": {"name": "get_time", "arguments": {"tz": "CET"}}}]}


def _run(reply: ChatReply, ids: list[int], reason: str = "stop") -> list:
    pieces = [p for t in ids for p in reply.feed(t)]
    return pieces + reply.finish(reason)


def test_tool_calls_get_kimi_ids_and_json_string_arguments(tok):
    reply = ChatReply(tok, thinking=True, stops=[], call_base=3)
    _run(reply, _generated(tok, CALLING))
    assert reply.calls == [
        {"index": 0, "id": "functions.get_weather:3", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"index": 1, "id": "functions.get_time:4", "name": "get_time", "arguments": '{"tz": "CET"}'},
    ]
    assert reply.reasoning == "I need the weather." and reply.content == ""
    assert reply.finish_reason("stop") == "tool_calls" and not reply.errors


def test_tool_choice_none_and_named_filter_calls(tok):
    ids = _generated(tok, CALLING)
    none = ChatReply(tok, thinking=True, stops=[], allowed=set())
    _run(none, ids)
    assert none.calls == [] and none.finish_reason("stop") == "stop"
    named = ChatReply(tok, thinking=True, stops=[], allowed={"get_time"}, required=True)
    _run(named, ids)
    assert [c["id"] for c in named.calls] == ["functions.get_time:0"] and not named.unmet
    plain = _generated(tok, {"role": "assistant", "content": "It is sunny."})
    unmet = ChatReply(tok, thinking=True, stops=[], required=True)
    _run(unmet, plain)
    assert unmet.content == "It is sunny." and unmet.unmet and unmet.finish_reason("stop") == "stop"


def test_named_tool_choice_declares_only_that_tool_and_requires_it(tok):
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    req = S.ChatRequest.model_validate({"model": "m", "messages": [USER], "tools": [WEATHER_TOOL, other],
                                        "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    state = ServerState(engine=None, tokenizer=tok, model_id="m", max_context=2048, metrics=None)
    ids, reply = render_chat(state, req)
    expected = encode_chat(tok, [USER], [other], tool_choice="required")
    assert ids == expected and reply.allowed == {"get_time"} and reply.required
    assert "get_weather" not in tok.decode(ids) and "tool_choice=required" in tok.decode(ids)


def _deltas(tok, assistant: dict, reason: str = "stop") -> tuple[list[dict], ChatReply, list]:
    reply = ChatReply(tok, thinking=True, stops=[])
    pieces = _run(reply, _generated(tok, assistant)[: None if reason == "stop" else -40], reason)
    head = {"id": "chatcmpl-x", "created": 0, "model": "m"}
    return [S.dump(c)["choices"][0]["delta"] for p in pieces for c in _delta_chunks(head, p)], reply, pieces


def _calls_of(deltas: list[dict]) -> dict:
    """A client's reassembly of streamed tool calls."""
    calls = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.get("id") or c["id"]
            c["name"] += tc["function"].get("name") or ""
            c["arguments"] += tc["function"]["arguments"]
    return calls


def test_streamed_call_is_a_header_then_argument_deltas_as_written(tok):
    deltas, reply, _ = _deltas(tok, CALLING)
    calls = [d for d in deltas if "tool_calls" in d]
    assert calls[0] == {"tool_calls": [{"index": 0, "id": "functions.get_weather:0", "type": "function",
                                        "function": {"name": "get_weather", "arguments": ""}}]}
    assert len(calls) > 4  # not one delta per call: '{"city": "', 'Paris', '"}', ...
    assert _calls_of(deltas) == {
        0: {"id": "functions.get_weather:0", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        1: {"id": "functions.get_time:1", "name": "get_time", "arguments": '{"tz": "CET"}'}}
    assert not any("<|" in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in deltas)
    assert [c["arguments"] for c in reply.calls] == ['{"city": "Paris"}', '{"tz": "CET"}']


def test_a_long_argument_streams_in_many_deltas_before_its_call_closes(tok):
    rng = random.Random()
    text = "".join(rng.choice("abc xyz\n\"\\é{}<>") for _ in range(5000))  # escapes, non-ASCII, braces
    args = {"path": "a.txt", "content": text, "mode": 420, "flags": {"append": False, "tags": ["x", None]}}
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "write", "arguments": args}}]}
    deltas, reply, pieces = _deltas(tok, call)
    fragments = [p for p in pieces if p.kind == "arguments"]
    end = next(i for i, p in enumerate(pieces) if p.kind == "call_end")
    assert len(fragments) > 10 and pieces.index(fragments[1]) < end  # many, and before the call closes
    whole = _calls_of(deltas)[0]["arguments"]
    assert json.loads(whole) == args and whole == reply.calls[0]["arguments"]


def test_a_call_cut_by_the_token_limit_leaves_what_was_streamed(tok):
    args = {"content": " ".join(["word"] * 300)}
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "write", "arguments": args}}]}
    deltas, reply, _ = _deltas(tok, call, reason="length")
    streamed = _calls_of(deltas)[0]["arguments"]
    assert streamed.startswith('{"content": "word word')
    assert reply.calls == [] and reply.finish_reason("length") == "length"


def test_stop_strings_cut_content_and_hold_back_a_partial_match():
    m = StopMatcher(["END", "\n\n"])
    assert m.feed("abc E") == "abc "  # "E" could begin "END"
    assert m.feed("Nx") == "ENx"  # no stop after all: released
    assert m.feed("a\n") == "a" and m.feed("\nb") == "" and m.hit  # "\n\n" across two pieces
    m = StopMatcher(["END"])
    out = m.feed("abc E") + m.feed("N") + m.feed("D tail")
    assert out == "abc " and m.hit and m.flush() == ""
    m = StopMatcher(["END"])
    assert m.feed("abc E") + m.feed("Nx") + m.flush() == "abc ENx" and not m.hit


def test_stop_string_in_reply_content(tok):
    reply = ChatReply(tok, thinking=True, stops=[" is"])
    _run(reply, _generated(tok, {"role": "assistant", "reasoning_content": "France: Paris.",
                                 "content": "The capital of France is Paris."}))
    assert reply.content == "The capital of France" and reply.stopped and reply.finish_reason("stop") == "stop"
    assert reply.reasoning == "France: Paris."  # stop strings apply to the content only


def test_prior_calls_counts_the_conversation():
    msgs = [USER, {"role": "assistant", "tool_calls": [{}, {}]}, {"role": "tool"}, {"role": "assistant"}]
    assert prior_calls(msgs) == 2


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]},
     "messages[0].content[0].type"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": "7"}, "seed"),
    ({"model": 3, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": 2**44}, "seed"),
    ({"model": "m", "messages": [{"role": "tool", "tool_call_id": "a"}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
])
def test_validation_errors_name_the_field(body, param):
    with pytest.raises(Exception) as e:
        S.ChatRequest.model_validate_json(json.dumps(body))
    err = from_validation(e.value)
    assert err.status == 400 and err.param == param, err.message


def test_nan_null_and_no_op_values():
    nan = '{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    with pytest.raises(Exception) as e:
        S.ChatRequest.model_validate_json(nan)
    assert from_validation(e.value).param == "temperature"
    S.ChatRequest.model_validate({"model": "m", "messages": [{"role": "assistant"}], "logprobs": False,
                                  "presence_penalty": 0, "logit_bias": {}, "response_format": {"type": "text"}})
    S.CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": False, "best_of": 1, "logprobs": 0})
    nulls = S.ChatRequest.model_validate_json(json.dumps({"model": "m", "messages": [USER], "temperature": None,
                                                          "top_p": None, "n": None, "stream": None,
                                                          "presence_penalty": None}))
    assert (nulls.temperature, nulls.top_p, nulls.n, nulls.stream) == (1.0, 1.0, 1, False)  # null is the default
    assert nulls.presence_penalty == 0.0


def test_response_format_is_prompted_through_the_template(tok):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "object"}}}
    req = S.ChatRequest.model_validate({"model": "m", "messages": [USER], "response_format": fmt})
    state = ServerState(engine=None, tokenizer=tok, model_id="m", max_context=2048, metrics=None)
    ids, _ = render_chat(state, req)
    assert ids == encode_chat(tok, [USER], response_format=fmt) != encode_chat(tok, [USER])


def test_more_messages_than_the_context_is_refused_before_rendering(tok):
    from streamrt.serve.errors import ApiError

    state = ServerState(engine=None, tokenizer=tok, model_id="m", max_context=64, metrics=None)
    req = S.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": ""}] * 65})
    with pytest.raises(ApiError) as e:
        render_chat(state, req)
    assert (e.value.param, e.value.code) == ("messages", "context_length_exceeded")


def test_field_path():
    assert field_path(("messages", 0, "role")) == "messages[0].role"
    assert field_path(("messages", 2, "content", "list[TextPart]", 1, "text")) == "messages[2].content[1].text"


@pytest.mark.parametrize("asked, rendered", [(None, "max"), ("none", "max"), ("low", "low"), ("minimal", "low"),
                                             ("medium", "medium"), ("high", "high"), ("xhigh", "max")])
def test_reasoning_effort_picks_the_thinking_effort_and_none_the_models_default(tok, asked, rendered):
    state = ServerState(engine=None, tokenizer=tok, model_id="m", max_context=2048, metrics=None,
                        thinking_effort="max")  # a real K3 tree's default
    body = {"model": "m", "messages": [USER]} | ({"reasoning_effort": asked} if asked else {})
    ids, _ = render_chat(state, S.ChatRequest.model_validate(body))
    assert ids == encode_chat(tok, [USER], thinking_effort=rendered)
    assert f"thinking_effort={rendered}`" in tok.decode(ids)
    with pytest.raises(ValidationError) as e:
        S.ChatRequest.model_validate({**body, "reasoning_effort": "extreme"})
    assert from_validation(e.value).param == "reasoning_effort"


def test_reasoning_content_sent_back_renders_as_the_reference_encoder_does(tok):
    """An agent sends the assistant's tool-call turn back with its reasoning (either name): it renders
    inside the think frame, as `render` (checked against the reference encoder) renders it."""
    state = ServerState(engine=None, tokenizer=tok, model_id="m", max_context=2048, metrics=None)
    call = {"id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    result = {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "26 C"}
    for key in ("reasoning_content", "reasoning"):
        turn = {"role": "assistant", "content": None, key: "I need the weather.", "tool_calls": [call]}
        req = S.ChatRequest.model_validate({"model": "m", "messages": [USER, turn, result], "tools": [WEATHER_TOOL]})
        ids, reply = render_chat(state, req)
        want = {"role": "assistant", "content": "", "reasoning_content": "I need the weather.",
                "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
        assert ids == encode_chat(tok, [USER, want, {"role": "tool", "name": "get_weather", "content": "26 C"}],
                                  [WEATHER_TOOL])
        assert "I need the weather." in tok.decode(ids) and reply.call_base == 1
