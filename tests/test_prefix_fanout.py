"""Requests that arrive together sharing a long prefix (clients with one system prompt): the
serve engine on a tiny random model prefills the shared part once. The first request leads; the
others wait until its prefill leaves a snapshot where the shared part ends (aligned to where the
backend may resume), then resume there and prefill only their own suffix. Every reply, and the
logits its first token came from, equals the same request served alone, bit for bit; a request
that shares nothing is not held back; a follower whose leader is cancelled or fails completes
on its own."""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamrt.model import run_sync
from streamrt.model.lockstep import lockstep
from streamrt.model.prefix_cache import PrefixCache, common_prefix
from streamrt.serve.engine import Engine, EngineError, Job
from tiny_models import random_ids, random_model, row_dependent

SYSTEM = 150  # shared tokens: past two KDA chunks, not a multiple of the 64-token prefill chunk


class TinyRunner:
    """The serve runner's step (runner.py) on a tiny model: the decode step and the prefill pieces
    in lockstep, answered by a dict of experts; it counts the prompt tokens prefilled, logs each
    step's piece lengths and keeps each piece's last-position logits."""

    def __init__(self, model, provider, *, rows_exact: bool = True, fail_at: int | None = None):
        self.model, self.provider, self.fail_at = model, provider, fail_at
        self.device = torch.device("cpu")
        self.prefill_rows_exact = rows_exact
        self.prefill_stride = model.prefill_chunk_tokens(None, self.device)
        self.prefilled, self.calls, self.pieces = 0, [], []

    def new_cache(self):
        return self.model.new_cache(1, self.device)

    async def step(self, last, cache, prefills):
        self.calls.append(tuple(len(ids) for ids, _ in prefills))
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("device fell over")
        gens = [self.model.forward_steps(torch.tensor([[t] for t in last]), cache)] if last else []
        gens += [self.model.forward_steps(torch.tensor([ids]), c, last_only=True) for ids, c in prefills]
        with torch.no_grad():
            out = run_sync(lockstep(gens), self.provider)
        await asyncio.sleep(0)
        decoded = out.pop(0)[:, 0].float() if last else None
        logits = [x[0, 0].float() for x in out]
        for (ids, c), x in zip(prefills, logits):
            self.prefilled += len(ids)
            self.pieces.append((c.lengths[0], tuple(ids), x))
        return decoded, logits

    def first_logits(self, ids: list[int]) -> torch.Tensor:
        """The logits a job's first token was sampled from: its last piece's."""
        (x,) = [x for n, piece, x in self.pieces if n == len(ids) and piece == tuple(ids[-len(piece):])]
        return x


def _model(name: str, rows_exact: bool):
    cfg, model, prov = random_model(name, 5, 6)
    if not rows_exact:  # nvrtc's case: snapshots kept and resumed at multiples of the prefill chunk only
        model = row_dependent(cfg, model)
    return cfg, model, prov


def _prompts(cfg, seed: int, sizes) -> list[list[int]]:
    """The shared system part plus each client's own suffix, whose first ids all differ."""
    system = random_ids(cfg, SYSTEM, seed).tolist()
    out = []
    for i, n in enumerate(sizes):
        own = random_ids(cfg, n, seed + 1 + i).tolist()
        own[0] = (system[0] + 1 + i) % cfg.vocab_size  # not the system part's next id, nor another client's
        out.append(system + own)
    return out


def _serve(runner, prompts, *, prefix: PrefixCache | None, prefill_chunk: int, max_tokens: int = 4,
           cancel_first_after: int | None = None, max_batch: int = 0):
    """Submit every prompt at once (greedy), run the engine until all end: the jobs."""

    async def go():
        engine = Engine(runner, max_batch=max_batch or len(prompts) + 1, prefill_chunk=prefill_chunk,
                        prefix_cache=prefix)
        jobs = [Job(ids, max_tokens, frozenset()) for ids in prompts]
        for job in jobs:
            engine.submit(job)
        loop = asyncio.ensure_future(engine.run())
        if cancel_first_after is not None:
            while len(runner.calls) < cancel_first_after:
                await asyncio.sleep(0)
            jobs[0].cancel()
        for job in jobs:
            try:
                async for _ in job.stream():
                    pass
            except EngineError:
                pass
        engine.stop()
        await loop
        return jobs

    return asyncio.run(asyncio.wait_for(go(), 300))


def _alone(model, prov, ids, prefill_chunk: int, rows_exact: bool):
    """(greedy tokens, first-token logits) of the request served alone, no prefix cache."""
    runner = TinyRunner(model, prov, rows_exact=rows_exact)
    (job,) = _serve(runner, [ids], prefix=None, prefill_chunk=prefill_chunk)
    return job.tokens, runner.first_logits(ids)


@pytest.mark.parametrize("name,rows_exact,chunk", [("tiny-k3.1-pro", True, 0), ("tiny-k3", True, 64),
                                                   ("tiny-k3.1-pro", False, 64)])
