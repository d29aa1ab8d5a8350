"""The prefill link arithmetic (plan/prefill_bytes.py) and `inspect --prompt-tokens`, against
an exact enumeration and a hand-written formula."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest

from streamrt.checkpoint.expert_file import ExpertLayout
from streamrt.cli.main import main
from streamrt.config import load_config
from streamrt.plan.prefill_bytes import expected_unique_experts, prefill_link_bytes


@pytest.mark.parametrize("E,k,n", [(5, 2, 3), (6, 3, 2), (4, 1, 4)])
def test_expected_unique_experts_is_the_exact_mean_union(E, k, n):
    """Every way n tokens can each pick k of E experts, equally likely: the mean union size."""
    picks = list(itertools.combinations(range(E), k))
    total = sum(len(set().union(*choice)) for choice in itertools.product(picks, repeat=n))
    exact = Fraction(total, len(picks) ** n)
    assert expected_unique_experts(E, k, n) == pytest.approx(float(exact), rel=1e-12)


def test_fanout_geometry_is_the_real_fan_out():
    cfg = load_config("fanout-k3.1-pro")
    assert (cfg.num_experts, cfg.experts_per_token, len(cfg.moe_layers)) == (896, 16, 3)
    assert (cfg.routed_expert_hidden_size, cfg.moe_intermediate_size) == (3584, 3072)
    assert cfg.indexer is not None and len(cfg.attnres_block_starts) >= 2
    assert 45e9 <= cfg.expert_files * ExpertLayout.for_config(cfg).file_bytes <= 55e9  # fits a 64 GiB disk


@pytest.mark.parametrize("tokens,chunk", [(4096, 512), (700, 256), (300, 4096)])
def test_prefill_link_bytes_by_hand(tokens, chunk):
    cfg = load_config("fanout-k3.1-pro")
    fb = ExpertLayout.for_config(cfg).file_bytes
    miss = 1 - 16 / 896

    def union(n):
        return 896 * (1 - miss**n)

    chunks = [chunk] * (tokens // chunk) + ([tokens % chunk] if tokens % chunk else [])
    chunk_major = sum(union(c) for c in chunks) * 3 * fb
    stationary = union(tokens) * 3 * fb
    assert prefill_link_bytes(cfg, fb, tokens, chunk, "chunk") == pytest.approx(chunk_major, rel=1e-12)
    assert prefill_link_bytes(cfg, fb, tokens, chunk, "layer") == pytest.approx(stationary, rel=1e-12)


@pytest.mark.parametrize("name", ["fanout-k3.1-pro", "kimi-k3.1-pro"])
def test_inspect_prompt_tokens_json(name, capsys):
    assert main(["inspect", name, "--prompt-tokens", "4096", "--prefill-chunk", "512", "--link-gbps", "50",
                 "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["prefill"]
    cfg = load_config(name)
    fb = ExpertLayout.for_config(cfg).file_bytes
    E, k, layers = cfg.num_experts, cfg.experts_per_token, len(cfg.moe_layers)
    per_chunk = E * (1 - (1 - k / E) ** 512)
    assert p["chunk_major"]["link_bytes"] == pytest.approx(8 * per_chunk * layers * fb, rel=1e-12)
    assert p["stationary"]["link_bytes"] == pytest.approx(E * (1 - (1 - k / E) ** 4096) * layers * fb, rel=1e-12)
    assert p["stationary"]["ttft_link_s"] == pytest.approx(p["stationary"]["link_bytes"] / 50e9, rel=1e-12)
    assert p["chunk_major"]["banks"] == pytest.approx(8 * per_chunk / E, rel=1e-12)  # ~8 passes over the bank


def test_inspect_prompt_tokens_text(capsys):
    assert main(["inspect", "fanout-k3.1-pro", "--prompt-tokens", "32768"]) == 0
    out = capsys.readouterr().out
    assert "chunk-major (chunk 4,096)" in out and "8.00 banks" in out and "1.00 banks" in out


def test_inspect_prompt_tokens_refuses_zero(capsys):
    assert main(["inspect", "fanout-k3.1-pro", "--prompt-tokens", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prompt-tokens" in err[0]
