"""kill -9 in the middle of `streamrt convert`, then re-run: the tree must verify and equal a
clean conversion file for file. The kill is made deterministic by a test hook
(STREAMRT_TEST_KILL_AFTER_BYTES: the process SIGKILLs itself once that many bytes are
written) with one worker, placed mid-way through an expert file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from streamrt.checkpoint.convert import KILL_ENV, convert
from streamrt.checkpoint.expert_file import ExpertLayout
from streamrt.checkpoint.fileio import is_tmp
from streamrt.checkpoint.synth import synth
from streamrt.checkpoint.verify import verify_tree
from streamrt.config import load_config


def _convert_cli(src, dst, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "streamrt", "convert", str(src), str(dst), "--workers", "1", "--no-progress"],
        env=env, capture_output=True, text=True, timeout=120,
    )


def test_kill_9_mid_file_then_resume(tmp_path):
    src, clean, dst = tmp_path / "rel", tmp_path / "clean", tmp_path / "out"
    synth("tiny-k3.1-pro", src, seed=3, progress=False)
    convert(src, clean, workers=1, progress=False)
    files = json.loads((clean / "manifest.json").read_text())["files"]
    before_experts = sum(v["size"] for k, v in files.items() if not k.endswith(".nvfp4"))
    lay = ExpertLayout.for_config(load_config("tiny-k3.1-pro"))
    kill_at = before_experts + 10 * lay.file_bytes + 6000  # inside the 11th expert, past its header

    r = _convert_cli(src, dst, {KILL_ENV: str(kill_at)})
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert not (dst / "manifest.json").exists()
    tmps = [p for p in dst.rglob("*") if is_tmp(p.name)]
    assert len(tmps) == 1  # killed mid-file: exactly the one in flight, under its temp name
    finals = list(dst.rglob("*.nvfp4"))
    assert len(finals) == 10 and all(p.stat().st_size == lay.file_bytes for p in finals)

    r = _convert_cli(src, dst)
    assert r.returncode == 0, r.stderr
    assert "10 already complete" in r.stdout or "already complete" in r.stdout
    assert not [p for p in dst.rglob("*") if is_tmp(p.name)]
    assert verify_tree(dst, full=True, progress=False)[0] == []
    assert json.loads((dst / "manifest.json").read_text())["files"] == files
