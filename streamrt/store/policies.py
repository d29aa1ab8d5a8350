"""Replacement policies for the device tier, and Belady's offline MIN for comparison.

The access pattern the device tier sees is a cyclic scan: every decoded token visits the
MoE layers in order and each layer touches its top-k experts. Plain LRU with fewer slots than
one token's working set evicts every expert just before its next use, so it hits 0 % by
construction. The default policy, `lfu`, is frequency-aware with exponential aging: each
reference adds an increment that grows by 2**(1/halflife) per reference, so a reference
`halflife` references ago weighs half as much as one now. The victim is the resident key with
the lowest score; history is kept for non-resident keys too, so a popular expert that was
evicted comes back with its score. Under skewed router popularity this converges on a stable
resident subset of the hottest experts, and hits grow with the slot count.

A policy tracks the resident set only; slots are the device tier's business:

    policy.access(key)            every reference, hit or miss, before any insert
    policy.insert(key)            key became resident
    policy.remove(key)            key left
    policy.victim(pinned) -> key  the resident key to evict, never one in `pinned`; None if all are

`belady_hit_rate(groups, capacity)` replays a trace with MIN (evict the resident key whose next
use is farthest in the future), the optimum for any online policy on that trace.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Container, Hashable, Iterable, Protocol, Sequence

from streamrt.errors import StreamrtError

Key = Hashable


class LazyHeap:
    """A min-heap of entries `(..., key)` with lazy deletion: an entry goes stale when its key's
    rank changes or the key leaves, and is dropped when it surfaces (`live` says which).

    The entries of pinned keys met on the way to a victim are set aside, not pushed back: the
    keys just staged for the next layers are pinned and, new, rank lowest, so every eviction of
    a step would pop and push them again. They rejoin the heap once their key is unpinned."""

    def __init__(self) -> None:
        self._heap: list[tuple] = []
        self._aside: list[tuple] = []

    def __len__(self) -> int:
        return len(self._heap) + len(self._aside)

    def push(self, entry: tuple) -> None:
        heapq.heappush(self._heap, entry)

    def reset(self, entries: Iterable[tuple]) -> None:
        self._heap, self._aside = list(entries), []
        heapq.heapify(self._heap)

    def smallest(self, live, pinned: Container) -> object | None:
        """The key of the smallest live entry whose key is not in `pinned`; None if none."""
        heap, aside = self._heap, self._aside
        if aside:
            self._aside = []
            for entry in aside:  # the entries of keys unpinned since rejoin the heap
                if entry[-1] in pinned:
                    self._aside.append(entry)
                else:
                    heapq.heappush(heap, entry)
        while heap:
            entry = heap[0]
            if not live(entry):
                heapq.heappop(heap)
            elif entry[-1] in pinned:
                self._aside.append(heapq.heappop(heap))
            else:
                return entry[-1]
        return None


class Policy(Protocol):
    name: str

    def access(self, key: Key) -> None: ...

    def insert(self, key: Key) -> None: ...

    def remove(self, key: Key) -> None: ...

    def victim(self, pinned: Container[Key] = ()) -> Key | None: ...


class LRU:
    """Least recently used. Hits 0 % on a cyclic scan longer than the cache."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, pinned: Container[Key] = ()) -> Key | None:
        for key in self._order:
            if key not in pinned:
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


class LFUDecay:
    """Frequency with exponential aging (scan-resistant; the default).

    score[key] = sum over its references r of 2**(r / halflife), r counting all references;
    the victim is the resident key of lowest score (ties: least recently referenced). The
    increment grows instead of the scores decaying, so a reference costs O(log n); scores are
    rescaled when the increment gets large.
    """

    name = "lfu"

    def __init__(self, halflife: int = 4096) -> None:
        if halflife < 1:
            raise StreamrtError(f"lfu halflife must be >= 1, got {halflife}")
        self.halflife = halflife
        self._growth = 2.0 ** (1.0 / halflife)
        self._inc = 1.0
        self._tick = 0
        self._score: dict[Key, float] = {}
        self._last: dict[Key, int] = {}
        self._resident: set[Key] = set()
        self._heap = LazyHeap()  # (score, last tick, key)

    def access(self, key: Key) -> None:
        self._tick += 1
        self._inc *= self._growth
        if self._inc > 1e200:
            self._rescale()
        self._score[key] = self._score.get(key, 0.0) + self._inc
        self._last[key] = self._tick
        if key in self._resident:
            self._push(key)

    def insert(self, key: Key) -> None:
        self._resident.add(key)
        self._push(key)

    def remove(self, key: Key) -> None:
        self._resident.discard(key)

    def victim(self, pinned: Container[Key] = ()) -> Key | None:
        def live(entry) -> bool:
            score, last, key = entry
            return key in self._resident and score == self._score.get(key, 0.0) and last == self._last.get(key, 0)

        return self._heap.smallest(live, pinned)

    def __len__(self) -> int:
        return len(self._resident)

    def _push(self, key: Key) -> None:
        self._heap.push((self._score.get(key, 0.0), self._last.get(key, 0), key))
        if len(self._heap) > 4 * len(self._resident) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap.reset((self._score.get(k, 0.0), self._last.get(k, 0), k) for k in self._resident)

    def _rescale(self) -> None:
        s = self._inc
        self._inc = 1.0
        self._score = {k: v / s for k, v in self._score.items() if v / s > 1e-300}
        self._rebuild()


