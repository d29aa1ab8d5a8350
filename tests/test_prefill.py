"""Chunked prefill: a position's logits do not depend on the prefill chunk C, equal
token-by-token decode within tolerance, ExpertRequests by prefill order, the absorbed
tile-and-block MLA prefill against a float64 reference (selection active, with ties), the
context-length policy, and peak RSS linear in the prompt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import reference as ref
from streamrt.backends.torch_backend import TorchBackend
from streamrt.errors import StreamrtError
from streamrt.model import KimiLinearForCausalLM
from streamrt.loader import DictExpertProvider
from streamrt.model.cache import KDACache, MLACache
from tiny_models import random_ids, random_model

VARIANTS = ["tiny-k3", "tiny-k3.1-pro"]
ROOT = Path(__file__).resolve().parents[1]



def build(name: str):
    return random_model(name, 0, 100)


def tokens(cfg, n: int, seed: int) -> torch.Tensor:
    return random_ids(cfg, n, seed)


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def prefill(model, prov, ids, C):
    cache = model.new_cache(1)
    with torch.no_grad():
        logits = model(ids[None], cache, prov, prefill_chunk=C)[0]  # [T, V]
    return logits, cache


# ---- chunk invariance and decode agreement ----------------------------------------------


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_identical_for_any_prefill_chunk(name):
    """C in {7, 64, T}: every position's logits and the whole cache are bit-identical; on
    K3.1 Pro the prompt is 5x index_topk, so the selection decides most positions."""
    cfg, model, prov = build(name)
    T = 80
    if cfg.indexer is not None:
        assert T >= 5 * cfg.indexer.topk
    ids = tokens(cfg, T, 1)
    base, base_cache = prefill(model, prov, ids, T)
    for C in (7, 64):
        got, cache = prefill(model, prov, ids, C)
        assert torch.equal(got[-1], base[-1]), f"C={C}: last position differs"
        assert torch.equal(got, base), (
            f"C={C}: positions {[t for t in range(T) if not torch.equal(got[t], base[t])][:8]} differ"
        )
        for lc, lb in zip(cache.layers, base_cache.layers):
            if isinstance(lc, MLACache):
                for a, b in zip(lc.tensors(), lb.tensors()):
                    assert torch.equal(a[:, :T], b[:, :T])
            else:
                assert all(torch.equal(a, b) for a, b in zip(lc.tensors(), lb.tensors()))


@pytest.mark.parametrize("name", VARIANTS)
def test_chunked_prefill_equals_token_by_token_decode(name):
    """Prefill (C = 7) vs T decode steps (absorbed MLA, recurrent KDA, GEMV rows): the two
    arithmetic orders agree to rel 1e-4 (measured ~1.2e-5), also past index_topk."""
    cfg, model, prov = build(name)
    T = 40
    ids = tokens(cfg, T, 2)
    got, _ = prefill(model, prov, ids, 7)
    cache = model.new_cache(1)
    with torch.no_grad():
        dec = torch.stack([model(ids[t : t + 1][None], cache, prov)[0, 0] for t in range(T)])
    assert rel(got, dec) < 1e-4
    if cfg.indexer is not None:
        k = cfg.indexer.topk
        assert rel(got[k:], dec[k:]) < 1e-4


def test_prefill_after_decode_continues_the_cache():
    """prefill 30, decode 3, prefill 20 (the KDA anchor is dropped by decode and re-anchored)
    == one prefill of all 53 within tolerance, and the cache ends at 53."""
    cfg, model, prov = build("tiny-k3.1-pro")
    ids = tokens(cfg, 53, 3)
    full, _ = prefill(model, prov, ids, 16)
    cache = model.new_cache(1)
    with torch.no_grad():
        a = model(ids[None, :30], cache, prov, prefill_chunk=16)[0]
        b = torch.stack([model(ids[None, t : t + 1], cache, prov)[0, 0] for t in range(30, 33)])
        c = model(ids[None, 33:], cache, prov, prefill_chunk=16)[0]
    assert cache.lengths == [53]
    assert rel(torch.cat([a, b, c]), full) < 1e-4


@pytest.mark.parametrize("order", ["chunk", "layer"])
def test_expert_requests_by_prefill_order(order):
    """chunk: one request per MoE layer per chunk; layer (expert-stationary): one per MoE layer
    for the whole prompt's rows."""
    cfg, model, prov = build("tiny-k3.1-pro")
    seen = []

    def recording(req):
        seen.append((req.layer, req.ids.shape[0]))
        return prov(req)

    model.prefill_order = order
    try:
        with torch.no_grad():
            model(tokens(cfg, 100, 4)[None], model.new_cache(1), recording, prefill_chunk=64)
    finally:
        model.prefill_order = "layer"
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    if order == "chunk":
        assert seen == [(layer, 64) for layer in moe] + [(layer, 36) for layer in moe]
    else:
        assert seen == [(layer, 100) for layer in moe]


