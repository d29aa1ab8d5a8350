"""`DeviceTier`: a fixed slab of M expert slots on the compute device, key -> slot.

Each slot holds one expert file's bytes (uint8 [file_bytes]); the model gets zero-copy views of
the slot (`views(slot)`). Which key leaves when a slot is needed is the policy's decision
(`--gpu-policy`, default the scan-resistant `lfu`, see `policies.py`).

Two events per slot keep the copy and compute streams honest without a host synchronize:
  ready[slot]     recorded on the copy stream after the fill; compute waits on it
  last_use[slot]  recorded on the compute stream after the layer that read the slot was
                  queued; the copy stream waits on it before refilling the slot

Keys the current request needs (and staged predictions for the next layer) are pinned: the
policy never picks them as victims.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from torch import Tensor

from streamrt.output_paths import human_bytes
from streamrt.errors import StreamrtError
from streamrt.store.keys import ExpertKey
from streamrt.store.policies import Policy


class DeviceTier:
    def __init__(self, slots: int, slot_bytes: int, *, device, policy: Policy, stats) -> None:
        self.slots = slots  # >= 1: RuntimeOptions.resolve gives at least one layer request's worth
        self.slot_bytes = slot_bytes
        self.device = device
        self.policy = policy
        self.stats = stats
        try:
            self.slab = device.alloc_slab(slots, slot_bytes)  # [M, file_bytes] uint8
        except RuntimeError:  # torch's out-of-memory (a traceback otherwise)
            raise StreamrtError(f"--gpu-experts {slots}: cannot allocate {slots} x {slot_bytes}-byte expert slots "
                                f"({human_bytes(slots * slot_bytes)}) on {device.kind}; lower --gpu-experts "
                                f"or --gpu-mem") from None
        self._slot_of: dict[ExpertKey, int] = {}
        self._key_of: list[ExpertKey | None] = [None] * slots
        self._free = list(range(slots - 1, -1, -1))
        self.ready: list = [None] * slots
        self.last_use: list = [None] * slots
        self._pins: Counter[ExpertKey] = Counter()
        self._views: list = [None] * slots
        self.evictions = 0
        self.transients = 0

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def slot_of(self, key: ExpertKey) -> int | None:
        return self._slot_of.get(key)

    def lookup(self, key: ExpertKey) -> int | None:
        """A reference: tells the policy, counts device_hits / device_misses."""
        self.policy.access(key)
        slot = self._slot_of.get(key)
        if slot is None:
            self.stats.device_misses += 1
        else:
            self.stats.device_hits += 1
        return slot

    # ---- pins ----------------------------------------------------------------------

    def pin(self, keys) -> None:
        self._pins.update(keys)

    @property
    def pinned(self) -> int:
        """Distinct keys pinned now."""
        return len(self._pins)

    def unpin(self, keys) -> None:
        pins = self._pins
        for k in keys:
            pins[k] -= 1
            if pins[k] <= 0:
                del pins[k]

    # ---- fill ----------------------------------------------------------------------

    def admit(self, key: ExpertKey, *, required: bool = True) -> int | None:
        """A slot for `key`: a free one, else the policy's victim among unpinned keys.
        With no victim: an error when `required`, else None (staging just skips)."""
        if key in self._slot_of:
            return self._slot_of[key]
        if self._free:
            slot = self._free.pop()
        else:
            victim = self.policy.victim(self._pins)
            if victim is None:
                if not required:
                    return None
                raise StreamrtError(
                    f"--gpu-experts {self.slots}: every slot is pinned by the current request; "
                    f"raise --gpu-experts above the experts one layer needs"
                )
            slot = self._slot_of.pop(victim)
            self.policy.remove(victim)
            self.evictions += 1
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self.policy.insert(key)
        return slot

    def fill(self, slot: int, src: Tensor, *, pinned: bool) -> None:
        """Queue the copy of one expert file into `slot` on the copy stream, after the last
        compute that read the slot's previous occupant; record the slot's ready event."""
        if self.last_use[slot] is not None:
            self.device.copy_wait(self.last_use[slot])
        self.device.copy_h2d(self.slab[slot], src, pinned=pinned)
        self.ready[slot] = self.device.record_copy_event()
        self.stats.bytes_h2d += self.slot_bytes

    def fill_transient(self, src: Tensor, *, pinned: bool) -> tuple[Tensor, object]:
        """A request needing more experts than there are unpinned slots (a long prefill) gets
        the overflow in a transient buffer on the compute device, freed by the caching
        allocator once the compute that reads it has run. Returns (buffer, ready event)."""
        buf = self.device.alloc_buffer(self.slot_bytes)
        self.device.copy_h2d(buf, src, pinned=pinned, transient=True)
        self.stats.bytes_h2d += self.slot_bytes
        self.transients += 1
        return buf, self.device.record_copy_event()

    def build_views(self, slot: int, make: Callable[[Tensor], object]) -> None:
        """A filled slot's zero-copy expert views, `make(slot tensor)`; the layout is fixed, so
        built once per slot, at its first fill."""
        if self._views[slot] is None:
            self._views[slot] = make(self.slab[slot])

    def views(self, slot: int):
        """The expert views of a slot filled before (`build_views`)."""
        return self._views[slot]

    def release(self) -> None:
        """Give the slab back (a closed runtime), and the slots' views with it, so that the next
        runtime in the same process can take the memory; the key map stays for reports."""
        self.slab = None
        self._views = [None] * self.slots
        self.ready = [None] * self.slots

    def keys(self) -> list[ExpertKey]:
        return list(self._slot_of)


def relocate_views(weights, base: Tensor, target: Tensor):
    """The same expert views `weights` has over `base` (a parsed host mapping), made over
    `target` (a slot holding the same bytes): no header read, so no device-to-host sync."""
    import dataclasses

    origin = base.data_ptr()

    def move(t: Tensor) -> Tensor:
        off = t.data_ptr() - origin
        n = t.numel() * t.element_size()
        if not (0 <= off and off + n <= base.numel()) or not t.is_contiguous():
            raise StreamrtError("expert views must be contiguous views of their file buffer")
        return target[off : off + n].view(t.dtype).view(t.shape)

    def walk(obj):
        if isinstance(obj, Tensor):
            return move(obj)
        if dataclasses.is_dataclass(obj):
            return type(obj)(**{f.name: walk(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
        return obj

    return walk(weights)
