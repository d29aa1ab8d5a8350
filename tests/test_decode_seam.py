"""The decode step's device-side seam, on the CPU (the twin of tests/test_decode_graphs_gpu.py).

Issue 24: a decode step reads its cache lengths from the device (`ModelCache.device_lengths`,
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
    c, kr, keys = torch.randn(B, cap, R, generator=g), torch.randn(B, cap, Dr, generator=g), torch.randn(B, cap, Di, generator=g)
    q, w = torch.randn(B, Hi, Di, generator=g), torch.rand(B, Hi, generator=g) + 0.1
    for b, n in enumerate(lengths.tolist()):
        c[b, n:], kr[b, n:], keys[b, n:] = 1e4, -1e4, 1e4
    scores = be.indexer_scores(q, w, keys, lengths)
    sel = be.select_topk(scores, k, lengths)
    out = be.mla_decode(q_lat, q_rot, c, kr, 0.3, sel, lengths)
    assert scores.shape == (B, cap) and sel.shape == (B, k) and out.shape == (B, H, R)
    for b, n in enumerate(lengths.tolist()):
        want_scores = ref.indexer_scores(q[b].double().numpy(), w[b].double().numpy(), keys[b, :n].double().numpy())
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
    wrong = ExpertWeights(NVFP4Matrix(bad.gate.packed.float(), bad.gate.scales, bad.gate.global_scale), bad.up, bad.down)
    with pytest.raises(ValueError, match=r"expert 0 gate\.packed"):
        table.place(layer, 0, wrong)
    with pytest.raises(ValueError, match="not a MoE layer"):
        table.place(-1, 0, bad)
    with pytest.raises(ValueError, match="outside"):
        table.place(layer, cfg.num_experts, bad)


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
    with StreamingRuntime(tree, model, RuntimeOptions(device="cpu", gpu_experts=tree.config.expert_files)) as rt:
        rt.preload()
        cache = model.new_cache()
        with torch.no_grad():
            rt.run(model.forward_steps(torch.tensor([3, 5, 7]), cache, last_only=True))
            rt.run(model.forward_steps(torch.tensor([[9]]), cache), tokens=1)
        assert model.decode_graphs is None and rt.stats.graph_steps == 0  # CUDA only
