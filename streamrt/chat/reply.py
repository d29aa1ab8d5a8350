"""Events back into messages: `Reply` (one generated assistant message) and
`parse_conversation` (a whole rendered conversation, the inverse of `encode_chat`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from streamrt.chat.events import (ContentText, EndOfMessage, Event, MessageStart, ParseError, ResponseText,
                                  ThinkText, ToolCall)
from streamrt.chat.parser import ChatParser
from streamrt.chat.xtml import DYNAMIC_TOOLS_HEAD, TOOL_DECLARE_HEAD, TOOL_DECLARE_TAIL
from streamrt.jsonio import loads_text
from streamrt.tokenizer import Tokenizer


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
        return loads_text(text)
    except ValueError:
        return None
