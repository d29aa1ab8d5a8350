"""Config loading, variant gating (both directions), layer schedule, and the seeds' figures."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from streamrt.config import BUNDLED, K3, K31_PRO, config_from_dict, load_config
from streamrt.errors import ConfigError
from streamrt.plan.budget import GIB, MIB, budget


def raw(name: str) -> dict:
    return copy.deepcopy(load_config(name).raw)


INDEXER_NAMES = {"language_model.model.layers.3.self_attn.indexer.wq_b.weight", "language_model.model.norm.weight"}
PLAIN_NAMES = {"language_model.model.norm.weight"}


# ---- the seeds' numbers from the bundled full-geometry configs ---------------------------


@pytest.mark.parametrize("name", ["kimi-k3", "kimi-k3.1-pro"])
def test_seed_figures(name):
    b = budget(load_config(name))
    assert b["num_layers"] == 93
    assert len(b["kda_layers"]) == 69 and len(b["mla_layers"]) == 24
    assert b["mla_layers"] == list(range(3, 92, 4)) + [92]  # 0-based {3, 7, ..., 91, 92}
    assert b["working_set_experts"] == 1472  # 92 MoE layers x top-16
    assert round(b["expert_bytes_nvfp4"] / MIB, 2) == 17.72
    assert round(b["expert_bytes_per_token"] / GIB, 1) == 25.5
    assert b["expert_files"] == 82_432
    assert b["mla_latent_bytes_per_token_idealized"] == 24 * 1024  # 24 KiB
    assert b["mla_latent_bytes_per_token_idealized"] * 1_048_576 == 24 * GIB  # 24 GiB at 1M tokens
    assert round(b["kda_state_bytes"]["bf16"] / MIB) == 207
    assert round(b["kda_state_bytes"]["fp32"] / MIB) == 414
    assert b["kda_state_bytes"]["bf16"] == 108_527_616 * 2
    assert round(b["routed_params_per_layer"] / 1e9, 1) == 29.6
    assert round(b["active_routed_params_per_token_per_layer"] / 1e6) == 528
    assert b["attnres_groups"] == 8
    assert b["attnres_block_starts"][-1] == 84  # final group partial: layers 84..92 (9 of 12)


def test_variants_are_told_apart():
    k3, k31 = load_config("kimi-k3"), load_config("kimi-k3.1-pro")
    assert k3.variant == K3 and k3.indexer is None
    assert k31.variant == K31_PRO
    # dsa_layers [4, 8, ..., 92, 93] (1-based) are exactly the 0-based full-attention set
    assert k31.indexer.layers == k31.mla_layers
    assert k31.indexer.n_heads == 32 and k31.indexer.head_dim == 128 and k31.indexer.topk == 2048
    assert k31.indexer.rope_dim == 0


def test_a_log_padding_recorded():
    assert load_config("kimi-k3").a_log_stored_len == 128  # 96 heads padded to head_dim
    assert load_config("tiny-k3").a_log_stored_len == 16


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_configs_load(name):
    cfg = load_config(name)
    assert cfg.num_layers - 1 in cfg.mla_layers  # the final-layer exception is always MLA
    assert cfg.moe_layers and cfg.dense_layers == tuple(range(cfg.first_k_dense_replace))


@pytest.mark.parametrize("name", ["tiny-k3", "tiny-k3.1-pro"])
def test_tiny_structure(name):
    cfg = load_config(name)
    assert cfg.attnres_groups >= 2 and cfg.num_layers % cfg.attn_res_block_size != 0  # partial last group
    assert len(cfg.mla_layers) >= 2 and cfg.num_layers - 1 in cfg.mla_layers
    assert cfg.num_experts >= 32 and cfg.experts_per_token == 4
    if cfg.indexer:
        assert cfg.indexer.topk <= 16


def test_slice_geometry():
    cfg = load_config("slice-k3.1-pro")
    b = budget(cfg)
    assert cfg.hidden_size == 7168 and (cfg.routed_expert_hidden_size, cfg.moe_intermediate_size) == (3584, 3072)
    assert 15e9 <= b["routed_bytes_total_nvfp4"] <= 20e9


# ---- variant gating, both directions ------------------------------------------------------


def test_gate_marker_without_dsa_config():
    d = raw("kimi-k3.1-pro")
    del d["text_config"]["dsa_config"]
    with pytest.raises(ConfigError, match=r"model_type 'kimi_k31'.*present but text_config.dsa_config"):
        config_from_dict(d)


def test_gate_dsa_config_without_marker():
    d = raw("kimi-k3.1-pro")
    d["model_type"] = "kimi_k3"
    with pytest.raises(ConfigError, match=r"text_config.dsa_config present but model_type 'kimi_k31' missing"):
        config_from_dict(d)


def test_gate_dsa_config_misplaced_at_top_level():
    d = raw("kimi-k3.1-pro")
    d["dsa_config"] = d["text_config"].pop("dsa_config")
    with pytest.raises(ConfigError, match=r"^config.json: dsa_config: .*belongs inside text_config"):
        config_from_dict(d)


def test_gate_indexer_tensors_in_k3_checkpoint():
    with pytest.raises(ConfigError, match=r"indexer tensors present but model_type 'kimi_k31', text_config.dsa_config"):
        config_from_dict(raw("kimi-k3"), tensor_names=INDEXER_NAMES)


def test_gate_k31_config_without_indexer_tensors():
    with pytest.raises(ConfigError, match=r"present but indexer tensors missing"):
        config_from_dict(raw("kimi-k3.1-pro"), tensor_names=PLAIN_NAMES)


def test_gate_consistent_trees_pass():
    assert config_from_dict(raw("kimi-k3.1-pro"), tensor_names=INDEXER_NAMES).variant == K31_PRO
    assert config_from_dict(raw("kimi-k3"), tensor_names=PLAIN_NAMES).variant == K3


def test_gate_reads_the_tree_index(tmp_path):
    d = raw("tiny-k3")
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"language_model.model.layers.3.self_attn.indexer.wk.weight": "a.safetensors"}})
    )
    with pytest.raises(ConfigError, match="indexer tensors present"):
        load_config(tmp_path)


# ---- schedule errors name the field --------------------------------------------------------


def _bad(mutate, match):
    d = raw("tiny-k3.1-pro")
    mutate(d["text_config"])
    with pytest.raises(ConfigError, match=match):
        config_from_dict(d)


def test_schedule_zero_based_list_rejected():
    def m(t):
        t["linear_attn_config"]["full_attn_layers"] = [3, 7, 8]
        t["linear_attn_config"]["kda_layers"] = [0, 1, 2, 4, 5, 6]

    _bad(m, r"text_config.linear_attn_config.kda_layers: entries \[0\] are out of range: the list is 1-based")


def test_schedule_out_of_range():
    _bad(lambda t: t["linear_attn_config"].__setitem__("full_attn_layers", [4, 8, 10]),
         r"text_config.linear_attn_config.full_attn_layers: entries \[10\] are out of range")


def test_schedule_overlap():
    _bad(lambda t: t["linear_attn_config"].__setitem__("kda_layers", [1, 2, 3, 4, 5, 6, 7]),
         r"text_config.linear_attn_config.full_attn_layers: layers \[4\] \(1-based\) are also in kda_layers")


def test_schedule_gap():
    _bad(lambda t: t["linear_attn_config"].__setitem__("kda_layers", [1, 2, 3, 5, 6]),
         r"must partition 1..9; missing \[7\]")


def test_schedule_duplicates():
    _bad(lambda t: t["linear_attn_config"].__setitem__("full_attn_layers", [4, 8, 9, 9]),
         r"full_attn_layers: has duplicate entries")


def test_dsa_layers_must_be_full_attention():
    _bad(lambda t: t["dsa_config"].__setitem__("dsa_layers", [4, 5]),
         r"text_config.dsa_config.dsa_layers: layers \[5\] \(1-based\) are not full-attention layers")


def test_index_rope_dim_must_be_zero():
    _bad(lambda t: t["dsa_config"].__setitem__("index_rope_dim", 64), r"text_config.dsa_config.index_rope_dim")


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("hidden_size", 0, r"text_config.hidden_size: must be >= 1, got 0"),
        ("hidden_size", -5, r"text_config.hidden_size: must be >= 1"),
        ("num_hidden_layers", "9", r"text_config.num_hidden_layers: expected an integer"),
        ("num_experts", 2.5, r"text_config.num_experts: expected an integer"),
        ("num_experts_per_token", 64, r"text_config.num_experts_per_token: 64 exceeds num_experts"),
        ("rms_norm_eps", -1.0, r"text_config.rms_norm_eps: must be > 0"),
        ("moe_intermediate_size", 48, r"text_config.moe_intermediate_size: 48 is not a multiple of 32"),
        ("eos_token_id", 99999, r"text_config.eos_token_id: 99999 is outside the vocabulary"),
        ("mla_use_nope", "yes", r"text_config.mla_use_nope: expected true or false"),
        ("model_type", "llama", r"text_config.model_type: expected 'kimi_linear'"),
    ],
)
def test_field_errors_name_the_path(field, value, match):
    _bad(lambda t: t.__setitem__(field, value), match)


def test_missing_field_named():
    _bad(lambda t: t.pop("kv_lora_rank"), r"text_config.kv_lora_rank: missing")


def test_missing_nested_field_named():
    _bad(lambda t: t["linear_attn_config"].pop("kda_layers"), r"text_config.linear_attn_config.kda_layers: missing")


def test_moe_and_attnres_schedule():
    cfg = load_config("tiny-k3.1-pro")
    assert cfg.moe_layers == tuple(range(1, 9)) and cfg.dense_layers == (0,)
    assert cfg.attnres_block_starts == (0, 4, 8)
    assert cfg.layer_kind(3) == "mla" and cfg.layer_kind(2) == "kda" and cfg.has_indexer(8)


# ---- the CLI: one line, exit 2, no traceback ------------------------------------------------


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "streamrt", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda p: None, "no such config file"),
        (lambda p: p.write_text("{not json"), "invalid JSON at line 1"),
        (
            lambda p: p.write_text(json.dumps({"model_type": "kimi_k3", "text_config": []})),
            "text_config: expected an object",
        ),
        (lambda p: p.write_text(json.dumps({"model_type": "kimi_k3"})), "text_config: missing"),
    ],
)
def test_cli_bad_input_one_line_exit_2(tmp_path, make, needle):
    p = tmp_path / "config.json"
    make(p)
    r = _cli("inspect", str(p))
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_inspect_json():
    r = _cli("inspect", "kimi-k3.1-pro", "--json")
    assert r.returncode == 0, r.stderr
    b = json.loads(r.stdout)
    for key in (
        "variant", "num_layers", "kda_layers", "mla_layers", "indexer_layers", "moe_layers", "experts_per_layer",
        "experts_per_token", "working_set_experts", "expert_bytes_nvfp4", "expert_bytes_mxfp4",
        "expert_bytes_per_token", "expert_files", "mla_latent_bytes_per_token_idealized", "kv_cache_bytes_per_token",
        "kda_state_bytes", "routed_params_per_layer", "active_routed_params_per_token_per_layer", "attnres_groups",
        "tensor_count",
    ):
        assert key in b, key
    assert b["variant"] == "kimi-k3.1-pro" and b["working_set_experts"] == 1472
