"""Kimi K3 XTML chat frames (spec/MODEL.md §8.2): render, encode, and parse the model's output.

A frame is `<|open|>tag attrs<|sep|> … <|close|>tag<|sep|>`; every message ends with
`<|end_of_msg|>`. Only the markers are special ids. Tag names, attributes and all user, tool
and model text are ordinary tokens, encoded segment by segment the way the reference
encoder splits them (BPE merges never cross a segment boundary, so the split is part of
the format). The rules follow Moonshot's encoding helpers (`encoding.py`, `tokenization.py`, as
carried by NeMo Automodel's `kimi_k3` package); `tests/test_chat_reference.py` spells them out.

The parser is incremental over token ids and total: any id sequence yields events, and a
malformed or truncated frame yields `ParseError` events, never an exception.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from streamrt.errors import StreamrtError
from streamrt.jsonio import load_json
from streamrt.tokenizer import Tokenizer

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
ARG_TYPES = ("string", "number", "boolean", "null", "object", "array")
THINKING_EFFORTS = ("low", "medium", "high", "max")
ROLES = ("system", "user", "assistant", "tool")


class ChatFormatError(StreamrtError):
    """Messages or tools that cannot be rendered (bad role, content, arguments, file)."""


# ---- rendering ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    text: str
    special: bool = False


def escape_attr(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


_UNESCAPE = re.compile(r"&(amp|quot);")


def unescape_attr(value: str) -> str:
    # One pass, so "&amp;quot;" comes back as "&quot;" and not as '"'.
    return _UNESCAPE.sub(lambda m: "&" if m.group(1) == "amp" else '"', value)


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


def compact_json(value: Any) -> str:
    """Compact, key-sorted JSON: the tool-declaration body."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def arg_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    raise ChatFormatError(f"tool argument value {value!r} is not JSON")


def arg_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


TOOL_DECLARE_HEAD = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
TOOL_DECLARE_TAIL = "\n```"


# A system message carrying `tools` extends the toolset mid-conversation (the reference's
# "dynamic" declaration); its content, if any, is not rendered.
DYNAMIC_TOOLS_HEAD = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n"
)


def tool_declare_body(tools: list, *, dynamic: bool = False) -> str:
    return f"{DYNAMIC_TOOLS_HEAD if dynamic else TOOL_DECLARE_HEAD}{compact_json(tools)}{TOOL_DECLARE_TAIL}"


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


def _call_parts(call: Any, where: str) -> tuple[str, dict | None, str | None]:
    """(name, arguments dict, raw argument text when the arguments are not a JSON object)."""
    if not isinstance(call, dict):
        raise ChatFormatError(f"{where}: a tool call must be an object")
    fn = call.get("function", call)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise ChatFormatError(f"{where}: tool call without a function name")
    args = fn.get("arguments", {})
    if args is None:
        return name, {}, None
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string
        if not args.strip():
            return name, {}, None
        try:
            parsed = json.loads(args)
        except ValueError:
            return name, None, args  # rendered verbatim in a json block, as the reference does
        if not isinstance(parsed, dict):
            raise ChatFormatError(f"{where}: tool call arguments must be a JSON object")
        return name, parsed, None
    if isinstance(args, dict):
        return name, args, None
    raise ChatFormatError(f"{where}: tool call arguments must be an object or a JSON string")


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
        name, args, raw = _call_parts(call, f"{where}, tool call {index}")
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
) -> list[Segment]:
    """The XTML segments of a conversation, ending with the generation prompt.

    thinking_effort defaults to none here, as in the reference's segment builder; its
    `apply_chat_template` passes "max" unless told otherwise, which callers get from
    `ChatProfile` (what the model's tree says it was trained with)."""
    out: list[Segment] = []
    if tools:
        if not isinstance(tools, list):
            raise ChatFormatError("tools must be a list")
        _message(out, [("role", "system"), ("type", "tool-declare")], tool_declare_body(tools))
    if thinking and thinking_effort is not None:
        if thinking_effort not in THINKING_EFFORTS:
            raise ChatFormatError(f"thinking effort {thinking_effort!r} is not one of {', '.join(THINKING_EFFORTS)}")
        _internal_system(
            out,
            "thinking-effort",
            "`thinking_effort` guides on how much to think in your thinking channel (not including the "
            "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={thinking_effort}`.",
        )
    last_calls: list = []
    tool_index = 0  # tool results since the last assistant message: the rendered `index`
    for i, msg, call_name in _in_render_order(messages):
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
            name = call_name or _tool_result_name(msg, last_calls, tool_index, where)
            _message(out, [("role", "tool"), ("tool", name), ("index", tool_index)], msg.get("content"), where)
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
    _response_format(out, response_format)
    if add_generation_prompt:
        _open(out, "message", [("role", "assistant")])
        _open(out, "think" if thinking else "response")
    return out


