"""Forwards driven in lockstep (the server's step: a decode batch and new prompts' prefills in one
pass): each forward's logits are bit-identical to running it alone, and requests for the same layer
are served as one (fewer provider calls, the union of the experts)."""

from __future__ import annotations

import pytest
import torch

from streamrt.backends.torch_backend import TorchBackend
from streamrt.config import load_config
from streamrt.loader import DictExpertProvider
from streamrt.model import KimiLinearForCausalLM, run_sync
from streamrt.model.lockstep import lockstep
from streamrt.model.synthetic import init_random_, random_experts


def _model():
    cfg = load_config("tiny-k3.1-pro")
    model = KimiLinearForCausalLM(cfg, backend=TorchBackend()).eval()
    init_random_(model, 3)
    return cfg, model, random_experts(cfg, 11)


def _forwards(model, cfg, seed: int):
    """A 2-row decode step on a prefilled cache and two prompts (one in two chunks), fresh caches."""
    g = torch.Generator().manual_seed(seed)
    experts = DictExpertProvider(random_experts(cfg, 11))
    batch = model.new_cache(2)
    run_sync(model.forward_steps(torch.randint(0, cfg.vocab_size, (2, 5), generator=g), batch), experts)
    last = torch.randint(0, cfg.vocab_size, (2, 1), generator=g)
    a = torch.randint(0, cfg.vocab_size, (1, 9), generator=g)
    b = torch.randint(0, cfg.vocab_size, (1, 13), generator=g)
    ca, cb = model.new_cache(1), model.new_cache(1)
    return [
        lambda: model.forward_steps(last, batch),
        lambda: model.forward_steps(a, ca, last_only=True),
        lambda: model.forward_steps(b, cb, last_only=True, prefill_chunk=8),
    ], (batch, ca, cb)


@pytest.mark.parametrize("order", ["chunk", "layer"])
def test_lockstep_is_bit_identical_and_shares_each_layers_fetch(order):
    cfg, model, experts = _model()
    model.prefill_order = order
    try:
        with torch.no_grad():
            makers, _ = _forwards(model, cfg, 5)
            alone_provider = DictExpertProvider(experts, record=True)
            alone = [run_sync(make(), alone_provider) for make in makers]
            makers, _ = _forwards(model, cfg, 5)
            merged_provider = DictExpertProvider(experts, record=True)
            together = run_sync(lockstep([make() for make in makers]), merged_provider)
    finally:
        model.prefill_order = "layer"
    assert len(together) == 3
    for x, y in zip(alone, together):
        assert x.shape == y.shape and torch.equal(x, y)
    n_moe = len(cfg.moe_layers)
    first = merged_provider.requests[0]
    if order == "chunk":  # decode 1 pass, a 1 pass, b 2 chunks: 4 passes
        assert len(alone_provider.requests) == 4 * n_moe
        # b's second chunk runs alone after the three first passes went together: 2 passes' worth
        assert len(merged_provider.requests) == 2 * n_moe
        assert first.ids.shape[0] == 2 + 9 + 8  # the decode rows, a's 9 positions, b's first chunk of 8
    else:  # b's two chunks are one pass layer by layer: all three go together
        assert len(alone_provider.requests) == 3 * n_moe
        assert len(merged_provider.requests) == n_moe
        assert first.ids.shape[0] == 2 + 9 + 13


def test_a_bound_forward_reaches_decode_steps_only_and_lockstep_binds_its_parts():
    """The driver's `Forward`: a decode step on a cache runs through its graphs (given the step
    hint), a prefill never does; lockstep hands it to each forward; unbound, a forward runs op by
    op and nothing is set on the model."""
    from streamrt.model.model import Forward

    cfg, model, experts = _model()
    provider = DictExpertProvider(experts)
    calls = []

    class Graphs:  # stands in for the runtime's decode graphs: records, then runs op by op
        def steps(self, ids, cache, last_only, step_hint):
            calls.append((tuple(ids.shape), step_hint))
            return (yield from model.forward_chunk(ids, cache, last_only, step_hint))

    hinted = []
    forward = Forward(graphs=Graphs(), step_hint=lambda h: hinted.append(tuple(h.shape)))
    with torch.no_grad():
        makers, (batch, _, _) = _forwards(model, cfg, 7)
        want = run_sync(makers[0](), provider)  # unbound: op by op
        assert calls == [] and hinted == []
        makers, _ = _forwards(model, cfg, 7)
        gen = lockstep([m() for m in makers])
        gen.bind(forward)
        got = run_sync(gen, provider)
    assert torch.equal(got[0], want)
    assert calls == [((2, 1), forward.step_hint)] and hinted == [(2, cfg.hidden_size)]  # the decode step alone
    assert not hasattr(model, "decode_graphs") and not hasattr(model, "step_hint")
