"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the same
template, engine and reply parser as chat completions.

A request becomes a `ChatTurn`: `system` a system message, user text blocks a user message,
`tool_result` blocks tool messages (before the user's text, as Anthropic orders them),
assistant `thinking` / `text` / `tool_use` blocks one assistant message with its reasoning and
tool calls. `tool_choice` auto / any / tool / none maps to auto / required / the named function
/ none. `thinking` absent or enabled: the model thinks (as it was trained); disabled: it answers
without the think channel. The reply is thinking, text and tool_use blocks, or with
`stream: true` Anthropic's SSE events, tool input streamed as `input_json_delta` as it is
written. `output_config.effort` picks the template's thinking effort (absent: the model's
default), `output_config.format` is prompted as chat's json_schema response_format. Refused
(a 400 naming the field): image and document blocks, server tools.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator, model_validator

from streamrt.jsonio import loads_text
from streamrt.serve.engine import EngineError, Job
from streamrt.serve.errors import ApiError, anthropic_body
from streamrt.serve.replies import ChatReply, Piece
from streamrt.serve.routes import (ChatTurn, ServerState, check_model, count_unmet, parse_body, render_turn,
                                   run_to_end, stream_events, stream_response, submit, token_limit)
from streamrt.serve.schemas import _Strict, thinking_effort

# ---- requests -------------------------------------------------------------------------------


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    """Encrypted reasoning of another server: nothing to render, dropped."""

    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                  Field(discriminator="type")]


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, v):
        if isinstance(v, dict) and v.get("type") not in (None, "custom"):
            raise ValueError(f"only custom tools (name, input_schema) are supported, got type {v.get('type')!r}")
        return v


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # accepted; the think channel is not cut at it


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # the template's thinking effort
    format: OutputFormat | None = None  # prompted through the template, as chat's response_format


class CountTokensRequest(_Strict):
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @field_validator("temperature", "top_p", "stream", mode="before")
    @classmethod
    def _null_is_default(cls, v, info):
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v and any(not s for s in v):
            raise ValueError("stop sequences must not be empty")
        return v

    def sampling(self) -> dict:
        """The request's sampling, as the engine's Job takes it."""
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or 0)


# ---- request -> chat turn -------------------------------------------------------------------


def to_turn(req: CountTokensRequest) -> ChatTurn:
    messages, origins = [], []
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        messages.append({"role": "system", "content": system})
        origins.append("system")
    for i, m in enumerate(req.messages):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        for j, b in enumerate(blocks):
            if b.type in (("thinking", "tool_use") if m.role == "user" else ("tool_result",)):
                raise ApiError(400, f"a {m.role} message cannot hold a {b.type} block",
                               param=f"messages[{i}].content[{j}]")
        texts = [{"type": "text", "text": b.text} for b in blocks if b.type == "text"]
        if m.role == "user":
            for b in blocks:
                if b.type == "tool_result":
                    messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text})
                    origins.append(f"messages[{i}]")
            if texts or not any(b.type == "tool_result" for b in blocks):
                messages.append({"role": "user", "content": m.content if isinstance(m.content, str) else texts})
                origins.append(f"messages[{i}]")
            continue
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                 for b in blocks if b.type == "tool_use"]
        reasoning = "".join(b.thinking for b in blocks if b.type == "thinking")
        messages.append({"role": "assistant", "content": texts, "reasoning_content": reasoning or None,
                         "tool_calls": calls or None})
        origins.append(f"messages[{i}]")
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.input_schema}} for t in req.tools or []]
    for t in tools:
        if t["function"]["description"] is None:
            del t["function"]["description"]
    choice, named = _tool_choice(req)
    thinking = req.thinking is None or req.thinking.type != "disabled"
    stops = list(getattr(req, "stop_sequences", None) or [])
    out = req.output_config or OutputConfig()
    fmt = {"type": "json_schema", "json_schema": {"schema": out.format.schema_}} if out.format else None
    return ChatTurn(messages, tools, choice, named, thinking, thinking_effort(out.effort), fmt, stops, origins=origins)


def _tool_choice(req: CountTokensRequest) -> tuple[str | None, str | None]:
    c = req.tool_choice
    if c is None or c.type == "auto":
        return None, None
    names = [t.name for t in req.tools or []]
    if c.type != "none" and not names:
        raise ApiError(400, f"tool_choice {c.type!r} needs tools", param="tool_choice")
    if c.type == "tool":
        if c.name not in names:
            raise ApiError(400, f"names tool {c.name!r}, which is not in tools ({', '.join(names)})",
                           param="tool_choice.name")
        return None, c.name
    return ("required" if c.type == "any" else "none"), None


