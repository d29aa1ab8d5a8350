"""Chat frames as Moonshot's encoder renders them.

The reference: Moonshot's `encoding.py` / `tokenization.py` as carried by NVIDIA NeMo
Automodel (`nemo_automodel/components/models/kimi_k3/`). Every expected frame below is written
out by hand from its rules, never produced by our renderer; each rendering must parse back.
"""

import base64
import json

import pytest

from streamrt.chat import ChatFormatError, ChatProfile, encode_chat, parse_conversation, render, render_text
from streamrt.default_model import packaged_model_dir
from streamrt.tokenizer import ByteTokenizer, load_tokenizer

TOK = ByteTokenizer(512)
END = "<|close|>message<|sep|><|end_of_msg|>"
RAW_JSON = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."


def _frames(messages, tools=None, **kw):
    """Rendered text, plus the check that the frames (less the generation prompt) parse back
    without a single error."""
    kw.setdefault("add_generation_prompt", False)
    closed = {**kw, "add_generation_prompt": False}
    parsed, _, errors = parse_conversation(TOK, encode_chat(TOK, messages, tools, **closed))
    assert errors == []
    return render_text(render(messages, tools, **kw)), parsed


def _call(call_id, name, **args):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


# ---- 1. a run of tool results: call order by tool_call_id, numbered by rendered position -------


def test_tool_results_are_sorted_into_call_order_and_numbered_as_rendered():
    messages = [
        {"role": "user", "content": "Ski day in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                _call("a", "get_weather", city="Oslo"),
                _call("b", "get_time", tz="CET"),
                _call("c", "get_news", topic="ski"),
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "Snow ahead."},  # arrives first, third call
        {"role": "tool", "tool_call_id": "a", "content": "rainy"},  # no result for b
    ]
    text, parsed = _frames(messages)
    assert text == (
        '<|open|>message role="user"<|sep|>Ski day in Oslo?' + END
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
        '<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
        '<|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Oslo<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="get_time" index="2"<|sep|>'
        '<|open|>argument key="tz" type="string"<|sep|>CET<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="get_news" index="3"<|sep|>'
        '<|open|>argument key="topic" type="string"<|sep|>ski<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|close|>tools<|sep|>' + END
        + '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>rainy' + END
        + '<|open|>message role="tool" tool="get_news" index="2"<|sep|>Snow ahead.' + END
    )
    assert [(m.get("tool"), m.get("index"), m.get("content")) for m in parsed[2:]] == [
        ("get_weather", "1", "rainy"), ("get_news", "2", "Snow ahead."),
    ]
    assert messages[2] == {"role": "tool", "tool_call_id": "c", "content": "Snow ahead."}  # input untouched


def test_a_run_with_an_id_less_result_keeps_arrival_order():
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [_call("a", "f"), _call("b", "g")]},
        {"role": "tool", "tool_call_id": "b", "name": "g", "content": "G"},
        {"role": "tool", "name": "f", "content": "F"},  # no id: the reference leaves the run as it came
    ]
    text, _ = _frames(messages, thinking=False)
    assert text.endswith(
        '<|open|>message role="tool" tool="g" index="1"<|sep|>G' + END
        + '<|open|>message role="tool" tool="f" index="2"<|sep|>F' + END
    )


# ---- 2. the tool name comes from the id-matched call, not a stale `name` ------------------------


def test_tool_name_comes_from_the_matched_call_not_a_stale_name():
    messages = [
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [_call("x1", "lookup", q="kiwi"), _call("x2", "convert", n=3)],
        },
        {"role": "tool", "tool_call_id": "x1", "name": "lookup", "content": "a fruit"},
        {"role": "tool", "tool_call_id": "x2", "name": "lookup", "tool": "lookup", "content": "3.0"},  # stale
    ]
    text, parsed = _frames(messages, thinking=False)
    assert text == (
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>Looking.<|close|>response<|sep|>'
        '<|open|>tools<|sep|><|open|>call tool="lookup" index="1"<|sep|>'
        '<|open|>argument key="q" type="string"<|sep|>kiwi<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="convert" index="2"<|sep|>'
        '<|open|>argument key="n" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|close|>tools<|sep|>' + END
        + '<|open|>message role="tool" tool="lookup" index="1"<|sep|>a fruit' + END
        + '<|open|>message role="tool" tool="convert" index="2"<|sep|>3.0' + END
    )
    assert parsed[2]["tool"] == "convert"


