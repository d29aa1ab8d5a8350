"""Command-line values of `run`, `selfcheck` and `serve`, checked at the edge: parsed here
rather than by argparse `type=`, so a bad value is one `streamrt: …` line (exit 2) and not a
usage dump. Sampling flags, --prefill-chunk, text from the command line or stdin.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import TextIO

from streamrt.api.options import check_device
from streamrt.api.sampling import MAX_NEW_TOKENS, MAX_SEED, Sampling
from streamrt.api.session import Session
from streamrt.api.session import open_session as open_model_session
from streamrt.errors import StreamrtError
from streamrt.runtime.options import RuntimeOptions

__all__ = ["MAX_NEW_TOKENS", "MAX_SEED", "Sampling", "check_device", "check_runtime_flags", "open_session",
           "parse_float", "parse_int", "prefill_chunk", "read_user_line", "sampling_from_args", "user_text"]


def parse_int(value: str, flag: str, lo: int, hi: int | None = None) -> int:
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


def parse_float(value: str, flag: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise StreamrtError(f"{flag} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise StreamrtError(f"{flag} must be finite, got {value!r}")
    return x


def sampling_from_args(args: argparse.Namespace) -> Sampling:
    """--max-new-tokens, --temperature, --top-p, --top-k, --min-p, --repetition-penalty, --seed,
    --greedy, --ignore-eos, each checked here so the error names the flag."""
    n = parse_int(args.max_new_tokens, "--max-new-tokens", 1, MAX_NEW_TOKENS)
    t = parse_float(args.temperature, "--temperature")
    if t < 0:
        raise StreamrtError(f"--temperature must be >= 0, got {args.temperature}")
    p = parse_float(args.top_p, "--top-p")
    if not 0 < p <= 1:
        raise StreamrtError(f"--top-p must be in (0, 1], got {args.top_p}")
    seed = parse_int(args.seed, "--seed", 0, MAX_SEED)
    k = parse_int(getattr(args, "top_k", "0"), "--top-k", -(1 << 62))
    min_p = parse_float(getattr(args, "min_p", "0"), "--min-p")
    if not 0 <= min_p <= 1:
        raise StreamrtError(f"--min-p must be in [0, 1], got {args.min_p}")
    rep = parse_float(getattr(args, "repetition_penalty", "1"), "--repetition-penalty")
    if not rep > 0:
        raise StreamrtError(f"--repetition-penalty must be > 0, got {args.repetition_penalty}")
    return Sampling(n, t, p, seed, bool(args.greedy) or t == 0, bool(getattr(args, "ignore_eos", False)), k, min_p, rep)


def prefill_chunk(args: argparse.Namespace) -> int | None:
    """--prefill-chunk: tokens per chunk, or None for auto (the model picks from free memory)."""
    value = getattr(args, "prefill_chunk", "auto")
    return None if value in (None, "auto") else parse_int(value, "--prefill-chunk", 1, 1 << 20)


def check_runtime_flags(args: argparse.Namespace) -> None:
    """Validate the runtime flags up front, before a default model is built or a tree opened;
    the output files (--stats-json, --trace) too, so a bad path never costs a generation."""
    options = RuntimeOptions.from_args(args).check_output_paths()
    check_device(options.device)
    # An output written over an input (or over the other output) loses what the user had.
    inputs = [("--messages", getattr(args, "messages", None))]
    outputs = [("--stats-json", options.stats_json), ("--trace", options.trace)]
    seen: dict = {}
    for flag, path in inputs + outputs:
        if not path:
            continue
        key = os.path.realpath(os.path.expanduser(path))
        if key in seen:
            raise StreamrtError(f"{flag} {path}: the same file as {seen[key]}; give another file name")
        seen[key] = flag


def open_session(model_dir, args: argparse.Namespace, *, progress: bool) -> Session:
    """The model session the command's flags describe (runtime options, --prefill-chunk)."""
    return open_model_session(model_dir, RuntimeOptions.from_args(args), progress=progress,
                              prefill_chunk=prefill_chunk(args))
