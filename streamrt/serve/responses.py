"""POST /v1/responses: OpenAI's Responses API, stateless, on the same template, engine and reply
parser as chat completions.

`instructions` is a system message; `input` a string (one user message) or items: messages
(input_text / output_text parts), `reasoning` items (their text becomes the next assistant
turn's reasoning), `function_call` and `function_call_output` items (an assistant turn's tool
calls and their results, matched by call_id). The reply's output is a reasoning item, a message
item and function_call items; with `stream: true` the Responses events, function arguments
streamed as `response.function_call_arguments.delta` as they are written. Nothing is stored:
`store: true`, `previous_response_id`, `conversation`, `background` are refused (a 400 naming
the field), as are input images and files and non-function tools.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from streamrt.serve.engine import EngineError, Job
from streamrt.serve.errors import ApiError, error_body
from streamrt.serve.replies import ChatReply, Piece
from streamrt.serve.routes import (ChatTurn, ServerState, check_model, count_unmet, parse_body, render_turn,
                                   run_to_end, stream_events, stream_response, submit, token_limit)
from streamrt.serve.schemas import ResponseFormat, _Strict, _unsupported, thinking_effort

# ---- requests -------------------------------------------------------------------------------


class TextPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    id: str | None = None
    encrypted_content: str | None = None
    status: str | None = None


_TAGS = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionOutput",
         "reasoning": "Reasoning"}


def _item_tag(v: Any) -> str | None:
    """An item's branch: by its type, a message when it has none (EasyInputMessage)."""
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)
    return _TAGS.get(kind) if isinstance(kind, str) else None


Item = Annotated[Union[Annotated[MessageItem, Tag("Message")], Annotated[FunctionCallItem, Tag("FunctionCall")],
                       Annotated[FunctionOutputItem, Tag("FunctionOutput")],
                       Annotated[ReasoningItem, Tag("Reasoning")]], Discriminator(_item_tag)]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, v):
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(f"only function tools are supported, got type {v.get('type')!r}")
        return v


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class Reasoning(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None
    generate_summary: str | None = None


class TextConfig(_Strict):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(_Strict):
    model: str
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # stateless: accepted at their no-op values only
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    top_logprobs: int | None = None

    @field_validator("temperature", "top_p", "stream", mode="before")
    @classmethod
    def _null_is_default(cls, v, info):
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("store", "background", "top_logprobs")
    @classmethod
    def _off(cls, v):
        return v if not v else _unsupported(v, "this server stores nothing: send false or leave it out")

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _stateless(cls, v):
        return v if v is None else _unsupported(v, "this server stores nothing: send the whole conversation as input")

    def sampling(self) -> dict:
        """The request's sampling, as the engine's Job takes it."""
        return dict(temperature=self.temperature, top_p=self.top_p)


# ---- request -> chat turn -------------------------------------------------------------------


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def to_turn(req: ResponsesRequest) -> ChatTurn:
    messages, origins = [], []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
        origins.append("instructions")
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    assistant, reasoning = None, ""  # the assistant turn being gathered, reasoning waiting for one
    for i, item in enumerate(items):
        where = "input" if isinstance(req.input, str) else f"input[{i}]"
        if item.type == "reasoning":
            reasoning += "".join(p.text for p in item.content or item.summary)
            continue
        if item.type == "function_call" or (item.type == "message" and item.role == "assistant"):
            if assistant is None or (item.type == "message" and assistant["tool_calls"]):
                assistant = {"role": "assistant", "content": "", "reasoning_content": reasoning or None,
                             "tool_calls": []}
                messages.append(assistant)
                origins.append(where)
                reasoning = ""
            if item.type == "message":
                assistant["content"] += _text(item.content)
            else:
                assistant["tool_calls"].append({"id": item.call_id, "type": "function",
                                                "function": {"name": item.name, "arguments": item.arguments}})
            continue
        assistant = None
        if item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.content
                             if isinstance(item.content, str) else [{"type": "text", "text": p.text}
                                                                    for p in item.content]})
        origins.append(where)
    tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
             for t in req.tools or []]
    choice, named = req.tool_choice, None
    if isinstance(choice, NamedFunction):
        choice, named = None, choice.name
    fmt = req.text.format if req.text and req.text.format else None
    if fmt is not None:  # Responses flattens the schema into format; chat completions nests it
        fmt = ResponseFormat.model_validate({"type": fmt.get("type"), "json_schema": fmt if fmt.get(
            "type") == "json_schema" else None}).model_dump(exclude_none=True)
    effort = thinking_effort(req.reasoning.effort if req.reasoning else None)
    return ChatTurn(messages, tools, choice, named, True, effort, fmt, [], where="input", origins=origins)


