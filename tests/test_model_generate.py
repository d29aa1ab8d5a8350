"""generate(): prefill + decode with caches, greedy and seeded sampling, stop tokens,
callbacks, and batch invariance of the decoded logits."""

from __future__ import annotations

import pytest
import torch

from streamrt.backends.torch_backend import TorchBackend
from streamrt.config import load_config
from streamrt.errors import StreamrtError
from streamrt.generate import generate, sample
from streamrt.model import KimiLinearForCausalLM, logits_hash
from streamrt.loader import DictExpertProvider
from streamrt.model.synthetic import init_random_, random_experts


@pytest.fixture(scope="module")
def k31():
    cfg = load_config("tiny-k3.1-pro")
    model = KimiLinearForCausalLM(cfg, backend=TorchBackend()).eval()
    init_random_(model, 3)
    return cfg, model, DictExpertProvider(random_experts(cfg, 4))


def prompt(cfg, n, seed):
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_matches_manual_decode(k31):
    cfg, model, prov = k31
    p = prompt(cfg, 14, 1)
    res = generate(model, p, provider=prov, max_new_tokens=6, stop_ids=[])
    assert res.finish_reasons == ["length"] and len(res.tokens[0]) == 6
    seq = list(p)
    with torch.no_grad():
        for _ in range(6):  # no cache: full forward over the growing sequence
            seq.append(int(model(torch.tensor(seq), provider=prov)[-1].argmax()))
    assert res.tokens[0] == seq[len(p):]
    seen = []
    one = generate(model, torch.tensor(p), provider=prov, max_new_tokens=3, stop_ids=[], on_token=seen.append)
    assert seen == one.tokens[0] == res.tokens[0][:3] and one.new_tokens == 3 and one.stop == "length"
    assert res.prefill_hashes[0] == logits_hash(res.prefill_logits[0])


def test_batch_rows_equal_single_runs_bit_for_bit(k31):
    """Beyond index_topk, prompts of different lengths: each row = its B = 1 run, logits too."""
    cfg, model, prov = k31
    prompts = [prompt(cfg, 18, 2), prompt(cfg, 9, 3), prompt(cfg, 15, 4)]
    batch = generate(model, prompts, provider=prov, max_new_tokens=5, stop_ids=[], hash_steps=True)
    for row, p in enumerate(prompts):
        one = generate(model, [p], provider=prov, max_new_tokens=5, stop_ids=[], hash_steps=True)
        assert batch.tokens[row] == one.tokens[0]
        assert batch.prefill_hashes[row] == one.prefill_hashes[0]
        assert batch.step_hashes[row] == one.step_hashes[0] and len(one.step_hashes[0]) == 4


def test_stop_tokens_and_callback(k31):
    cfg, model, prov = k31
    prompts = [prompt(cfg, 6, 5), prompt(cfg, 6, 6)]
    free = generate(model, prompts, provider=prov, max_new_tokens=4, stop_ids=[])
    stop = free.tokens[0][1]  # row 0 stops at its second token
    seen = []
    res = generate(
        model, prompts, provider=prov, max_new_tokens=4, stop_ids=[stop], on_token=lambda r, t: seen.append((r, t))
    )
    assert res.tokens[0] == free.tokens[0][: free.tokens[0].index(stop) + 1]
    assert res.finish_reasons[0] == "stop"
    if stop not in free.tokens[1]:
        assert res.tokens[1] == free.tokens[1] and res.finish_reasons[1] == "length"
    assert sorted(seen) == sorted((r, t) for r in range(2) for t in res.tokens[r])
    assert [t for r, t in seen if r == 0] == res.tokens[0]  # in order


def test_seeded_sampling(k31):
    cfg, model, prov = k31
    p = [prompt(cfg, 8, 7)]
    kw = dict(provider=prov, max_new_tokens=6, stop_ids=[], temperature=1.5, top_p=0.95)
    a, b = generate(model, p, seed=11, **kw), generate(model, p, seed=11, **kw)
    assert a.tokens == b.tokens
    others = {tuple(generate(model, p, seed=s, **kw).tokens[0]) for s in (12, 13, 14)}
    assert len(others | {tuple(a.tokens[0])}) > 1
    greedy = generate(model, p, provider=prov, max_new_tokens=6, stop_ids=[])
    nucleus1 = generate(model, p, seed=5, **{**kw, "top_p": 1e-9})  # only the top token survives
    assert nucleus1.tokens == greedy.tokens


def test_sample_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    drawn = {sample(logits, 1.0, 0.7, g) for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 < 0.7 <= 0.8: tokens 0 and 1
    assert sample(logits, 0.0, 1.0, None) == 0


def test_generate_rejects_bad_arguments(k31):
    cfg, model, prov = k31
    with pytest.raises(StreamrtError, match="at least one token"):
        generate(model, [[]], provider=prov)
    with pytest.raises(StreamrtError, match="top_p"):
        generate(model, [1, 2], provider=prov, top_p=0.0)
