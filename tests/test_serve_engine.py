"""The continuous-batching engine against a scripted runner: who joins and leaves at which
step boundary, chunked prefills interleaved with decode steps, cancellation, failures."""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamrt.model import ModelCache
from streamrt.serve.engine import Engine, EngineError, Job, QueueFull

V = 8
STOP = 7


class ScriptedRunner:
    """Logits that pick token 1 (or STOP for prompts starting with STOP); logs every forward."""

    def __init__(self, fail_at: int | None = None):
        self.calls: list[tuple[str, int]] = []
        self.fail_at = fail_at

    def new_cache(self) -> ModelCache:
        return ModelCache([], [0])

    def _logits(self, tok: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(tok), V).float()

    async def step(self, last, cache, prefills):
        self.calls.append(("step", len(last), tuple(len(ids) for ids, _ in prefills)))
        if last:
            assert cache.batch == len(last)
        if self.fail_at is not None and len(self.calls) >= self.fail_at:
            self.fail_at = None
            raise RuntimeError("device fell over")
        await asyncio.sleep(0)
        decoded = torch.stack([self._logits(1) for _ in last]) if last else None
        return decoded, [self._logits(STOP if ids[0] == STOP else 1) for ids, _ in prefills]


def _job(n_prompt: int, max_tokens: int, first: int = 0) -> Job:
    return Job([first] * n_prompt, max_tokens, frozenset({STOP}))


async def _drain(job: Job) -> list[int]:
    return [t async for t in job.stream()]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_chunked_prefill_interleaves_with_running_decodes():
    async def go():
        runner = ScriptedRunner()
        engine = Engine(runner, max_batch=4, prefill_chunk=64)
        loop = asyncio.ensure_future(engine.run())
        a, b = _job(10, 8), _job(150, 3)
        engine.submit(a)
        first = asyncio.ensure_future(_drain(a))
        while engine.batch_size == 0:
            await asyncio.sleep(0)
        engine.submit(b)
        got = await asyncio.gather(first, _drain(b))
        engine.stop()
        await loop
        return runner.calls, got, (a.finish_reason, b.finish_reason)

    calls, (ta, tb), reasons = _run(go())
    assert ta == [1] * 8 and tb == [1] * 3 and reasons == ("length", "length")
    # a joins after its one prefill; b's 150 tokens go in as 64 + 64 + 22, each in one forward with a's
    # decode step; b's first token comes from its last piece, two decode steps with a give the rest
    assert calls[0] == ("step", 0, (10,))
    i = calls.index(("step", 1, (64,)))
    assert calls[i : i + 5] == [("step", 1, (64,)), ("step", 1, (64,)), ("step", 1, (22,)), ("step", 2, ()),
                                ("step", 2, ())]
    assert calls[-1] == ("step", 1, ())  # b left after 3 tokens, a went on alone


def test_waiting_prompts_prefill_together_within_the_token_budget():
    async def go():
        runner = ScriptedRunner()
        engine = Engine(runner, max_batch=3, prefill_tokens=100)
        jobs = [_job(n, 2) for n in (40, 50, 30, 20)]
        for job in jobs:
            engine.submit(job)
        loop = asyncio.ensure_future(engine.run())
        got = await asyncio.gather(*(_drain(j) for j in jobs))
        engine.stop()
        await loop
        return runner.calls, got

    calls, got = _run(go())
    assert got == [[1, 1]] * 4
    # three rows: 40 + 50 fit the 100-token budget, 30 waits a step (decoded with the two rows, which
    # then leave, two tokens each); the fourth waits for a free row
    assert calls == [("step", 0, (40, 50)), ("step", 2, (30,)), ("step", 1, (20,)), ("step", 1, ())]


def test_stop_token_at_prefill_never_joins_and_cancel_frees_the_row():
    async def go():
        runner = ScriptedRunner()
        engine = Engine(runner, max_batch=4)
        loop = asyncio.ensure_future(engine.run())
        stopper, long = _job(5, 10, first=STOP), _job(5, 10_000)
        engine.submit(stopper)
        engine.submit(long)
        assert await _drain(stopper) == [STOP]
        seen = []
        async for t in long.stream():
            seen.append(t)
            if len(seen) == 3:
                long.cancel()
        while engine.batch_size:
            await asyncio.sleep(0)
        engine.stop()
        await loop
        return stopper.finish_reason, long.finish_reason, len(long.tokens), engine.batch_size

    stop_reason, cut_reason, generated, rows = _run(go())
    assert stop_reason == "stop" and cut_reason == "cancelled" and rows == 0
    assert 3 <= generated <= 5  # the row left at the next step boundary


