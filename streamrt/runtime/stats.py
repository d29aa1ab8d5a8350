"""Counters of the streaming runtime and the `--stats-json` payload.

Every byte moved and every stall is accounted for:
  host_hits / host_misses      host-tier lookups (a miss maps, and on CUDA page-locks, a file)
  device_hits / device_misses  device-tier references (one per unique expert per layer request)
  bytes_h2d                    bytes copied host -> device slots (staged predictions included)
  bytes_read                   bytes of expert files newly mapped or read (from the page cache
                               or the drive), plus `--prefetch discard` reads
  evictions                    host-tier evictions (each retires one mapping)
  retired / released           mappings queued on the RetireQueue / released from it
  full_synchronizes            device-wide synchronizes (0 on the decode path by design)
  stall_s                      host time the decode loop spent awaiting mappings it needed
                               for the current request (cold files)
  predicted_recall             |predicted ∩ routed| / |routed| over all layer requests with a
                               prediction (layer l+1's router on layer l's FFN input)
  effective_gbps               bytes copied during decode steps / decode wall time (1e9 B/s);
                               prefill copies are not counted

A runtime's `--stats-json` adds the staging counters (STAGING_KEYS) after those:
  staged                       guessed experts whose copy was issued ahead of their router
  stage_dropped                queued guesses dropped unissued, almost all because their
                               layer's router spoke first (or the step ended): they cost no
                               link time; a routed one was fetched as an ordinary miss.
                               staged + stage_dropped = guesses queued (not already resident)
  graph_steps                  decode steps replayed as a CUDA graph (every expert resident: no
                               expert is requested, so the hit counters above stay still)

and last, `prefill` (PREFILL_KEYS), the forwards that are not decode steps (prompts), apart
from decode's counters above (which include them except where they say decode):
  prefill.forwards             prefill forwards run
  prefill.s                    their wall time
  prefill.layer_requests       ExpertRequests they served (expert-stationary: one per MoE layer)
  prefill.bytes_h2d            routed-expert bytes they copied host -> device (staged included)
  prefill.experts_loaded       expert copies they made (bytes_h2d / the expert file's bytes)
  prefill.bank_passes          bytes_h2d / the whole routed bank's bytes (1.0: every expert once)
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field
from pathlib import Path

PAYLOAD_KEYS = (
    "tokens", "s_per_token", "host_hits", "host_misses", "device_hits", "device_misses", "bytes_h2d",
    "bytes_read", "evictions", "retired", "released", "full_synchronizes", "stall_s", "predicted_recall",
    "effective_gbps",
)
STAGING_KEYS = ("staged", "stage_dropped", "graph_steps")
PREFILL_KEYS = ("prefill",)
# Disk tier: where the expert bytes came from. Added to a runtime's payload when the
# pool tier runs or --host-tier was given (see DISK_DOC below).
DISK_KEYS = ("host_tier", "bytes_from_disk", "bytes_from_page_cache", "pool_hits", "pool_misses", "readahead_reads",
             "readahead_used")
DISK_DOC = """
  host_tier          mapped | pool
  bytes_from_disk    expert bytes that came from the drive: O_DIRECT reads, plus mapped or
                     buffered bytes not in the page cache when opened (mincore)
  bytes_from_page_cache   expert bytes mapped or read that the page cache already held
  pool_hits / pool_misses   pool-tier references served from a ready buffer / read from disk
  readahead_reads    predicted experts read into the pool ahead of their router
  readahead_used     of those, routed later while still in the pool (a read-ahead that paid)
