"""The manifest checksum (fileio): chunked blake2b tree hash, parallel over chunks, one rule
for every writer and reader; format_version 1 trees keep their whole-file blake2b.

Chunk sizes are shrunk to a few KiB here (a parameter, or fileio.CHUNK_BYTES for whole
conversions) so files stay tiny yet span many chunks."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from streamrt import fileio
from streamrt.checkpoint.convert import convert
from streamrt.checkpoint.reader import open_tree
from streamrt.checkpoint.synth import synth
from streamrt.checkpoint.verify import verify_tree
from streamrt.errors import CheckpointError

ASSET = Path(__file__).resolve().parents[1] / "streamrt/assets/default_model"
SMALL = 4096


def ref_digest(data: bytes, chunk: int) -> str:
    """Independent reimplementation from the definition, hashlib only."""
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)] or [b""]
    inner = b"".join(hashlib.blake2b(p, digest_size=8).digest() for p in pieces)
    return hashlib.blake2b(inner, digest_size=8).hexdigest()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("rel") / "tiny"
    synth("tiny-k3.1-pro", root, seed=5, shards=4, progress=False, device="cpu")
    return root


@pytest.fixture(scope="module")
def small_chunk_tree(release, tmp_path_factory):
    """A converted tree written with 4 KiB chunks: the dense files span dozens of chunks."""
    dst = tmp_path_factory.mktemp("conv") / "t"
    mp = pytest.MonkeyPatch()
    mp.setattr(fileio, "CHUNK_BYTES", SMALL)
    try:
        convert(release, dst, workers=2, progress=False)
    finally:
        mp.undo()
    return dst


SIZES = [0, 1, SMALL - 1, SMALL, SMALL + 1, 3 * SMALL, 7 * SMALL + 123]


@pytest.mark.parametrize("n", SIZES)
def test_digest_matches_reference(tmp_path, n):
    data = os.urandom(n)
    p = tmp_path / "f"
    p.write_bytes(data)
    want = ref_digest(data, SMALL)
    assert fileio.file_digest(p, chunk_bytes=SMALL) == want
    assert fileio.file_digest(p, fileio.rule_name(SMALL)) == want
    assert fileio.buffer_digest(data, chunk_bytes=SMALL) == want
    assert fileio.buffer_digest(bytearray(data), "blake2b64-tree-4KiB") == want
    assert fileio.file_digest(p) == ref_digest(data, 64 << 20)  # default rule: 64 MiB chunks
    whole = hashlib.blake2b(data, digest_size=8).hexdigest()  # the format_version 1 rule
    assert fileio.file_digest(p, fileio.LEGACY_RULE) == fileio.buffer_digest(data, fileio.LEGACY_RULE) == whole


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("n", SIZES)
def test_atomic_writer_digest_any_write_sizes(tmp_path, monkeypatch, background, n):
    """Writes straddle chunk boundaries; inline and pool hashing both give the reference."""
    monkeypatch.setattr(fileio, "CHUNK_BYTES", SMALL)
    data = os.urandom(n)
    buf = bytearray(1000)  # the caller reuses its buffer, as convert does
    with fileio.AtomicWriter(tmp_path / "f", background_hash=background) as w:
        for i in range(0, n, 1000):
            k = min(1000, n - i)
            buf[:k] = data[i : i + k]
            w.write(memoryview(buf)[:k])
    assert (tmp_path / "f").read_bytes() == data
    assert w.digest == ref_digest(data, SMALL)


def test_background_abort_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "CHUNK_BYTES", SMALL)
    with pytest.raises(RuntimeError):
        with fileio.AtomicWriter(tmp_path / "g", background_hash=True) as w:
            w.write(os.urandom(20 * SMALL))  # chunk jobs in flight
            raise RuntimeError("killed mid-file")
    assert list(tmp_path.iterdir()) == []


def test_rule_names():
    assert fileio.rule_name() == "blake2b64-tree-64MiB"
    assert fileio.rule_chunk("blake2b64-tree-64MiB") == 64 << 20 and fileio.rule_chunk(fileio.LEGACY_RULE) is None
    assert fileio.rule_chunk(fileio.rule_name(12288)) == 12288
    for bad in (None, "", "sha256", "blake2b64-tree-0B", "blake2b64-tree-2048MiB"):
        with pytest.raises(ValueError):
            fileio.rule_chunk(bad)


def _as_format_1(src: Path, dst: Path) -> dict:
    """A copy of a converted tree with its manifest rewritten the way format_version 1 wrote it:
    no "checksum" key, each file's "blake2b" the whole-file blake2b-64 (hashlib here)."""
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["format_version"] = 1
    m.pop("checksum", None)
    for rel, entry in m["files"].items():
        entry["blake2b"] = hashlib.blake2b((dst / rel).read_bytes(), digest_size=8).hexdigest()
    (dst / "manifest.json").write_text(json.dumps(m, indent=1))
    return m


