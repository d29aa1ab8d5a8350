"""One routed expert in NVFP4, as the model consumes it, and the answer to a layer's request.

The tensors are views: of a CPU file mapping, of a pinned host buffer, or of a GPU slot.
Nothing here copies or dequantises.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from streamrt.errors import StreamrtError


@dataclass(frozen=True)
class NVFP4Matrix:
    packed: Tensor  # uint8 [out, in/2]; low nibble = even element (E2M1)
    scales: Tensor  # uint8 [out, in/16]; E4M3 bits, one per 16 elements
    global_scale: Tensor  # float32 [out]

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2


@dataclass(frozen=True)
class ExpertWeights:
    gate: NVFP4Matrix  # w1 [I, Dl]
    up: NVFP4Matrix  # w3 [I, Dl]
    down: NVFP4Matrix  # w2 [Dl, I]


def unique_ids(host_ids: Tensor) -> list[int]:
    """The distinct ids of a host tensor of expert ids, ascending. A decode step's few ids go
    through a set; a prefill chunk's tens of thousands through a count per id (20x faster there)."""
    flat = host_ids.reshape(-1)
    if flat.numel() <= 256:
        return sorted(set(flat.tolist()))
    return torch.bincount(flat).nonzero().view(-1).tolist()


def first_seen_ids(host_ids: Tensor) -> list[int]:
    """The distinct ids of a host tensor in the order they first occur (a guess's ranks: most
    confident first). A whole prompt's guesses (millions of ids) go through each id's first
    position, not a Python dict."""
    flat = host_ids.reshape(-1)
    if flat.numel() <= 4096:
        return list(dict.fromkeys(flat.tolist()))
    n = flat.numel()
    first = torch.full((int(flat.max()) + 1,), n, dtype=torch.long)
    first.scatter_reduce_(0, flat.long(), torch.arange(n), reduce="amin")
    present = (first < n).nonzero().view(-1)
    return present[torch.argsort(first[present])].tolist()


class RoutedExperts:
    """The answer to one ExpertRequest, the one type the model, the providers, the runtime and
    the backends share: the request's routed ids on the host (`host_ids` [N, k]), its unique ids
    once, ascending (`unique`), and each expert's weights by `take(e)`.

    The runtime's answer (runtime/streamed.py) makes the compute stream wait for an expert's copy
    when it is taken, and `pending(e)` says whether it would; expert parallelism's
    (parallel/shard.py) says `is_local(e)`. Asking `has`, `pending` or `is_local` never waits."""

    def __init__(self, views: Mapping[int, ExpertWeights], host_ids: Tensor, unique: list[int] | None = None,
                 layer: int = -1):
        self._views = views
        self.host_ids = host_ids
        self.unique = unique if unique is not None else unique_ids(host_ids)
        self.layer = layer

    def take(self, e: int) -> ExpertWeights:
        return self._views[e]

    def has(self, e: int) -> bool:
        return e in self._views

    def pending(self, e: int) -> bool:
        return False

    def is_local(self, e: int) -> bool:
        return True

    @property
    def ids(self) -> Tensor:
        """The ids a backend indexes with: the host ids (ResidentExperts: the router's device ids)."""
        return self.host_ids

    def missing(self) -> list[int]:
        """Routed ids the answer holds no weights for (a provider's bug)."""
        return [e for e in self.unique if not self.has(e)]

    def with_ids(self, host_ids: Tensor) -> "RoutedExperts":
        """The same experts for other rows' ids (a lockstep forward's share, one rank's pairs)."""
        return _WithIds(self, host_ids)


class _WithIds(RoutedExperts):
    def __init__(self, whole: RoutedExperts, host_ids: Tensor):
        super().__init__({}, host_ids, layer=whole.layer)
        self._whole = whole

    def take(self, e: int) -> ExpertWeights:
        return self._whole.take(e)

    def has(self, e: int) -> bool:
        return self._whole.has(e)

    def pending(self, e: int) -> bool:
        return self._whole.pending(e)

    def is_local(self, e: int) -> bool:
        return self._whole.is_local(e)


class ResidentExperts(RoutedExperts):
    """The answer when every expert of the layer sits in a device slot that does not move: the
    router's ids stay on the device (`ids`; nothing waits for them), and beside the views the
    layer's pointer table on the device (`table` [E, 9] int64, backends/expert_pointers.ExpertTable;
    `inter` the experts' intermediate size), from which kernels gather their own pointers, so a
    CUDA graph of the step replays for any routing; `tensor_core`: the table's experts meet the
    tensor-core kernels' alignment. Host ids exist only when a backend asks for them
    (`host_ids`: one device-to-host copy; the torch backend's per-expert loop)."""

    def __init__(self, views: Mapping[int, ExpertWeights], table: Tensor, inter: int, ids: Tensor, layer: int = -1,
                 tensor_core: bool = True):
        self._views, self.table, self.inter, self._ids, self.layer = views, table, inter, ids, layer
        self.tensor_core = tensor_core
        self._host = self._unique = None

    @property
    def ids(self) -> Tensor:
        return self._ids

    @property
    def host_ids(self) -> Tensor:
        if self._host is None:
            self._host = self._ids.cpu()
        return self._host

    @property
    def unique(self) -> list[int]:
        if self._unique is None:
            self._unique = unique_ids(self.host_ids)
        return self._unique

    def missing(self) -> list[int]:
        return []  # the table holds every expert of the layer (ExpertTable.complete)


def answer_to(answer, ids: Tensor) -> RoutedExperts:
    """A provider's answer to the request for `ids` as RoutedExperts: itself, or a plain
    {id: weights} mapping wrapped (simple providers; `ids` come to the host once)."""
    return answer if isinstance(answer, RoutedExperts) else RoutedExperts(answer, ids.cpu())


def answer_for_layer(answer, ids: Tensor, layer: int) -> RoutedExperts:
    """`answer_to`, refused with a StreamrtError naming the layer if it lacks a routed expert."""
    experts = answer_to(answer, ids)
    missing = experts.missing()
    if missing:
        raise StreamrtError(f"expert provider returned no weights for layer {layer} experts {missing[:8]}")
    return experts


def as_routed(experts, ids: Tensor) -> RoutedExperts:
    """`experts` for the routed `ids` (a backend's argument) as RoutedExperts: the answer itself
    when it was given for exactly these ids, its share for other ids, or a plain mapping wrapped
    (tests, benchmarks)."""
    if isinstance(experts, RoutedExperts):
        return experts if experts.ids is ids else experts.with_ids(ids.cpu())
    return answer_to(experts, ids)
