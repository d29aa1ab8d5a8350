"""The decode step's device-side seam, on the CPU (the twin of tests/test_decode_graphs_gpu.py).

A decode step reads its cache lengths from the device (`ModelCache.device_lengths`,
the backends' `length` argument) and, with every expert resident, is answered with
`ResidentExperts` (the router's ids left on the device, a pointer table from `ExpertTable`).
Here: the length semantics of the torch backend against float64 numpy references, the device
lengths kept in step with the host ones, the pointer table, and the whole model answered with
ResidentExperts giving the bits of the ordinary answers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reference as ref
from streamrt.backends.expert_pointers import ExpertTable
from streamrt.backends.torch_backend import TorchBackend
from streamrt.checkpoint.reader import open_tree
from streamrt.checkpoint.synth import synth
from streamrt.expert_weights import NVFP4Matrix, ExpertWeights, ResidentExperts
from streamrt.loader import DirectExpertProvider, load_model
from streamrt.model.cache import ModelCache
from streamrt.model.model import run_sync
from streamrt.runtime.streams import CpuDevice


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("seam") / "tree"
    synth("tiny-k3.1-pro", root, fmt="streamrt", seed=3, progress=False)
    return open_tree(root)


def _length(n: int) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int32)


def test_select_topk_with_a_length_reads_only_the_valid_scores():
    g = torch.Generator().manual_seed(11)
    be = TorchBackend()
    cap, n = 48, 29
    scores = torch.randint(-4, 5, (cap,), generator=g).float()  # small integers: ties at the threshold
    scores[n:] = 1e9  # past the length: would win every top-k if read
    for k in (5, 12, 28):
        got = be.select_topk(scores, k, _length(n)).tolist()
        assert got == ref.select_topk(scores[:n].tolist(), k), k
    # at most k valid positions: every one, ascending (the unselected attention's order)
    assert be.select_topk(scores, 29, _length(n)).tolist() == list(range(n))
    assert be.select_topk(scores, 40, _length(n)).tolist() == list(range(n))


def test_mla_decode_and_indexer_with_a_length_match_float64():
    g = torch.Generator().manual_seed(12)
    be = TorchBackend()
    H, R, Dr, Hi, Di, cap, n = 3, 16, 8, 4, 8, 40, 23
    q_lat, q_rot = torch.randn(H, R, generator=g), torch.randn(H, Dr, generator=g)
    c, kr = torch.randn(cap, R, generator=g), torch.randn(cap, Dr, generator=g)
    c[n:], kr[n:] = 1e4, -1e4  # past the length: would dominate the softmax if read
    scale = 0.3
    got = be.mla_decode(q_lat, q_rot, c, kr, scale, None, _length(n)).double().numpy()
    s = (q_lat.double().numpy() @ c[:n].double().numpy().T + q_rot.double().numpy() @ kr[:n].double().numpy().T) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ c[:n].double().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # a selection longer than the length: only select[:length] is read
    sel = torch.cat((torch.arange(n), torch.full((cap - n,), cap - 1)))
    got_sel = be.mla_decode(q_lat, q_rot, c, kr, scale, sel, _length(n)).double().numpy()
    np.testing.assert_allclose(got_sel, want, rtol=1e-5, atol=1e-6)

    q, w, keys = torch.randn(Hi, Di, generator=g), torch.rand(Hi, generator=g) + 0.1, torch.randn(cap, Di, generator=g)
    scores = be.indexer_scores(q, w, keys, _length(n))
    np.testing.assert_allclose(scores[:n].double().numpy(), ref.indexer_scores(q.double().numpy(), w.double().numpy(),
                               keys[:n].double().numpy()), rtol=1e-5, atol=1e-6)


def test_decode_ops_take_rows_each_with_its_own_length():
    """The batched forms the model's decode calls (a leading row dim, lengths [B]) against
    float64 numpy, row by row, with the past-the-length cache poisoned."""
    g = torch.Generator().manual_seed(13)
    be = TorchBackend()
    B, H, R, Dr, Hi, Di, cap, k, dn, dv = 3, 2, 16, 8, 3, 8, 40, 6, 12, 10
    lengths = torch.tensor([5, 40, 23], dtype=torch.int32)
    q_lat, q_rot = torch.randn(B, H, R, generator=g), torch.randn(B, H, Dr, generator=g)
    c, kr = torch.randn(B, cap, R, generator=g), torch.randn(B, cap, Dr, generator=g)
    keys = torch.randn(B, cap, Di, generator=g)
    q, w = torch.randn(B, Hi, Di, generator=g), torch.rand(B, Hi, generator=g) + 0.1
    for b, n in enumerate(lengths.tolist()):
        c[b, n:], kr[b, n:], keys[b, n:] = 1e4, -1e4, 1e4
    w_scale = 0.37  # the indexer's head-weight scale, applied by the score op at decode
    scores = be.indexer_scores(q, w, keys, lengths, w_scale)
    sel = be.select_topk(scores, k, lengths)
    out = be.mla_decode(q_lat, q_rot, c, kr, 0.3, sel, lengths)
    assert scores.shape == (B, cap) and sel.shape == (B, k) and out.shape == (B, H, R)
    for b, n in enumerate(lengths.tolist()):
        want_scores = ref.indexer_scores(q[b].double().numpy(), w[b].double().numpy() * w_scale,
                                         keys[b, :n].double().numpy())
        np.testing.assert_allclose(scores[b, :n].double().numpy(), want_scores, rtol=1e-5, atol=1e-6)
        want_sel = ref.select_topk(scores[b, :n].tolist(), k) if n > k else list(range(n))
        assert sel[b, : min(k, n)].tolist() == want_sel, b
        cs, ks = c[b, want_sel].double().numpy(), kr[b, want_sel].double().numpy()
        s = (q_lat[b].double().numpy() @ cs.T + q_rot[b].double().numpy() @ ks.T) * 0.3
        p = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(out[b].double().numpy(), (p / p.sum(-1, keepdims=True)) @ cs, rtol=1e-5, atol=1e-6)

    W = torch.randn(H * (dn + dv), R, generator=g).to(torch.bfloat16).view(H, dn + dv, R)  # kv_b_proj as stored
    qn, o_lat = torch.randn(B, H, dn, generator=g), torch.randn(B, H, R, generator=g)
    W64 = W.double().numpy()
    np.testing.assert_allclose(be.mla_absorb(qn, W[:, :dn]).double().numpy(),
                               np.einsum("bhd,hdr->bhr", qn.double().numpy(), W64[:, :dn]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(be.mla_expand(o_lat, W[:, dn:]).double().numpy(),
                               np.einsum("hvr,bhr->bhv", W64[:, dn:], o_lat.double().numpy()), rtol=1e-5, atol=1e-5)


def test_device_lengths_follow_the_host_lengths(tree):
    model = load_model(tree, "cpu")
    a, b = model.new_cache(), model.new_cache()
    assert a.device_lengths.tolist() == [0] and a.device_lengths.dtype == torch.int32
    a.advance(5)
    b.advance(2)
    b.advance(1)
    both = ModelCache.stack([a, b])
    assert both.lengths == [5, 3] and both.device_lengths.tolist() == [5, 3]
    assert both.select([1]).device_lengths.tolist() == [3] and both.clone().device_lengths.tolist() == [5, 3]
    both.advance(2, on_device=False)  # a graph's replay advanced the device copy itself
    assert both.lengths == [7, 5] and both.device_lengths.tolist() == [5, 3]
    both.lengths = [1, 2]
    assert both.device_lengths.tolist() == [1, 2]


def _views(tree):
    return {(l, e): tree.load_expert(l, e) for l in tree.config.moe_layers for e in range(tree.config.num_experts)}


def test_expert_table_holds_each_experts_section_addresses_checked_once(tree):
    cfg = tree.config
    views = _views(tree)
    table = ExpertTable(cfg.moe_layers, cfg.num_experts, cfg.routed_expert_hidden_size, torch.device("cpu"))
    layer = cfg.moe_layers[-1]
    assert not table.complete()
    for (l, e), ew in views.items():
        table.place(l, e, ew)
    assert table.complete()
    table.upload()
    for e in (0, cfg.num_experts - 1):
        ew = views[(layer, e)]
        want = [m.data_ptr() for mat in (ew.gate, ew.up, ew.down) for m in (mat.packed, mat.scales, mat.global_scale)]
        assert table.layer(layer)[e].tolist() == want
    assert table.inter == views[(layer, 0)].gate.packed.shape[0]
    bad = views[(layer, 0)]
    wrong = ExpertWeights(NVFP4Matrix(bad.gate.packed.float(), bad.gate.scales, bad.gate.global_scale), bad.up,
                          bad.down)
    with pytest.raises(ValueError, match=r"expert 0 gate\.packed"):
        table.place(layer, 0, wrong)
    with pytest.raises(ValueError, match="not a MoE layer"):
        table.place(-1, 0, bad)
    with pytest.raises(ValueError, match="outside"):
        table.place(layer, cfg.num_experts, bad)


def _addresses(ew):
    return [m.data_ptr() for mat in (ew.gate, ew.up, ew.down) for m in (mat.packed, mat.scales, mat.global_scale)]


def test_refresh_rewrites_one_layers_rows_of_the_routed_experts(tree):
    """A streamed step's table (segment graphs): each router's experts are written where the
    scheduler put them, then the layer's rows copied to the device; the other layers and rows
    stay as they were."""
    cfg = tree.config
    views = _views(tree)
    table = ExpertTable(cfg.moe_layers, cfg.num_experts, cfg.routed_expert_hidden_size, torch.device("cpu"))
    first, last = cfg.moe_layers[0], cfg.moe_layers[-1]
    for e in range(cfg.num_experts):
        table.place(last, e, views[(last, e)])
    table.upload()
    before = table.layer(last).clone()
    from streamrt.backends.expert_pointers import expert_pointers

    routed = {3: views[(first, 3)], 7: views[(first, 7)]}
    table.refresh(first, {e: expert_pointers(ew, e, cfg.routed_expert_hidden_size, torch.device("cpu"))
                          for e, ew in routed.items()})
    for e in range(cfg.num_experts):
        want = _addresses(routed[e]) if e in routed else [0] * 9
        assert table.layer(first)[e].tolist() == want, e
    assert torch.equal(table.layer(last), before)
    moved = {3: views[(first, 11)]}  # expert 3 now in another slot: its row follows, 7's stays
    table.refresh(first, {3: expert_pointers(moved[3], 3, cfg.routed_expert_hidden_size, torch.device("cpu"))})
    assert table.layer(first)[3].tolist() == _addresses(moved[3])
    assert table.layer(first)[7].tolist() == _addresses(routed[7])


def test_segment_graphs_place_takes_every_routed_expert_and_checks_it(tree):
    """Between two segments the answer's experts go into the table: each one taken (the
    compute stream waits for its copy), its pointers checked; an expert of another
    intermediate size, or scales off the tensor-core alignment the graphs were captured
    for, is refused with the layer and expert named."""
    from types import SimpleNamespace

    from streamrt.errors import StreamrtError
    from streamrt.model.moe import ExpertRequest
    from streamrt.runtime.segment_graphs import SegmentGraphs
    from streamrt.runtime.streamed import StreamedExperts
    from streamrt.runtime.streams import DONE, CpuDevice

    cfg = tree.config
    views = _views(tree)
    model = load_model(tree, "cpu")
    model.backend = SimpleNamespace(name="nvrtc", captures_decode=True)  # only the host side runs here
    seg = SegmentGraphs(model, tensor_core=True)
    layer = cfg.moe_layers[1]
    ids = torch.tensor([[5, 2, 9, 2]])
    req = ExpertRequest(layer, ids, torch.rand(1, 4), torch.randn(1, cfg.hidden_size))

    def answer(ws):
        return StreamedExperts(CpuDevice(), ws, {e: DONE for e in ws}, host_ids=ids)  # routed: 2, 5, 9

    a = answer({e: views[(layer, e)] for e in (2, 5, 9)})
    seg._place(req, a)
    assert not any(a.pending(e) for e in (2, 5, 9))  # each taken: its copy waited for
    for e in (2, 5, 9):
        assert seg.table.layer(layer)[e].tolist() == _addresses(views[(layer, e)])
    with pytest.raises(StreamrtError, match=rf"layer {layer} experts \[9\]"):
        seg._place(req, answer({e: views[(layer, e)] for e in (2, 5)}))
    ew = views[(layer, 9)]
    short = ExpertWeights(*(NVFP4Matrix(m.packed[:32], m.scales[:32], m.global_scale[:32]) for m in (ew.gate, ew.up)),
                          NVFP4Matrix(ew.down.packed[:, :16], ew.down.scales[:, :2], ew.down.global_scale))
    with pytest.raises(StreamrtError, match=rf"layer {layer} expert 9: intermediate size 32"):
        seg._place(req, answer({2: views[(layer, 2)], 5: views[(layer, 5)], 9: _contiguous(short)}))
    shifted = _shifted_scales(ew)
    with pytest.raises(StreamrtError, match=rf"layer {layer} expert 9: scales not 8-byte aligned"):
        seg._place(req, answer({2: views[(layer, 2)], 5: views[(layer, 5)], 9: shifted}))


class _CudaNamedCpu(CpuDevice):
    """The runtime's "cuda" branches (segment graphs installed), CPU tensors underneath."""

    kind = "cuda"


