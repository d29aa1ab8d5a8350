"""Staging: the next layer's predicted experts copied to the device just in time.

While layer l computes, layer l+1's guesses (the predictor's, most confident first) wait in a
queue and are fed to the copy stream behind layer l's misses, at most `--stage-depth` staged
copies in flight at once; when layer l+1's router speaks, the guesses still queued are dropped
(a routed one is then fetched as an ordinary miss), so real misses queue behind at most that
many guesses and a guess never issued costs no link time. The first MoE layer of a decode step
is staged from the step's token embeddings (the runtime's `Forward.step_hint`), while the
dense layers compute. On the pool tier, guesses also start reading from disk as soon as the previous router
spoke (`read_ahead`), behind every routed miss.

    stager = Stager(rt)              # rt: the StreamingRuntime whose tiers it fills
    stager.guess(req)                # (next layer, predicted ids [T*k] on the device) or None
    stager.stage(layer, ids, budget=n)   # queue, issue the first --stage-depth, feed the rest
    stager.drop(layer)               # the router spoke: unissued guesses cost nothing
    stager.settle()                  # end of a step: nothing queued, nothing pinned

The counters it keeps (`RuntimeStats`): `staged` (issued copies), `stage_dropped` (queued,
never issued), `predicted` / `routed` (recall). `StreamingRuntime(..., stager=factory)` takes
another factory `rt -> Stager`: the tests observe staging through a subclass.

What it uses of the runtime: `gpu`, `host` (the host-tier protocol, runtime/host_reads.py),
`loop`, `options`, `stats`, `stage_depth` and `copy_in(key, entry, required=False)`.
"""

from __future__ import annotations

import asyncio

import torch

from streamrt.runtime.predictor import Predictor
from streamrt.store.keys import ExpertKey

MAPPING = object()  # `_issue`: the guess's mapping is still being opened; it keeps its place


