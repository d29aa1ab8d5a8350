"""Several forwards driven as one: requests for the same layer share one expert fetch.

    lockstep([gen_a, gen_b, ...]) -> a generator of the same protocol (yields ExpertRequest,
                                     is sent the experts, returns [result_a, result_b, ...])

The server runs a new request's prefill and the running rows' decode step at the same step
boundary; at full scale both touch most of a layer's experts, so fetching the union once
halves the bytes of that boundary. Each forward keeps its own rows, cache and arithmetic
(it is sent the merged answer and takes only its own experts from it), so its results are
bit-identical to running it alone; only the order of the queued work interleaves.

Forwards that are at different layers (a prompt in its second chunk, say) are served
lowest layer first, alone, until they line up again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generator

import torch

from streamrt.model.moe import ExpertRequest


def lockstep(gens: list[Generator]) -> Generator:
    results: dict[int, object] = {}
    pending: dict[int, ExpertRequest] = {}
    for i, gen in enumerate(gens):
        _advance(i, gen, None, pending, results, first=True)
    while pending:
        layer = min(req.layer for req in pending.values())
        group = [i for i in sorted(pending) if pending[i].layer == layer]
        reqs = [pending[i] for i in group]
        experts = yield (reqs[0] if len(reqs) == 1 else _merge(reqs))
        row = 0
        for i, req in zip(group, reqs):
            n = req.ids.shape[0]
            answer = experts if len(reqs) == 1 else _RowsOf(experts, row, n)
            row += n
            _advance(i, gens[i], answer, pending, results)
    return [results[i] for i in range(len(gens))]


def _advance(i, gen, answer, pending, results, first: bool = False) -> None:
    try:
        pending[i] = next(gen) if first else gen.send(answer)
    except StopIteration as stop:
        pending.pop(i, None)
        results[i] = stop.value


def _merge(reqs: list[ExpertRequest]) -> ExpertRequest:
    return ExpertRequest(
        reqs[0].layer,
        torch.cat([r.ids for r in reqs]),
        torch.cat([r.weights for r in reqs]),
        torch.cat([r.hidden for r in reqs]),
    )


class _RowsOf(Mapping):
    """One forward's share of a merged answer: every expert of the union, and the host copy
    of its own rows of the routed ids (the model reads `host_ids` to skip a device sync)."""

    def __init__(self, experts: Mapping, start: int, n: int):
        self._experts = experts
        host = getattr(experts, "host_ids", None)
        self.host_ids = host[start : start + n] if host is not None else None

    def __getitem__(self, e: int):
        return self._experts[e]

    def pending(self, e: int) -> bool:
        pending = getattr(self._experts, "pending", None)
        return bool(pending(e)) if pending is not None else False

    def is_local(self, e: int) -> bool:
        """Whether expert e's weights are on this rank (expert parallelism's stand-ins are not)."""
        is_local = getattr(self._experts, "is_local", None)
        return bool(is_local(e)) if is_local is not None else True

    def __iter__(self):
        return iter(self._experts)

    def __len__(self) -> int:
        return len(self._experts)