# ---- 3. tools on a system message: a dynamic tool-declare block -------------------------------


def test_tools_on_a_system_message_render_as_a_dynamic_declaration():
    clock = {"type": "function", "function": {"parameters": {"type": "object"}, "name": "clock"}}
    messages = [
        {"role": "user", "content": "And the time?"},
        {"role": "system", "content": "not rendered", "tools": [clock]},  # the reference drops the content
    ]
    text, parsed = _frames(messages)
    assert text == (
        '<|open|>message role="user"<|sep|>And the time?' + END
        + '<|open|>message role="system" type="tool-declare"<|sep|>## New Tools Available\n'
        "The system dynamically extends the toolset via lazy-loading.\n"
        "You have access to all existing and extended tools.\n"
        "Here are the specs for the extended tools.\n\n"
        '```json\n[{"function":{"name":"clock","parameters":{"type":"object"}},"type":"function"}]\n```' + END
    )
    assert parsed == [{"role": "user", "content": "And the time?"}, {"role": "system", "tools": [clock]}]


# ---- 4. content as text parts: one segment per part -------------------------------------------


def _bpe_tokenizer(tmp_path):
    """A BPE whose merges build "hello": the split of a text into segments shows in its ids."""
    ranks = {bytes([b]): b for b in range(256)}
    for merge in (b"he", b"ll", b"llo", b"hello"):
        ranks[merge] = len(ranks)
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return load_tokenizer(tmp_path, 1024)


def test_text_parts_are_encoded_part_by_part(tmp_path):
    tok = _bpe_tokenizer(tmp_path)
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    ids = encode_chat(tok, [{"role": "user", "content": parts}], add_generation_prompt=False)
    joined = encode_chat(tok, [{"role": "user", "content": "hello"}], add_generation_prompt=False)
    head = [tok.special_id("<|open|>")] + tok.encode("message") + tok.encode(" role") + tok.encode('="') + \
        tok.encode("user") + tok.encode('"') + [tok.special_id("<|sep|>")]
    # "hel" -> he, l; "lo" -> l, o; joined "hello" is the one merged token 259.
    assert ids[len(head) : len(head) + 4] == [256, ord("l"), ord("l"), ord("o")]
    assert joined[len(head)] == 259 and ids[: len(head)] == joined[: len(head)] == head
    text, parsed = _frames(
        [{"role": "user", "content": parts}, {"role": "assistant", "content": parts}], thinking=False
    )
    assert text == (
        '<|open|>message role="user"<|sep|>hello' + END
        + '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>hello<|close|>response<|sep|>' + END
    )
    assert [m["content"] for m in parsed] == ["hello", "hello"]
    assert [s.text for s in render([{"role": "tool", "name": "t", "content": parts}])][15:17] == ["hel", "lo"]


# ---- 5. response_format ----------------------------------------------------------------------


def test_response_format_json_object():
    text, parsed = _frames([{"role": "user", "content": "Two colours?"}], response_format={"type": "json_object"},
                           add_generation_prompt=True)
    assert text == (
        '<|open|>message role="user"<|sep|>Two colours?' + END
        + '<|open|>message role="system" type="response-format"<|sep|>'
        "The system is invoked with `response_format=json_object`.\n" + RAW_JSON + END
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    assert parsed[1]["type"] == "response-format"


def test_response_format_json_schema_follows_tool_choice_with_a_sorted_schema():
    schema = {"type": "object", "required": ["b"], "properties": {"b": {"type": "string"}, "a": {"type": "number"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "pair", "strict": True, "schema": schema}}
    text, _ = _frames([{"role": "user", "content": "Go."}], tool_choice="required", response_format=fmt)
    assert text == (
        '<|open|>message role="user"<|sep|>Go.' + END
        + '<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with `tool_choice=required`.\n'
        "You MUST call tools in the next message." + END
        + '<|open|>message role="system" type="response-format"<|sep|>'
        "The system is invoked with `response_format=json_schema`.\n" + RAW_JSON + "\n"
        "The JSON data must match the following schema:\n"
        '```json\n{"properties":{"a":{"type":"number"},"b":{"type":"string"}},"required":["b"],"type":"object"}\n```'
        + END
    )
    assert render([], response_format="text") == render([])  # plain text adds nothing


# ---- 6. the thinking-effort message: the reference's default unless the tree says otherwise ----

EFFORT_MAX = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to think in '
    "your thinking channel (not including the response channel), supported values include `low`, `medium`, "
    "`high`, and `max`.\nNow the system is invoked with `thinking_effort=max`." + END
)


def test_a_tree_without_the_key_gets_the_reference_default_max(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"added_tokens_decoder": {"163584": {"content": "[BOS]"}}})
    )
    profile = ChatProfile.from_tree(tmp_path)
    assert profile == ChatProfile.from_tree(tmp_path / "nowhere") == ChatProfile("max", True)
    tools = [{"type": "function", "function": {"name": "t"}}]
    text, parsed = _frames([{"role": "user", "content": "Hi."}], tools, thinking_effort=profile.thinking_effort)
    assert text == (
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, described in '
        'JSONSchema.\n\n```json\n[{"function":{"name":"t"},"type":"function"}]\n```' + END
        + EFFORT_MAX
        + '<|open|>message role="user"<|sep|>Hi.' + END
    )
    assert parsed[0]["type"] == "thinking-effort"
    assert "thinking-effort" not in render_text(render([], thinking=False, thinking_effort="max"))


