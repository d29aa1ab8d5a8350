"""What the parser yields: one small frozen dataclass per event, and `Event`, their union."""

from __future__ import annotations

from dataclasses import dataclass

from streamrt.jsonio import dumps_text


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
            "function": {"name": self.name, "arguments": dumps_text(self.arguments)},
        }


@dataclass(frozen=True)
class CallOpen:
    """A tool call's frame opened (its name is known); `stream_calls` parsers only."""

    name: str
    index: int


@dataclass(frozen=True)
class ArgumentOpen:
    """An argument frame of a call opened; `stream_calls` parsers only."""

    key: str
    type: str


@dataclass(frozen=True)
class ArgumentText:
    """Text of a string argument as it is written; `stream_calls` parsers only."""

    text: str


@dataclass(frozen=True)
class ArgumentValue:
    """An argument frame closed with a value of its type (a json frame: key None, an object
    of arguments); `stream_calls` parsers only."""

    key: str | None
    type: str
    value: object


@dataclass(frozen=True)
class EndOfMessage:
    role: str | None


@dataclass(frozen=True)
class ParseError:
    message: str


Event = (MessageStart | ThinkText | ResponseText | ContentText | ToolCall | EndOfMessage | ParseError | CallOpen
         | ArgumentOpen | ArgumentText | ArgumentValue)
