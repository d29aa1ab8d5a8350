"""The commit stage: writer jobs finish a file (bytes written, hash closed) and hand it to
committer threads (fsync, rename, journal). Output must not depend on where commits run;
fsync must leave the writer threads; the backlog stays bounded; a failed fsync names the file
and leaves nothing half written."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest

from streamrt.checkpoint import convert as conv
from streamrt.checkpoint.dst import STATE_DIR
from streamrt import fileio
from streamrt.checkpoint.names import expert_relpath
from streamrt.checkpoint.synth import synth
from streamrt.checkpoint.verify import verify_tree
from streamrt.errors import CheckpointError

SMALL = 4096
VICTIM = expert_relpath(3, 5)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("rel") / "tiny"
    synth("tiny-k3.1-pro", root, seed=5, progress=False, device="cpu")
    return root


@pytest.fixture(scope="module")
def clean(release, tmp_path_factory):
    dst = tmp_path_factory.mktemp("clean") / "out"
    conv.convert(release, dst, workers=2, commit_threads=0, progress=False)
    return dst


def _tree(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _tmps(dst) -> list:
    return [p for p in dst.rglob("*") if fileio.is_tmp(p.name)]


@pytest.mark.parametrize("commit_threads", [0, None, 3])
def test_same_bytes_and_manifest_wherever_commits_run(release, clean, tmp_path, monkeypatch, commit_threads):
    monkeypatch.setattr(fileio, "CHUNK_BYTES", SMALL)  # dense files go through RangeWriter in many chunks
    monkeypatch.setattr(conv, "PIECE_BYTES", 1000)
    ref, dst = tmp_path / "ref", tmp_path / "out"
    conv.convert(release, ref, workers=3, commit_threads=0, progress=False)
    s = conv.convert(release, dst, workers=3, commit_threads=commit_threads, progress=False)
    assert s["commit_threads"] == (3 if commit_threads is None else commit_threads)
    assert _tree(dst) == _tree(ref)  # every file, manifest included
    assert not _tmps(dst) and not (dst / STATE_DIR).exists()
    assert verify_tree(dst, full=True, progress=False)[0] == []


@pytest.mark.parametrize("commit_threads", [0, None])
def test_fsync_runs_on_committer_threads(release, tmp_path, monkeypatch, commit_threads):
    real, names = os.fsync, []

    def spy(fd):
        names.append(threading.current_thread().name)
        return real(fd)

    monkeypatch.setattr(fileio.os, "fsync", spy)
    conv.convert(release, tmp_path / "out", workers=2, commit_threads=commit_threads, progress=False)
    committers = [n for n in names if n.startswith("srt-commit")]
    others = {n for n in names if not n.startswith("srt-commit")} - {"MainThread"}  # state, manifest, dirs
    if commit_threads == 0:
        assert not committers and others  # the writer jobs commit their own files
    else:
        assert len(committers) > 100 and not others  # no writer thread ever waits in fsync


def test_backlog_is_bounded(release, tmp_path, monkeypatch):
    """Slow fsync, fast writers: finished-but-uncommitted files pile up to the bound, no further."""
    import time

    monkeypatch.setattr(conv, "COMMIT_BACKLOG", 1)
    real_fsync, real_finish, real_commit = os.fsync, fileio.AtomicWriter.finish, fileio.AtomicWriter.commit
    lock, state = threading.Lock(), {"now": 0, "max": 0}

    def finish(self):
        if not self.finished:
            with lock:
                state["now"] += 1
                state["max"] = max(state["max"], state["now"])
        real_finish(self)

    def commit(self):
        try:
            return real_commit(self)
        finally:
            with lock:
                state["now"] -= 1

    monkeypatch.setattr(fileio.os, "fsync", lambda fd: (time.sleep(0.005), real_fsync(fd))[1])
    monkeypatch.setattr(fileio.AtomicWriter, "finish", finish)
    monkeypatch.setattr(fileio.AtomicWriter, "commit", commit)
    conv.convert(release, tmp_path / "out", workers=2, commit_threads=1, progress=False)
    # 1 x 2 workers in the backlog, plus one finished file per worker waiting for a slot
    assert 2 <= state["max"] <= 4 and state["now"] == 0


@pytest.mark.parametrize("commit_threads", [0, None])
def test_enospc_at_fsync_names_the_file_and_leaves_nothing(release, clean, tmp_path, monkeypatch, commit_threads):
    dst, real = tmp_path / "out", os.fsync
    victim_tmp = os.path.realpath(fileio.tmp_path(dst / VICTIM))

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == victim_tmp:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(fileio.os, "fsync", fsync)
    with pytest.raises(CheckpointError) as ei:
        conv.convert(release, dst, workers=2, commit_threads=commit_threads, progress=False)
    msg = str(ei.value)
    assert "\n" not in msg and "disk full" in msg and str(dst / VICTIM) in msg
    assert not (dst / VICTIM).exists() and not _tmps(dst) and not (dst / "manifest.json").exists()
    journal = (dst / STATE_DIR / "journal.jsonl").read_text().splitlines()
    journaled = {json.loads(line)["path"] for line in journal}
    assert VICTIM not in journaled
    for rel in journaled:  # whatever was committed is complete
        assert (dst / rel).read_bytes() == (clean / rel).read_bytes(), rel

    monkeypatch.setattr(fileio.os, "fsync", real)
    s = conv.convert(release, dst, workers=2, commit_threads=commit_threads, progress=False)
    assert s["skipped"] >= 1 and not _tmps(dst)
    assert _tree(dst) == _tree(clean)


@pytest.mark.parametrize("background", [False, True])
def test_atomic_writer_deferred_commit(tmp_path, monkeypatch, background):
    monkeypatch.setattr(fileio, "CHUNK_BYTES", SMALL)
    data = os.urandom(5 * SMALL + 77)
    path = tmp_path / "f"
    with fileio.AtomicWriter(path, background_hash=background, defer_commit=True) as w:
        w.write(data)
    assert not path.exists() and w.tmp.exists()  # finished, not durable: still under the temp name
    with pytest.raises(AssertionError):
        w.write(b"x")
    out = {}
    t = threading.Thread(target=lambda: out.update(r=w.commit()))  # the durable part on another thread
    t.start()
    t.join()
    assert out["r"] == (len(data), fileio.buffer_digest(data)) and path.read_bytes() == data
    w.abort()  # a no-op once committed
    assert path.read_bytes() == data and sorted(tmp_path.iterdir()) == [path]

    with fileio.AtomicWriter(tmp_path / "g", background_hash=background, defer_commit=True) as w2:
        w2.write(data)
    w2.abort()
    assert sorted(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("kind", ["atomic", "range"])
def test_failed_fsync_removes_temp_and_names_file(tmp_path, monkeypatch, kind):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    path = tmp_path / "f"
    if kind == "atomic":
        w = fileio.AtomicWriter(path, defer_commit=True)
        w.write(b"abc")
        w.finish()
    else:
        w = fileio.RangeWriter(path, 3)
        w.write_chunk(0, [b"abc"])
        w.finish()
    monkeypatch.setattr(fileio.os, "fsync", full)
    with pytest.raises(CheckpointError, match="disk full") as ei:
        w.commit()
    assert str(path) in str(ei.value)
    w.abort()  # safe to call again
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kw, flag", [(dict(commit_threads=-1), "--commit-threads"), (dict(workers=-1), "--workers")])
def test_bad_thread_counts_are_refused_before_dst_is_touched(release, tmp_path, kw, flag):
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError, match=f"{flag} must be"):
        conv.convert(release, dst, progress=False, **kw)
    assert not dst.exists()
