"""What a prompt's prefill moves over the host->device link, by prefill order.

Chunk-major prefill runs every layer for one chunk of the prompt, then the next chunk, so each
chunk fetches its own routed experts again. Expert-stationary prefill runs one layer for the whole
prompt before the next, so each MoE layer fetches the union of the prompt's experts once. Under
even router popularity a token picks k of E experts; an expert is missed by n independent tokens
with probability (1 - k/E)^n, so n tokens route E * (1 - (1 - k/E)^n) distinct experts per layer.
Figures assume no expert starts in a device slot (experts in host RAM): the link's worst case.
"""

from __future__ import annotations


def expected_unique_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens route at one MoE layer, each choosing `top_k` of
    `num_experts` with even popularity."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def chunk_sizes(tokens: int, chunk: int) -> list[int]:
    """The prefill's chunks: full chunks of `chunk` tokens, then the remainder."""
    full, rest = divmod(tokens, chunk)
    return [chunk] * full + ([rest] if rest else [])


def prefill_link_bytes(cfg, expert_bytes: int, tokens: int, chunk: int, order: str) -> float:
    """Expected routed-expert bytes over the link for a prompt of `tokens` tokens run in chunks of
    `chunk` tokens (`order` "chunk": each chunk fetches its own union; "layer": the prompt's
    union once per MoE layer), every MoE layer, `expert_bytes` per expert file."""
    E, k = cfg.num_experts, cfg.experts_per_token
    parts = [tokens] if order == "layer" or tokens <= chunk else chunk_sizes(tokens, chunk)
    per_layer = sum(expected_unique_experts(E, k, n) for n in parts)
    return per_layer * len(cfg.moe_layers) * expert_bytes


def prefill_projection(cfg, expert_bytes: int, tokens: int, chunk: int, link_gbps: float) -> dict:
    """Both orders' link bytes for `tokens`, in banks (the whole routed store is one) and as a
    projected time to first token bounded by the link alone (bytes / link rate)."""
    bank = cfg.num_experts * len(cfg.moe_layers) * expert_bytes
    out = {"prompt_tokens": tokens, "prefill_chunk": chunk, "link_gbps": link_gbps, "bank_bytes": bank,
           "unique_experts_per_layer": expected_unique_experts(cfg.num_experts, cfg.experts_per_token, tokens)}
    for order, name in (("chunk", "chunk_major"), ("layer", "stationary")):
        b = prefill_link_bytes(cfg, expert_bytes, tokens, chunk, order)
        out[name] = {"link_bytes": b, "banks": b / bank if bank else 0.0, "ttft_link_s": b / (link_gbps * 1e9)}
    return out
