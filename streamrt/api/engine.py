"""`load(model, **runtime options) -> Engine`: a loaded model for Python callers, the same
`Session` that `streamrt run` and `streamrt selfcheck` drive, without the command line."""

from __future__ import annotations

import os
import sys
from typing import Iterator

from streamrt.api.options import runtime_options
from streamrt.api.sampling import Sampling
from streamrt.api.session import GenStats, Session, open_session, resolve_model_dir
from streamrt.chat import ChatFormatError, ChatParser, EndOfMessage, ParseError, Reply, ResponseText, encode_chat
from streamrt.errors import StreamrtError

_SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "seed", "greedy", "ignore_eos")


def load(model: str | os.PathLike | None = None, *, prefill_chunk: int | None = None, progress: bool = False,
         **options) -> "Engine":
    """Open a model: `model` is a converted streamrt tree (a directory), or None for the small
    embedded default model. The keywords are the runtime options of `streamrt run` by their
    Python names (`device="cuda"`, `gpu_mem="40G"`, `window=4096`, `backend="nvrtc"`, ...);
    prefill_chunk is tokens per prefill chunk (None: from free memory). The weights load on
    the first generation. A bad keyword is a TypeError or ValueError naming it."""
    opts = runtime_options(**options)
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)):
        raise TypeError(f"prefill_chunk must be an int or None, got {type(prefill_chunk).__name__}")
    if prefill_chunk is not None and not 1 <= prefill_chunk <= 1 << 20:
        raise ValueError(f"prefill_chunk must be in 1..{1 << 20}, got {prefill_chunk}")
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path (str or os.PathLike) or None, got {type(model).__name__}")
    try:
        model_dir = resolve_model_dir(None if model is None else os.fspath(model),
                                      lambda m: print(m, file=sys.stderr))
    except StreamrtError as e:
        raise ValueError(str(e).replace("--model ", "model ", 1)) from None
    return Engine(open_session(model_dir, opts, progress=progress, prefill_chunk=prefill_chunk))


class Engine:
    """A loaded model. `generate` answers one prompt as `streamrt run --prompt` does; `chat`
    continues a conversation (OpenAI-style messages, optional tools). Both return the whole
    reply, or with `stream=True` an iterator over it as it is decoded. One generation at a time;
    `close()` (or leaving a `with` block) frees the runtime."""

    def __init__(self, session: Session):
        self._session = session
        self._busy = False
        self._closed = False
        self.stats: GenStats | None = None  # the last finished generation's counters

    @property
    def name(self) -> str:
        return self._session.name

    def generate(self, prompt: str, max_new_tokens: int | None = None, *, system: str | None = None,
                 thinking: bool = True, stream: bool = False, sampling: Sampling | None = None,
                 **sampling_keys) -> str | Iterator[str]:
        """The reply to one user message (`system`: a system message before it), without its
        thinking. Sampling: a `Sampling`, or its fields as keywords (greedy=True, temperature=0.7,
        top_p, seed, ignore_eos); the default is greedy. stream=True: an iterator of text pieces."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if not prompt.strip():
            raise ValueError("prompt is empty; give the text of a user message")
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a str or None, got {type(system).__name__}")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        s = _sampling(sampling, max_new_tokens, sampling_keys)
        pieces = (e.text for e in self._events(messages, None, s, thinking) if isinstance(e, ResponseText))
        return pieces if stream else "".join(pieces)

    def chat(self, messages: list[dict], tools: list[dict] | None = None, max_new_tokens: int | None = None, *,
             thinking: bool = True, stream: bool = False, sampling: Sampling | None = None, **sampling_keys):
        """The assistant's next message for OpenAI-style `messages` (and `tools`, OpenAI function
        specs): {"role": "assistant", "content", "reasoning_content"?, "tool_calls"?}. stream=True:
        an iterator of the parser's events as they are decoded (streamrt.chat: ThinkText,
        ResponseText, ToolCall)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages) or not messages:
            raise TypeError("messages must be a non-empty list of dicts ({'role': ..., 'content': ...})")
        if tools is not None and not isinstance(tools, list):
            raise TypeError(f"tools must be a list or None, got {type(tools).__name__}")
        s = _sampling(sampling, max_new_tokens, sampling_keys)
        events = self._events(messages, tools, s, thinking)
        if stream:
            return (e for e in events if not isinstance(e, ParseError))
        reply = Reply()
        for e in events:
            reply.add(e)
        return reply.to_message()

    def _events(self, messages, tools, sampling: Sampling, thinking: bool):
        """Checked now (a bad message raises here, not at the first `next`); decoded lazily."""
        self._check_open()
        session = self._session
        try:
            ids = encode_chat(session.tokenizer, messages, tools, thinking=thinking,
                              thinking_effort=session.chat.thinking_effort)
        except (ChatFormatError, KeyError, AttributeError) as e:
            raise ValueError(f"messages: {e}") from None
        if session.context is not None and len(ids) > session.context:
            raise ValueError(f"prompt is {len(ids)} tokens but the model's context is {session.context} tokens")
        return self._decode(ids, sampling, thinking)

    def _decode(self, ids, sampling, thinking):
        """Marked busy from the first piece to the last (or the iterator's close): the runtime
        holds one generation's state at a time."""
        self._check_open()
        self._busy = True
        try:
            parser = ChatParser.for_generation(self._session.tokenizer, thinking=thinking)
            ended = False
            steps = self._session.tokens(ids, sampling)
            while True:
                try:
                    tok = next(steps)
                except StopIteration as done:
                    self.stats = done.value
                    break
                for e in parser.feed(tok):
                    ended = ended or isinstance(e, EndOfMessage)
                    yield e
            if not ended:  # as `run`: an open frame at the token limit is expected, not malformed
                tail = parser.finish()
                yield from (e for e in tail if not (self.stats.stop == "length" and isinstance(e, ParseError)))
        finally:
            self._busy = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine is closed")
        if self._busy:
            raise RuntimeError("another generation of this Engine is still streaming; finish or close it first")

    def close(self) -> None:
        """Free the runtime (device memory, mapped expert files). Idempotent."""
        if not self._closed:
            self._closed = True
            self._session.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<streamrt.Engine {self.name}{' (closed)' if self._closed else ''}>"


def _sampling(sampling: Sampling | None, max_new_tokens: int | None, keys: dict) -> Sampling:
    unknown = [k for k in keys if k not in _SAMPLING_KEYS]
    if unknown:
        raise TypeError(f"unknown keyword {unknown[0]!r}; sampling takes {', '.join(_SAMPLING_KEYS)} (or sampling=)")
    if sampling is not None and not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a streamrt.Sampling, got {type(sampling).__name__}")
    if max_new_tokens is not None:
        keys = {**keys, "max_new_tokens": max_new_tokens}
    base = sampling or Sampling()
    return Sampling(**{**{k: getattr(base, k) for k in _SAMPLING_KEYS}, **keys})