class _NamedNvrtc(TorchBackend):
    """The torch backend claiming to capture decode steps, as nvrtc does: SegmentGraphs' host side
    on the CPU (the torch backend takes table answers too, reading their ids on the host)."""

    name = "nvrtc"
    captures_decode = True


def test_segment_graphs_first_step_answers_from_the_table_and_a_failed_capture_stays_op_by_op(tree):
    """A streamed step of a new shape runs op by op with every router answered from the table
    (the kernels a capture takes on nvrtc; the torch backend here reads the views beside it):
    the bits of the ordinary answers. The capture that follows
    fails here (no CUDA): the reason is kept, the step's logits stand, later steps run op by
    op with the same bits, and the host lengths count each step once."""
    from streamrt.runtime.segment_graphs import SegmentGraphs
    from streamrt.runtime.streamed import StreamedExperts
    from streamrt.runtime.streams import DONE, CpuDevice

    cfg = tree.config
    views = _views(tree)
    model = load_model(tree, "cpu", backend=_NamedNvrtc())
    seg = SegmentGraphs(model, tensor_core=True)
    served = []

    def streamed(req):  # the scheduler's answer: slot views, a copy event per expert
        served.append(req.layer)
        host = req.ids.cpu()
        ws = {e: views[(req.layer, e)] for e in host.unique().tolist()}
        return StreamedExperts(CpuDevice(), ws, {e: DONE for e in ws}, host_ids=host)

    direct = DirectExpertProvider(tree)
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, cfg.vocab_size - 1, (11,), generator=g)
    steps = torch.randint(0, cfg.vocab_size - 1, (4, 1, 1), generator=g)
    with torch.no_grad():
        plain, graphed = model.new_cache(), model.new_cache()
        for c in (plain, graphed):
            model(prompt, c, direct, last_only=True)
        for t in range(steps.shape[0]):
            want = model(steps[t], plain, direct)
            got = run_sync(seg.steps(steps[t], graphed, False), streamed)
            assert torch.equal(want, got), f"step {t}"
            assert graphed.lengths == plain.lengths, f"step {t}"
            if t == 0:
                assert served == list(cfg.moe_layers) and "cuda" in (seg.refused or "").lower() and seg.captures == 0
                assert seg.table.layer(cfg.moe_layers[0]).abs().sum() > 0  # the first step filled it
    assert seg.replays == 0 and len(served) == steps.shape[0] * len(cfg.moe_layers)


