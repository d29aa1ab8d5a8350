"""The prefix cache (model/prefix_cache.py): a request resumed from a cached prefix gets logits
bit-identical to the same request prefilled from scratch (torch.equal), on K3 and K3.1 Pro tiny
trees, with the KDA snapshot at a sub-chunk boundary and mid-chunk, the indexer's selection
active, two batch rows sharing a prefix, and eviction under a tiny budget; a hit prefills only
the new tokens (counted at the first MoE layer's expert requests)."""

from __future__ import annotations

import pytest
import torch

from streamrt.backends.torch_backend import TorchBackend
from streamrt.generate import generate
from streamrt.loader import DictExpertProvider
from streamrt.model import KimiLinearForCausalLM, run_sync
from streamrt.model.cache import KDACache
from streamrt.model.kda import KDA_CHUNK
from streamrt.model.prefix_cache import MIN_NEW, PrefixCache, Snapshot, prefill_steps
from tiny_models import random_ids, random_model, row_dependent

VARIANTS = ["tiny-k3", "tiny-k3.1-pro"]


def build(name: str):
    return random_model(name, 7, 11)


def tokens(cfg, n: int, seed: int) -> list[int]:
    return random_ids(cfg, n, seed).tolist()


class Counting:
    """An expert provider that counts the tokens forwarded (rows of the first MoE layer's requests)."""

    def __init__(self, cfg, inner):
        self.first = min(i for i in range(cfg.num_layers) if cfg.is_moe(i))
        self.inner, self.tokens = inner, 0

    def __call__(self, req):
        if req.layer == self.first:
            self.tokens += req.ids.shape[0]
        return self.inner(req)


def scratch(model, prov, ids, C):
    """Every position's logits [T, V] of one prefill from an empty cache, and the cache."""
    cache = model.new_cache(1)
    with torch.no_grad():
        return model(torch.tensor([ids]), cache, prov, prefill_chunk=C)[0], cache


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("P", [2 * KDA_CHUNK, 2 * KDA_CHUNK + 13])  # at a KDA sub-chunk boundary, mid-chunk
def test_resumed_prefill_is_bit_identical(name, P):
    cfg, model, prov = build(name)
    T, C = 96, 24
    if cfg.indexer is not None:
        assert T - P > cfg.indexer.topk and P > cfg.indexer.topk  # the selection decides the new positions
    ids = tokens(cfg, T, P)
    base, base_cache = scratch(model, prov, ids, C)

    pc = PrefixCache(1 << 30)
    with torch.no_grad():
        run_sync(prefill_steps(model, ids[:P], model.new_cache(1), [P], pc, C), prov)
    snap = pc.lookup(ids)
    assert snap is not None and len(snap.tokens) == P
    cache = snap.restore("cpu")
    counting = Counting(cfg, prov)
    with torch.no_grad():
        got = model(torch.tensor([ids[P:]]), cache, counting, prefill_chunk=C)[0]  # [T - P, V]
    assert counting.tokens == T - P  # only the new tokens went through the model
    assert torch.equal(got, base[P:]), [t for t in range(T - P) if not torch.equal(got[t], base[P + t])][:8]
    for lc, lb in zip(cache.layers, base_cache.layers):
        if isinstance(lc, KDACache):
            assert all(torch.equal(a, b) for a, b in zip(lc.tensors(), lb.tensors()))
        else:
            assert all(torch.equal(a[:, :T], b[:, :T]) for a, b in zip(lc.tensors(), lb.tensors()))


@pytest.mark.parametrize("name", VARIANTS)
def test_generate_with_cache_equals_generate_without(name):
    """Turn 2 of a conversation (turn 1's prompt + its reply + new tokens) resumes at turn 1's
    prompt end; its logits and tokens equal the uncached run, and the cache is counted."""
    cfg, model, prov = build(name)
    first = tokens(cfg, 70, 1)
    pc = PrefixCache(1 << 30)
    kw = dict(provider=prov, max_new_tokens=4, prefill_chunk=16, hash_steps=True, stop_ids=[])
    r1 = generate(model, first, prefix_cache=pc, **kw)
    assert r1.cached_tokens == [0]
    second = first + r1.tokens[0] + tokens(cfg, 9, 2)
    counting = Counting(cfg, prov)
    r2 = generate(model, second, prefix_cache=pc, **{**kw, "provider": counting})
    plain = generate(model, second, **kw)
    assert r2.cached_tokens == [len(first)]
    assert torch.equal(r2.prefill_logits, plain.prefill_logits)
    assert r2.tokens == plain.tokens and r2.step_hashes == plain.step_hashes  # every decode step, bit for bit
    assert counting.tokens == len(second) - len(first) + r2.decode_steps


