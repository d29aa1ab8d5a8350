"""Prefill + decode: batched generation with greedy or seeded temperature / top-p sampling.

Each prompt is prefilled on its own (so a row's arithmetic never depends on its batch
companions), the per-sequence caches are stacked, and the batch decodes one token per
row per step with row-wise ops. Rows stop at a stop token or `max_new_tokens`; finished
rows leave the batch. How a forward is driven is pluggable: `runner(gen) -> logits`
(default: `run_sync(gen, provider)`), so the asyncio scheduler can drive the same loop.
"""

from __future__ import annotations

import math

import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterable, Sequence

import torch
from torch import Tensor

from streamrt.errors import StreamrtError
from streamrt.model import ModelCache, logits_hash, run_sync  # noqa: F401  (re-exported)
from streamrt.model.model import ExpertProvider, ForwardSteps, KimiLinearForCausalLM
from streamrt.model.prefix_cache import PrefixCache, prefill_steps, resume_align

Runner = Callable[[ForwardSteps], Tensor]
TokenCallback = Callable[..., None]  # on_token(token) for one prompt, on_token(row, token) for a batch


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per row (a stop token, if hit, is the last entry)
    finish_reasons: list[str]  # "stop" or "length"
    prefill_logits: Tensor  # [B, V] fp32: the last prompt position of each row
    prefill_hashes: list[str]  # logits_hash of each row's prefill_logits
    step_hashes: list[list[str]] = field(default_factory=list)  # per row, per decode step (hash_steps=True)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    cached_tokens: list[int] = field(default_factory=list)  # per row, prompt tokens resumed from the prefix cache

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def stop(self) -> str:
        """Finish reason of the first row ("stop" or "length"): the single-prompt answer."""
        return self.finish_reasons[0]

    @property
    def decode_tokens_per_s(self) -> float:
        n = sum(max(0, len(t) - 1) for t in self.tokens)
        return n / self.decode_s if self.decode_s > 0 else 0.0


def apply_penalties(logits: Tensor, generated: Sequence[int], presence: float, frequency: float,
                    repetition: float = 1.0, prompt: Sequence[int] = ()) -> Tensor:
    """The penalties in vLLM's order. repetition (vLLM's repetition_penalty, llama-server's
    repeat_penalty over the whole context): the logit of every token in prompt or generated is
    divided by it when positive, multiplied by it otherwise. Then OpenAI's presence and frequency
    penalties over the generated tokens only: logits[j] - frequency * count_j - presence * (count_j > 0).
    Unchanged when repetition is 1 and both others are 0."""
    if repetition != 1.0 and (prompt or generated):
        seen = torch.tensor(sorted(set(prompt) | set(generated)), dtype=torch.int64, device=logits.device)
        logits = logits.float().clone()
        x = logits[seen]
        logits[seen] = torch.where(x > 0, x / repetition, x * repetition)
    if not generated or (presence == 0 and frequency == 0):
        return logits
    V = logits.shape[-1]
    counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=V)[:V].to(logits.device)
    return logits.float() - frequency * counts - presence * (counts > 0)


def sampling_probs(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                   min_p: float = 0.0) -> Tensor | None:
    """The distribution a token is drawn from, fp64 [V] on the CPU, as vLLM builds it: softmax of
    logits / temperature; min_p drops tokens below min_p * the largest probability; top_k (<= 0:
    off) keeps the k most probable; top_p keeps the smallest prefix, by probability, whose mass
    reaches top_p; each filter renormalises. None when the temperature is 0 or so small that the
    scaled logits overflow: the draw is the argmax then."""
    if temperature <= 0:
        return None
    scaled = logits.detach().cpu().double() / temperature  # CPU: device-independent draws
    if not math.isfinite(float(scaled.max())):
        return None
    probs = torch.softmax(scaled, dim=-1)
    if min_p > 0:
        probs = torch.where(probs < min_p * probs.max(), 0.0, probs)
        probs = probs / probs.sum()
    V = probs.numel()
    if 0 < top_k < V or top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        if 0 < top_k < V:
            sorted_p, order = sorted_p[:top_k], order[:top_k]
            sorted_p = sorted_p / sorted_p.sum()
        if top_p < 1.0:
            keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p  # the smallest prefix reaching top_p (>= 1 token)
            sorted_p, order = sorted_p[keep], order[keep]
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return probs / probs.sum()