def test_runtime_installs_segment_graphs_while_streaming_and_keeps_them_across_misses(tree):
    """The runtime's side on the CPU: under --cuda-graphs auto, with experts streaming, a
    device that says "cuda" and a backend that captures decode steps, decode steps go through
    SegmentGraphs (chosen once, kept while slots are refilled; the runtime's own, in its
    `Forward`, never set on the model); here the capture fails (no CUDA), so the
    steps run op by op through the scheduler's answers, to the reference's bits."""
    from streamrt.runtime.options import RuntimeOptions
    from streamrt.runtime.scheduler import StreamingRuntime
    from streamrt.runtime.segment_graphs import SegmentGraphs

    cfg = tree.config
    model = load_model(tree, "cpu", backend=_NamedNvrtc())
    direct = DirectExpertProvider(tree)
    g = torch.Generator().manual_seed(13)
    prompt = torch.randint(0, cfg.vocab_size - 1, (9,), generator=g)
    steps = torch.randint(0, cfg.vocab_size - 1, (5, 1, 1), generator=g)
    with torch.no_grad():
        ref_cache = model.new_cache()
        model(prompt, ref_cache, direct, last_only=True)
        want = [model(steps[t], ref_cache, direct) for t in range(steps.shape[0])]
        opts = RuntimeOptions(device="cpu", gpu_experts=cfg.expert_files // 4)  # --cuda-graphs auto
        with StreamingRuntime(tree, model, opts, device=_CudaNamedCpu(), workers=2) as rt:
            cache = model.new_cache()
            rt.run(model.forward_steps(prompt, cache, last_only=True))
            assert rt.forward.graphs is None  # prefill: no graphs
            misses_before = rt.stats.device_misses
            got, installed = [], None
            for t in range(steps.shape[0]):
                got.append(rt.run(model.forward_steps(steps[t], cache), tokens=1))
                installed = installed or rt.forward.graphs
                assert rt.forward.graphs is installed, f"step {t}: the segment graphs were replaced"
            assert isinstance(installed, SegmentGraphs) and "cuda" in (installed.refused or "").lower()
            assert rt.graphs_line == f"CUDA graphs refused, decode steps run op by op: {installed.refused}"
            assert rt.stage_depth == 2  # the steps run op by op, and stage as op-by-op steps do
            assert rt.stats.device_misses > misses_before  # decode steps refilled slots: the graphs stayed
        assert rt.forward.graphs is None and not hasattr(model, "decode_graphs")  # closing drops them
    for t, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"step {t}"




def test_segment_graphs_first_step_in_lockstep_with_a_prefill(tree):
    """serve's step on the runtime's "cuda" path (CPU tensors underneath): two decode rows and
    another prompt's prefill go through one lockstep, so each router's answer is the merged
    request's, cut to the decode rows. The decode step of a new shape is answered from the
    segment table with those cut answers (the capture after it fails here, no CUDA): every
    row's logits are those of running each forward alone."""
    from streamrt.model.lockstep import lockstep
    from streamrt.model.cache import ModelCache
    from streamrt.runtime.options import RuntimeOptions
    from streamrt.runtime.scheduler import StreamingRuntime
    from streamrt.runtime.segment_graphs import SegmentGraphs

    cfg = tree.config
    model = load_model(tree, "cpu", backend=_NamedNvrtc())
    direct = DirectExpertProvider(tree)
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, cfg.vocab_size - 1, (n,), generator=g) for n in (6, 10, 13)]
    step = torch.randint(0, cfg.vocab_size - 1, (2, 1), generator=g)
    with torch.no_grad():
        alone = [model.new_cache() for _ in prompts]
        want_prefill = model(prompts[2], alone[2], direct, last_only=True)
        want_rows = []
        for r in range(2):
            model(prompts[r], alone[r], direct, last_only=True)
            want_rows.append(model(step[r : r + 1], alone[r], direct))
        opts = RuntimeOptions(device="cpu", gpu_experts=cfg.expert_files // 3)  # --cuda-graphs auto
        with StreamingRuntime(tree, model, opts, device=_CudaNamedCpu(), workers=2) as rt:
            rows = [model.new_cache() for _ in range(2)]
            for r in range(2):
                rt.run(model.forward_steps(prompts[r], rows[r], last_only=True))
            batch, other = ModelCache.stack(rows), model.new_cache()
            decoded, prefilled = rt.run(lockstep([model.forward_steps(step, batch),
                                                  model.forward_steps(prompts[2], other, last_only=True)]), tokens=2)
            assert isinstance(rt.forward.graphs, SegmentGraphs) and rt.forward.graphs.refused is not None
    for r in range(2):
        assert torch.equal(decoded[r : r + 1], want_rows[r]), f"decode row {r}"
    assert torch.equal(prefilled, want_prefill)

def test_stage_depth_is_one_while_segment_graphs_replay_unless_the_flag_says(tree):
    """--stage-depth unset: one staged copy in flight while segment graphs replay (the host waits
    on the GPU then, and deeper queues put wrong guesses ahead of real misses), two op by op or
    once a capture was refused; the flag, when given, wins."""
    from streamrt.runtime.options import RuntimeOptions
    from streamrt.runtime.scheduler import StreamingRuntime
    from streamrt.runtime.segment_graphs import SegmentGraphs

    model = load_model(tree, "cpu", backend=_NamedNvrtc())
    for flag, replaying, refused_then in ((None, 1, 2), (3, 3, 3)):
        with StreamingRuntime(tree, model, RuntimeOptions(device="cpu", stage_depth=flag)) as rt:
            assert rt.stage_depth == (flag or 2)  # op by op
            rt.forward.graphs = graphs = SegmentGraphs(model, tensor_core=False)
            assert rt.stage_depth == replaying
            graphs.refused = "RuntimeError: capture failed"
            assert rt.stage_depth == refused_then
            rt.forward.graphs = None

def _contiguous(ew):
    c = lambda m: NVFP4Matrix(m.packed.contiguous(), m.scales.contiguous(), m.global_scale.contiguous())  # noqa: E731
    return ExpertWeights(c(ew.gate), c(ew.up), c(ew.down))


def _shifted_scales(ew):
    """The same expert with its gate scales 2 bytes past an 8-byte boundary (the NVFP4 checks
    need 2-byte alignment, the tensor-core kernels 8)."""
    sc = ew.gate.scales
    buf = torch.empty(sc.numel() + 16, dtype=torch.uint8)
    off = (-buf.data_ptr()) % 8 + 2
    moved = buf[off : off + sc.numel()].view(sc.shape)
    moved.copy_(sc)
    return ExpertWeights(NVFP4Matrix(ew.gate.packed, moved, ew.gate.global_scale), ew.up, ew.down)


def test_resident_answers_give_the_bits_of_host_answers(tree):
    """Prefill, then decode past the cache's first capacity (64) and the indexer's top-k, one row
    and two rows at different lengths: the model answered with ResidentExperts (device ids,
    pointer table) against the ordinary host-id answers, bit for bit."""
    cfg = tree.config
    model = load_model(tree, "cpu")
    views = _views(tree)
    table = ExpertTable(cfg.moe_layers, cfg.num_experts, cfg.routed_expert_hidden_size, torch.device("cpu"))
    for (l, e), ew in views.items():
        table.place(l, e, ew)
    table.upload()
    per_layer = {l: {e: views[(l, e)] for e in range(cfg.num_experts)} for l in cfg.moe_layers}
    answered = []

    def resident(req):
        answered.append(req.layer)
        return ResidentExperts(per_layer[req.layer], table.layer(req.layer), table.inter, req.ids, req.layer)

    direct = DirectExpertProvider(tree)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab_size - 1, (n,), generator=g) for n in (9, 21)]
    steps = torch.randint(0, cfg.vocab_size - 1, (70, 2), generator=g)
    with torch.no_grad():
        for rows in ([0], [0, 1]):
            caches = {}
            for name, provider in (("host", direct), ("resident", resident)):
                cs = [model.new_cache() for _ in rows]
                for c, r in zip(cs, rows):
                    model(prompts[r], c, provider, last_only=True)
                cache = ModelCache.stack(cs)
                caches[name] = [model(steps[t, : len(rows), None], cache, provider) for t in range(steps.shape[0])]
            assert max(cache.lengths) > 64 and min(cache.lengths) > cfg.indexer.topk
            for t, (a, b) in enumerate(zip(caches["host"], caches["resident"])):
                assert torch.equal(a, b), f"rows {rows}, step {t}: resident answers changed the logits"
    assert answered and set(answered) == set(cfg.moe_layers)


def test_cuda_graphs_flag_is_checked_and_cpu_steps_stay_op_by_op(tree):
    from streamrt.errors import StreamrtError
    from streamrt.runtime.options import RuntimeOptions
    from streamrt.runtime.scheduler import StreamingRuntime

    with pytest.raises(StreamrtError, match="cuda.graphs"):
        RuntimeOptions(cuda_graphs="always")
    model = load_model(tree, "cpu")
    for graphs, slots in (("auto", tree.config.expert_files), ("auto", tree.config.expert_files // 3),
                          ("resident", tree.config.expert_files // 3)):
        with StreamingRuntime(tree, model, RuntimeOptions(device="cpu", gpu_experts=slots, cuda_graphs=graphs)) as rt:
            rt.preload()
            cache = model.new_cache()
            with torch.no_grad():
                rt.run(model.forward_steps(torch.tensor([3, 5, 7]), cache, last_only=True))
                rt.run(model.forward_steps(torch.tensor([[9]]), cache), tokens=1)
            assert rt.forward.graphs is None and rt.stats.graph_steps == 0, graphs  # CUDA only
