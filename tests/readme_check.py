"""Re-run the README's quoted `streamrt run` / `streamrt selfcheck` commands on the embedded
model and check what the README says they print against what they print now.

Checked exactly: every line of the reply (stdout: think channel, answer, tool call), the token
counts of the summary line (generated and prefill), the selfcheck verdict and top-1, and the
logits_hash on the class of CPU the README names for it (`cpu_class`: the host math library
picks its code path by the CPU's vector extensions, so the hash is one per class; docs/CONTRACTS.md).
Not checked: rates, seconds, memory sizes, pids, paths (they depend on the machine and its load).

    python tests/readme_check.py            # exit 0 when the README matches, 1 listing what differs
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK_INTRO = "What the embedded model answers"
SUMMARY = re.compile(r"^streamrt: (\d+) tokens, .* prefill (\d+) tokens in ")
SELFCHECK = re.compile(r"logits_hash ([0-9a-f]{16})\s+top-1 (\d+)")
HASH_CLASS = re.compile(r"selfcheck hash above\s+was printed on [^(]*\(class ([0-9a-f]{8})")
PASS = re.compile(r"^(PASS|FAIL): (\d+)/(\d+) cycles bit-identical \(logits_hash ([0-9a-f]{16}), top-1 (\d+)\)")


@dataclass
class Quoted:
    command: str  # as quoted, without "$ "
    lines: list[str] = field(default_factory=list)  # what the README shows it printing


def quoted_commands(readme: str) -> list[Quoted]:
    """The `$ streamrt ...` commands of the code block after BLOCK_INTRO, each with its output."""
    block = readme.split(BLOCK_INTRO, 1)[1].split("```", 2)[1]
    out: list[Quoted] = []
    for line in block.splitlines()[1:]:
        if line.startswith("$ "):
            out.append(Quoted(line[2:]))
        elif out and line.strip():
            out[-1].lines.append(line)
    return out


def facts(lines: list[str], stdout: list[str] | None = None) -> dict:
    """What must not change between the README and a re-run: the reply's lines (from stdout when
    given, else every line that is not a `streamrt:` status line), token counts, selfcheck results."""
    status = ("streamrt:", "selfcheck ", "  process", "  ...", "PASS", "FAIL")
    got: dict = {"reply": stdout if stdout is not None else [ln for ln in lines if not ln.startswith(status)]}
    for ln in lines:
        if m := SUMMARY.match(ln):
            got["tokens"], got["prefill"] = int(m.group(1)), int(m.group(2))
        if m := PASS.match(ln):
            got["verdict"] = (m.group(1), m.group(2), m.group(3), m.group(4), m.group(5))
        if ln.startswith("  process") and (m := SELFCHECK.search(ln)):
            got.setdefault("cycles", set()).add(m.groups())
    if "verdict" in got:
        got["reply"] = []  # selfcheck prints no reply
    return got


# A hash that moves while top-1 holds on the README's CPU class: the arithmetic changed.
HASH_HINT = " (top-1 agrees: the bits of the arithmetic moved on the CPU class that printed the README's hash)"


def cpu_class() -> tuple[str, str]:
    """(vendor and vector extensions, their 8-hex-digit digest): what the host math library's
    code path follows, from /proc/cpuinfo (the machine name elsewhere)."""
    vendor, flags = platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id":
                vendor = value.strip()
            elif key.strip() == "flags":
                flags = value.split()
                break
    except OSError:
        pass
    ext = sorted(f for f in set(flags) if f.startswith(("avx", "amx", "fma", "sse4")))
    text = " ".join([vendor, *ext])
    return text, hashlib.sha256(text.encode()).hexdigest()[:8]


def without_hash(key: str, value):
    """A selfcheck fact with its logits_hash left out (compared off the README's CPU class)."""
    if value is None:
        return None
    if key == "verdict":
        return value[:3] + value[4:]
    return {top for _, top in value} if key == "cycles" else value


def rerun(q: Quoted) -> tuple[int, dict, str]:
    argv = shlex.split(q.command)
    assert argv[0] == "streamrt", q.command
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "streamrt", *argv[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    stdout = proc.stdout.splitlines()
    lines = stdout + proc.stderr.splitlines()
    if argv[1] == "selfcheck":
        return proc.returncode, facts(lines), proc.stderr
    return proc.returncode, facts(lines, [ln for ln in stdout if ln.strip()]), proc.stderr


def check(readme_path: Path = ROOT / "README.md") -> list[str]:
    """What differs, one line each (empty: the README matches)."""
    problems = []
    readme = readme_path.read_text()
    quoted = quoted_commands(readme)
    if not quoted:
        return [f"no quoted commands found after {BLOCK_INTRO!r}"]
    named = HASH_CLASS.search(readme)
    if named is None:
        return ["the README does not name the CPU class its selfcheck hash was printed on"]
    same_class = named.group(1) == cpu_class()[1]
    for q in quoted:
        want = facts(q.lines)
        rc, got, err = rerun(q)
        if rc != 0:
            problems.append(f"$ {q.command}: exit {rc}: {(err.strip().splitlines() or [''])[-1]}")
            continue
        for key in sorted(set(want) | set(got)):
            w, g = want.get(key), got.get(key)
            if w == g:
                continue
            hash_only = key in ("verdict", "cycles") and without_hash(key, w) == without_hash(key, g)
            if hash_only and not same_class:
                continue  # another CPU class prints its own hash
            problems.append(f"$ {q.command}: {key}: README says {w!r}, now {g!r}{HASH_HINT if hash_only else ''}")
    return problems


def main() -> int:
    text, digest = cpu_class()
    print(f"CPU class {digest}: {text}")
    problems = check()
    for p in problems:
        print(p)
    print("README figures match" if not problems else f"{len(problems)} README figure(s) differ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
