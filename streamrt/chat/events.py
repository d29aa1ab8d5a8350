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
class EndOfMessage:
    role: str | None


@dataclass(frozen=True)
class ParseError:
    message: str


Event = MessageStart | ThinkText | ResponseText | ContentText | ToolCall | EndOfMessage | ParseError
