"""The seed's engine and its failure modes, kept so that `streamrt sweep` and the benchmarks can
reproduce its figures beside the production runtime's. Off by default; any of these flags makes
`StreamingRuntime(...)` construct `SeedBaseline`, so the production scheduler never tests them:

    --copies sync       pageable expert mappings, synchronous copies one miss at a time, the
                        routed ids brought to the host by a blocking transfer, nothing staged
                        (the seed's first engine: the baseline)
    --preparse          map and parse up to `window` experts at load, in path order
    --prefetch discard  read each routed file into a throwaway buffer before its fetch
    --evict sync        synchronize the device at every host-tier eviction

The rest is the production runtime's: same fetch results, same logits (the sweep checks the
hash at every point).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from streamrt.checkpoint.expert_file import parse_expert
from streamrt.runtime.aio import gather_all
from streamrt.runtime.host_reads import HostReads, open_host_reads
from streamrt.runtime.scheduler import StreamingRuntime
from streamrt.runtime.stager import Stager
from streamrt.store.host_tier import HostMapping, HostTier
from streamrt.store.keys import ExpertKey


class SyncEvictTier(HostTier):
    """`--evict sync`: every eviction waits for every queued copy (and all unrelated work)."""

    def _evict(self, mapping: HostMapping) -> None:
        self.stats.evictions += 1
        mapping.retired = True
        self.device.synchronize()
        mapping.release()
        self.stats.released_sync += 1


class Unstaged(Stager):
    """`--copies sync`: no predictor, so nothing is guessed or staged."""

    def __init__(self, rt, predictor=None) -> None:
        super().__init__(rt, None)
        self.predictor = None


class SeedBaseline(StreamingRuntime):
    def __init__(self, tree, model=None, options=None, *, stager=Stager, **kw) -> None:
        super().__init__(tree, model, options, stager=stager if options.copies == "async" else Unstaged, **kw)
        self._discard_pool: ThreadPoolExecutor | None = None
        if self.options.prefetch == "discard":
            self._discard_pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="streamrt-discard",
                                                    initializer=self.device.thread_init)
        if self.options.preparse and self.host.kind == "mapped":
            self._preparse()

    def _open_host(self, file_reader) -> HostReads:
        """`--copies sync` maps (pageable) whatever --host-tier says; `--evict sync` its window."""
        sync = self.options.copies == "sync"
        return open_host_reads(self, file_reader, mode="mapped" if sync else None, register=not sync,
                               tier=SyncEvictTier if self.options.evict == "sync" else HostTier)

    def _preparse(self) -> int:
        """`--preparse`: eagerly map and parse up to `window` experts at load, in path order
        rather than decode order. Returns how many."""
        n = 0
        for key in self.every_key():
            if n >= self.host.capacity:
                break
            m = self.host.tier.get(key)  # mapped as the seed did: no header or checksum check
            parse_expert(m.data, self.layout)
            n += 1
        return n

    def _map_now(self, key: ExpertKey) -> HostMapping:
        """Lookup-or-map (checked) on this thread (the mapped tier)."""
        return self.host.lookup(key) or self.host.tier.insert(self.host.open(key))

    async def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if self.options.copies == "sync":
            return t.cpu()  # the seed's blocking transfer
        return await super()._to_host(t)

    async def _fetch_misses(self, keys: list[ExpertKey], guess) -> None:
        if self.options.prefetch == "discard":
            await self._discard_reads(keys)  # traffic for nothing
        if self.options.copies == "async":
            return await super()._fetch_misses(keys, guess)
        for key in keys:  # synchronous map + pageable copy, one by one
            if self.gpu.lookup(key) is None:
                self.copy_in(key, self._map_now(key))

    async def _discard_reads(self, keys: list[ExpertKey]) -> None:
        """`--prefetch discard`: read each routed file into a throwaway buffer (aiofiles)."""
        import aiofiles

        async def read(key: ExpertKey) -> None:
            path = self.tree.expert_path(key.layer, key.expert)
            async with aiofiles.open(path, "rb", executor=self._discard_pool) as f:
                n = len(await f.read())  # read before the counter is: concurrent reads would lose counts
            self.stats.bytes_read += n

        await gather_all(read(k) for k in keys)

    def close(self) -> None:
        super().close()
        if self._discard_pool is not None:
            self._discard_pool.shutdown(wait=True)
