"""top_k, min_p and repetition_penalty as vLLM and llama-server define them, against the
definitions written out in float64 numpy; the same fields through generate(), `streamrt run`'s
flags and the HTTP API, and an unknown request field refused by name."""

from __future__ import annotations

import json
import secrets

import numpy as np
import pytest
import torch

from streamrt.errors import StreamrtError
from streamrt.generate import apply_penalties, generate, sample, sampling_probs


def _reference_probs(logits: np.ndarray, temperature: float, top_p: float, top_k: int, min_p: float) -> np.ndarray:
    """vLLM's order: softmax(logits / T); min_p drops p < min_p * max p; top_k keeps the k
    largest (k <= 0: all); top_p keeps the smallest most-probable prefix with mass >= top_p;
    renormalised after each filter."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if min_p > 0:
        p = np.where(p < min_p * p.max(), 0.0, p)
        p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(p.size, dtype=bool)
    k = top_k if 0 < top_k < p.size else p.size
    keep[order[:k]] = True
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    if top_p < 1:
        mass, chosen = 0.0, []
        for j in order:
            if not keep[j] or mass >= top_p:
                break
            chosen.append(j)
            mass += p[j]
        p = np.where(np.isin(np.arange(p.size), chosen), p, 0.0)
        p /= p.sum()
    return p


def _reference_repetition(logits: np.ndarray, seen: set[int], r: float) -> np.ndarray:
    out = logits.copy()
    for j in seen:
        out[j] = out[j] / r if out[j] > 0 else out[j] * r
    return out


@pytest.mark.parametrize("case", range(12))
def test_sampling_filters_match_the_numpy_definition(case):
    rng = np.random.default_rng(secrets.randbits(32))
    V = int(rng.integers(2, 300))
    logits = rng.normal(0, 3, V)
    temperature = float(rng.uniform(0.2, 2.0))
    top_k = int(rng.choice([-1, 0, 1, int(rng.integers(1, V + 2))]))
    min_p = float(rng.choice([0.0, rng.uniform(0, 1)]))
    top_p = float(rng.choice([1.0, rng.uniform(0.05, 1)]))
    want = _reference_probs(logits, temperature, top_p, top_k, min_p)
    got = sampling_probs(torch.tensor(logits, dtype=torch.float32), temperature, top_p, top_k, min_p)
    # the runtime's logits are fp32: compare against the reference of the same rounded values
    want32 = _reference_probs(logits.astype(np.float32).astype(np.float64), temperature, top_p, top_k, min_p)
    assert np.allclose(got.numpy(), want32, rtol=1e-9, atol=1e-12), (V, temperature, top_k, min_p, top_p)
    assert set(np.flatnonzero(got.numpy())) == set(np.flatnonzero(want32))
    assert np.allclose(got.numpy(), want, atol=1e-5)
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    draws = {sample(torch.tensor(logits, dtype=torch.float32), temperature, top_p, g, top_k, min_p) for _ in range(50)}
    assert draws <= set(np.flatnonzero(want32))


def test_top_k_one_and_min_p_one_are_the_argmax():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(secrets.randbits(31)))
    best = int(logits.argmax())
    g = torch.Generator().manual_seed(1)
    assert {sample(logits, 1.5, 1.0, g, top_k=1) for _ in range(20)} == {best}
    assert {sample(logits, 1.5, 1.0, g, min_p=1.0) for _ in range(20)} == {best}


def test_repetition_penalty_matches_the_numpy_definition():
    rng = np.random.default_rng(secrets.randbits(32))
    V = 64
    logits = rng.normal(0, 2, V).astype(np.float32)
    prompt = rng.integers(0, V, 20).tolist()
    generated = rng.integers(0, V, 10).tolist()
    r = float(rng.uniform(0.3, 3.0))
    want = _reference_repetition(logits.astype(np.float64), set(prompt) | set(generated), r)
    got = apply_penalties(torch.tensor(logits), generated, 0.0, 0.0, r, prompt)
    assert np.allclose(got.double().numpy(), want, rtol=1e-6, atol=0)
    # then OpenAI's presence/frequency over the generated tokens only, as vLLM orders them
    count = np.bincount(generated, minlength=V)
    want2 = want - 0.5 * count - 0.25 * (count > 0)
    got2 = apply_penalties(torch.tensor(logits), generated, 0.25, 0.5, r, prompt)
    assert np.allclose(got2.double().numpy(), want2, rtol=1e-6, atol=1e-6)
    t = torch.tensor(logits)
    assert apply_penalties(t, generated, 0.0, 0.0, 1.0, prompt) is t


class _Model:
    """A model stand-in for generate(): its logits favour token 1, then 2, ..."""

    class config:
        eos_token_id = 99

    lm_head = torch.nn.Linear(1, 1)

    def new_cache(self, batch, device):
        return object()

    def forward_steps(self, ids, cache, **_):
        return ids


def _runner(ids):
    V = 8
    row = torch.linspace(1.0, 0.1, V)  # positive, token 0 first
    return row.expand(ids.shape[0], 1, V).clone()


def test_generate_applies_the_repetition_penalty_over_prompt_and_output():
    """Greedy: without a penalty the top token repeats; with 2.0 every used token halves, so the
    reply walks to tokens unused by the prompt or the reply so far."""
    plain = generate(_Model(), [3], runner=_runner, max_new_tokens=3, stop_ids=[])
    assert plain.tokens == [[0, 0, 0]]
    steered = generate(_Model(), [1], runner=_runner, max_new_tokens=3, stop_ids=[], repetition_penalty=2.0)
    # linspace 1.0 .. 0.1 by 9/70: token 0 halved (0.5) falls below 2 (0.743), which halved
    # (0.371) falls below 3 (0.614); token 1 is in the prompt (0.436 after the penalty)
    assert steered.tokens == [[0, 2, 3]]
    with pytest.raises(StreamrtError, match="repetition_penalty"):
        generate(_Model(), [1], runner=_runner, max_new_tokens=1, repetition_penalty=0.0)
    with pytest.raises(StreamrtError, match="min_p"):
        generate(_Model(), [1], runner=_runner, max_new_tokens=1, min_p=1.5)


def test_run_flags_are_checked_in_one_line(capsys):
    from streamrt.cli import main

    for argv, flag in ((["--top-k", "x"], "--top-k"), (["--min-p", "2"], "--min-p"),
                       (["--repetition-penalty", "0"], "--repetition-penalty"), (["--min-p", "nan"], "--min-p")):
        assert main(["run", "--prompt", "hi", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("streamrt:") and flag in err and "\n" not in err, err


# ---- HTTP ---------------------------------------------------------------------------------


def _post(body: dict, path: str = "/v1/chat/completions", jobs: list | None = None):
    """POST one body to an app with the real routes and tokenizer; the engine's submit is
    replaced by one that keeps the Job in `jobs` and answers 503 (nothing is generated)."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from streamrt.default_model import default_model_dir
    from streamrt.serve.app import create_app
    from streamrt.cli.serve import build_state
    from streamrt.serve.engine import QueueFull
    from streamrt.tokenizer import load_tokenizer

    root = default_model_dir()
    cfg = json.loads((root / "config.json").read_text())["text_config"]

    class _Runner:
        name, max_context, stats = "m", 2048, None
        tokenizer = load_tokenizer(root, cfg["vocab_size"], cfg.get("eos_token_id"))

    state = build_state(_Runner(), max_batch=1, max_queue=1)

    def submit(job):
        (jobs if jobs is not None else []).append(job)
        raise QueueFull("test")

    state.engine.submit = submit
    with TestClient(create_app(state)) as c:
        return c.post(path, content=json.dumps(body))