class FrequencyMRU:
    """Frequency first, newest-inserted on ties: the host pool's policy (`store/pool.py`).

    The victim is the resident key with the fewest references (counts halve every
    `reset_every` references, TinyLFU's aging, so popularity can drift); among equals, the one
    inserted last. Under a cyclic scan with no skew every key has the same count, so the
    newest arrival leaves first and the rest of the resident set stays: hits are
    (capacity - 1) / working set, growing with the capacity, where LRU hits 0 %. Under skew
    the hottest keys have the highest counts and stay. LFUDecay is no help there: its aging
    makes the most recent reference weigh most, which on an unskewed scan is LRU again.
    """

    name = "lfu-mru"

    def __init__(self, reset_every: int = 1 << 20) -> None:
        if reset_every < 1:
            raise StreamrtError(f"lfu-mru reset_every must be >= 1, got {reset_every}")
        self.reset_every = reset_every
        self._refs = 0
        self._seq = 0
        self._count: dict[Key, int] = {}
        self._resident: dict[Key, int] = {}  # key -> insertion sequence number
        self._heap = LazyHeap()  # (count, -seq, key)

    def access(self, key: Key) -> None:
        self._count[key] = self._count.get(key, 0) + 1
        self._refs += 1
        if key in self._resident:
            self._push(key)
        if self._refs >= self.reset_every:
            self._age()

    def insert(self, key: Key) -> None:
        self._seq += 1
        self._resident[key] = self._seq
        self._push(key)

    def remove(self, key: Key) -> None:
        self._resident.pop(key, None)

    def count(self, key: Key) -> int:
        return self._count.get(key, 0)

    def victim(self, pinned: Container[Key] = ()) -> Key | None:
        def live(entry) -> bool:
            count, negseq, key = entry
            return self._resident.get(key) == -negseq and count == self._count.get(key, 0)

        return self._heap.smallest(live, pinned)

    def __len__(self) -> int:
        return len(self._resident)

    def _push(self, key: Key) -> None:
        self._heap.push((self._count.get(key, 0), -self._resident[key], key))
        if len(self._heap) > 4 * len(self._resident) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap.reset((self._count.get(k, 0), -s, k) for k, s in self._resident.items())

    def _age(self) -> None:
        self._refs = 0
        self._count = {k: c // 2 for k, c in self._count.items() if c // 2 or k in self._resident}
        self._rebuild()


POLICIES = {"lru": LRU, "lfu": LFUDecay}
DEFAULT_POLICY = "lfu"


def make_policy(name: str, *, capacity: int | None = None) -> Policy:
    """A policy by its `--gpu-policy` name. The lfu half-life scales with the cache: 256 x capacity
    references (at least 65536): long enough to learn a skewed popularity (shorter half-lives lose
    5-10 % of the hits on stationary traces, profiling/cache_sim.py), short enough to follow drift
    over a long generation."""
    if name not in POLICIES:
        raise StreamrtError(f"--gpu-policy: unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    if name == "lfu":
        return LFUDecay(halflife=max(65536, 256 * (capacity or 0)))
    return POLICIES[name]()


# ---- offline simulation -------------------------------------------------------------


def replay(policy: Policy, groups: Iterable[Sequence[Key]], capacity: int) -> tuple[int, int]:
    """Replay a trace of reference groups (one group = the unique experts one layer request
    needs; they are pinned together, as in the device tier). Returns (hits, references)."""
    if capacity < 1:
        raise StreamrtError(f"cache capacity must be >= 1, got {capacity}")
    resident: set[Key] = set()
    hits = refs = 0
    for group in groups:
        pinned = set(group)
        if len(pinned) > capacity:
            raise StreamrtError(f"a request needs {len(pinned)} experts but the cache holds {capacity}")
        for key in group:
            refs += 1
            policy.access(key)
            if key in resident:
                hits += 1
                continue
            if len(resident) >= capacity:
                v = policy.victim(pinned)
                assert v is not None
                policy.remove(v)
                resident.discard(v)
            policy.insert(key)
            resident.add(key)
    return hits, refs


def belady_hits(groups: Sequence[Sequence[Key]], capacity: int) -> tuple[int, int]:
    """Belady's MIN on the same trace and pinning rule: evict the unpinned resident key whose next
    reference is farthest away (never referenced again = infinitely far). Returns (hits, refs)."""
    if capacity < 1:
        raise StreamrtError(f"cache capacity must be >= 1, got {capacity}")
    flat = [k for g in groups for k in g]
    nxt = [math.inf] * len(flat)
    last_seen: dict[Key, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        nxt[i] = last_seen.get(flat[i], math.inf)
        last_seen[flat[i]] = i
    resident: dict[Key, float] = {}  # key -> position of its next reference
    heap: list[tuple[float, int, Key]] = []  # (-next, tiebreak, key), lazy
    hits = 0
    i = 0
    for group in groups:
        pinned = set(group)
        for key in group:
            if key in resident:
                hits += 1
            elif len(resident) >= capacity:
                held = []
                while True:
                    negn, tb, k = heapq.heappop(heap)
                    if resident.get(k) != -negn:
                        continue
                    if k in pinned:
                        held.append((negn, tb, k))
                        continue
                    del resident[k]
                    break
                for e in held:
                    heapq.heappush(heap, e)
            resident[key] = nxt[i]
            heapq.heappush(heap, (-nxt[i], i, key))
            i += 1
    return hits, len(flat)