def test_two_rows_sharing_a_prefix():
    """A long shared system part: the first request leaves a snapshot at its last chunk boundary
    inside it; a batch of two rows that share it both resume there and equal the uncached batch."""
    cfg, model, prov = build("tiny-k3.1-pro")
    system, C = tokens(cfg, 66, 3), 16
    pc = PrefixCache(1 << 30)
    kw = dict(provider=prov, max_new_tokens=3, prefill_chunk=C)
    generate(model, system + tokens(cfg, 5, 4), prefix_cache=pc, **kw)
    assert len(pc) == 2  # the chunk boundary at 64 and the prompt's end
    rows = [system + tokens(cfg, 7, 5), system + tokens(cfg, 12, 6)]
    got = generate(model, rows, prefix_cache=pc, **kw)
    plain = generate(model, rows, **kw)
    assert got.cached_tokens == [64, 64]
    assert torch.equal(got.prefill_logits, plain.prefill_logits)
    assert got.tokens == plain.tokens


def test_eviction_under_a_tiny_budget():
    """A budget for two snapshots: the least recently used goes, a lookup of it misses, a kept one
    hits; answers equal the uncached ones either way; a snapshot over the budget is not kept."""
    cfg, model, prov = build("tiny-k3")
    a, b, c = (tokens(cfg, 40, s) for s in (7, 8, 9))
    a_cache = scratch(model, prov, a, 40)[1]
    one = Snapshot.take(a, a_cache).nbytes
    assert Snapshot.size_of(a_cache, 40) == one
    pc = PrefixCache(2 * one + one // 2)
    kw = dict(provider=prov, max_new_tokens=2, prefill_chunk=64)
    for p in (a, b):
        generate(model, p, prefix_cache=pc, **kw)
    assert pc.lookup(a + [1, 2]) is not None  # a is now the most recently used
    generate(model, c, prefix_cache=pc, **kw)
    assert len(pc) == 2 and pc.stats.evicted == 1 and pc.nbytes <= pc.budget
    assert pc.lookup(b + [1, 2]) is None
    for p in (a, c):
        ids = p + [3, 4, 5]
        snap = pc.lookup(ids)
        assert snap is not None and len(snap.tokens) == 40
        with torch.no_grad():
            got = run_sync(prefill_steps(model, ids, snap.restore("cpu"), [43], None, 64), prov)[0, 0]
        assert torch.equal(got, scratch(model, prov, ids, 64)[0][-1])
    small = PrefixCache(one - 1)
    generate(model, a, prefix_cache=small, **kw)
    assert len(small) == 0 and small.stats.too_big == 1


def test_lookup_needs_the_whole_prefix_and_leaves_new_tokens():
    cfg, model, prov = build("tiny-k3")
    ids = tokens(cfg, 30, 10)
    pc = PrefixCache(1 << 30)
    with torch.no_grad():
        run_sync(prefill_steps(model, ids, model.new_cache(1), [20, 30], pc, 64), prov)
    assert len(pc.lookup(ids + [5, 6]).tokens) == 30
    assert len(pc.lookup(ids + [5]).tokens) == 20  # one new token would be a decode step
    assert len(pc.lookup(ids[:29] + [(ids[29] + 1) % cfg.vocab_size, 1, 2]).tokens) == 20
    assert pc.lookup(ids[:19] + [0] * 20) is None
    assert PrefixCache(0).store(ids, model.new_cache(1)) is False


def test_marks_fall_on_chunk_boundaries():
    assert PrefixCache.marks(0, 100, 32) == [96, 100]
    assert PrefixCache.marks(0, 96 + MIN_NEW - 1, 32) == [64, 96 + MIN_NEW - 1]  # 96 would leave too few
    assert PrefixCache.marks(10, 40, 32) == [40]
    assert PrefixCache.marks(10, 60, 32) == [42, 60]
    assert PrefixCache.marks(0, 100, 0) == [100]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", VARIANTS)
def test_cuda_snapshots_are_page_locked_and_resume_bit_identically(name):
    """The torch backend on CUDA: a snapshot lives in page-locked host memory, its restore on the
    device, and the resumed turn's logits and tokens equal the uncached run's."""
    from streamrt.loader import _to

    cfg, model, prov = build(name)
    gm = KimiLinearForCausalLM(cfg, backend=TorchBackend()).eval().cuda()
    gm.load_state_dict(model.state_dict())
    gprov = DictExpertProvider({k: _to(v, "cuda") for k, v in prov.experts.items()})
    first = tokens(cfg, 77, 12)
    pc = PrefixCache(1 << 30)
    kw = dict(provider=gprov, max_new_tokens=4, prefill_chunk=24)
    r1 = generate(gm, first, prefix_cache=pc, **kw)
    snap = pc.lookup(first + [1, 2])
    assert snap is not None and all(t.is_pinned() for t in snap.layers[0][1:] if isinstance(t, torch.Tensor))
    assert snap.restore("cuda").layers[0].tensors()[0].is_cuda
    second = first + r1.tokens[0] + tokens(cfg, 30, 13)
    got = generate(gm, second, prefix_cache=pc, **kw)
    plain = generate(gm, second, **kw)
    assert got.cached_tokens == [len(first)]
    assert torch.equal(got.prefill_logits, plain.prefill_logits) and got.tokens == plain.tokens


def test_a_row_dependent_backend_keeps_and_resumes_at_chunk_multiples_only():
    """Where the backend's prefill bits depend on a chunk's rows (nvrtc's cuBLAS GEMMs), a resume
    must cut its chunks where a prefill from scratch does: snapshots at multiples of the chunk."""
    from streamrt.model.prefix_cache import resume_align

    cfg, model, prov = build("tiny-k3.1-pro")

    rd = row_dependent(cfg, model)
    assert resume_align(model, 24) == 1 and resume_align(rd, 24) == 24 and resume_align(rd, 0) == 1
    first = tokens(cfg, 77, 21)
    pc = PrefixCache(1 << 30)
    kw = dict(provider=prov, max_new_tokens=3, prefill_chunk=24)
    r1 = generate(rd, first, prefix_cache=pc, **kw)
    assert sorted(n for n, _ in pc._entries) == [72]  # the chunk boundary; 77 is no multiple of 24
    second = first + r1.tokens[0] + tokens(cfg, 30, 22)
    got = generate(rd, second, prefix_cache=pc, **kw)
    plain = generate(rd, second, **kw)
    assert got.cached_tokens == [72] and got.tokens == plain.tokens
    assert torch.equal(got.prefill_logits, plain.prefill_logits)
    assert not pc.store(first[:50], model.new_cache(1), align=24)  # off the grid: not kept


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", VARIANTS)
def test_nvrtc_resumes_at_a_chunk_boundary_bit_identically(name, tmp_path_factory):
    """--backend nvrtc, bf16: turn 2 resumes at turn 1's last chunk boundary and its prefill
    logits and tokens equal a prefill from scratch, bit for bit."""
    from streamrt.backends.nvrtc import NvrtcBackend
    from streamrt.checkpoint.reader import open_tree
    from streamrt.checkpoint.synth import synth
    from streamrt.loader import DirectExpertProvider, load_model

    root = tmp_path_factory.mktemp(name) / "tree"
    synth(name, root, fmt="streamrt", seed=3, progress=False)
    tree = open_tree(root)
    model = load_model(tree, "cuda", dtype=torch.bfloat16, backend=NvrtcBackend())
    cfg = tree.config
    first = tokens(cfg, 77, 31)
    pc = PrefixCache(1 << 30)
    kw = dict(provider=DirectExpertProvider(tree, "cuda"), max_new_tokens=4, prefill_chunk=24)
    r1 = generate(model, first, prefix_cache=pc, **kw)
    second = first + r1.tokens[0] + tokens(cfg, 30, 32)
    got = generate(model, second, prefix_cache=pc, **kw)
    plain = generate(model, second, **kw)
    assert got.cached_tokens == [72]
    assert torch.equal(got.prefill_logits, plain.prefill_logits) and got.tokens == plain.tokens
