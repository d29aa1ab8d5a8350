"""Tool calls both ways: a call's name and arguments as a request carries them, each argument's
XTML type and text, an argument's value back from its text, and tool results put in their
calls' order and named (as the reference encoder does)."""

from __future__ import annotations

from typing import Any

from streamrt.chat.xtml import ROLES, ChatFormatError
from streamrt.jsonio import dumps_text, loads_text


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
    return value if isinstance(value, str) else dumps_text(value)


def call_parts(call: Any, where: str) -> tuple[str, dict | None, str | None]:
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
            parsed = loads_text(args)
        except ValueError:
            return name, None, args  # rendered verbatim in a json block, as the reference does
        if not isinstance(parsed, dict):
            raise ChatFormatError(f"{where}: tool call arguments must be a JSON object")
        return name, parsed, None
    if isinstance(args, dict):
        return name, args, None
    raise ChatFormatError(f"{where}: tool call arguments must be an object or a JSON string")


def _call_names_by_id(calls: Any) -> dict[str, tuple[int, str | None]]:
    """An assistant's tool calls: id -> (1-based position, function name); the first of a repeated id wins."""
    by_id: dict[str, tuple[int, str | None]] = {}
    for pos, call in enumerate(calls if isinstance(calls, list) else [], start=1):
        if isinstance(call, dict) and call.get("id") is not None:
            fn = call.get("function", call)
            by_id.setdefault(str(call["id"]), (pos, fn.get("name") if isinstance(fn, dict) else None))
    return by_id


def in_render_order(messages: list) -> list[tuple[int, dict, str | None]]:
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


def tool_result_name(msg: dict, calls: list, index: int, where: str) -> str:
    """A result without a matched call: its own `tool`/`name`, else the call at its position."""
    name = msg.get("tool") or msg.get("name")
    if not name and 0 < index <= len(calls) and isinstance(calls[index - 1], dict):
        fn = calls[index - 1].get("function", calls[index - 1])
        name = fn.get("name") if isinstance(fn, dict) else None
    if not name:
        raise ChatFormatError(f"{where}: tool result without a tool name (give `name` or a matching tool_call_id)")
    return str(name)


def typed_value(kind: str, raw: str) -> Any:
    """An argument's value from its text and declared type; ValueError when they disagree."""
    if kind == "string":
        return raw
    try:
        value = loads_text(raw)
    except ValueError as exc:
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


def prior_calls(messages: list[dict]) -> int:
    """Tool calls already in the conversation: the first new call's IDX."""
    return sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")
