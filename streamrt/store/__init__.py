"""The expert store: host tier (mapped files, retention window; or, for checkpoints bigger than
RAM, a pool of page-locked buffers filled by O_DIRECT reads), device tier (slot cache),
retirement FIFO, replacement policies. Values that come from flags (window, slots, modes) arrive
checked by `RuntimeOptions`; the store does not check them again.

    ExpertKey(layer, expert)
    HostTier(path_of, file_bytes, window, device=, retire=, stats=, register=)
    PoolTier(path_of, file_bytes, budget_bytes, device=, stats=, policy=)   the disk tier's RAM cache
    choose_host_tier(mode, expert_bytes, host_mem, available) -> (kind, pool budget, why)
    FileReader(direct=, notice=, preadv=, open_fn=); DiskReader(threads)   reads in priority order
    choose_gds(mode, device) -> GdsChoice(active, why)
    DeviceTier(slots, slot_bytes, device=, policy=, stats=)
    RetireQueue()
    make_policy(name, capacity=) -> LRU | LFUDecay;  belady_hits(groups, capacity); replay(policy, groups, capacity)
"""

from streamrt.store.device_tier import DeviceTier, relocate_views
from streamrt.store.disk_reader import DiskReader, FileReader
from streamrt.store.gds import choose_gds
from streamrt.store.host_tier import HostMapping, HostTier, choose_host_tier
from streamrt.store.pool import PoolTier
from streamrt.store.keys import ExpertKey
from streamrt.store.policies import (DEFAULT_POLICY, FrequencyMRU, LFUDecay, LRU, POLICIES, belady_hits, make_policy,
                                     replay)
from streamrt.store.retire import RetireQueue

__all__ = [
    "DEFAULT_POLICY", "DeviceTier", "DiskReader", "ExpertKey", "FileReader", "FrequencyMRU", "HostMapping", "HostTier",
    "LFUDecay", "LRU", "POLICIES", "PoolTier", "RetireQueue", "belady_hits", "choose_gds", "choose_host_tier",
    "make_policy", "relocate_views", "replay",
]