def sample(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None,
           top_k: int = 0, min_p: float = 0.0) -> int:
    """One token from logits [V]: argmax (first max) when temperature == 0, else a draw from
    `sampling_probs`."""
    probs = sampling_probs(logits, temperature, top_p, top_k, min_p)
    if probs is None:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(
    model: KimiLinearForCausalLM,
    prompts: Sequence[Sequence[int]] | Sequence[int],
    *,
    on_token: TokenCallback | None = None,
    **kw,
) -> GenerationResult:
    """Generate for a batch of prompts (lists of token ids; lengths may differ).

    `prompts` is one list of ids or a list of them. on_token is called for every generated
    token, in order: on_token(id) for a single prompt, on_token(row, id) for a batch. The
    other keywords are `generate_tokens`'s.
    """
    single = _as_batch(prompts)[1]
    steps = generate_tokens(model, prompts, **kw)
    while True:
        try:
            row, tok = next(steps)
        except StopIteration as done:
            return done.value
        if on_token is not None:
            on_token(tok) if single else on_token(row, tok)


def generate_tokens(
    model: KimiLinearForCausalLM,
    prompts: Sequence[Sequence[int]] | Sequence[int],
    *,
    provider: ExpertProvider | None = None,
    runner: Runner | None = None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    seed: int = 0,
    stop_ids: Iterable[int] | None = None,
    hash_steps: bool = False,
    prefill_chunk: int | None = None,
    max_context: int | None = None,
    prefix_cache: PrefixCache | None = None,
) -> Generator[tuple[int, int], None, GenerationResult]:
    """`generate` as an iterator: yields (row, token) as each token is drawn and returns the
    GenerationResult (StopIteration.value). Closing it early stops between two forwards.

    stop_ids default to the config's eos_token_id. Sampling is seeded per row (seed, row), so
    a row's samples do not depend on the batch. prefill_chunk: tokens per prefill chunk
    (default the model's, else chosen from free memory; the logits do not depend on it).
    top_k, min_p, repetition_penalty: as vLLM's (see `sampling_probs`, `apply_penalties`).
    max_context: a row stops ("length") once prompt + generated tokens reach it; a prompt
    longer than it is an error (the caller truncates or refuses first). prefix_cache: a row
    resumes from its longest cached prefix and leaves snapshots (model/prefix_cache.py; the
    logits do not depend on it).
    """
    prompts, _ = _as_batch(prompts)
    _check_request(prompts, max_new_tokens, top_p, max_context, min_p, repetition_penalty)
    runner = runner or (lambda gen: run_sync(gen, provider))
    rows = _Rows([len(p) for p in prompts], max_new_tokens, max_context,
                 set(stop_ids) if stop_ids is not None else {model.config.eos_token_id})
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + row) for row in range(len(prompts))]

    t0 = time.perf_counter()
    caches, prefill_logits, cached = _prefill(model, prompts, runner, prefill_chunk, prefix_cache)
    t1 = time.perf_counter()
    cache = ModelCache.stack(caches) if len(prompts) > 1 else caches[0]

    def draw(row: int, logits: Tensor) -> int:
        logits = apply_penalties(logits, rows.tokens[row], 0.0, 0.0, repetition_penalty, prompts[row])
        return sample(logits, temperature, top_p, gens[row], top_k, min_p)

    steps = yield from _decode(model, runner, cache, prefill_logits, rows, draw, hash_steps)
    t2 = time.perf_counter()
    return GenerationResult(
        tokens=rows.tokens,
        finish_reasons=rows.reasons,
        prefill_logits=prefill_logits,
        prefill_hashes=[logits_hash(l) for l in prefill_logits],
        step_hashes=rows.step_hashes,
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        decode_steps=steps,
        cached_tokens=cached,
    )


def _as_batch(prompts: Sequence[Sequence[int]] | Sequence[int] | Tensor) -> tuple[list[list[int]], bool]:
    """(a list of prompts, whether one bare prompt was given)."""
    if isinstance(prompts, Tensor):
        prompts = prompts.tolist()
    single = len(prompts) > 0 and isinstance(prompts[0], int)
    if single:
        prompts = [prompts]
    return [list(p) for p in prompts], single


