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
                evict the previous layer's experts before its compute is queued)
    3. fetch    device hits need nothing. Every miss is issued at once: a miss whose mapping
                is open is copied now on the copy stream (one event per expert); cold files
                are mapped (and page-locked) by a bounded thread pool, each copied the moment
                its mapping arrives
    3b. dense   layer+1's streamed dense weights (certain bytes) are queued on the copy stream behind
                this layer's misses, ahead of its guesses (`model.layer_weights.prefetch`)
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

Completion reaches asyncio by event-query polling (`aio.event_done`), never by blocking the loop.
Staging (4, and the guesses' reads) is `stager.Stager`'s; the host tier (mapped files or the
buffer pool, one protocol) is `host_reads`'; the CUDA graphs decode steps replay are chosen by
`graph_choice` and handed to the model in the runtime's `Forward`. Batch decode: B rows, one
request per layer, its unique ids fetched once.

The seed's failure modes (`--copies sync`, `--prefetch discard`, `--evict sync`, `--preparse`)
are not here: asking for one makes this class construct `seed_baseline.SeedBaseline`.

Construction and driving (what `streamrt run` does):

    rt = StreamingRuntime(tree, model, RuntimeOptions.from_args(args), batch=B)
    logits = rt.run(model.forward_steps(prompt_ids, cache))             # prefill
    logits = rt.run(model.forward_steps(next_ids, cache), tokens=B)     # each decode step
    rt.finish()                                                         # --stats-json, --trace, close
or synchronously: `run_sync(gen, rt.provider)`.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import torch

from streamrt.checkpoint.expert_file import parse_expert
from streamrt.expert_weights import ExpertWeights, first_seen_ids, unique_ids
from streamrt.model.model import Forward
from streamrt.runtime.aio import event_done, gather_all, new_event_loop, settled
from streamrt.runtime.graph_choice import GraphChoice
from streamrt.runtime.host_reads import HostReads, open_host_reads
from streamrt.runtime.options import DEFAULT_STAGE_DEPTH, SEGMENT_STAGE_DEPTH, RuntimeOptions
from streamrt.runtime.predictor import Predictor
from streamrt.runtime.stager import Stager
from streamrt.runtime.stats import RuntimeStats, write_stats_json
from streamrt.runtime.streamed import StreamedExperts
from streamrt.runtime.streams import make_device
from streamrt.store.device_tier import DeviceTier, relocate_views
from streamrt.store.disk_reader import FileReader
from streamrt.store.keys import ExpertKey
from streamrt.store.policies import make_policy
from streamrt.store.retire import RetireQueue
from streamrt.trace import NullTracer


class StreamingRuntime:
    def __new__(cls, tree, model=None, options: RuntimeOptions | None = None, **kw):
        """Options asking for a failure mode of the seed construct the seed baseline instead
        (runtime/seed_baseline.py): this class never branches on them."""
        if cls is StreamingRuntime and options is not None and options.seed_baseline:
            from streamrt.runtime.seed_baseline import SeedBaseline

            cls = SeedBaseline
        return super().__new__(cls)

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
        stager: Callable[..., Stager] = Stager,
    ) -> None:
        """`stager(runtime, predictor)` makes the staging machinery (default `Stager`; tests
        pass a subclass that observes it). `predictor`: default the model's own routers."""
        self.options = opts = options or RuntimeOptions()
        self.tree, self.cfg, self.layout = tree, tree.config, tree.layout
        self.device = device or make_device(opts.device)
        sizes = opts.resolve(self.cfg, self.layout.file_bytes, self.device, batch=batch)
        self.window, self.gpu_experts = sizes.window, sizes.gpu_experts
        self.workers = workers or min(16, os.cpu_count() or 1)  # threads mapping cold files
        self.stats = RuntimeStats(trace=[] if record_trace else None)
        self.tracer = tracer or NullTracer()  # streamrt.trace.Tracer for `--trace`
        self.retire = RetireQueue()
        self.loop = new_event_loop()  # the host tier's reads answer on it
        try:
            self.host: HostReads = self._open_host(file_reader)
        except BaseException:  # e.g. --gds on without cuFile: no loop left open
            self.loop.close()
            raise
        self.stats.host_tier = self.host.kind
        self.gpu = DeviceTier(
            sizes.gpu_experts,
            self.layout.file_bytes,
            device=self.device,
            policy=make_policy(opts.gpu_policy, capacity=sizes.gpu_experts),
            stats=self.stats,
        )
        self.model = model
        self.stager = stager(self, predictor)
        # what the model's forwards driven here are given: the graphs decode steps replay, and the
        # hint that stages a step's first MoE layer from its embeddings
        self.forward = Forward(step_hint=self.stager.stage_first if self.stager.hints_first else None)
        self.graphs = GraphChoice(self)
        self._held: list[ExpertKey] = []  # keys the last served request pinned
        self._transient: dict[ExpertKey, tuple] = {}  # overflow of a request wider than the slab

    def _open_host(self, file_reader: FileReader | None) -> HostReads:
        """The host tier: a pool of buffers filled from the drive, or the expert files mapped in
        place, at most `window` open; its `line` says which."""
        return open_host_reads(self, file_reader)

    @property
    def host_tier_line(self) -> str:
        return self.host.line

    # ---- driving the model ----------------------------------------------------------

    def run(self, gen, *, tokens: int = 0) -> torch.Tensor:
        """Drive one forward generator (a prefill, or a decode step producing `tokens` tokens)
        to its logits on this runtime's loop. Decode steps (tokens > 0) are timed."""
        return self.loop.run_until_complete(self.decode_step(gen, tokens=tokens))

    def provider(self, req) -> StreamedExperts:
        """Synchronous provider for `streamrt.model.run_sync` (same fetch path, same answers)."""
        return self.loop.run_until_complete(self.serve(req))

    async def decode_step(self, gen, *, tokens: int = 0) -> torch.Tensor:
        """`gen`: the model's forward (`model.forward_steps`, or several in `lockstep`); it is
        given this runtime's `Forward` before it starts."""
        t0, b0 = time.perf_counter(), self.stats.bytes_h2d
        tracer = self.tracer
        tracer.begin_step()
        if tokens and self.model is not None:
            self.graphs.update()
        bind = getattr(gen, "bind", None)
        if bind is not None:
            bind(self.forward)
        requests = 0
        try:
            req = next(gen)  # runs the model up to the first MoE router
            while True:
                requests += 1
                experts = await self.serve(req)
                with tracer.span("compute", f"L{req.layer}", stream=self.device.compute_stream, layer=req.layer):
                    req = gen.send(experts)  # queues this layer's compute, runs to the next router
        except StopIteration as stop:
            logits = stop.value
        finally:
            gen.close()
            self._finish_previous()
            await self.stager.settle()
            self.retire.release()  # staging that settled here may have evicted after step 5's release
        if tokens:
            await event_done(self.device.record_compute_event())  # the step's GPU work is done
            self.stats.tokens += tokens
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.decode_bytes_h2d += self.stats.bytes_h2d - b0
        else:
            self._count_prefill(time.perf_counter() - t0, self.stats.bytes_h2d - b0, requests)
        tracer.end_step()
        return logits

    def _count_prefill(self, seconds: float, nbytes: int, requests: int) -> None:
        """A forward that is not a decode step (a prompt): its expert traffic apart from decode's."""
        st = self.stats
        st.prefills += 1
        st.prefill_s += seconds
        st.prefill_bytes_h2d += nbytes
        st.prefill_requests += requests

    @property
    def stage_depth(self) -> int:
        """Staged copies in flight at once: --stage-depth, else one while segment graphs replay and
        two op by op. A replayed step leaves the host waiting on the GPU, free to issue every guess
        it may; at two in flight, wrong guesses then took the link from the real misses (4x the
        guesses, 1.27x the time a token at a third of the slots)."""
        if self.options.stage_depth is not None:
            return self.options.stage_depth
        return SEGMENT_STAGE_DEPTH if self.graphs.replaying_segments else DEFAULT_STAGE_DEPTH

    @property
    def graphs_line(self) -> str | None:
        """Why decode steps run op by op although CUDA graphs were asked for; None otherwise."""
        return self.graphs.line

    # ---- one layer request: the I/O story ---------------------------------------------

    async def serve(self, req) -> StreamedExperts:
        layer = req.layer

        # 1. route: routed ids (and the guess for the next layer) reach the host together;
        #    the feeder issues this layer's queued guesses while the host waits. The router has
        #    spoken: guesses still queued are dropped (routed ones are fetched as misses in 3).
        host_ids, guess = await self._route(req)
        self.stager.drop(layer)
        self.host.unprotect(layer)  # its read-ahead (pool tier) may be evicted from now on

        # 2. finish: the previous layer's compute is queued; mark its slots' last use, unpin.
        self._finish_previous()
        ids = unique_ids(host_ids)
        keys = [ExpertKey(layer, e) for e in ids]
        self.stager.routed(layer, ids)
        if self.stats.trace is not None:
            self.stats.trace.append([layer, ids])
        self.gpu.pin(keys)
        self._held = keys

        # 3. fetch: hits need nothing; open mappings are copied now; cold files via the pool.
        await self._fetch_misses(keys, guess)

        # 3b. every miss of this layer is on the copy stream; the next layer's guesses are not.
        self._before_staging(layer)

        # 4. stage: the next layer's predicted experts copy while this layer computes, into
        #    unpinned slots, leaving room for the next request's misses (this layer's pins are
        #    released before it arrives, so they are not counted twice).
        if guess is not None:
            self.stager.stage(*guess, budget=min(self.gpu.slots - self.gpu.pinned, self.gpu.slots - len(keys)))

        # 5. retire: release evicted mappings whose copies have executed (front only).
        self.retire.release()
        if self.tracer.enabled:
            self.tracer.counter("retire_fifo_depth", self.retire.pending)
            self.tracer.counter("device_slots_used", len(self.gpu))

        # 6. compute: lazy views; the compute stream waits per expert, on the GPU.
        views, events = self._views(keys)
        return StreamedExperts(self.device, views, events, self.tracer, layer, host_ids, unique=ids)

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
        self.stager.unpin(self._held[0].layer)
        self._held = []

    async def _route(self, req) -> tuple[torch.Tensor, tuple[int, list[int]] | None]:
        """The routed ids on the host (req.ids' shape), and (next layer, unique predicted ids,
        most confident first)."""
        ids = req.ids.reshape(-1)
        guess = self.stager.guess(req)
        if guess is None:
            return await self._to_host(req.ids), None
        target, predicted = guess
        both = await self._to_host(torch.cat((ids.to(predicted.dtype), predicted)))  # one device-to-host transfer
        n = ids.numel()
        host = both[:n].to(req.ids.dtype).view(req.ids.shape)
        return host, (target, first_seen_ids(both[n:]))  # guesses by rank

    async def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the host, without blocking the host thread on the GPU reaching it: from a CUDA
        device a non-blocking copy into page-locked memory, then a compute-stream event polled
        (other tasks, the staging feeder, run meanwhile). Elsewhere a plain `.cpu()`."""
        if self.device.kind != "cuda" or not t.is_cuda:
            return t.cpu()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        await event_done(self.device.record_compute_event())
        return host

    async def _fetch_misses(self, keys: list[ExpertKey], guess: tuple[int, list[int]] | None) -> None:
        """Step 3: every miss of `keys` issued at once; returns when all are on the copy stream.
        Host hits are copied now, cold ones once mapped or read; on a host tier that reads ahead
        (the pool), the next layer's guesses start reading behind the misses."""
        cold = []
        for key in keys:
            if self.gpu.lookup(key) is not None:
                continue
            m = self.host.lookup(key)
            if m is not None:
                self.copy_in(key, m)
            else:
                cold.append(key)
        t = time.perf_counter()
        fetches = [self.loop.create_task(self._fetch(k)) for k in cold]  # misses submitted first
        if guess is not None:
            self.stager.read_ahead(*guess)
        if fetches:
            await gather_all(fetches)
            self.stats.stall_s += time.perf_counter() - t

    def _before_staging(self, layer: int) -> None:
        """Step 3b, between fetch and stage: `layer`'s misses are all queued on the copy stream
        and layer+1's guesses not yet: the next streamed layer's dense weights go on the link
        here, certain bytes behind this layer's misses and ahead of speculative ones
        (runtime/dense_stream.py; the model's `layer_weights`, a no-op when all is resident)."""
        dense = getattr(self.model, "layer_weights", None)  # None: no model given
        if dense is not None:
            dense.prefetch(layer + 1)

    def _views(self, keys: list[ExpertKey]) -> tuple[dict[int, ExpertWeights], dict[int, object]]:
        """Step 6: each expert's views of its slot (or transient buffer), and the copy events the
        compute stream must wait for."""
        views, events = {}, {}
        for key in keys:
            if key in self._transient:
                views[key.expert], events[key.expert] = self._transient[key]
                continue
            slot = self.gpu.slot_of(key)
            views[key.expert] = self.gpu.views(slot)
            if self.gpu.ready[slot] is not None:
                events[key.expert] = self.gpu.ready[slot]
        return views, events

    def copy_in(self, key: ExpertKey, m, *, required: bool = True) -> bool:
        """Give `key` a slot and queue its copy from host entry `m` (one ready event)."""
        if key in self.gpu or key in self._transient:
            return True
        self.graphs.slot_refilled()  # a slot may be refilled: the whole-step graphs' table would go stale
        slot = self.gpu.admit(key, required=False)
        if slot is None:  # every slot pinned: only a request wider than the slab gets here
            if required:
                buf, m.last_copy = self.gpu.fill_transient(m.data, pinned=m.registered)
                self._transient[key] = (relocate_views(parse_expert(m.data, self.layout), m.data, buf), m.last_copy)
            return required
        with self.tracer.span("copy", "expert", stream=self.device.copy_stream,
                              layer=key.layer, expert=key.expert, bytes=m.nbytes):
            self.gpu.fill(slot, m.data, pinned=m.registered)
        m.last_copy = self.gpu.ready[slot]  # a pool buffer is not reused before it
        # The slot's views (built once, from the first entry copied into it: same layout).
        self.gpu.build_views(slot, lambda t: relocate_views(parse_expert(m.data, self.layout), m.data, t))
        return True

    async def _fetch(self, key: ExpertKey) -> None:
        """A cold miss: copied the moment its entry arrives (no-op if staging got it first)."""
        self.copy_in(key, await self.host.entry(key))

    # ---- setup ------------------------------------------------------------------------

    def preload(self, keys=None) -> int:
        """Setup, not decode: copy `keys` (default every expert, in path order) into free device
        slots until the slab is full, e.g. to measure all-resident compute. Returns how many."""
        n = 0
        for key in self.every_key() if keys is None else keys:
            if len(self.gpu) >= self.gpu.slots:
                break
            if key not in self.gpu:
                m = self.loop.run_until_complete(self.host.entry(key))
                self.copy_in(key, m, required=False)
                n += 1
        self.retire.release()
        return n

    def warm_host(self, keys=None) -> int:
        """Setup, not decode: bring `keys` (default every expert) into the host tier (checksum
        on first map, page-lock), as many as it holds, concurrently; no device copies. A
        long-running process reaches this state by itself; benchmarks that measure steady-state
        decode with "experts in host RAM" start from it. Returns how many."""
        keys = [k for k in (self.every_key() if keys is None else keys) if self.host.lookup(k) is None]
        keys = keys[: max(0, self.host.capacity - len(self.host))]
        if keys:
            self.loop.run_until_complete(gather_all(self.host.entry(k) for k in keys))
        self.retire.release()
        return len(keys)

    def every_key(self) -> list[ExpertKey]:
        """Every routed expert of the model, in path order (layer, then expert)."""
        return [ExpertKey(l, e) for l in self.cfg.moe_layers for e in range(self.cfg.num_experts)]

    # ---- results and shutdown ----------------------------------------------------------

    def payload(self) -> dict:
        """The `--stats-json` object."""
        disk = self.host.kind == "pool" or self.options.host_tier != "auto"
        payload = self.stats.payload(retire=self.retire, device=self.device, staging=True, disk=disk,
                                     bank=(self.cfg.expert_files, self.layout.file_bytes))
        cpu_experts = self._cpu_expert_counts
        return payload | cpu_experts.as_dict() if cpu_experts is not None else payload

    def reset_stats(self, *, keep_prefill: bool = False) -> None:
        """Zero every counter (e.g. after warm-up steps), retirement and synchronizes included;
        `keep_prefill`: the prefill counters stay (the decode counters start after a prompt)."""
        self.stats.reset(keep_prefill=keep_prefill)
        self.retire.retired = self.retire.released = 0
        self.device.full_synchronizes = 0
        if self._cpu_expert_counts is not None:
            self._cpu_expert_counts.reset()

    @property
    def _cpu_expert_counts(self):
        """The CPU expert kernel's counters (`--cpu-experts`: HostExpertBackend), else None."""
        return getattr(getattr(self.model, "backend", None), "counts", None)

    def write_stats(self, path=None) -> dict:
        p = self.payload()
        path = path or self.options.stats_json
        if path:
            write_stats_json(path, p)
        return p

    def finish(self) -> None:
        """The run's end: `--stats-json` and `--trace` written when asked for, then `close`."""
        if self.options.stats_json:
            self.write_stats()
        if self.options.trace:
            self.tracer.write(self.options.trace)
        self.close()

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.graphs.drop()  # the graphs point into this runtime's slots
        # a step cut short (Ctrl-C) leaves its tasks pending: cancel them, else closing the loop
        # prints "Task was destroyed but it is pending!" for each, and settle() could wait on them
        leftover = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for t in leftover:
            t.cancel()
        self.loop.run_until_complete(settled(leftover))
        self.loop.run_until_complete(self.stager.settle())
        self.loop.run_until_complete(self.host.close())
        self.loop.close()
        self.gpu.release()  # else the slab lives as long as the runtime object does

    def __enter__(self) -> "StreamingRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