@pytest.mark.parametrize("path, base", [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": "m", "prompt": "hi"}),
])
def test_unknown_fields_are_a_400_naming_them(path, base):
    r = _post({**base, "frobnicate": 1, "top_q": 0.5}, path)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "frobnicate" in err["message"] and "top_q" in err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == "frobnicate"


@pytest.mark.parametrize("field, value", [("top_k", 1.5), ("min_p", 1.5), ("min_p", -0.1),
                                          ("repetition_penalty", 0), ("repetition_penalty", "2")])
def test_bad_sampling_fields_are_a_400_naming_them(field, value):
    r = _post({"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("path, base", [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": "m", "prompt": [5, 6]}),
])
def test_sampling_fields_reach_the_job(path, base):
    k, min_p, rep = secrets.randbelow(50) + 1, secrets.randbelow(100) / 100, 0.5 + secrets.randbelow(100) / 50
    jobs: list = []
    r = _post({**base, "top_k": k, "min_p": min_p, "repetition_penalty": rep}, path, jobs)
    assert r.status_code == 503 and len(jobs) == 1, r.text
    assert (jobs[0].top_k, jobs[0].min_p, jobs[0].repetition_penalty) == (k, min_p, rep)
    r = _post({**base, "top_k": None, "min_p": None, "repetition_penalty": None}, path, jobs)
    assert (jobs[1].top_k, jobs[1].min_p, jobs[1].repetition_penalty) == (0, 0.0, 1.0)
