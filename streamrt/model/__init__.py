"""The KimiLinear forward (Kimi K3 / K3.1 Pro), written against a Backend of ops.

Public API:
    KimiLinearForCausalLM(cfg, float_experts=False, backend=None)
        .forward_steps(input_ids, cache=None, last_only=False)  generator: yields ExpertRequest,
                                                                 returns logits fp32
        .forward(input_ids, cache=None, provider=None)         the same, driven by run_sync
        .new_cache(batch, device)                               -> ModelCache
    run_sync(gen, provider) -> logits;  logits_hash(logits) -> str
    ExpertRequest(layer, ids [N, k], weights [N, k], hidden [N, D]); ModelCache
    load_model(tree_or_path, device, dtype); DirectExpertProvider(tree); DictExpertProvider(experts)
    indexer.select_topk(scores, k)
"""

from streamrt.model.cache import ModelCache
from streamrt.model.indexer import select_topk
from streamrt.model.loader import DictExpertProvider, DirectExpertProvider, load_model, load_weights
from streamrt.model.model import (
    KimiLinearForCausalLM,
    dense_state_dict,
    export_float_experts,
    logits_hash,
    run_sync,
)
from streamrt.model.moe import ExpertRequest

__all__ = [
    "DictExpertProvider",
    "DirectExpertProvider",
    "ExpertRequest",
    "KimiLinearForCausalLM",
    "ModelCache",
    "dense_state_dict",
    "export_float_experts",
    "load_model",
    "load_weights",
    "logits_hash",
    "run_sync",
    "select_topk",
]
