"""Dense streaming: the dense weights of the layers the placement plan streams live in host
memory and are copied to the GPU, one layer ahead, into a ring of `buffers` device slots.

    host     one page-locked arena (cudaHostRegister'd anonymous memory on CUDA), one contiguous,
             4096-aligned range per streamed layer, every tensor of the layer 256-aligned in it
    device   `buffers` slots (2: double, 3: triple buffer), each as large as the largest streamed
             layer. Streamed layer number p (its position in the plan's list) always lives in slot
             p % buffers, so its parameters are permanent views of that slot: the model reads
             `self.q_proj.weight` as ever, and the bytes behind the view change from layer to layer
    events   a layer's copy records a copy-stream event; `acquire(l)` makes the compute stream wait
             on that event only (GPU-side). `release(l)` records a compute-stream event after the
             layer's last use; the next copy into that slot waits on it on the copy stream, so a
             slot is overwritten only once the layer that used it has finished computing. The host
             never blocks, on CUDA or on the CPU twin (where copies are synchronous)

The order on the one link (the copy stream executes in issue order): layer l's routed misses,
then layer l+1's dense weights, then layer l+1's staged guesses: dense bytes are certain, guesses
speculative. The scheduler gets that order by calling `prefetch(layer + 1)` between fetching
layer l's misses and staging layer l+1 (its one hook); from its first call on it owns the
prefetch after MoE layers. Without a scheduler (`run_sync`, the plain providers) `acquire(l)`
issues the next streamed layers itself, so copies still overlap compute. A prefetch past the last
layer wraps to the next step's first streamed layer (it copies while lm_head and sampling run).

Forwards driven in lockstep (model/lockstep.py, the server's prefill beside its decode step) reach
each layer together: a layer's buffer is released when the last of them releases it.

The routers (`block_sparse_moe.gate.*`) never stream: the predictor applies layer l+1's router to
layer l's FFN input before layer l+1's dense weights are on the link (placement.py counts them
resident).

Same arithmetic, same bits: the ops read the same values from another address.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from streamrt.errors import StreamrtError
from streamrt.trace import NullTracer

TENSOR_ALIGN = 256  # every tensor's offset in a slot: what vectorised kernels and cuBLAS like
LAYER_ALIGN = 4096  # every layer's range in the host arena: page-aligned DMA sources
DENSE_TRACK = "copy-dense"  # the trace track of dense copies (expert copies are on "copy")
RESIDENT_SUFFIXES = ("block_sparse_moe.gate.weight", "block_sparse_moe.gate.e_score_correction_bias")


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def streamed_tensors(layer: nn.Module) -> list[tuple[str, Tensor]]:
    """A decoder layer's tensors that stream (parameters and buffers, routers excluded), in
    module order: the same list on every call."""
    named = list(layer.named_parameters(recurse=True)) + list(layer.named_buffers(recurse=True))
    return [(n, t) for n, t in named if not n.endswith(RESIDENT_SUFFIXES)]


@dataclass
class DenseStats:
    copies: int = 0  # layer copies issued on the copy stream
    bytes_h2d: int = 0  # their bytes
    late: int = 0  # acquires that found their layer not issued ahead (copied then: no overlap)
    waits: int = 0  # compute-stream waits on a dense copy's event
    per_layer: dict[int, int] = field(default_factory=dict)  # copies per layer

    def reset(self) -> None:
        self.copies = self.bytes_h2d = self.late = self.waits = 0
        self.per_layer.clear()


@dataclass(frozen=True)
class _Layer:
    index: int  # the model's layer
    slot: int  # its device buffer: its position among the streamed layers, mod buffers
    nbytes: int  # its range in the host arena and in the slot
    host: Tensor  # uint8 view of the arena


class DenseStream:
    """The model's `layer_weights` when layers stream (model.py calls acquire / release around
    every layer; the scheduler calls prefetch). See the module docstring."""

    def __init__(self, model, layers, device, *, buffers: int = 2, tracer=None) -> None:
        cfg = model.config
        layers = tuple(sorted(set(int(i) for i in layers)))
        if not layers:
            raise StreamrtError("dense streaming: no layer to stream")
        if layers[0] < 0 or layers[-1] >= cfg.num_layers:
            raise StreamrtError(
                f"dense streaming: layers must lie in 0..{cfg.num_layers - 1}, got {layers[0]}..{layers[-1]}"
            )
        if buffers < 2:
            raise StreamrtError(f"dense streaming needs at least 2 device buffers (layer l+1 copies while l computes), "
                                f"got {buffers}")
        self.device, self.buffers = device, buffers
        self.tracer = tracer or NullTracer()
        self.stats = DenseStats()
        self.moe_layers = frozenset(cfg.moe_layers)
        self.order = layers  # streamed layers, in layer order
        self.scheduled = False  # a scheduler issues the prefetch after MoE layers (first prefetch() call)

        # Layout: each tensor 256-aligned inside its layer's range; the slot fits the largest layer.
        plans = []
        for i in layers:
            offs, off = [], 0
            for name, t in streamed_tensors(model.model.layers[i]):
                if t.device.type == "meta":
                    raise StreamrtError(
                        f"dense streaming: layer {i} tensor {name} has no data (load the weights first)"
                    )
                offs.append((name, t, off))
                off = _round_up(off + t.numel() * t.element_size(), TENSOR_ALIGN)
            plans.append((i, offs, off))
        self.slot_bytes = _round_up(max(n for _, _, n in plans), LAYER_ALIGN)
        self.host_bytes = sum(_round_up(n, LAYER_ALIGN) for _, _, n in plans)

        # Host: one arena, page-locked on CUDA; each layer's tensors copied in once, here.
        self._arena, self.pinned = device.alloc_host_arena(self.host_bytes)
        self._slab = device.alloc_slab(buffers, self.slot_bytes)  # [buffers, slot_bytes] uint8
        self._layers: dict[int, _Layer] = {}
        base = 0
        with torch.no_grad():
            for pos, (i, offs, n) in enumerate(plans):
                host = self._arena[base : base + n]
                slot = pos % buffers
                for name, t, off in offs:
                    nb = t.numel() * t.element_size()
                    src = t.detach().contiguous().reshape(-1).view(torch.uint8)
                    host[off : off + nb].copy_(src.cpu())
                    view = self._slab[slot, off : off + nb].view(t.dtype).view(t.shape)
                    t.data = view  # the Parameter / buffer object stays; its bytes are the slot's
                self._layers[i] = _Layer(i, slot, n, host)
                base += _round_up(n, LAYER_ALIGN)
        self._holds: list[int | None] = [None] * buffers  # slot -> layer copied (or being copied) in
        self._ready: list[object | None] = [None] * buffers  # slot -> that copy's event
        self._freed: list[object | None] = [None] * buffers  # slot -> compute event after its last use
        self._pending: list[int | None] = [None] * buffers  # slot -> layer to copy once the slot is released
        self._unused = [False] * buffers  # slot -> copied in ahead and not acquired yet: not to be overwritten
        # layer -> forwards between its acquire and release (several when forwards run in lockstep,
        # model/lockstep.py: they reach a layer together)
        self._users: dict[int, int] = {}

    # ---- the hook the model calls (model.py `LayerWeights`) ---------------------------------

    def acquire(self, layer: int) -> None:
        """Layer `layer` is about to compute: its weights' copy is issued (if nobody did) and the
        compute stream waits on that copy's event; the next streamed layers are prefetched (the
        one after a MoE layer only while no scheduler does it)."""
        L = self._layers.get(layer)
        if L is not None:
            if self._holds[L.slot] != layer:
                if self._holds[L.slot] in self._users:
                    raise StreamrtError(
                        f"dense streaming: layer {layer} needs device buffer {L.slot}, which layer "
                        f"{self._holds[L.slot]} of another forward still uses; forwards in lockstep must reach "
                        f"each streamed layer together")
                self.stats.late += 1
                self._issue(L)
            with self.tracer.span("stall", "dense-wait", stream=self.device.compute_stream, layer=layer):
                self.device.compute_wait(self._ready[L.slot])
            self.stats.waits += 1
            self._unused[L.slot] = False
            self._users[layer] = self._users.get(layer, 0) + 1
        if not (self.scheduled and layer in self.moe_layers):
            self._ahead(layer + 1)

    def release(self, layer: int) -> None:
        """Layer `layer`'s compute is queued: its slot may be overwritten once the compute stream
        passes this point (one compute event); a copy waiting for the slot is issued now."""
        L = self._layers.get(layer)
        if L is None or layer not in self._users:
            return
        self._users[layer] -= 1
        if self._users[layer]:
            return  # another forward still computes this layer
        del self._users[layer]
        self._freed[L.slot] = self.device.record_compute_event()
        nxt = self._pending[L.slot]
        if nxt is not None:
            self._pending[L.slot] = None
            self._issue(self._layers[nxt])

    def prefetch(self, layer: int) -> None:
        """The scheduler's hook, between layer `layer - 1`'s routed misses and `layer`'s staged
        guesses: queue the dense weights of the next streamed layers from `layer` on (at most
        `buffers - 1`, wrapping to the next step) on the copy stream. Nothing when they are
        already there or on their way; a slot still in use is copied into when it is released."""
        self.scheduled = True
        self._ahead(layer)

    # ---- the ring ---------------------------------------------------------------------------

    def _ahead(self, layer: int) -> None:
        """Issue (or schedule) the next `buffers - 1` streamed layers at or after `layer`."""
        order, n = self.order, len(self.order)
        start = next((p for p, i in enumerate(order) if i >= layer), 0)  # past the end: the next step
        for k in range(min(self.buffers - 1, n)):
            L = self._layers[order[(start + k) % n]]
            if self._holds[L.slot] == L.index or self._pending[L.slot] == L.index:
                continue
            if self._unused[L.slot]:
                break  # the slot holds a nearer layer not computed yet (the ring wrapped): later
            if self._holds[L.slot] in self._users:
                self._pending[L.slot] = L.index  # copied the moment the occupant is released
                continue
            self._issue(L)

    def _issue(self, L: _Layer) -> None:
        """Copy layer L into its slot on the copy stream, behind the slot's last use."""
        s, dev = L.slot, self.device
        self._pending[s] = None if self._pending[s] == L.index else self._pending[s]
        if self._freed[s] is not None:
            dev.copy_wait(self._freed[s])  # GPU-side: the copy stream waits, the host does not
        with self.tracer.span(DENSE_TRACK, "dense", stream=dev.copy_stream, layer=L.index, bytes=L.nbytes):
            dev.copy_h2d(self._slab[s, : L.nbytes], L.host, pinned=self.pinned)
        self._ready[s] = dev.record_copy_event()
        self._holds[s], self._unused[s] = L.index, True
        self.stats.copies += 1
        self.stats.bytes_h2d += L.nbytes
        self.stats.per_layer[L.index] = self.stats.per_layer.get(L.index, 0) + 1

    # ---- results and shutdown ---------------------------------------------------------------

    @property
    def streamed_bytes(self) -> int:
        """Bytes copied per pass over every streamed layer (one decode step)."""
        return sum(L.nbytes for L in self._layers.values())

    @property
    def device_bytes(self) -> int:
        return self.buffers * self.slot_bytes

    def line(self) -> str:
        """One line for a start message."""
        return (f"dense streaming: {len(self.order)} layers ({self.streamed_bytes / 2**30:.2f} GiB per token) from "
                f"{'page-locked' if self.pinned else 'pageable'} host memory through {self.buffers} device buffers "
                f"x {self.slot_bytes / 2**30:.2f} GiB")

    def close(self) -> None:
        """Give back the host arena (after every queued copy from it has executed)."""
        if self._arena is None:
            return
        for ev in self._ready:
            if ev is not None:
                ev.synchronize()
        self.device.free_host_arena(self._arena, self.pinned)
        self._arena = None
