"""Decode caches and the per-forward context.

Per layer and sequence (spec/MODEL.md §2.3, §3.3, K31_INDEXER.md):
- KDA: conv_q / conv_k / conv_v [B, P, W] (the last W conv inputs) and state [B, H, K, V] fp32.
- MLA: c [B, cap, R] (post kv_a_layernorm latent), kr [B, cap, Dr] (un-rotated key dims),
  plus ik [B, cap, Di] (indexer keys) on indexer layers. Rows fill independently:
  `lengths[b]` positions of row b are valid.
AttnRes needs no cache (its sources are rebuilt on every forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


class KDACache:
    """conv_q / conv_k / conv_v [B, P, W], state [B, H, K, V] (the decode state, always current).

    Prefill anchor (kda.py module doc): anchor_state [B, H, K, V] = the state at the last
    KDA_CHUNK boundary of this run of prefills, pending = (q, k, v, g, beta) [B, L, H, .] of
    the L < KDA_CHUNK tokens since it; None after a decode step or a stack (kept by clone and
    select). Not counted by `ModelCache.nbytes` (at most one state and KDA_CHUNK tokens per layer).
    """

    def __init__(self, conv_q: Tensor, conv_k: Tensor, conv_v: Tensor, state: Tensor):
        self.conv_q, self.conv_k, self.conv_v, self.state = conv_q, conv_k, conv_v, state
        self.anchor_state: Tensor | None = None
        self.pending: list[Tensor] | None = None

    def anchor(self) -> tuple[Tensor, list[Tensor] | None]:
        """(state the next prefill chunk starts from, tokens it must recompute or None)."""
        if self.anchor_state is None:
            return self.state, None
        return self.anchor_state, self.pending

    def set_anchor(self, state: Tensor, pending: list[Tensor]) -> None:
        self.anchor_state, self.pending = state, (pending if pending[0].shape[1] else None)

    def drop_anchor(self) -> None:
        self.anchor_state = self.pending = None

    @classmethod
    def empty(cls, cfg, batch: int, device) -> "KDACache":
        P, W, H, K = cfg.kda_proj_dim, cfg.short_conv_kernel_size, cfg.kda_num_heads, cfg.kda_head_dim
        z = lambda *s: torch.zeros(*s, dtype=torch.float32, device=device)  # noqa: E731
        return cls(z(batch, P, W), z(batch, P, W), z(batch, P, W), z(batch, H, K, K))

    def tensors(self) -> list[Tensor]:
        return [self.conv_q, self.conv_k, self.conv_v, self.state]

    def map(self, fn) -> "KDACache":
        out = KDACache(*(fn(t) for t in self.tensors()))
        if self.anchor_state is not None:  # kept through clone / select, so a copy continues a prefill alike
            out.anchor_state = fn(self.anchor_state)
            out.pending = None if self.pending is None else [fn(t) for t in self.pending]
        return out


class MLACache:
    def __init__(self, c: Tensor, kr: Tensor, ik: Tensor | None):
        self.c, self.kr, self.ik = c, kr, ik

    @classmethod
    def empty(cls, cfg, batch: int, device, indexer: bool, cap: int = 64) -> "MLACache":
        z = lambda d: torch.zeros(batch, cap, d, dtype=torch.float32, device=device)  # noqa: E731
        return cls(z(cfg.kv_lora_rank), z(cfg.qk_rope_head_dim), z(cfg.indexer.head_dim) if indexer else None)

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.c, self.kr, self.ik) if t is not None]

    def map(self, fn) -> "MLACache":
        return MLACache(fn(self.c), fn(self.kr), None if self.ik is None else fn(self.ik))

    def reserve(self, n: int, *, exact: bool = False) -> None:
        """Grow capacity to hold n positions: doubling (amortised appends), or to exactly n."""
        cap = self.c.shape[1]
        if n <= cap:
            return
        new = n if exact else max(n, 2 * cap)
        grow = lambda t: torch.cat((t, t.new_zeros(t.shape[0], new - cap, t.shape[2])), dim=1)  # noqa: E731
        self.c, self.kr = grow(self.c), grow(self.kr)
        if self.ik is not None:
            self.ik = grow(self.ik)


class ModelCache:
    """Every layer's decode state for a batch of B sequences. `lengths` (host) and `device_lengths`
    (int32 [B] beside the caches) both count each row's valid positions: decode reads the
    device copy, so a CUDA graph of a step needs no host value that changes per token."""

    def __init__(self, layers: list, lengths: list[int]):
        self.layers = layers  # KDACache | MLACache per layer
        self.lengths = lengths  # valid positions per row

    @property
    def lengths(self) -> list[int]:
        return self._lengths

    @lengths.setter
    def lengths(self, lengths: list[int]) -> None:
        self._lengths = list(lengths)
        device = self.layers[0].tensors()[0].device if self.layers else torch.device("cpu")
        self.device_lengths = torch.tensor(self._lengths, dtype=torch.int32, device=device)

    def advance(self, t: int, *, on_device: bool = True) -> None:
        """Every row gained t positions: on the host, and in place on the device (capturable;
        on_device=False: a graph's replay did that part)."""
        self._lengths = [n + t for n in self._lengths]
        if on_device:
            self.device_lengths.add_(t)

    def reserve(self, n: int) -> None:
        """Every MLA layer's capacity to at least n positions (doubling, as a step's own growth)."""
        for lc in self.layers:
            if isinstance(lc, MLACache):
                lc.reserve(n)

    def tensor_addresses(self) -> tuple:
        """Where every cache tensor lives, and its shape: a CUDA graph of a step is valid while
        these stay (a freed cache's memory may come back at the same address, another size)."""
        ts = [self.device_lengths, *(t for lc in self.layers for t in lc.tensors())]
        return tuple((t.data_ptr(), *t.shape) for t in ts)

    @classmethod
    def empty(cls, cfg, batch: int, device=None) -> "ModelCache":
        device = torch.device(device or "cpu")
        layers = [
            MLACache.empty(cfg, batch, device, cfg.has_indexer(i))
            if cfg.layer_kind(i) == "mla"
            else KDACache.empty(cfg, batch, device)
            for i in range(cfg.num_layers)
        ]
        return cls(layers, [0] * batch)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def select(self, rows: Sequence[int]) -> "ModelCache":
        """A cache holding only `rows` (e.g. the sequences still generating)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        pick = lambda t: t.index_select(0, idx.to(t.device))  # noqa: E731
        return ModelCache([lc.map(pick) for lc in self.layers], [self.lengths[r] for r in rows])

    def clone(self) -> "ModelCache":
        return ModelCache([lc.map(torch.clone) for lc in self.layers], list(self.lengths))

    @classmethod
    def stack(cls, caches: Sequence["ModelCache"]) -> "ModelCache":
        """Concatenate caches along the batch (rows may have different lengths)."""
        layers = []
        for per_layer in zip(*(c.layers for c in caches)):
            if isinstance(per_layer[0], MLACache):
                cap = max(lc.c.shape[1] for lc in per_layer)
                for lc in per_layer:
                    lc.reserve(cap, exact=True)  # same width for every row (doubling could overshoot)
                cat = [torch.cat(ts, dim=0) for ts in zip(*(lc.tensors() for lc in per_layer))]
                layers.append(MLACache(cat[0], cat[1], cat[2] if len(cat) > 2 else None))
            else:
                layers.append(KDACache(*(torch.cat(ts, dim=0) for ts in zip(*(lc.tensors() for lc in per_layer)))))
        return cls(layers, [n for c in caches for n in c.lengths])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for lc in self.layers for t in lc.tensors())


@dataclass
class Step:
    """Per-forward context the blocks share (nano-vllm's `Context`)."""

    be: object  # the Backend
    batch: int  # B sequences
    seqlen: int  # T new tokens per sequence
    cache: ModelCache | None
    start: int  # first position of the new tokens (prefill forms; rows share it)
    valid: Tensor | None = None  # decode: int32 [B] on the device, positions valid once this step's token is in

    def __post_init__(self) -> None:
        if self.valid is None and self.decode:
            self.valid = self.cache.device_lengths + 1

    @property
    def decode(self) -> bool:
        """One new token per sequence on a cache: recurrent KDA, absorbed MLA."""
        return self.cache is not None and self.seqlen == 1
