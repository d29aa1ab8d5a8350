"""`python -m streamrt.trace summarize FILE`: the same as `streamrt trace summarize FILE`."""

import sys

from streamrt.cli.main import main

raise SystemExit(main(["trace", *sys.argv[1:]]))
