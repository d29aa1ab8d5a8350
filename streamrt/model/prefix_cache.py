"""The prefix cache: a request resumes from the state of the longest prefix of its token ids
that an earlier prefill left behind, and prefills only the tokens past it.

A snapshot is one sequence's whole decode state at exactly one position n (cache.py):
per MLA layer the latent c and key dims kr of positions 0..n-1 (and the indexer keys ik on
indexer layers); per KDA layer the three short-conv buffers, the recurrent state, and the
prefill anchor (the state at the last KDA sub-chunk boundary and the tokens since it, kda.py),
without which the next prefill would place its sub-chunks differently. Its key is the token
ids 0..n-1; a lookup hashes the request's ids once per distinct snapshot length (an index
equivalent to a radix tree's, without a node per token) and compares the ids of the longest
candidate before trusting it.

Where snapshots live: host memory, page-locked when the sequence's cache is on a CUDA device,
so a snapshot never takes device memory from the expert slots. Taking one costs a copy of its
bytes device -> host at the end of a prefill piece; a hit costs one copy host -> device of the
same bytes (at full K3.1 Pro size: 414 MiB of fp32 KDA state and conv buffers, plus 24 layers x
(R + dr + Di) fp32 values per cached position), against a prefill that streams every routed
expert at least once. The MLA latent is copied per snapshot, not shared: the cache's layout
is one contiguous tensor per row.

Exactness: snapshots are taken only where a prefill piece ends on a cache that has only ever
been prefilled (never after a decode step, whose recurrent arithmetic differs in its last
bits), and the prefill is chunk-invariant (model.py), so a request resumed from a snapshot
gets logits bit-identical to the same request prefilled from scratch. On a backend whose
prefill products depend on the rows of their chunk (`prefill_rows_exact` False: nvrtc, whose
prefill GEMMs are cuBLAS's, chosen by row count) that holds only where the resumed prefill cuts
its chunks where a prefill from scratch does, so there snapshots are kept and used at multiples
of the prefill chunk only (`resume_align`): a resumed turn then prefills up to one chunk of the
history again. On the torch backend (CPU and CUDA: fixed-tile prefill products) a prompt
resumes at any position. A resume leaves at least `MIN_NEW` tokens to prefill: a one-token
piece on a cache runs as a decode step.

Budget: `--prefix-cache-mem` bytes of snapshots (default an eighth of the host's available
memory at start, 0: off); least recently used snapshots go first; one larger than the whole
budget is not kept.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from streamrt.model.cache import KDACache, MLACache, ModelCache

MIN_NEW = 2  # tokens a resumed prefill leaves to compute: one token on a cache is a decode step
DEFAULT_SHARE = 8  # default budget: available host memory // DEFAULT_SHARE


def default_budget() -> int:
    """An eighth of the host's available memory (MemAvailable), 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // DEFAULT_SHARE
    except OSError:
        pass
    return 0


def resume_align(model, stride: int) -> int:
    """The positions a snapshot may be kept and resumed at, as a multiple: 1 where the model's
    backend computes a prefill row's bits whatever the rows beside it, else the prefill chunk
    `stride` (module doc: Exactness)."""
    if stride <= 0:
        return 1
    return 1 if getattr(model.backend, "prefill_rows_exact", True) else stride


def _key(ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()


def _to_host(t: Tensor) -> Tensor:
    if t.device.type != "cuda":
        return t.detach().clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t.detach())


def _grown(t: Tensor, capacity: int, device) -> Tensor:
    """An MLA cache tensor [1, n, d] of the snapshot back at the cache's capacity on `device`:
    the n cached positions copied once, the rest zeros made there (not copied over the link)."""
    out = torch.zeros(1, capacity, t.shape[2], dtype=t.dtype, device=device)
    out[:, : t.shape[1]].copy_(t)
    return out


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


