"""The host tier as the scheduler and the stager see it: one protocol, two implementations.

    MappedReads (runtime/mapped_reads.py)  expert files mapped in place, an LRU window of them:
                                           the store fits in RAM
    PoolReads   (runtime/pool_reads.py)    a pool of page-locked buffers filled by O_DIRECT reads
                                           under --host-mem: checkpoints bigger than RAM

Both hand out entries (`HostMapping`, `PoolEntry`) with `data` (uint8 bytes of one expert
file), `nbytes`, `registered` (page-locked: the copy is asynchronous), `live`, and
`last_copy`, which the copier sets to the event after the last H2D copy queued from it.
`open_host_reads` picks one (--host-tier, --host-mem, the memory available) and says which in
its `line`.
"""

from __future__ import annotations

from typing import Protocol

from streamrt.runtime.mapped_reads import MappedReads
from streamrt.runtime.pool_reads import PoolReads
from streamrt.store.host_tier import HostTier, available_memory, choose_host_tier
from streamrt.store.keys import ExpertKey


class HostReads(Protocol):
    kind: str  # "mapped" | "pool" (the stats' host_tier)
    line: str  # the start line saying which tier runs and how big it is
    capacity: int  # entries it holds at most
    reads_ahead: bool  # a layer's guesses start reading when the previous router spoke

    def __len__(self) -> int: ...
    def __contains__(self, key: ExpertKey) -> bool: ...

    def lookup(self, key: ExpertKey):
        """A routed reference: a ready entry (a host hit), else None."""

    def for_guess(self, key: ExpertKey):
        """The ready entry a staged copy is taken from, else None."""

    async def entry(self, key: ExpertKey):
        """A routed miss: its entry, live when this returns (copy from it before the next await)."""

    async def guess(self, key: ExpertKey, rank: int) -> bool:
        """A predicted expert brought in behind every routed miss; False when there is no room."""

    def cancel_guesses(self, keys) -> None:
        """Their router spoke: guess reads not started yet cost nothing."""

    def unprotect(self, layer: int | None = None) -> None:
        """`layer`'s router spoke (None: the step ended): its guesses may be evicted now."""

    async def end_step(self, guesses) -> None:
        """End of a step, given the tasks bringing in its guesses."""

    async def close(self) -> None:
        """Shutdown, after the step's tasks ended."""


def open_host_reads(rt, file_reader=None, *, mode: str | None = None, tier=HostTier,
                    register: bool = True) -> HostReads:
    """The host tier of runtime `rt` (its tree, options, device, loop, stats, tracer, retire queue,
    window and map workers). `mode` overrides --host-tier; `tier` and `register` make the mapped
    tier's window (the seed baseline passes its own)."""
    opts, fb = rt.options, rt.layout.file_bytes
    kind, budget, why = choose_host_tier(mode or opts.host_tier, rt.cfg.expert_files * fb, opts.host_mem,
                                         available_memory())
    if kind == "pool":
        return PoolReads(rt.tree, budget, why, options=opts, device=rt.device, loop=rt.loop, stats=rt.stats,
                         tracer=rt.tracer, keys=rt.every_key(), retire=rt.retire, file_reader=file_reader)
    window = tier(lambda key: rt.tree.expert_path(key.layer, key.expert), fb, rt.window, device=rt.device,
                  retire=rt.retire, stats=rt.stats, register=register)
    return MappedReads(rt.tree, window, why, options=opts, loop=rt.loop, tracer=rt.tracer, workers=rt.workers,
                       device=rt.device)
