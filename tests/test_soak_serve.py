"""`profiling/soak_serve.py` in its small form: three clients for two minutes against `streamrt
serve` on the embedded model, every request class mixed, the engine's step randomly delayed.
No 5xx, no lost or wrong reply (each greedy reply equal to `streamrt run`'s), the server alive
and answering at the end, RSS growth under 5 %."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

SCRIPT = Path(__file__).resolve().parents[1] / "profiling" / "soak_serve.py"


def test_two_minute_soak_has_no_5xx_lost_or_wrong_reply(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(SCRIPT), "--minutes", "2", "--clients", "3", "--seed", "7", "--tokens", "6",
           "--tool-tokens", "12", "--max-batch", "4", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert (r["5xx"], r["lost"], r["wrong"]) == (0, 0, 0), r["first_errors"]
    # 130: the exit of a Ctrl-C (the soak stops the server with SIGINT)
    assert r["alive"] and r["final_request"] == "ok" and r["server_exit"] in (0, 130), r["server_stderr_tail"]
    assert r["rss"]["growth"] is not None and r["rss"]["growth"] < 0.05
    # the checks were not vacuous: greedy replies were compared against non-empty references,
    # and the fault classes reached the server
    assert all(ref["content"] or ref["thinking"] or ref["tool_calls"] for ref in r["references"].values())
    by = r["by_class"]
    assert by["normal"]["ok"] + by["stream"]["ok"] + by["slow_body"]["ok"] >= 3
    assert by["malformed"]["requests"] + by["oversized"]["requests"] + by["cancel"]["requests"] >= 1
    assert proc.returncode == 0, proc.stdout[-2000:]
