"""Rendering: a conversation (OpenAI-style messages, tools, thinking, tool choice, response
format) as XTML segments, and segments as token ids.

Only the markers are special ids. Tag names, attributes and all user, tool and model text are
ordinary tokens, encoded segment by segment the way the reference encoder splits them (BPE
merges never cross a segment boundary, so the split is part of the format)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from streamrt.chat.tools import arg_text, arg_type, call_parts, in_render_order, tool_result_name
from streamrt.chat.xtml import (
    CLOSE,
    END_OF_MSG,
    OPEN,
    SEP,
    THINKING_EFFORTS,
    ChatFormatError,
    compact_json,
    escape_attr,
    tool_declare_body,
)
from streamrt.tokenizer import Tokenizer


@dataclass(frozen=True)
class Segment:
    text: str
    special: bool = False


class ConversationTooLong(ChatFormatError):
    """More segments than `render`'s max_segments: each is at least one token, so the prompt
    cannot fit a context of that many tokens."""


class _Segments(list):
    """render's output, refusing its (max + 1)-th segment: a request of 360k tiny tool-call
    arguments is refused after max of them, not after seconds of rendering them all."""

    def __init__(self, max_segments: int):
        super().__init__()
        self.max = max_segments

    def append(self, segment: Segment) -> None:
        if len(self) >= self.max:
            raise ConversationTooLong(f"the conversation renders to more than {self.max} tokens")
        super().append(segment)


def _text(out: list[Segment], text: Any) -> None:
    text = str(text)
    if text:
        out.append(Segment(text))


def _open(out: list[Segment], tag: str, attrs: Iterable[tuple[str, Any]] = ()) -> None:
    out.append(Segment(OPEN, True))
    _text(out, tag)
    for key, value in attrs:
        _text(out, f" {key}")
        _text(out, '="')
        _text(out, escape_attr(value))
        _text(out, '"')
    out.append(Segment(SEP, True))


def _close(out: list[Segment], tag: str) -> None:
    out.append(Segment(CLOSE, True))
    _text(out, tag)
    out.append(Segment(SEP, True))


def _message(out: list[Segment], attrs: list[tuple[str, Any]], body: Any, where: str = "") -> None:
    _open(out, "message", attrs)
    _content(out, body, where)
    _close(out, "message")
    out.append(Segment(END_OF_MSG, True))


def _content(out: list[Segment], content: Any, where: str) -> None:
    """A message body: a string is one segment; a list of text parts is one segment per part, as
    the reference encodes it (BPE merges stop at each part's edge, so joining would change ids)."""
    if content is None:
        return
    if isinstance(content, str):
        _text(out, content)
        return
    if not isinstance(content, list):
        raise ChatFormatError(f"{where}: content must be a string, a list of text parts or null")
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatFormatError(f"{where}: content[{j}] is not a text part (type {kind!r}; only text is supported)")
        _text(out, part["text"])


def _assistant(out: list[Segment], msg: dict, where: str, thinking: bool) -> None:
    if thinking:
        # The think channel is structural in thinking mode: present even when empty.
        _open(out, "think")
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if reasoning is not None and str(reasoning).strip():
            _text(out, reasoning)
        _close(out, "think")
    _open(out, "response")
    _content(out, msg.get("content"), where)
    _close(out, "response")
    calls = msg.get("tool_calls") or []
    if not calls:
        return
    _open(out, "tools")
    for index, call in enumerate(calls, start=1):
        name, args, raw = call_parts(call, f"{where}, tool call {index}")
        _open(out, "call", [("tool", name), ("index", index)])
        if raw is not None:
            _open(out, "json", [("type", "object")])
            _text(out, raw)
            _close(out, "json")
        else:
            for key, value in args.items():
                _open(out, "argument", [("key", key), ("type", arg_type(value))])
                _text(out, arg_text(value))
                _close(out, "argument")
        _close(out, "call")
    _close(out, "tools")


def _internal_system(out: list[Segment], kind: str, body: str) -> None:
    _message(out, [("role", "system"), ("type", kind)], body.strip())


RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_RAW_JSON = (
    "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
)


def _response_format(out: list[Segment], response_format: Any) -> None:
    """The response-format system message (OpenAI `response_format`: a type name or {"type": ...})."""
    if response_format is None:
        return
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind not in RESPONSE_FORMATS:
        raise ChatFormatError(f"response_format type {kind!r} is not one of {', '.join(RESPONSE_FORMATS)}")
    if kind == "text":
        return  # plain text is the default: nothing to say
    head = f"The system is invoked with `response_format={kind}`.\n{_RAW_JSON}"
    if kind == "json_object":
        _internal_system(out, "response-format", head)
        return
    spec = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if not isinstance(spec, dict):
        raise ChatFormatError("response_format json_schema: json_schema must be an object (with a schema)")
    # The reference takes json_schema.schema, else json_schema.json_schema, else json_schema itself.
    schema = spec.get("schema", spec.get("json_schema", spec))
    _internal_system(
        out,
        "response-format",
        f"{head}\nThe JSON data must match the following schema:\n```json\n{compact_json(schema)}\n```",
    )


def render(
    messages: list[dict],
    tools: list | None = None,
    *,
    add_generation_prompt: bool = True,
    thinking: bool = True,
    thinking_effort: str | None = None,
    tool_choice: str | None = None,
    response_format: Any = None,
    max_segments: int | None = None,
) -> list[Segment]:
    """The XTML segments of a conversation, ending with the generation prompt.

    thinking_effort defaults to none here, as in the reference's segment builder; its
    `apply_chat_template` passes "max" unless told otherwise, which callers get from
    `ChatProfile` (what the model's tree says it was trained with). `max_segments`: raise
    ConversationTooLong past that many (a bound on the tokens, checked while rendering)."""
    out: list[Segment] = [] if max_segments is None else _Segments(max_segments)
    if tools:
        if not isinstance(tools, list):
            raise ChatFormatError("tools must be a list")
        _message(out, [("role", "system"), ("type", "tool-declare")], tool_declare_body(tools))
    if thinking and thinking_effort is not None:
        _thinking_effort(out, thinking_effort)
    _conversation(out, messages, thinking)
    _tool_choice(out, tool_choice)
    _response_format(out, response_format)
    if add_generation_prompt:
        _open(out, "message", [("role", "assistant")])
        _open(out, "think" if thinking else "response")
    return out


def _thinking_effort(out: list[Segment], thinking_effort: str) -> None:
    if thinking_effort not in THINKING_EFFORTS:
        raise ChatFormatError(f"thinking effort {thinking_effort!r} is not one of {', '.join(THINKING_EFFORTS)}")
    _internal_system(
        out,
        "thinking-effort",
        "`thinking_effort` guides on how much to think in your thinking channel (not including the "
        "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
        f"Now the system is invoked with `thinking_effort={thinking_effort}`.",
    )


def _conversation(out: list[Segment], messages: list[dict], thinking: bool) -> None:
    """Every message, tool results in their calls' order."""
    last_calls: list = []
    tool_index = 0  # tool results since the last assistant message: the rendered `index`
    for i, msg, call_name in in_render_order(messages):
        where = f"message {i}"
        role = msg["role"]
        if role == "system" and msg.get("tools"):
            if not isinstance(msg["tools"], list):
                raise ChatFormatError(f"{where}: tools must be a list")
            _message(out, [("role", "system"), ("type", "tool-declare")], tool_declare_body(msg["tools"], dynamic=True))
        elif role in ("system", "user"):
            attrs = [("role", role)] + ([("name", msg["name"])] if msg.get("name") else [])
            _message(out, attrs, msg.get("content"), where)
        elif role == "assistant":
            last_calls, tool_index = list(msg.get("tool_calls") or []), 0
            attrs = [("role", "assistant")] + ([("name", msg["name"])] if msg.get("name") else [])
            _open(out, "message", attrs)
            _assistant(out, msg, where, thinking)
            _close(out, "message")
            out.append(Segment(END_OF_MSG, True))
        else:
            tool_index += 1
            name = call_name or tool_result_name(msg, last_calls, tool_index, where)
            _message(out, [("role", "tool"), ("tool", name), ("index", tool_index)], msg.get("content"), where)


def _tool_choice(out: list[Segment], tool_choice: str | None) -> None:
    if tool_choice in ("required", "none"):
        verb = "MUST" if tool_choice == "required" else "MUST NOT"
        _internal_system(
            out,
            "tool-choice",
            f"The system is invoked with `tool_choice={tool_choice}`.\nYou {verb} call "
            f"{'tools' if tool_choice == 'required' else 'any tools'} in the next message.",
        )
    elif tool_choice not in (None, "auto"):
        raise ChatFormatError(f"tool_choice {tool_choice!r} is not one of auto, required, none")


def render_text(segments: Iterable[Segment]) -> str:
    return "".join(s.text for s in segments)


def encode_segments(tok: Tokenizer, segments: Iterable[Segment]) -> list[int]:
    ids: list[int] = []
    for s in segments:
        ids.extend(tok.encode_special(s.text) if s.special else tok.encode(s.text))
    return ids


def encode_chat(tok: Tokenizer, messages: list[dict], tools: list | None = None, **kw: Any) -> list[int]:
    return encode_segments(tok, render(messages, tools, **kw))