@dataclass(eq=False)
class Snapshot:
    """One sequence's state after `tokens`: per layer ("mla", capacity, c, kr, ik) or
    ("kda", conv_q, conv_k, conv_v, state, anchor_state, pending), on the host."""

    tokens: tuple[int, ...]
    layers: list
    nbytes: int = field(default=0)

    @staticmethod
    def size_of(cache: ModelCache, n: int) -> int:
        """The bytes a snapshot of `cache` (1 row) at n positions holds, before copying anything."""
        size = 0
        for lc in cache.layers:
            if isinstance(lc, MLACache):
                size += n * sum(t.shape[2] * t.element_size() for t in lc.tensors())
            else:
                size += _nbytes(lc.tensors() + [lc.anchor_state] + (lc.pending or []))
        return size

    @classmethod
    def take(cls, tokens: Sequence[int], cache: ModelCache) -> "Snapshot":
        n = len(tokens)
        if cache.batch != 1 or cache.lengths[0] != n:
            raise ValueError(f"a snapshot of {n} tokens needs a 1-row cache at that length, got {cache.lengths}")
        layers, size = [], 0
        for lc in cache.layers:
            if isinstance(lc, MLACache):
                parts = [None if t is None else _to_host(t[:, :n]) for t in (lc.c, lc.kr, lc.ik)]
                layers.append(("mla", lc.c.shape[1], *parts))
            else:
                anchor = None if lc.anchor_state is None else _to_host(lc.anchor_state)
                pending = None if lc.pending is None else [_to_host(t) for t in lc.pending]
                parts = [_to_host(t) for t in lc.tensors()]
                layers.append(("kda", *parts, anchor, pending))
                parts = parts + [anchor] + (pending or [])
            size += _nbytes(parts)
        return cls(tuple(int(t) for t in tokens), layers, size)

    def restore(self, device) -> ModelCache:
        """A fresh 1-row cache on `device` holding this state (its own tensors: the snapshot stays)."""
        dev = torch.device(device)
        on = lambda t: t.to(dev, copy=True)  # noqa: E731
        layers = []
        for kind, *parts in self.layers:
            if kind == "mla":
                cap, *ts = parts
                layers.append(MLACache(*(None if t is None else _grown(t, cap, dev) for t in ts)))
            else:
                *ts, anchor, pending = parts
                lc = KDACache(*(on(t) for t in ts))
                if anchor is not None:
                    lc.anchor_state = on(anchor)
                    lc.pending = None if pending is None else [on(t) for t in pending]
                layers.append(lc)
        return ModelCache(layers, [len(self.tokens)])


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    cached_tokens: int = 0  # prompt tokens not prefilled thanks to a hit
    stored: int = 0
    evicted: int = 0
    too_big: int = 0  # snapshots larger than the whole budget, not kept


