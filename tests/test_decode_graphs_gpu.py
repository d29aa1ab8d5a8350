"""CUDA-graph decode on the GPU: the pieces a graph needs, and graphs on vs off.

- `srt_moe_tables` writes, from device ids and a pointer table, the GateUpTable / DownTable bytes
  the host packs for the same pairs in the same order (by expert; `expert_pointers.tables`), and
  the list of groups the staged expert-FFN blocks take;
- the attention kernels with a device `length` over a longer cache give the bits of the same
  call on the cache cut to that length (and the selection of every position, ascending, gives
  the bits of no selection);
- a whole model, every expert resident, decodes with graphs (`--cuda-graphs auto`) to logits
  bit-identical to op by op (`off`), at one row and three rows of different lengths, across a
  doubling of the cache (a new capture) and the indexer's top-k, with the experts' slots in two
  different orders; and, a third of the experts in slots, with the stretches between routers
  replayed as graphs (`--cuda-graphs auto` while experts stream). CPU twin: tests/test_decode_seam.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrt.backends.expert_pointers import ExpertPointers, down_table_bytes, gate_up_table_bytes, tables
from streamrt.backends.kernel_defines import EXPERT_COLS, MOE_MAXP_DT
from streamrt.checkpoint.reader import open_tree
from streamrt.checkpoint.synth import synth
from streamrt.loader import load_model
from streamrt.model.cache import ModelCache
from streamrt.runtime.options import RuntimeOptions
from streamrt.runtime.scheduler import StreamingRuntime
from streamrt.runtime.streams import make_device
from streamrt.store.keys import ExpertKey

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def be():
    from streamrt.backends.nvrtc import NvrtcBackend

    return NvrtcBackend()


def _groups_by_hand(experts_in_order: list[int], cap: int) -> list[int]:
    """The first entry of each group of one table: a new group where the expert changes, and
    every `cap` entries along one expert's run."""
    firsts, run = [], 0
    for i, e in enumerate(experts_in_order):
        run = run + 1 if i and e == experts_in_order[i - 1] else 0
        if run % cap == 0:
            firsts.append(i)
    return firsts


@pytest.mark.parametrize("T,k,E,cap,listed", [(1, 16, 24, 16, False), (3, 16, 24, 16, True), (5, 7, 24, 4, True),
                                            (16, 16, 24, 16, True), (70, 16, 24, 16, False), (70, 16, 3, 16, True),
                                            (70, 16, 24, 5, True)])
