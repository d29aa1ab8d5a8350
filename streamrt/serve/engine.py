"""Continuous batching: one coroutine on the server's loop owns the decode batch.

Each turn of `Engine.run`, at a step boundary:
  1. drop   rows whose client went away or whose reply hit a stop string (`Job.cancel`), and
            waiting jobs cancelled before they got a row: the batch cache keeps the others
  2. admit  waiting jobs (FIFO) take prefill slots while the batch has free rows; each has
            its own 1-row cache, restored from the prefix cache's snapshot of its longest
            cached prefix when there is one (model/prefix_cache.py: only the tokens past it
            are prefilled, bit-identically), and goes in whole, or with `prefill_chunk` one chunk of that
            many tokens per boundary, so a long prompt is spread over several steps; at most
            `prefill_tokens` prompt tokens go in per boundary (the oldest piece always does).
            A waiting job that shares a longer prefix with a prefill ahead of it than the
            cache holds (clients sharing a system prompt, arriving together) follows it: the
            leader gets a snapshot mark where the shared part ends, and the follower keeps its
            place in the queue (jobs behind it go on) until the leader has passed the mark,
            then resumes there and prefills only its own suffix.
            (Chunks must be multiples of the KDA chunk, 64, and are exact only on a model
            whose chunked prefill is bit-identical to the one-shot one: default off.)
  3. step   one forward for everything at this boundary: a decode step of every running row
            and the next piece of every prefill, driven in lockstep so each layer's experts
            are fetched once for all of them (the runner's `step`). Each row samples its
            token and hands it to its client's queue; rows that stop (a stop token or their
            max_tokens) leave; a prefill that finished samples its first token and its cache
            is stacked onto the batch's. A piece ending at one of the prefill's snapshot
            marks (its last chunk boundary, its end) leaves a snapshot in the prefix cache.
  4. yield  to the loop, so the HTTP side reads requests and writes tokens

A row samples with its own generator seeded as `streamrt run --seed S` seeds row 0, so a
request's tokens do not depend on its batch companions; a row whose sampling fails ends
alone, its companions go on. The waiting queue is bounded: `submit` raises QueueFull (a 503
with Retry-After upstream) when `max_queue` jobs wait beyond the batch's free rows.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from streamrt.generate import apply_penalties, sample
from streamrt.model import ModelCache
from streamrt.model.prefix_cache import MIN_NEW, common_prefix

log = logging.getLogger("streamrt.serve")

# Tokens a waiting job must gain over what the prefix cache holds before it waits for a prefill
# ahead of it to leave the prefix they share: the new mark splits that prefill's piece (one
# more forward for it), so a share shorter than one KDA chunk is prefilled again instead.
MIN_SHARED = 64


class QueueFull(Exception):
    """The waiting queue holds max_queue jobs already."""


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (a stop token), "length" (max_tokens) or "cancelled" (Job.cancel)


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(eq=False)  # identity: a job is one request
class Job:
    """One request's generation: its prompt, sampling, and the queue its tokens go to."""

    ids: list[int]
    max_tokens: int
    stop_ids: frozenset[int]
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # token ids, then Finished | Failed
    tokens: list[int] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False
    finish_reason: str = ""  # set when `stream` ends
    cached_tokens: int = 0  # prompt tokens resumed from the prefix cache, set when the job is admitted
    followed: bool = False  # waited for a prefill ahead of it to leave their shared prefix (counted once)
    submitted: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        seed = self.seed if self.seed is not None else secrets.randbits(31)
        self.generator = torch.Generator().manual_seed(seed * 1_000_003)  # generate()'s row 0

    def cancel(self) -> None:
        """The client is gone (or needs no more tokens): the row is freed at the next boundary."""
        if not self.done:
            self.cancelled = True

    async def stream(self):
        """The generated token ids as they come; returns at the end, raises EngineError on failure."""
        while True:
            item = await self.out.get()
            if isinstance(item, int):
                yield item
            elif isinstance(item, Failed):
                raise EngineError(item.message)
            else:
                self.finish_reason = item.reason
                return


class EngineError(Exception):
    """A forward failed; the jobs of that step end with this message."""


