"""POST /v1/chat/completions and /v1/completions: request -> prompt ids -> Job -> reply.

A request is parsed (400 naming the field), rendered (chat: our XTML template; completions:
raw text), checked against the context, and submitted to the engine (503 with Retry-After
when its queue is full). Non-streaming replies wait for the job while watching for the
client's disconnect; streaming replies are SSE chunks ending in `data: [DONE]`, and a
client that goes away cancels its job when the next chunk cannot be written. Either way a
cancelled job's row is freed at the engine's next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from streamrt.chat import ChatFormatError, encode_chat
from streamrt.chat.render import ConversationTooLong
from streamrt.serve import schemas as S
from streamrt.serve.engine import EngineError, Job, QueueFull
from streamrt.serve.errors import ApiError, error_body, from_validation
from streamrt.chat.tools import prior_calls
from streamrt.serve.replies import ChatReply, TextReply

RETRY_AFTER_S = 1
BODY_SECONDS = 30  # a body not in by then is a 408: a client that stops mid-body holds nothing longer
MIN_BODY_BYTES = 4 << 20
BODY_BYTES_PER_TOKEN = 32  # generous: JSON-escaped CJK text is under 10 bytes a token


@dataclass
class ServerState:
    engine: object  # streamrt.serve.engine.Engine
    tokenizer: object
    model_id: str
    max_context: int
    metrics: object  # streamrt.serve.metrics.ServeMetrics
    api_key: str | None = None
    created: int = 0
    thinking_effort: str | None = None  # the model's default (its tree's ChatProfile); a request may ask another

    @property
    def max_body(self) -> int:
        """Request body bytes: far more than a prompt that fits the context can take, so a huge
        body is a 413 before it is parsed and tokenized on the server's one loop."""
        return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * self.max_context)


# ---- shared steps ---------------------------------------------------------------------------


async def read_body(request: Request, limit: int) -> bytes:
    def too_large():
        return ApiError(413, f"request body exceeds {limit} bytes", code="request_too_large")

    size = request.headers.get("content-length", "")
    if size.isascii() and size.isdigit() and (len(size) > 18 or int(size) > limit):
        raise too_large()
    chunks, n = [], 0
    try:
        async with asyncio.timeout(BODY_SECONDS):
            async for chunk in request.stream():
                n += len(chunk)
                if n > limit:  # chunked, or a Content-Length that lied
                    raise too_large()
                chunks.append(chunk)
    except ClientDisconnect:  # gone before its body was in: not a server error
        raise ApiError(499, "client disconnected before sending the whole body", code="client_disconnected") from None
    except TimeoutError:
        raise ApiError(408, f"request body not received within {BODY_SECONDS} s ({n} bytes came)",
                       code="request_timeout") from None
    return b"".join(chunks)


async def parse_body(state: ServerState, request: Request, cls: type[BaseModel]):
    body = await read_body(request, state.max_body)
    try:
        return cls.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation(exc) from None


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_id:  # a 404, as OpenAI and vLLM answer an unknown model
        raise ApiError(404, f"model {model!r} is not served here (this server serves {state.model_id!r})",
                       param="model", code="model_not_found")


def token_limit(state: ServerState, prompt: int, asked: int | None, field: str, prompt_field: str) -> int:
    """max_tokens for the job: as asked, else what the context leaves; 400 when it does not fit."""
    room = state.max_context - prompt
    if room < 1:
        raise ApiError(400, f"this model's maximum context length is {state.max_context} tokens, but the "
                       f"prompt is {prompt} tokens", param=prompt_field, code="context_length_exceeded")
    if asked is not None and asked > room:
        raise ApiError(400, f"{field} {asked} + prompt {prompt} tokens exceed the context of {state.max_context} "
                       f"tokens (at most {room})", param=field, code="context_length_exceeded")
    return asked if asked is not None else room


