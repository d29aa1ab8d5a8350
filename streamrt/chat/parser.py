"""`ChatParser`: incremental over token ids and total. Any id sequence yields events; a malformed
or truncated frame yields `ParseError` events, never an exception."""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from streamrt.chat.events import (ArgumentOpen, ArgumentText, ArgumentValue, CallOpen, ContentText, EndOfMessage,
                                  Event, MessageStart, ParseError, ResponseText, ThinkText, ToolCall)
from streamrt.chat.tools import typed_value
from streamrt.chat.xtml import ARG_TYPES, CLOSE, END_OF_MSG, OPEN, ROLES, SEP, unescape_attr
from streamrt.tokenizer import Tokenizer


_CHILDREN = {
    None: {"message"},
    "message": {"think", "response", "tools"},
    "tools": {"call"},
    "call": {"argument", "json"},
}
_OPEN_TAG = re.compile(r'\A([A-Za-z_][\w-]*)((?:\s+[\w-]+="[^"]*")*)\s*\Z')
_ATTR = re.compile(r'([\w-]+)="([^"]*)"')
_MAX_TAG_BYTES = 4096
_MAX_DEPTH = 16  # the format nests 4 frames; a deeper open is refused, so each step's work stays bounded


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
    """Incremental XTML parser over token ids. `feed(id)` and `finish()` return event lists.

    With `stream_calls`, a tool call is also reported as it is written: `CallOpen` once its
    name is known, `ArgumentOpen`, `ArgumentText` (string arguments, as decoded) and
    `ArgumentValue` per argument; `ToolCall` still closes it."""

    def __init__(self, tok: Tokenizer, *, open_frames: Iterable[tuple[str, dict]] = (), stream_calls: bool = False):
        self._tok = tok
        self._stream_calls = stream_calls
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
    def for_generation(cls, tok: Tokenizer, *, thinking: bool = True, stream_calls: bool = False) -> "ChatParser":
        """A parser positioned after the generation prompt (inside the assistant's think/response)."""
        return cls(tok, open_frames=[("message", {"role": "assistant"}), ("think" if thinking else "response", {})],
                   stream_calls=stream_calls)

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
            if not name or not (index.isascii() and index.isdigit()):  # '²' is a digit to isdigit, not to int
                ev.append(ParseError(f"tool call with tool={name!r} index={index!r}"))
                f.ok = False
            elif self._stream_calls:
                ev.append(CallOpen(name, int(index)))
        elif tag == "argument":
            if "key" not in attrs or attrs.get("type") not in ARG_TYPES:
                ev.append(ParseError(f"argument with key={attrs.get('key')!r} type={attrs.get('type')!r}"))
                f.ok = False
                parent.ok = False
            elif self._stream_calls:
                ev.append(ArgumentOpen(attrs["key"], attrs["type"]))
                if attrs["type"] == "string":
                    f.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return f

    def _finish_open(self, text: str, ev: list[Event]) -> None:
        m = _OPEN_TAG.match(text)
        if not m:
            ev.append(ParseError(f"malformed open tag {text!r}"))
            if self._stack and self._stack[-1].tag in ("tools", "call", "argument", "json"):
                self._stack[-1].ok = False  # a call with a lost argument must not be emitted
            return
        if len(self._stack) >= _MAX_DEPTH:
            ev.append(ParseError(f"<{m.group(1)}> nested deeper than {_MAX_DEPTH} frames; ignored"))
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
            if self._stream_calls:
                ev.append(ArgumentValue(key, f.attrs["type"], value))
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
                if self._stream_calls:
                    ev.append(ArgumentValue(None, "object", value))
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
        if f.tag in ("argument", "json"):
            f.raw.extend(data)
            if f.decoder is not None:  # a string argument of a `stream_calls` parser
                self._emit_text(f, f.decoder.decode(data), ev)
        elif f.decoder is not None:
            self._emit_text(f, f.decoder.decode(data), ev)
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
        elif f.tag == "argument":
            ev.append(ArgumentText(text))
        else:
            ev.append(ContentText(text))
