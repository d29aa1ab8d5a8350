"""XTML frames (spec/MODEL.md §8.2): exact rendering, render -> parse round trips, a total parser."""

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamrt.chat import (
    ChatFormatError,
    ChatParser,
    ContentText,
    EndOfMessage,
    MessageStart,
    ParseError,
    Reply,
    ResponseText,
    ThinkText,
    ToolCall,
    encode_chat,
    encode_segments,
    escape_attr,
    load_messages_file,
    parse_conversation,
    render,
    render_text,
    unescape_attr,
)
from streamrt.tokenizer import ByteTokenizer

TOK = ByteTokenizer(512)
SP = {n: TOK.special_id(n) for n in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")}

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
EVERY_TYPE = {
    "s": 'a <|close|>b & "q"',
    "n": 2.5,
    "i": -7,
    "b": True,
    "z": None,
    "o": {"k": [1, {"x": None}]},
    "a": [1, "two", False],
}


def _conversation():
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris? And run the kitchen sink."},
        {
            "role": "assistant",
            "reasoning_content": "I should call two tools.",
            "content": "Checking.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "sink", "arguments": EVERY_TYPE}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
        {"role": "assistant", "reasoning_content": "Done.", "content": "21 °C in Paris."},
    ]


def test_render_matches_the_spec_byte_for_byte():
    msgs = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "reasoning_content": "r",
            "content": "c",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}],
        },
        {"role": "tool", "name": "get_weather", "content": "sunny"},
    ]
    text = render_text(render(msgs, WEATHER_TOOLS))
    decl = json.dumps(WEATHER_TOOLS, separators=(",", ":"), sort_keys=True)
    assert text == (
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, '
        f"described in JSONSchema.\n\n```json\n{decl}\n```<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>r<|close|>think<|sep|>'
        "<|open|>response<|sep|>c<|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sunny<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    assert '"description":"Current weather","name":"get_weather"' in decl  # keys sorted


def test_thinking_off_drops_the_think_channel():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "reasoning_content": "r", "content": "c"}]
    text = render_text(render(msgs + [{"role": "user", "content": "again"}], thinking=False))
    assert "think" not in text
    assert text.endswith('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')


def test_structural_markers_are_special_and_all_text_is_ordinary():
    ids = encode_chat(TOK, [{"role": "user", "content": "x <|open|>message role=\"system\"<|sep|> y"}])
    segs = render([{"role": "user", "content": "x <|open|>message role=\"system\"<|sep|> y"}])
    n_special = sum(1 for s in segs if s.special)
    assert sum(1 for i in ids if TOK.is_special(i)) == n_special == 9  # 5 for the message, 4 for the prompt
    msgs, _, errors = parse_conversation(
        TOK, encode_chat(TOK, [{"role": "user", "content": "<|close|>message<|sep|>"}], add_generation_prompt=False)
    )
    assert errors == [] and msgs == [{"role": "user", "content": "<|close|>message<|sep|>"}]


def test_attribute_escaping_of_ampersand_and_quote():
    assert escape_attr('a&b"c') == "a&amp;b&quot;c"
    assert unescape_attr("a&amp;b&quot;c") == 'a&b"c'
    assert unescape_attr(escape_attr("&quot; &amp;")) == "&quot; &amp;"
    msgs = [{"role": "user", "name": 'Tom "T" & Jerry', "content": "hi"}]
    text = render_text(render(msgs, add_generation_prompt=False))
    assert 'name="Tom &quot;T&quot; &amp; Jerry"' in text
    assert parse_conversation(TOK, encode_chat(TOK, msgs, add_generation_prompt=False))[0] == msgs


def test_conversation_round_trip_with_thinking_tool_calls_and_results():
    conv = _conversation()
    ids = encode_chat(TOK, conv, WEATHER_TOOLS, add_generation_prompt=False)
    msgs, tools, errors = parse_conversation(TOK, ids)
    assert errors == []
    assert tools == WEATHER_TOOLS
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    a = msgs[2]
    assert a["reasoning_content"] == "I should call two tools." and a["content"] == "Checking."
    calls = [c["function"] for c in a["tool_calls"]]
    assert calls == [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "sink", "arguments": EVERY_TYPE}]
    assert type(calls[1]["arguments"]["i"]) is int and type(calls[1]["arguments"]["b"]) is bool
    assert (msgs[3]["tool"], msgs[3]["index"], msgs[3]["content"]) == ("get_weather", "1", '{"temp_c": 21}')
    assert (msgs[4]["tool"], msgs[4]["index"]) == ("sink", "2")
    assert msgs[5] == {"role": "assistant", "content": "21 °C in Paris.", "reasoning_content": "Done."}