def test_moe_tables_kernel_writes_the_host_tables(be, T, k, E, cap, listed):
    """The tables' bytes equal the host's for the same pairs; with a list, each table's groups
    (runs of one expert cut every `cap` entries) follow: their count, first entries and the
    table's length. 70 x 16 pairs span two tables, an expert's run crossing between them."""
    from streamrt.backends.nvrtc_args import i32, ptr
    from streamrt.backends.nvrtc_moe import most_groups

    g = torch.Generator().manual_seed(T * 100 + k + E + cap)
    experts = torch.randint(1, 2**62, (E, EXPERT_COLS), generator=g, dtype=torch.int64)  # stand-in addresses
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int64)
    P = T * k
    M = MOE_MAXP_DT
    chunks = -(-P // M)
    gt = torch.zeros(chunks, gate_up_table_bytes(M), dtype=torch.uint8, device="cuda")
    dt = torch.zeros(chunks, down_table_bytes(M), dtype=torch.uint8, device="cuda")
    groups = torch.full((chunks, M + 2), -7, dtype=torch.int32, device="cuda") if listed else None
    ids_d, ex_d = ids.cuda(), experts.cuda()
    threads = M if listed else min(1024, 32 * -(-P // 32))
    be._k("nvfp4_moe", "srt_moe_tables")(
        (1,), (threads,), [ptr(ids_d), ptr(ex_d), i32(P), i32(k), ptr(gt), ptr(dt), i32(cap), ptr(groups)])
    torch.cuda.synchronize()
    flat = ids.reshape(-1).tolist()
    order = sorted(range(P), key=lambda p: (flat[p], p))  # the pairs by expert, as the host orders them
    for c in range(chunks):
        chunk = [(p, p // k, flat[p]) for p in order[c * M : (c + 1) * M]]
        ptrs = {e: ExpertPointers(*experts[e].tolist(), 0) for _, _, e in chunk}
        want_g, want_d = tables(chunk, ptrs, M)
        assert np.array_equal(gt[c].cpu().numpy(), want_g), f"GateUpTable {c}"
        assert np.array_equal(dt[c].cpu().numpy(), want_d), f"DownTable {c}"
        if listed:
            firsts = _groups_by_hand([e for _, _, e in chunk], cap)
            got = groups[c].tolist()
            assert got[0] == len(firsts) and got[1 : 1 + len(firsts)] == firsts, f"groups of table {c}"
            assert got[1 + len(firsts)] == len(chunk)
            assert len(firsts) <= most_groups(len(chunk), E, cap)


@pytest.mark.parametrize("n", [5, 16, 17, 100])
def test_length_kernels_equal_the_cut_cache(be, n):
    g = torch.Generator().manual_seed(n)
    H, R, Dr, Hi, Di, cap, topk = 8, 64, 16, 4, 32, 160, 16
    dev = "cuda"
    q_lat, q_rot = torch.randn(H, R, generator=g).to(dev), torch.randn(H, Dr, generator=g).to(dev)
    c, kr = torch.randn(cap, R, generator=g).to(dev), torch.randn(cap, Dr, generator=g).to(dev)
    c[n:], kr[n:] = 1e4, -1e4  # never read
    q, w, keys = (torch.randn(Hi, Di, generator=g).to(dev), (torch.rand(Hi, generator=g) + 0.1).to(dev),
                  torch.randn(cap, Di, generator=g).to(dev))
    length = torch.tensor([n], dtype=torch.int32, device=dev)
    scores = be.indexer_scores(q, w, keys, length)
    assert torch.equal(scores[:n], be.indexer_scores(q, w, keys[:n]))
    sel = be.select_topk(scores, topk, length)
    if n <= topk:
        assert sel[:n].tolist() == list(range(n))
        want = be.mla_decode(q_lat, q_rot, c[:n], kr[:n], 0.2, None)
    else:
        assert torch.equal(sel, be.select_topk(scores[:n], topk))
        want = be.mla_decode(q_lat, q_rot, c[:n], kr[:n], 0.2, sel)
    assert torch.equal(be.mla_decode(q_lat, q_rot, c, kr, 0.2, sel, length), want)
    assert torch.equal(be.mla_decode(q_lat, q_rot, c, kr, 0.2, None, length),
                       be.mla_decode(q_lat, q_rot, c[:n], kr[:n], 0.2, None))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from streamrt.backends.nvrtc import NvrtcBackend

    root = tmp_path_factory.mktemp("graphs") / "tree"
    synth("tiny-k3.1-pro", root, fmt="streamrt", seed=4, progress=False)
    tree = open_tree(root)
    return tree, load_model(tree, "cuda", dtype=torch.bfloat16, backend=NvrtcBackend())


def _decode(tree, model, graphs: str, rows: list[int], reverse_slots: bool, slots: int | None = None,
            ) -> tuple[list[torch.Tensor], dict]:
    """Decode 75 forced steps; every expert preloaded into a slot, or (`slots`) streamed."""
    cfg = tree.config
    opts = RuntimeOptions(device="cuda", gpu_experts=slots or cfg.expert_files, cuda_graphs=graphs)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, cfg.vocab_size - 1, (n,), generator=g) for n in (7, 30, 12)]
    steps = torch.randint(0, cfg.vocab_size - 1, (75, 3), generator=g)
    with StreamingRuntime(tree, model, opts, device=make_device("cuda")) as rt, torch.no_grad():
        keys = [ExpertKey(l, e) for l in cfg.moe_layers for e in range(cfg.num_experts)]
        if slots is None:
            rt.preload(keys[::-1] if reverse_slots else keys)  # other slots: other addresses in the table
        caches = []
        for r in rows:
            caches.append(model.new_cache())
            rt.run(model.forward_steps(prompts[r], caches[-1], last_only=True))
        cache = ModelCache.stack(caches)
        out = [rt.run(model.forward_steps(steps[t, : len(rows), None], cache), tokens=len(rows)).cpu()
               for t in range(steps.shape[0])]
        assert max(cache.lengths) > 64 and min(cache.lengths) > cfg.indexer.topk
        graphs_used = rt.forward.graphs
        info = {"graph_steps": rt.stats.graph_steps, "captures": graphs_used.captures if graphs_used else 0,
                "kind": type(graphs_used).__name__, "refused": getattr(graphs_used, "refused", None),
                "resident": len(rt.gpu)}
    assert rt.forward.graphs is None  # closing the runtime drops graphs that point into its slots
    return out, info


@pytest.mark.parametrize("rows", [[0], [0, 1, 2]])
def test_graph_decode_is_bit_identical_to_op_by_op(tiny, rows):
    tree, model = tiny
    eager, off = _decode(tree, model, "off", rows, False)
    assert off["graph_steps"] == 0
    for reverse in (False, True):
        graphed, on = _decode(tree, model, "auto", rows, reverse)
        assert on["captures"] >= 2, on  # the first shape, and again once the cache doubled past 64
        assert on["graph_steps"] >= len(eager) - 2 * on["captures"], on
        for t, (a, b) in enumerate(zip(eager, graphed)):
            assert torch.equal(a, b), f"rows {rows}, reversed slots {reverse}, step {t}: graphs changed the logits"


def test_a_row_decodes_to_the_same_bits_alone_and_in_a_batch(tiny):
    """Batch invariance of the whole decode step (attention rows in one launch, 8-row GEMVs,
    per-pair expert FFN): row 0 of a three-row batch gives the logits of row 0 decoded alone."""
    tree, model = tiny
    alone, _ = _decode(tree, model, "auto", [0], False)
    batch, _ = _decode(tree, model, "auto", [0, 1, 2], False)
    for t, (a, b) in enumerate(zip(alone, batch)):
        assert torch.equal(a[0], b[0]), f"step {t}: row 0 differs alone and in a batch of three"


@pytest.mark.parametrize("rows", [[0], [0, 1, 2]])
def test_streamed_segment_graphs_are_bit_identical_to_op_by_op(tiny, rows):
    """A third of the experts in slots, so every step streams: `--cuda-graphs auto` replays
    the stretches between routers (runtime/segment_graphs.py) to the bits of op by op, across
    a doubling of the cache and the indexer's top-k."""
    tree, model = tiny
    slots = tree.config.expert_files // 3
    eager, off = _decode(tree, model, "off", rows, False, slots)
    assert off["graph_steps"] == 0
    graphed, on = _decode(tree, model, "auto", rows, False, slots)
    assert on["kind"] == "SegmentGraphs" and on["refused"] is None, on
    assert on["resident"] < tree.config.expert_files  # it streamed to the end
    assert on["captures"] >= 2, on  # the first shape, and again once the cache doubled past 64
    assert on["graph_steps"] >= len(eager) - 2 * on["captures"], on
    for t, (a, b) in enumerate(zip(eager, graphed)):
        assert torch.equal(a, b), f"rows {rows}, step {t}: segment graphs changed the logits"
