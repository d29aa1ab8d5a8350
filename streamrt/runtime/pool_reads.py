"""The pool tier's reads: expert files read from the drive into page-locked pool
buffers by reader threads, routed misses first, guesses behind them by confidence.

    reads = PoolReads(tree, budget, why, options=opts, device=dev, loop=loop, stats=st, tracer=tr)
    e = await reads.entry(key)        # a routed miss: its buffer, read and checked
    ok = await reads.guess(key, rank)  # a guess: read behind every miss; False when no buffer is idle
    reads.cancel_guesses(keys)        # their router spoke first: a read not started costs nothing

A read is checked on its reader thread (header against the key; the checksum the first time
with --verify-experts first) and handed out only once complete. `reads.line` is the start
line saying which read path runs. One side of the host-tier protocol (runtime/host_reads.py);
`MappedReads` is the other.
"""

from __future__ import annotations

import asyncio
import time

from streamrt.checkpoint.expert_file import parse_expert
from streamrt.errors import StreamrtError
from streamrt.runtime.aio import settled
from streamrt.store.disk_reader import DEFAULT_READ_THREADS, DiskReader, FileReader, ReadCancelled, tune_threads
from streamrt.store.gds import choose_gds
from streamrt.store.keys import ExpertKey
from streamrt.store.pool import PoolEntry, PoolTier

POOL_WAIT_S = 30.0  # a routed miss waiting this long for a pool buffer, nothing being read: a bug, said in a line