# ---- routes ---------------------------------------------------------------------------------


async def count_tokens(state: ServerState, request: Request):
    req = await parse_body(state, request, CountTokensRequest)
    check_model(state, req.model)
    ids, _ = render_turn(state, to_turn(req))
    return JSONResponse({"input_tokens": len(ids)})


async def messages(state: ServerState, request: Request):
    req = await parse_body(state, request, MessagesRequest)
    check_model(state, req.model)
    ids, reply = render_turn(state, to_turn(req))
    job = submit(state, ids, req.sampling(), token_limit(state, len(ids), req.max_tokens, "max_tokens", "messages"))
    head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": state.model_id}
    if req.stream:
        return stream_response(_events(state, request, job, reply, head))
    reason = await run_to_end(request, job, reply)
    if reason is None:
        return JSONResponse(anthropic_body(499, "client disconnected"), 499)
    reply.finish(reason)
    count_unmet(state, reply)
    content = []
    if reply.reasoning:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    content += [{"type": "tool_use", "id": c["id"], "name": c["name"], "input": loads_text(c["arguments"])}
                for c in reply.calls]
    reason, sequence = _stop_reason(reply, reason)
    return JSONResponse({**head, "content": content, "stop_reason": reason, "stop_sequence": sequence,
                         "usage": _usage(job)})


def _stop_reason(reply: ChatReply, reason: str) -> tuple[str, str | None]:
    if reply.calls:
        return "tool_use", None
    if reply.stopped:
        return "stop_sequence", reply.stop.matched
    return ("max_tokens" if reason == "length" else "end_turn"), None


def _usage(job: Job) -> dict:
    # Anthropic's input_tokens are the ones not read from the cache (the three add up to the prompt)
    return {"input_tokens": len(job.ids) - job.cached_tokens, "output_tokens": len(job.tokens),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": job.cached_tokens}


def event(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


class _Blocks:
    """Reply pieces -> content-block events: a block opens when a piece of another kind comes."""

    def __init__(self):
        self.index, self.open = -1, None  # open: "thinking" | "text" | "tool_use"

    def events(self, piece: Piece) -> list[str]:
        if piece.kind in ("reasoning", "content"):
            kind = "thinking" if piece.kind == "reasoning" else "text"
            out = [] if self.open == kind else self.start(kind, {"type": kind, kind: ""} | (
                {"signature": ""} if kind == "thinking" else {}))
            delta = {"type": "thinking_delta", "thinking": piece.text} if kind == "thinking" else {
                "type": "text_delta", "text": piece.text}
            return out + [event("content_block_delta", {"index": self.index, "delta": delta})]
        c = piece.call
        if piece.kind == "call":
            return self.start("tool_use", {"type": "tool_use", "id": c["id"], "name": c["name"], "input": {}})
        if piece.kind == "arguments" and self.open == "tool_use":
            delta = {"type": "input_json_delta", "partial_json": piece.text}
            return [event("content_block_delta", {"index": self.index, "delta": delta})]
        return self.stop() if piece.kind == "call_end" else []

    def start(self, kind: str, block: dict) -> list[str]:
        out = self.stop()
        self.index, self.open = self.index + 1, kind
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]


def _events(state: ServerState, request: Request, job: Job, reply: ChatReply, head: dict):
    blocks = _Blocks()

    def first() -> list[str]:
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {**_usage(job), "output_tokens": 0}}
        return [event("message_start", {"message": start}), event("ping", {})]

    def translate(pieces) -> list[str]:
        return [e for piece in pieces for e in blocks.events(piece)]

    def tail(reason: str) -> list[str]:
        out = translate(reply.finish(reason)) + blocks.stop()
        count_unmet(state, reply)
        stop, sequence = _stop_reason(reply, reason)
        return out + [event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": sequence},
                                              "usage": {"output_tokens": len(job.tokens)}}),
                      event("message_stop", {})]

    def failed(exc: EngineError) -> list[str]:
        return [event("error", {"error": anthropic_body(500, str(exc))["error"]})]

    return stream_events(request, job, reply, head=first, translate=translate, failed=failed, tail=tail)
