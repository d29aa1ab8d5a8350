"""`PoolTier`: the host tier when the experts do not fit in RAM: a fixed pool of page-locked
buffers under `--host-mem`, holding expert bytes read from the drive.

    budget = --host-mem  ->  n = budget // file_bytes buffers, allocated once, never grown
    hit      a ready buffer holding the key: copied H2D from it (async DMA on CUDA)
    miss     take a buffer (a free one, else the policy's victim), read the file into it with
             O_DIRECT on the reader threads (`disk_reader.py`), then copy H2D from it
    guess    the same read, for a predicted expert of the next layer, at lower priority; it
             lands in a pool buffer (never a throwaway one), so a routed guess is a pool hit

A buffer is busy, so never a victim, while it is being read, while a task that needs it for
the current request waits on it (`pins`), and until the last H2D copy queued from it has
executed (`last_copy`, a copy-stream event, queried only when the buffer is considered). A
key is handed out (`lookup`, `__contains__`) only once its read completed: an entry being read
is in `reading`, visible to nobody but the waiters of its read.

Victims come from `FrequencyMRU` (policies.py): fewest references first, newest first among
equals, which keeps a stable resident subset under the layer-ordered cyclic scan where LRU
would hit 0 %.

Thread model: every method runs on the scheduler's thread; the reader threads only write the
bytes of a buffer they were handed, and the scheduler calls `complete` / `fail` on its own
thread when the read ends.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from streamrt.output_paths import human_bytes
from streamrt.errors import StreamrtError
from streamrt.store.keys import ExpertKey
from streamrt.store.policies import FrequencyMRU

READING, READY, GONE = "reading", "ready", "gone"


class PoolEntry:
    """One buffer's current occupant. A new entry per fill: an evicted entry stays GONE."""

    __slots__ = ("key", "index", "data", "nbytes", "registered", "state", "pins", "last_copy", "guess", "job", "path",
                 "future")

    def __init__(self, key: ExpertKey, index: int, data: Tensor, registered: bool, path, guess: bool) -> None:
        self.key, self.index, self.data, self.registered, self.path = key, index, data, registered, path
        self.nbytes = data.numel()
        self.state = READING
        self.pins = 0  # tasks waiting on this read to copy from it
        self.last_copy = None  # copy-stream event after the last H2D copy queued from it (set by the copier)
        self.guess = guess  # read ahead on a prediction, not yet routed
        self.job = None  # the DiskReader job while queued / running
        self.future = None  # the scheduler's asyncio future of the read

    @property
    def live(self) -> bool:
        return self.state == READY