def _check_tool_choice(req: ResponsesRequest) -> None:
    names = [t.name for t in req.tools or []]
    if isinstance(req.tool_choice, NamedFunction) and req.tool_choice.name not in names:
        raise ApiError(400, f"tool_choice names function {req.tool_choice.name!r}, which is not in tools",
                       param="tool_choice")
    if req.tool_choice == "required" and not names:
        raise ApiError(400, "tool_choice 'required' needs tools", param="tool_choice")


# ---- the route ------------------------------------------------------------------------------


async def responses(state: ServerState, request: Request):
    req = await parse_body(state, request, ResponsesRequest)
    check_model(state, req.model)
    _check_tool_choice(req)
    ids, reply = render_turn(state, to_turn(req))
    job = submit(state, ids, req.sampling(),
                 token_limit(state, len(ids), req.max_output_tokens, "max_output_tokens", "input"))
    out = _Output(req, state.model_id, job)
    if req.stream:
        return stream_response(_events(state, request, job, reply, out))
    reason = await run_to_end(request, job, reply)
    if reason is None:
        return JSONResponse(error_body("client disconnected", type="invalid_request_error"), 499)
    reply.finish(reason)
    count_unmet(state, reply)
    return JSONResponse(out.response(reply, reason))


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class _Output:
    """The response object and its items, as built up and at the end."""

    def __init__(self, req: ResponsesRequest, model: str, job: Job):
        self.job = job
        self.base = {"id": _id("resp"), "object": "response", "created_at": int(time.time()), "model": model,
                     "instructions": req.instructions,
                     "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                     "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction)
                                     else req.tool_choice or "auto"),
                     "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
                     "top_p": req.top_p, "max_output_tokens": req.max_output_tokens, "previous_response_id": None,
                     "store": False, "metadata": req.metadata or {}, "error": None, "incomplete_details": None,
                     "reasoning": req.reasoning.model_dump(exclude_none=True) if req.reasoning else None,
                     "text": {"format": (req.text.format if req.text and req.text.format else {"type": "text"})}}
        self.reasoning_id, self.message_id = _id("rs"), _id("msg")

    def snapshot(self, status: str, output: list | None = None) -> dict:
        return {**self.base, "status": status, "output": output or []}

    def reasoning_item(self, text: str, status: str = "completed") -> dict:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}

    def message_item(self, text: str, status: str = "completed") -> dict:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" \
            else []
        return {"type": "message", "id": self.message_id, "role": "assistant", "status": status, "content": content}

    @staticmethod
    def call_item(call: dict, status: str = "completed") -> dict:
        return {"type": "function_call", "id": "fc_" + call["id"], "call_id": call["id"], "name": call["name"],
                "arguments": call["arguments"] if status == "completed" else "", "status": status}

    def response(self, reply: ChatReply, reason: str) -> dict:
        output = [self.reasoning_item(reply.reasoning)] if reply.reasoning else []
        if reply.content or not reply.calls:
            output.append(self.message_item(reply.content))
        output += [self.call_item(c) for c in reply.calls]
        done = reason != "length" or bool(reply.calls) or reply.stopped
        body = self.snapshot("completed" if done else "incomplete", output)
        if not done:
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        n, m = len(self.job.ids), len(self.job.tokens)
        body["usage"] = {"input_tokens": n, "input_tokens_details": {"cached_tokens": self.job.cached_tokens},
                         "output_tokens": m, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n + m}
        return body


