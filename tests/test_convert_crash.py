"""kill -9 in the middle of `streamrt convert`, then re-run: the tree must verify and equal a
clean conversion file for file. The kill is made deterministic with one worker: the converter
runs in a child process whose `on_written` callback SIGKILLs it once that many bytes are
written, placed mid-way through an expert file. Both commit paths are
covered: inline (--commit-threads 0) and the deferred commit stage, where finished files may
still sit under their temp names waiting for fsync + rename when the kill lands.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from streamrt.checkpoint.convert import convert
from streamrt.checkpoint.expert_file import ExpertLayout
from streamrt.fileio import is_tmp
from streamrt.checkpoint.synth import synth
from streamrt.checkpoint.verify import verify_tree
from streamrt.config import load_config


# The child converts and SIGKILLs itself from the progress callback at argv[3] bytes (0: never).
KILLING_CONVERT = (
    "import os, signal, sys; from streamrt.checkpoint.convert import convert; kill_at = int(sys.argv[3]); "
    "convert(sys.argv[1], sys.argv[2], workers=1, progress=False, commit_threads=int(sys.argv[4]) if sys.argv[4] else "
        "None, "
    "on_written=lambda n: kill_at and n >= kill_at and os.kill(os.getpid(), signal.SIGKILL), log=print)"
)


def _convert_cli(src, dst, kill_at=0, commit_args=(), prelude=""):
    commit = commit_args[1] if commit_args else ""
    return subprocess.run([sys.executable, "-c", prelude + KILLING_CONVERT, str(src), str(dst), str(kill_at), commit],
                          capture_output=True, text=True, timeout=120)


def _tmps(dst):
    return [p for p in dst.rglob("*") if is_tmp(p.name)]


def _check_killed_tree(dst, clean):
    """What a kill may leave: temp files, and final files that are complete (byte-equal to the
    clean tree); the journal names only final files, each complete."""
    assert not (dst / "manifest.json").exists()
    finals = [p for p in dst.rglob("*") if p.is_file() and not is_tmp(p.name) and ".convert" not in p.parts]
    for p in finals:
        assert p.read_bytes() == (clean / p.relative_to(dst)).read_bytes(), p
    journal = (dst / ".convert" / "journal.jsonl").read_text().splitlines()
    journaled = {json.loads(line)["path"] for line in journal}
    assert journaled <= {str(p.relative_to(dst)) for p in finals}
    return finals


def _release_and_clean(tmp_path):
    """A tiny release, its clean conversion's manifest files, the expert layout, and a kill
    point inside the 11th expert file (past its header)."""
    src, clean, dst = tmp_path / "rel", tmp_path / "clean", tmp_path / "out"
    synth("tiny-k3.1-pro", src, seed=3, progress=False)
    convert(src, clean, workers=1, progress=False)
    files = json.loads((clean / "manifest.json").read_text())["files"]
    before_experts = sum(v["size"] for k, v in files.items() if not k.endswith(".nvfp4"))
    lay = ExpertLayout.for_config(load_config("tiny-k3.1-pro"))
    return src, clean, dst, files, lay, before_experts + 10 * lay.file_bytes + 6000


@pytest.mark.parametrize("commit_args", [(), ("--commit-threads", "0")], ids=["deferred", "inline"])
def test_kill_9_mid_file_then_resume(tmp_path, commit_args):
    src, clean, dst, files, lay, kill_at = _release_and_clean(tmp_path)

    r = _convert_cli(src, dst, kill_at, commit_args)
    assert r.returncode == -signal.SIGKILL, r.stderr
    finals = _check_killed_tree(dst, clean)
    tmps = _tmps(dst)
    final_experts = [p for p in finals if p.suffix == ".nvfp4"]
    if commit_args:  # inline: exactly the one in flight, under its temp name
        assert len(tmps) == 1 and len(final_experts) == 10
    else:  # deferred: the one in flight, plus finished ones whose commit had not happened yet
        assert len(tmps) >= 1 and len(final_experts) + len([p for p in tmps if ".nvfp4" in p.name]) == 11
    assert all(p.stat().st_size == lay.file_bytes for p in final_experts)

    r = _convert_cli(src, dst, commit_args=commit_args)
    assert r.returncode == 0, r.stderr
    assert "already complete" in r.stdout
    assert not _tmps(dst)
    assert verify_tree(dst, full=True, progress=False)[0] == []
    assert json.loads((dst / "manifest.json").read_text())["files"] == files


def test_kill_9_with_commit_backlog_then_resume(tmp_path):
    """Slow fsync, one committer: several finished files wait in the backlog under temp names
    when the kill lands. None of them may count; the re-run redoes them."""
    src, clean, dst, files, lay, kill_at = _release_and_clean(tmp_path)
    slow_fsync = "import os, time; real = os.fsync; os.fsync = lambda fd: (time.sleep(0.2), real(fd))[1]; "
    r = _convert_cli(src, dst, kill_at, ("--commit-threads", "1"), prelude=slow_fsync)
    assert r.returncode == -signal.SIGKILL, r.stderr
    finals = _check_killed_tree(dst, clean)
    expert_tmps = [p for p in _tmps(dst) if ".nvfp4" in p.name]
    assert len(expert_tmps) >= 2  # the one being written and at least one finished, uncommitted
    assert len([p for p in finals if p.suffix == ".nvfp4"]) + len(expert_tmps) == 11

    s = convert(src, dst, workers=1, progress=False)
    assert s["skipped"] >= 1 and not _tmps(dst)
    assert verify_tree(dst, full=True, progress=False)[0] == []
    assert json.loads((dst / "manifest.json").read_text())["files"] == files
