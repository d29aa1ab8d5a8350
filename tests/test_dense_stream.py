"""Dense streaming (streamrt/runtime/dense_stream.py): streamed layers give the same bits as
resident ones, the ring's events order every copy behind its slot's last use, and the copy order
with a scheduler's hook is misses, dense, guesses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from streamrt.backends.torch_backend import TorchBackend
from streamrt.checkpoint.names import RELEASED_F32
from streamrt.config import load_config
from streamrt.errors import StreamrtError
from streamrt.loader import DictExpertProvider, DirectExpertProvider, dense_placement, load_model, stream_dense
from streamrt.model.model import RESIDENT, KimiLinearForCausalLM, run_sync
from streamrt.model.synthetic import init_random_, random_experts
from streamrt.plan.placement import plan_placement
from streamrt.runtime.dense_stream import DENSE_TRACK, DenseStream, streamed_tensors
from streamrt.runtime.streams import CpuDevice

CFG = "tiny-k3.1-pro"
PROMPT = [3, 17, 101, 42, 7, 250]
DECODE = [5, 77, 9]


def _model(device="cpu") -> KimiLinearForCausalLM:
    """Random tiny K3.1 Pro, bf16 with the released F32 tensors fp32 (norm gains ~ 1 + 0.1 N)."""
    cfg = load_config(CFG)
    m = KimiLinearForCausalLM(cfg, backend=TorchBackend())
    init_random_(m, seed=1)
    m.to(torch.bfloat16)
    for name, t in list(m.named_parameters()) + list(m.named_buffers()):
        if name.endswith(RELEASED_F32):
            t.data = t.data.float()
    return m.eval().requires_grad_(False).to(device)


@pytest.fixture(scope="module")
def provider():
    return DictExpertProvider(random_experts(load_config(CFG), seed=2))


def _decode(model, provider, *, chunk: int | None = 4) -> list[torch.Tensor]:
    """A chunked prefill and three decode steps: every logit row, on the host."""
    model.prefill_chunk = chunk
    dev = model.lm_head.weight.device
    cache = model.new_cache(1, dev)
    out = [run_sync(model.forward_steps(torch.tensor(PROMPT), cache), provider)]
    for t in DECODE:
        out.append(run_sync(model.forward_steps(torch.tensor([[t]]), cache), provider))
    return [x.float().cpu() for x in out]


@pytest.fixture(scope="module")
def resident_logits(provider):
    return _decode(_model(), provider)


def _plan(cfg, streamed, buffers):
    return dataclasses.replace(plan_placement(cfg, 1 << 40), streamed_layers=tuple(streamed), buffers=buffers)


@pytest.mark.parametrize("buffers", [2, 3])
@pytest.mark.parametrize("which", ["some", "all"])
def test_streamed_logits_are_bit_identical(provider, resident_logits, buffers, which):
    model = _model()
    cfg = model.config
    streamed = range(2, cfg.num_layers) if which == "some" else range(cfg.num_layers)
    ds = stream_dense(model, _plan(cfg, streamed, buffers), CpuDevice())
    assert model.layer_weights is ds and ds.device_bytes == buffers * ds.slot_bytes
    got = _decode(model, provider)
    assert all(torch.equal(a, b) for a, b in zip(got, resident_logits))
    n = len(ds.order)
    # the prompt's two chunks (4 + 2 tokens) in one pass per layer (--prefill-order layer), three steps
    assert ds.stats.waits == n * (1 + len(DECODE))
    # every layer was issued ahead, but layer 0 of the first forward when it streams itself
    assert ds.stats.late == (1 if which == "all" else 0)


def test_every_forward_copies_each_streamed_layer_once(provider):
    model = _model()
    cfg = model.config
    ds = stream_dense(model, _plan(cfg, range(1, cfg.num_layers), 2), CpuDevice())
    _decode(model, provider, chunk=None)
    forwards = 1 + len(DECODE)
    # each forward copies every streamed layer once; the last one prefetched the next step's first layer
    assert ds.stats.copies == forwards * len(ds.order) + 1
    assert ds.stats.bytes_h2d == forwards * ds.streamed_bytes + ds._layers[ds.order[0]].nbytes


def test_layers_that_fit_the_ring_are_copied_once(provider, resident_logits):
    model = _model()
    ds = stream_dense(model, _plan(model.config, (4, 6), 3), CpuDevice())
    assert torch.equal(_decode(model, provider)[-1], resident_logits[-1])
    assert ds.stats.per_layer == {4: 1, 6: 1}


def test_streamed_bytes_are_the_plans(provider):
    """What streams is the plan's inventory: every dense tensor of the layer but its router."""
    model = _model()
    cfg = model.config
    plan = plan_placement(cfg, 1 << 40)
    ds = stream_dense(model, _plan(cfg, range(cfg.num_layers), 2), CpuDevice())
    for i in range(cfg.num_layers):
        raw = sum(t.numel() * t.element_size() for _, t in streamed_tensors(model.model.layers[i]))
        assert raw == plan.layer_bytes[i]
        assert ds._layers[i].nbytes >= raw
    gate = model.model.layers[1].block_sparse_moe.gate.weight
    assert gate.untyped_storage().data_ptr() != ds._slab.untyped_storage().data_ptr()  # routers stay put