def test_a_failed_forward_fails_its_jobs_and_the_engine_goes_on():
    async def go():
        runner = ScriptedRunner(fail_at=3)
        engine = Engine(runner, max_batch=4)
        loop = asyncio.ensure_future(engine.run())
        doomed = _job(4, 50)
        engine.submit(doomed)
        with pytest.raises(EngineError, match="device fell over"):
            await _drain(doomed)
        after = _job(4, 2)
        engine.submit(after)
        tokens = await _drain(after)
        engine.stop()
        await loop
        return tokens

    assert _run(go()) == [1, 1]


def test_queue_bound():
    engine = Engine(ScriptedRunner(), max_batch=2, max_queue=1)
    for _ in range(3):  # two for the free rows, one waiting
        engine.submit(_job(1, 1))
    with pytest.raises(QueueFull):
        engine.submit(_job(1, 1))
    assert engine.queue_depth == 3
    with pytest.raises(QueueFull):  # no free row: max_queue 0 takes nothing
        Engine(ScriptedRunner(), max_batch=0, max_queue=0).submit(_job(1, 1))


def test_a_row_whose_sampling_fails_ends_alone(monkeypatch):
    import streamrt.serve.engine as engine_mod

    def picky(logits, temperature, top_p, generator, *filters):
        if temperature == 0.5:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return int(torch.argmax(logits))

    monkeypatch.setattr(engine_mod, "sample", picky)

    async def go():
        engine = Engine(ScriptedRunner(), max_batch=4)
        loop = asyncio.ensure_future(engine.run())
        doomed, fine = (Job([0] * 4, 5, frozenset({STOP}), temperature=t) for t in (0.5, 0.0))
        engine.submit(doomed)
        engine.submit(fine)
        with pytest.raises(EngineError, match="inf"):
            await _drain(doomed)
        got = await _drain(fine)
        engine.stop()
        await loop
        return got

    assert _run(go()) == [1] * 5


def test_a_temperature_that_overflows_the_scaling_samples_the_argmax():
    from streamrt.generate import sample

    logits = torch.tensor([0.5, 3.0, -1.0])
    assert sample(logits, 5e-324, 1.0, torch.Generator().manual_seed(0)) == 1


def test_penalties_as_openai_defines_them():
    """logit_j - frequency * count_j - presence * [count_j > 0] over the generated tokens,
    against the definition written out in numpy; both 0 leaves the logits untouched."""
    import numpy as np

    from streamrt.generate import apply_penalties

    g = torch.Generator().manual_seed(11)
    logits = torch.randn(50, generator=g)
    generated = torch.randint(0, 50, (40,), generator=g).tolist()
    pres, freq = float(torch.rand(1, generator=g)) * 2 - 1, float(torch.rand(1, generator=g)) * 2
    count = np.zeros(50)
    for t in generated:
        count[t] += 1
    want = logits.double().numpy() - freq * count - pres * (count > 0)
    got = apply_penalties(logits, generated, pres, freq)
    assert np.allclose(got.double().numpy(), want, rtol=0, atol=1e-6)
    assert apply_penalties(logits, generated, 0.0, 0.0) is logits
    assert apply_penalties(logits, [], pres, freq) is logits


def test_a_frequency_penalty_steers_a_greedy_row():
    """The scripted logits always favour token 1 by 1.0; a frequency penalty of 2 takes it below
    the others after one use, so greedy walks the rest in id order up to the stop token."""
    async def go():
        engine = Engine(ScriptedRunner(), max_batch=2)
        loop = asyncio.ensure_future(engine.run())
        plain = Job([0] * 3, 10, frozenset({STOP}))
        steered = Job([0] * 3, 10, frozenset({STOP}), frequency_penalty=2.0)
        engine.submit(plain)
        engine.submit(steered)
        out = await asyncio.gather(_drain(plain), _drain(steered))
        loop.cancel()
        return out

    plain, steered = _run(go())
    assert plain == [1] * 10
    assert steered == [1, 0, 2, 3, 4, 5, 6, STOP]
