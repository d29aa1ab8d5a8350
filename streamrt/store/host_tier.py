"""`HostTier`: expert files mapped into host memory, kept open in an LRU retention window.

A mapping is opened on first use (never eagerly at load), kept while it is among the `window`
most recently used, and on a CUDA device page-locked in place (`cudaHostRegister`, read-only)
so the GPU DMAs straight from the page cache. Mapping and registering an 18.6 MB expert costs
~1 ms, three times its 0.34 ms copy: retention (map and register once) is what makes the link
the bound. An evicted mapping is *retired*, not unmapped: one event on the copy stream marks
the copies queued from it, and the `RetireQueue` releases it once that event completed.

`window` must cover the per-token working set, or the layer-ordered access pattern is a cyclic
scan that LRU never hits (the seed's 512-vs-1472 bug); the default is max(2 x working set,
65536) capped by `--host-mem`.

Thread model: `open_mapping` (file open + mmap + register, the slow part) runs in a worker
thread; every other method runs on the scheduler's thread.
"""

from __future__ import annotations

import mmap
import os
import stat
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from streamrt.errors import CheckpointError, StreamrtError
from streamrt.store.disk_reader import not_regular_error, resident_bytes
from streamrt.store.keys import ExpertKey
from streamrt.store.retire import RetireQueue


class HostMapping:
    """One expert file mapped read-only; `data` is a zero-copy uint8 tensor over it."""

    __slots__ = ("key", "path", "nbytes", "_mm", "data", "registered", "retired", "_device", "cached", "last_copy")

    def __init__(self, key: ExpertKey, path: Path, nbytes: int, device, register: bool) -> None:
        self.key, self.path, self.nbytes, self._device = key, path, nbytes, device
        try:
            # O_NONBLOCK: a FIFO in the file's place would block open() forever; a regular file ignores it
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise not_regular_error(path)
                if st.st_size != nbytes:
                    raise CheckpointError(
                        f"expert file {path}: {st.st_size} bytes, expected {nbytes}; re-run 'streamrt convert'"
                    )
                self._mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
        except FileNotFoundError:
            raise CheckpointError(f"expert file {path}: missing; run 'streamrt verify'") from None
        except OSError as e:
            raise CheckpointError(f"expert file {path}: cannot map ({e.strerror or e})") from None
        with warnings.catch_warnings():  # the mapping is read-only on purpose; nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            self.data: Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        # in the page cache before anything touched it (registering faults the rest in from disk)
        self.cached = resident_bytes(self.data.data_ptr(), nbytes) or 0
        self.registered = register and device.host_register(self.data)
        self.retired = False  # evicted from the window: no new copies may be queued from it
        # the event after the last H2D copy queued from it (as a pool buffer's): the retire event
        # recorded at eviction follows it on the copy stream
        self.last_copy = None

    @property
    def live(self) -> bool:
        return not self.retired and self.data is not None

    def release(self) -> None:
        """Unregister and drop the mapping. Only after every copy queued from it has executed.
        The mmap is not closed explicitly: torch.frombuffer holds a reference to it but no
        buffer export, so close() would unmap under a CPU view still alive somewhere (a
        segfault). Dropping our references unmaps it when the last view goes."""
        if self.data is None:
            return
        if self.registered:
            self._device.host_unregister(self.data)
            self.registered = False
        self.data = None
        self._mm = None