class _Ev:
    def __init__(self, kind, n):
        self.kind, self.n = kind, n

    def query(self):
        return True

    def synchronize(self):
        pass


class _RecordingDevice(CpuDevice):
    """The CPU twin, with named events and a log of every ordering call."""

    def __init__(self):
        super().__init__()
        self.log, self._n = [], 0

    def _ev(self, kind):
        self._n += 1
        return _Ev(kind, self._n)

    def record_copy_event(self):
        ev = self._ev("copy")
        self.log.append(("record", ev))
        return ev

    def record_compute_event(self):
        ev = self._ev("compute")
        self.log.append(("record", ev))
        return ev

    def copy_wait(self, ev):
        self.log.append(("copy_wait", ev))

    def compute_wait(self, ev):
        self.log.append(("compute_wait", ev))

    def copy_h2d(self, dst, src, *, pinned, transient=False):
        self.log.append(("copy", dst.data_ptr()))
        super().copy_h2d(dst, src, pinned=pinned)


@pytest.mark.parametrize("buffers", [2, 3])
def test_a_slot_is_refilled_only_behind_its_last_use(provider, buffers):
    """Replay the ordering calls: every copy into a slot waits (copy stream) on the compute event
    recorded after that slot's previous layer; every acquire waits (compute stream) on the event
    of the copy that filled its slot last."""
    model = _model()
    dev = _RecordingDevice()
    ds = stream_dense(model, _plan(model.config, range(model.config.num_layers), buffers), dev)
    slot_of = {ds._slab[s].data_ptr(): s for s in range(buffers)}
    filled_by, last_use, latest_copy = {}, {}, {}  # copy event -> slot; slot -> compute event; slot -> copy event
    waited, copied_into, computing = None, None, None
    copies = 0
    _decode(model, provider)
    for kind, x in dev.log:
        if kind == "copy_wait":
            waited = x
        elif kind == "copy":
            s = copied_into = slot_of[x]
            if s in last_use:
                assert waited is last_use[s], "a slot was refilled without waiting for its last use"
            waited = None
            copies += 1
        elif kind == "record" and x.kind == "copy":
            filled_by[x], latest_copy[copied_into] = copied_into, x
        elif kind == "compute_wait":
            computing = filled_by[x]
            assert latest_copy[computing] is x  # the copy that holds this layer now, no older one
        elif kind == "record" and x.kind == "compute":
            last_use[computing] = x
    assert copies == ds.stats.copies and ds.stats.copies > 2 * buffers


def test_the_scheduler_hook_puts_dense_between_misses_and_guesses(provider, resident_logits):
    """The scheduler's hook (`prefetch(layer + 1)` after the misses, before staging): layer l+1's
    dense copy is issued after layer l's misses and before layer l+1's guesses, and acquire no
    longer issues it a layer early."""
    model = _model()
    cfg = model.config
    dev = _RecordingDevice()
    ds = stream_dense(model, _plan(cfg, range(cfg.num_layers), 2), dev)
    events = []

    def scheduler(req):  # what StreamingRuntime.serve does, in its order
        events.append(("misses", req.layer))
        experts = provider(req)
        n = len(dev.log)
        model.layer_weights.prefetch(req.layer + 1)
        if any(k == "copy" for k, _ in dev.log[n:]):
            events.append(("dense", req.layer + 1))
        events.append(("guesses", req.layer + 1))
        return experts

    got = _decode(model, scheduler)
    assert all(torch.equal(a, b) for a, b in zip(got, resident_logits))
    # from the hook's first call on (the first MoE layer of the first forward prefetched its next
    # layer itself), every MoE layer's next layer copies behind its misses, ahead of its guesses
    pairs = list(zip(events, events[1:]))[3:]
    assert all(b == ("dense", a[1] + 1) for a, b in pairs if a[0] == "misses" and a[1] + 1 < cfg.num_layers)
    assert ds.scheduled and ds.stats.late <= 1


