"""The `streamrt` command line: one module per sub-command, each registering its own flags.

    main.py        the entry point: builds the parser, one-line user errors
    args.py        command-line values checked at the edge (sampling, prompts, runtime flags)
    run.py         `streamrt run`: chat framing, context policy, the chat loop
    output.py      what `run` prints (streamed text, the report, --json)
    selfcheck.py   `streamrt selfcheck`
    inspect.py     `streamrt inspect`: budgets and placement plans
    checkpoint.py  `streamrt synth`, `convert`, `verify`
    serve.py       `streamrt serve`: flags, sockets, the server on the runtime's loop
"""

from streamrt.cli.main import main

__all__ = ["main"]
