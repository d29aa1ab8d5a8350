"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests are validated strictly (a string where a number belongs is a 400, not a silent
conversion; null is the default where OpenAI allows it); fields the API has and streamrt
does not implement are accepted at their no-op values (`logprobs` false, `logit_bias` {},
`best_of` 1, ...) and any other value is a 400 naming the field, so an answer never
silently ignores what was asked; `presence_penalty` and `frequency_penalty` apply as
OpenAI's, `top_k`, `min_p` and `repetition_penalty` as vLLM's; `response_format` is prompted
through the template, as tool_choice is. An unknown top-level field is a 400 naming it, as
OpenAI's own server answers (nested objects ignore theirs, as clients echo fields). Responses are the
shapes the official client parses: `reasoning_content` beside `content`, tool calls with
`functions.NAME:IDX` ids and arguments as a JSON string. `reasoning_effort`
picks the template's thinking effort.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from streamrt.api.sampling import MAX_SEED

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


_CLOSED = ConfigDict(extra="forbid")  # a request body: a field it does not know is a 400


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_tag(part) -> bool:
    """A union branch pydantic names in a location ('str', 'list[TextPart]', 'NamedToolChoice')."""
    p = str(part)
    return "[" in p or p in _TYPE_TAGS or p[:1].isupper() or p.startswith("function-")


def field_path(loc: tuple) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; pydantic's union branch tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_tag(part):
            out += f".{part}" if out else str(part)
    return out


def first_error(exc: ValidationError) -> tuple[str, str, str]:
    """(field path, message, pydantic's error type) of the error to report: of a union's branch
    errors, the one that got furthest into the value (a list of parts beats 'not a string')."""
    first = max(exc.errors(include_url=False), key=lambda e: len(field_path(tuple(e["loc"]))))
    return field_path(tuple(first["loc"])), first["msg"].removeprefix("Value error, "), first["type"]


# ---- requests -------------------------------------------------------------------------------


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Strict):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class Message(_Strict):
    role: Role
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's name for it
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _has_content(cls, v, info: ValidationInfo):
        # only an assistant turn may go without text (its tool calls or reasoning carry it)
        role = info.data.get("role")
        if v is None and role not in (None, "assistant"):
            raise ValueError(f"a {role} message needs content")
        return v

    def to_render(self) -> dict:
        """The dict `streamrt.chat.render` takes (developer messages are system messages)."""
        out = self.model_dump(exclude_none=True)
        if out["role"] == "developer":
            out["role"] = "system"
        return out


class FunctionDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    """Prompted through the template's response-format message, not constrained."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = Field(default=None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _schema_given(cls, v, info: ValidationInfo):
        if v is None and info.data.get("type") == "json_schema":
            raise ValueError("type 'json_schema' needs a json_schema object")
        return v


def _unsupported(v, hint: str = "leave it out"):
    raise ValueError(f"not supported by streamrt ({hint}), got {v!r}")


class _Sampling(_Strict):
    """The fields /v1/chat/completions and /v1/completions share."""

    model: str
    max_tokens: int | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)  # what `streamrt run --seed` takes
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)  # over the generated tokens, as OpenAI's
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    top_k: int = 0  # vLLM's and llama-server's: <= 0 (vLLM's -1) keeps every token
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # relative to the most probable token
    repetition_penalty: float = Field(default=1.0, gt=0.0)  # over prompt and output, as vLLM's
    # accepted at their no-op values only
    logit_bias: dict[str, float] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None

    @field_validator("parallel_tool_calls")
    @classmethod
    def _parallel_ok(cls, v: bool | None) -> bool | None:
        return v if v is not False else _unsupported(v, "the model may call several tools; send true or leave it out")

    @field_validator("store")
    @classmethod
    def _no_store(cls, v: bool | None) -> bool | None:
        return v if not v else _unsupported(v)

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        return v if not v else _unsupported(v)

    @field_validator("temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                     "repetition_penalty", mode="before")
    @classmethod
    def _null_is_default(cls, v, info: ValidationInfo):
        # OpenAI's API takes null for these (clients that serialize None send it)
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

    @field_validator("n")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"only n = 1 is supported, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop strings")
        return stops

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    def sampling(self) -> dict:
        """The request's sampling, as the engine's Job takes it."""
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty, seed=self.seed,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)


class ChatPrompt(_Strict):
    """The conversation a chat prompt is rendered from: a request's, and the whole of
    `streamrt run --messages FILE`."""

    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None


class ChatRequest(_Sampling, ChatPrompt):
    model_config = _CLOSED
    max_completion_tokens: int | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    thinking: bool = True  # streamrt extension: False answers without the think channel
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        return v if not v else _unsupported(v)

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        return v if not v else _unsupported(v)

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive_completion(cls, v: int | None) -> int | None:
        return cls._positive(v)

    def tool_choice_error(self) -> str | None:
        """Why tool_choice cannot be honoured with these tools (a 400 on `tool_choice`), or None."""
        names = [t.function.name for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                return (f"tool_choice names function {self.tool_choice.function.name!r}, which is not in "
                        f"tools ({', '.join(names) or 'none given'})")
        elif self.tool_choice == "required" and not names:
            return "tool_choice 'required' needs tools"
        return None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def effort(self) -> str | None:
        return thinking_effort(self.reasoning_effort)


# OpenAI's reasoning efforts -> the template's thinking efforts (low, medium, high, max); none: the model's default
_EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "max", "max": "max"}


def thinking_effort(effort: str | None) -> str | None:
    return _EFFORTS.get(effort) if effort else None


class CompletionRequest(_Sampling):
    model_config = _CLOSED
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        # OpenAI's prompt is text, token ids, or a batch of either; clients (LangChain's
        # OpenAI LLM) send a batch of one
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) > 1:
                raise ValueError(f"one prompt per request is supported, got {len(v)}")
            v = v[0]
        if not v:
            raise ValueError("must not be empty")
        return v

    @field_validator("echo", "logprobs", "suffix")
    @classmethod
    def _no_extras(cls, v):
        return v if not v else _unsupported(v)

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, v: int | None) -> int | None:
        return v if v in (None, 1) else _unsupported(v, "send 1 or leave it out")

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


# ---- responses ------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # resumed from the prefix cache, as OpenAI reports prompt caching


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class FunctionCallOut(BaseModel):
    name: str | None = None
    arguments: str


class ToolCallOut(BaseModel):
    index: int | None = None  # streamed deltas only
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "streamrt"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict:
    """A response body: None fields left out (OpenAI omits them too)."""
    return model.model_dump(exclude_none=True)