class HostTier:
    def __init__(
        self,
        path_of: Callable[[ExpertKey], Path],
        file_bytes: int,
        window: int,
        *,
        device,
        retire: RetireQueue,
        stats,
        register: bool = True,
    ) -> None:
        # window >= 1: RuntimeOptions checked the flag it comes from
        self.path_of = path_of
        self.file_bytes = file_bytes
        self.window = window
        self.device = device
        self.retire = retire
        self.stats = stats
        self.register = register and device.kind == "cuda"
        self._open: OrderedDict[ExpertKey, HostMapping] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._open

    def lookup(self, key: ExpertKey) -> HostMapping | None:
        """A hit moves the mapping to the most-recent end. Counts host_hits; a None return is
        followed by `open_mapping` + `insert`, which count the miss."""
        m = self._open.get(key)
        if m is not None:
            self._open.move_to_end(key)
            self.stats.host_hits += 1
        return m

    def open_mapping(self, key: ExpertKey) -> HostMapping:
        """Map (and page-lock) one expert file. Thread-safe: touches no shared state."""
        return HostMapping(key, self.path_of(key), self.file_bytes, self.device, self.register)

    def insert(self, mapping: HostMapping) -> HostMapping:
        """Admit a fresh mapping (a miss), evicting the least recently used beyond `window`.
        If another fill of the same key won the race, keep that one and drop this one."""
        key = mapping.key
        if key in self._open:
            mapping.release()  # nothing was ever copied from it
            self._open.move_to_end(key)
            return self._open[key]
        self.stats.host_misses += 1
        self.stats.bytes_read += mapping.nbytes
        self.stats.bytes_from_page_cache += mapping.cached
        self.stats.bytes_from_disk += mapping.nbytes - mapping.cached
        self._open[key] = mapping
        while len(self._open) > self.window:
            _, old = self._open.popitem(last=False)
            self._evict(old)
        return mapping

    def get(self, key: ExpertKey) -> HostMapping:
        """Synchronous lookup-or-open (CPU tests, the synchronous provider)."""
        return self.lookup(key) or self.insert(self.open_mapping(key))

    def _evict(self, mapping: HostMapping) -> None:
        """One event on the copy stream after every copy queued from this mapping; the
        `RetireQueue` releases the mapping once it completed."""
        self.stats.evictions += 1
        mapping.retired = True
        self.retire.retire(self.device.record_copy_event(), mapping)

    def close(self) -> None:
        """Retire every open mapping and release them all (shutdown)."""
        while self._open:
            _, m = self._open.popitem(last=False)
            self.retire.retire(self.device.record_copy_event(), m)
        self.retire.drain()


# ---- which host tier: mapped files (the store fits in RAM) or the buffer pool ----------------

POOL_SHARE_OF_AVAILABLE = 0.5  # pool budget without --host-mem: half the memory available now


def available_memory() -> int | None:
    """Bytes this process can still use: MemAvailable, capped by a cgroup v2 memory.max."""
    avail = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        cg = open("/proc/self/cgroup").read().strip().split("::", 1)[-1]
        base = "/sys/fs/cgroup" + cg.rstrip("/")
        limit = open(f"{base}/memory.max").read().strip()
        if limit != "max":
            free = int(limit) - int(open(f"{base}/memory.current").read())
            avail = free if avail is None else min(avail, free)
    except (OSError, ValueError):
        pass
    return avail


def choose_host_tier(mode: str, expert_bytes: int, host_mem: int | None,
                     available: int | None) -> tuple[str, int | None, str]:
    """(kind, pool budget, why). `auto`: mapped when every expert file fits in --host-mem (or,
    without it, in the memory available now), else the pool under --host-mem (or half of what
    is available). `mode` is RuntimeOptions.host_tier, checked there. A pool under a --host-mem
    above `available` is refused."""
    from streamrt.output_paths import human_bytes as hb

    room, named = (host_mem, "--host-mem") if host_mem is not None else (available, "available memory")
    fits = room is None or expert_bytes <= room
    if mode == "mapped" or (mode == "auto" and fits):
        why = "--host-tier mapped" if mode == "mapped" else (
            f"{hb(expert_bytes)} of experts fit in {named} {hb(room)}" if room is not None
            else "memory size unknown")
        return "mapped", None, why
    budget = host_mem if host_mem is not None else int(POOL_SHARE_OF_AVAILABLE * (available or 0))
    budget = min(budget, expert_bytes)
    if host_mem is not None and available is not None and budget > available:
        # the pool is anonymous (on CUDA page-locked) memory, all of it touched: past RAM it is the OOM killer
        raise StreamrtError(f"--host-mem {hb(budget)} of pool buffers is more than the {hb(available)} "
                            f"of memory available; lower --host-mem")
    why = "--host-tier pool" if mode == "pool" else f"{hb(expert_bytes)} of experts > {named} {hb(room)}"
    return "pool", budget, why