def submit(state: ServerState, ids: list[int], sampling: dict, limit: int) -> Job:
    """Queue a job; `sampling`: Job's sampling fields, from the request's `sampling()`."""
    job = Job(ids, limit, frozenset(state.tokenizer.stop_ids), **sampling)
    try:
        state.engine.submit(job)
    except QueueFull as exc:
        raise ApiError(503, f"server busy: {exc}; retry after {RETRY_AFTER_S} s", type="server_error",
                       code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    return job


def usage(job: Job) -> S.Usage:
    return S.Usage(prompt_tokens=len(job.ids), completion_tokens=len(job.tokens),
                   total_tokens=len(job.ids) + len(job.tokens),
                   prompt_tokens_details=S.PromptTokensDetails(cached_tokens=job.cached_tokens))


class Fed:
    """A job's tokens fed to its reply: yields what each token adds
    (pieces or text; nothing is yielded for a token that adds nothing), cancels the job once the
    reply has hit a stop string, and leaves the finish reason ("stop" then) in `reason`."""

    reason = "stop"

    async def feed(self, job: Job, reply):
        async for t in job.stream():
            out = reply.feed(t)
            if out:
                yield out
            if reply.stopped:
                job.cancel()
                return
        self.reason = job.finish_reason


async def run_to_end(request: Request, job: Job, reply) -> str | None:
    """Feed the job's tokens to the reply until it ends; None when the client went away."""

    async def consume() -> str:
        run = Fed()
        async for _ in run.feed(job, reply):
            pass
        return run.reason

    work, gone = asyncio.ensure_future(consume()), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            job.cancel()
    if not work.done() or work.cancelled():
        return None
    try:
        reason = work.result()
    except EngineError as exc:
        raise ApiError(500, str(exc), type="server_error", code="generation_failed") from None
    return None if reason == "cancelled" else reason


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def watch_disconnect(request: Request, job: Job) -> asyncio.Future:
    """Cancel the job the moment the client goes away. (Starlette cancels a streaming body on
    disconnect too, but its cancellation can lose every race against a token arriving in the
    same loop turn, so the row would run to its end.)"""
    gone = asyncio.ensure_future(_disconnected(request))
    gone.add_done_callback(lambda f: None if f.cancelled() else job.cancel())
    return gone


async def stream_events(request: Request, job: Job, reply, *, head, translate, failed, tail):
    """The one skeleton of every streamed reply, whatever the API: `head()`'s events first, then
    what each token adds (`reply.feed`'s output) through `translate`; an engine failure ends the
    stream with `failed(exc)`'s events; at the end `tail(reason)`'s. The job is cancelled the
    moment the client goes away and its row freed however the stream ends."""
    gone = watch_disconnect(request, job)
    try:
        for e in head():
            yield e
        run = Fed()
        try:
            async for fed in run.feed(job, reply):
                for e in translate(fed):
                    yield e
        except EngineError as exc:
            for e in failed(exc):
                yield e
            return
        if run.reason == "cancelled":  # the client is gone
            return
        for e in tail(run.reason):
            yield e
    finally:
        gone.cancel()
        job.cancel()  # no-op when finished; frees the row when the client went away


def sse(obj) -> str:
    body = S.dump(obj) if isinstance(obj, BaseModel) else obj
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def stream_response(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---- chat -----------------------------------------------------------------------------------


@dataclass
class ChatTurn:
    """What every chat-style API asks of the model, in the renderer's terms (OpenAI-style
    messages and tools); `where` names the request's conversation in errors."""

    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str | None = None  # "auto" | "none" | "required"
    named: str | None = None  # tool_choice naming one function
    thinking: bool = True
    effort: str | None = None  # None: the model's default
    response_format: dict | None = None
    stops: list[str] = field(default_factory=list)
    where: str = "messages"
    origins: list[str] | None = None  # per rendered message, the request field it came from


def render_chat(state: ServerState, req: S.ChatRequest) -> tuple[list[int], ChatReply]:
    problem = req.tool_choice_error()
    if problem:
        raise ApiError(400, problem, param="tool_choice")
    choice, named = req.tool_choice, None
    if isinstance(choice, S.NamedToolChoice):
        choice, named = None, choice.function.name
    turn = ChatTurn([m.to_render() for m in req.messages], [t.model_dump(exclude_none=True) for t in req.tools or []],
                    choice, named, req.thinking, req.effort,
                    S.dump(req.response_format) if req.response_format else None, req.stop_strings)
    return render_turn(state, turn)


def render_turn(state: ServerState, turn: ChatTurn) -> tuple[list[int], ChatReply]:
    """The prompt ids and the reply parser of a chat turn; 400s name `turn.where`."""
    # each message, tool and tool call renders to at least one token: refuse a count that cannot fit
    # before rendering it (130k empty messages, or 90k calls in one message, take seconds of the
    # server's one loop)
    calls = sum(len(m.get("tool_calls") or []) for m in turn.messages)
    for what, n, name in (("messages", len(turn.messages), turn.where), ("tools", len(turn.tools or []), "tools"),
                          ("tool calls", calls, turn.where)):
        if n > state.max_context:
            raise ApiError(400, f"{n} {what} cannot fit this model's maximum context length of "
                           f"{state.max_context} tokens", param=name, code="context_length_exceeded")
    tools, choice, allowed = turn.tools or None, turn.tool_choice, None
    if turn.named is not None:
        tools = [t for t in tools or [] if t["function"]["name"] == turn.named]
        choice, allowed = "required", {turn.named}
    elif choice == "none":
        allowed = set()
    try:
        ids = encode_chat(state.tokenizer, turn.messages, tools, thinking=turn.thinking,
                          thinking_effort=turn.effort or state.thinking_effort,
                          tool_choice=choice if tools else None, response_format=turn.response_format,
                          max_segments=state.max_context)
    except ConversationTooLong as exc:
        raise ApiError(400, f"{exc}, past this model's maximum context length of {state.max_context} tokens",
                       param=turn.where, code="context_length_exceeded") from None
    except ChatFormatError as exc:
        m = re.match(r"message (\d+)", str(exc))
        at = int(m.group(1)) if m else None
        param = turn.where if at is None else turn.origins[at] if turn.origins else f"{turn.where}[{at}]"
        raise ApiError(400, str(exc), param=param) from None
    reply = ChatReply(state.tokenizer, thinking=turn.thinking, stops=turn.stops,
                      call_base=prior_calls(turn.messages), allowed=allowed, required=choice == "required")
    return ids, reply


async def chat_completions(state: ServerState, request: Request):
    req = await parse_body(state, request, S.ChatRequest)
    check_model(state, req.model)
    ids, reply = render_chat(state, req)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    job = submit(state, ids, req.sampling(), token_limit(state, len(ids), req.token_limit, field, "messages"))
    head = dict(id=f"chatcmpl-{uuid.uuid4().hex[:24]}", created=int(time.time()), model=state.model_id)
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        return stream_response(_chat_events(state, request, job, reply, head, include))
    reason = await run_to_end(request, job, reply)
    if reason is None:
        return JSONResponse(error_body("client disconnected", type="invalid_request_error"), 499)
    reply.finish(reason)
    count_unmet(state, reply)
    calls = [S.ToolCallOut(id=c["id"], type="function", function=S.FunctionCallOut(name=c["name"],
             arguments=c["arguments"])) for c in reply.calls]
    msg = S.AssistantMessage(content=reply.content if reply.content or not calls else None,
                             reasoning_content=reply.reasoning or None, tool_calls=calls or None)
    body = S.ChatCompletion(**head, choices=[S.ChatChoice(message=msg, finish_reason=reply.finish_reason(reason))],
                            usage=usage(job))
    out = S.dump(body)
    out["choices"][0]["message"].setdefault("content", None)  # OpenAI sends content: null beside tool calls
    return JSONResponse(out)


def count_unmet(state: ServerState, reply: ChatReply) -> None:
    if reply.unmet:
        state.metrics.tool_choice_unmet.inc()


def _delta_chunks(head: dict, piece) -> list[S.ChatCompletionChunk]:
    def chunk(**delta):
        return S.ChatCompletionChunk(**head, choices=[S.ChunkChoice(delta=S.Delta(**delta))])

    if piece.kind == "reasoning":
        return [chunk(reasoning_content=piece.text)]
    if piece.kind == "content":
        return [chunk(content=piece.text)]
    c = piece.call
    if piece.kind == "call":  # the header as soon as the name is known; arguments follow as written
        return [chunk(tool_calls=[S.ToolCallOut(index=c["index"], id=c["id"], type="function",
                                                function=S.FunctionCallOut(name=c["name"], arguments=""))])]
    if piece.kind == "arguments":
        return [chunk(tool_calls=[S.ToolCallOut(index=c["index"], function=S.FunctionCallOut(arguments=piece.text))])]
    return []


def _chat_events(state: ServerState, request: Request, job: Job, reply: ChatReply, head: dict, include_usage: bool):
    def translate(pieces) -> list[str]:
        return [sse(c) for piece in pieces for c in _delta_chunks(head, piece)]

    def tail(reason: str) -> list[str]:
        out = translate(reply.finish(reason))
        count_unmet(state, reply)
        final = S.ChunkChoice(delta=S.Delta(), finish_reason=reply.finish_reason(reason))
        out.append(sse(S.ChatCompletionChunk(**head, choices=[final])))
        if include_usage:
            out.append(sse(S.ChatCompletionChunk(**head, choices=[], usage=usage(job))))
        return out + ["data: [DONE]\n\n"]

    def first() -> list[str]:
        opening = S.ChunkChoice(delta=S.Delta(role="assistant", content=""))
        return [sse(S.ChatCompletionChunk(**head, choices=[opening]))]

    return stream_events(request, job, reply, head=first, translate=translate, failed=_failed_sse, tail=tail)


def _failed_sse(exc: EngineError) -> list[str]:
    return [sse(error_body(str(exc), type="server_error")), "data: [DONE]\n\n"]


# ---- completions ----------------------------------------------------------------------------


async def completions(state: ServerState, request: Request):
    req = await parse_body(state, request, S.CompletionRequest)
    check_model(state, req.model)
    ids = prompt_ids(state, req.prompt)
    job = submit(state, ids, req.sampling(), token_limit(state, len(ids), req.token_limit, "max_tokens", "prompt"))
    reply = TextReply(state.tokenizer, stops=req.stop_strings)
    head = dict(id=f"cmpl-{uuid.uuid4().hex[:24]}", created=int(time.time()), model=state.model_id)
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        return stream_response(_text_events(request, job, reply, head, include))
    reason = await run_to_end(request, job, reply)
    if reason is None:
        return JSONResponse(error_body("client disconnected", type="invalid_request_error"), 499)
    reply.finish()
    choice = S.CompletionChoice(text=reply.text, finish_reason=reply.finish_reason(reason))
    return JSONResponse(S.dump(S.Completion(**head, choices=[choice], usage=usage(job))))


def prompt_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return state.tokenizer.encode(prompt)
    # an id past the embedding would fail the forward of every row sharing the step
    vocab = state.tokenizer.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary (0 to {vocab - 1})", param="prompt",
                       code="invalid_value")
    return list(prompt)


def _text_events(request: Request, job: Job, reply: TextReply, head: dict, include_usage: bool):
    def chunk(text: str, reason: str | None = None):
        return sse(S.Completion(**head, choices=[S.CompletionChoice(text=text, finish_reason=reason)]))

    def tail(reason: str) -> list[str]:
        out = [chunk(reply.finish(), reply.finish_reason(reason))]
        if include_usage:
            out.append(sse(S.Completion(**head, choices=[], usage=usage(job))))
        return out + ["data: [DONE]\n\n"]

    return stream_events(request, job, reply, head=list, translate=lambda text: [chunk(text)], failed=_failed_sse,
                         tail=tail)