def _call_names_by_id(calls: Any) -> dict[str, tuple[int, str | None]]:
    """An assistant's tool calls: id -> (1-based position, function name); the first of a repeated id wins."""
    by_id: dict[str, tuple[int, str | None]] = {}
    for pos, call in enumerate(calls if isinstance(calls, list) else [], start=1):
        if isinstance(call, dict) and call.get("id") is not None:
            fn = call.get("function", call)
            by_id.setdefault(str(call["id"]), (pos, fn.get("name") if isinstance(fn, dict) else None))
    return by_id


def _in_render_order(messages: list) -> list[tuple[int, dict, str | None]]:
    """(index, message, tool name of its matched call) in render order.

    Each run of tool results is sorted into the preceding assistant's tool_calls order by
    tool_call_id, and the matched call names the tool (a stale `name` on the result must not
    disagree with the position it is rendered at). A run where some result carries no id stays
    in arrival order, named by `tool`/`name` or by position, as the reference leaves it."""
    if not isinstance(messages, list):
        raise ChatFormatError("messages must be a list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ChatFormatError(f"message {i}: must be an object")
        if msg.get("role") not in ROLES:
            raise ChatFormatError(f"message {i}: role {msg.get('role')!r} is not one of {', '.join(ROLES)}")
    out: list[tuple[int, dict, str | None]] = []
    by_id: dict[str, tuple[int, str | None]] = {}
    i = 0
    while i < len(messages):
        if messages[i]["role"] != "tool":
            if messages[i]["role"] == "assistant":
                by_id = _call_names_by_id(messages[i].get("tool_calls"))
            out.append((i, messages[i], None))
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        run = list(range(i, j))
        ids = [messages[k].get("tool_call_id", messages[k].get("id")) for k in run]
        for k, cid in zip(run, ids):
            if cid is not None and str(cid) not in by_id:
                field_name = "tool_call_id" if "tool_call_id" in messages[k] else "id"
                raise ChatFormatError(
                    f"message {k}: {field_name} {cid!r} matches no tool call of the preceding assistant message"
                )
        if any(cid is None for cid in ids):
            out += [(k, messages[k], None) for k in run]
        else:
            ordered = sorted(zip(run, ids), key=lambda kc: by_id[str(kc[1])][0])  # stable: ties keep arrival order
            out += [(k, messages[k], by_id[str(cid)][1]) for k, cid in ordered]
        i = j
    return out


def _tool_result_name(msg: dict, calls: list, index: int, where: str) -> str:
    """A result without a matched call: its own `tool`/`name`, else the call at its position."""
    name = msg.get("tool") or msg.get("name")
    if not name and 0 < index <= len(calls) and isinstance(calls[index - 1], dict):
        fn = calls[index - 1].get("function", calls[index - 1])
        name = fn.get("name") if isinstance(fn, dict) else None
    if not name:
        raise ChatFormatError(f"{where}: tool result without a tool name (give `name` or a matching tool_call_id)")
    return str(name)


def render_text(segments: Iterable[Segment]) -> str:
    return "".join(s.text for s in segments)


def encode_segments(tok: Tokenizer, segments: Iterable[Segment]) -> list[int]:
    ids: list[int] = []
    for s in segments:
        ids.extend(tok.encode_special(s.text) if s.special else tok.encode(s.text))
    return ids


def encode_chat(tok: Tokenizer, messages: list[dict], tools: list | None = None, **kw: Any) -> list[int]:
    return encode_segments(tok, render(messages, tools, **kw))


# ---- what a model's tree says about its chat framing ----------------------------------------

PROFILE_FILE = "tokenizer_config.json"
PROFILE_KEY = "streamrt_chat"


@dataclass(frozen=True)
class ChatProfile:
    """The framing defaults a model was trained with, from its tree's `tokenizer_config.json`.

    Without a `streamrt_chat` key (a real K3 tree) they are the reference's: Moonshot's
    `apply_chat_template` renders a `thinking_effort=max` message, and conversations have any
    number of turns. A tree says otherwise with `"streamrt_chat": {"thinking_effort": null,
    "multi_turn": false}` (the embedded model: trained without the message, on one exchange
    per conversation)."""

    thinking_effort: str | None = "max"
    multi_turn: bool = True

    @classmethod
    def from_tree(cls, root: str | Path) -> "ChatProfile":
        path = Path(root) / PROFILE_FILE
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ChatFormatError(f"{path}: not a JSON file ({exc})") from None
        spec = data.get(PROFILE_KEY, {}) if isinstance(data, dict) else {}
        if not isinstance(spec, dict):
            raise ChatFormatError(f"{path}: {PROFILE_KEY} must be an object")
        unknown = sorted(set(spec) - {"thinking_effort", "multi_turn"})
        if unknown:
            raise ChatFormatError(f"{path}: {PROFILE_KEY}.{unknown[0]} is not a known key (thinking_effort, multi_turn)")
        effort = spec.get("thinking_effort", cls.thinking_effort)
        if effort is not None and effort not in THINKING_EFFORTS:
            raise ChatFormatError(f"{path}: {PROFILE_KEY}.thinking_effort {effort!r} is not null or one of {', '.join(THINKING_EFFORTS)}")
        multi = spec.get("multi_turn", cls.multi_turn)
        if not isinstance(multi, bool):
            raise ChatFormatError(f"{path}: {PROFILE_KEY}.multi_turn must be true or false")
        return cls(effort, multi)


# ---- parsing ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MessageStart:
    role: str | None
    attrs: dict


@dataclass(frozen=True)
class ThinkText:
    text: str


@dataclass(frozen=True)
class ResponseText:
    text: str


@dataclass(frozen=True)
class ContentText:
    """Body text of a system, user or tool message."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    name: str
    index: int
    arguments: dict

    def to_openai(self, call_id: str | None = None) -> dict:
        return {
            "id": call_id or f"call_{self.index}",
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


@dataclass(frozen=True)
class EndOfMessage:
    role: str | None


@dataclass(frozen=True)
class ParseError:
    message: str


Event = MessageStart | ThinkText | ResponseText | ContentText | ToolCall | EndOfMessage | ParseError

_CHILDREN = {None: {"message"}, "message": {"think", "response", "tools"}, "tools": {"call"}, "call": {"argument", "json"}}
_OPEN_TAG = re.compile(r'\A([A-Za-z_][\w-]*)((?:\s+[\w-]+="[^"]*")*)\s*\Z')
_ATTR = re.compile(r'([\w-]+)="([^"]*)"')
_MAX_TAG_BYTES = 4096


@dataclass
class _Frame:
    tag: str
    attrs: dict
    ok: bool = True  # False: the frame is malformed and its payload is dropped
    role: str | None = None
    decoder: Any = None
    raw: bytearray = field(default_factory=bytearray)
    args: dict = field(default_factory=dict)
    stray_reported: bool = False


class ChatParser:
    """Incremental XTML parser over token ids. `feed(id)` and `finish()` return event lists."""

    def __init__(self, tok: Tokenizer, *, open_frames: Iterable[tuple[str, dict]] = ()):
        self._tok = tok
        self._sp = {name: tok.special_id(name) for name in (OPEN, CLOSE, SEP, END_OF_MSG)}
        self._enders = set(tok.stop_ids) | {self._sp[END_OF_MSG]}
        self._stack: list[_Frame] = []
        self._mode = "body"  # or "open" / "close": inside a tag, collecting its text until <|sep|>
        self._tag = bytearray()
        self._top_stray = False
        self._closed_message = False  # a message was closed; its <|end_of_msg|> is expected
        for tag, attrs in open_frames:
            self._stack.append(self._new_frame(tag, dict(attrs), []))

    @classmethod
    def for_generation(cls, tok: Tokenizer, *, thinking: bool = True) -> "ChatParser":
        """A parser positioned after the generation prompt (inside the assistant's think/response)."""
        return cls(tok, open_frames=[("message", {"role": "assistant"}), ("think" if thinking else "response", {})])

    # ---- public ---------------------------------------------------------------------------

    def feed(self, token_id: int) -> list[Event]:
        events: list[Event] = []
        try:
            self._feed(int(token_id), events)
        except Exception as exc:  # defensive: a parser bug must not kill a stream
            events.append(ParseError(f"internal parser error ({type(exc).__name__}: {exc}); state reset"))
            self._stack.clear()
            self._mode = "body"
            self._tag.clear()
        return events

    def feed_many(self, ids: Iterable[int]) -> list[Event]:
        events: list[Event] = []
        for i in ids:
            events.extend(self.feed(i))
        return events

    def finish(self) -> list[Event]:
        """End of stream: reports a truncated tag or frame."""
        events: list[Event] = []
        try:
            if self._mode != "body":
                events.append(ParseError(f"stream ended inside a tag: {self._tag_text()!r}"))
                self._mode = "body"
                self._tag.clear()
            if self._stack:
                events.append(ParseError(f"stream ended with {self._open_path()} still open"))
                while self._stack:
                    self._pop(events, properly=False)
        except Exception as exc:
            events.append(ParseError(f"internal parser error ({type(exc).__name__}: {exc})"))
            self._stack.clear()
        return events

    @property
    def in_message(self) -> bool:
        return bool(self._stack)

    # ---- internals ------------------------------------------------------------------------

    def _open_path(self) -> str:
        return "".join(f"<{f.tag}>" for f in self._stack)

    def _tag_text(self) -> str:
        return bytes(self._tag).decode("utf-8", errors="replace")

    def _feed(self, t: int, ev: list[Event]) -> None:
        tok = self._tok
        if not 0 <= t < tok.vocab_size:
            ev.append(ParseError(f"token id {t} is outside the vocabulary"))
            return
        if self._mode != "body":
            if t == self._sp[SEP]:
                text, mode = self._tag_text(), self._mode
                self._mode = "body"
                self._tag.clear()
                (self._finish_open if mode == "open" else self._finish_close)(text, ev)
                return
            if not tok.is_special(t):
                self._tag.extend(tok.token_bytes(t))
                if len(self._tag) > _MAX_TAG_BYTES:
                    ev.append(ParseError(f"tag longer than {_MAX_TAG_BYTES} bytes"))
                    self._mode = "body"
                    self._tag.clear()
                return
            ev.append(ParseError(f"tag {self._tag_text()!r} interrupted by {tok.special_name(t)}"))
            self._mode = "body"
            self._tag.clear()  # then handle the special afresh
        if t == self._sp[OPEN]:
            self._mode = "open"
        elif t == self._sp[CLOSE]:
            self._mode = "close"
        elif t in self._enders:
            self._end_message(t, ev)
        elif tok.is_special(t):
            ev.append(ParseError(f"unexpected special token {tok.special_name(t)}"))
        else:
            self._content(tok.token_bytes(t), ev)

    def _new_frame(self, tag: str, attrs: dict, ev: list[Event]) -> _Frame:
        parent = self._stack[-1] if self._stack else None
        f = _Frame(tag, attrs)
        allowed = _CHILDREN.get(parent.tag if parent else None, set())
        if parent is not None and parent.tag == "message" and parent.role != "assistant":
            allowed = set()
        if tag not in allowed or (parent is not None and not parent.ok):
            where = f"inside <{parent.tag}>" if parent else "at top level"
            if parent is None or parent.ok:
                ev.append(ParseError(f"unexpected <{tag}> {where}"))
            f.ok = False
            return f
        if tag == "message":
            f.role = attrs.get("role")
            if f.role not in ROLES:
                ev.append(ParseError(f"message with role {f.role!r}"))
            ev.append(MessageStart(f.role, dict(attrs)))
            if f.role != "assistant":
                f.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        elif tag in ("think", "response"):
            f.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        elif tag == "call":
            name, index = attrs.get("tool"), attrs.get("index", "")
            if not name or not index.isdigit():
                ev.append(ParseError(f"tool call with tool={name!r} index={index!r}"))
                f.ok = False
        elif tag == "argument":
            if "key" not in attrs or attrs.get("type") not in ARG_TYPES:
                ev.append(ParseError(f"argument with key={attrs.get('key')!r} type={attrs.get('type')!r}"))
                f.ok = False
                parent.ok = False
        return f

    def _finish_open(self, text: str, ev: list[Event]) -> None:
        m = _OPEN_TAG.match(text)
        if not m:
            ev.append(ParseError(f"malformed open tag {text!r}"))
            if self._stack and self._stack[-1].tag in ("tools", "call", "argument", "json"):
                self._stack[-1].ok = False  # a call with a lost argument must not be emitted
            return
        attrs = {k: unescape_attr(v) for k, v in _ATTR.findall(m.group(2))}
        self._closed_message = False
        self._stack.append(self._new_frame(m.group(1), attrs, ev))

    def _finish_close(self, text: str, ev: list[Event]) -> None:
        name = text.strip()
        tags = [f.tag for f in self._stack]
        if name not in tags:
            ev.append(ParseError(f"close </{name}> with {self._open_path() or 'nothing'} open"))
            return
        if tags[-1] != name:
            ev.append(ParseError(f"</{name}> closes {self._open_path()}: inner frames truncated"))
            while self._stack[-1].tag != name:
                self._pop(ev, properly=False)
        self._pop(ev, properly=True)

    def _pop(self, ev: list[Event], *, properly: bool) -> None:
        f = self._stack.pop()
        parent = self._stack[-1] if self._stack else None
        if f.decoder is not None:
            self._emit_text(f, f.decoder.decode(b"", final=True), ev)
        if f.tag == "argument" and parent is not None and f.ok:
            if not properly:
                parent.ok = False
                return
            key = f.attrs["key"]
            try:
                value = typed_value(f.attrs["type"], bytes(f.raw).decode("utf-8", errors="replace"))
            except ValueError as exc:
                ev.append(ParseError(f"argument {key!r} of tool call {parent.attrs.get('tool')!r}: {exc}"))
                parent.ok = False
                return
            if key in parent.args:
                ev.append(ParseError(f"argument {key!r} repeated in tool call {parent.attrs.get('tool')!r}"))
                parent.ok = False
            parent.args[key] = value
        elif f.tag == "json" and parent is not None and f.ok:
            try:
                value = typed_value("object", bytes(f.raw).decode("utf-8", errors="replace")) if properly else None
            except ValueError as exc:
                ev.append(ParseError(f"json arguments of tool call {parent.attrs.get('tool')!r}: {exc}"))
                value = None
            if value is None:
                parent.ok = False
            else:
                parent.args.update(value)
        elif f.tag == "call" and f.ok:
            if properly:
                ev.append(ToolCall(f.attrs["tool"], int(f.attrs["index"]), dict(f.args)))
            else:
                ev.append(ParseError(f"tool call {f.attrs['tool']!r} truncated; dropped"))
        elif f.tag == "message" and properly:
            ev.append(EndOfMessage(f.role))
            self._closed_message = True

    def _end_message(self, t: int, ev: list[Event]) -> None:
        if self._stack:
            ev.append(ParseError(f"{self._tok.special_name(t)} with {self._open_path()} still open"))
            role = self._stack[0].role
            while self._stack:
                self._pop(ev, properly=False)
            ev.append(EndOfMessage(role))
        elif not self._closed_message:
            ev.append(ParseError(f"{self._tok.special_name(t)} outside a message"))
        self._closed_message = False
        self._top_stray = False

    def _content(self, data: bytes, ev: list[Event]) -> None:
        f = self._stack[-1] if self._stack else None
        if f is None:
            if data.strip() and not self._top_stray:
                ev.append(ParseError("text outside a message"))
                self._top_stray = True
            return
        if not f.ok:
            return
        if f.decoder is not None:
            self._emit_text(f, f.decoder.decode(data), ev)
        elif f.tag in ("argument", "json"):
            f.raw.extend(data)
        elif data.strip() and not f.stray_reported:
            ev.append(ParseError(f"text directly inside <{f.tag}>"))
            f.stray_reported = True

    def _emit_text(self, f: _Frame, text: str, ev: list[Event]) -> None:
        if not text:
            return
        if f.tag == "think":
            ev.append(ThinkText(text))
        elif f.tag == "response":
            ev.append(ResponseText(text))
        else:
            ev.append(ContentText(text))


def typed_value(kind: str, raw: str) -> Any:
    """An argument's value from its text and declared type; ValueError when they disagree."""
    if kind == "string":
        return raw
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"value {raw[:40]!r} is not JSON ({exc.__class__.__name__})") from None
    ok = {
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
    }.get(kind, False)
    if not ok:
        raise ValueError(f"value {raw[:40]!r} is not of type {kind}")
    return value


# ---- events -> messages ---------------------------------------------------------------------


@dataclass
class Reply:
    """An assistant reply assembled from generation events."""

    thinking: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ended: bool = False
    truncated: bool = False  # generation hit its token limit before the message closed

    def add(self, event: Event) -> None:
        if isinstance(event, ThinkText):
            self.thinking += event.text
        elif isinstance(event, (ResponseText, ContentText)):
            self.content += event.text
        elif isinstance(event, ToolCall):
            self.tool_calls.append(event)
        elif isinstance(event, ParseError):
            self.errors.append(event.message)
        elif isinstance(event, EndOfMessage):
            self.ended = True

    def to_message(self) -> dict:
        """The OpenAI-style assistant message, for the chat history."""
        msg: dict = {"role": "assistant", "content": self.content}
        if self.thinking:
            msg["reasoning_content"] = self.thinking
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


def parse_conversation(tok: Tokenizer, ids: Iterable[int]) -> tuple[list[dict], list | None, list[str]]:
    """(messages, tools, parse errors) from rendered ids: the inverse of `encode_chat`."""
    parser = ChatParser(tok)
    events = parser.feed_many(ids) + parser.finish()
    messages: list[dict] = []
    tools = None
    errors: list[str] = []
    cur: dict | None = None
    for e in events:
        if isinstance(e, MessageStart):
            cur = {"role": e.role, **{k: v for k, v in e.attrs.items() if k != "role"}}
            messages.append(cur)
            if cur["role"] == "assistant":
                cur["content"] = ""
            continue
        if isinstance(e, ParseError):
            errors.append(e.message)
            continue
        if cur is None:
            continue
        if isinstance(e, ThinkText):
            cur["reasoning_content"] = cur.get("reasoning_content", "") + e.text
        elif isinstance(e, (ResponseText, ContentText)):
            cur["content"] = cur.get("content", "") + e.text
        elif isinstance(e, ToolCall):
            cur.setdefault("tool_calls", []).append({"function": {"name": e.name, "arguments": e.arguments}})
        elif isinstance(e, EndOfMessage):
            if cur.get("type") == "tool-declare":
                body = cur.get("content", "")
                for head, dynamic in ((TOOL_DECLARE_HEAD, False), (DYNAMIC_TOOLS_HEAD, True)):
                    if body.startswith(head) and body.endswith(TOOL_DECLARE_TAIL):
                        declared = _json_or_none(body[len(head) : -len(TOOL_DECLARE_TAIL)])
                        if declared is None:
                            errors.append("tool-declare message whose JSON does not parse")
                        elif dynamic:  # back to the system message it came from
                            cur.clear()
                            cur.update({"role": "system", "tools": declared})
                        else:
                            tools = declared
                            messages.remove(cur)
                        break
            cur = None
    return messages, tools, errors


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


# ---- OpenAI-style input ---------------------------------------------------------------------


def load_messages_file(path: str | Path) -> tuple[list[dict], list | None]:
    """`--messages FILE.json`: a list of messages, or {"messages": [...], "tools": [...]}."""
    p = Path(path)
    if not p.is_file():
        raise ChatFormatError(f"{p}: no such messages file")
    data = load_json(p, what="messages file", expect=(list, dict), max_bytes=64 << 20, error=ChatFormatError)
    tools = None
    if isinstance(data, dict):
        messages, tools = data.get("messages"), data.get("tools")
    else:
        messages = data
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError(f"{p}: expected a non-empty list of messages (or an object with \"messages\")")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ChatFormatError(f"{p}: \"tools\" must be a list of objects")
    try:
        render(messages, tools)  # validate every message now, naming the file
    except ChatFormatError as exc:
        raise ChatFormatError(f"{p}: {exc}") from None
    return messages, tools or None
