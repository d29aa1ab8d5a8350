"""`streamrt` command line: one sub-command per module, each registering its own flags.

User errors (`StreamrtError`) print one line and exit 2 (or the error's own code); a
Ctrl-C exits 130 without a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from streamrt import __version__
from streamrt.errors import StreamrtError

# (module, what it registers). Imported lazily per module so `--help` stays fast and a
# command whose optional dependencies are missing does not break the others.
COMMAND_MODULES = (
    "streamrt.cli.run",  # run, selfcheck
    "streamrt.cli.inspect",  # inspect
    "streamrt.cli.checkpoint",  # synth, convert, verify
    "streamrt.trace",  # trace summarize
    "streamrt.sweep",  # sweep
    "streamrt.cli.serve",  # serve
)


class _Parser(argparse.ArgumentParser):
    """Usage errors (a bad flag value, an unknown flag) are one line naming the flag, exit 2,
    like every other user error: a usage dump hides the message under the flag list.
    Sub-command parsers inherit this class (argparse's `parser_class` default)."""

    def error(self, message: str):
        flag = re.fullmatch(r"argument (--[\w-]+).*: expected one argument", message)
        if flag:  # `--host-mem -5G`: argparse takes the value for a flag, so name the flag and the way out
            message = (f"{flag.group(1)} needs a value; one that starts with '-' is given as "
                       f"{flag.group(1)}=VALUE")
        self.exit(2, f"streamrt: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="streamrt",
        description="Run KimiLinear MoE models (Kimi K3, Kimi K3.1 Pro) on one GPU by streaming the "
        "routed experts from a host-side store. With no --model, `streamrt run` uses the small "
        "embedded model.",
        epilog="Quick start: streamrt run --prompt \"What is the capital of France?\"; with a tool: "
        "streamrt run --messages examples/weather.json --show-thinking",
    )
    parser.add_argument("--version", action="version", version=f"streamrt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("streamrt"):
                continue  # a command not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sweep"]:  # the sweep owns its whole flag set (see streamrt/sweep.py)
        from streamrt.sweep import main as sweep_main

        return sweep_main(argv[1:])
    try:
        parser = build_parser()  # imports torch: a Ctrl-C can land here too
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except StreamrtError as e:
        print(f"streamrt: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("streamrt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
