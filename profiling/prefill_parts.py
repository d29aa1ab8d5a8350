"""Per-model-part accounting for profile_step.py's prefill mode (profiling only: nothing in
streamrt/ is edited; the parts are monkeypatched in for the profiled runs and restored after).

`Parts(model)` wraps module forwards, backend methods and two module functions in
`torch.profiler.record_function("part:<name>")` ranges, and times each range's exclusive host
time with perf_counter (optionally with a device synchronize at every part boundary, so a part's
time is its real elapsed time, serialized). `breakdown(events)` turns a torch.profiler event list
into per-part GPU time, kernels, top-level ops and op time, attributing every event to the
innermost part range around it (kernels: through the op or range that launched them).

Parts (group/detail; the group is the table's row):
  kda/proj      KimiDeltaAttention.forward minus the below (projections, gate, l2norm, o-norm)
  kda/conv      short_conv_prefill            kda/chunked   kda_chunked (the grouped sub-chunk solve)
  mla/proj      KimiMLAAttention.forward minus the below
  mla/indexer   LightningIndexer.from_projections (its projections run in mla/proj's shared GEMVs)
  mla/attention backend.mla_prefill minus index_select
  mla/index_select  backend._index_select (indexer scores + exact top-k per query tile)
  moe_experts   backend.expert_ffn (routed experts)
  moe_rest/router backend.route (the top-k; its logits are in LatentMoE's shared GEMVs)
  moe_rest/shared the shared experts' SiTU-GLU and down (gate / up: LatentMoE's shared GEMVs)
  moe_rest/latent rest of LatentMoE
  dense_ffn     the dense layers' GLU MLP     attnres   attn_res (every mix, incl. the output one)
  norms         input / post-attention layernorms and the final norm
  lm_head       backend.linear with the lm_head weight
  glue/layer    DecoderLayer.forward_steps minus the above (residual adds)
  glue/model    the model forward minus the layers (embedding, last-row gather)
  (outside)     everything else: the runtime's per-layer expert service, the driver loop
"""

from __future__ import annotations

import functools
import re
import time
from collections import defaultdict

import torch
from torch.profiler import record_function

from streamrt.backends.torch_backend import TorchBackend

PREFIX = "part:"
_RUNTIME_API = re.compile(r"^(cuda|cu|hip)[A-Z]")  # runtime / driver API events (host side of a launch)
# ops that never launch a kernel (metadata only): a leaf op not among these is a kernel on CUDA
VIEW_OPS = frozenset("aten::" + n for n in (
    "view", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "slice", "select", "transpose", "t", "numpy_T",
    "permute", "expand", "expand_as", "as_strided", "alias", "detach", "_unsafe_view", "split", "chunk", "unbind",
    "narrow", "empty", "empty_strided", "empty_like", "lift_fresh", "result_type", "is_nonzero", "resolve_conj",
    "resolve_neg", "view_as", "contiguous", "to", "_to_copy", "diagonal", "unflatten", "flatten", "movedim"))


