"""Staging predictor: guess layer l+1's experts while layer l computes.

Layer l+1's router (`block_sparse_moe.gate.weight` [E, D] and `e_score_correction_bias` [E])
applied to layer l's FFN input. The residual stream changes little from one layer to the next,
so the guess is usually close; the real router still decides, and a wrong guess costs only
traffic. The first MoE layer of a decode step has no MoE layer before it: its guess comes from
the step's token embeddings (`predict_first`), made while the dense layers compute. The
scheduler reports recall (`predicted_recall`).

A guess runs on the model's backend as the router itself does (`linear`, then `route`): on
nvrtc two launches a MoE layer, where torch ops took six (cast, GEMM, cast, sigmoid, add,
top-k), each beside the host's per-layer work of a streamed step.
"""

from __future__ import annotations

from typing import Mapping

from torch import Tensor


class Predictor:
    def __init__(
        self, routers: Mapping[int, tuple[Tensor, Tensor]], moe_layers: tuple[int, ...], k: int, backend
    ) -> None:
        self.routers = dict(routers)  # layer -> (weight [E, D], bias [E]) on the compute device
        self.k = k
        self.backend = backend
        self.next_layer = {a: b for a, b in zip(moe_layers, moe_layers[1:])}
        self.first_layer = moe_layers[0] if moe_layers and moe_layers[0] in self.routers else None

    @classmethod
    def from_model(cls, model) -> "Predictor":
        """Routers straight from the model's own (device-resident) gate parameters: no copy."""
        cfg = model.config
        routers = {}
        for layer in model.model.layers:
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None and hasattr(moe, "gate"):
                routers[layer.layer_idx] = (moe.gate.weight, moe.gate.e_score_correction_bias)
        return cls(routers, tuple(cfg.moe_layers), cfg.experts_per_token, model.backend)

    def target(self, layer: int) -> int | None:
        """The MoE layer a prediction made at `layer` is for."""
        nxt = self.next_layer.get(layer)
        return nxt if nxt in self.routers else None

    def predict(self, layer: int, hidden: Tensor) -> Tensor | None:
        """hidden [T, D] (layer's FFN input) -> predicted ids [T, k] of the next MoE layer, on the
        compute device (the caller brings them to the host together with the routed ids)."""
        nxt = self.target(layer)
        return None if nxt is None else self._topk(nxt, hidden)

    def predict_first(self, embeddings: Tensor) -> Tensor | None:
        """embeddings [T, D] of a decode step -> predicted ids [T, k] of the first MoE layer."""
        return None if self.first_layer is None else self._topk(self.first_layer, embeddings)

    def _topk(self, layer: int, hidden: Tensor) -> Tensor:
        """The k experts of highest sigmoid(logit) + bias for each row, most confident first:
        [T, k] int64 (a plain top-k over every expert, whatever the layer's grouping)."""
        w, b = self.routers[layer]
        return self.backend.route(self.backend.linear(hidden, w), b, self.k, False, 1.0)[0]
