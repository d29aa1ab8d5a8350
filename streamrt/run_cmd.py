"""`streamrt run` (generate in XTML chat frames) and `streamrt selfcheck` (bit-exact replay).

The commands talk to the model through one small `Session` (tokenizer, generate with a
per-token callback, last-position logits of a prompt); everything else here is argument
checking, chat framing and printing. Flag values are parsed here rather than by argparse
`type=`, so a bad value is one `streamrt: …` line (exit 2) and not a usage dump.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, TextIO

from streamrt.chat import (
    ChatParser,
    ChatProfile,
    ParseError,
    Reply,
    ResponseText,
    ThinkText,
    ToolCall,
    encode_chat,
    load_messages_file,
)
from streamrt.errors import StreamrtError
from streamrt.tokenizer import Tokenizer

CONTROL_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
# Test hook only: when set, selfcheck perturbs each cycle's logits differently, so the
# suite can prove that selfcheck notices nondeterminism. Nothing else reads it.
NOISE_ENV = "_STREAMRT_TEST_SELFCHECK_NOISE"


# ---- flags --------------------------------------------------------------------------------


def _runtime_flags(p: argparse.ArgumentParser) -> None:
    try:
        from streamrt.runtime.options import add_runtime_flags
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("streamrt"):
            raise
        return  # runtime not built yet: the commands run with its defaults
    add_runtime_flags(p)


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
    src.add_argument("--messages", metavar="FILE.json", help='OpenAI-style messages (a list, or {"messages", "tools"})')
    p.add_argument("--system", metavar="TEXT", help="a system message before the conversation")
    p.add_argument("--no-thinking", action="store_true", help="answer without the think channel")
    p.add_argument("--show-thinking", action="store_true", help="print the think channel too")
    p.add_argument("--json", action="store_true", help="machine-readable output (one JSON object per reply)")
    p.add_argument("--max-new-tokens", default="256", metavar="N", help="at most N generated tokens (default 256)")
    p.add_argument("--temperature", default="0", metavar="T",
                   help="sampling temperature >= 0 (default 0: greedy, the same answer every time; "
                        "> 0 samples with --top-p and --seed)")
    p.add_argument("--top-p", default="0.95", metavar="P", help="nucleus mass in (0, 1] (default 0.95)")
    p.add_argument("--seed", default="0", metavar="S", help="sampling seed (default 0)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    p.add_argument("--truncate", choices=("left",),
                   help="a prompt longer than the model's context (max_position_embeddings) is refused; "
                        "'left' keeps its last tokens instead")
    p.add_argument("--prefill-chunk", default="auto", metavar="N",
                   help="prompt tokens per prefill chunk (default auto: from free memory, 64..4096); "
                        "changes time and peak memory, never the logits on the torch backend")
    _runtime_flags(p)
    p.set_defaults(func=run_command)

    s = sub.add_parser(
        "selfcheck",
        help="bit-exact replay of a framed control prompt, in one process and across processes",
        description="Run the framed control prompt N times in this process and N times in a fresh "
        "process; print each cycle's logits_hash and top-1 id. PASS only if all are identical; exit 1 on FAIL.",
    )
    s.add_argument("--model", metavar="DIR", help="converted streamrt tree (default: the embedded model)")
    s.add_argument("--cycles", default="3", metavar="N", help="cycles per process (default 3)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the cross-process half
    _runtime_flags(s)
    s.set_defaults(func=selfcheck_command, _parser=s)


def _check_runtime_flags(args: argparse.Namespace) -> None:
    """Validate the runtime flags up front, before a default model is built or a tree opened;
    the output files (--stats-json, --trace) too, so a bad path never costs a generation."""
    try:
        from streamrt.runtime.options import RuntimeOptions
    except ModuleNotFoundError:
        return
    RuntimeOptions.from_args(args).check_output_paths()


MAX_SEED = 2**44 - 1  # generate seeds row r with seed * 1_000_003 + r, which must fit torch's 64 bits
MAX_NEW_TOKENS = 1 << 20  # the longest context any supported model has
MAX_CYCLES = 1000


def _int(value: str, flag: str, lo: int, hi: int | None = None) -> int:
    text = str(value)
    if len(text) > 40:  # int() of a 10^6-digit string is slow and its error is a traceback
        raise StreamrtError(f"{flag} must be an integer of at most 40 characters, got {text[:20]}...")
    try:
        n = int(text)
    except (TypeError, ValueError):
        raise StreamrtError(f"{flag} must be an integer, got {text!r}") from None
    if n < lo:
        raise StreamrtError(f"{flag} must be >= {lo}, got {n}")
    if hi is not None and n > hi:
        raise StreamrtError(f"{flag} must be at most {hi}, got {n}")
    return n


def user_text(text: str, flag: str) -> str:
    """Text from the command line or stdin, checked at the edge: undecodable bytes (which
    Python carries as lone surrogates) are one line naming the flag and the byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        what = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"character U+{ch:04X}"
        raise StreamrtError(f"{flag}: not valid UTF-8 ({what} at position {e.start}); "
                            "give the text in UTF-8") from None
    return text