def _check_request(prompts: list[list[int]], max_new_tokens: int, top_p: float, max_context: int | None,
                   min_p: float = 0.0, repetition_penalty: float = 1.0) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise StreamrtError("generate: every prompt needs at least one token")
    if max_new_tokens < 1:
        raise StreamrtError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 < top_p <= 1:
        raise StreamrtError(f"generate: top_p must be in (0, 1], got {top_p}")
    if not 0 <= min_p <= 1 or not repetition_penalty > 0:
        raise StreamrtError(f"generate: min_p must be in [0, 1] and repetition_penalty > 0, got {min_p}, "
                            f"{repetition_penalty}")
    if max_context is not None and max(len(p) for p in prompts) > max_context:
        raise StreamrtError(f"generate: a prompt of {max(len(p) for p in prompts)} tokens exceeds the context "
                            f"of {max_context}")


def _prefill(
    model: KimiLinearForCausalLM, prompts: list[list[int]], runner: Runner, prefill_chunk: int | None,
    prefix: PrefixCache | None = None,
) -> tuple[list[ModelCache], Tensor, list[int]]:
    """Each prompt prefilled on its own, past its longest cached prefix: (its cache, the logits of
    its last position, the tokens resumed from the prefix cache) per row."""
    device = model.lm_head.weight.device
    prefix = prefix if prefix is not None and prefix.enabled else None
    caches, last, cached = [], [], []
    stride = 0 if prefix is None else model.prefill_chunk_tokens(prefill_chunk, device)
    align = resume_align(model, stride)
    with torch.no_grad():
        for p in prompts:
            if prefix is None:  # one forward over the whole prompt
                cache, start = model.new_cache(1, device), 0
                steps = model.forward_steps(torch.tensor([p], device=device), cache, last_only=True,
                                            prefill_chunk=prefill_chunk)
            else:
                snap = prefix.lookup(p, align)
                cache = snap.restore(device) if snap is not None else model.new_cache(1, device)
                start = cache.lengths[0]
                stops = PrefixCache.marks(start, len(p), stride)
                steps = prefill_steps(model, p, cache, stops, prefix, prefill_chunk, align)
            logits = runner(steps)  # [1, 1, V]
            caches.append(cache)
            last.append(logits[0, 0].float())
            cached.append(start)
    return caches, torch.stack(last), cached  # [B, V]


class _Rows:
    """The decode loop's bookkeeping per original row: its tokens, why it stopped, its step hashes."""

    def __init__(self, prompt_lens: list[int], max_new_tokens: int, max_context: int | None, stops: set[int]):
        B = len(prompt_lens)
        self.prompt_lens, self.max_new_tokens = prompt_lens, max_new_tokens
        self.max_context, self.stops = max_context, stops
        self.tokens: list[list[int]] = [[] for _ in range(B)]
        self.reasons = ["length"] * B
        self.step_hashes: list[list[str]] = [[] for _ in range(B)]
        self.active = list(range(B))  # original row of each cache row

    def continues(self, row: int, tok: int) -> bool:
        """After `tok` was appended: False once the row hit a stop token, its budget or the context."""
        if tok in self.stops:
            self.reasons[row] = "stop"
            return False
        n = len(self.tokens[row])
        return n < self.max_new_tokens and (self.max_context is None or self.prompt_lens[row] + n < self.max_context)


def _decode(
    model: KimiLinearForCausalLM,
    runner: Runner,
    cache: ModelCache,
    logits: Tensor,
    rows: _Rows,
    draw: Callable[[int, Tensor], int],
    hash_steps: bool,
) -> Generator[tuple[int, int], None, int]:
    """Sample every running row (yielding (row, token)), let finished rows leave the batch, one
    batched forward for the rest; until no row runs. Returns the number of decode forwards.
    Grad mode is off only around the forward, never across a yield (the caller's code runs there)."""
    device = model.lm_head.weight.device
    steps = 0
    while True:
        still = []
        for i, row in enumerate(rows.active):
            tok = draw(row, logits[i])
            rows.tokens[row].append(tok)
            yield row, tok
            if rows.continues(row, tok):
                still.append(i)
        if not still:
            return steps
        if len(still) < len(rows.active):
            cache = cache.select(still)
            rows.active = [rows.active[i] for i in still]
        ids = torch.tensor([[rows.tokens[row][-1]] for row in rows.active], device=device)  # [B', 1]
        with torch.no_grad():
            logits = runner(model.forward_steps(ids, cache))[:, 0].float()  # [B', V]
        steps += 1
        if hash_steps:
            for i, row in enumerate(rows.active):
                rows.step_hashes[row].append(logits_hash(logits[i]))
