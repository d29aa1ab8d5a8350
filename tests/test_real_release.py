"""The real release layout (spec/REAL_RELEASE.md): what synth writes, what convert accepts and
refuses, and what the config must say.

Expected values come from the release as the public ports state it, written out here by hand:
shard naming, F32 tensors, quantization_config inside text_config, the tensor counts of the
seed, the tokenizer files. They are never read back from the code under test.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamrt.checkpoint.convert import convert
from streamrt.checkpoint.reader import open_tree
from streamrt.checkpoint.synth import synth
from streamrt.checkpoint.verify import verify_tree
from streamrt.cli.main import main as cli_main
from streamrt.config import config_from_dict, load_config
from streamrt.errors import CheckpointError, ConfigError

INDEX = "model.safetensors.index.json"
# Leaves the release stores as F32 [K3X; NEMO fp32 modules]: spec/REAL_RELEASE.md "Tensors".
RELEASED_F32 = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight", "A_log", "dt_bias",
                "e_score_correction_bias")


def header(path: Path) -> dict:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n])


def one_line(excinfo, *needles) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    return {name: synth(name, root / name, seed=11, shards=4, progress=False, device="cpu") and root / name
            for name in ("tiny-k3", "tiny-k3.1-pro")}


@pytest.fixture
def rel_copy(releases, tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(releases["tiny-k3.1-pro"], dst)
    return dst


# ---- the layout synth writes ------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-k3", "tiny-k3.1-pro"])
def test_release_layout_as_published(releases, name):
    root = releases[name]
    shards = sorted(p.name for p in root.glob("*.safetensors"))
    assert shards == [f"model-{i:05d}-of-000004.safetensors" for i in range(1, 5)]  # 5 digits, then 6
    index = json.loads((root / INDEX).read_text())
    headers = {s: header(root / s) for s in shards}
    held = {n: s for s, h in headers.items() for n in h if n != "__metadata__"}
    assert held == index["weight_map"]
    total = sum(math.prod(e["shape"]) * {"BF16": 2, "F32": 4, "U8": 1}[e["dtype"]]
                for h in headers.values() for n, e in h.items() if n != "__metadata__")
    assert index["metadata"]["total_size"] == total
    # vision tower and projector only in the last shard(s), after every text tensor
    order = {s: i for i, s in enumerate(shards)}
    vision = [n for n in held if not n.startswith("language_model.")]
    assert len([n for n in vision if n.startswith("vision_tower.")]) == 3 + 2 * 6  # tiny vision_config: 2 blocks
    assert len([n for n in vision if n.startswith("mm_projector.")]) == 3
    assert min(order[held[n]] for n in vision) >= max(order[held[n]] for n in held if n.startswith("language_model."))
    # dtypes as released
    for n, s in held.items():
        dt = headers[s][n]["dtype"]
        if n.startswith("language_model.") and any(n.endswith(leaf) for leaf in RELEASED_F32):
            assert dt == "F32", n
        elif ".experts." in n:
            assert dt == "U8", n
        else:
            assert dt == "BF16", n
    # each expert's six tensors together, the experts of a layer not in id order
    for s, h in headers.items():
        ex = sorted(((e["data_offsets"][0], n) for n, e in h.items() if ".experts." in n))
        ids = [int(n.split(".experts.", 1)[1].split(".", 1)[0]) for _, n in ex]
        runs = [ids[i] for i in range(0, len(ids), 6)]
        assert all(ids[i : i + 6] == [ids[i]] * 6 for i in range(0, len(ids), 6)), s
        if len(runs) > 4:
            assert runs != sorted(runs), s
    # the wrapper config as released
    cfg = json.loads((root / "config.json").read_text())
    k31 = name.endswith("k3.1-pro")
    assert cfg["architectures"] == ["KimiK31ForConditionalGeneration" if k31 else "KimiK3ForConditionalGeneration"]
    assert cfg["model_type"] == ("kimi_k31" if k31 else "kimi_k3")
    assert "quantization_config" not in cfg and "vision_config" in cfg
    q = cfg["text_config"]["quantization_config"]
    g = q["config_groups"]["group_0"]
    assert q["quant_method"] == "compressed-tensors" and g["format"] == "mxfp4-pack-quantized"
    assert g["weights"]["num_bits"] == 4 and g["weights"]["group_size"] == 32 and g["weights"]["type"] == "float"
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id", "image_placeholder"):
        assert k in cfg, k
    # tokenizer files: tiktoken.model, and tokenizer_config.json naming the 256 reserved ids from 163584
    assert (root / "tiktoken.model").is_file() and not (root / "tokenizer.json").exists()
    added = json.loads((root / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert sorted(map(int, added)) == list(range(163584, 163840))
    assert added["163584"]["content"] == "[BOS]" and added["163586"]["content"] == "<|end_of_msg|>"


@pytest.mark.parametrize("name", ["tiny-k3", "tiny-k3.1-pro"])
def test_release_converts_verifies_and_runs(releases, name, tmp_path, capsys):
    dst = tmp_path / "tree"
    assert cli_main(["convert", str(releases[name]), str(dst), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "skipping 18 tensors outside the language model" in out  # 15 tower + 3 projector
    assert verify_tree(dst, full=True, progress=False)[0] == []
    tree = open_tree(dst)
    sd = tree.dense_state_dict()
    assert sd["model.layers.0.self_attn.q_conv1d.weight"].dtype == torch.float32  # kept F32 in the dense plane
    assert not any(k.startswith(("vision_tower.", "mm_projector.")) for k in sd)
    assert (dst / "tiktoken.model").is_file() and (dst / "tokenizer_config.json").is_file()
    r = subprocess.run([sys.executable, "-m", "streamrt", "run", "--model", str(dst), "--prompt", "hello",
                        "--max-new-tokens", "4", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["stats"]["new_tokens"] >= 1


def test_loader_keeps_released_f32_tensors_fp32(releases, tmp_path):
    from streamrt.loader import load_model

    convert(releases["tiny-k3"], tmp_path / "t", progress=False)
    model = load_model(tmp_path / "t", dtype=torch.bfloat16)
    sd = model.state_dict()
    for k, v in sd.items():
        if any(k.endswith(leaf) for leaf in RELEASED_F32):
            assert v.dtype == torch.float32, k


# ---- what convert refuses -----------------------------------------------------------------


def _rewrite_tensor(shard: Path, name: str, fn) -> None:
    """Rewrite one tensor of a shard (safetensors' own writer, so offsets are recomputed)."""
    tensors = load_file(str(shard))
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(shard), metadata={"format": "pt"})


