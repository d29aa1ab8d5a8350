"""`--messages FILE.json`: OpenAI-style input from a file, checked by the server's own request
model (`ChatPrompt`: one set of rules for a file and a request), then by rendering it."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from streamrt.chat.render import render
from streamrt.chat.xtml import ChatFormatError
from streamrt.jsonio import load_json


def load_messages_file(path: str | Path) -> tuple[list[dict], list | None]:
    """`--messages FILE.json`: a list of messages, or {"messages": [...], "tools": [...]}."""
    # (streamrt.serve imports the session, which imports chat)
    from streamrt.serve.schemas import ChatPrompt, first_error

    p = Path(path)
    if not p.exists():
        raise ChatFormatError(f"{p}: no such messages file")
    if not p.is_file():
        raise ChatFormatError(f"{p}: not a regular file; give a FILE.json of messages")
    data = load_json(p, what="messages file", expect=(list, dict), max_bytes=64 << 20, error=ChatFormatError)
    if isinstance(data, list):
        data = {"messages": data}
    # the rest of a request (sampling, tool_choice, ...) comes from the flags or the server: a
    # file that carries it (a saved request body) is refused rather than half followed
    if unread := [k for k in data if k not in ChatPrompt.model_fields]:
        raise ChatFormatError(f"{p}: {unread[0]!r} is not read from a messages file (it holds only "
                              f"{' and '.join(ChatPrompt.model_fields)}; sampling is given by flags)")
    _check_unicode(p, data, "")
    try:
        ChatPrompt.model_validate(data)
    except ValidationError as exc:
        field, msg, kind = first_error(exc)
        raise ChatFormatError(f"{p}: missing {field}" if kind == "missing" else f"{p}: {field}: {msg}") from None
    # developer messages are system messages, as the server renders them
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in data["messages"]]
    tools = data.get("tools")
    try:
        render(messages, tools)  # the template's own rules, naming the file
    except ChatFormatError as exc:
        raise ChatFormatError(f"{p}: {exc}") from None
    return messages, tools or None


def _check_unicode(p: Path, value, where: str) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ChatFormatError(f"{p}: {where or 'a string'}: not valid Unicode (lone surrogate "
                                  f"\\u{ord(value[e.start]):04x} at position {e.start})") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(p, k, f"{where} key" if where else "a key")
            _check_unicode(p, v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_unicode(p, v, f"{where}[{i}]")
