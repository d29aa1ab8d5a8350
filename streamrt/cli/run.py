"""`streamrt run`: generate in XTML chat frames from a prompt, an interactive chat or a messages
file, and register `streamrt selfcheck` (`streamrt.cli.selfcheck`) beside it.

The command talks to the model through one small `Session` (`streamrt.api.session`); its flags are
checked in `streamrt.cli.args`, its output printed by `streamrt.cli.output`. What is left here
is chat framing: the history, the context-length policy, the chat loop.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from streamrt.api.session import GenStats, Session, resolve_model_dir
from streamrt.chat import ChatParser, ParseError, Reply, encode_chat, load_messages_file
from streamrt.cli import selfcheck
from streamrt.cli.args import (Sampling, check_runtime_flags, open_session, parse_int, prefill_chunk, read_user_line,
                               sampling_from_args, user_text)
from streamrt.chat.tools import prior_calls
from streamrt.cli.output import StreamPrinter, cut_note, report, reply_json
from streamrt.errors import StreamrtError
from streamrt.runtime.options import add_runtime_flags

__all__ = ["GenStats", "Session", "Sampling", "fit_context", "open_session", "parse_int", "read_user_line",
           "register", "resolve_model_dir", "run_command", "user_text"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="generate from a model (prompt, interactive chat or a messages file)",
        description="Generate with a converted streamrt tree (--model DIR) or, without --model, the "
        "small embedded default model. Output streams as it is decoded; tool calls print as JSON.",
    )
    p.add_argument("--model", metavar="DIR", help="converted streamrt tree (default: the embedded model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", metavar="TEXT", help="one user message")
    src.add_argument("--chat", action="store_true", help="interactive: one user message per stdin line")
    src.add_argument("--messages", metavar="FILE.json",
                     help='OpenAI-style messages (a list, or {"messages", "tools"}), checked as the server checks them')
    p.add_argument("--system", metavar="TEXT", help="a system message before the conversation")
    p.add_argument("--no-thinking", action="store_true", help="answer without the think channel")
    p.add_argument("--show-thinking", action="store_true", help="print the think channel too")
    p.add_argument("--json", action="store_true", help="machine-readable output (one JSON object per reply)")
    p.add_argument("--max-new-tokens", default="256", metavar="N", help="at most N generated tokens (default 256)")
    p.add_argument("--temperature", default="0", metavar="T",
                   help="sampling temperature >= 0 (default 0: greedy, the same answer every time; "
                        "> 0 samples with --top-p and --seed)")
    p.add_argument("--top-p", default="0.95", metavar="P", help="nucleus mass in (0, 1] (default 0.95)")
    p.add_argument("--top-k", default="0", metavar="K",
                   help="keep the K most probable tokens (default 0: off; as vLLM's)")
    p.add_argument("--min-p", default="0", metavar="P",
                   help="drop tokens below P times the most probable one's probability, P in [0, 1] (default 0: off)")
    p.add_argument("--repetition-penalty", default="1", metavar="R",
                   help="> 0: logits of tokens in the prompt or reply divided by R when positive, multiplied "
                        "when negative (default 1: off; as vLLM's and llama-server's)")
    p.add_argument("--seed", default="0", metavar="S", help="sampling seed (default 0)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the end-of-turn / end-of-text tokens: always generate --max-new-tokens "
                        "(for benchmarks, as llama.cpp's --ignore-eos)")
    p.add_argument("--truncate", choices=("left",),
                   help="a prompt longer than the model's context (max_position_embeddings) is refused; "
                        "'left' keeps its last tokens instead")
    p.add_argument("--prefill-chunk", default="auto", metavar="N",
                   help="prompt tokens per prefill chunk (default auto: from free memory, 64..4096); "
                        "changes time and peak memory, never the logits on the torch backend")
    p.add_argument("--gpus", default=None, metavar="N",
                   help="expert parallelism: N processes, one per GPU, the routed experts sharded over them "
                        "(one all-reduce per MoE layer; the same tokens and logits as one process); "
                        "under torchrun the ranks come from its environment")
    add_runtime_flags(p)
    p.set_defaults(func=run_command)
    selfcheck.register(sub)


def _one_reply(session: Session, ids: list[int], sampling: Sampling, thinking: bool, printer: StreamPrinter | None):
    parser = ChatParser.for_generation(session.tokenizer, thinking=thinking)
    reply = Reply()

    def on_token(t: int) -> None:
        for e in parser.feed(t):
            reply.add(e)
            if printer is not None:
                printer.event(e)

    stats = session.generate(ids, sampling, on_token)
    if not reply.ended:
        tail = parser.finish()
        if stats.stop == "length":
            reply.truncated = True  # an open frame at the token limit is expected, not malformed
            tail = [e for e in tail if not isinstance(e, ParseError)]
        for e in tail:
            reply.add(e)
    if printer is not None:
        printer.finish()
    return reply, stats


def fit_context(ids: list[int], context: int | None, truncate: str | None, reserve: int = 0) -> list[int]:
    """The context-length policy: a prompt longer than the model's context is refused
    before any work, naming both numbers, or with --truncate left keeps its last tokens, leaving
    `reserve` positions (at most half the context) for the reply. Generation stops at the context."""
    if context is None or len(ids) <= context:
        return ids
    if truncate == "left":
        return ids[-(context - min(reserve, context // 2)):]
    raise StreamrtError(f"prompt is {len(ids)} tokens but the model's context is {context} tokens "
                        f"(max_position_embeddings); shorten it or pass --truncate left")


def run_command(args: argparse.Namespace) -> int:
    sampling = sampling_from_args(args)
    check_runtime_flags(args)
    prefill_chunk(args)  # flag errors before any loading
    thinking = not args.no_thinking
    tools = None
    history: list[dict] = [{"role": "system", "content": user_text(args.system, "--system")}] if args.system else []
    if args.messages is not None:
        if not args.messages:
            raise StreamrtError("--messages: empty path; give a FILE.json")
        messages, tools = load_messages_file(args.messages)
        history += messages
    elif args.prompt is not None:
        if not args.prompt.strip():  # as --chat skips an empty line: an unset shell variable, not a question
            raise StreamrtError("--prompt is empty; give the text of a user message")
        history.append({"role": "user", "content": user_text(args.prompt, "--prompt")})
    elif not args.chat:
        raise StreamrtError("give --prompt TEXT, --chat or --messages FILE.json")
    model_dir = resolve_model_dir(args.model, lambda m: print(m, file=sys.stderr))
    if not args.chat and getattr(args, "prefix_cache_mem", None) is None:
        args.prefix_cache_mem = "0"  # one request: no later one resumes from its snapshots
    if args.gpus is not None and "RANK" not in os.environ:  # spawn the ranks; each runs this command
        from streamrt.parallel.launch import check_gpus, run_ranks

        if args.chat:
            raise StreamrtError("--chat with --gpus is not supported yet (give --prompt or --messages)")
        return run_ranks(run_command, args, check_gpus(args.gpus))
    session = open_session(model_dir, args, progress=not args.json)
    try:
        return _run(session, history, tools, sampling, thinking, args)
    finally:
        session.close()


def _run(session, history, tools, sampling, thinking, args) -> int:
    if args.chat:
        session.load()  # a bad tree or budget before the first line is typed
        return _chat_loop(session, history, sampling, thinking, args, sys.stdin)
    ids = encode_chat(session.tokenizer, history, tools, thinking=thinking,
                      thinking_effort=session.chat.thinking_effort)
    ids = fit_context(ids, session.context, getattr(args, "truncate", None), sampling.max_new_tokens)
    base = prior_calls(history)
    printer = None if args.json else StreamPrinter(sys.stdout, show_thinking=args.show_thinking, call_base=base)
    reply, stats = _one_reply(session, ids, sampling, thinking, printer)
    if args.json:
        print(reply_json(session.name, reply, stats, base))
        if (note := cut_note(stats, sampling)) and stats.new_tokens < sampling.max_new_tokens:
            print(f"streamrt: {note}", file=sys.stderr)  # the context, which --json's "length" does not tell
    else:
        report(reply, stats, sampling)
    return 0


def _chat_loop(session, history, sampling, thinking, args, stdin: TextIO) -> int:
    """One user message per input line; the whole history is re-framed every turn, unless the
    model's tree says it was trained on one exchange per conversation (`ChatProfile.multi_turn`):
    such a model answers a second question from the first (the embedded one did: "capital of
    Egypt?" after Spain gave Madrid), so each line is framed on its own. Ctrl-C ends the reply."""
    tty = stdin.isatty()
    if tty and not args.json:
        print("streamrt: chat with the model; empty line skips, /reset clears history, /exit or Ctrl-D quits",
              file=sys.stderr)
    if not session.chat.multi_turn and not args.json:
        print("streamrt: this model was trained on single exchanges (streamrt_chat.multi_turn false in its "
              "tokenizer_config.json); each line starts a new conversation", file=sys.stderr)
    base = list(history)
    turn = 0
    while True:
        if tty:
            print("> ", end="", file=sys.stderr, flush=True)
        line = read_user_line(stdin)
        if line is None:  # EOF
            break
        if isinstance(line, StreamrtError):  # undecodable input: this line only, not the session
            print(f"streamrt: {line}; line ignored", file=sys.stderr, flush=True)
            continue
        text = line.rstrip("\n")
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            history[:] = list(base)
            continue
        if not text.strip():
            continue
        turn += 1
        if not session.chat.multi_turn:
            history[:] = list(base)
        history.append({"role": "user", "content": text})
        ids = encode_chat(session.tokenizer, history, thinking=thinking, thinking_effort=session.chat.thinking_effort)
        try:
            ids = fit_context(ids, session.context, getattr(args, "truncate", None), sampling.max_new_tokens)
        except StreamrtError as exc:  # this turn only, not the session
            history.pop()
            print(f"streamrt: {exc}; line ignored", file=sys.stderr, flush=True)
            continue
        calls = prior_calls(history)
        printer = None if args.json else StreamPrinter(sys.stdout, show_thinking=args.show_thinking, call_base=calls)
        try:
            reply, stats = _one_reply(session, ids, sampling, thinking, printer)
        except KeyboardInterrupt:  # the reply, not the session: drop the unanswered question
            if printer is not None:
                printer.finish()
            history.pop()
            print("streamrt: reply interrupted", file=sys.stderr, flush=True)
            continue
        history.append(reply.to_message())
        if args.json:
            print(reply_json(session.name, reply, stats, calls), flush=True)
        else:
            report(reply, stats, sampling)
    return 0