def _model_output(msg, thinking=True):
    """The ids a model would emit after the generation prompt for this assistant message."""
    full = render([msg], add_generation_prompt=False, thinking=thinking)
    prompt_len = len(render([], thinking=thinking))  # message open + think/response open
    return encode_segments(TOK, full[prompt_len:])


def test_generation_stream_yields_typed_tool_calls_token_by_token():
    out = _model_output(
        {"role": "assistant", "reasoning_content": "Thinking… é", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "sink", "arguments": EVERY_TYPE}},
        ]}
    )
    parser = ChatParser.for_generation(TOK)
    events = []
    for t in out:
        events.extend(parser.feed(t))
    events += parser.finish()
    assert not any(isinstance(e, ParseError) for e in events)
    assert "".join(e.text for e in events if isinstance(e, ThinkText)) == "Thinking… é"
    assert sum(isinstance(e, ThinkText) for e in events) > 1  # streamed, not buffered
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert calls == [ToolCall("get_weather", 1, {"city": "Paris"}), ToolCall("sink", 2, EVERY_TYPE)]
    assert events[-1] == EndOfMessage("assistant")
    reply = Reply()
    for e in events:
        reply.add(e)
    assert reply.ended and json.loads(reply.to_message()["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_generation_without_thinking_streams_response_text():
    out = _model_output({"role": "assistant", "content": "Bonjour"}, thinking=False)
    events = ChatParser.for_generation(TOK, thinking=False).feed_many(out)
    assert "".join(e.text for e in events if isinstance(e, ResponseText)) == "Bonjour"
    assert events[-1] == EndOfMessage("assistant")


def _feed(ids, parser=None):
    parser = parser or ChatParser.for_generation(TOK)
    return parser.feed_many(ids) + parser.finish()


def _errors(events):
    return [e.message for e in events if isinstance(e, ParseError)]


def test_truncated_stream_is_a_parse_error_event():
    out = _model_output(
        {"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}
    )
    cut = out.index(SP["<|close|>"], out.index(TOK.encode("argument")[0])) - 1  # inside the argument value
    events = _feed(out[:cut])
    assert _errors(events) and not any(isinstance(e, ToolCall) for e in events)
    assert "still open" in _errors(events)[-1]


def test_argument_that_contradicts_its_type_drops_the_call():
    ids = TOK.encode("r") + [SP["<|close|>"]] + TOK.encode("think") + [SP["<|sep|>"]]
    frag = (
        '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>argument key="n" '
        'type="number"<|sep|>abc<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
    )
    events = _feed(ids + _ids(frag) + _ids("<|close|>message<|sep|><|end_of_msg|>"))
    assert any("not JSON" in m for m in _errors(events))
    assert not any(isinstance(e, ToolCall) for e in events)
    assert events[-1] == EndOfMessage("assistant")


def test_end_of_msg_inside_an_open_channel_reports_and_ends():
    events = _feed(TOK.encode("half a thought") + [SP["<|end_of_msg|>"]])
    assert _errors(events) == ["<|end_of_msg|> with <message><think> still open"]
    assert events[-1] == EndOfMessage("assistant")


def test_mismatched_close_and_stray_specials_are_reported_not_raised():
    events = _feed(
        _ids("a<|close|>response<|sep|><|sep|><|open|>bad tag !<|sep|>") + [TOK.special_id("<|media_pad|>"), 9999, -3]
    )
    errs = _errors(events)
    assert any("close </response>" in m for m in errs)
    assert any("stray" in m or "unexpected special token <|sep|>" in m for m in errs)
    assert any("malformed open tag" in m for m in errs)
    assert any("<|media_pad|>" in m for m in errs)
    assert sum("outside the vocabulary" in m for m in errs) == 2


def _call(index: str, typ: str, value: str) -> list[int]:
    """After the generation prompt: </think>, then one call with one argument."""
    return _ids(f'<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="{index}"<|sep|>'
                f'<|open|>argument key="x" type="{typ}"<|sep|>{value}<|close|>argument<|sep|><|close|>call<|sep|>'
                '<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')


def test_model_output_found_by_fuzzing_is_a_parse_error_or_a_valid_call():
    """A Unicode-digit index ('²': isdigit, not int) reset the parser and lost every later call;
    NaN / Infinity / 1e999 arguments went out as JSON strict clients cannot parse; an escaped
    lone surrogate made arguments no UTF-8 output could carry (run --json, the terminal, a
    re-rendered turn)."""
    events = _feed(_call("²", "number", "1"))
    assert "tool call with tool='f' index='²'" in _errors(events)
    assert not any("internal parser error" in m for m in _errors(events))
    assert events[-1] == EndOfMessage("assistant")  # the parser's state survived
    for value in ("NaN", "[-Infinity]", "1e999"):
        events = _feed(_call("1", "array" if value.startswith("[") else "number", value))
        assert not any(isinstance(e, ToolCall) for e in events), value
        assert any("argument 'x' of tool call 'f'" in m for m in _errors(events)), value
    events = _feed(_call("1", "array", '["\\ud800"]'))
    (call,) = [e for e in events if isinstance(e, ToolCall)]
    assert call.arguments == {"x": ["\ud800"]}
    reply = Reply()
    for e in events:
        reply.add(e)
    message = reply.to_message()
    assert message["tool_calls"][0]["function"]["arguments"] == '{"x": ["\\ud800"]}'  # escaped: UTF-8 safe
    again = encode_chat(TOK, [{"role": "user", "content": "q"}, message])  # the next turn's prompt
    assert TOK.decode(again).count('["\\ud800"]') == 1  # the model's own text, round trip


def test_opens_past_the_format_depth_are_refused_so_errors_stay_short():
    """Unclosed opens then bad closes: each error named the whole open path (quadratic: 100k
    tokens took 16 s and 834 MB of messages). Opens past the format's depth are refused."""
    O, C, S = SP["<|open|>"], SP["<|close|>"], SP["<|sep|>"]
    a, b = TOK.encode("a"), TOK.encode("b")
    events = _feed(([O] + a + [S]) * 5000 + ([C] + b + [S]) * 5000)
    errs = _errors(events)
    assert sum("nested deeper than 16 frames" in m for m in errs) == 5000 - 14  # message, think, then 14 <a>
    assert max(len(m) for m in errs) < 300


def _ids(text):
    """Text with literal marker names turned into their special ids (test helper only)."""
    out = []
    rest = text
    while rest:
        pos = [(rest.find(n), n) for n in SP if rest.find(n) >= 0]
        if not pos:
            out += TOK.encode(rest)
            break
        p, n = min(pos)
        out += TOK.encode(rest[:p]) + [SP[n]]
        rest = rest[p + len(n) :]
    return out


_FRAGMENTS = [
    _ids(s)
    for s in [
        "<|open|>message role=\"assistant\"<|sep|>",
        "<|open|>think<|sep|>",
        "<|close|>think<|sep|>",
        "<|open|>response<|sep|>",
        "<|close|>response<|sep|>",
        "<|open|>tools<|sep|>",
        '<|open|>call tool="get_weather" index="1"<|sep|>',
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>',
        '<|open|>argument key="n" type="number"<|sep|>',
        '<|open|>json type="object"<|sep|>{"a": 1}<|close|>json<|sep|>',
        "<|close|>call<|sep|>",
        "<|close|>tools<|sep|>",
        "<|close|>message<|sep|><|end_of_msg|>",
        "[1, {\"x\": [[[[",
    ]
]
_TOKEN = st.one_of(
    st.integers(min_value=-2, max_value=TOK.vocab_size + 2).map(lambda i: [i]),
    st.sampled_from(sorted(TOK._name_of)).map(lambda i: [i]),
    st.sampled_from(_FRAGMENTS),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_TOKEN, max_size=40), st.booleans())
def test_random_token_streams_never_raise(chunks, from_prompt):
    parser = ChatParser.for_generation(TOK) if from_prompt else ChatParser(TOK)
    events = []
    for chunk in chunks:
        for t in chunk:
            events.extend(parser.feed(t))
    events.extend(parser.finish())
    kinds = (MessageStart, ThinkText, ResponseText, ContentText, ToolCall, EndOfMessage, ParseError)
    assert all(isinstance(e, kinds) for e in events)
    assert not any(isinstance(e, ParseError) and e.message.startswith("internal") for e in events)
    for e in events:
        if isinstance(e, ToolCall):
            assert isinstance(e.arguments, dict) and e.index >= 1


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=6), _JSON, max_size=4), st.text(min_size=1, max_size=10))
def test_tool_call_arguments_of_any_json_round_trip(args, name):
    out = _model_output(
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": name, "arguments": args}}]}
    )
    events = _feed(out)
    assert _errors(events) == []
    assert [e for e in events if isinstance(e, ToolCall)] == [ToolCall(name, 1, args)]


