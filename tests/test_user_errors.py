"""What a new user meets when something is wrong: the diagnosis names the real cause, sizes come
in units that say something, output paths are checked before any work, each in one line."""

from __future__ import annotations

import json
from pathlib import Path
import secrets

import pytest

from streamrt.cli import main
from streamrt.output_paths import human_bytes


def _one_line(capsys, argv, fragment, rc=2) -> str:
    got = main(argv)
    out, err = capsys.readouterr()
    assert got == rc, out + err
    assert err.count("\n") == 1 and err.startswith("streamrt: ") and "Traceback" not in err, err
    assert fragment in err, err
    return err


def test_human_bytes_picks_the_unit_by_size():
    assert human_bytes(0) == "0 B" and human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(38 << 30) == "38.0 GiB"
    assert human_bytes(600 << 30) == "600 GiB" and human_bytes(3 << 40) == "3.0 TiB"
    for _ in range(200):
        n = secrets.randbelow(1 << 50) + 1
        text = human_bytes(n)
        value, unit = text.split()
        scale = 1 << (10 * ["B", "KiB", "MiB", "GiB", "TiB", "PiB"].index(unit))
        assert float(value) >= 1 and abs(float(value) * scale - n) <= 0.05 * n + 1, (n, text)
        assert float(value) < 1024 or unit == "PiB"


def test_a_converted_tree_without_its_manifest_is_named_so(capsys, tmp_path):
    tree = tmp_path / "conv"
    (tree / "experts").mkdir(parents=True)
    (tree / "dense").mkdir()
    (tree / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))
    err = _one_line(capsys, ["run", "--model", str(tree), "--prompt", "hi"], "manifest.json is missing")
    assert "release checkpoint" not in err and "convert again into an empty directory" in err


def test_output_on_a_read_only_file_system_names_the_cause(capsys, tmp_path):
    # /proc refuses new files for everyone, root included
    _one_line(capsys, ["synth", "--config", "tiny-k3", "--out", "/proc/streamrt-out"], "cannot write in /proc")
    err = _one_line(capsys, ["run", "--prompt", "hi", "--stats-json", "/proc/s.json"], "cannot write in /proc")
    assert "0.0 GiB" not in err


def test_convert_into_a_missing_directory_is_refused_before_any_work(capsys, tmp_path):
    dst = tmp_path / "no" / "such" / "conv"
    _one_line(capsys, ["convert", str(tmp_path), str(dst)], f"directory {dst.parent} does not exist")
    _one_line(capsys, ["run", "--model", "", "--prompt", "hi"], "--model is empty")
    assert not (tmp_path / "no").exists()


def test_placement_shortfall_in_readable_units():
    from streamrt.config import load_config
    from streamrt.errors import StreamrtError
    from streamrt.plan.placement import plan_placement

    with pytest.raises(StreamrtError) as e:
        plan_placement(load_config("tiny-k3"), 1 << 20)
    assert "0.0 GiB" not in str(e.value) and "short" in str(e.value), str(e.value)


def test_gpu_mem_without_a_gpu_is_explained(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: --gpu-mem is its budget")
    from streamrt.cli.main import build_parser
    from streamrt.default_model import default_model_dir
    from streamrt.cli.args import open_session

    args = build_parser().parse_args(["run", "--prompt", "hi", "--gpu-mem", "10G"])
    open_session(default_model_dir(), args, progress=False).close()
    err = capsys.readouterr().err.strip().splitlines()
    said = [ln for ln in err if "--gpu-mem" in ln]
    assert len(said) == 1 and "CPU" in said[0] and "10.0 GiB" in said[0], err


def test_a_negative_size_names_its_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--prompt", "hi", "--host-mem", "-5G"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--host-mem needs a value" in err, err
    assert "--host-mem=VALUE" in err
    _one_line(capsys, ["run", "--prompt", "hi", "--host-mem=-5G"], "--host-mem: expected a size")


def test_a_vision_config_missing_a_field_is_only_a_warning(capsys, tmp_path):
    """streamrt never runs the vision tower: its geometry must not refuse a release."""
    from streamrt.config import load_config

    src = json.loads((Path(__file__).resolve().parents[1] / "streamrt" / "configs" / "tiny-k3.json").read_text())
    field = secrets.choice(["intermediate_size", "hidden_size", "num_hidden_layers", "patch_size"])
    del src["vision_config"][field]
    (tmp_path / "config.json").write_text(json.dumps(src))
    cfg = load_config(tmp_path / "config.json")
    err = capsys.readouterr().err
    assert cfg.vision is None and cfg.num_layers == load_config("tiny-k3").num_layers
    assert err.count("\n") == 1 and "warning" in err and f"vision_config.{field}" in err, err
