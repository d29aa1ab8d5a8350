"""The KimiLinear forward (Kimi K3 / K3.1 Pro), one module per block, in paper order.

Module paths equal the checkpoint's tensor names minus `language_model.`, so
`model.load_state_dict(tree.dense_state_dict(), assign=True)` loads a tree. Routed
experts are not parameters (inference): the forward is a generator that yields one
`ExpertRequest` per MoE layer and is sent the experts' NVFP4 weights (docs/CONTRACTS.md,
"Model <-> store"). Axis legend: B sequences, T new tokens per sequence, N = B*T rows,
D hidden, V vocabulary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Generator as GeneratorABC
from dataclasses import dataclass
from typing import Callable, Generator, Mapping, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from streamrt.backends.base import Backend
from streamrt.errors import StreamrtError
from streamrt.expert_weights import ExpertWeights
from streamrt.model.attnres import attn_res
from streamrt.model.cache import ModelCache, Step
from streamrt.model.kda import KimiDeltaAttention
from streamrt.model.layers import GLUMLP, RMSNorm, act_betas
from streamrt.model.mla import KimiMLAAttention
from streamrt.model.moe import ExpertRequest, LatentMoE
from streamrt.model.stationary import stationary_prefill

ExpertProvider = Callable[[ExpertRequest], Mapping[int, ExpertWeights]]
ForwardSteps = Generator[ExpertRequest, Mapping[int, ExpertWeights], Tensor]

PREFILL_CHUNK_MIN, PREFILL_CHUNK_MAX = 64, 4096


class LayerWeights(Protocol):
    """Where a layer's dense weights are while it computes. The forward calls `acquire(l)` before
    layer l and `release(l)` once its compute is queued; `prefetch(l)` is for the scheduler (layer
    l's weights are certainly needed next). The runtime's dense streaming (runtime/dense_stream.py)
    copies streamed layers into device buffers there; timing only, never numbers."""

    def acquire(self, layer: int) -> None: ...
    def release(self, layer: int) -> None: ...
    def prefetch(self, layer: int) -> None: ...


class ResidentWeights:
    """Every layer's weights stay where they were loaded: nothing to do."""

    def acquire(self, layer: int) -> None:
        pass

    def release(self, layer: int) -> None:
        pass

    def prefetch(self, layer: int) -> None:
        pass


RESIDENT = ResidentWeights()


@dataclass
class Forward:
    """What the driver of a model's forwards gives them (the streaming runtime owns one): decode
    steps' CUDA graphs, and a hint called with a decode step's embeddings [N, D] before its first
    layer (the runtime stages the first MoE layer's likely experts then). Timing only, never
    numbers. `graphs.steps(ids, cache, last_only, step_hint)` is a decode step's forward
    generator: the whole step replayed (runtime/decode_graphs.py) or its stretches between
    routers (runtime/segment_graphs.py); None: op by op."""

    graphs: object | None = None
    step_hint: Callable[[Tensor], None] | None = None


PLAIN = Forward()


class ForwardPass(GeneratorABC):
    """One forward as a generator (yields ExpertRequest, is sent the experts, returns logits),
    started on first use. Until then its driver may `bind` a `Forward` to it."""

    def __init__(self, start: Callable[[Forward], ForwardSteps]) -> None:
        self._start, self._forward, self._gen = start, PLAIN, None

    def bind(self, forward: Forward) -> None:
        assert self._gen is None, "a forward is bound before it starts"
        self._forward = forward

    def send(self, value):
        if self._gen is None:
            self._gen = self._start(self._forward)
        return self._gen.send(value)

    def throw(self, typ, val=None, tb=None):
        if self._gen is None:
            self._gen = self._start(self._forward)
        return self._gen.throw(typ, val, tb) if val is not None or tb is not None else self._gen.throw(typ)

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()


def _free_bytes(device: torch.device) -> int:
    """Free memory where the activations live: the device's (CUDA) or MemAvailable (host)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def default_prefill_chunk(cfg, device) -> int:
    """Tokens per prefill chunk when --prefill-chunk is not given: a quarter of free memory over
    a chunk row's live fp32 activations (a generous per-layer bound), in [64, 4096], a multiple
    of 64. Attention buffers do not depend on it (fixed query tiles x key blocks)."""
    widths = (
        cfg.hidden_size * (8 + len(cfg.attnres_block_starts)),
        6 * max(cfg.kda_proj_dim, cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)),
        4 * max(cfg.intermediate_size, cfg.shared_intermediate_size or 0),
        (cfg.experts_per_token * (3 * cfg.moe_intermediate_size + 2 * cfg.routed_expert_hidden_size)
         if cfg.num_experts else 0),
    )
    per_row = 4 * sum(widths) + 4 * (cfg.num_experts or 0)
    n = _free_bytes(torch.device(device)) // 4 // max(1, per_row)
    return int(max(PREFILL_CHUNK_MIN, min(PREFILL_CHUNK_MAX, n // 64 * 64)))


class DecoderLayer(nn.Module):
    """AttnRes mix -> token mixer (KDA or MLA) -> AttnRes mix -> FFN (dense or latent MoE)."""

    def __init__(self, cfg, i: int, float_experts: bool = False):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx = i
        self.block_start = i in cfg.attnres_block_starts
        self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
        self.self_attention_res_norm = RMSNorm(D, eps)
        self.mlp_res_proj = nn.Linear(D, 1, bias=False)
        self.mlp_res_norm = RMSNorm(D, eps)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.self_attn = KimiMLAAttention(cfg, i) if cfg.layer_kind(i) == "mla" else KimiDeltaAttention(cfg, i)
        if cfg.is_moe(i):
            self.block_sparse_moe = LatentMoE(cfg, i, float_experts)
        else:
            self.mlp = GLUMLP(D, cfg.intermediate_size, *act_betas(cfg))

    def forward_steps(self, partial: Tensor, blocks: list[Tensor], step: Step):
        """partial [N, D] in-block running sum, blocks: completed sources -> (partial, blocks)."""
        partial, blocks, h = self.mix_and_attend(partial, blocks, step)
        if hasattr(self, "block_sparse_moe"):
            partial = yield from self.block_sparse_moe.forward_steps(h, step.be, (partial,))
        else:
            partial = self.mlp(h, step.be, (partial,))
        return partial, blocks

    def mix_and_attend(self, partial: Tensor, blocks: list[Tensor], step: Step) -> tuple[Tensor, list[Tensor], Tensor]:
        """Everything before the FFN: -> (partial [N, D] with the token mixer's output added,
        blocks, h [N, D] the FFN input)."""
        be = step.be
        cache = step.cache.layers[self.layer_idx] if step.cache is not None else None
        # the mixes and the norms after them are one op each
        if blocks:
            x = attn_res(partial, blocks, self.self_attention_res_proj, self.self_attention_res_norm, be,
                         self.input_layernorm)
        else:
            x = self.input_layernorm(partial, be)
        if self.block_start:  # the finished block (or the embedding) becomes a source
            blocks, partial = blocks + [partial], None
        # the residual adds ride on the output projections' GEMVs: partial + a, partial + m
        partial = self.self_attn(x, step, cache, () if partial is None else (partial,))  # [N, D]
        h = attn_res(partial, blocks, self.mlp_res_proj, self.mlp_res_norm, be, self.post_attention_layernorm)
        return partial, blocks, h


class TokenEmbedding(nn.Embedding):
    """nn.Embedding that leaves a meta-device table uninitialised: the loader builds the model on
    the meta device and assigns the checkpoint's table, and `normal_` on a meta tensor imports
    torch._dynamo (about 1.5 s of every process start)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class KimiLinearModel(nn.Module):
    def __init__(self, cfg, float_experts: bool = False):
        super().__init__()
        D = cfg.hidden_size
        self.embed_tokens = TokenEmbedding(cfg.vocab_size, D)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, float_experts) for i in range(cfg.num_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(D, 1, bias=False)
        self.output_attn_res_norm = RMSNorm(D, cfg.rms_norm_eps)


class KimiLinearForCausalLM(nn.Module):
    """The language model, computed with the ops of `backend` (the caller picks it: the torch
    reference, or NVRTC kernels). `float_experts=True` gives trainable float routed experts."""

    def __init__(self, cfg, *, backend: Backend, float_experts: bool = False):
        super().__init__()
        self.config = cfg
        self.backend = backend
        # Tokens per prefill chunk on a cache (None: `default_prefill_chunk` from free memory).
        # Timing and memory only: a position's logits do not depend on it on the torch backend.
        self.prefill_chunk: int | None = None
        # A prompt longer than one chunk on a cache: "layer" runs each layer over the whole prompt
        # (model/stationary.py: each MoE layer's experts fetched once), "chunk" each chunk through
        # every layer. Bit-identical logits; link bytes and timing differ.
        self.prefill_order: str = "layer"
        # Around every layer: acquire / release its dense weights (RESIDENT: they never move).
        self.layer_weights: LayerWeights = RESIDENT
        self.model = KimiLinearModel(cfg, float_experts)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def float_experts(self) -> bool:
        return any(getattr(l, "block_sparse_moe", None) is not None and l.block_sparse_moe.experts is not None
                   for l in self.model.layers)

    def new_cache(self, batch: int = 1, device=None) -> ModelCache:
        return ModelCache.empty(self.config, batch, device or self.lm_head.weight.device)

    def forward_steps(
        self, input_ids: Tensor, cache: ModelCache | None = None, *, last_only: bool = False,
        prefill_chunk: int | None = None,
    ) -> ForwardPass:
        """input_ids [T] or [B, T] -> logits [T, V] / [B, T, V] fp32 ([.., 1, V] if last_only).

        With a cache: T == 1 decodes (rows may sit at different lengths); T > 1 is a
        prefill continuing from the cache (rows must share one length), run in chunks of
        `prefill_chunk` tokens (default `self.prefill_chunk`, else from free memory): in
        `self.prefill_order` "layer", one ExpertRequest per MoE layer for the whole prompt; in
        "chunk", one per MoE layer per chunk. Without a cache: the full parallel forward
        (training, or a reference). A decode step runs as its driver's bound `Forward` says.
        """
        return ForwardPass(lambda forward: self._forward_steps(input_ids, cache, last_only, prefill_chunk, forward))

    def _forward_steps(self, input_ids: Tensor, cache: ModelCache | None, last_only: bool, prefill_chunk: int | None,
                       forward: Forward) -> ForwardSteps:
        cfg = self.config
        ids = torch.as_tensor(input_ids)
        squeeze = ids.dim() == 1
        ids = ids[None] if squeeze else ids
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise StreamrtError(f"input_ids must be an integer tensor [T] or [B, T], got {tuple(ids.shape)} "
                                f"{ids.dtype}")
        B, T = ids.shape
        if T == 0:
            raise StreamrtError("input_ids is empty")
        lo, hi = int(ids.min()), int(ids.max())  # where the ids are (host ids: no device synchronize)
        if lo < 0 or hi >= cfg.vocab_size:
            raise StreamrtError(f"token id out of range [0, {cfg.vocab_size}): min {lo}, max {hi}")
        ids = ids.to(self.lm_head.weight.device)
        if cache is not None:
            if cache.batch != B:
                raise StreamrtError(f"cache holds {cache.batch} sequences but input_ids has {B}")
            if T > 1 and len(set(cache.lengths)) > 1:
                raise StreamrtError(f"a prefill on a cache needs rows of one length, got lengths {cache.lengths}")
        if cache is not None and T == 1 and forward.graphs is not None:
            logits = yield from forward.graphs.steps(ids, cache, last_only, forward.step_hint)  # replayed CUDA graphs
            return logits[0] if squeeze else logits
        if cache is not None and T > 1:
            C = self.prefill_chunk_tokens(prefill_chunk, ids.device)
            if C < 1:
                raise StreamrtError(f"prefill chunk must be >= 1 token, got {C}")
            if T > C and self.prefill_order == "layer":
                logits = yield from stationary_prefill(self, ids, cache, C, last_only)
                return logits[0] if squeeze else logits
            if T > C:
                outs = []
                for t0 in range(0, T, C):
                    out = yield from self.forward_chunk(ids[:, t0 : t0 + C], cache, last_only)
                    outs.append(out)
                logits = outs[-1] if last_only else torch.cat(outs, dim=1)  # [B, T or 1, V]
                return logits[0] if squeeze else logits
        logits = yield from self.forward_chunk(ids, cache, last_only, forward.step_hint)
        return logits[0] if squeeze else logits

    def forward_chunk(self, ids: Tensor, cache: ModelCache | None, last_only: bool,
                      step_hint: Callable[[Tensor], None] | None = None) -> ForwardSteps:
        """One forward over ids [B, T] on the model's device, already checked (one prefill
        chunk, a decode step, or the cache-less form) -> logits [B, T or 1, V]. `step_hint`:
        called with a decode step's embeddings (`Forward`)."""
        be = self.backend
        B, T = ids.shape
        decode = cache is not None and T == 1
        if not decode and hasattr(be, "for_prefill"):
            be = be.for_prefill()  # fixed-tile products: chunk-invariant rows
        step = Step(be=be, batch=B, seqlen=T, cache=cache, start=cache.lengths[0] if cache is not None else 0)

        h = self.embed(ids)
        if step_hint is not None and cache is not None and T == 1:
            step_hint(h)
        partial, blocks, weights = h, [], self.layer_weights
        for layer in self.model.layers:
            weights.acquire(layer.layer_idx)  # streamed: the compute waits for its copy (GPU-side)
            try:
                partial, blocks = yield from layer.forward_steps(partial, blocks, step)
            finally:  # also when the forward is closed or fails inside the layer
                weights.release(layer.layer_idx)  # its buffer may be refilled once this compute ran
        if cache is not None:
            cache.advance(T)
        return self.head(partial, blocks, be, B, T, last_only)

    def head(self, partial: Tensor, blocks: list[Tensor], be, B: int, T: int, last_only: bool) -> Tensor:
        """After the last layer: partial [B*T, D] and the block sources -> logits [B, T or 1, V]
        (the final AttnRes mix, norm and lm_head; with `last_only` each row's last position)."""
        if last_only:  # every op below is row-wise
            rows = torch.arange(B, device=partial.device) * T + (T - 1)
            partial, blocks, T = partial[rows], [b[rows] for b in blocks], 1
        h = attn_res(partial, blocks, self.model.output_attn_res_proj, self.model.output_attn_res_norm, be,
                     self.model.norm)
        logits = be.linear(h, self.lm_head.weight)  # [N, V] fp32
        return logits.view(B, T, -1)

    def prefill_chunk_tokens(self, requested: int | None, device) -> int:
        """Tokens per prefill chunk on a cache: `requested`, else `self.prefill_chunk`, else
        `default_prefill_chunk` from `device`'s free memory."""
        return int(requested or self.prefill_chunk or default_prefill_chunk(self.config, device))

    def embed(self, ids: Tensor) -> Tensor:
        """ids [B, T] on the model's device -> their embeddings [B*T, D] fp32 there."""
        emb = self.model.embed_tokens.weight  # on the host when dense layers stream (placement.py)
        return F.embedding(ids.reshape(-1).to(emb.device), emb).to(ids.device).float()

    def forward(
        self, input_ids: Tensor, cache: ModelCache | None = None, provider: ExpertProvider | None = None, *,
        last_only: bool = False, prefill_chunk: int | None = None,
    ) -> Tensor:
        gen = self.forward_steps(input_ids, cache, last_only=last_only, prefill_chunk=prefill_chunk)
        return run_sync(gen, provider)


def run_sync(gen: ForwardSteps, provider: ExpertProvider | None) -> Tensor:
    """Drive a forward generator to completion, answering each ExpertRequest with provider(req)."""
    try:
        req = next(gen)
        while True:
            if provider is None:
                gen.close()
                raise StreamrtError(f"layer {req.layer} requests routed experts but no expert provider was given")
            req = gen.send(provider(req))
    except StopIteration as stop:
        return stop.value


def logits_hash(logits: Tensor) -> str:
    """First 16 hex digits of sha256 over the last position's float32 logits bytes."""
    last = logits.detach().reshape(-1, logits.shape[-1])[-1].float().cpu().contiguous()
    return hashlib.sha256(last.numpy().tobytes()).hexdigest()[:16]


def dense_state_dict(model: KimiLinearForCausalLM) -> dict[str, Tensor]:
    """The state dict a converted tree holds: everything except float routed experts."""
    return {k: v for k, v in model.state_dict().items() if ".block_sparse_moe.experts." not in k}


def export_float_experts(model: KimiLinearForCausalLM) -> dict[tuple[int, int], dict[str, Tensor]]:
    """Float routed experts of a training-mode model: {(layer, expert): {"w1", "w2", "w3"}}
    as detached fp32 CPU tensors (w1 gate [I, Dl], w3 up [I, Dl], w2 down [Dl, I])."""
    out = {}
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is None or moe.experts is None:
            continue
        for e, ex in enumerate(moe.experts):
            out[(layer.layer_idx, e)] = {n: getattr(ex, n).weight.detach().float().cpu().clone()
                                         for n in ("w1", "w2", "w3")}
    if not out:
        raise StreamrtError("model has no float routed experts (build it with float_experts=True)")
    return out
