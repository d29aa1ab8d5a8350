"""The streaming runtime: one asyncio coroutine per decode step drives the model's forward
generator and moves routed experts host -> device around its compute.

The whole I/O story of a decode step is in `decode_step` and `serve`, top to bottom:

    the model runs until a MoE layer's router has spoken and yields ExpertRequest(layer, ids, ...)
    1. route    ids to the host (one transfer, together with the predictor's guess for the
                next layer), awaited without blocking the host thread: a non-blocking copy into
                page-locked memory and a polled compute event, so the staging feeder keeps
                the copy stream fed meanwhile. Then this layer's unissued staged guesses are
                dropped (a routed one becomes an ordinary miss below); recall is recorded
    2. finish   the previous layer's compute is queued: one compute event marks its slots'
                last use; its pins drop (only now, so guesses fed during the route never
                evict the previous layer's experts, as when all were staged at once)
    3. fetch    device hits need nothing. Every miss is issued at once: a miss whose mapping
                is open is copied now on the copy stream (one event per expert); cold files
                are mapped (and page-locked) by a bounded thread pool, each copied the moment
                its mapping arrives
    4. stage    the next layer's predicted experts are queued (most confident first) and fed
                to the copy stream just in time, behind this layer's misses: at most
                --stage-depth staged copies are in flight at once, so when the next router
                speaks its real misses wait behind at most that many guesses, and guesses
                never issued cost no link time (the first MoE layer's guess is queued at the
                start of the step, from the token embeddings, while the dense layers compute)
    5. retire   mappings evicted from the host window are released once the copy-stream event
                recorded at their eviction completed (front of the FIFO only)
    6. compute  the model receives lazy expert views: taking expert e makes the compute stream
                wait for e's copy event (GPU-side), so the first experts compute while later
                ones still arrive. No host synchronize anywhere on this path.

Completion reaches asyncio by event-query polling (`_event_done`), never by blocking the loop.
Batch decode needs nothing special: B sequences yield one request per layer and its unique ids
are fetched once.

Failure modes of the seed, for the sweep (off by default): `--staging off` (no pool, no
staging, pageable synchronous copies: the baseline), `--prefetch discard`, `--evict sync`,
`--preparse`.

Construction and driving (what `streamrt run` does):

    rt = StreamingRuntime(tree, model, RuntimeOptions.from_args(args), batch=B)
    logits = rt.run(model.forward_steps(prompt_ids, cache))             # prefill
    logits = rt.run(model.forward_steps(next_ids, cache), tokens=B)     # each decode step
    rt.write_stats(args.stats_json); rt.close()
or synchronously: `run_sync(gen, rt.provider)`.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from streamrt.checkpoint.expert_file import parse_expert
from streamrt.errors import StreamrtError
from streamrt.expert_weights import ExpertWeights
from streamrt.runtime.options import RuntimeOptions
from streamrt.runtime.predictor import Predictor
from streamrt.runtime.stats import RuntimeStats, write_stats_json
from streamrt.runtime.streams import make_device
from streamrt.store.device_tier import DeviceTier, relocate_views
from streamrt.store.disk_reader import DEFAULT_READ_THREADS, DiskReader, FileReader, ReadCancelled, tune_threads
from streamrt.store.gds import choose_gds
from streamrt.store.host_tier import HostMapping, HostTier, available_memory, choose_host_tier
from streamrt.store.pool import PoolEntry, PoolTier
from streamrt.store.keys import ExpertKey
from streamrt.store.policies import make_policy
from streamrt.store.retire import RetireQueue
from streamrt.trace import NullTracer

# Share of a layer's guesses queued for staging by default (most confident first). When every
# queued guess was copied at once, fewer were faster (H200, slice, 32 slots: all 16 31.6 / 36.0
# ms/token, 12 30.0 / 28.2, 8 26.2 / 29.9). Copied just in time, a queued guess costs nothing
# until it is issued and the unissued rest is dropped when the router speaks, so all of them are
# queued (session 4, profiling/RESULTS.md §1).
STAGE_SHARE = 1.0
POOL_WAIT_S = 30.0  # a routed miss waiting this long for a pool buffer, nothing being read: a bug, said in a line


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed, else the default loop."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()


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


class StreamingRuntime:
    def __init__(
        self,
        tree,
        model=None,
        options: RuntimeOptions | None = None,
        *,
        device=None,
        batch: int = 1,
        predictor: Predictor | None = None,
        workers: int | None = None,
        record_trace: bool = False,
        tracer=None,
        file_reader: FileReader | None = None,
    ) -> None:
        self.options = opts = options or RuntimeOptions()
        self.tree, self.cfg, self.layout = tree, tree.config, tree.layout
        cfg = self.cfg
        self.device = device or make_device(opts.device)
        sizes = opts.resolve(cfg, self.layout.file_bytes, self.device, batch=batch)
        self.window, self.gpu_experts = sizes.window, sizes.gpu_experts
        self.stats = RuntimeStats(trace=[] if record_trace else None)
        self.tracer = tracer or NullTracer()  # streamrt.trace.Tracer for `--trace`
        self.retire = RetireQueue()
        self.reader: DiskReader | None = None
        kind, budget, why = choose_host_tier(opts.host_tier if opts.staging else "mapped",
                                             cfg.expert_files * self.layout.file_bytes, opts.host_mem,
                                             available_memory() if opts.host_mem is None else None)
        if kind == "pool":
            self._init_pool(budget, why, file_reader)
        else:
            self.host = HostTier(
                lambda key: tree.expert_path(key.layer, key.expert),
                self.layout.file_bytes,
                sizes.window,
                device=self.device,
                retire=self.retire,
                stats=self.stats,
                register=opts.staging,  # the baseline copies from pageable mappings
                evict=opts.evict,
            )
            self.host_tier_line = f"host tier mapped ({why}): up to {sizes.window} page-locked file mappings"
        self.stats.host_tier = kind
        self.gpu = DeviceTier(
            sizes.gpu_experts,
            self.layout.file_bytes,
            device=self.device,
            policy=make_policy(opts.gpu_policy, capacity=sizes.gpu_experts),
            stats=self.stats,
        )
        if predictor is None and model is not None and opts.staging:
            predictor = Predictor.from_model(model)
        self.predictor = predictor if opts.staging else None
        self.model = model
        self.pool = ThreadPoolExecutor(
            max_workers=workers or min(16, os.cpu_count() or 1),
            thread_name_prefix="streamrt-map",
            initializer=self.device.thread_init,
        )
        self.loop = new_event_loop()
        self._inflight: dict[ExpertKey, asyncio.Future] = {}  # cold mappings being opened
        self._guess_maps: dict[ExpertKey, asyncio.Task] = {}  # cold guess -> its mapping task (this step)
        self._queue: dict[int, list[ExpertKey]] = {}  # layer -> guesses not yet issued, by rank
        self._outstanding: list = []  # ready events of issued staged copies, not seen complete
        self._feeder: asyncio.Task | None = None  # feeds _queue while guesses wait
        self._held: list[ExpertKey] = []  # keys the last served request pinned
        self._transient: dict[ExpertKey, tuple] = {}  # overflow of a request wider than the slab
        self._predicted: dict[int, set[int]] = {}  # layer -> ids predicted for it
        self._staged: dict[int, list[ExpertKey]] = {}  # layer -> keys pinned for it by staging
        self._verified: set[ExpertKey] = set()  # checksummed once in this process (--verify-experts)
        self._read_seq = iter(range(1 << 62))  # FIFO order among reads of one priority class
        self._background: set[asyncio.Task] = set()  # pool-tier guess reads outliving their step
        if opts.preparse and not self.pooled:
            self.host.preparse(self._every_key(), lambda buf: parse_expert(buf, self.layout))

    # ---- driving the model ----------------------------------------------------------

    def run(self, gen, *, tokens: int = 0) -> torch.Tensor:
        """Drive one forward generator (a prefill, or a decode step producing `tokens` tokens)
        to its logits on this runtime's loop. Decode steps (tokens > 0) are timed."""
        return self.loop.run_until_complete(self.decode_step(gen, tokens=tokens))

    def provider(self, req) -> Mapping[int, ExpertWeights]:
        """Synchronous provider for `streamrt.model.run_sync` (same fetch path, same answers)."""
        return self.loop.run_until_complete(self.serve(req))

    async def decode_step(self, gen, *, tokens: int = 0) -> torch.Tensor:
        t0, b0 = time.perf_counter(), self.stats.bytes_h2d
        tracer = self.tracer
        tracer.begin_step()
        hinted = self.model is not None and self.predictor is not None and self.predictor.first_layer is not None
        if hinted:
            self.model.step_hint = self._stage_first
        try:
            req = next(gen)  # runs the model up to the first MoE router
            while True:
                experts = await self.serve(req)
                with tracer.span("compute", f"L{req.layer}", stream=self.device.compute_stream, layer=req.layer):
                    req = gen.send(experts)  # queues this layer's compute, runs to the next router
        except StopIteration as stop:
            logits = stop.value
        finally:
            if hinted:
                self.model.step_hint = None
            gen.close()
            self._finish_previous()
            await self._settle()
        if tokens:
            await _event_done(self.device.record_compute_event())  # the step's GPU work is done
            self.stats.tokens += tokens
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.decode_bytes_h2d += self.stats.bytes_h2d - b0
        tracer.end_step()
        return logits

    # ---- one layer request: the I/O story ---------------------------------------------

    async def serve(self, req) -> StreamedExperts:
        layer = req.layer

        # 1. route: routed ids (and the guess for the next layer) reach the host together;
        #    the feeder issues this layer's queued guesses while the host waits. The router has
        #    spoken: guesses still queued are dropped (routed ones are fetched as misses in 3).
        host_ids, guess = await self._route(req)
        self._drop(layer)
        if self.pooled:
            self.host.unprotect(layer)  # its read-ahead may be evicted from now on

        # 2. finish: the previous layer's compute is queued; mark its slots' last use, unpin.
        self._finish_previous()
        ids = sorted(set(host_ids.reshape(-1).tolist()))
        keys = [ExpertKey(layer, e) for e in ids]
        if layer in self._predicted:
            hit = self._predicted.pop(layer)
            self.stats.predicted += sum(1 for e in ids if e in hit)
            self.stats.routed += len(ids)
        if self.stats.trace is not None:
            self.stats.trace.append([layer, ids])
        if self.options.prefetch == "discard":
            await self._discard_reads(keys)  # the seed's failure mode: traffic for nothing
        self.gpu.pin(keys)
        self._held = keys

        # 3. fetch: hits need nothing; open mappings are copied now; cold files via the pool.
        cold = []
        for key in keys:
            if self.gpu.lookup(key) is not None:
                continue
            if not self.options.staging:  # baseline: synchronous map + pageable copy, one by one
                self._copy_in(key, self.host.lookup(key) or self.host.insert(self._open(key)))
                continue
            m = self.host.lookup(key)
            if m is not None:
                self._copy_in(key, m)
            else:
                cold.append(key)
        if self.pooled:  # misses submitted first, then the next layer's guesses behind them
            t = time.perf_counter()
            fetches = [self.loop.create_task(self._fetch(k)) for k in cold]
            if guess is not None:
                self._read_ahead(*guess)
            if fetches:
                await _all(fetches)
                self.stats.stall_s += time.perf_counter() - t
        elif cold:
            t = time.perf_counter()
            await _all(self._fetch(k) for k in cold)
            self.stats.stall_s += time.perf_counter() - t

        # 4. stage: the next layer's predicted experts copy while this layer computes, into
        #    unpinned slots, leaving room for the next request's misses (this layer's pins are
        #    released before it arrives, so they are not counted twice).
        if guess is not None:
            self._stage(*guess, budget=min(self.gpu.slots - self.gpu.pinned, self.gpu.slots - len(keys)))

        # 5. retire: release evicted mappings whose copies have executed (front only).
        self.retire.release()
        if self.tracer.enabled:
            self.tracer.counter("retire_fifo_depth", self.retire.pending)
            self.tracer.counter("device_slots_used", len(self.gpu))

        # 6. compute: lazy views; the compute stream waits per expert, on the GPU.
        views, events = {}, {}
        for key in keys:
            if key in self._transient:
                views[key.expert], events[key.expert] = self._transient[key]
                continue
            slot = self.gpu.slot_of(key)
            views[key.expert] = self.gpu.views(slot, self._slot_views)
            if self.gpu.ready[slot] is not None:
                events[key.expert] = self.gpu.ready[slot]
        return StreamedExperts(self.device, views, events, self.tracer, layer, host_ids)

    # ---- the steps' parts -----------------------------------------------------------

    def _finish_previous(self) -> None:
        self._transient.clear()  # the compute reading them is queued; the allocator takes over
        if not self._held:
            return
        ev = self.device.record_compute_event()
        for key in self._held:
            slot = self.gpu.slot_of(key)
            if slot is not None:
                self.gpu.last_use[slot] = ev
        self.gpu.unpin(self._held)
        layer = self._held[0].layer
        self.gpu.unpin(self._staged.pop(layer, ()))
        self._held = []

    async def _route(self, req) -> tuple[torch.Tensor, tuple[int, list[int]] | None]:
        """The routed ids on the host (req.ids' shape), and (next layer, unique predicted ids,
        most confident first)."""
        ids = req.ids.reshape(-1)
        target = self.predictor.target(req.layer) if self.predictor is not None else None
        if target is None:
            return await self._to_host(req.ids), None
        guess = self.predictor.predict(req.layer, req.hidden).reshape(-1)
        both = await self._to_host(torch.cat((ids.to(guess.dtype), guess)))  # one device-to-host transfer
        n = ids.numel()
        host = both[:n].to(req.ids.dtype).view(req.ids.shape)
        return host, (target, list(dict.fromkeys(both[n:].tolist())))  # guesses by rank

    async def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the host, without blocking the host thread on the GPU reaching it: from a CUDA
        device a non-blocking copy into page-locked memory, then a compute-stream event polled
        (other tasks, the staging feeder, run meanwhile). Elsewhere a plain `.cpu()`."""
        if self.device.kind != "cuda" or not t.is_cuda or not self.options.staging:
            return t.cpu()  # (the --staging off baseline keeps the seed's blocking transfer)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        await _event_done(self.device.record_compute_event())
        return host

    def _copy_in(self, key: ExpertKey, m: HostMapping, *, required: bool = True) -> bool:
        """Give `key` a slot and queue its copy from mapping `m` (one ready event)."""
        if key in self.gpu or key in self._transient:
            return True
        slot = self.gpu.admit(key, required=False)
        if slot is None:  # every slot pinned: only a request wider than the slab gets here
            if required:
                buf, ev = self.gpu.fill_transient(m.data, pinned=m.registered)
                self.host.note_copy(m, ev)
                self._transient[key] = (relocate_views(parse_expert(m.data, self.layout), m.data, buf), ev)
            return required
        with self.tracer.span("copy", "expert", stream=self.device.copy_stream,
                              layer=key.layer, expert=key.expert, bytes=m.nbytes):
            self.gpu.fill(slot, m.data, pinned=m.registered)
        self.host.note_copy(m, self.gpu.ready[slot])  # a pool buffer is not reused before it
        # The slot's views (built once, from the first mapping copied into it: same layout).
        self.gpu.views(slot, lambda t: relocate_views(parse_expert(m.data, self.layout), m.data, t))
        return True

    async def _fetch(self, key: ExpertKey) -> None:
        """A cold miss: copied the moment its mapping arrives (no-op if staging got it first)."""
        self._copy_in(key, await self._mapping(key))

    def _slot_views(self, slot_tensor):  # views are always built in _copy_in first
        raise AssertionError("slot views requested before the slot was filled")

    async def _mapping(self, key: ExpertKey) -> HostMapping:
        """The open mapping of `key`, live when this returns (the caller copies from it before
        its next await): a host hit, a fill already in flight, or a new one mapped (and
        page-locked) on the pool, inserted into the host window on this thread. A fill shared
        with another task may have been evicted again by the time this task resumes (a window
        smaller than the request): then map it once more."""
        while True:
            m = await self._mapping_once(key)
            if m.live:
                return m

    async def _mapping_once(self, key: ExpertKey) -> HostMapping:
        if self.pooled:
            return await self._pool_entry(key)
        m = self.host.lookup(key)
        if m is not None:
            return m
        fut = self._inflight.get(key)
        if fut is None:
            fut = self._inflight[key] = self.loop.create_future()
            try:
                with self.tracer.span("host-io", "map", layer=key.layer, expert=key.expert, bytes=self.layout.file_bytes):
                    m = await self.loop.run_in_executor(self.pool, self._open, key)
                m = self.host.insert(m)
                fut.set_result(m)
            except BaseException as e:
                fut.set_exception(e)
                fut.exception()  # retrieved: waiters re-raise it
                raise
            finally:
                del self._inflight[key]
            return m
        return await fut

    def _open(self, key: ExpertKey) -> HostMapping:
        """Pool thread: map (+ register) and validate the header against the key."""
        m = self.host.open_mapping(key)
        try:
            parse_expert(m.data, self.layout, name=str(m.path), expect=(key.layer, key.expert))
            if self.options.verify_experts == "first" and key not in self._verified:
                # hash the mapped bytes (no second read) under the manifest's rule
                self.tree.check_expert(key.layer, key.expert, data=m.data)
                self._verified.add(key)
        except BaseException:
            m.release()
            raise
        return m

    # ---- the pool tier (issue 21): experts read from the drive into page-locked buffers --------

    @property
    def pooled(self) -> bool:
        return self.reader is not None

    def _init_pool(self, budget: int, why: str, file_reader: FileReader | None) -> None:
        """The host tier as a buffer pool under `budget` bytes, its reader threads and the
        start line saying which read path runs."""
        opts, fb = self.options, self.layout.file_bytes
        self.host = PoolTier(lambda key: self.tree.expert_path(key.layer, key.expert), fb, budget,
                             device=self.device, stats=self.stats)
        self.file_reader = file_reader or FileReader()
        threads, tuned = opts.read_threads or DEFAULT_READ_THREADS, ""
        if opts.read_threads == -1:  # --read-threads auto: a short measurement over expert files
            paths = [self.tree.expert_path(k.layer, k.expert) for k in self._every_key()[:96]]
            threads, rates = tune_threads(paths, fb, reader=self.file_reader)
            tuned = " (auto: " + ", ".join(f"{n}: {r / 1e9:.2f} GB/s" for n, r in rates.items()) + ")"
        self.reader = DiskReader(threads, thread_init=self.device.thread_init)
        self.gds = choose_gds(opts.gds, self.device)
        gds = self.gds.why + ("; misses still read through the pool" if self.gds.active else "")
        self.host_tier_line = (
            f"host tier pool ({why}): {self.host.capacity} {'page-locked ' if self.host.registered else ''}buffers "
            f"x {fb / 2**20:.1f} MiB = {self.host.bytes_allocated / 2**30:.2f} GiB, {threads} reader threads{tuned}, "
            f"{self.file_reader.mode}, {gds}"
        )

    async def _pool_entry(self, key: ExpertKey) -> PoolEntry:
        """A routed miss on the pool tier: its buffer, read completely, when this returns (the
        caller copies from it before its next await). A read already queued as a guess is raised
        to miss priority; with every buffer busy, wait for one (a read ends, a copy executes)."""
        pool, delay, since = self.host, 0.0, None
        while True:
            e = pool.peek(key)
            if e is not None:
                return e
            e = pool.reading(key)
            if e is None:
                e = pool.take(key)
                if e is None:
                    since = since or time.perf_counter()
                    if time.perf_counter() - since > POOL_WAIT_S and not self.reader.in_flight:
                        raise StreamrtError(f"--host-mem: no pool buffer came free for {POOL_WAIT_S:.0f} s with no "
                                            f"read in flight ({pool.capacity} buffers); raise --host-mem")
                    await asyncio.sleep(delay)
                    delay = min(1e-4, delay * 2 or 5e-6)
                    continue
                self._submit_read(e, (0, next(self._read_seq)))
            elif e.job is not None and e.job.state == "queued":
                e.guess = False  # the read-ahead did not get there first
                e.job.raise_priority((0, next(self._read_seq)))
            e.pins += 1
            try:
                await e.future
            except ReadCancelled:
                continue
            finally:
                e.pins -= 1
            if e.live:
                return e

    def _read_ahead(self, layer: int, ids: list[int]) -> None:
        """Pool tier, as soon as layer-1's router spoke: `layer`'s predicted experts start
        reading into the pool (most confident first, behind every routed miss), so the drive
        never idles at the tail of a layer's misses. Staging copies them later (`_stage`)."""
        cap = self.options.stage_max if self.options.stage_max is not None else len(ids)
        for rank, e in enumerate(ids[:cap]):
            key = ExpertKey(layer, e)
            if key in self.gpu or key in self.host or key in self._guess_maps:
                continue
            self._guess_maps[key] = self.loop.create_task(self._stage_cold(key, rank))

    async def _pool_guess(self, key: ExpertKey, rank: int) -> bool:
        """Read a predicted expert into the pool behind every routed miss (priority by rank).
        False when no buffer is idle: a guess never waits for one."""
        pool = self.host
        if key in pool:
            return True
        e = pool.reading(key)
        if e is None:
            e = pool.take(key, guess=True)
            if e is None:
                return False
            self._submit_read(e, (1, rank, next(self._read_seq)))
        await e.future
        return e.live

    def _submit_read(self, e: PoolEntry, priority: tuple) -> None:
        loop = self.loop
        e.future = loop.create_future()

        def done(result, exc) -> None:  # reader thread
            loop.call_soon_threadsafe(self._read_done, e, result, exc)

        e.job = self.reader.submit(priority, lambda: self._read_job(e), done)

    def _read_job(self, e: PoolEntry):
        """Reader thread: the file into `e`'s buffer, then the header (and the checksum, the
        first time) checked against the key."""
        key = e.key
        r = self.file_reader.read_into(e.path, self.host.memory_of(e), e.nbytes)
        parse_expert(e.data, self.layout, name=str(e.path), expect=(key.layer, key.expert))
        if self.options.verify_experts == "first" and key not in self._verified:
            self.tree.check_expert(key.layer, key.expert, data=e.data)
            self._verified.add(key)
        return r

    def _read_done(self, e: PoolEntry, r, exc) -> None:
        """Scheduler thread: the read of `e` ended; its waiters may take it (or its error)."""
        if e.future.done():  # cancelled meanwhile (its future already answered)
            return
        if exc is None:
            self.host.complete(e, direct=r.direct, cached=r.cached)
            if self.tracer.enabled:
                self.tracer.record("disk", "read", r.start_s, r.end_s, layer=e.key.layer, expert=e.key.expert,
                                   bytes=r.nbytes, direct=r.direct, guess=e.guess)
            e.future.set_result(e)
        else:
            self.host.fail(e)
            e.future.set_exception(exc)
            e.future.exception()  # retrieved: waiters re-raise it

    def _cancel_guess_reads(self, layer: int) -> None:
        """`layer`'s router spoke: its guess reads not started yet cost no disk time (routed ones
        are read again at miss priority by the fetch)."""
        for key in [k for k in self._guess_maps if k.layer == layer]:
            e = self.host.reading(key)
            if e is not None and e.guess and e.pins == 0 and e.job is not None and e.job.cancel():
                self.host.fail(e)
                self.stats.readahead_reads -= 1
                e.future.set_exception(ReadCancelled(str(key)))
                e.future.exception()

    def _stage_first(self, embeddings: torch.Tensor) -> None:
        """Decode-step start (the model's step_hint): queue the first MoE layer's guess (the
        first --stage-depth issued now) while the dense layers compute, leaving slots for that
        layer's misses."""
        guess = self.predictor.predict_first(embeddings).reshape(-1).cpu()  # small; the GPU is idle here
        budget = self.gpu.slots - self.gpu.pinned - min(self.gpu.slots, guess.numel())
        self._stage(self.predictor.first_layer, list(dict.fromkeys(guess.tolist())), budget=budget)

    def _stage(self, layer: int, ids: list[int], *, budget: int) -> None:
        """Queue up to `budget` of `layer`'s predicted experts for staging (most confident first,
        at most --stage-max, by default all of them) and issue the first
        --stage-depth now (the host may run Python for a while before it next awaits); the
        feeder issues the rest one by one as earlier staged copies complete, until `layer`'s
        router speaks and drops what is left. Cold guesses start mapping now and are copied when
        their turn comes. Issued keys are pinned until `layer` has been served."""
        self._predicted[layer] = set(ids)  # recall is the predictor's, whatever gets staged
        self._staged.setdefault(layer, [])
        cap = self.options.stage_max if self.options.stage_max is not None else math.ceil(STAGE_SHARE * len(ids))
        queue = self._queue.setdefault(layer, [])
        for rank, e in enumerate(ids[: max(0, min(budget, cap))]):
            key = ExpertKey(layer, e)
            if key in self.gpu or key in queue:
                continue
            queue.append(key)
            task = self._guess_maps.get(key)
            if key not in self.host and (task is None or task.done()):
                self._guess_maps[key] = self.loop.create_task(self._stage_cold(key, rank))
        self._pump()
        if self._queue and (self._feeder is None or self._feeder.done()):
            self._feeder = self.loop.create_task(self._feed())

    def _pump(self) -> int:
        """Issue queued guesses, most confident first, while fewer than --stage-depth staged
        copies are outstanding (issued, copy event not complete). A guess whose mapping is still
        being opened keeps its place without holding up the ones behind it; one already
        resident leaves the queue; one whose mapping was pushed out of the window again, or
        with no slot to take (every slot pinned), is dropped. Returns how many were issued."""
        out = self._outstanding = [ev for ev in self._outstanding if not ev.query()]
        depth, issued = self.options.stage_depth, 0
        for layer in list(self._queue):
            queue, rest = self._queue[layer], []
            for i, key in enumerate(queue):
                if len(out) >= depth:
                    rest += queue[i:]
                    break
                if key in self.gpu:
                    continue
                if key not in self.host:
                    task = self._guess_maps.get(key)
                    if task is not None and not task.done():
                        rest.append(key)  # still mapping
                    else:
                        self.stats.stage_dropped += 1
                    continue
                src = self.host.peek(key) if self.pooled else self.host.lookup(key)
                if not self._copy_in(key, src, required=False):
                    self.stats.stage_dropped += 1
                    continue
                self.gpu.pin((key,))
                self._staged[layer].append(key)
                self.stats.staged += 1
                issued += 1
                ev = self.gpu.ready[self.gpu.slot_of(key)]
                if not ev.query():
                    out.append(ev)
            if rest:
                self._queue[layer] = rest
            else:
                del self._queue[layer]
        return issued

    async def _feed(self) -> None:
        """The staging feeder: while guesses are queued, poll the outstanding staged copies'
        events (query, yield, back off to 100 us, as `_event_done`) and issue the next guess as
        one completes. It runs whenever the decode coroutine awaits: above all while the next
        router's ids come to the host."""
        delay = 0.0
        while self._queue:
            if self._pump():
                delay = 0.0
            await asyncio.sleep(delay)
            delay = min(1e-4, delay * 2 or 5e-6)

    async def _stage_cold(self, key: ExpertKey, rank: int = 0) -> None:
        """A cold guess: map it on the pool (mapped tier), or read it from disk into a pool buffer
        behind every routed miss, most confident first (pool tier); if its turn has come, it is
        copied at once."""
        try:
            if self.pooled:
                if not await self._pool_guess(key, rank):
                    return
            else:
                await self._mapping_once(key)
        except Exception:  # a guess is no error: if routed, its fetch maps it again and raises
            return
        if self._queue:
            self._pump()  # the mapping is live now

    def _drop(self, layer: int) -> None:
        """`layer`'s router has spoken (or the step ended): its unissued guesses cost nothing."""
        queue = self._queue.pop(layer, ())
        self.stats.stage_dropped += sum(1 for key in queue if key not in self.gpu)
        if self.pooled:
            self._cancel_guess_reads(layer)

    async def _settle(self) -> None:
        """End of a step: drop what is still queued, stop the feeder, let cold guesses still
        mapping finish (they only map), unpin what staging pinned."""
        for layer in list(self._queue):
            self._drop(layer)
        if self._feeder is not None:
            self._feeder.cancel()
            await asyncio.gather(self._feeder, return_exceptions=True)
            self._feeder = None
        if self.pooled:  # reads already started finish into the pool while the next step runs
            self.host.unprotect()
            self._background.update(t for t in self._guess_maps.values() if not t.done())
            self._background = {t for t in self._background if not t.done()}
        elif self._guess_maps:
            await asyncio.gather(*self._guess_maps.values(), return_exceptions=True)
        self._guess_maps.clear()
        for layer in list(self._staged):
            self.gpu.unpin(self._staged.pop(layer))
        self._predicted.clear()

    async def _discard_reads(self, keys: list[ExpertKey]) -> None:
        """`--prefetch discard`: read each routed file into a throwaway buffer (aiofiles)."""
        import aiofiles

        async def read(key: ExpertKey) -> None:
            async with aiofiles.open(self.host.path_of(key), "rb", executor=self.pool) as f:
                self.stats.bytes_disk += len(await f.read())

        await _all(read(k) for k in keys)

    def preload(self, keys=None) -> int:
        """Setup, not decode: copy `keys` (default every expert, in path order) into free device
        slots until the slab is full, e.g. to measure all-resident compute. Returns how many."""
        n = 0
        for key in self._every_key() if keys is None else keys:
            if len(self.gpu) >= self.gpu.slots:
                break
            if key not in self.gpu:
                m = self.loop.run_until_complete(self._mapping(key))
                self._copy_in(key, m, required=False)
                n += 1
        self.retire.release()
        return n

    def warm_host(self, keys=None) -> int:
        """Setup, not decode: map (checksum on first map, page-lock) `keys` (default every
        expert) into the host window, as many as it holds, concurrently on the pool; no device
        copies. A long-running process reaches this state by itself; benchmarks that measure
        steady-state decode with "experts in host RAM" start from it. Returns how many."""
        keys = [k for k in (self._every_key() if keys is None else keys) if self.host.lookup(k) is None]
        keys = keys[: max(0, (self.host.capacity if self.pooled else self.window) - len(self.host))]
        if keys:
            self.loop.run_until_complete(_all(self._mapping(k) for k in keys))
        self.retire.release()
        return len(keys)

    def _every_key(self) -> list[ExpertKey]:
        """Every routed expert of the model, in path order (layer, then expert)."""
        return [ExpertKey(l, e) for l in self.cfg.moe_layers for e in range(self.cfg.num_experts)]

    # ---- results and shutdown ----------------------------------------------------------

    def payload(self) -> dict:
        """The `--stats-json` object."""
        disk = self.pooled or self.options.host_tier != "auto"
        return self.stats.payload(retire=self.retire, device=self.device, staging=True, disk=disk)

    def reset_stats(self) -> None:
        """Zero every counter (e.g. after warm-up steps), retirement and synchronizes included."""
        self.stats.reset()
        self.retire.retired = self.retire.released = 0
        self.device.full_synchronizes = 0

    def write_stats(self, path=None) -> dict:
        p = self.payload()
        path = path or self.options.stats_json
        if path:
            write_stats_json(path, p)
        return p

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.run_until_complete(self._settle())
        if self.reader is not None:
            self.reader.close()  # queued reads cancelled, running ones finished
            self.loop.run_until_complete(_settled(self._background))
            self.retire.drain()
        self.host.close()
        self.pool.shutdown(wait=True)
        self.loop.close()

    def __enter__(self) -> "StreamingRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _all(coros) -> list:
    """Run coroutines concurrently; wait for every one, then raise the first failure. (A plain
    gather raises at the first failure and leaves the others' exceptions unretrieved: asyncio
    then prints their tracebacks, e.g. when several expert files fail their checksum.)"""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


async def _settled(tasks) -> None:
    """Wait for every task, ignoring their outcomes (shutdown)."""
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0)  # callbacks the reader threads queued run now


async def _event_done(ev) -> None:
    """Wait for an event without blocking the loop: query, yield, back off to 100 us."""
    delay = 0.0
    while not ev.query():
        await asyncio.sleep(delay)
        delay = min(1e-4, delay * 2 or 5e-6)
