"""`streamrt run` in a terminal (a pty): the loading bar is gone when the run ends and every
line written meanwhile is whole (a line printed under the bar once lost its first letter)."""

from __future__ import annotations

import os
import select
import sys

import pytest

pty = pytest.importorskip("pty")


def _in_a_pty(argv: list[str], timeout: float = 300) -> bytes:
    pid, fd = pty.fork()
    if pid == 0:  # the child: a 100-column terminal, as a user's
        import fcntl
        import struct
        import termios

        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        os.execvpe(argv[0], argv, {**os.environ, "TERM": "xterm"})
    out = b""
    while True:
        try:
            ready, _, _ = select.select([fd], [], [], timeout)
            chunk = os.read(fd, 65536) if ready else b""
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    return out


def _screen(raw: bytes) -> list[str]:
    """What a terminal shows: carriage return rewinds the line, later characters overwrite
    earlier ones, newline moves on. (The run writes no cursor escapes; any would show here.)"""
    lines, line, col = [], [], 0
    for ch in raw.decode("utf-8", "replace"):
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        else:
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
    if "".join(line).strip():
        lines.append("".join(line).rstrip())
    return lines


def test_run_in_a_terminal_leaves_no_bar_and_no_cut_line():
    raw = _in_a_pty([sys.executable, "-m", "streamrt", "run", "--prompt", "hi", "--max-new-tokens", "2"])
    assert "\x1b" not in raw.decode("utf-8", "replace")
    screen = _screen(raw)
    assert screen, raw
    assert not any("loading" in line for line in screen), screen
    said = [line for line in screen if "treamrt:" in line]
    assert any("host tier" in line for line in said), screen
    assert all(line.startswith("streamrt: ") for line in said), screen