class Stager:
    def __init__(self, rt, predictor: Predictor | None = None) -> None:
        self.rt = rt
        if predictor is None and rt.model is not None:
            predictor = Predictor.from_model(rt.model)
        self.predictor = predictor
        self.queue: dict[int, list[ExpertKey]] = {}  # layer -> guesses not yet issued, by rank
        self.outstanding: list = []  # ready events of issued staged copies, not seen complete
        self.feeder: asyncio.Task | None = None  # feeds the queue while guesses wait
        self.predicted: dict[int, set[int]] = {}  # layer -> ids predicted for it
        self.staged: dict[int, list[ExpertKey]] = {}  # layer -> keys pinned for it by staging
        self.guess_maps: dict[ExpertKey, asyncio.Task] = {}  # cold guess -> its mapping or read task (this step)

    # ---- the predictor's guesses -----------------------------------------------------------

    @property
    def hints_first(self) -> bool:
        """Whether a decode step's first MoE layer is staged from its token embeddings."""
        return self.rt.model is not None and self.predictor is not None and self.predictor.first_layer is not None

    def guess(self, req) -> tuple[int, torch.Tensor] | None:
        """(the next MoE layer, its predicted ids [T * k] on the compute device) from `req`'s FFN
        input, or None when there is nothing to stage."""
        target = self.predictor.target(req.layer) if self.predictor is not None else None
        if target is None:
            return None
        return target, self.predictor.predict(req.layer, req.hidden).reshape(-1)

    def routed(self, layer: int, ids: list[int]) -> None:
        """`layer`'s router chose `ids`: the predictor's recall is recorded."""
        if layer in self.predicted:
            hit = self.predicted.pop(layer)
            self.rt.stats.predicted += sum(1 for e in ids if e in hit)
            self.rt.stats.routed += len(ids)

    def stage_first(self, embeddings: torch.Tensor) -> None:
        """Decode-step start (`Forward.step_hint`): queue the first MoE layer's guess (the
        first --stage-depth issued now) while the dense layers compute, leaving slots for that
        layer's misses."""
        gpu = self.rt.gpu
        guess = self.predictor.predict_first(embeddings).reshape(-1).cpu()  # small; the GPU is idle here
        budget = gpu.slots - gpu.pinned - min(gpu.slots, guess.numel())
        self.stage(self.predictor.first_layer, list(dict.fromkeys(guess.tolist())), budget=budget)

    # ---- the queue fed to the copy stream ------------------------------------------------

    def stage(self, layer: int, ids: list[int], *, budget: int) -> None:
        """Queue up to `budget` of `layer`'s predicted experts for staging (most confident first,
        at most --stage-max, by default all of them) and issue the first
        --stage-depth now (the host may run Python for a while before it next awaits); the
        feeder issues the rest one by one as earlier staged copies complete, until `layer`'s
        router speaks and drops what is left. Cold guesses start mapping now and are copied when
        their turn comes. Issued keys are pinned until `layer` has been served."""
        rt = self.rt
        self.predicted[layer] = set(ids)  # recall is the predictor's, whatever gets staged
        self.staged.setdefault(layer, [])
        cap = rt.options.stage_max if rt.options.stage_max is not None else len(ids)
        queue = self.queue.setdefault(layer, [])
        for rank, e in enumerate(ids[: max(0, min(budget, cap))]):
            key = ExpertKey(layer, e)
            if key in rt.gpu or key in queue:
                continue
            queue.append(key)
            task = self.guess_maps.get(key)
            if key not in rt.host and (task is None or task.done()):
                self.guess_maps[key] = rt.loop.create_task(self.stage_cold(key, rank))
        self.pump()
        if self.queue and (self.feeder is None or self.feeder.done()):
            self.feeder = rt.loop.create_task(self.feed())

    def pump(self) -> int:
        """Issue queued guesses, most confident first, while fewer than --stage-depth staged
        copies are outstanding (issued, copy event not complete). A guess whose mapping is still
        being opened keeps its place without holding up the ones behind it; one already
        resident leaves the queue; one whose mapping was pushed out of the window again, or
        with no slot to take (every slot pinned), is dropped. Returns how many were issued."""
        out = self.outstanding = [ev for ev in self.outstanding if not ev.query()]
        depth, issued = self.rt.stage_depth, 0
        for layer in list(self.queue):
            queue, rest = self.queue[layer], []
            for i, key in enumerate(queue):
                if len(out) >= depth:
                    rest += queue[i:]
                    break
                state = self._issue(layer, key)
                if state is MAPPING:
                    rest.append(key)
                elif state is not None:
                    issued += 1
                    if not state.query():
                        out.append(state)
            if rest:
                self.queue[layer] = rest
            else:
                del self.queue[layer]
        return issued

    def _issue(self, layer: int, key: ExpertKey):
        """One queued guess: its copy's ready event once issued (pinned for `layer`), MAPPING
        while its mapping is being opened, None when it leaves the queue unissued (resident
        already, or dropped)."""
        rt = self.rt
        if key in rt.gpu:
            return None
        if key not in rt.host:
            task = self.guess_maps.get(key)
            if task is not None and not task.done():
                return MAPPING
            rt.stats.stage_dropped += 1
            return None
        if not rt.copy_in(key, rt.host.for_guess(key), required=False):
            rt.stats.stage_dropped += 1
            return None
        rt.gpu.pin((key,))
        self.staged[layer].append(key)
        rt.stats.staged += 1
        return rt.gpu.ready[rt.gpu.slot_of(key)]

    async def feed(self) -> None:
        """The staging feeder: while guesses are queued, poll the outstanding staged copies'
        events (query, yield, back off to 100 us, as `event_done`) and issue the next guess as
        one completes. It runs whenever the decode coroutine awaits: above all while the next
        router's ids come to the host."""
        delay = 0.0
        while self.queue:
            if self.pump():
                delay = 0.0
            await asyncio.sleep(delay)
            delay = min(1e-4, delay * 2 or 5e-6)

    async def stage_cold(self, key: ExpertKey, rank: int = 0) -> None:
        """A cold guess: mapped (mapped tier), or read from disk into a pool buffer behind every
        routed miss, most confident first (pool tier); if its turn has come, it is copied at once."""
        try:
            if not await self.rt.host.guess(key, rank):
                return
        except Exception:  # a guess is no error: if routed, its fetch maps it again and raises
            return
        if self.queue:
            self.pump()  # the mapping is live now

    def read_ahead(self, layer: int, ids: list[int]) -> None:
        """As soon as layer-1's router spoke, on a host tier that `reads_ahead` (the pool):
        `layer`'s predicted experts start reading (most confident first, behind every routed
        miss), so the drive never idles at the tail of a layer's misses. Staging copies them
        later (`stage`)."""
        rt = self.rt
        if not rt.host.reads_ahead:
            return
        cap = rt.options.stage_max if rt.options.stage_max is not None else len(ids)
        for rank, e in enumerate(ids[:cap]):
            key = ExpertKey(layer, e)
            if key in rt.gpu or key in rt.host or key in self.guess_maps:
                continue
            self.guess_maps[key] = rt.loop.create_task(self.stage_cold(key, rank))

    # ---- the router speaks, the layer ends, the step ends ----------------------------------

    def drop(self, layer: int) -> None:
        """`layer`'s router has spoken (or the step ended): its unissued guesses cost nothing;
        on the pool tier, its guess reads not started yet cost no disk time (routed ones are
        read again at miss priority by the fetch)."""
        rt = self.rt
        queue = self.queue.pop(layer, ())
        rt.stats.stage_dropped += sum(1 for key in queue if key not in rt.gpu)
        rt.host.cancel_guesses([k for k in self.guess_maps if k.layer == layer])

    def unpin(self, layer: int) -> None:
        """`layer` has been served and its compute queued: what staging pinned for it may go."""
        self.rt.gpu.unpin(self.staged.pop(layer, ()))

    async def settle(self) -> None:
        """End of a step: drop what is still queued, stop the feeder, let cold guesses still
        mapping finish (they only map), unpin what staging pinned."""
        rt = self.rt
        for layer in list(self.queue):
            self.drop(layer)
        if self.feeder is not None:
            self.feeder.cancel()
            await asyncio.gather(self.feeder, return_exceptions=True)
            self.feeder = None
        await rt.host.end_step(list(self.guess_maps.values()))
        self.guess_maps.clear()
        for layer in list(self.staged):
            rt.gpu.unpin(self.staged.pop(layer))
        self.predicted.clear()