# ---- the MLA prefill op against float64 -------------------------------------------------


def _op_inputs(seed: int, n: int, H=2, dn=4, dr=3, dv=5, R=6, Hi=2, Di=4):
    r = np.random.default_rng(seed)
    q_nope, q_rot = r.standard_normal((n, H, dn)), r.standard_normal((n, H, dr))
    w_uk, w_uv = r.standard_normal((H, dn, R)), r.standard_normal((H, dv, R))
    c, kr = r.standard_normal((n, R)), r.standard_normal((n, dr))
    # Small integers: indexer scores are exact in fp32 and fp64 and tie often (relu zeros too).
    qi, ki = r.integers(-1, 2, (n, Hi, Di)).astype(float), r.integers(-1, 2, (n, Di)).astype(float)
    wi = r.choice([0.5, 1.0, 2.0], (n, Hi))
    return q_nope, q_rot, w_uk, w_uv, c, kr, qi, wi, ki


def _ref_prefill(q_nope, q_rot, w_uk, w_uv, c, kr, qi, wi, ki, start, T, scale, topk):
    """Expanded float64 MLA for queries start..start+T-1 with the spec's selection."""
    H = q_nope.shape[1]
    n = start + T
    K = np.concatenate([np.einsum("hdr,sr->shd", w_uk, c[:n]), np.repeat(kr[:n, None], H, 1)], -1)  # [n, H, dn+dr]
    V = np.einsum("hvr,sr->shv", w_uv, c[:n])  # [n, H, dv]
    Q = np.concatenate([q_nope, q_rot], -1)[start:n]
    allowed = np.zeros((T, n), bool)
    ties = 0
    for t in range(T):
        p = start + t
        if topk is None or p + 1 <= topk:
            allowed[t, : p + 1] = True
        else:
            I = ref.indexer_scores(qi[p], wi[p], ki[: p + 1])
            sel = ref.select_topk(list(I), topk)
            ties += int(np.sum(I == I[sel[-1]]) > 1)
            allowed[t, sel] = True
    return ref.mla_attention(Q, K, V, scale, allowed), ties


@pytest.mark.parametrize("topk", [None, 5])
def test_mla_prefill_matches_float64_reference(topk):
    """Tiles of 4 queries x blocks of 8 keys (several of each, a partial last tile and block),
    a chunk starting mid-block; with topk the boundary groups tie (checked), so the tie rule
    decides which keys each query sees."""
    start, T = 9, 13
    n = start + T
    x = _op_inputs(5, n)
    q_nope, q_rot, w_uk, w_uv, c, kr, qi, wi, ki = (torch.tensor(a, dtype=torch.float32) for a in x)
    be = TorchBackend(q_tile=4, key_block=8).for_prefill()
    scale = 7**-0.5
    index = None if topk is None else (qi[start:], wi[start:], ki, topk)
    got = be.mla_prefill(q_nope[start:], q_rot[start:], w_uk, w_uv, c, kr, start, scale, index)
    want, ties = _ref_prefill(*x, start, T, scale, topk)
    if topk is not None:
        assert ties >= 3  # the tie rule is exercised
    err = np.abs(got.double().numpy() - want).max() / np.abs(want).max()
    assert err < 1e-5, err


def test_mla_prefill_rows_do_not_depend_on_the_chunking():
    n = 40
    x = _op_inputs(6, n)
    q_nope, q_rot, w_uk, w_uv, c, kr, qi, wi, ki = (torch.tensor(a, dtype=torch.float32) for a in x)
    be = TorchBackend(q_tile=4, key_block=8).for_prefill()

    def run(s0, s1):
        return be.mla_prefill(q_nope[s0:s1], q_rot[s0:s1], w_uk, w_uv, c, kr, s0, 0.3, (qi[s0:s1], wi[s0:s1], ki, 6))

    whole = run(0, n)
    for C in (1, 3, 7, 16):
        parts = torch.cat([run(s, min(s + C, n)) for s in range(0, n, C)])
        assert torch.equal(parts, whole), C


