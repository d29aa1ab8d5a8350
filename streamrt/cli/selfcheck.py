"""`streamrt selfcheck`: the framed control prompt replayed N times in this process and N times
in a fresh one; PASS only if every cycle's logits_hash and top-1 id agree (exit 1 on FAIL)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from streamrt.chat import encode_chat
from streamrt.errors import StreamrtError
from streamrt.cli.args import check_runtime_flags, open_session, parse_int
from streamrt.runtime.options import add_runtime_flags
from streamrt.api.session import Session, resolve_model_dir

CONTROL_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
MAX_CYCLES = 1000


def register(sub: argparse._SubParsersAction) -> None:
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
    add_runtime_flags(s)
    s.set_defaults(func=selfcheck_command, _parser=s)


@dataclass(frozen=True)
class Cycle:
    process: int  # 1: this process, 2: the spawned one
    pid: int
    cycle: int
    logits_hash: str
    top1: int


def logits_hash(logits) -> str:
    """The model's canonical hash of the last position's fp32 logits (one definition, in the model)."""
    from streamrt.model import logits_hash as model_hash

    return str(model_hash(logits))


def run_cycles(session: Session, cycles: int, process: int) -> list[Cycle]:
    # The framed control prompt, as the model's chat is framed.
    ids = encode_chat(session.tokenizer, CONTROL_MESSAGES, thinking_effort=session.chat.thinking_effort)
    out = []
    for c in range(1, cycles + 1):
        logits = session.control_logits(ids).reshape(-1)
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
    cycles = parse_int(args.cycles, "--cycles", 1, MAX_CYCLES)
    check_runtime_flags(args)
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
