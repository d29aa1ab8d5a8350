"""What `streamrt run` prints: the reply streamed to the terminal as it is decoded (response
text, thinking on request, tool calls as JSON), one JSON object per reply with --json, and the
one-line stats report on stderr."""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import TextIO

from streamrt.chat import Reply, ResponseText, ThinkText, ToolCall
from streamrt.jsonio import dumps_text
from streamrt.api.sampling import Sampling
from streamrt.api.session import GenStats



# ---- run ------------------------------------------------------------------------------------


def call_json(call: ToolCall, idx: int) -> dict:
    """A tool call as `run` prints it, with the id the server gives it: `functions.NAME:IDX`,
    IDX counting the conversation's calls from 0."""
    return {"id": f"functions.{call.name}:{idx}", "name": call.name, "arguments": call.arguments}


class StreamPrinter:
    """Chat events -> terminal: response text as it comes, thinking on request, calls as JSON."""

    def __init__(self, out: TextIO, *, show_thinking: bool, call_base: int = 0):
        self.out = out
        self.next_call = call_base
        self.show_thinking = show_thinking
        self.in_think = False
        self.at_line_start = True

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
            self.at_line_start = text.endswith("\n")

    def _end_think(self) -> None:
        if self.in_think:
            self._write(("" if self.at_line_start else "\n") + "</think>\n")
            self.in_think = False

    def event(self, e) -> None:
        if isinstance(e, ThinkText):
            if self.show_thinking:
                if not self.in_think:
                    self._write("<think>\n")
                    self.in_think = True
                self._write(e.text)
        elif isinstance(e, ResponseText):
            self._end_think()
            self._write(e.text)
        elif isinstance(e, ToolCall):
            self._end_think()
            if not self.at_line_start:
                self._write("\n")
            self._write(dumps_text({"tool_call": call_json(e, self.next_call)}) + "\n")
            self.next_call += 1

    def finish(self) -> None:
        self._end_think()
        if not self.at_line_start:
            self._write("\n")



def reply_json(name: str, reply: Reply, stats: GenStats, call_base: int = 0) -> str:
    return dumps_text(
        {
            "model": name,
            "thinking": reply.thinking,
            "content": reply.content,
            "tool_calls": [call_json(c, call_base + n) for n, c in enumerate(reply.tool_calls)],
            "parse_errors": reply.errors,
            "finish_reason": "tool_calls" if reply.tool_calls else ("length" if reply.truncated else stats.stop),
            "stats": {**asdict(stats), "decode_tok_s": stats.decode_rate},
        }
    )


def cut_note(stats: GenStats, sampling: Sampling) -> str | None:
    """Why a reply ended without its stop token: the token budget, or the model's context."""
    if stats.stop != "length":
        return None
    if stats.new_tokens >= sampling.max_new_tokens:
        return f"reply cut at --max-new-tokens {sampling.max_new_tokens}"
    return (f"reply cut at the model's context: prompt {stats.prompt_tokens} + reply {stats.new_tokens} tokens "
            f"reach its limit of {stats.prompt_tokens + stats.new_tokens} (max_position_embeddings)")


def report(reply: Reply, stats: GenStats, sampling: Sampling) -> None:
    note = cut_note(stats, sampling)
    if note and (reply.truncated or stats.new_tokens < sampling.max_new_tokens):
        print(f"streamrt: {note}", file=sys.stderr)
    if reply.errors:
        print(
            f"streamrt: {len(reply.errors)} malformed frame(s) in the model output (first: {reply.errors[0]})",
            file=sys.stderr,
        )
    print(f"streamrt: {stats.line()}", file=sys.stderr)
