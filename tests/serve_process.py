"""`streamrt serve` in a child process for the tests that talk to it over HTTP: started on a free
port, its URL and model id read from the line it prints, its stderr drained after that."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
READY = re.compile(r"serving (\S+) on (http://127\.0\.0\.1:\d+)")


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    model: str

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def start(*flags: str) -> subprocess.Popen:
    """`streamrt serve --port 0 --log-level error FLAGS` started (not yet ready: `ready`)."""
    return subprocess.Popen([sys.executable, "-m", "streamrt", "serve", "--port", "0", "--log-level", "error",
                             *flags], stderr=subprocess.PIPE, text=True, env=ENV)


def ready(proc: subprocess.Popen, startup_s: float = 180) -> Server:
    """The started server once it says where it serves; AssertionError with its output if it does not."""
    lines, deadline = [], time.monotonic() + startup_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = READY.search(line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return Server(proc, m.group(2), m.group(1))
    proc.terminate()
    raise AssertionError("server did not start:\n" + "".join(lines))


def serve(*flags: str, startup_s: float = 180) -> Server:
    return ready(start(*flags), startup_s)