def test_loader_streams_the_plans_layers_through_the_runtime(default_model_copy):
    """load_model with a plan from --gpu-mem: the streamed layers go through the ring, the
    embedding stays on the host; the streaming runtime's logits equal the resident model's."""
    from streamrt.checkpoint.reader import open_tree
    from streamrt.runtime.options import RuntimeOptions
    from streamrt.runtime.scheduler import StreamingRuntime

    tree = open_tree(default_model_copy)
    cfg = tree.config
    full = plan_placement(cfg, 1 << 40)
    budget = sum(full.fixed_bytes.values()) - full.fixed_bytes["embedding"] + sum(full.layer_bytes[:3])
    budget += 2 * max(full.layer_bytes[3:])  # layers 0-2 resident, the others streaming
    plan = dense_placement(cfg, budget, CpuDevice())
    r = len(plan.resident_layers)
    assert r >= 3 and plan.streamed_layers == tuple(range(r, cfg.num_layers)) and plan.streamed_layers
    assert dense_placement(cfg, None, CpuDevice()) is None  # no budget on the CPU twin: nothing streams
    ids = torch.tensor(PROMPT)

    def logits(model):
        rt = StreamingRuntime(tree, model, RuntimeOptions(device="cpu", gpu_experts=64), device=CpuDevice())
        try:
            cache = model.new_cache(1)
            out = [rt.run(model.forward_steps(ids, cache))]
            out += [rt.run(model.forward_steps(torch.tensor([[t]]), cache), tokens=1) for t in DECODE]
            return out
        finally:
            rt.close()

    ref = logits(load_model(tree, "cpu", dtype=None))
    model = load_model(tree, "cpu", dtype=None, placement=plan)
    assert isinstance(model.layer_weights, DenseStream) and model.layer_weights.order == plan.streamed_layers
    got = logits(model)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    resident = load_model(tree, "cpu", dtype=None, placement=full)  # a plan that streams nothing
    assert resident.layer_weights is RESIDENT
    direct = DirectExpertProvider(tree)
    assert torch.equal(run_sync(resident.forward_steps(ids), direct), run_sync(model.forward_steps(ids), direct))


def test_forwards_in_lockstep_share_each_layer(provider):
    """Two forwards driven as one (model/lockstep.py, as the server does) reach every layer
    together: the layer's buffer is refilled only after both released it; same bits as resident."""
    from streamrt.model.lockstep import lockstep

    def both(model):
        a, b = model.new_cache(1), model.new_cache(1)
        first = run_sync(lockstep([model.forward_steps(torch.tensor(PROMPT), a),
                                   model.forward_steps(torch.tensor(PROMPT[::-1]), b)]), provider)
        step = run_sync(lockstep([model.forward_steps(torch.tensor([[5]]), a),
                                  model.forward_steps(torch.tensor([[9]]), b)]), provider)
        return first + step

    ref = both(_model())
    model = _model()
    stream_dense(model, _plan(model.config, range(model.config.num_layers), 2), CpuDevice())
    model.prefill_chunk = None
    assert all(torch.equal(x, y) for x, y in zip(both(model), ref))


def test_a_forward_closed_inside_a_layer_releases_it(provider, resident_logits):
    model = _model()
    ds = stream_dense(model, _plan(model.config, range(model.config.num_layers), 2), CpuDevice())
    gen = model.forward_steps(torch.tensor(PROMPT), model.new_cache(1))
    next(gen)  # suspended inside layer 1 (its router spoke)
    gen.close()
    assert ds._users == {}
    assert all(torch.equal(a, b) for a, b in zip(_decode(model, provider), resident_logits))


def test_refusals_are_one_line():
    model = _model()
    with pytest.raises(StreamrtError, match="at least 2 device buffers"):
        DenseStream(model, (1, 2), CpuDevice(), buffers=1)
    with pytest.raises(StreamrtError, match="no layer"):
        DenseStream(model, (), CpuDevice())
    with pytest.raises(StreamrtError, match=r"0\.\.8"):
        DenseStream(model, (3, 9), CpuDevice())