def test_conv_weight_as_bf16_is_refused(rel_copy, tmp_path):
    name = "language_model.model.layers.0.self_attn.q_conv1d.weight"
    shard = rel_copy / json.loads((rel_copy / INDEX).read_text())["weight_map"][name]
    _rewrite_tensor(shard, name, lambda t: t.to(torch.bfloat16))
    with pytest.raises(CheckpointError) as ei:
        convert(rel_copy, tmp_path / "out", progress=False)
    one_line(ei, shard.name, name, "dtype BF16, expected F32")
    assert not (tmp_path / "out").exists()
    assert cli_main(["convert", str(rel_copy), str(tmp_path / "out2")]) == 2
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda g: g.update(format="nvfp4-pack-quantized"), "quantization_config.config_groups.group_0.format"),
        (lambda g: g["weights"].update(group_size=16), "quantization_config.config_groups.group_0.weights.group_size"),
        (lambda g: g["weights"].update(num_bits=8), "quantization_config.config_groups.group_0.weights.num_bits"),
    ],
)
def test_quantization_config_of_another_format_is_refused(rel_copy, tmp_path, edit, field):
    cfg = json.loads((rel_copy / "config.json").read_text())
    edit(cfg["text_config"]["quantization_config"]["config_groups"]["group_0"])
    (rel_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as ei:
        convert(rel_copy, tmp_path / "out", progress=False)
    one_line(ei, "config.json", f"text_config.{field}", "mxfp4-pack-quantized")
    assert not (tmp_path / "out").exists()


def test_quantization_config_where_it_lives():
    base = json.loads(json.dumps(load_config("tiny-k3").raw))
    q = base["text_config"].pop("quantization_config")
    with pytest.raises(ConfigError) as ei:
        config_from_dict(base)
    one_line(ei, "text_config.quantization_config: missing")
    # trees written before the release layout was known: flat, on the wrapper
    base["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "bits": 4,
                                   "group_size": 32}
    assert config_from_dict(base).variant == "kimi-k3"
    base["quantization_config"]["group_size"] = 64
    with pytest.raises(ConfigError) as ei:
        config_from_dict(base)
    one_line(ei, "quantization_config.group_size", "64")
    base.pop("quantization_config")
    base["text_config"]["quantization_config"] = dict(q, quant_method="fp8")
    with pytest.raises(ConfigError) as ei:
        config_from_dict(base)
    one_line(ei, "text_config.quantization_config.quant_method", "'fp8'")


def test_architecture_must_agree_with_the_variant():
    k31 = json.loads(json.dumps(load_config("tiny-k3.1-pro").raw))
    k31["architectures"] = ["KimiK3ForConditionalGeneration"]
    with pytest.raises(ConfigError) as ei:
        config_from_dict(k31)
    one_line(ei, "architectures", "KimiK3ForConditionalGeneration", "kimi-k3.1-pro", "KimiK31ForConditionalGeneration")
    k3 = json.loads(json.dumps(load_config("tiny-k3").raw))
    k3["architectures"] = ["KimiK31ForConditionalGeneration"]
    with pytest.raises(ConfigError) as ei:
        config_from_dict(k3)
    one_line(ei, "architectures", "KimiK31ForConditionalGeneration", "kimi-k3")
    k3["architectures"] = ["DeepseekV3ForCausalLM"]
    with pytest.raises(ConfigError) as ei:
        config_from_dict(k3)
    one_line(ei, "architectures", "DeepseekV3ForCausalLM", "not a Kimi K3")


def _index(root: Path) -> dict:
    return json.loads((root / INDEX).read_text())


def test_shard_outside_the_index(rel_copy, tmp_path):
    extra = rel_copy / "model-00005-of-000004.safetensors"
    shutil.copy(rel_copy / "model-00001-of-000004.safetensors", extra)
    with pytest.raises(CheckpointError) as ei:
        convert(rel_copy, tmp_path / "out", progress=False)
    one_line(ei, extra.name, "not named by")
    assert not (tmp_path / "out").exists()


def test_index_naming_a_missing_shard(rel_copy, tmp_path):
    (rel_copy / "model-00002-of-000004.safetensors").unlink()
    with pytest.raises(CheckpointError) as ei:
        convert(rel_copy, tmp_path / "out", progress=False)
    one_line(ei, "model-00002-of-000004.safetensors", "shard missing")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "symlink loop", "directory"])
