"""Bad inputs around the release layout (spec/REAL_RELEASE.md) that once slipped past the readers:
each is refused with one line naming the file and tensor, or, where the input is harmless, the
conversion goes through without a traceback and without reading what it does not need.

The release trees are synth's (seeded random weights); the hand-made shards hold os.urandom bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tracemalloc
from pathlib import Path

import pytest

from streamrt.checkpoint import dst as dst_module
from streamrt.checkpoint.convert import convert
from streamrt.checkpoint.release import open_release, release_fingerprint
from streamrt.checkpoint.safetensors_io import read_header
from streamrt.checkpoint.synth import synth
from streamrt.checkpoint.verify import verify_tree
from streamrt import fileio
from streamrt.cli.main import main as cli_main
from streamrt.errors import CheckpointError

INDEX = "model.safetensors.index.json"
SHARD = "model-00001-of-000003.safetensors"


def one_line(excinfo, *needles) -> str:
    msg = str(excinfo.value)
    assert len(msg.splitlines()) == 1, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def write_st(path: Path, entries: dict, data: bytes) -> None:
    """A safetensors file from {name: (dtype, shape, begin, end)} and the data section, as given."""
    hdr = {n: {"dtype": d, "shape": s, "data_offsets": [b, e]} for n, (d, s, b, e) in entries.items()}
    raw = json.dumps(hdr).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("edge") / "rel"
    synth("tiny-k3", root, seed=23, shards=3, progress=False, device="cpu")
    return root


@pytest.fixture
def src(release, tmp_path):
    out = tmp_path / "src"
    shutil.copytree(release, out)
    return out


def _index(root: Path) -> dict:
    return json.loads((root / INDEX).read_text())


# ---- safetensors headers ----------------------------------------------------------------------


def test_overlap_hidden_behind_a_zero_byte_tensor(tmp_path):
    """A zero-byte tensor sorted between two overlapping ones used to hide their overlap."""
    f = tmp_path / "x.safetensors"
    data = os.urandom(1024)
    write_st(f, {"a": ("F32", [128], 0, 512), "b": ("F32", [128], 512, 1024), "empty": ("BF16", [0], 4, 4)}, data)
    assert set(read_header(f).entries) == {"a", "b", "empty"}  # zero bytes inside a tensor: harmless
    write_st(f, {"a": ("F32", [128], 0, 512), "empty": ("BF16", [0], 4, 4), "b": ("F32", [128], 8, 520)}, data)
    with pytest.raises(CheckpointError) as ei:
        read_header(f)
    one_line(ei, str(f), "overlaps", "tensor b", "tensor a")


def test_control_characters_in_names_are_one_line(src, tmp_path):
    f = tmp_path / "x.safetensors"
    write_st(f, {"vision_tower.a\nb": ("U8", [16], 0, 16)}, os.urandom(16))
    with pytest.raises(CheckpointError) as ei:
        read_header(f)
    one_line(ei, str(f), "vision_tower.a\\nb")

    idx = _index(src)
    idx["weight_map"]["language_model.model.layers.0.x\ny"] = SHARD
    (src / INDEX).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError) as ei:
        open_release(src)
    one_line(ei, INDEX, "language_model.model.layers.0.x\\ny")

    idx = _index(src)
    del idx["weight_map"]["language_model.model.layers.0.x\ny"]
    name = next(iter(idx["weight_map"]))
    idx["weight_map"][name] = "model-00001\n.safetensors"
    (src / INDEX).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError) as ei:
        convert(src, tmp_path / "out", progress=False)
    one_line(ei, INDEX, "'model-00001\\n.safetensors'", "not a plain file name")
    assert not (tmp_path / "out").exists()


# ---- files beside the shards --------------------------------------------------------------------


def test_stray_safetensors_entries_beside_the_shards(src, tmp_path, capsys):
    """A directory or a dangling link named *.safetensors feeds no output: it used to be opened
    (a traceback) when the shards were fingerprinted."""
    (src / "extra.safetensors").mkdir()
    os.symlink(tmp_path / "nowhere", src / "gone.safetensors")
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--no-progress"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert verify_tree(tmp_path / "out", progress=False)[0] == []


def test_stray_file_with_a_lying_header_length_is_not_read(src, tmp_path):
    """A stray *.safetensors whose first 8 bytes claim a huge header was read to its end (a
    multi-GB file into memory) just to fingerprint it."""
    stray = src / "consolidated.safetensors"
    with open(stray, "wb") as fh:
        fh.write(struct.pack("<Q", 1 << 40) + os.urandom(4096))
        fh.truncate(512 << 20)  # sparse: costs no disk
    tracemalloc.start()
    try:
        convert(src, tmp_path / "out", progress=False, workers=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the run's own peak is ~100 MiB, mostly load_json's read(max_bytes + 1), which touches no pages
    assert peak < 256 << 20, f"peak {peak / 2**20:.0f} MiB"


# ---- the output directory -----------------------------------------------------------------------


def test_verify_source_refuses_a_foreign_dst_before_hashing(src, tmp_path, monkeypatch):
    """`--verify-source` hashes every shard (hours on the real release); a DST that is not ours
    must be refused before that, not after."""
    hashed = []
    real = fileio.file_digest

    def spy(path, *a, **k):
        hashed.append(Path(path).name)
        return real(path, *a, **k)

    monkeypatch.setattr(fileio, "file_digest", spy)
    monkeypatch.setattr(dst_module, "file_digest", spy, raising=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    with pytest.raises(CheckpointError) as ei:
        convert(src, out, progress=False, verify_source=True)
    one_line(ei, str(out), "not a previous partial conversion")
    assert [n for n in hashed if n.endswith(".safetensors")] == []
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]

    convert(src, tmp_path / "ok", progress=False, verify_source=True)
    shards = json.loads((tmp_path / "ok" / "manifest.json").read_text())["source"]["shards"]
    assert sorted(shards) == sorted(set(_index(src)["weight_map"].values()))
    assert all(isinstance(rec.get("blake2b"), str) for rec in shards.values())


@pytest.mark.parametrize("edit", [lambda m: m.update(files=[m["files"]]),
                                  lambda m: m["files"].update({"config.json": 5})],
                         ids=["files-a-list", "entry-an-integer"])
def test_rerun_over_a_manifest_with_malformed_files(src, tmp_path, edit):
    """A previous complete conversion whose manifest still names this source but whose
    `files` is malformed: its entries are not trusted (redone), never a traceback."""
    out = tmp_path / "out"
    convert(src, out, progress=False)
    m = json.loads((out / "manifest.json").read_text())
    edit(m)
    (out / "manifest.json").write_text(json.dumps(m))
    convert(src, out, progress=False)
    assert verify_tree(out, full=True, progress=False)[0] == []


def test_rerun_over_a_journal_line_with_an_infinite_size(src, tmp_path):
    out = tmp_path / "out"
    (out / ".convert").mkdir(parents=True)
    state = {"fingerprint": release_fingerprint(src), "checksum": fileio.rule_name(), "shards": {}}
    (out / ".convert" / "state.json").write_text(json.dumps(state))
    (out / ".convert" / "journal.jsonl").write_text('{"path": "config.json", "size": 1e400, "blake2b": "00"}\n')
    convert(src, out, progress=False)
    assert verify_tree(out, full=True, progress=False)[0] == []


def test_names_longer_than_the_file_system_allows_are_one_line(src, tmp_path, capsys):
    """ENAMETOOLONG is not an error pathlib's is_file/exists swallow: it was a traceback."""
    long = "n" * 300
    idx = _index(src)
    idx["weight_map"][next(iter(idx["weight_map"]))] = f"{long}.safetensors"
    (src / INDEX).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError) as ei:
        open_release(src)
    one_line(ei, INDEX, "shard name", "File name too long")
    for argv, fragment in [
        (["convert", str(src), str(tmp_path / long)], "DST cannot be created"),
        (["convert", str(tmp_path / long), str(tmp_path / "out")], "cannot read SRC"),
        (["verify", str(tmp_path / long)], "cannot read"),
    ]:
        assert cli_main([*argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and fragment in err and "File name too long" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_file_where_an_output_directory_belongs(src, tmp_path):
    """A resumed DST holding a file named `experts`: one line before any file is written (it was
    a worker's NotADirectoryError), and the user's file is left as it was."""
    out = tmp_path / "out"
    (out / ".convert").mkdir(parents=True)
    state = {"fingerprint": release_fingerprint(src), "checksum": fileio.rule_name(), "shards": {}}
    (out / ".convert" / "state.json").write_text(json.dumps(state))
    note = os.urandom(8).hex()
    (out / "experts").write_text(note)
    with pytest.raises(CheckpointError) as ei:
        convert(src, out, progress=False)
    one_line(ei, str(out / "experts"), "cannot create the output directory")
    assert (out / "experts").read_text() == note
    assert not (out / "config.json").exists()  # refused before the first file
