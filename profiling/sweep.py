"""Throughput sweep; the code lives in streamrt/sweep.py so `streamrt sweep` runs it too."""

import sys

from streamrt.sweep import main

if __name__ == "__main__":
    sys.exit(main())
