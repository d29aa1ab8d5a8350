"""Generated token ids -> the pieces of an OpenAI reply, through our XTML parser.

`ChatReply` feeds each id to `ChatParser` and turns its events into pieces: think text as
reasoning, response text as content (cut at the first stop string), and tool calls as they
are written: a "call" piece (id `functions.NAME:IDX`, IDX counting the conversation's calls
from 0 as Kimi's own ids do, and the name) as soon as the call's frame opens, "arguments"
pieces that concatenate to its arguments' JSON string (a string argument streams as it is
written, a typed one when its frame closes), and "call_end" when it closes. A call cut off
mid-way (by max_tokens, or a malformed frame) leaves what was streamed; `calls` holds only
the closed ones. Markup never reaches the text. `TextReply` is the raw-text twin for
/v1/completions.

tool_choice (what is enforced, and how): `none` and `required` are rendered by the
template's tool-choice system message; a named function declares only that tool, plus
`required`. The model is prompted, not constrained: calls it makes under `none`, or to a
function other than the named one, are dropped from the reply; a reply that makes no call
when one was required keeps finish_reason "stop" and is counted in
`streamrt_tool_choice_unmet` (the server does not invent a call).
"""

from __future__ import annotations

from dataclasses import dataclass

import json

from streamrt.chat import (ArgumentOpen, ArgumentText, ArgumentValue, CallOpen, ChatParser, EndOfMessage, ParseError,
                           ResponseText, ThinkText, ToolCall)
from streamrt.jsonio import dumps_text


@dataclass(frozen=True)
class Piece:
    kind: str  # "reasoning" | "content" | "call" | "arguments" | "call_end"
    text: str = ""  # the text, or the arguments' next fragment
    call: dict | None = None  # {"index", "id", "name", "arguments"}: the call (as far as written)


class StopMatcher:
    """Releases text up to the first stop string, holding back a tail that could begin one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.hit = False
        self.matched: str | None = None  # the stop string hit

    def feed(self, text: str) -> str:
        if self.hit:
            return ""
        if not self.stops:
            return text
        self.buf += text
        found = [(i, s) for s in self.stops if (i := self.buf.find(s)) >= 0]
        if found:
            cut, self.matched = min(found)
            out, self.buf, self.hit = self.buf[:cut], "", True
            return out
        keep = 0
        for k in range(1, min(len(self.buf), max(map(len, self.stops)) - 1) + 1):
            if any(s.startswith(self.buf[-k:]) for s in self.stops):
                keep = k
        out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.hit else self.buf), ""
        return out


class ChatReply:
    def __init__(self, tok, *, thinking: bool, stops: list[str], call_base: int = 0,
                 allowed: set[str] | None = None, required: bool = False):
        self.parser = ChatParser.for_generation(tok, thinking=thinking, stream_calls=True)
        self.stop = StopMatcher(stops)
        self.call_base = call_base
        self.allowed = allowed  # None: any declared tool; empty set: no calls (tool_choice none)
        self.required = required
        self.reasoning, self.content, self.calls, self.errors = "", "", [], []
        self.opened = 0  # calls streamed (closed or not): the next call's index
        self.call: dict | None = None  # the call being written, None outside one (or in a dropped one)
        self.items = 0  # arguments of self.call written so far
        self.ended = False

    @property
    def stopped(self) -> bool:
        """A stop string was hit: no more tokens are needed."""
        return self.stop.hit

    def feed(self, token: int) -> list[Piece]:
        return self._pieces(self.parser.feed(token))

    def finish(self, reason: str) -> list[Piece]:
        """End of generation ("stop" or "length"): the parser's tail and the held-back text."""
        tail = [] if self.ended else self.parser.finish()
        if reason == "length":
            tail = [e for e in tail if not isinstance(e, ParseError)]  # an open frame at the limit is expected
        pieces = self._pieces(tail)
        rest = self.stop.flush()
        if rest:
            self.content += rest
            pieces.append(Piece("content", rest))
        return pieces

    def finish_reason(self, reason: str) -> str:
        if self.calls:
            return "tool_calls"
        return "stop" if self.stopped else reason

    @property
    def unmet(self) -> bool:
        return self.required and not self.calls

    def _pieces(self, events) -> list[Piece]:
        out: list[Piece] = []
        for e in events:
            if isinstance(e, ThinkText):
                self.reasoning += e.text
                out.append(Piece("reasoning", e.text))
            elif isinstance(e, ResponseText):
                text = self.stop.feed(e.text)
                if text:
                    self.content += text
                    out.append(Piece("content", text))
            elif isinstance(e, (CallOpen, ArgumentOpen, ArgumentText, ArgumentValue, ToolCall)):
                self._call_event(e, out)
            elif isinstance(e, ParseError):
                self.errors.append(e.message)
            elif isinstance(e, EndOfMessage):
                self.ended = True
        return out

    def _call_event(self, e, out: list[Piece]) -> None:
        if isinstance(e, CallOpen):
            self.call = None
            if self.allowed is not None and e.name not in self.allowed:
                return  # dropped: tool_choice none, or not the named function
            n = self.opened
            self.opened, self.items = n + 1, 0
            self.call = {"index": n, "id": f"functions.{e.name}:{self.call_base + n}", "name": e.name,
                         "arguments": ""}
            out.append(Piece("call", call=dict(self.call)))
            return
        if self.call is None:
            return
        if isinstance(e, ArgumentOpen):
            if e.type == "string":  # the value streams as it is written, inside quotes
                self._arguments(self._item(e.key) + '"', out)
        elif isinstance(e, ArgumentText):
            self._arguments(json.dumps(e.text, ensure_ascii=False)[1:-1], out)
        elif isinstance(e, ArgumentValue):
            if e.type == "string" and e.key is not None:
                self._arguments('"', out)
            else:
                pairs = e.value.items() if e.key is None else [(e.key, e.value)]
                self._arguments("".join(self._item(k) + dumps_text(v) for k, v in pairs), out)
        elif isinstance(e, ToolCall):
            self._arguments("}" if self.items else "{}", out)
            self.calls.append(self.call)
            out.append(Piece("call_end", call=dict(self.call)))
            self.call = None

    def _item(self, key: str) -> str:
        self.items += 1
        return ("{" if self.items == 1 else ", ") + dumps_text(key) + ": "

    def _arguments(self, text: str, out: list[Piece]) -> None:
        if text:
            self.call["arguments"] += text
            out.append(Piece("arguments", text, call=self.call))


class TextReply:
    """Raw text of /v1/completions: bytes decoded incrementally, specials not shown."""

    def __init__(self, tok, *, stops: list[str]):
        self.decoder = tok.stream_decoder(show_special=False)
        self.stop = StopMatcher(stops)
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self.stop.hit

    def feed(self, token: int) -> str:
        out = self.stop.feed(self.decoder.feed(token))
        self.text += out
        return out

    def finish(self) -> str:
        out = self.stop.feed(self.decoder.flush()) + self.stop.flush()
        self.text += out
        return out

    def finish_reason(self, reason: str) -> str:
        return "stop" if self.stopped else reason