class Engine:
    def __init__(self, runner, *, max_batch: int = 16, max_queue: int = 64, prefill_chunk: int = 0,
                 prefill_tokens: int = 4096, metrics=None, prefix_cache=None):
        self.runner = runner
        self.prefix = prefix_cache if prefix_cache is not None and prefix_cache.enabled else None
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prefill_chunk = prefill_chunk  # 0: a whole prompt per boundary
        self.prefill_tokens = prefill_tokens  # prompt tokens per step, beyond the first piece: bounds activations
        self.prefilling: list[_Prefill] = []
        self.metrics = metrics
        self.waiting: deque[Job] = deque()
        self.rows: list[Job] = []  # row i of self.cache is self.rows[i]
        self.cache: ModelCache | None = None
        self.steps = 0
        self._wake = asyncio.Event()
        self._stopping = False

    # ---- the HTTP side --------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        # jobs submitted since the last boundary sit in `waiting` even while rows are free for them
        free = max(self.max_batch - len(self.rows) - len(self.prefilling), 0)
        if len(self.waiting) >= self.max_queue + free:
            raise QueueFull(f"{len(self.waiting) - free} requests are waiting for a batch row already")
        self.waiting.append(job)
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    # ---- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        while not self._stopping:
            self._drop_cancelled()
            if not self.rows and not self.waiting and not self.prefilling:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._admit_waiting()
            await self._guarded(self._step(), [p.job for p in self.prefilling] + list(self.rows))
            await asyncio.sleep(0)
        for job in [p.job for p in self.prefilling] + list(self.rows) + list(self.waiting):
            self._fail(job, "server shutting down")

    async def _guarded(self, step, jobs: list[Job]) -> None:
        """Await a step; a failing forward ends its jobs with an error and resets the batch."""
        try:
            await step
        except Exception as exc:  # a model or runtime error must not kill the server
            log.exception("streamrt serve: forward failed")
            for job in set(jobs) | set(self.rows):
                self._fail(job, f"generation failed ({type(exc).__name__}: {exc})")
            self.rows, self.cache, self.prefilling = [], None, []

    async def _step(self) -> None:
        """One forward: the running rows' decode step and the next piece of the prefills (the
        oldest first, as many as `prefill_tokens` allows; the oldest always goes)."""
        going, pieces, total = [], [], 0
        for p in self.prefilling:
            piece = self._next_piece(p)
            if going and total + len(piece) > self.prefill_tokens:
                break
            going.append(p)
            pieces.append(piece)
            total += len(piece)
        last = [job.tokens[-1] for job in self.rows]
        t0 = time.perf_counter()
        work = [(piece, p.cache) for p, piece in zip(going, pieces)]
        decoded, prefilled = await self.runner.step(last, self.cache, work)
        seconds = time.perf_counter() - t0
        if self.rows:
            self.steps += 1
            if self.metrics is not None:
                self.metrics.step(len(self.rows))
            self._keep([i for i, job in enumerate(self.rows) if self._emit(job, decoded[i])])
        if going and self.metrics is not None:
            self.metrics.prefill(total, seconds)
        for p, piece, logits in zip(going, pieces, prefilled):
            p.done += len(piece)
            if p.done in p.stops:
                self.prefix.store(p.job.ids[: p.done], p.cache, self._resume_align())
            if p.done == len(p.job.ids):
                self._join(p, logits)
        self.prefilling = [p for p in self.prefilling if p.done < len(p.job.ids)]

    def _admit_waiting(self) -> None:
        """Waiting jobs take free rows in FIFO order. One that follows a prefill ahead of it
        (`_follows`, asked even while no row is free, so that the leader leaves the snapshot
        before the follower's row comes) keeps its place, and the jobs behind it go on."""
        held: deque[Job] = deque()
        for job in self.waiting:
            follows = self._follows(job)
            if follows and not job.followed:
                job.followed = True
                if self.metrics is not None:
                    self.metrics.follower()
            if follows or len(self.rows) + len(self.prefilling) >= self.max_batch:
                held.append(job)
            else:
                self.prefilling.append(self._admit(job))
        self.waiting = held

    def _follows(self, job: Job) -> bool:
        """Whether the job waits for a prefill ahead of it that shares a longer prefix with it
        than the prefix cache holds: that prefill gets a snapshot mark at the shared length
        (aligned down to `_resume_align`) and the job is admitted once it has passed it, to
        resume there. A new mark must gain MIN_SHARED tokens; one the leader has already (its
        own, or one placed for this job before the cache caught up part way) costs nothing
        more. Only live prefills that have not passed the mark lead, so a cancelled or failed
        leader (gone from `prefilling`) leaves its followers to be admitted as they are."""
        if self.prefix is None:
            return False
        align = self._resume_align()
        shares = []
        for p in self.prefilling:
            n = min(common_prefix(job.ids, p.job.ids), len(job.ids) - MIN_NEW) // align * align
            if n > p.done and not p.job.cancelled:
                shares.append((n, p))
        if not shares:  # the common case, an unrelated job: no hashing of its ids
            return False
        cached = self.prefix.cached_length(job.ids, align)
        best, leader = 0, None
        for n, p in shares:
            if n > best and (n - cached >= max(align, MIN_SHARED) or (n > cached and n in p.stops)):
                best, leader = n, p
        if leader is None:
            return False
        if best not in leader.stops:
            leader.stops = sorted(leader.stops + [best])
        return True

    def _admit(self, job: Job) -> "_Prefill":
        """A prefill slot for the job: on its longest cached prefix's state, or a fresh cache."""
        if self.prefix is None:
            return _Prefill(job, self.runner.new_cache())
        snap = self.prefix.lookup(job.ids, self._resume_align())
        cache = self.runner.new_cache() if snap is None else snap.restore(self.runner.device)
        job.cached_tokens = cache.lengths[0]
        if self.metrics is not None:
            self.metrics.cached(job.cached_tokens)
        stops = self.prefix.marks(job.cached_tokens, len(job.ids), self._stride())
        return _Prefill(job, cache, job.cached_tokens, stops)

    def _stride(self) -> int:
        """Tokens per prefill chunk: the engine's pieces, else the model's own chunks."""
        return self.prefill_chunk if self.prefill_chunk > 0 else self.runner.prefill_stride

    def _resume_align(self) -> int:
        """Where snapshots are kept and resumed (prefix_cache.resume_align): anywhere, or at
        multiples of the prefill chunk where the backend's prefill bits depend on a chunk's rows."""
        return 1 if self.runner.prefill_rows_exact else self._stride()

    def _next_piece(self, p: "_Prefill") -> list[int]:
        n = len(p.job.ids)
        end = p.done + (n if self.prefill_chunk <= 0 else self.prefill_chunk)
        end = min([end] + [m for m in p.stops if m > p.done])  # a snapshot mark ends a piece
        return p.job.ids[p.done : end]

    def _join(self, p: "_Prefill", logits) -> None:
        """A prefill's last piece is in: sample its first token; a live row joins the batch."""
        if self.metrics is not None:
            self.metrics.first_token(time.perf_counter() - p.job.submitted)
        if self._emit(p.job, logits) and not p.job.cancelled:
            self.cache = p.cache if self.cache is None else ModelCache.stack([self.cache, p.cache])
            self.rows.append(p.job)

    def _emit(self, job: Job, logits) -> bool:
        """Sample the job's next token and hand it over; False when the job is finished."""
        if job.cancelled:
            if not job.done:
                self._close(job, Finished("cancelled"))
            return False
        try:
            logits = apply_penalties(logits, job.tokens, job.presence_penalty, job.frequency_penalty,
                                     job.repetition_penalty, job.ids)
            tok = sample(logits, job.temperature, job.top_p, job.generator, job.top_k, job.min_p)
        except Exception as exc:  # this row's sampling only: its companions go on
            log.exception("streamrt serve: sampling failed")
            self._fail(job, f"generation failed ({type(exc).__name__}: {exc})")
            return False
        job.tokens.append(tok)
        job.out.put_nowait(tok)
        if self.metrics is not None:
            self.metrics.tokens(1)
        if tok in job.stop_ids:
            self._close(job, Finished("stop"))
        elif len(job.tokens) >= job.max_tokens:
            self._close(job, Finished("length"))
        return not job.done

    def _drop_cancelled(self) -> None:
        for p in self.prefilling:
            if p.job.cancelled:
                self._close(p.job, Finished("cancelled"))
        self.prefilling = [p for p in self.prefilling if not p.job.cancelled]
        if any(job.cancelled for job in self.waiting):
            for job in self.waiting:
                if job.cancelled:
                    self._close(job, Finished("cancelled"))
            self.waiting = deque(j for j in self.waiting if not j.cancelled)
        keep = [i for i, job in enumerate(self.rows) if not job.cancelled]
        for job in self.rows:
            if job.cancelled:
                self._close(job, Finished("cancelled"))
        self._keep(keep)

    def _keep(self, keep: list[int]) -> None:
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        self.cache = self.cache.select(keep) if keep else None

    def _close(self, job: Job, item) -> None:
        job.done = True
        job.out.put_nowait(item)

    def _fail(self, job: Job, message: str) -> None:
        if not job.done:
            self._close(job, Failed(message))


@dataclass(eq=False)
class _Prefill:
    """A job being prefilled: its 1-row cache, how many prompt tokens it holds, and where it
    leaves prefix-cache snapshots."""

    job: Job
    cache: ModelCache
    done: int = 0
    stops: list[int] = field(default_factory=list)