def test_index_naming_a_shard_that_is_not_a_file(rel_copy, tmp_path, kind):
    shard = rel_copy / "model-00002-of-000004.safetensors"
    shard.unlink()
    if kind == "fifo":
        os.mkfifo(shard)
    elif kind == "directory":
        shard.mkdir()
    else:
        shard.symlink_to(shard)
    with pytest.raises(CheckpointError) as ei:
        convert(rel_copy, tmp_path / "out", progress=False)
    one_line(ei, shard.name, "shard is not a regular file")
    assert not (tmp_path / "out").exists()


def test_two_shards_claiming_one_tensor(rel_copy, tmp_path):
    idx = _index(rel_copy)
    name = next(n for n, s in idx["weight_map"].items() if s == "model-00001-of-000004.safetensors" and "norm" in n)
    other = rel_copy / "model-00003-of-000004.safetensors"
    tensors = load_file(str(other))
    tensors[name] = load_file(str(rel_copy / "model-00001-of-000004.safetensors"))[name]
    save_file(tensors, str(other), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as ei:
        convert(rel_copy, tmp_path / "out", progress=False)
    one_line(ei, other.name, name, "also stored here", "model-00001-of-000004.safetensors")
    assert not (tmp_path / "out").exists()


def test_vision_tensor_with_a_broken_header(rel_copy, tmp_path):
    idx = _index(rel_copy)
    name = next(n for n in idx["weight_map"] if n.startswith("vision_tower."))
    shard = rel_copy / idx["weight_map"][name]
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8 : 8 + n])
    h[name]["data_offsets"][1] = h[name]["data_offsets"][0] + 10**9  # runs past the file
    new = json.dumps(h, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    shard.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])
    with pytest.raises(CheckpointError) as ei:
        convert(rel_copy, tmp_path / "out", progress=False)
    one_line(ei, shard.name, name)
    assert not (tmp_path / "out").exists()


