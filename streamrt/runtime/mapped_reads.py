"""The mapped host tier's reads: expert files mapped in place (on CUDA page-locked), at most
`window` open (`store/host_tier.HostTier`), cold ones mapped on a bounded thread pool.

    reads = MappedReads(tree, tier, why, options=opts, loop=loop, tracer=tr, workers=n, device=dev)
    m = await reads.entry(key)         # a routed miss: its mapping, live, checked
    ok = await reads.guess(key, rank)  # a guess: mapped like a miss (a mapping is cheap to drop)

One side of the host-tier protocol (runtime/host_reads.py); `PoolReads` is the other. A file
is checked on the thread that maps it (header against the key; the checksum the first time
with --verify-experts first) and inserted into the window on the scheduler's thread.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from streamrt.checkpoint.expert_file import parse_expert
from streamrt.store.host_tier import HostMapping, HostTier
from streamrt.store.keys import ExpertKey


class MappedReads:
    kind = "mapped"
    reads_ahead = False  # a guess is mapped when it is queued for staging, not before

    def __init__(self, tree, tier: HostTier, why: str, *, options, loop, tracer, workers: int, device) -> None:
        self.tree, self.layout, self.options = tree, tree.layout, options
        self.loop, self.tracer = loop, tracer
        self.tier = tier
        self.capacity = tier.window
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="streamrt-map",
                                           initializer=device.thread_init)
        self.line = f"host tier mapped ({why}): up to {tier.window} page-locked file mappings"
        self._inflight: dict[ExpertKey, asyncio.Future] = {}  # cold mappings being opened
        self._verified: set[ExpertKey] = set()  # checksummed once in this process (--verify-experts)

    def __len__(self) -> int:
        return len(self.tier)

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self.tier

    def lookup(self, key: ExpertKey) -> HostMapping | None:
        """A routed reference: the open mapping (a host hit), or None (cold)."""
        return self.tier.lookup(key)

    def for_guess(self, key: ExpertKey) -> HostMapping | None:
        """The mapping a staged copy is taken from (a reference, as a routed one)."""
        return self.tier.lookup(key)

    async def entry(self, key: ExpertKey) -> HostMapping:
        """The open mapping of `key`, live when this returns (the caller copies from it before
        its next await). A fill shared with another task may have been evicted again by the
        time this task resumes (a window smaller than the request): then map it once more."""
        while True:
            m = await self._map_once(key)
            if m.live:
                return m

    async def guess(self, key: ExpertKey, rank: int) -> bool:
        """A predicted expert mapped ahead of its turn to be staged."""
        await self._map_once(key)
        return True

    def cancel_guesses(self, keys) -> None:
        """The router spoke: a mapping in flight finishes (it costs no link time)."""

    def unprotect(self, layer: int | None = None) -> None:
        """Nothing is held back from eviction for a layer's guesses here."""

    async def end_step(self, guesses) -> None:
        """End of a step: the guesses still mapping finish (they only map)."""
        if guesses:
            await asyncio.gather(*guesses, return_exceptions=True)

    async def _map_once(self, key: ExpertKey) -> HostMapping:
        """A host hit, a fill already in flight, or a new one mapped (and page-locked) on the
        thread pool, inserted into the window on this thread."""
        m = self.tier.lookup(key)
        if m is not None:
            return m
        fut = self._inflight.get(key)
        if fut is not None:
            return await fut
        fut = self._inflight[key] = self.loop.create_future()
        try:
            with self.tracer.span("host-io", "map", layer=key.layer, expert=key.expert, bytes=self.layout.file_bytes):
                m = await self.loop.run_in_executor(self.executor, self.open, key)
            m = self.tier.insert(m)
            fut.set_result(m)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiters re-raise it
            raise
        finally:
            del self._inflight[key]
        return m

    def open(self, key: ExpertKey) -> HostMapping:
        """Map (+ register) and validate the header against the key; any thread."""
        m = self.tier.open_mapping(key)
        try:
            parse_expert(m.data, self.layout, name=str(m.path), expect=(key.layer, key.expert))
            if self.options.verify_experts == "first" and key not in self._verified:
                # hash the mapped bytes (no second read) under the manifest's rule
                self.tree.check_expert(key.layer, key.expert, data=m.data)
                self._verified.add(key)
        except BaseException:
            m.release()
            raise
        return m

    async def close(self) -> None:
        """Shutdown: every mapping retired and released, the thread pool joined."""
        self.tier.close()
        self.executor.shutdown(wait=True)