def test_clients_sharing_a_system_prompt_prefill_it_once(name, rows_exact, chunk):
    cfg, model, prov = _model(name, rows_exact)
    align = 1 if rows_exact else chunk
    seed = 40 + 3 * chunk + rows_exact
    prompts = _prompts(cfg, seed, (7, 12, 9, 15))
    other = random_ids(cfg, 20, seed + 50).tolist()  # shares nothing: never waits behind the followers
    other[0] = (prompts[0][0] + 7) % cfg.vocab_size
    prompts.insert(2, other)
    runner = TinyRunner(model, prov, rows_exact=rows_exact)
    jobs = _serve(runner, prompts, prefix=PrefixCache(1 << 30), prefill_chunk=chunk)
    shared = SYSTEM // align * align
    followers = [j for j in jobs if j.ids is not other and j is not jobs[0]]
    assert all(common_prefix(j.ids, jobs[0].ids) == SYSTEM for j in followers)
    assert jobs[0].cached_tokens == 0 and jobs[2].cached_tokens == 0
    assert [j.cached_tokens for j in followers] == [shared] * 3
    # the system part once, then every client's own tokens
    assert runner.prefilled == len(jobs[0].ids) + len(other) + sum(len(j.ids) - shared for j in followers)
    # the first step: the leader's first piece and all of `other`, the followers wait
    assert runner.calls[0] == (min(chunk or SYSTEM, SYSTEM // align * align), len(other))
    for job in jobs:
        tokens, logits = _alone(model, prov, job.ids, chunk, rows_exact)
        assert job.finish_reason == "length" and job.tokens == tokens
        assert torch.equal(runner.first_logits(job.ids), logits)


def test_followers_waiting_for_a_row_still_get_the_shared_snapshot():
    """One batch row: the leader holds it while it prefills and decodes; the others, queued for the
    row, mark the leader's prefill all the same and each resumes at the shared part's end."""
    cfg, model, prov = _model("tiny-k3", True)
    prompts = _prompts(cfg, 70, (8, 5, 11))
    runner = TinyRunner(model, prov)
    jobs = _serve(runner, prompts, prefix=PrefixCache(1 << 30), prefill_chunk=0, max_batch=1)
    assert [j.cached_tokens for j in jobs] == [0, SYSTEM, SYSTEM]
    assert runner.prefilled == SYSTEM + 8 + 5 + 11
    for job in jobs:
        tokens, logits = _alone(model, prov, job.ids, 0, True)
        assert job.tokens == tokens and torch.equal(runner.first_logits(job.ids), logits)


def test_a_short_share_is_not_waited_for():
    """Two prompts that share 40 tokens (under one KDA chunk): both prefill at once, whole."""
    cfg, model, prov = _model("tiny-k3", True)
    a, b = (random_ids(cfg, 60, s).tolist() for s in (80, 81))
    b[:40] = a[:40]
    b[40] = (a[40] + 1) % cfg.vocab_size
    runner = TinyRunner(model, prov)
    jobs = _serve(runner, [a, b], prefix=PrefixCache(1 << 30), prefill_chunk=0)
    assert runner.calls[0] == (60, 60) and [j.cached_tokens for j in jobs] == [0, 0]


@pytest.mark.parametrize("how", ["cancelled", "failed"])
def test_a_follower_whose_leader_is_gone_completes_on_its_own(how):
    """The leader's prefill spans several steps (64-token pieces); it is cancelled (or its forward
    fails) before it reaches the shared part's end: the follower is admitted as it is, prefills its
    whole prompt and answers as alone."""
    cfg, model, prov = _model("tiny-k3.1-pro", True)
    prompts = _prompts(cfg, 90, (9, 6))
    runner = TinyRunner(model, prov, fail_at=2 if how == "failed" else None)
    cancel = 1 if how == "cancelled" else None
    lead, follower = _serve(runner, prompts, prefix=PrefixCache(1 << 30), prefill_chunk=64,
                            cancel_first_after=cancel)
    assert runner.calls[:2] == [(64,), (64,)]  # the follower waited while the leader went on
    assert lead.finish_reason == "cancelled" if how == "cancelled" else lead.done and not lead.tokens
    assert follower.cached_tokens == 0 and follower.finish_reason == "length"
    tokens, logits = _alone(model, prov, follower.ids, 64, True)
    assert follower.tokens == tokens and torch.equal(runner.first_logits(follower.ids), logits)


def test_common_prefix_and_a_lookup_that_only_looks():
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        n = int(torch.randint(0, 700, (1,), generator=gen))
        a = torch.randint(0, 4, (n,), generator=gen).tolist()
        b = a[: int(torch.randint(0, n + 1, (1,), generator=gen))] + torch.randint(0, 4, (40,), generator=gen).tolist()
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == common_prefix(b, a) == want
    cfg, model, prov = _model("tiny-k3", True)
    ids = random_ids(cfg, 30, 4).tolist()
    pc = PrefixCache(1 << 30)
    with torch.no_grad():
        run_sync(model.forward_steps(torch.tensor([ids[:20]]), cache := model.new_cache(1)), prov)
    pc.store(ids[:20], cache)
    assert pc.cached_length(ids) == 20 and pc.cached_length(ids, align=8) == 0 and pc.cached_length(ids[:21]) == 0
    assert (pc.stats.lookups, pc.stats.hits) == (0, 0)
    assert len(pc.lookup(ids).tokens) == 20 and (pc.stats.lookups, pc.stats.hits) == (1, 1)