# ---- counts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, total, text", [("kimi-k3", "497,220", "497,052"), ("kimi-k3.1-pro", "497,340", "497,172")]
)
def test_inspect_counts_the_seed_tensors(name, total, text, capsys):
    assert cli_main(["inspect", name]) == 0
    out = capsys.readouterr().out
    assert f"{total} = {text} text + 168 vision tower and projector" in out


def test_inspect_of_a_release_tree_counts_its_index(releases, capsys):
    root = releases["tiny-k3.1-pro"]
    n = len(_index(root)["weight_map"])
    assert cli_main(["inspect", str(root), "--json"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert (b["tensor_count"], b["vision_tensor_count"], b["counted_from"]) == (n, 18, "index")


# ---- synthetic weights that show a missing norm or clamp ------------------------------------


def test_synth_tree_shows_a_dropped_norm_gain_and_a_wrong_situ_clamp(releases, tmp_path, monkeypatch):
    import streamrt.backends.torch_backend as tb
    from streamrt.model import run_sync
    from streamrt.loader import DirectExpertProvider, load_model

    convert(releases["tiny-k3.1-pro"], tmp_path / "t", progress=False)
    tree = open_tree(tmp_path / "t")
    model, provider = load_model(tree, dtype=None), DirectExpertProvider(tree)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(5))

    def rel_change() -> float:
        return float((run_sync(model.forward_steps(ids), provider) - base).abs().max() / base.abs().max())

    base = run_sync(model.forward_steps(ids), provider)
    params = dict(model.named_parameters())
    for name in ("model.norm.weight", "model.layers.4.post_attention_layernorm.weight",
                 "model.layers.2.block_sparse_moe.routed_expert_norm.weight"):
        p = params[name]
        saved = p.detach().clone()
        with torch.no_grad():
            p.fill_(1.0)  # the gain dropped
        assert rel_change() > 1e-2, name
        with torch.no_grad():
            p.copy_(saved)
    situ = tb.situ_glu
    monkeypatch.setattr(tb, "situ_glu", lambda g, u, beta, lin: situ(g, u, math.inf, None))  # no tanh clamps
    assert rel_change() > 1e-2


# ---- the dense plane of a release's own geometry ---------------------------------------------


def test_implausible_config_is_refused_before_anything_is_built(tmp_path):
    cfg = json.loads(json.dumps(load_config("kimi-k3").raw))
    for key, value in (("num_experts", 10**9), ("num_hidden_layers", 10**7), ("hidden_size", 2**40)):
        bad = json.loads(json.dumps(cfg))
        bad["text_config"][key] = value
        p = tmp_path / f"{key}.json"
        p.write_text(json.dumps(bad))
        t0 = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-m", "streamrt", "inspect", str(p)], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 2 and r.stdout == "", (key, r.stderr[-300:])
        line = r.stderr.strip()
        assert "\n" not in line and len(line) < 300 and key in line and "implausible" in line, line
        assert time.perf_counter() - t0 < 30
    # every field in range, but together more than any machine holds
    big = json.loads(json.dumps(cfg))
    big["text_config"].update(num_experts=16384, moe_intermediate_size=65536, routed_expert_hidden_size=65536)
    with pytest.raises(ConfigError) as ei:
        config_from_dict(big)
    msg = one_line(ei, "PiB", "no machine holds that")
    assert len(msg) < 300