class Parts:
    """Install with `with Parts(model, sync=...) as parts:`; `parts.self_s` {part: exclusive s},
    `parts.calls` {part: ranges entered}. `sync`: called at every part boundary (None: never)."""

    def __init__(self, model, sync=None):
        self.model, self.sync = model, sync
        self.self_s: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list] = []  # [name, start, child time]
        self._undo: list = []

    # ---- ranges ------------------------------------------------------------------------

    def _enter(self, name: str):
        if self.sync is not None:
            self.sync()
        rf = record_function(PREFIX + name)
        rf.__enter__()
        self._stack.append([name, time.perf_counter(), 0.0, rf])
        self.calls[name] += 1

    def _exit(self):
        if self.sync is not None:
            self.sync()
        name, t0, child, rf = self._stack.pop()
        dt = time.perf_counter() - t0
        rf.__exit__(None, None, None)
        self.self_s[name] += dt - child
        if self._stack:
            self._stack[-1][2] += dt

    def wrap(self, fn, name: str):
        @functools.wraps(fn)
        def w(*a, **k):
            self._enter(name)
            try:
                return fn(*a, **k)
            finally:
                self._exit()

        return w

    def wrap_gen(self, fn, name: str):
        """A generator function: the range is open while the generator runs, closed while it is
        suspended at a yield (the runtime serves the request outside it)."""

        @functools.wraps(fn)
        def w(*a, **k):
            gen = fn(*a, **k)
            send, exc = None, None
            while True:
                self._enter(name)
                try:
                    req = gen.throw(exc) if exc is not None else gen.send(send)
                except StopIteration as stop:
                    return stop.value
                finally:
                    self._exit()
                send, exc = None, None
                try:
                    send = yield req
                except GeneratorExit:
                    gen.close()
                    raise
                except BaseException as e:  # noqa: BLE001 - handed to the inner generator
                    exc = e

        return w

    # ---- patching ----------------------------------------------------------------------

    def _set(self, obj, attr: str, value) -> None:
        had = attr in vars(obj)
        old = vars(obj).get(attr)
        setattr(obj, attr, value)
        self._undo.append((obj, attr, had, old))

    def _patch(self, obj, attr: str, name: str, gen: bool = False) -> None:
        fn = getattr(obj, attr)
        self._set(obj, attr, (self.wrap_gen if gen else self.wrap)(fn, name))

    def install(self) -> "Parts":
        import streamrt.model.kda as kda_mod
        import streamrt.model.model as model_mod
        from streamrt.model.kda import KimiDeltaAttention
        from streamrt.model.mla import KimiMLAAttention
        from streamrt.model.moe import LatentMoE

        m = self.model
        # backend methods, on the backend's class (the prefill view is a copy of the instance)
        bcls = type(m.backend)
        for attr, name in (("expert_ffn", "moe_experts"), ("route", "moe_rest/router"),
                           ("mla_prefill", "mla/attention"), ("_index_select", "mla/index_select")):
            if hasattr(bcls, attr):
                self._patch(bcls, attr, name)
        lm_w = m.lm_head.weight
        linear = bcls.linear

        @functools.wraps(linear)
        def lin(be, x, w, *add):
            if w is not lm_w:
                return linear(be, x, w, *add)
            self._enter("lm_head")
            try:
                return linear(be, x, w, *add)
            finally:
                self._exit()

        self._set(bcls, "linear", lin)
        # module functions called through their module's globals
        self._patch(kda_mod, "kda_chunked", "kda/chunked")
        self._patch(kda_mod, "short_conv_prefill", "kda/conv")
        self._patch(model_mod, "attn_res", "attnres")
        # generator forwards, on their classes
        self._patch(type(m), "_forward", "glue/model", gen=True)
        self._patch(type(m.model.layers[0]), "forward_steps", "glue/layer", gen=True)
        self._patch(LatentMoE, "forward_steps", "moe_rest/latent", gen=True)
        # module instances
        for layer in m.model.layers:
            a = layer.self_attn
            if isinstance(a, KimiDeltaAttention):
                self._patch(a, "forward", "kda/proj")
            elif isinstance(a, KimiMLAAttention):
                self._patch(a, "forward", "mla/proj")
                if a.indexer is not None:
                    self._patch(a.indexer, "from_projections", "mla/indexer")
            for n in ("input_layernorm", "post_attention_layernorm"):
                self._patch(getattr(layer, n), "forward", "norms")
            if hasattr(layer, "mlp"):
                self._patch(layer.mlp, "forward", "dense_ffn")
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None and moe.shared_experts is not None:
                self._patch(moe.shared_experts, "down", "moe_rest/shared")
        self._patch(m.model.norm, "forward", "norms")
        return self

    def remove(self) -> None:
        while self._undo:
            obj, attr, had, old = self._undo.pop()
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)

    def __enter__(self) -> "Parts":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()


def group(part: str) -> str:
    return part.split("/")[0]


