"""Dense files are written as independent checksum chunks by several workers at once
(fileio.RangeWriter). With 4 KiB chunks and 1000-byte pieces a tiny tree's dense files span
dozens of chunks and the pieces straddle chunk and tensor boundaries; the result must equal
the serial streaming write byte for byte, checksum included, and a failure or kill -9 in one
chunk must leave no final file and resume cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from streamrt.checkpoint import convert as conv
from streamrt.checkpoint.manifest import dense_files
from streamrt import fileio
from streamrt.checkpoint.names import TensorSpec, dense_specs, strip_prefix
from streamrt.checkpoint.release import open_release
from streamrt.checkpoint.safetensors_io import write_stream
from streamrt.checkpoint.synth import synth
from streamrt.checkpoint.verify import verify_tree

SMALL = 4096
RESIDENT = "dense/resident.safetensors"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("rel") / "tiny"
    synth("tiny-k3.1-pro", root, seed=11, progress=False, device="cpu")
    return root


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(fileio, "CHUNK_BYTES", SMALL)
    monkeypatch.setattr(conv, "PIECE_BYTES", 1000)  # pieces cross chunk and tensor boundaries


def _files(dst) -> dict:
    return json.loads((dst / "manifest.json").read_text())["files"]


def _tmps(dst) -> list:
    return [p for p in dst.rglob("*") if fileio.is_tmp(p.name)]


@pytest.mark.parametrize("chunk", [SMALL, None])  # many chunks per file / the default rule, one chunk
def test_chunked_dense_equals_serial_write(release, tmp_path, monkeypatch, chunk):
    if chunk:
        monkeypatch.setattr(fileio, "CHUNK_BYTES", chunk)
        monkeypatch.setattr(conv, "PIECE_BYTES", 1000)
    dst, ref = tmp_path / "out", tmp_path / "serial"
    conv.convert(release, dst, workers=3, progress=False)
    files = _files(dst)
    rt = open_release(release)
    dense = dense_files(dense_specs(rt.config))
    assert chunk is None or files[RESIDENT]["size"] > 20 * chunk
    for rel, specs in dense.items():  # the pre-parallel path: one thread streams the tensors in order
        renamed = [TensorSpec(strip_prefix(s.name), s.shape, s.dtype) for s in specs]
        size, digest = write_stream(ref / rel, renamed, (rt.raw(s.name) for s in specs))
        assert (dst / rel).read_bytes() == (ref / rel).read_bytes(), rel
        assert files[rel] == {"size": size, "blake2b": digest}, rel
        assert fileio.file_digest(dst / rel) == digest
    rt.close()
    assert verify_tree(dst, full=True, progress=False)[0] == []


def test_failed_chunk_leaves_no_file_then_rerun_completes(release, tmp_path, small_chunks, monkeypatch):
    clean, dst = tmp_path / "clean", tmp_path / "out"
    conv.convert(release, clean, workers=2, progress=False)
    real_fill, resident_size = conv._dense_fill, _files(clean)[RESIDENT]["size"]

    def failing_fill(rt, header, specs):
        fill = real_fill(rt, header, specs)
        size = len(header) + sum(s.nbytes for s in specs)

        def f(off, buf):
            if size == resident_size and off >= size // 2:
                raise RuntimeError("injected failure in one chunk")
            fill(off, buf)

        return f

    monkeypatch.setattr(conv, "_dense_fill", failing_fill)
    with pytest.raises(RuntimeError, match="injected"):
        conv.convert(release, dst, workers=2, progress=False)
    assert not (dst / RESIDENT).exists() and not (dst / "manifest.json").exists()
    assert _tmps(dst) == []  # the unfinished file's temp was removed once the pool drained

    monkeypatch.setattr(conv, "_dense_fill", real_fill)
    s = conv.convert(release, dst, workers=2, progress=False)
    assert s["skipped"] >= 1 and s["written"] + s["skipped"] == s["files"]
    assert _tmps(dst) == [] and _files(dst) == _files(clean)
    assert verify_tree(dst, full=True, progress=False)[0] == []


def test_kill_9_mid_chunked_file_then_resume(release, tmp_path, small_chunks):
    clean, dst = tmp_path / "clean", tmp_path / "out"
    conv.convert(release, clean, workers=2, progress=False)
    files = _files(clean)
    # Dense chunks are queued before any expert, planes before the resident file.
    before = sum(v["size"] for k, v in files.items() if not k.endswith(".nvfp4") and k != RESIDENT)
    kill_at = before + files[RESIDENT]["size"] // 2
    code = (
        "import os, signal, sys; from streamrt import fileio; from streamrt.checkpoint import convert as c; "
        f"fileio.CHUNK_BYTES = {SMALL}; c.PIECE_BYTES = 1000; "
        f"c.convert(sys.argv[1], sys.argv[2], workers=2, progress=False, "
        f"on_written=lambda n: n >= {kill_at} and os.kill(os.getpid(), signal.SIGKILL))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(release), str(dst)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert not (dst / RESIDENT).exists() and not (dst / "manifest.json").exists()
    assert any(p.name.startswith(f"{fileio.TMP_PREFIX}resident.") for p in _tmps(dst))

    s = conv.convert(release, dst, workers=2, progress=False)
    assert s["skipped"] >= 2  # config.json and the finished planes are kept
    assert _tmps(dst) == [] and _files(dst) == files
    assert verify_tree(dst, full=True, progress=False)[0] == []


def test_range_writer_any_order(tmp_path, monkeypatch):
    """Chunks written out of order, in uneven pieces: same bytes and checksum as the definition."""
    monkeypatch.setattr(fileio, "CHUNK_BYTES", SMALL)
    data = os.urandom(5 * SMALL + 123)
    w = fileio.RangeWriter(tmp_path / "f", len(data))
    order = [3, 0, 5, 1, 4, 2]
    for i in order:
        off, n = w.ranges[i]
        last = w.write_chunk(i, (data[p : min(p + 1000, off + n)] for p in range(off, off + n, 1000)))
        assert last == (i == order[-1])
    assert not (tmp_path / "f").exists()  # nothing final before the commit
    size, digest = w.commit()
    w.abort()  # a no-op once committed
    assert (tmp_path / "f").read_bytes() == data and size == len(data)
    assert digest == fileio.buffer_digest(data) == fileio.file_digest(tmp_path / "f")
    assert list(tmp_path.iterdir()) == [tmp_path / "f"]
