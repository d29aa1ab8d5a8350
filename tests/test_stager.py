"""The Stager on its own, through its seam (the runtime it is given): a fake runtime whose copy
events complete only when the test says so. At most --stage-depth staged copies in flight; the
rest issued one by one as copies complete; the unissued rest dropped when the router speaks;
cold guesses keep their place while they map; the counters and pins it leaves behind."""

import asyncio

from streamrt.runtime.options import DEFAULT_STAGE_DEPTH, RuntimeOptions
from streamrt.runtime.stager import Stager
from streamrt.runtime.stats import RuntimeStats
from streamrt.store.keys import ExpertKey


class Ev:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


class FakeGpu:
    """Slots that hold keys; each copy's ready event completes when the test sets it."""

    def __init__(self, slots):
        self.slots, self.pinned, self.pins = slots, 0, {}
        self.keys, self.ready = [], []

    def __contains__(self, key):
        return key in self.keys

    def slot_of(self, key):
        return self.keys.index(key)

    def pin(self, keys):
        for k in keys:
            self.pins[k] = self.pins.get(k, 0) + 1
        self.pinned = len(self.pins)

    def unpin(self, keys):
        for k in keys:
            self.pins[k] -= 1
            if not self.pins[k]:
                del self.pins[k]
        self.pinned = len(self.pins)


class Host(set):
    """The host-tier protocol (runtime/host_reads.py) over the mapped keys; a mapping is its key,
    and a cold one maps when the test resolves its future in `maps`."""

    reads_ahead = False

    def __init__(self, mapped, loop):
        super().__init__(mapped)
        self.loop, self.maps = loop, {}

    def lookup(self, key):
        return key if key in self else None

    for_guess = lookup

    async def guess(self, key, rank):
        await self.maps.setdefault(key, self.loop.create_future())
        self.add(key)
        return True

    def cancel_guesses(self, keys):
        pass

    async def end_step(self, guesses):
        if guesses:
            await asyncio.gather(*guesses, return_exceptions=True)


class FakeRuntime:
    """What the Stager uses of a StreamingRuntime: tiers, loop, options, stats, stage_depth, copy_in."""

    model = None

    def __init__(self, *, slots=16, mapped=(), **opts):
        self.options = RuntimeOptions(device="cpu", **opts)
        self.stats = RuntimeStats()
        self.gpu = FakeGpu(slots)
        self.loop = asyncio.new_event_loop()
        self.host = Host(mapped, self.loop)
        self.maps = self.host.maps  # key -> future the test resolves to finish its mapping
        self.copies = []  # keys in the order their copies were issued

    @property
    def stage_depth(self):
        return self.options.stage_depth or DEFAULT_STAGE_DEPTH

    def copy_in(self, key, src, *, required=True):
        assert src == key and not required
        if len(self.gpu.keys) >= self.gpu.slots:
            return False
        self.gpu.keys.append(key)
        self.gpu.ready.append(Ev())
        self.copies.append(key)
        return True


def keys(layer, ids):
    return [ExpertKey(layer, e) for e in ids]


def test_at_most_depth_copies_in_flight_then_one_per_completion():
    rt = FakeRuntime(mapped=keys(1, range(6)), stage_depth=2)
    st = Stager(rt)
    st.stage(1, [5, 4, 3, 2, 1, 0], budget=16)  # most confident first
    assert rt.copies == keys(1, [5, 4])  # the first --stage-depth issued at stage time
    assert st.queue[1] == keys(1, [3, 2, 1, 0]) and rt.stats.staged == 2
    assert st.pump() == 0  # nothing completed: the bound holds
    rt.gpu.ready[0].done = True
    assert st.pump() == 1 and rt.copies[-1] == ExpertKey(1, 3)  # one completed, one more issued
    assert rt.gpu.pins == {k: 1 for k in keys(1, [5, 4, 3])}  # staged keys stay pinned
    rt.loop.run_until_complete(st.settle())
    rt.loop.close()


def test_the_router_speaking_drops_unissued_guesses():
    rt = FakeRuntime(mapped=keys(1, range(6)), stage_depth=1)
    st = Stager(rt)
    st.stage(1, [0, 1, 2, 3], budget=16)
    st.routed(1, [0, 3, 9, 8])  # recall: 2 of 4 routed ids were predicted
    st.drop(1)
    assert rt.copies == keys(1, [0]) and 1 not in st.queue
    assert (rt.stats.staged, rt.stats.stage_dropped) == (1, 3)  # staged + dropped = queued
    assert (rt.stats.predicted, rt.stats.routed) == (2, 4)
    for ev in rt.gpu.ready:
        ev.done = True
    assert st.pump() == 0 and rt.copies == keys(1, [0])  # a dropped guess is never copied
    st.unpin(1)  # the layer was served
    assert rt.gpu.pinned == 0
    rt.loop.run_until_complete(st.settle())
    rt.loop.close()


def test_the_feeder_issues_while_the_host_waits():
    rt = FakeRuntime(mapped=keys(2, range(5)), stage_depth=1)
    st = Stager(rt)

    async def route_then_speak():
        st.stage(2, [0, 1, 2, 3, 4], budget=16)
        assert st.feeder is not None
        for _ in range(3):  # the copy stream executes three copies while the ids come back
            rt.gpu.ready[-1].done = True
            n = len(rt.copies)
            while len(rt.copies) == n:
                await asyncio.sleep(1e-4)
        st.drop(2)
        await st.settle()

    rt.loop.run_until_complete(asyncio.wait_for(route_then_speak(), 5))
    assert rt.copies == keys(2, [0, 1, 2, 3])  # in rank order, one per completion
    assert (rt.stats.staged, rt.stats.stage_dropped) == (4, 1)
    assert st.feeder is None and not st.queue and not st.staged and rt.gpu.pinned == 0
    rt.loop.close()


def test_budget_stage_max_and_residents():
    rt = FakeRuntime(mapped=keys(3, range(8)), stage_depth=8, stage_max=3)
    rt.gpu.keys.append(ExpertKey(3, 0))  # already resident: not queued, not counted
    rt.gpu.ready.append(Ev())
    st = Stager(rt)
    st.stage(3, [0, 1, 2, 3, 4], budget=16)
    assert rt.copies == keys(3, [1, 2])  # --stage-max 3 of the guesses, less the resident one
    st.stage(4, [0, 1], budget=0)  # no free slots to spend: nothing queued
    assert 4 not in st.queue and rt.stats.staged == 2 and rt.stats.stage_dropped == 0
    rt.loop.run_until_complete(st.settle())
    rt.loop.close()


def test_a_cold_guess_keeps_its_place_while_it_maps():
    rt = FakeRuntime(mapped=keys(1, [1]), stage_depth=4)
    st = Stager(rt)

    async def scenario():
        st.stage(1, [0, 1], budget=16)  # 0 is cold: its mapping starts, 1 is copied now
        assert rt.copies == keys(1, [1]) and st.queue[1] == keys(1, [0])
        await asyncio.sleep(0)
        rt.maps[ExpertKey(1, 0)].set_result(None)  # the mapping arrives: copied at once
        await st.guess_maps[ExpertKey(1, 0)]
        assert rt.copies == keys(1, [1, 0]) and 1 not in st.queue
        await st.settle()

    rt.loop.run_until_complete(asyncio.wait_for(scenario(), 5))
    assert (rt.stats.staged, rt.stats.stage_dropped) == (2, 0)
    rt.loop.close()


def test_no_predictor_without_a_model():
    rt = FakeRuntime()
    st = Stager(rt)
    assert st.predictor is None and not st.hints_first and st.guess(None) is None
    rt.loop.close()
