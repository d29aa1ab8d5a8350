"""Edge cases of the config loader, the JSON helper and the atomic writers: every bad input is
one line naming the path (or field, or key), exit 2, and nothing is half written."""

from __future__ import annotations

import json
import os
import random
import secrets
import struct
from pathlib import Path

import pytest

from streamrt import fileio, output_paths
from streamrt.cli.main import main
from streamrt.config import load_config
from streamrt.errors import CheckpointError, ConfigError, StreamrtError

CONFIGS = Path(__file__).parents[1] / "streamrt" / "configs"
LONG = "n" * 300  # one path component past NAME_MAX (255): stat() fails with ENAMETOOLONG


def project_error(fn, *args, **kwargs) -> StreamrtError:
    with pytest.raises(StreamrtError) as ei:
        fn(*args, **kwargs)
    assert "\n" not in str(ei.value), str(ei.value)
    return ei.value


def one_line_exit_2(capsys, argv: list[str], fragment: str) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, out + err
    assert err.count("\n") == 1 and err.startswith("streamrt: "), err
    assert fragment in err, err
    return err


def tiny_config() -> dict:
    return json.loads((CONFIGS / "tiny-k3.json").read_text())


def no_tmp_left(root: Path) -> None:
    assert not [p for p in root.rglob("*") if fileio.is_tmp(p.name)]


# ---- 1: the writers' directories -----------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda p: fileio.AtomicWriter(p),
        lambda p: fileio.AtomicWriter(p, background_hash=True),
        lambda p: fileio.RangeWriter(p, 4096),
    ],
    ids=["atomic", "atomic-bg", "range"],
)
def test_writer_whose_parent_is_a_file_or_too_long_is_one_line(tmp_path, make):
    blocker = tmp_path / "blocker"
    blocker.write_bytes(os.urandom(64))
    before = blocker.read_bytes()
    for target in (blocker / "sub" / "x.bin", tmp_path / LONG / "x.bin", tmp_path / (LONG + ".bin")):
        e = project_error(make, target)
        assert isinstance(e, CheckpointError) and str(target) in str(e) and "cannot create" in str(e)
    assert blocker.read_bytes() == before  # nothing the user had is touched
    no_tmp_left(tmp_path)


def test_writer_in_a_read_only_directory_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if output_paths.writable_dir_error(ro) is None:
            pytest.skip("permission bits do not bind here (root with CAP_DAC_OVERRIDE)")
        for target in (ro / "x.bin", ro / "sub" / "x.bin"):
            e = project_error(fileio.AtomicWriter, target)
            assert str(target) in str(e) and "Permission denied" in str(e)
    finally:
        ro.chmod(0o700)


def test_output_flag_with_a_too_long_name_is_one_line_exit_2(capsys, tmp_path, monkeypatch):
    from streamrt.cli import run as run_cmd

    monkeypatch.setattr(run_cmd, "open_session", lambda *a, **k: pytest.fail("a model was loaded"))
    target = tmp_path / LONG / "stats.json"
    one_line_exit_2(capsys, ["run", "--prompt", "hi", "--stats-json", str(target)], f"--stats-json {target}")
    e = project_error(output_paths.check_output_path, tmp_path / LONG, "--trace")
    assert f"--trace {tmp_path / LONG}" in str(e)


# ---- 2: path probes in the config loader ---------------------------------------------------


def test_config_paths_with_a_too_long_component_are_one_line_exit_2(capsys, tmp_path):
    for p in (tmp_path / LONG, tmp_path / LONG / "config.json", Path(LONG)):
        e = project_error(load_config, p)
        assert isinstance(e, ConfigError) and str(p) in str(e), e
        one_line_exit_2(capsys, ["inspect", str(p)], str(p))
        one_line_exit_2(capsys, ["verify", str(p)], str(p))
        one_line_exit_2(capsys, ["run", "--model", str(p), "--prompt", "hi"], str(p))
    one_line_exit_2(capsys, ["synth", "--config", str(tmp_path / LONG), "--dry-run"], str(tmp_path / LONG))


def test_config_in_an_unsearchable_directory_is_one_line(tmp_path):
    d = tmp_path / "locked"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_config()))
    d.chmod(0o600)  # readable, not searchable: stat of its entries fails with EACCES
    try:
        if os.access(d / "config.json", os.F_OK):
            pytest.skip("permission bits do not bind here (root with CAP_DAC_READ_SEARCH)")
        e = project_error(load_config, d)
        assert str(d / "config.json") in str(e)
    finally:
        d.chmod(0o700)


