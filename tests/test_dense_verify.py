"""Dense files are verified like experts: a flipped byte in
`dense/resident.safetensors` stops `run` (exit 2, naming the file) instead of changing the
answer; fast `verify` holds every dense header against the config (names, dtypes, shapes);
the checksum runs once per tree and is recorded by size and mtime."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from streamrt.checkpoint import reader
from streamrt.checkpoint.reader import VERIFIED, open_tree
from streamrt.checkpoint.verify import verify_tree
from streamrt.cli.main import main
from streamrt.errors import CheckpointError

RESIDENT = "dense/resident.safetensors"


@pytest.fixture
def tree(default_model_copy) -> Path:
    return default_model_copy  # conftest.py


def _flip_data_byte(path: Path, back: int = 100) -> None:
    """Flip one bit of a tensor byte (past the header), keeping the size."""
    b = bytearray(path.read_bytes())
    n = struct.unpack("<Q", b[:8])[0]
    assert len(b) - back > 8 + n
    b[-back] ^= 0x10
    path.write_bytes(bytes(b))


def _edit_header(path: Path, old: bytes, new: bytes, *, keep_mtime: bool = False) -> None:
    """Replace `old` by `new` (same length) inside the safetensors JSON header."""
    assert len(old) == len(new)
    st = path.stat()
    b = bytearray(path.read_bytes())
    n = struct.unpack("<Q", b[:8])[0]
    i = bytes(b[8 : 8 + n]).index(old) + 8
    b[i : i + len(old)] = new
    path.write_bytes(bytes(b))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _run(tree: Path) -> list[str]:
    return ["run", "--model", str(tree), "--prompt", "What is the capital of France?", "--max-new-tokens", "2",
            "--json"]


def test_flipped_dense_byte_stops_run_naming_the_file(tree, capsys):
    _flip_data_byte(tree / RESIDENT)
    rc = main(_run(tree))
    out, err = capsys.readouterr()
    assert rc == 2, out + err
    assert out == "" and err.count("\n") == 1, err
    assert f"{tree / RESIDENT}: checksum mismatch" in err


def test_flipped_dense_byte_found_by_a_plane_file_too(tree):
    plane = sorted((tree / "dense").glob("plane.*.safetensors"))[0]
    _flip_data_byte(plane, back=10)
    with pytest.raises(CheckpointError, match=f"{plane.name}: checksum mismatch"):
        open_tree(tree).dense_state_dict()


def test_checksum_once_then_recorded_by_size_and_mtime(tree, monkeypatch):
    calls = []
    real = reader.StreamrtTree.digest

    def counting(self, path=None, *, data=None):
        calls.append(1)
        return real(self, path, data=data)

    monkeypatch.setattr(reader.StreamrtTree, "digest", counting)
    n_dense = len(open_tree(tree).dense_files())
    open_tree(tree).dense_state_dict()
    assert len(calls) == n_dense  # first load: every dense file hashed once
    record = json.loads((tree / VERIFIED).read_text())
    assert set(record["files"]) == {p.relative_to(tree).as_posix() for p in open_tree(tree).dense_files()}
    assert {"size", "mtime_ns", "blake2b"} <= set(record["files"][RESIDENT])
    calls.clear()
    open_tree(tree).dense_state_dict()
    assert calls == []  # recorded: no hash on later loads
    os.utime(tree / RESIDENT)  # same bytes, new mtime: hashed again (and passes)
    open_tree(tree).dense_state_dict()
    assert len(calls) == 1
    _flip_data_byte(tree / RESIDENT)  # a later corruption is caught: the mtime moved
    with pytest.raises(CheckpointError, match="resident.safetensors: checksum mismatch"):
        open_tree(tree).dense_state_dict()


def test_read_only_tree_keeps_its_record_in_the_cache_and_says_so(tree, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reader, "writable_dir_error", lambda d: "Read-only file system" if d == tree else None)
    open_tree(tree).dense_state_dict()
    err = capsys.readouterr().err
    assert f"{tree} is read-only; dense checksums recorded in {tmp_path / 'cache' / 'verified'}" in err
    assert not (tree / VERIFIED).exists()
    assert len(list((tmp_path / "cache" / "verified").glob("*.json"))) == 1
    open_tree(tree).dense_state_dict()  # recorded: no second notice
    assert capsys.readouterr().err == ""


def test_header_dtype_edit_fails_fast_verify_naming_file_and_tensor(tree, capsys):
    # BF16 -> F16 keeps every size and offset: only the header check can see it.
    _edit_header(tree / RESIDENT, b'"model.embed_tokens.weight":{"dtype":"BF16"',
                 b'"model.embed_tokens.weight":{"dtype":"F16" ')
    bad, _ = verify_tree(tree, progress=False)
    assert [rel for rel, _ in bad] == [RESIDENT], bad
    assert "tensor model.embed_tokens.weight: dtype F16 [512, 96] disagrees with the config (BF16" in bad[0][1]
    rc = main(["verify", str(tree), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and f"BAD {tree}/{RESIDENT}: tensor model.embed_tokens.weight: dtype F16" in err


def test_header_shape_edit_fails_fast_verify(tree):
    _edit_header(tree / RESIDENT, b'"model.embed_tokens.weight":{"dtype":"BF16","shape":[512,96]',
                 b'"model.embed_tokens.weight":{"dtype":"BF16","shape":[96,512]')
    bad, _ = verify_tree(tree, progress=False)
    assert [rel for rel, _ in bad] == [RESIDENT]
    assert "tensor model.embed_tokens.weight: shape BF16 [96, 512] disagrees with the config" in bad[0][1]


def test_header_dtype_edit_stops_run_even_when_the_record_says_verified(tree, capsys):
    open_tree(tree).dense_state_dict()  # recorded as verified
    _edit_header(tree / RESIDENT, b'"model.embed_tokens.weight":{"dtype":"BF16"',
                 b'"model.embed_tokens.weight":{"dtype":"F16" ', keep_mtime=True)
    rc = main(_run(tree))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert f"{tree / RESIDENT}: tensor model.embed_tokens.weight: dtype F16" in err


def test_intact_tree_passes_fast_verify_and_loads(tree):
    bad, n = verify_tree(tree, progress=False)
    assert bad == [] and n > 0
    assert len(open_tree(tree).dense_state_dict()) > 0
