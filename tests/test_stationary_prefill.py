"""Expert-stationary prefill (model/stationary.py): the same logits and caches as chunk-major
prefill bit for bit (K3 and K3.1 Pro, indexer selection active, several chunks), one expert
load per expert the prompt routes at each MoE layer when the union fits the device slots
(counted independently from the routers' choices), prefill stats apart from decode's, and peak
memory linear in the prompt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamrt.checkpoint.reader import open_tree
from streamrt.checkpoint.synth import synth
from streamrt.loader import load_model
from streamrt.model.cache import KDACache
from streamrt.runtime.options import RuntimeOptions
from streamrt.runtime.scheduler import StreamingRuntime
from streamrt.store.keys import ExpertKey
from tiny_models import random_ids, random_model

ROOT = Path(__file__).resolve().parents[1]


def build(name: str):
    return random_model(name, 3, 7)


def tokens(cfg, n: int, seed: int) -> torch.Tensor:
    return random_ids(cfg, n, seed)


def prefill(model, provider, ids, chunk: int, order: str, *, start=None, last_only=False):
    """Prefill ids [B, T] in `order` (optionally after a first prefill `start`) -> (logits, cache, requests)."""
    cache, requests = model.new_cache(ids.shape[0]), []

    def recording(req):
        requests.append((req.layer, req.ids.clone()))
        return provider(req)

    model.prefill_order = order
    try:
        with torch.no_grad():
            if start is not None:
                model(start, cache, provider, prefill_chunk=chunk)
            logits = model(ids, cache, recording, prefill_chunk=chunk, last_only=last_only)
    finally:
        model.prefill_order = "layer"
    return logits, cache, requests


def caches_equal(a, b) -> bool:
    for la, lb in zip(a.layers, b.layers):
        ta, tb = la.tensors(), lb.tensors()
        if isinstance(la, KDACache):
            ta = ta + ([la.anchor_state] if la.anchor_state is not None else []) + list(la.pending or [])
            tb = tb + ([lb.anchor_state] if lb.anchor_state is not None else []) + list(lb.pending or [])
        if len(ta) != len(tb) or not all(torch.equal(x, y) for x, y in zip(ta, tb)):
            return False
    return a.lengths == b.lengths


@pytest.mark.parametrize("name", ["tiny-k3", "tiny-k3.1-pro"])
def test_chunk_major_is_chunk_invariant(name):
    """The property stationary prefill rests on: chunk-major logits do not depend on the chunk."""
    cfg, model, prov = build(name)
    ids = tokens(cfg, 90, 1)[None]
    whole, _, _ = prefill(model, prov, ids, 90, "chunk")
    for chunk in (13, 32):
        got, _, _ = prefill(model, prov, ids, chunk, "chunk")
        assert torch.equal(got, whole), chunk


@pytest.mark.parametrize("name", ["tiny-k3", "tiny-k3.1-pro"])
@pytest.mark.parametrize("chunk", [9, 32])
def test_stationary_equals_chunk_major_bit_for_bit(name, chunk):
    """90 tokens (> 5x the indexer's top-k on K3.1 Pro, so the selection decides most positions)
    in chunks of 9 (KDA's chunk boundaries fall inside prefill chunks) or 32: every position's
    logits, every layer's cache (KDA state and anchor, MLA latent, indexer keys), and the
    routers' choices are equal."""
    cfg, model, prov = build(name)
    if cfg.indexer is not None:
        assert 90 >= 5 * cfg.indexer.topk
    ids = tokens(cfg, 90, 2)[None]
    ref, ref_cache, ref_reqs = prefill(model, prov, ids, chunk, "chunk")
    got, cache, reqs = prefill(model, prov, ids, chunk, "layer")
    assert torch.equal(got, ref)
    assert caches_equal(cache, ref_cache)
    moe = list(cfg.moe_layers)
    assert [layer for layer, _ in reqs] == moe  # one request per MoE layer, the whole prompt's rows
    for layer, ids_all in reqs:
        chunk_ids = torch.cat([i for lay, i in ref_reqs if lay == layer])
        assert torch.equal(ids_all, chunk_ids)


def test_stationary_continues_a_cache_batched_and_last_only():
    """Two rows, a prefill continuing a cache of 20 positions, last position only: equal too."""
    cfg, model, prov = build("tiny-k3.1-pro")
    start = torch.stack([tokens(cfg, 20, 5), tokens(cfg, 20, 6)])
    ids = torch.stack([tokens(cfg, 50, 7), tokens(cfg, 50, 8)])
    ref, ref_cache, _ = prefill(model, prov, ids, 16, "chunk", start=start, last_only=True)
    got, cache, _ = prefill(model, prov, ids, 16, "layer", start=start, last_only=True)
    assert got.shape == (2, 1, cfg.vocab_size) and torch.equal(got, ref)
    assert caches_equal(cache, ref_cache)


# ---- through the streaming runtime --------------------------------------------------------


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny") / "tree"
    synth("tiny-k3.1-pro", root, fmt="streamrt", seed=4, workers=1, progress=False)
    return open_tree(root)


def _loads_by_layer(rt, monkeypatch) -> dict[int, list[int]]:
    """Each expert copied host -> device, by layer, as the runtime issues the copies."""
    loads: dict[int, list[int]] = {}
    copy_in = rt.copy_in

    def recording(key: ExpertKey, m, *, required: bool = True) -> bool:
        if key not in rt.gpu and key not in rt._transient:
            loads.setdefault(key.layer, []).append(key.expert)
        return copy_in(key, m, required=required)

    monkeypatch.setattr(rt, "copy_in", recording)
    return loads


@pytest.mark.parametrize("order", ["layer", "chunk"])
def test_expert_loads_per_layer_equal_the_unique_experts_routed(tree, monkeypatch, order):
    """Slots for one layer's experts only (32 of 8 x 32), nothing staged: stationary loads each
    expert the prompt routes at a layer exactly once; chunk-major reloads what later layers
    evicted between chunks. Unique experts counted here from the routers' recorded choices."""
    model = load_model(tree, "cpu", dtype=None)
    cfg = tree.config
    ids = tokens(cfg, 60, 9)[None]
    routed = {layer: set() for layer in cfg.moe_layers}
    per_chunk = {layer: 0 for layer in cfg.moe_layers}
    opts = RuntimeOptions(device="cpu", gpu_experts=cfg.num_experts, stage_max=0)
    with StreamingRuntime(tree, model, opts, workers=2) as rt:
        loads = _loads_by_layer(rt, monkeypatch)
        seen = []
        model.prefill_order = order
        try:
            with torch.no_grad():
                gen = model.forward_steps(ids, model.new_cache(1), prefill_chunk=12)
                rt.run(_recording(gen, seen))
        finally:
            model.prefill_order = "layer"
        p = rt.payload()["prefill"]
    for layer, chosen in seen:
        routed[layer] |= set(chosen.reshape(-1).tolist())
        per_chunk[layer] += len(set(chosen.reshape(-1).tolist()))
    assert set(loads) == set(cfg.moe_layers)
    if order == "layer":
        assert {layer: sorted(e) for layer, e in loads.items()} == {layer: sorted(e) for layer, e in routed.items()}
        assert p["layer_requests"] == len(cfg.moe_layers)
    else:  # each chunk loads its layer's experts that later layers evicted: more than once each
        assert all(len(set(loads[layer])) == len(routed[layer]) for layer in cfg.moe_layers)
        assert all(len(loads[layer]) <= per_chunk[layer] for layer in cfg.moe_layers)
        assert sum(map(len, loads.values())) > sum(map(len, routed.values()))
        assert p["layer_requests"] == 5 * len(cfg.moe_layers)
    assert p["experts_loaded"] == sum(map(len, loads.values()))
    assert p["bytes_h2d"] == p["experts_loaded"] * tree.layout.file_bytes


def _recording(gen, seen):
    """Pass a forward's requests through, keeping each (layer, routed ids)."""
    answer = None
    try:
        while True:
            req = gen.send(answer)
            seen.append((req.layer, req.ids.clone()))
            answer = yield req
    except StopIteration as stop:
        return stop.value


# ---- memory -----------------------------------------------------------------------------


def _peak(length: int, chunk: int, order: str) -> dict:
    from streamrt.default_model import default_model_dir

    cmd = [sys.executable, str(ROOT / "profiling" / "bench_prefill.py"), "--child", "--length", str(length),
           "--prefill-chunk", str(chunk), "--threads", "1", "--model", str(default_model_dir(lambda m: None)),
           "--prefill-order", order]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, p.stderr[-2000:]
    return json.loads(line[0][7:])


def test_stationary_peak_rss_is_linear_in_the_prompt():
    """The embedded model, chunks of 128, 512 -> 2,048 tokens (its context) in fresh processes:
    the prefill's own increment (peak - RSS after loading) grows at most 4x x 1.5 plus the cache."""
    a, b = _peak(512, 128, "layer"), _peak(2048, 128, "layer")
    inc_a, inc_b = a["rss_peak"] - a["rss_loaded"], b["rss_peak"] - b["rss_loaded"]
    assert inc_b < 1.5 * 4 * max(inc_a, 8 << 20) + b["cache_bytes"], (a, b)
    assert b["length"] == 2048 and a["top1"] >= 0


def test_a_union_wider_than_the_slots_is_fetched_once_and_exact(tree, monkeypatch):
    """8 device slots, a layer's union of up to 32 experts: the overflow goes to transient device
    buffers, each routed expert still crosses the link once per layer, and the logits equal the
    chunk-major run's on the same runtime settings."""
    model = load_model(tree, "cpu", dtype=None)
    cfg = tree.config
    ids = tokens(cfg, 48, 10)[None]
    logits, loads = {}, {}
    for order in ("chunk", "layer"):
        with StreamingRuntime(tree, model, RuntimeOptions(device="cpu", gpu_experts=8, stage_max=0), workers=2) as rt:
            loads[order], seen = _loads_by_layer(rt, monkeypatch), []
            model.prefill_order = order
            try:
                with torch.no_grad():
                    gen = model.forward_steps(ids, model.new_cache(1), prefill_chunk=16)
                    logits[order] = rt.run(_recording(gen, seen))
            finally:
                model.prefill_order = "layer"
        routed = {}
        for layer, chosen in seen:
            routed.setdefault(layer, set()).update(chosen.reshape(-1).tolist())
        if order == "layer":
            assert {la: sorted(e) for la, e in loads[order].items()} == {la: sorted(e) for la, e in routed.items()}
            assert max(len(e) for e in routed.values()) > 8  # wider than the slab
    assert torch.equal(logits["layer"], logits["chunk"])
    assert sum(map(len, loads["chunk"].values())) > sum(map(len, loads["layer"].values()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["torch", "nvrtc"])
@pytest.mark.parametrize("name", ["tiny-k3", "tiny-k3.1-pro"])
def test_cuda_stationary_equals_chunk_major_through_the_runtime(name, backend, tmp_path_factory, monkeypatch):
    """On the GPU, bf16 weights, each backend, through the streaming runtime with a third of the
    bank in slots: the same logits bit for bit and each routed expert copied once per layer."""
    from streamrt.backends.nvrtc import NvrtcBackend

    root = tmp_path_factory.mktemp(name) / "tree"
    synth(name, root, fmt="streamrt", seed=1, progress=False)
    tree = open_tree(root)
    cfg = tree.config
    be = NvrtcBackend() if backend == "nvrtc" else None
    model = load_model(tree, "cuda", dtype=torch.bfloat16, backend=be)
    ids = tokens(cfg, 90, 12)[None].cuda()
    out, loaded = {}, {}
    for order in ("chunk", "layer"):
        opts = RuntimeOptions(device="cuda", gpu_experts=cfg.expert_files // 3, backend=backend)
        with StreamingRuntime(tree, model, opts) as rt:
            loads = _loads_by_layer(rt, monkeypatch)
            model.prefill_order = order
            try:
                with torch.no_grad():
                    out[order] = rt.run(model.forward_steps(ids, model.new_cache(1), prefill_chunk=32)).cpu()
            finally:
                model.prefill_order = "layer"
            loaded[order] = sum(map(len, loads.values()))
            if order == "layer":
                assert rt.payload()["prefill"]["layer_requests"] == len(cfg.moe_layers)
    assert torch.equal(out["layer"], out["chunk"])
    assert loaded["layer"] <= loaded["chunk"]


@pytest.mark.parametrize("n,E", [(10, 6), (4096, 24), (4097, 24), (50_000, 896)])
def test_a_whole_prompts_guesses_keep_their_rank_order(n, E):
    """The next layer's guesses for a whole prompt (millions of ids) are ranked by first
    occurrence, as a decode step's few are: the order a plain first-seen walk gives."""
    from streamrt.expert_weights import first_seen_ids

    ids = torch.randint(0, E, (n,), generator=torch.Generator().manual_seed(n))
    seen, want = set(), []
    for e in ids.tolist():
        if e not in seen:
            seen.add(e)
            want.append(e)
    assert first_seen_ids(ids) == want