def test_the_embedded_tree_frames_multi_turn_as_trained():
    root = packaged_model_dir()
    assert root is not None
    profile = ChatProfile.from_tree(root)
    assert profile == ChatProfile(thinking_effort=None, multi_turn=True)  # trained on conversations
    # A file outside the manifest: the checksummed tree (weights, config) is untouched.
    assert "tokenizer_config.json" not in json.loads((root / "manifest.json").read_text())["files"]
    tok = load_tokenizer(root, 512)
    ids = encode_chat(tok, [{"role": "user", "content": "What is the capital of France?"}],
                      thinking_effort=profile.thinking_effort)
    assert tok.decode(ids) == (
        '<|open|>message role="user"<|sep|>What is the capital of France?' + END
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )


@pytest.mark.parametrize("spec, fragment", [
    ({"thinking_effort": "huge"}, "streamrt_chat.thinking_effort 'huge' is not null or one of low"),
    ({"multi_turn": "no"}, "streamrt_chat.multi_turn must be true or false"),
    ({"effort": "max"}, "streamrt_chat.effort is not a known key"),
])
def test_bad_profile_keys_are_one_line_errors(tmp_path, spec, fragment):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"streamrt_chat": spec}))
    with pytest.raises(ChatFormatError, match=fragment) as exc:
        ChatProfile.from_tree(tmp_path)
    assert "\n" not in str(exc.value) and "tokenizer_config.json" in str(exc.value)


# ---- bad inputs: one line naming the message and the field -----------------------------------


@pytest.mark.parametrize("messages, kw, fragment", [
    ([{"role": "assistant", "content": "", "tool_calls": [_call("k1", "f")]},
      {"role": "tool", "tool_call_id": "k1", "content": "ok"},
      {"role": "tool", "tool_call_id": "k9", "content": "?"}],
     {}, "message 2: tool_call_id 'k9' matches no tool call of the preceding assistant message"),
    ([{"role": "assistant", "content": "", "tool_calls": [_call("k1", "f")]},
      {"role": "tool", "name": "f", "content": "ok"},  # an id-less neighbour does not excuse a wrong id
      {"role": "tool", "tool_call_id": "k2", "name": "f", "content": "?"}],
     {}, "message 2: tool_call_id 'k2' matches no tool call"),
    ([{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}]}],
     {}, r"message 0: content\[1\] is not a text part \(type 'image_url'; only text is supported\)"),
    ([{"role": "user", "content": [{"type": "text", "text": 7}]}], {}, r"message 0: content\[0\] is not a text part"),
    ([{"role": "user", "content": "x"}], {"response_format": {"type": "xml"}},
     "response_format type 'xml' is not one of text, json_object, json_schema"),
    ([{"role": "user", "content": "x"}], {"response_format": {"type": "json_schema"}},
     "response_format json_schema: json_schema must be an object"),
    ([{"role": "system", "tools": {"name": "t"}}], {}, "message 0: tools must be a list"),
])
def test_bad_inputs_are_one_line_chat_format_errors(messages, kw, fragment):
    with pytest.raises(ChatFormatError, match=fragment) as exc:
        render(messages, **kw)
    assert "\n" not in str(exc.value)