# ---- 3: quantization_config in two places --------------------------------------------------


def test_conflicting_quantization_configs_are_refused(capsys, tmp_path):
    cfg = tiny_config()
    inner = cfg["text_config"]["quantization_config"]
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [random.choice((64, 128)), 128]}
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    e = project_error(load_config, f)
    assert (
        str(f) in str(e) and "text_config.quantization_config" in str(e) and "quantization_config (top level)" in str(e)
    )
    one_line_exit_2(capsys, ["inspect", str(f)], "disagree")

    cfg["quantization_config"] = json.loads(json.dumps(inner))  # an identical copy is fine
    f.write_text(json.dumps(cfg))
    assert load_config(f).num_experts == cfg["text_config"]["num_experts"]


# ---- 4: duplicate JSON keys ----------------------------------------------------------------


def _dup_key_text(obj: dict, key: str, value) -> str:
    """obj as JSON text with `key` written a second time (json.dumps cannot produce that)."""
    text = json.dumps(obj)
    return text[:-1] + f", {json.dumps(key)}: {json.dumps(value)}}}"


def test_config_json_with_a_duplicated_key_is_refused(capsys, tmp_path):
    cfg = tiny_config()
    t = cfg.pop("text_config")
    text = json.dumps(cfg)[:-1] + ', "text_config": ' + _dup_key_text(t, "hidden_size", t["hidden_size"] * 2) + "}"
    f = tmp_path / "config.json"
    f.write_text(text)
    e = project_error(load_config, f)
    assert isinstance(e, ConfigError) and str(f) in str(e) and "'hidden_size' appears twice" in str(e)
    one_line_exit_2(capsys, ["inspect", str(f)], "'hidden_size' appears twice")

    f.write_text(_dup_key_text(tiny_config(), "model_type", "kimi_k31"))  # the wrapper's own keys too
    assert "'model_type' appears twice" in str(project_error(load_config, f))


def test_release_index_with_a_duplicated_tensor_is_refused(tmp_path):
    from streamrt.checkpoint.release import read_index

    root = tmp_path / "rel"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(tiny_config()))
    name = f"language_model.model.layers.0.mlp.t{secrets.token_hex(4)}.weight"
    wm = {
        f"language_model.model.layers.{i}.x{secrets.token_hex(3)}.weight": "model-00001.safetensors" for i in range(5)
    }
    wm[name] = "model-00001.safetensors"
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}})[:-1]
        + ', "weight_map": '
        + _dup_key_text(wm, name, "model-00002.safetensors")
        + "}"
    )
    idx = root / "model.safetensors.index.json"
    e = project_error(read_index, root)
    assert isinstance(e, CheckpointError) and str(idx) in str(e) and repr(name) in str(e)
    e = project_error(load_config, root)  # the config loader reads the same index for the variant gate
    assert str(idx) in str(e) and repr(name) in str(e)


def test_safetensors_header_with_a_duplicated_tensor_is_refused(tmp_path):
    from streamrt.checkpoint.safetensors_io import read_header

    rng = random.Random()
    n = 2 * rng.randint(1, 32)
    name = f"t{secrets.token_hex(4)}"
    entry = {"dtype": "BF16", "shape": [n], "data_offsets": [0, 2 * n]}
    other = {"dtype": "F32", "shape": [n // 2], "data_offsets": [0, 2 * n]}  # valid alone: the copies disagree only
    raw = _dup_key_text({name: entry}, name, other).encode()
    raw += b" " * (-len(raw) % 8)
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + os.urandom(2 * n))
    e = project_error(read_header, f)
    assert isinstance(e, CheckpointError) and str(f) in str(e) and repr(name) in str(e)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    e = project_error(load_config, tmp_path)  # a single-file tree: the config loader reads the header's names
    assert str(f) in str(e) and repr(name) in str(e)


def test_unique_keys_is_an_option_of_load_json():
    from streamrt.jsonio import load_json

    key = secrets.token_hex(3)
    text = f'{{"{key}": 1, "{key}": 2}}'.encode()
    assert load_json(text, what="x") == {key: 2}  # the default keeps json's behaviour
    e = project_error(load_json, text, what="thing", name="f.json", unique_keys=True)
    assert str(e) == f"f.json: thing: key {key!r} appears twice in one object; the file is ambiguous"
    nested = f'[{{"a": {{"{key}": 1, "{key}": 1}}}}]'.encode()  # equal values are still ambiguous text
    assert key in str(project_error(load_json, nested, what="thing", unique_keys=True))