def test_dense_copies_have_their_own_trace_track(provider):
    from streamrt.trace import Tracer

    model = _model()
    tracer = Tracer(event_factory=None)
    stream_dense(model, _plan(model.config, (2, 3, 4), 2), CpuDevice(), tracer=tracer)
    tracer.begin_step()
    _decode(model, provider)
    tracer.end_step()
    spans = [e for e in tracer.events if e.get("cat") == DENSE_TRACK and e.get("ph") == "X"]
    assert spans and {e["args"]["layer"] for e in spans} == {2, 3, 4}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu on the device)")
@pytest.mark.parametrize("buffers", [2, 3])
@pytest.mark.parametrize("which", ["some", "all"])
def test_streamed_logits_are_bit_identical_on_cuda(buffers, which):
    """Real async copies on the copy stream, events, page-locked host memory: the same bits as
    the resident model on the GPU, and no full synchronize; then again with each copy delayed on
    the copy stream and each layer's compute delayed on the compute stream (spin kernels), so a
    missing wait on either side would read or overwrite a buffer too early."""
    from streamrt.loader import _to
    from streamrt.runtime.streams import CudaDevice

    spin = 2_000_000  # GPU clock cycles, ~1 ms

    class SlowCopies(CudaDevice):
        slow = False

        def copy_h2d(self, dst, src, *, pinned, transient=False):
            if self.slow:
                with torch.cuda.stream(self.copy_stream):
                    torch.cuda._sleep(spin)
            super().copy_h2d(dst, src, pinned=pinned, transient=transient)

    cfg = load_config(CFG)
    prov = DictExpertProvider({k: _to(ew, "cuda") for k, ew in random_experts(cfg, seed=2).items()})
    ref = _decode(_model("cuda"), prov)
    model = _model("cpu")
    dev = SlowCopies()
    streamed = range(2, cfg.num_layers) if which == "some" else range(cfg.num_layers)
    ds = stream_dense(model, _plan(cfg, streamed, buffers), dev)
    model.to(dev.torch_device)
    assert ds.pinned and ds._slab.is_cuda
    got = _decode(model, prov)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))

    acquire = ds.acquire

    def slow_acquire(layer):  # the layer's compute starts late: its buffer stays busy longer
        acquire(layer)
        torch.cuda._sleep(spin)

    dev.slow, ds.acquire = True, slow_acquire
    got = _decode(model, prov)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert dev.full_synchronizes == 0 and ds.stats.copies > len(ds.order)
    ds.close()


def test_serve_runner_lockstep_with_streamed_layers_and_multi_pass_pieces(default_model_copy):
    """serve's step with dense layers streaming: prompt pieces of one and of several passes through
    the layers (longer than one model chunk) go in lockstep; the forwards start together, so they
    reach every streamed layer together, and every piece's logits equal the all-resident runner's."""
    import argparse

    from streamrt.checkpoint.reader import open_tree
    from streamrt.runtime.options import add_runtime_flags
    from streamrt.serve.runner import ModelRunner

    cfg = open_tree(default_model_copy).config
    full = plan_placement(cfg, 1 << 40, batch=2)  # the runner plans for its batch
    budget = sum(full.fixed_bytes.values()) - full.fixed_bytes["embedding"] + sum(full.layer_bytes[:3])
    budget += 2 * max(full.layer_bytes[3:])

    def pieces(flags):
        p = argparse.ArgumentParser()
        add_runtime_flags(p)
        runner = ModelRunner(default_model_copy, p.parse_args(["--device", "cpu", *flags]), max_batch=2)
        runner.model.prefill_chunk = 8
        try:
            long, short = runner.new_cache(), runner.new_cache()
            _, out = runner.loop.run_until_complete(
                runner.step([], None, [(list(range(3, 23)), long), ([5, 6, 7], short)])
            )
            return runner, out
        finally:
            runner.close()

    streamed, got = pieces(["--gpu-mem", str(budget), "--gpu-experts", "64"])
    assert isinstance(streamed.model.layer_weights, DenseStream)
    resident, want = pieces(["--gpu-experts", "64"])
    assert resident.model.layer_weights is RESIDENT
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
