"""convert against a source that changes under it, and two converters on one DST."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from streamrt.checkpoint.convert import convert
from streamrt.checkpoint.dst import DstLock
from streamrt.checkpoint.synth import synth
from streamrt.errors import CheckpointError

INDEX = "model.safetensors.index.json"
TENSOR = "language_model.model.layers.3.block_sparse_moe.experts.7.w2.weight_packed"
EXPERT_FILE = "experts/L003/E0007.nvfp4"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("src") / "rel"
    synth("tiny-k3", root, seed=3, shards=3, progress=False, device="cpu")
    return root


@pytest.fixture
def src(release, tmp_path):
    dst = tmp_path / "rel"
    shutil.copytree(release, dst)
    return dst


def _flip_expert_byte(src: Path, keep_mtime: bool = False) -> Path:
    """Change one nibble byte of TENSOR in place: same size, same header."""
    shard = src / json.loads((src / INDEX).read_text())["weight_map"][TENSOR]
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    begin = 8 + n + json.loads(raw[8 : 8 + n])[TENSOR]["data_offsets"][0]
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(begin + 5)
        f.write(bytes([raw[begin + 5] ^ 0x11]))
    if keep_mtime:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    return shard


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and p.name != "manifest.json"}


def test_changed_shard_reconverts_what_it_feeds(src, tmp_path):
    dst = tmp_path / "out"
    convert(src, dst, progress=False)
    before = (dst / EXPERT_FILE).read_bytes()
    _flip_expert_byte(src)
    lines = []
    s = convert(src, dst, progress=False, log=lines.append)
    assert (dst / EXPERT_FILE).read_bytes() != before
    assert any("1 source shard(s) changed" in line for line in lines), lines
    assert 0 < s["written"] < s["files"]  # only the files made from that shard
    fresh = tmp_path / "fresh"
    convert(src, fresh, progress=False)
    assert _tree_bytes(dst) == _tree_bytes(fresh)


def test_verify_source_catches_a_rewrite_that_kept_its_mtime(src, tmp_path):
    dst = tmp_path / "out"
    convert(src, dst, progress=False, verify_source=True)
    before = (dst / EXPERT_FILE).read_bytes()
    _flip_expert_byte(src, keep_mtime=True)
    assert convert(src, dst, progress=False)["written"] == 0  # size, header and mtime: nothing to see
    assert (dst / EXPERT_FILE).read_bytes() == before
    convert(src, dst, progress=False, verify_source=True)
    assert (dst / EXPERT_FILE).read_bytes() != before


def test_a_second_converter_is_told_who_holds_dst(src, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    with DstLock(dst):
        r = subprocess.run([sys.executable, "-m", "streamrt", "convert", str(src), str(dst), "--no-progress"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        line = r.stderr.strip()
        assert "\n" not in line and "being converted by streamrt convert pid" in line and str(os.getpid()) in line, line
        with pytest.raises(CheckpointError, match="being converted by"):
            convert(src, dst, progress=False)
    assert not (dst / ".convert").exists()  # the refused runs left nothing behind
    convert(src, dst, progress=False)  # free again
    assert not (dst / ".convert").exists() and (dst / "manifest.json").is_file()