"""


@dataclass
class RuntimeStats:
    tokens: int = 0
    decode_s: float = 0.0
    decode_bytes_h2d: int = 0  # bytes_h2d moved during timed decode steps (prefill excluded)
    host_hits: int = 0
    host_misses: int = 0
    device_hits: int = 0
    device_misses: int = 0
    bytes_h2d: int = 0
    bytes_read: int = 0
    evictions: int = 0
    released_sync: int = 0  # released at once under --evict sync (not via the RetireQueue)
    stall_s: float = 0.0
    predicted: int = 0  # routed experts that had been predicted
    routed: int = 0  # routed experts of requests that had a prediction
    staged: int = 0  # experts copied ahead on a prediction (staged copies issued)
    stage_dropped: int = 0  # queued guesses dropped unissued (mostly: their router spoke first)
    graph_steps: int = 0  # decode steps replayed as a CUDA graph (runtime/decode_graphs.py)
    host_tier: str = "mapped"  # DISK_KEYS, see DISK_DOC
    bytes_from_disk: int = 0
    bytes_from_page_cache: int = 0
    pool_hits: int = 0
    pool_misses: int = 0
    readahead_reads: int = 0
    readahead_used: int = 0
    prefills: int = 0  # forwards that are not decode steps (prompts); see PREFILL_KEYS
    prefill_s: float = 0.0
    prefill_requests: int = 0
    prefill_bytes_h2d: int = 0
    trace: list | None = field(default=None, repr=False)  # [[layer, [experts]], ...] when recording

    def reset(self, *, keep_prefill: bool = False) -> None:
        """Zero every counter in place (the tiers hold a reference to this object); with
        `keep_prefill` the prefill counters (PREFILL_KEYS) stay."""
        trace = [] if self.trace is not None else None
        tier = self.host_tier  # a setting, not a counter
        for f in self.__dataclass_fields__.values():
            if keep_prefill and f.name.startswith("prefill"):
                continue
            setattr(self, f.name, f.default if f.default is not MISSING else f.default_factory())
        self.trace, self.host_tier = trace, tier

    def payload(self, *, retire=None, device=None, staging: bool = False, disk: bool = False,
                bank: tuple[int, int] | None = None) -> dict:
        """The `--stats-json` object: exactly PAYLOAD_KEYS, then STAGING_KEYS with `staging`,
        DISK_KEYS with `disk`, PREFILL_KEYS with `bank` = (expert files, bytes per file)."""
        retired = retire.retired if retire is not None else 0
        released = (retire.released if retire is not None else 0) + self.released_sync
        out = {
            "tokens": self.tokens,
            "s_per_token": self.decode_s / self.tokens if self.tokens else 0.0,
            "host_hits": self.host_hits,
            "host_misses": self.host_misses,
            "device_hits": self.device_hits,
            "device_misses": self.device_misses,
            "bytes_h2d": self.bytes_h2d,
            "bytes_read": self.bytes_read,
            "evictions": self.evictions,
            "retired": retired,
            "released": released,
            "full_synchronizes": device.full_synchronizes if device is not None else 0,
            "stall_s": self.stall_s,
            "predicted_recall": self.predicted / self.routed if self.routed else 0.0,
            "effective_gbps": self.decode_bytes_h2d / self.decode_s / 1e9 if self.decode_s else 0.0,
        }
        assert tuple(out) == PAYLOAD_KEYS
        if staging:
            out.update(staged=self.staged, stage_dropped=self.stage_dropped, graph_steps=self.graph_steps)
        if disk:
            out.update({k: getattr(self, k) for k in DISK_KEYS})
        if bank is not None:
            out["prefill"] = self.prefill_payload(*bank)
        return out

    def prefill_payload(self, expert_files: int, file_bytes: int) -> dict:
        """The prefill forwards' own expert traffic (PREFILL_KEYS)."""
        bank = expert_files * file_bytes
        return {"forwards": self.prefills, "s": self.prefill_s, "layer_requests": self.prefill_requests,
                "bytes_h2d": self.prefill_bytes_h2d, "experts_loaded": self.prefill_bytes_h2d // max(1, file_bytes),
                "bank_passes": self.prefill_bytes_h2d / bank if bank else 0.0}


def write_stats_json(path: str | Path, payload: dict) -> None:
    """Atomically (temp name + rename): the file is the old one or the whole new one; a write
    failure is one CheckpointError naming the path. `run` checks the path before it starts
    (output_paths.check_output_path), so this only fails if the disk changed meanwhile."""
    from streamrt.fileio import atomic_write

    atomic_write(path, json.dumps(payload, indent=2) + "\n")
