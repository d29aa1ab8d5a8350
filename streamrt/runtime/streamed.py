"""`StreamedExperts`: the streaming runtime's answer to one `ExpertRequest`, views of device
slots whose copies the compute stream waits for one expert at a time."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from streamrt.expert_weights import ExpertWeights
from streamrt.trace import NullTracer


class StreamedExperts(Mapping):
    """The answer to one ExpertRequest: expert id -> ExpertWeights views of its device slot.
    Taking an expert makes the compute stream wait for that expert's copy (a GPU-side wait);
    listing the ids waits for nothing."""

    def __init__(self, device, views: dict[int, ExpertWeights], events: dict[int, object], tracer=None, layer=-1,
                 host_ids: torch.Tensor | None = None):
        self._device, self._views, self._events = device, views, events
        self._tracer, self._layer = tracer or NullTracer(), layer
        self.host_ids = host_ids  # the request's ids, already on the host: the model needs no second sync

    def __getitem__(self, e: int) -> ExpertWeights:
        ev = self._events.pop(e, None)
        if ev is not None:
            with self._tracer.span("stall", "wait", stream=self._device.compute_stream, layer=self._layer, expert=e):
                self._device.compute_wait(ev)
        return self._views[e]

    def pending(self, e: int) -> bool:
        """Whether taking `e` would make the compute stream wait (its copy is still queued), so a
        backend can queue the resident experts' work first."""
        return e in self._events

    def __iter__(self):
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)