def breakdown(events) -> dict:
    """torch.profiler events -> {part: {"gpu_us", "kernels", "launches", "ops", "all_ops", "leaf_ops", "op_us",
    "ranges",
    "op_names": {name: [count, us]}, "kernel_names": {name: [count, us]}}} plus the key "_total"
    {"gpu_us", "kernels"} over every device event. A part's ops are the top-level torch ops issued
    inside it (not the ops those call; all_ops counts those too; leaf_ops the ops that call none and
    are not views: about the kernels they would launch on CUDA); op_us their inclusive host time
    (CPU: their compute)."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    dev = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    memo: dict[int, tuple[str, bool]] = {}

    def ctx(p) -> tuple[str, bool]:
        """For an event whose parent is p: (innermost part around it, whether a torch op sits
        between it and that part)."""
        if p is None:
            return "(outside)", False
        r = memo.get(id(p))
        if r is None:
            if p.name.startswith(PREFIX):
                r = (p.name[len(PREFIX):], False)
            else:
                part, under = ctx(p.cpu_parent)
                r = (part, under or not _RUNTIME_API.match(p.name))
            memo[id(p)] = r
        return r

    def owner(e) -> tuple[str, bool]:
        return ctx(e.cpu_parent)

    stats: dict[str, dict] = defaultdict(
        lambda: {
            "gpu_us": 0.0,
            "kernels": 0,
            "launches": 0,
            "ops": 0,
            "op_us": 0.0,
            "all_ops": 0,
            "leaf_ops": 0,
            "ranges": 0,
            "op_names": defaultdict(lambda: [0, 0.0]),
            "kernel_names": defaultdict(lambda: [0, 0.0]),
        }
    )
    for e in cpu:
        if e.name.startswith(PREFIX):
            own = e.name[len(PREFIX):]
            stats[own]["ranges"] += 1
        else:
            own, under_op = owner(e)
            st = stats[own]
            if _RUNTIME_API.match(e.name):  # the host side of a launch, copy, sync
                st["launches"] += "Launch" in e.name
            else:
                st["all_ops"] += 1
                if e.name not in VIEW_OPS and not any(not _RUNTIME_API.match(c.name) for c in e.cpu_children):
                    st["leaf_ops"] += 1  # does the work itself: about one kernel each on CUDA
                if not under_op:  # a top-level op: what the Python code issued
                    dur = e.time_range.end - e.time_range.start
                    st["ops"] += 1
                    st["op_us"] += dur
                    on = st["op_names"][e.name]
                    on[0] += 1
                    on[1] += dur
        for k in getattr(e, "kernels", ()) or ():
            if k.name.startswith(PREFIX):  # the GPU-side span of a part range, not a kernel
                continue
            st = stats[own]
            st["kernels"] += 1
            st["gpu_us"] += k.duration
            kn = st["kernel_names"][k.name]
            kn[0] += 1
            kn[1] += k.duration
    out = dict(stats)
    kern = [e for e in dev if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(PREFIX)]
    out["_total"] = {"gpu_us": sum(e.time_range.end - e.time_range.start for e in kern), "kernels": len(kern)}
    return out



class NvrtcLinearTwin(TorchBackend):
    """The torch backend shaped like the nvrtc backend's prefill, for CPU op counts: the CUDA
    tiles (q_tile, key_block) and nvrtc's `linear` (one GEMM, weights converted to fp32 in row
    blocks, instead of fixed 64-row tiles). Norms, AttnRes, the router and the experts stay torch
    ops (the nvrtc backend runs each norm / mix / router as one kernel, experts as grouped GEMMs)."""

    name = "torch(nvrtc-twin)"

    def __init__(self):
        _, q_tile, key_block = TorchBackend.TILES["cuda"]
        super().__init__(q_tile=q_tile, key_block=key_block)

    def linear(self, x, w):
        x = x.float()
        if x.shape[0] == 0 or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            return super().linear(x, w)
        rows = max(1, self.block_elems // max(1, w.shape[1]))
        parts = [x @ w[r0 : r0 + rows].float().T for r0 in range(0, w.shape[0], rows)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
