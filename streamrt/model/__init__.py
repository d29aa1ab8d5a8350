"""The KimiLinear forward (Kimi K3 / K3.1 Pro), written against a Backend of ops.

Public API:
    KimiLinearForCausalLM(cfg, backend=be, float_experts=False)   be: a Backend (backends/base.py)
        .forward_steps(input_ids, cache=None, last_only=False)  generator: yields ExpertRequest,
                                                                 returns logits fp32; its driver
                                                                 may .bind(Forward(graphs, step_hint))
        .forward(input_ids, cache=None, provider=None)         the same, driven by run_sync
        .new_cache(batch, device)                               -> ModelCache
    run_sync(gen, provider) -> logits;  logits_hash(logits) -> str
    ExpertRequest(layer, ids [N, k], weights [N, k], hidden [N, D]); ModelCache
    select_topk(scores, k)  (streamrt/ops.py)
Loading a tree into a model, with its expert providers, is `streamrt/loader.py`'s: the model
knows neither trees nor backends beyond the Backend protocol.
"""

from streamrt.model.cache import ModelCache
from streamrt.model.model import (
    Forward,
    KimiLinearForCausalLM,
    dense_state_dict,
    export_float_experts,
    logits_hash,
    run_sync,
)
from streamrt.model.moe import ExpertRequest
from streamrt.ops import select_topk

__all__ = [
    "ExpertRequest",
    "Forward",
    "KimiLinearForCausalLM",
    "ModelCache",
    "dense_state_dict",
    "export_float_experts",
    "logits_hash",
    "run_sync",
    "select_topk",
]