class PoolReads:
    kind = "pool"
    reads_ahead = True  # guesses start reading as soon as the previous router spoke, behind its misses

    def __init__(self, tree, budget: int, why: str, *, options, device, loop, stats, tracer, keys, retire,
                 file_reader: FileReader | None = None) -> None:
        """The host tier as a buffer pool under `budget` bytes, its reader threads and the start
        line. `keys`: every expert, in path order (--read-threads auto measures over the first)."""
        fb = tree.layout.file_bytes
        self.tree, self.layout, self.options = tree, tree.layout, options
        self.loop, self.stats, self.tracer, self.retire = loop, stats, tracer, retire
        self.pool = PoolTier(lambda key: tree.expert_path(key.layer, key.expert), fb, budget,
                             device=device, stats=stats)
        self.file_reader = file_reader or FileReader()
        threads, tuned = options.read_threads or DEFAULT_READ_THREADS, ""
        if options.read_threads == -1:  # --read-threads auto: a short measurement over expert files
            paths = [tree.expert_path(k.layer, k.expert) for k in keys[:96]]
            threads, rates = tune_threads(paths, fb, reader=self.file_reader)
            tuned = " (auto: " + ", ".join(f"{n}: {r / 1e9:.2f} GB/s" for n, r in rates.items()) + ")"
        self.reader = DiskReader(threads, thread_init=device.thread_init)
        self.gds = choose_gds(options.gds, device)
        gds = self.gds.why + ("; misses still read through the pool" if self.gds.active else "")
        pool = self.pool
        self.line = (
            f"host tier pool ({why}): {pool.capacity} {'page-locked ' if pool.registered else ''}buffers "
            f"x {fb / 2**20:.1f} MiB = {pool.bytes_allocated / 2**30:.2f} GiB, {threads} reader threads{tuned}, "
            f"{self.file_reader.mode}, {gds}"
        )
        self._seq = iter(range(1 << 62))  # FIFO order among reads of one priority class
        self._verified: set[ExpertKey] = set()  # checksummed once in this process (--verify-experts)
        self.capacity = pool.capacity
        self.background: set[asyncio.Task] = set()  # guess reads outliving their step

    def __len__(self) -> int:
        return len(self.pool)

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self.pool

    def lookup(self, key: ExpertKey) -> PoolEntry | None:
        """A routed reference: a ready buffer (a pool hit), or None (absent or being read)."""
        return self.pool.lookup(key)

    def for_guess(self, key: ExpertKey) -> PoolEntry | None:
        """The ready buffer a staged copy is taken from, without counting a reference."""
        return self.pool.peek(key)

    def unprotect(self, layer: int | None = None) -> None:
        """`layer`'s router spoke (None: the step ended): its read-ahead may be evicted now."""
        self.pool.unprotect(layer)

    async def end_step(self, guesses) -> None:
        """End of a step: guess reads already started finish into the pool while the next step
        runs (`close` waits for them)."""
        self.pool.unprotect()
        self.background.update(t for t in guesses if not t.done())
        self.background = {t for t in self.background if not t.done()}

    async def entry(self, key: ExpertKey) -> PoolEntry:
        """A routed miss: its buffer, read completely, when this returns (the caller copies from
        it before its next await). A read already queued as a guess is raised to miss priority;
        with every buffer busy, wait for one (a read ends, a copy executes)."""
        pool, delay, since = self.pool, 0.0, None
        while True:
            e = pool.peek(key)
            if e is not None:
                return e
            e = pool.reading(key)
            if e is None:
                e = pool.take(key)
                if e is None:
                    since = since or time.perf_counter()
                    if time.perf_counter() - since > POOL_WAIT_S and not self.reader.in_flight:
                        raise StreamrtError(f"--host-mem: no pool buffer came free for {POOL_WAIT_S:.0f} s with no "
                                            f"read in flight ({pool.capacity} buffers); raise --host-mem")
                    await asyncio.sleep(delay)
                    delay = min(1e-4, delay * 2 or 5e-6)
                    continue
                self._submit(e, (0, next(self._seq)))
            elif e.job is not None and e.job.state == "queued":
                e.guess = False  # the read-ahead did not get there first
                e.job.raise_priority((0, next(self._seq)))
            e.pins += 1
            try:
                await e.future
            except ReadCancelled:
                continue
            finally:
                e.pins -= 1
            if e.live:
                return e

    async def guess(self, key: ExpertKey, rank: int) -> bool:
        """Read a predicted expert into the pool behind every routed miss (priority by rank).
        False when no buffer is idle: a guess never waits for one."""
        pool = self.pool
        if key in pool:
            return True
        e = pool.reading(key)
        if e is None:
            e = pool.take(key, guess=True)
            if e is None:
                return False
            self._submit(e, (1, rank, next(self._seq)))
        await e.future
        return e.live

    def cancel_guesses(self, keys) -> None:
        """Their router spoke and their guess reads have not started: they cost no disk time (a
        routed one is read again at miss priority by the fetch)."""
        for key in keys:
            e = self.pool.reading(key)
            if e is not None and e.guess and e.pins == 0 and e.job is not None and e.job.cancel():
                self.pool.fail(e)
                self.stats.readahead_reads -= 1
                e.future.set_exception(ReadCancelled(str(key)))
                e.future.exception()

    def _submit(self, e: PoolEntry, priority: tuple) -> None:
        loop = self.loop
        e.future = loop.create_future()

        def done(result, exc) -> None:  # reader thread
            loop.call_soon_threadsafe(self._done, e, result, exc)

        e.job = self.reader.submit(priority, lambda: self._job(e), done)

    def _job(self, e: PoolEntry):
        """Reader thread: the file into `e`'s buffer, then the header (and the checksum, the
        first time) checked against the key."""
        key = e.key
        r = self.file_reader.read_into(e.path, self.pool.memory_of(e), e.nbytes)
        parse_expert(e.data, self.layout, name=str(e.path), expect=(key.layer, key.expert))
        if self.options.verify_experts == "first" and key not in self._verified:
            self.tree.check_expert(key.layer, key.expert, data=e.data)
            self._verified.add(key)
        return r

    def _done(self, e: PoolEntry, r, exc) -> None:
        """Scheduler thread: the read of `e` ended; its waiters may take it (or its error)."""
        if e.future.done():  # cancelled meanwhile (its future already answered)
            return
        if exc is None:
            self.pool.complete(e, direct=r.direct, cached=r.cached)
            if self.tracer.enabled:
                self.tracer.record("disk", "read", r.start_s, r.end_s, layer=e.key.layer, expert=e.key.expert,
                                   bytes=r.nbytes, direct=r.direct, guess=e.guess)
            e.future.set_result(e)
        else:
            self.pool.fail(e)
            e.future.set_exception(exc)
            e.future.exception()  # retrieved: waiters re-raise it

    async def close(self) -> None:
        """Shutdown: queued reads cancelled, running ones finished, the guess reads still
        running ended, every copy waited for, the buffers freed."""
        self.reader.close()
        await settled(self.background)
        self.retire.drain()
        self.pool.close()
