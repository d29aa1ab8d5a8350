"""`profiling/stress_determinism.py` in its CI form: every sweep knob (window, slots, policy,
staging, stage depth and cap, pool tier, evict sync, prefill chunk, batch, lockstep) and operand
alignment through the streaming runtime on the CPU twin made late (copies on a copy-stream
thread after random delays, events that complete late, destinations poisoned until their copy
ran), with random delays where mappings open and disk reads end and the page cache dropped
before each run: every logits hash equal to the direct provider's. And the stress test sees the
bugs it is there for, put back one at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "profiling" / "stress_determinism.py"


def stress(tmp_path, *flags: str) -> tuple[int, dict, str]:
    out = tmp_path / "stress.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--processes", "1", "--rounds", "1", "--load", "0",
                           "--seed", str(int.from_bytes(os.urandom(2), "little")), "--json", str(out), *flags],
                          capture_output=True, text=True, timeout=600, env=env)
    assert out.exists(), proc.stderr[-2000:]
    return proc.returncode, json.loads(out.read_text()), proc.stdout


def test_every_point_bit_identical_under_late_completions(tmp_path):
    rc, r, log = stress(tmp_path)
    assert r["comparisons"] >= 200
    assert r["differing"] == 0 and rc == 0, log


@pytest.mark.parametrize("bug,points", [("no-wait", "1,7"), ("no-retire", "1,21")])
def test_stress_sees_a_missing_wait(tmp_path, bug, points):
    """A compute that reads a slot before its copy event, or a mapping released before the
    copies queued from it ran: the CPU twin's always-complete events would hide both."""
    rc, r, log = stress(tmp_path, "--points", points, "--plant", bug)
    assert rc == 1 and r["differing"] > 0, log


def test_stress_sees_an_alignment_dependent_product(tmp_path):
    """A product whose bits depend on its weight's address modulo 64 (a BLAS with an aligned fast
    path): the point that moves every weight and slot off the 64-byte boundary sees it; the
    default point, whose operands sit where the reference's do, does not."""
    rc, r, log = stress(tmp_path, "--points", "0,28", "--plant", "align-path")
    assert rc == 1 and r["differing"] > 0, log
    assert all(p.startswith("point 28 ") for p in r["problems"]), log