class PoolTier:
    def __init__(self, path_of: Callable[[ExpertKey], object], file_bytes: int, budget_bytes: int, *, device,
                 stats, policy=None) -> None:
        count = budget_bytes // file_bytes
        if count < 1:
            raise StreamrtError(f"--host-mem {budget_bytes} bytes holds no {file_bytes}-byte expert file")
        self.path_of, self.file_bytes, self.device, self.stats = path_of, file_bytes, device, stats
        self.capacity = count
        self.bytes_allocated = count * file_bytes  # <= budget_bytes, allocated once
        try:
            self.arena, self.registered = device.alloc_host_arena(self.bytes_allocated)
        except (OSError, RuntimeError) as e:  # ENOMEM from mmap, or the page-locking refused
            raise StreamrtError(f"--host-mem {budget_bytes} bytes: cannot allocate the {count} pool buffers "
                                f"({human_bytes(self.bytes_allocated)}): {getattr(e, 'strerror', None) or e}; "
                                f"lower --host-mem") from None
        self._views = [self.arena[i * file_bytes:(i + 1) * file_bytes] for i in range(count)]
        self._mem = memoryview(self.arena.numpy())  # what the reader threads write through
        self._free = list(range(count - 1, -1, -1))
        self._entries: dict[ExpertKey, PoolEntry] = {}
        self._by_index: list[PoolEntry | None] = [None] * count
        self.policy = policy if policy is not None else FrequencyMRU(reset_every=max(1 << 16, 64 * count))
        self._busy = _Busy(self)
        # guesses read ahead for a layer whose router has not spoken yet: not victims until it has
        # (else one guess evicts the previous one, read but not yet used); at most half the pool
        self._protected: dict[int, set[ExpertKey]] = {}

    # ---- what the scheduler asks ----------------------------------------------------------

    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if e.state == READY)

    def __contains__(self, key: ExpertKey) -> bool:
        e = self._entries.get(key)
        return e is not None and e.state == READY

    def lookup(self, key: ExpertKey) -> PoolEntry | None:
        """A reference: tells the policy; a ready entry is a pool hit (a read-ahead that paid, if
        it was a guess). None: not ready (absent, or still being read: see `reading`)."""
        self.policy.access(key)
        e = self._entries.get(key)
        if e is None or e.state != READY:
            return None
        self.stats.pool_hits += 1
        self.stats.host_hits += 1
        if e.guess:
            e.guess = False
            self.stats.readahead_used += 1
        return e

    def peek(self, key: ExpertKey) -> PoolEntry | None:
        """The ready entry of `key`, without counting a reference."""
        e = self._entries.get(key)
        return e if e is not None and e.state == READY else None

    def reading(self, key: ExpertKey) -> PoolEntry | None:
        e = self._entries.get(key)
        return e if e is not None and e.state == READING else None

    def memory_of(self, e: PoolEntry) -> memoryview:
        """The writable bytes of `e`'s buffer, for a reader thread."""
        return self._mem[e.index * self.file_bytes:(e.index + 1) * self.file_bytes]

    def take(self, key: ExpertKey, *, guess: bool = False) -> PoolEntry | None:
        """A buffer for `key`'s read: a free one, else the policy's victim among idle entries.
        None when every buffer is busy (the caller waits, or a guess gives up). The entry is
        READING until `complete` or `fail`."""
        assert key not in self._entries, f"{key} already has a buffer"
        if guess and 2 * (sum(len(v) for v in self._protected.values()) + 1) > self.capacity:
            return None
        if self._free:
            index = self._free.pop()
        else:
            victim = self.policy.victim(self._busy)
            if victim is None:
                return None
            old = self._entries.pop(victim)
            self.policy.remove(victim)
            old.state = GONE
            index = old.index
            self.stats.evictions += 1
        e = PoolEntry(key, index, self._views[index], self.registered, self.path_of(key), guess)
        self._entries[key] = e
        self._by_index[index] = e
        self.policy.insert(key)
        if guess:
            self._protected.setdefault(key.layer, set()).add(key)
            self.stats.readahead_reads += 1
        else:
            self.stats.pool_misses += 1
            self.stats.host_misses += 1
        return e

    def complete(self, e: PoolEntry, *, direct: bool, cached: int) -> None:
        """The read into `e` finished: its bytes may be handed out now."""
        e.state, e.job = READY, None
        disk = e.nbytes if direct else e.nbytes - cached
        self.stats.bytes_read += e.nbytes
        self.stats.bytes_from_disk += disk
        self.stats.bytes_from_page_cache += e.nbytes - disk

    def unprotect(self, layer: int | None = None) -> None:
        """`layer`'s router spoke (None: the step ended): its read-ahead entries are ordinary now."""
        if layer is None:
            self._protected.clear()
        else:
            self._protected.pop(layer, None)

    def fail(self, e: PoolEntry) -> None:
        """The read into `e` failed or was cancelled: the buffer is free again, the key absent."""
        self._protected.get(e.key.layer, set()).discard(e.key)
        if self._entries.get(e.key) is e:
            del self._entries[e.key]
            self.policy.remove(e.key)
        if self._by_index[e.index] is e:
            self._by_index[e.index] = None
            self._free.append(e.index)
        e.state, e.job = GONE, None

    def check(self) -> None:
        """Accounting invariants (tests): buffers are either free or held by exactly one entry."""
        held = [e.index for e in self._entries.values()]
        assert len(set(held)) == len(held) and not set(held) & set(self._free), "buffer held twice"
        assert len(held) + len(self._free) == self.capacity, "buffer lost"
        assert self.capacity * self.file_bytes == self.bytes_allocated
        assert all(k in self._entries for v in self._protected.values() for k in v), "protected key without a buffer"

    def close(self) -> None:
        """Shutdown, after every copy was waited for (the scheduler drains first)."""
        for e in self._entries.values():
            if e.last_copy is not None:
                e.last_copy.synchronize()
            e.state = GONE
        self._entries.clear()
        self.device.free_host_arena(self.arena, self.registered)


class _Busy:
    """The policy's `pinned` container: keys whose buffer must not be taken now."""

    __slots__ = ("pool",)

    def __init__(self, pool: PoolTier) -> None:
        self.pool = pool

    def __contains__(self, key) -> bool:
        e = self.pool._entries.get(key)
        if e is None:
            return False
        if e.state != READY or e.pins > 0 or key in self.pool._protected.get(key.layer, ()):
            return True
        return e.last_copy is not None and not e.last_copy.query()


def expected_disk_bytes_per_token(cfg, file_bytes: int, host_mem: int | None, gpu_experts: int = 0) -> int:
    """Bytes per decode token that come from the drive when --host-mem buffers (plus the device
    slots) hold a stable subset of the experts and routing is uniform: each routed expert is
    resident with probability held / expert files. Skewed routing reads less (the hot subset
    stays); this is the no-skew estimate `streamrt inspect` prints."""
    per_token = cfg.working_set_experts * file_bytes
    if host_mem is None:
        return 0
    held = min(cfg.expert_files, host_mem // file_bytes + gpu_experts)
    return int(per_token * (1.0 - held / cfg.expert_files))
