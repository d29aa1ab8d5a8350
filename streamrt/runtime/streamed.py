"""`StreamedExperts`: the streaming runtime's answer to one `ExpertRequest`, views of device
slots whose copies the compute stream waits for one expert at a time."""

from __future__ import annotations

import torch

from streamrt.expert_weights import ExpertWeights, RoutedExperts
from streamrt.trace import NullTracer


class StreamedExperts(RoutedExperts):
    """RoutedExperts whose views are device slots. Taking an expert makes the compute stream
    wait for that expert's copy (a GPU-side wait), once; `pending`, `has` and the ids wait for
    nothing."""

    def __init__(self, device, views: dict[int, ExpertWeights], events: dict[int, object], tracer=None, layer=-1,
                 host_ids: torch.Tensor | None = None, unique: list[int] | None = None):
        if host_ids is None:  # (tests that build one by hand) the views' ids, one row
            host_ids = torch.tensor([sorted(views)], dtype=torch.int64)
        super().__init__(views, host_ids, unique, layer)
        self._device, self._events = device, events
        self._tracer = tracer or NullTracer()

    def take(self, e: int) -> ExpertWeights:
        ev = self._events.pop(e, None)
        if ev is not None:
            with self._tracer.span("stall", "wait", stream=self._device.compute_stream, layer=self.layer, expert=e):
                self._device.compute_wait(ev)
        return self._views[e]

    def pending(self, e: int) -> bool:
        """Whether taking `e` would make the compute stream wait (its copy is still queued), so a
        backend can queue the resident experts' work first."""
        return e in self._events
