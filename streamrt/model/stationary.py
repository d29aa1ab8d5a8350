"""Expert-stationary prefill: a prompt longer than one chunk runs layer by layer.

Chunk-major prefill walks every layer for one chunk, then the next chunk, so each chunk asks for
its MoE layers' routed experts again: at the real fan-out (896 experts, top-16) a few hundred
tokens route nearly every expert, and every chunk is one more pass over the whole bank. Here each
layer runs for the whole prompt before the next:

    for each layer:
        each chunk in order: AttnRes mix, token mixer, AttnRes mix    (KDA state, MLA latent and
                                                                       indexer caches carry across
                                                                       chunks exactly as chunk-major)
        MoE layer: every chunk's router, then ONE ExpertRequest for the whole prompt's rows
                   (its union of experts fetched once), then each chunk's routed sum and
                   combine with that answer, in chunk order

Every op is the same call on the same chunk's rows as in chunk-major order (the routed sum of a
chunk takes the same experts' weights, only fetched once), so the logits are bit-identical to it.

Memory: the whole prompt's activations between layers (each chunk's in-block running sum, its
AttnRes block sources, and at a MoE layer its FFN input, latent and routing) stay on the model's
device, all [N, D]-sized or smaller: linear in the prompt. The request's width is the prompt's
union, at most a layer's experts; the runtime serves one wider than the device slots as it serves
a wide chunk (the overflow in transient device buffers), so each expert crosses the link once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from streamrt.expert_weights import answer_for_layer
from streamrt.model.cache import ModelCache, Step
from streamrt.model.moe import ExpertRequest

def stationary_prefill(model, ids: Tensor, cache: ModelCache, chunk: int, last_only: bool):
    """ids [B, T] (checked, on the model's device, T > chunk) continuing `cache` -> logits
    [B, T or 1, V]; yields one ExpertRequest per MoE layer for the whole prompt."""
    be = model.backend
    if hasattr(be, "for_prefill"):
        be = be.for_prefill()  # fixed-tile products, as each chunk-major chunk runs
    B, T = ids.shape
    s0 = cache.lengths[0]
    spans = [(t0, min(T, t0 + chunk)) for t0 in range(0, T, chunk)]
    steps = [Step(be=be, batch=B, seqlen=t1 - t0, cache=cache, start=s0 + t0) for t0, t1 in spans]
    states = [(model.embed(ids[:, t0:t1]), []) for t0, t1 in spans]  # (partial [N_c, D], blocks) per chunk
    weights = model.layer_weights
    for layer in model.model.layers:
        weights.acquire(layer.layer_idx)
        try:
            states = yield from _layer(layer, states, steps)
        finally:
            weights.release(layer.layer_idx)
    cache.advance(T)
    outs = [model.head(partial, blocks, be, B, t1 - t0, last_only)
            for (partial, blocks), (t0, t1) in zip(states[-1:] if last_only else states,
                                                    spans[-1:] if last_only else spans)]
    return outs[-1] if last_only else torch.cat(outs, dim=1)


def _layer(layer, states: list, steps: list[Step]):
    """One decoder layer over every chunk -> the chunks' (partial, blocks) after it."""
    mixed = []
    for step in steps:  # in chunk order; each chunk's input is dropped once mixed (memory)
        partial, blocks = states.pop(0)
        mixed.append(layer.mix_and_attend(partial, blocks, step))
    be = steps[0].be
    if not hasattr(layer, "block_sparse_moe"):
        return [(layer.mlp(h, be, (partial,)), blocks) for partial, blocks, h in mixed]
    outs = yield from _moe(layer.block_sparse_moe, [m[2] for m in mixed], [m[0] for m in mixed], be)
    return [(out, blocks) for out, (_, blocks, _) in zip(outs, mixed)]


def _moe(moe, hs: list[Tensor], residuals: list[Tensor], be):
    """A MoE layer over every chunk's FFN input hs[c] [N_c, D]: each chunk routed, one request for
    all their rows, then each chunk's routed sum and combine (+ residuals[c]) -> [N_c, D] each."""
    routed = [moe.route(h, be) for h in hs]  # (ids, w, z, shared gate / up) per chunk
    if moe.experts is not None:  # float experts (training form): nothing is fetched
        sums = [moe._float_expert_ffn(z, ids, w, be) for ids, w, z, _ in routed]
    else:
        ids = torch.cat([r[0] for r in routed])  # [N, k], chunk after chunk
        req = ExpertRequest(moe.layer_idx, ids, torch.cat([r[1] for r in routed]), torch.cat(hs))
        answer = yield req
        whole = answer_for_layer(answer, ids, moe.layer_idx)
        host_ids, sums, r0 = whole.host_ids, [], 0
        for c_ids, w, z, _ in routed:
            n = c_ids.shape[0]
            share = whole.with_ids(host_ids[r0 : r0 + n])  # this chunk's rows of the same experts
            sums.append(moe.routed_sum(z, w, share, be))
            r0 += n
        del req, whole
    return [moe.combine(u, r[3], be, (res,)) for u, r, res in zip(sums, routed, residuals)]
