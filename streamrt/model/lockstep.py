"""Several forwards driven as one: requests for the same layer share one expert fetch.

    lockstep([gen_a, gen_b, ...]) -> a generator of the same protocol (yields ExpertRequest,
                                     is sent the experts, returns [result_a, result_b, ...])

The server runs a new request's prefill and the running rows' decode step at the same step
boundary; at full scale both touch most of a layer's experts, so fetching the union once
halves the bytes of that boundary. Each forward keeps its own rows, cache and arithmetic
(it is sent the merged answer and takes only its own experts from it), so its results are
bit-identical to running it alone; only the order of the queued work interleaves. Its share
of the answer is `RoutedExperts.with_ids`: every expert of the union, its own rows' host ids.

Forwards that are at different layers (a prompt in its second chunk, say) are served
lowest layer first, alone, until they line up again.
"""

from __future__ import annotations

from typing import Generator

import torch

from streamrt.expert_weights import answer_to
from streamrt.model.model import Forward, ForwardPass
from streamrt.model.moe import ExpertRequest


def lockstep(gens: list[Generator]) -> ForwardPass:
    """The forwards `gens` as one; a `Forward` bound to it is bound to each of them."""

    def start(forward: Forward) -> Generator:
        for gen in gens:
            bind = getattr(gen, "bind", None)  # a model's forward; a wrapped one runs as it is
            if bind is not None:
                bind(forward)
        return _lockstep(gens)

    return ForwardPass(start)


def _lockstep(gens: list[Generator]) -> Generator:
    results: dict[int, object] = {}
    pending: dict[int, ExpertRequest] = {}
    for i, gen in enumerate(gens):
        _advance(i, gen, None, pending, results, first=True)
    while pending:
        layer = min(req.layer for req in pending.values())
        group = [i for i in sorted(pending) if pending[i].layer == layer]
        reqs = [pending[i] for i in group]
        merged = reqs[0] if len(reqs) == 1 else _merge(reqs)
        experts = yield merged
        if len(reqs) > 1:
            experts = answer_to(experts, merged.ids)
        row = 0
        for i, req in zip(group, reqs):
            n = req.ids.shape[0]
            # each forward gets every expert of the union and its own rows' ids
            answer = experts if len(reqs) == 1 else experts.with_ids(experts.host_ids[row : row + n])
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