def test_old_format_manifest_still_verifies(tmp_path):
    """A format_version 1 tree (whole-file blake2b, as trees converted before the tree hash
    carry) verifies unchanged, and the legacy rule really is checked: a flipped byte is caught."""
    old = tmp_path / "old"
    _as_format_1(ASSET, old)
    assert verify_tree(old, full=True, progress=False)[0] == []
    tree = open_tree(old)
    assert tree.checksum_rule == fileio.LEGACY_RULE
    rel = "experts/L001/E0000.nvfp4"
    raw = (old / rel).read_bytes()
    tree.check_expert(1, 0, data=raw)  # the runtime's first-map check path
    bad = bytearray(raw)
    bad[len(bad) // 2] ^= 1
    (old / rel).write_bytes(bad)
    got, _ = verify_tree(old, full=True, progress=False)
    assert [g[0] for g in got] == [rel] and "checksum" in got[0][1]
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        open_tree(old).check_expert(1, 0, data=bytes(bad))


def test_new_format_tree_verifies_and_matches_reference(small_chunk_tree):
    m = json.loads((small_chunk_tree / "manifest.json").read_text())
    assert m["format_version"] == 2 and m["checksum"] == "blake2b64-tree-4KiB"
    big = "dense/resident.safetensors"
    data = (small_chunk_tree / big).read_bytes()
    assert len(data) > 10 * SMALL  # really multi-chunk (written through the pool path)
    for rel, e in m["files"].items():  # every writer (copy, dense, expert) follows the one rule
        assert e["blake2b"] == ref_digest((small_chunk_tree / rel).read_bytes(), SMALL), rel
    # the rule comes from the manifest, not from the current default chunk size
    assert verify_tree(small_chunk_tree, full=True, progress=False)[0] == []
    tree = open_tree(small_chunk_tree)
    layer = tree.config.moe_layers[0]
    tree.check_expert(layer, 3)
    tree.check_expert(layer, 3, data=tree.expert_path(layer, 3).read_bytes())


def test_flipped_byte_in_a_multi_chunk_file_is_detected(small_chunk_tree, tmp_path):
    dst = tmp_path / "t"
    shutil.copytree(small_chunk_tree, dst)
    big = "dense/resident.safetensors"
    data = bytearray((dst / big).read_bytes())
    data[len(data) - SMALL - 5] ^= 0x40  # inside a later chunk, not the first or the last
    (dst / big).write_bytes(data)
    got, _ = verify_tree(dst, full=True, progress=False)
    assert [g[0] for g in got] == [big] and "checksum mismatch" in got[0][1]


def test_unknown_version_or_rule_refused(small_chunk_tree, tmp_path):
    dst = tmp_path / "t"
    shutil.copytree(small_chunk_tree, dst)
    mf = dst / "manifest.json"
    m = json.loads(mf.read_text())
    for change, needle in (
        ({"checksum": "sha1-tree"}, "unknown checksum rule"),
        ({"format_version": 3}, "format_version 3"),
    ):
        mf.write_text(json.dumps({**m, **change}))
        with pytest.raises(CheckpointError, match=needle) as ei:
            open_tree(dst)
        assert "\n" not in str(ei.value)
    mf.write_text(json.dumps({k: v for k, v in m.items() if k != "checksum"}))
    with pytest.raises(CheckpointError, match="unknown checksum rule None"):
        open_tree(dst)


def test_resume_never_mixes_rules(release, small_chunk_tree, tmp_path):
    """A tree or journal recorded under another rule is redone, even when resume trusts sizes
    (check_resumed=False): the manifest never mixes rules."""
    dst = tmp_path / "t"
    shutil.copytree(small_chunk_tree, dst)  # complete, rule 4 KiB
    s = convert(release, dst, workers=2, progress=False, check_resumed=False)
    assert s["written"] == s["files"] and s["skipped"] == 0
    m = json.loads((dst / "manifest.json").read_text())
    assert m["checksum"] == "blake2b64-tree-64MiB"
    assert verify_tree(dst, full=True, progress=False)[0] == []

    # a partial run by an older streamrt: state.json without "checksum", journal in whole-file blake2b
    (dst / "manifest.json").unlink()
    (dst / ".convert").mkdir()
    fp = m["source"]["fingerprint"]
    (dst / ".convert/state.json").write_text(json.dumps({"source": str(release), "fingerprint": fp}))
    lines = [json.dumps({"path": r, "size": e["size"], "blake2b": fileio.file_digest(dst / r, fileio.LEGACY_RULE)})
             for r, e in m["files"].items()]
    (dst / ".convert/journal.jsonl").write_text("\n".join(lines) + "\n")
    s = convert(release, dst, workers=2, progress=False, check_resumed=False)
    assert s["written"] == s["files"]
    assert json.loads((dst / "manifest.json").read_text())["files"] == m["files"]

    # same rule: resume skips everything
    s = convert(release, dst, workers=2, progress=False)
    assert s["written"] == 0 and s["skipped"] == s["files"]


def test_shipped_model_verifies():
    """The embedded default model's manifest matches its files under the rule it names."""
    assert verify_tree(ASSET, full=True, progress=False)[0] == []