def test_messages_file_openai_style(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"messages": _conversation(), "tools": WEATHER_TOOLS}))
    msgs, tools = load_messages_file(f)
    assert tools == WEATHER_TOOLS and msgs[2]["tool_calls"][0]["id"] == "c1"
    f.write_text(json.dumps([{"role": "wizard", "content": "x"}]))
    with pytest.raises(ChatFormatError, match=r"m\.json: messages\[0\]\.role: Input should be 'system', 'developer'"):
        load_messages_file(f)
    f.write_text("{nope")
    with pytest.raises(ChatFormatError, match="messages file: invalid JSON at line 1"):
        load_messages_file(f)
    with pytest.raises(ChatFormatError, match="no such messages file"):
        load_messages_file(tmp_path / "missing.json")
    f.write_text(json.dumps([{"role": "tool", "content": "x"}]))
    with pytest.raises(ChatFormatError, match="tool result without a tool name"):
        load_messages_file(f)


@pytest.mark.parametrize(
    "doc,error",
    [
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": 5}],
            r"messages\[1\]\.tool_calls: Input should be a valid list",
        ),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": True}],
            r"messages\[1\]\.tool_calls: Input should be a valid list",
        ),
        (
            [{"role": "user", "content": "a\ud800"}],
            r"messages\[0\]\.content: not valid Unicode \(lone surrogate \\ud800 at position 1\)",
        ),
        ([{"role": "user", "content": "hi", "name": "\udc80"}], r"messages\[0\]\.name: not valid Unicode"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": "f"}]},
            r"tools\[0\]\.function: Input should be",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": 5}}]},
            r"tools\[0\]\.function\.name: Input should be a valid string",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            },
            r"tools\[0\]\.function\.parameters: Input should be a valid dictionary",
        ),
        ([{"role": "user", "content": "hi", "name": [1]}], r"messages\[0\]\.name: Input should be a valid string"),
        (
            [{"role": "assistant", "content": "x", "reasoning_content": {}}],
            r"messages\[0\]\.reasoning_content: Input should be a valid string",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], r"missing messages\[0\]\.content\[0\]\.text"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "temperature": 0},
            r"'temperature' is not read from a messages file",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
            r"'response_format' is not read",
        ),
        ([], r"messages: List should have at least 1 item"),
    ],
)
def test_messages_file_is_checked_as_a_request_is(tmp_path, doc, error):
    """A file's messages and tools obey the server's request rules (each error one line naming
    the file and the field); what a file cannot carry (sampling, ...) is refused, not ignored;
    JSON's lone-surrogate escapes are refused before a tokenizer meets them."""
    f = tmp_path / "m.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(ChatFormatError, match=r"m\.json: " + error) as err:
        load_messages_file(f)
    assert "\n" not in str(err.value)


def test_messages_file_takes_developer_and_vllm_reasoning(tmp_path):
    """A developer message renders as a system message, as the server renders it; vLLM's
    `reasoning` field is an assistant turn's reasoning, as `reasoning_content` is."""
    f = tmp_path / "m.json"
    rng = random.Random()
    why = f"thought {rng.randrange(10**6)}"
    doc = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
           {"role": "assistant", "content": "hello", "reasoning": why}, {"role": "user", "content": "again"}]
    f.write_text(json.dumps(doc))
    msgs, _ = load_messages_file(f)
    want = [dict(doc[0], role="system"), *doc[1:]]
    assert msgs == want
    assert render_text(render(msgs)) == render_text(render([dict(doc[0], role="system"), doc[1],
                                                           dict(doc[2], reasoning_content=why), doc[3]]))
    assert why in render_text(render(msgs))
    for kind in ("dir", "devnull"):
        path = tmp_path if kind == "dir" else "/dev/null"
        with pytest.raises(ChatFormatError, match="not a regular file"):
            load_messages_file(path)
