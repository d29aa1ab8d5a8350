"""RetireQueue: FIFO release behind copy-stream events, querying only the front."""

from streamrt.store.retire import RetireQueue


class FakeEvent:
    """An event that completes when the test says so and counts how often it is queried."""

    def __init__(self, name):
        self.name, self.done, self.queries, self.syncs = name, False, 0, 0

    def query(self):
        self.queries += 1
        return self.done

    def synchronize(self):
        self.syncs += 1
        self.done = True


class Item:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def release(self):
        self.log.append(self.name)


def make(n):
    log, q = [], RetireQueue()
    evs = [FakeEvent(i) for i in range(n)]
    for i, ev in enumerate(evs):
        q.retire(ev, Item(i, log))
    return q, evs, log


def test_releases_in_order_and_queries_only_the_front():
    q, evs, log = make(5)
    assert (q.retired, q.released, q.pending) == (5, 0, 5)
    assert q.release() == 0  # nothing complete: only the front was asked
    assert [e.queries for e in evs] == [1, 0, 0, 0, 0]

    evs[0].done = evs[1].done = True
    evs[3].done = True  # completes "out of order": must not be released past event 2
    assert q.release() == 2
    assert log == [0, 1]
    assert [e.queries for e in evs] == [2, 1, 1, 0, 0]  # 3 and 4 never queried
    assert (q.retired, q.released, q.pending) == (5, 2, 3)

    evs[2].done = True
    assert q.release() == 2  # 2, then 3 (already done), stops at 4
    assert log == [0, 1, 2, 3]
    assert evs[4].queries == 1
    assert (q.released, q.pending) == (4, 1)


def test_release_cost_is_independent_of_queue_length():
    q, evs, _ = make(1000)
    for _ in range(50):
        q.release()
    assert sum(e.queries for e in evs) == 50  # the seed's regression queried all 1000 each time


def test_drain_waits_each_event_in_order():
    q, evs, log = make(3)
    assert q.drain() == 3
    assert log == [0, 1, 2] and all(e.syncs == 1 for e in evs)
    assert (q.retired, q.released, q.pending) == (3, 3, 0)