class _Stream:
    """Reply pieces -> Responses events, each with its sequence number; one output item open at a time."""

    def __init__(self, out: _Output):
        self.out, self.seq, self.items = out, 0, []
        self.open: str | None = None  # "reasoning" | "message" | "call"
        self.text = ""

    def event(self, kind: str, **body) -> str:
        self.seq += 1
        data = json.dumps({"type": kind, "sequence_number": self.seq - 1, **body}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def events(self, piece: Piece) -> list[str]:
        if piece.kind in ("reasoning", "content"):
            kind = "reasoning" if piece.kind == "reasoning" else "message"
            out = [] if self.open == kind else self.start(kind)
            self.text += piece.text
            at = dict(item_id=self._item_id(), output_index=len(self.items) - 1, content_index=0)
            if kind == "reasoning":
                return out + [self.event("response.reasoning_text.delta", **at, delta=piece.text)]
            return out + [self.event("response.output_text.delta", **at, delta=piece.text, logprobs=[])]
        if piece.kind == "call":
            return self.start("call", piece.call)
        at = dict(item_id=self._item_id(), output_index=len(self.items) - 1)
        if piece.kind == "arguments" and self.open == "call":
            self.text += piece.text
            return [self.event("response.function_call_arguments.delta", **at, delta=piece.text)]
        return self.stop() if piece.kind == "call_end" else []

    def _item_id(self) -> str:
        return self.items[-1]["id"] if self.items else ""

    def start(self, kind: str, call: dict | None = None) -> list[str]:
        out = self.stop()
        item = (self.out.reasoning_item("", "in_progress") if kind == "reasoning" else self.out.message_item(
            "", "in_progress") if kind == "message" else self.out.call_item(call, "in_progress"))
        self.items.append(item)
        self.open, self.text, self.call = kind, "", call
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                  content_index=0, part=part))
        return out

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        at, kind = dict(item_id=self._item_id(), output_index=len(self.items) - 1), self.open
        self.open, out = None, []
        if kind == "reasoning":
            item = self.out.reasoning_item(self.text)
            out.append(self.event("response.reasoning_text.done", **at, content_index=0, text=self.text))
        elif kind == "message":
            item = self.out.message_item(self.text)
            out.append(self.event("response.output_text.done", **at, content_index=0, text=self.text, logprobs=[]))
            out.append(self.event("response.content_part.done", **at, content_index=0, part=item["content"][0]))
        else:
            item = self.out.call_item({**self.call, "arguments": self.text})
            out.append(self.event("response.function_call_arguments.done", **at, arguments=self.text))
        self.items[-1] = item
        out.append(self.event("response.output_item.done", output_index=at["output_index"], item=item))
        return out


def _events(state: ServerState, request: Request, job: Job, reply: ChatReply, out: _Output):
    s = _Stream(out)

    def first() -> list[str]:
        return [s.event("response.created", response=out.snapshot("in_progress")),
                s.event("response.in_progress", response=out.snapshot("in_progress"))]

    def translate(pieces) -> list[str]:
        return [e for piece in pieces for e in s.events(piece)]

    def tail(reason: str) -> list[str]:
        events = translate(reply.finish(reason)) + s.stop()
        count_unmet(state, reply)
        final = out.response(reply, reason)
        final["output"] = s.items  # what was streamed, in its order
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return events + [s.event(kind, response=final)]

    def failed(exc: EngineError) -> list[str]:
        return [s.event("response.failed", response={**out.snapshot("failed", s.items), "error": {
            "code": "server_error", "message": str(exc)}})]

    return stream_events(request, job, reply, head=first, translate=translate, failed=failed, tail=tail)