def read_user_line(stdin: TextIO) -> "str | StreamrtError | None":
    """One line of --chat input: the text, None at EOF, or (not raised) a StreamrtError saying
    why the line cannot be used (not UTF-8), so the caller rejects that line and goes on.
    Reads bytes when the stream has them, so a bad byte costs only its own line."""
    raw = getattr(stdin, "buffer", None)
    try:
        line = raw.readline().decode("utf-8") if raw is not None else stdin.readline()
    except UnicodeDecodeError as e:
        return StreamrtError(f"chat input not valid UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})")
    if not line:
        return None
    try:
        return user_text(line, "chat input")
    except StreamrtError as e:
        return e


def _float(value: str, flag: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise StreamrtError(f"{flag} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise StreamrtError(f"{flag} must be finite, got {value!r}")
    return x


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    greedy: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Sampling":
        n = _int(args.max_new_tokens, "--max-new-tokens", 1, MAX_NEW_TOKENS)
        t = _float(args.temperature, "--temperature")
        if t < 0:
            raise StreamrtError(f"--temperature must be >= 0, got {args.temperature}")
        p = _float(args.top_p, "--top-p")
        if not 0 < p <= 1:
            raise StreamrtError(f"--top-p must be in (0, 1], got {args.top_p}")
        seed = _int(args.seed, "--seed", 0, MAX_SEED)
        return cls(n, t, p, seed, bool(args.greedy) or t == 0)


# ---- model ----------------------------------------------------------------------------------


def resolve_model_dir(model: str | None, notice: Callable[[str], None]) -> Path:
    """The streamrt tree to run: `--model DIR`, checked here so the error names the directory."""
    if model is None:
        from streamrt.default_model import default_model_dir

        return default_model_dir(notice)
    path = Path(model).expanduser()
    if not path.exists():
        raise StreamrtError(f"--model {model}: no such directory")
    if not path.is_dir():
        raise StreamrtError(f"--model {model}: not a directory (give a converted streamrt tree)")
    if not (path / "manifest.json").is_file():
        if (path / "config.json").is_file():
            raise StreamrtError(
                f"--model {model}: a release checkpoint, not a streamrt tree; convert it first: "
                f"streamrt convert {model} OUT_DIR"
            )
        raise StreamrtError(f"--model {model}: no manifest.json (not a converted streamrt tree)")
    return path


@dataclass
class GenStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop: str = "length"  # "stop" (a stop token) or "length" (--max-new-tokens)
    hits: dict = field(default_factory=dict)  # e.g. {"device": 0.41, "host": 0.98}
    logits_hash: str = ""  # over the prefill's and every decode step's logits: any divergence shows

    @property
    def decode_rate(self) -> float:
        # The first new token comes from the prefill; the decode steps make the rest.
        return max(0, self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def line(self) -> str:
        hits = ", ".join(f"{k} {v:.1%}" for k, v in self.hits.items()) or "n/a"
        return (
            f"{self.new_tokens} tokens, {self.decode_rate:.2f} tok/s decode; prefill {self.prompt_tokens} tokens "
            f"in {self.prefill_s:.2f} s; expert hit rate: {hits}"
        )


class Session:
    """A loaded model: what `run` and `selfcheck` need from the runtime."""

    name: str
    tokenizer: Tokenizer
    chat: ChatProfile = ChatProfile()  # the framing the model was trained with (its tree says)
    context: int | None = None  # the model's context (max_position_embeddings), None: unchecked

    def generate(self, ids: list[int], sampling: Sampling, on_token: Callable[[int], None]) -> GenStats:
        raise NotImplementedError

    def control_logits(self, ids: list[int]):
        """fp32 logits [V] of the last prompt position, from a fresh state."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def open_session(model_dir: Path, args: argparse.Namespace, *, progress: bool) -> Session:
    return _ModelSession(model_dir, args, progress=progress)


class _ModelSession(Session):
    """The real runtime: tree -> model -> StreamingRuntime (host + device tiers) -> generate."""

    def __init__(self, model_dir: Path, args: argparse.Namespace, *, progress: bool):
        try:
            from streamrt.checkpoint.reader import open_tree
            from streamrt.loader import load_model
            from streamrt.runtime.options import RuntimeOptions
            from streamrt.runtime.scheduler import StreamingRuntime
            from streamrt.runtime.streams import make_device
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("streamrt"):
                raise
            raise StreamrtError(f"model runtime unavailable in this build ({exc.name} is missing)") from None
        from streamrt.tokenizer import load_tokenizer

        self.options = RuntimeOptions.from_args(args)  # flag errors before any loading
        with _LoadBar(enabled=progress, desc=f"loading {model_dir.name}", total=3) as bar:
            tree = open_tree(model_dir)
            self.name = tree.config.name
            self.tokenizer = load_tokenizer(tree.root, tree.config.vocab_size, tree.config.eos_token_id)
            self.chat = ChatProfile.from_tree(tree.root)
            bar.step("dense weights")
            device = make_device(self.options.device)
            self.model = load_model(tree, device.torch_device, backend=self.options.make_backend(device))
            self.model.prefill_chunk = prefill_chunk(args)
            self.context = tree.config.max_position_embeddings
            bar.step("expert store")
            from streamrt.trace import make_tracer

            self.tracer = make_tracer(bool(self.options.trace))
            self.runtime = StreamingRuntime(tree, self.model, self.options, device=device, tracer=self.tracer)
            print(f"streamrt: {self.runtime.host_tier_line}", file=sys.stderr)
            bar.step("ready")

    def _runner(self):
        """generate's forward driver: the first forward is the prefill, each later one a decode step."""
        calls = [0]

        def run(gen):
            calls[0] += 1
            if calls[0] == 1:
                logits = self.runtime.run(gen, tokens=0)
                # The counters describe decoding: the prefill's compulsory misses would hide the
                # steady state the window and cache sizes are chosen for.
                self.runtime.reset_stats()
                return logits
            return self.runtime.run(gen, tokens=1)

        return run

    def control_logits(self, ids):
        import torch

        cache = self.model.new_cache()
        x = torch.tensor(ids, dtype=torch.long)
        with torch.no_grad():
            return self.runtime.run(self.model.forward_steps(x, cache, last_only=True)).reshape(-1).float()

    def generate(self, ids, sampling, on_token):
        from streamrt.generate import generate

        r = generate(
            self.model,
            ids,
            runner=self._runner(),
            max_new_tokens=sampling.max_new_tokens,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            stop_ids=sorted(self.tokenizer.stop_ids),
            on_token=on_token,
            hash_steps=True,
            max_context=self.context,
        )
        st = self.runtime.stats
        hits = {}
        for tier in ("device", "host"):
            h, m = getattr(st, f"{tier}_hits"), getattr(st, f"{tier}_misses")
            if h + m:
                hits[tier] = h / (h + m)
        digest = hashlib.sha256(" ".join(r.prefill_hashes + [h for row in r.step_hashes for h in row]).encode())
        return GenStats(len(ids), r.new_tokens, r.prefill_s, r.decode_s, r.stop, hits, digest.hexdigest()[:16])

    def close(self) -> None:
        if self.options.stats_json:
            self.runtime.write_stats()
        if self.options.trace:
            self.tracer.write(self.options.trace)
        self.runtime.close()


class _LoadBar:
    """A tqdm bar on stderr over the loading stages; silent when not a terminal or in --json mode."""

    def __init__(self, *, enabled: bool, desc: str, total: int):
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(desc=desc, total=total, file=sys.stderr, leave=False, bar_format="{desc}: {bar} {n}/{total} {postfix}")

    def step(self, what: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(what, refresh=False)
            self._bar.update(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.close()


# ---- run ------------------------------------------------------------------------------------


class _StreamPrinter:
    """Chat events -> terminal: response text as it comes, thinking on request, calls as JSON."""

    def __init__(self, out: TextIO, *, show_thinking: bool):
        self.out = out
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
            call = {"name": e.name, "index": e.index, "arguments": e.arguments}
            self._write(json.dumps({"tool_call": call}, ensure_ascii=False) + "\n")

    def finish(self) -> None:
        self._end_think()
        if not self.at_line_start:
            self._write("\n")


def _one_reply(session: Session, ids: list[int], sampling: Sampling, thinking: bool, printer: _StreamPrinter | None):
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


def _reply_json(session: Session, reply: Reply, stats: GenStats) -> str:
    return json.dumps(
        {
            "model": session.name,
            "thinking": reply.thinking,
            "content": reply.content,
            "tool_calls": [{"name": c.name, "index": c.index, "arguments": c.arguments} for c in reply.tool_calls],
            "parse_errors": reply.errors,
            "finish_reason": "tool_calls" if reply.tool_calls else ("length" if reply.truncated else stats.stop),
            "stats": {**asdict(stats), "decode_tok_s": stats.decode_rate},
        },
        ensure_ascii=False,
    )


def _report(reply: Reply, stats: GenStats, sampling: Sampling) -> None:
    if reply.truncated:
        print(f"streamrt: reply cut at --max-new-tokens {sampling.max_new_tokens}", file=sys.stderr)
    if reply.errors:
        print(
            f"streamrt: {len(reply.errors)} malformed frame(s) in the model output (first: {reply.errors[0]})",
            file=sys.stderr,
        )
    print(f"streamrt: {stats.line()}", file=sys.stderr)


def prefill_chunk(args: argparse.Namespace) -> int | None:
    """--prefill-chunk: tokens per chunk, or None for auto (the model picks from free memory)."""
    value = getattr(args, "prefill_chunk", "auto")
    return None if value in (None, "auto") else _int(value, "--prefill-chunk", 1, 1 << 20)


def fit_context(ids: list[int], context: int | None, truncate: str | None, reserve: int = 0) -> list[int]:
    """The context-length policy (issue 26): a prompt longer than the model's context is refused
    before any work, naming both numbers, or with --truncate left keeps its last tokens, leaving
    `reserve` positions (at most half the context) for the reply. Generation stops at the context."""
    if context is None or len(ids) <= context:
        return ids
    if truncate == "left":
        return ids[-(context - min(reserve, context // 2)):]
    raise StreamrtError(f"prompt is {len(ids)} tokens but the model's context is {context} tokens "
                        f"(max_position_embeddings); shorten it or pass --truncate left")


def run_command(args: argparse.Namespace) -> int:
    sampling = Sampling.from_args(args)
    _check_runtime_flags(args)
    prefill_chunk(args)  # flag errors before any loading
    thinking = not args.no_thinking
    tools = None
    history: list[dict] = [{"role": "system", "content": user_text(args.system, "--system")}] if args.system else []
    if args.messages:
        messages, tools = load_messages_file(args.messages)
        history += messages
    elif args.prompt is not None:
        history.append({"role": "user", "content": user_text(args.prompt, "--prompt")})
    elif not args.chat:
        raise StreamrtError("give --prompt TEXT, --chat or --messages FILE.json")
    model_dir = resolve_model_dir(args.model, lambda m: print(m, file=sys.stderr))
    session = open_session(model_dir, args, progress=not args.json)
    try:
        return _run(session, history, tools, sampling, thinking, args)
    finally:
        session.close()


def _run(session, history, tools, sampling, thinking, args) -> int:
    if args.chat:
        return _chat_loop(session, history, sampling, thinking, args, sys.stdin)
    ids = encode_chat(session.tokenizer, history, tools, thinking=thinking, thinking_effort=session.chat.thinking_effort)
    ids = fit_context(ids, session.context, getattr(args, "truncate", None), sampling.max_new_tokens)
    printer = None if args.json else _StreamPrinter(sys.stdout, show_thinking=args.show_thinking)
    reply, stats = _one_reply(session, ids, sampling, thinking, printer)
    if args.json:
        print(_reply_json(session, reply, stats))
    else:
        _report(reply, stats, sampling)
    return 0


def _chat_loop(session, history, sampling, thinking, args, stdin: TextIO) -> int:
    """One user message per input line; the whole history is re-framed every turn, unless the
    model's tree says it was trained on one exchange per conversation (`ChatProfile.multi_turn`):
    such a model answers a second question from the first (the embedded one did: "capital of
    Egypt?" after Spain gave Madrid), so each line is framed on its own. Ctrl-C ends the reply."""
    tty = stdin.isatty()
    if tty and not args.json:
        print("streamrt: chat with the model; empty line skips, /reset clears history, /exit or Ctrl-D quits", file=sys.stderr)
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
        printer = None if args.json else _StreamPrinter(sys.stdout, show_thinking=args.show_thinking)
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
            print(_reply_json(session, reply, stats), flush=True)
        else:
            _report(reply, stats, sampling)
    return 0


# ---- selfcheck ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cycle:
    process: int  # 1: this process, 2: the spawned one
    pid: int
    cycle: int
    logits_hash: str
    top1: int


def logits_hash(logits) -> str:
    """The model's canonical hash of the last position's fp32 logits (one definition, in the model)."""
    try:
        from streamrt.model import logits_hash as model_hash
    except ImportError:
        from streamrt.model.model import logits_hash as model_hash
    return str(model_hash(logits))


def _test_noise(logits, cycle: int):
    """Nondeterminism injected only under NOISE_ENV (tests): a different nudge per cycle and process."""
    if not os.environ.get(NOISE_ENV):
        return logits
    import torch

    g = torch.Generator().manual_seed(os.getpid() * 1000 + cycle)
    return logits + 1e-3 * torch.randn(logits.shape, generator=g, dtype=logits.dtype).to(logits.device)


def run_cycles(session: Session, cycles: int, process: int) -> list[Cycle]:
    # The framed control prompt, as the model's chat is framed.
    ids = encode_chat(session.tokenizer, CONTROL_MESSAGES, thinking_effort=session.chat.thinking_effort)
    out = []
    for c in range(1, cycles + 1):
        logits = _test_noise(session.control_logits(ids).reshape(-1), c)
        out.append(Cycle(process, os.getpid(), c, logits_hash(logits), int(logits.argmax())))
    return out


def _forwarded_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The runtime flags of this invocation, rebuilt for the child process."""
    own = {"model", "cycles", "json", "child", "help", "func", "_parser"}
    argv: list[str] = []
    for a in parser._actions:
        if not a.option_strings or a.dest in own:
            continue
        value = getattr(args, a.dest, a.default)
        if value == a.default:
            continue
        flag = a.option_strings[-1]
        if a.nargs == 0:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def child_cycles(model_dir: Path, cycles: int, extra: list[str]) -> list[Cycle]:
    """The same cycles in a fresh interpreter: catches state that survives only within a process."""
    cmd = [sys.executable, "-m", "streamrt", "selfcheck", "--model", str(model_dir), "--cycles", str(cycles)]
    proc = subprocess.run(cmd + ["--json", "--child", *extra], capture_output=True, text=True)
    try:
        data = json.loads(proc.stdout)
        return [Cycle(2, c["pid"], c["cycle"], c["logits_hash"], c["top1"]) for c in data["cycles"]]
    except (ValueError, KeyError, TypeError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise StreamrtError(f"selfcheck child process failed (exit {proc.returncode}): {last}") from None


def selfcheck_command(args: argparse.Namespace) -> int:
    cycles = _int(args.cycles, "--cycles", 1, MAX_CYCLES)
    _check_runtime_flags(args)
    model_dir = resolve_model_dir(args.model, lambda m: print(m, file=sys.stderr))
    session = open_session(model_dir, args, progress=not (args.json or args.child))
    try:
        results = run_cycles(session, cycles, 1)
    finally:
        session.close()
    if args.child:
        print(json.dumps({"cycles": [asdict(r) for r in results]}))
        return 0
    results += child_cycles(model_dir, cycles, _forwarded_flags(args._parser, args))
    outcomes = {(r.logits_hash, r.top1) for r in results}
    passed = len(outcomes) == 1
    if args.json:
        print(json.dumps({"model": session.name, "tree": str(model_dir), "result": "PASS" if passed else "FAIL",
                          "cycles": [asdict(r) for r in results]}))
    else:
        print(f"selfcheck {session.name} ({model_dir}): framed control prompt, {cycles} cycle(s) x 2 processes")
        for r in results:
            print(f"  process {r.process} (pid {r.pid}) cycle {r.cycle}: logits_hash {r.logits_hash}  top-1 {r.top1}")
        if passed:
            h, t = outcomes.pop()
            print(f"PASS: {len(results)}/{len(results)} cycles bit-identical (logits_hash {h}, top-1 {t})")
        else:
            print(f"FAIL: {len(outcomes)} different outcomes over {len(results)} cycles")
    return 0 if passed else 1