def test_linear_prefill_tiles_are_row_invariant():
    r = np.random.default_rng(8)
    x, w = (
        torch.tensor(r.standard_normal((150, 96)), dtype=torch.float32),
        torch.tensor(r.standard_normal((80, 96)), dtype=torch.float32),
    )
    be = TorchBackend().for_prefill()
    full = be.linear(x, w)
    for s0, s1 in ((0, 7), (7, 71), (5, 6), (64, 150), (100, 150)):
        assert torch.equal(be.linear(x[s0:s1], w), full[s0:s1])


def test_kda_anchor_is_kept_by_clone_and_dropped_by_decode():
    cfg, model, prov = build("tiny-k3")
    cache = model.new_cache(1)
    with torch.no_grad():
        model(tokens(cfg, 40, 9)[None], cache, prov, prefill_chunk=64)
        kda = [lc for lc in cache.layers if isinstance(lc, KDACache)]
        assert all(lc.anchor_state is not None and lc.pending[0].shape[1] == 40 - 32 for lc in kda)
        assert all(lc.pending is not None for lc in cache.clone().layers if isinstance(lc, KDACache))
        model(tokens(cfg, 1, 10)[None], cache, prov)
    assert all(lc.anchor_state is None and lc.pending is None for lc in kda)


# ---- context policy ---------------------------------------------------------------------


def test_context_policy_refuses_or_truncates_left():
    from streamrt.cli.run import fit_context

    ids = list(range(10))
    assert fit_context(ids, 10, None) == ids and fit_context(ids, None, None) == ids
    with pytest.raises(StreamrtError) as e:
        fit_context(ids, 8, None)
    msg = str(e.value)
    assert "10" in msg and "8" in msg and "\n" not in msg and "--truncate left" in msg
    assert fit_context(ids, 8, "left") == ids[2:]
    assert fit_context(ids, 8, "left", reserve=3) == ids[5:]  # room for a 3-token reply
    assert fit_context(ids, 8, "left", reserve=100) == ids[6:]  # at most half the context


def test_generate_stops_at_the_context():
    from streamrt.generate import generate

    cfg, model, prov = build("tiny-k3")
    r = generate(model, tokens(cfg, 10, 11).tolist(), provider=prov, max_new_tokens=50, stop_ids=[], max_context=14)
    assert len(r.tokens[0]) == 4 and r.stop == "length"
    with pytest.raises(StreamrtError):
        generate(model, tokens(cfg, 15, 11).tolist(), provider=prov, max_context=14)


# ---- memory -----------------------------------------------------------------------------


def _peak(length: int, chunk: int) -> dict:
    cmd = [sys.executable, str(ROOT / "profiling" / "bench_prefill.py"), "--child", "--length", str(length),
           "--prefill-chunk", str(chunk), "--threads", "1", "--model", _default_dir()]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, p.stderr[-2000:]
    return json.loads(line[0][7:])


def _default_dir() -> str:
    from streamrt.default_model import default_model_dir

    return str(default_model_dir(lambda m: None))


def test_default_model_peak_rss_is_linear_in_the_prompt():
    """The default model's context is 2,048, so 4x is 512 -> 2,048 (not 2k -> 8k). Measured in
    a fresh process each, chunk 256: the 2,048 peak stays under 1.5x the 512 peak plus the
    cache, and the prefill's own increment (peak - RSS after loading) grows at most 4x x 1.5
    plus the cache (HEAD grew quadratically: T x T scores for every head)."""
    a, b = _peak(512, 256), _peak(2048, 256)
    assert b["rss_peak"] < 1.5 * a["rss_peak"] + b["cache_bytes"], (a, b)
    inc_a, inc_b = a["rss_peak"] - a["rss_loaded"], b["rss_peak"] - b["rss_loaded"]
    assert inc_b < 1.5 * 4 * max(inc_a, 8 << 20) + b["cache_bytes"], (a, b)
    assert a["top1"] >= 0 and b["length"] == 2048


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", VARIANTS)
def test_cuda_torch_backend_logits_identical_for_any_prefill_chunk(name):
    """The torch backend on CUDA (its own tiles): chunk-invariant too, and close to the CPU."""
    from streamrt.loader import _to

    cfg, model, prov = build(name)
    gm = KimiLinearForCausalLM(cfg, backend=TorchBackend()).eval().cuda()
    gm.load_state_dict(model.state_dict())
    gprov = DictExpertProvider({k: _to(v, "cuda") for k, v in prov.experts.items()})
    ids = tokens(cfg, 80, 1).cuda()
    base, _ = prefill(gm, gprov, ids, 80)
    for C in (7, 64):
        got, _ = prefill(gm, gprov, ids, C)
        assert torch.equal(got, base), C
    cpu, _ = prefill(model, prov, ids.cpu(), 80)
    assert rel(base.cpu(), cpu) < 1e-4
