"""`--messages FILE.json`: OpenAI-style input from a file, validated by rendering it."""

from __future__ import annotations

from pathlib import Path

from streamrt.chat.render import render
from streamrt.chat.xtml import ChatFormatError
from streamrt.jsonio import load_json


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