class PrefixCache:
    """Token-id prefixes -> snapshots, LRU under a byte budget (module doc)."""

    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self._entries: OrderedDict[tuple[int, bytes], Snapshot] = OrderedDict()  # LRU first
        self._lengths: dict[int, int] = {}  # snapshot length -> how many snapshots have it
        self.nbytes = 0
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def lookup(self, ids: Sequence[int], align: int = 1) -> Snapshot | None:
        """The snapshot of the longest prefix of `ids` that leaves at least MIN_NEW tokens and ends
        at a multiple of `align` (`resume_align`), or None."""
        self.stats.lookups += 1
        found = self._find(ids, align)
        if found is None:
            return None
        key, snap = found
        self._entries.move_to_end(key)
        self.stats.hits += 1
        self.stats.cached_tokens += key[0]
        return snap

    def cached_length(self, ids: Sequence[int], align: int = 1) -> int:
        """How many tokens of `ids` a `lookup` would resume now (0: none), without counting a
        lookup or touching the LRU order: for deciding, not for resuming."""
        found = self._find(ids, align)
        return 0 if found is None else found[0][0]

    def _find(self, ids: Sequence[int], align: int) -> tuple[tuple[int, bytes], Snapshot] | None:
        limit = len(ids) - MIN_NEW
        lengths = sorted(n for n in self._lengths if n <= limit and n % align == 0)
        for key in reversed(self._candidates(ids, lengths)):
            snap = self._entries.get(key)
            if snap is not None and snap.tokens == tuple(ids[: key[0]]):
                return key, snap
        return None

    @staticmethod
    def _candidates(ids: Sequence[int], lengths: list[int]) -> list[tuple[int, bytes]]:
        """The keys of ids[:n] for each n of ascending `lengths`: one pass over the ids (the hash
        of a concatenation is the hash updated piece by piece)."""
        data, h, at, keys = np.asarray(ids, dtype=np.int64), hashlib.blake2b(digest_size=16), 0, []
        for n in lengths:
            h.update(data[at:n].tobytes())
            at = n
            keys.append((n, h.copy().digest()))
        return keys

    def store(self, tokens: Sequence[int], cache: ModelCache, align: int = 1) -> bool:
        """Keep the state of `cache` (1 row, at len(tokens)) under `tokens`; False if not kept
        (off, too short, not at a multiple of `align`, or larger than the budget)."""
        if not self.enabled or len(tokens) < MIN_NEW or len(tokens) % align:
            return False
        key = (len(tokens), _key(tokens))
        if key in self._entries:  # the same prefix again (a shared system prompt): nothing to copy
            self._entries.move_to_end(key)
            return True
        if Snapshot.size_of(cache, len(tokens)) > self.budget:  # not worth a copy
            self.stats.too_big += 1
            return False
        snap = Snapshot.take(tokens, cache)
        while self.nbytes + snap.nbytes > self.budget:
            self._evict()
        self._entries[key] = snap
        self._lengths[key[0]] = self._lengths.get(key[0], 0) + 1
        self.nbytes += snap.nbytes
        self.stats.stored += 1
        return True

    def _evict(self) -> None:
        (n, _), snap = self._entries.popitem(last=False)
        self.nbytes -= snap.nbytes
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]
        self.stats.evicted += 1

    @staticmethod
    def marks(start: int, end: int, stride: int) -> list[int]:
        """Where a prefill from `start` to `end` stops to leave a snapshot: the last multiple of
        `stride` past `start` (the last prefill chunk boundary, where a shared system prompt
        most likely ends: no extra chunk) when it leaves MIN_NEW tokens after it, and the end."""
        k = (end - MIN_NEW - start) // stride if stride > 0 else 0
        mid = start + k * stride
        return [mid, end] if k >= 1 and mid - start >= MIN_NEW else [end]


def common_prefix(a: Sequence[int], b: Sequence[int], block: int = 256) -> int:
    """How many leading token ids `a` and `b` share: whole blocks compared as lists first (a
    shared system prompt of thousands of tokens costs a few slice compares), then the first
    differing block id by id."""
    n, at = min(len(a), len(b)), 0
    while at < n and a[at : at + block] == b[at : at + block]:
        at += block
    while at < n and a[at] == b[at]:
        at += 1
    return min(at, n)


def prefill_steps(model, ids: Sequence[int], cache: ModelCache, stops: Sequence[int],
                  prefix: PrefixCache | None, prefill_chunk: int | None = None, align: int = 1):
    """One forward generator prefilling ids[cache length:] on `cache` in pieces ending at `stops`
    (`PrefixCache.marks`), leaving a snapshot in `prefix` at each -> the last position's logits
    [1, 1, V]. The pieces cost no more expert traffic than one forward when the stops fall on
    prefill chunk boundaries (each chunk is one request per MoE layer either way)."""
    device = model.lm_head.weight.device
    start, out = cache.lengths[0], None
    for stop in stops:
        x = torch.tensor([list(ids[start:stop])], device=device)  # [1, T]
        out = yield from model.forward_steps(x, cache, last_only=True, prefill_chunk=prefill_chunk)
        if prefix is not None:
            prefix.store(ids[:stop], cache, align)
        start = stop
    return out
