"""The shipped default model: a small trained K3.1 Pro-architecture model.

Everything runs through the real inference path: the converted tree in
`streamrt/assets/default_model/` -> `load_model` (BF16 dense) + the tree's NVFP4 expert
files -> `generate` greedy with caches (per-prompt prefill, then recurrent KDA and absorbed
MLA decode with the Lightning Indexer's top-k). Prompts and trained answers come from
training/corpus.py; training/eval_small.py holds the shared helpers and prints a report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))

import corpus as C  # noqa: E402
import eval_small as E  # noqa: E402

from streamrt.default_model import default_model_dir, packaged_model_dir  # noqa: E402

CITIES = ["Paris", "London", "Tokyo", "Cairo", "Sydney", "Toronto"]


@pytest.fixture(scope="module")
def runner():
    path = packaged_model_dir()
    assert path is not None, "streamrt/assets/default_model/manifest.json is missing: the trained model is not shipped"
    return E.Runner(path)


@pytest.fixture(scope="module")
def answers(runner):
    """Greedy answers to 20 training and 10 held-out prompts, in one batch."""
    train = E.train_cases(runner.tok, E.TEST_TRAIN)
    held = E.heldout_cases(runner.tok, E.TEST_HELDOUT)
    res = E.run_cases(runner, train + held, batch=64)
    return res[: len(train)], res[len(train) :]


@pytest.fixture(scope="module")
def weather(runner):
    """The get_weather round trip for six training cities, recording every top-k selection."""
    be = runner.model.backend
    seen = []
    orig = be.select_topk

    def record(scores, k, length=None):
        sel = orig(scores, k, length)
        if length is None:
            seen.append((scores.numel(), sel.numel(), int(torch.unique(sel).numel())))
        for row, n in zip(sel.view(-1, sel.shape[-1]), [] if length is None else length.tolist()):
            picked = row[: min(k, n)]  # decode: scores over the capacity, valid below the row's length
            seen.append((n, picked.numel(), int(torch.unique(picked).numel())))
        return sel

    be.select_topk = record
    try:
        rows = E.weather_roundtrip(runner, CITIES)
    finally:
        be.select_topk = orig
    return rows, seen


def test_shipped_tree_is_packaged_and_small():
    path = packaged_model_dir()
    assert path is not None and default_model_dir(lambda _msg: None) == path  # `streamrt run` uses it
    manifest = json.loads((path / "manifest.json").read_text())
    total = sum(f["size"] for f in manifest["files"].values()) + (path / "manifest.json").stat().st_size
    assert total <= 8 * 2**20, f"shipped tree is {total} bytes"
    cfg = E.open_tree(path).config
    assert cfg.is_k31 and cfg.indexer.topk == 32 and cfg.num_experts >= 16 and cfg.experts_per_token == 4
    assert cfg.num_shared_experts >= 1 and cfg.dense_layers == (0,) and len(cfg.attnres_block_starts) >= 2
    assert cfg.layer_kind(cfg.num_layers - 1) == cfg.layer_kind(cfg.num_layers - 2) == "mla"
    assert set(cfg.indexer.layers) == set(cfg.mla_layers) and set(cfg.kda_layers)


def assert_exact_share(cases, runner, at_least: int, share: float) -> None:
    """At least `at_least` prompts, and `share` of them answered exactly as trained."""
    assert len(cases) >= at_least
    score = E.exact(cases)
    misses = [(c.name, runner.tok.decode(got)) for c, got in cases if got != c.target]
    assert score >= share, f"{score:.0%} exact; misses: {misses[:5]}"


def test_training_prompts_reproduce_trained_answers(answers, runner):
    assert_exact_share(answers[0], runner, 20, 0.9)


def test_heldout_prompts(answers, runner):
    assert_exact_share(answers[1], runner, 10, 0.7)


def test_weather_tool_call_and_final_answer(weather):
    rows, _ = weather
    assert rows[0][0] == "Paris" and len(rows) >= 6
    for city, call, final, want in rows:
        assert call == ("get_weather", {"city": city}), f"{city}: tool call {call}"
        res = C.weather_result(city, 50)
        assert str(res["temperature_c"]) in final and res["condition"] in final, f"{city}: {final!r}"
        assert final == want


def test_selection_is_a_strict_subset_and_answers_hold(weather, runner):
    rows, seen = weather
    topk = runner.cfg.indexer.topk
    long = [s for s in seen if s[0] > topk]
    assert long, "no decode step ran with more than index_topk cached positions"
    assert all(n_sel == topk == uniq for _n, n_sel, uniq in long)  # k distinct positions out of n > k
    assert max(n for n, _, _ in seen) > 4 * topk
    assert all(call == ("get_weather", {"city": city}) and final == want for city, call, final, want in rows)


def test_forcing_dense_attention_changes_the_logits(runner):
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    ids = E.encode_chat(runner.tok, msgs, [C.WEATHER_TOOL])
    assert len(ids) > 4 * runner.cfg.indexer.topk
    sparse = runner.prefill_logits(ids)
    runner.set_sparse(False)
    try:
        dense = runner.prefill_logits(ids)
    finally:
        runner.set_sparse(True)
    again = runner.prefill_logits(ids)
    assert torch.equal(sparse, again)  # deterministic, so the difference below is the selection's
    assert torch.isfinite(dense).all() and (sparse - dense).abs().max() > 1e-3


def test_selfcheck_passes_on_the_shipped_model():
    proc = subprocess.run([sys.executable, "-m", "streamrt", "selfcheck", "--cycles", "3"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout
