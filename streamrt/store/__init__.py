"""The expert store: host tier (mapped files, retention window), device tier (slot cache),
retirement FIFO, replacement policies.

    ExpertKey(layer, expert)
    HostTier(path_of, file_bytes, window, device=, retire=, stats=, register=, evict=)
    DeviceTier(slots, slot_bytes, device=, policy=, stats=)
    RetireQueue()
    make_policy(name, capacity=) -> LRU | LFUDecay;  belady_hits(groups, capacity); replay(policy, groups, capacity)
"""

from streamrt.store.device_tier import DeviceTier, relocate_views
from streamrt.store.host_tier import HostMapping, HostTier
from streamrt.store.keys import ExpertKey
from streamrt.store.policies import DEFAULT_POLICY, LFUDecay, LRU, POLICIES, belady_hits, make_policy, replay
from streamrt.store.retire import RetireQueue

__all__ = [
    "DEFAULT_POLICY", "DeviceTier", "ExpertKey", "HostMapping", "HostTier", "LFUDecay", "LRU", "POLICIES",
    "RetireQueue", "belady_hits", "make_policy", "relocate_views", "replay",
]
