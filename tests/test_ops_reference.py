"""Every torch-backend op against its float64 numpy reference (tests/reference.py), on fresh
random inputs at both variants' tiny shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import reference as ref
from streamrt.backends.torch_backend import TorchBackend, dequant_nvfp4
from streamrt.config import load_config
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix
from streamrt.ops import select_topk, topk_mask
from streamrt.model.kda import kda_chunked, short_conv_prefill
from streamrt.model.synthetic import random_nvfp4

VARIANTS = ["tiny-k3", "tiny-k3.1-pro"]
BE = TorchBackend()


@pytest.fixture(params=VARIANTS)
def cfg(request):
    return load_config(request.param)


def rng(seed):
    return np.random.default_rng(seed)


def t32(a):
    return torch.tensor(np.asarray(a), dtype=torch.float32)


def f64(a):
    return np.asarray(a.detach().double().numpy() if isinstance(a, torch.Tensor) else a, dtype=np.float64)


def assert_close(got, want, tol=2e-6):
    got, want = f64(got), f64(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err < tol, f"relative max error {err:.3g} >= {tol}"


# ---- dense ops ---------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 3, 80])  # row-wise GEMV path and the GEMM path
def test_linear(cfg, rows):
    r = rng(rows)
    x, w = r.standard_normal((rows, cfg.hidden_size)), r.standard_normal((cfg.kda_proj_dim, cfg.hidden_size))
    assert_close(BE.linear(t32(x), t32(w)), x.astype(np.float32).astype(np.float64) @ w.astype(np.float32).T, 1e-5)
    wb = torch.tensor(w, dtype=torch.bfloat16)
    assert_close(BE.linear(t32(x), wb), x.astype(np.float32) @ f64(wb).T, 1e-5)


def test_linear_is_row_invariant(cfg):
    r = rng(7)
    x, w = t32(r.standard_normal((5, cfg.hidden_size))), t32(r.standard_normal((cfg.vocab_size, cfg.hidden_size)))
    full = BE.linear(x, w)
    for t in range(5):
        assert torch.equal(BE.linear(x[t : t + 1], w)[0], full[t])


def test_norms_and_activation(cfg):
    r = rng(1)
    D, H, K, Di = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, 16
    x, w = r.standard_normal((6, D)) * 3, 1 + 0.1 * r.standard_normal(D)
    assert_close(BE.rmsnorm(t32(x), t32(w), cfg.rms_norm_eps), ref.rmsnorm(x, w, cfg.rms_norm_eps))
    o, g, wo = r.standard_normal((6, H, K)), r.standard_normal((6, H, K)), 1 + 0.1 * r.standard_normal(K)
    assert_close(BE.gated_rmsnorm(t32(o), t32(g), t32(wo), 1e-5), ref.gated_rmsnorm(o, g, wo, 1e-5))
    xi, wi, bi = r.standard_normal((6, Di)) + 0.5, 1 + 0.1 * r.standard_normal(Di), 0.1 * r.standard_normal(Di)
    assert_close(BE.layernorm(t32(xi), t32(wi), t32(bi), 1e-6), ref.layernorm(xi, wi, bi, 1e-6))
    assert_close(BE.l2norm(t32(o), 1e-6), ref.l2norm(o, 1e-6))
    tiny = 1e-4 * r.standard_normal((3, K))  # eps inside the sqrt matters here
    assert_close(BE.l2norm(t32(tiny), 1e-6), ref.l2norm(tiny, 1e-6))
    gate, up = 8 * r.standard_normal((6, 64)), 40 * r.standard_normal((6, 64))  # into both tanh clips
    assert_close(
        BE.situ_glu(t32(gate), t32(up), cfg.situ_beta, cfg.situ_linear_beta), ref.situ_glu(gate, up, 4.0, 25.0), 5e-6
    )
    assert_close(BE.situ_glu(t32(gate), t32(up), 4.0, None), ref.situ_glu(gate, up, 4.0, None), 5e-6)


# ---- KDA ---------------------------------------------------------------------------------


def test_short_conv_step_and_prefill(cfg):
    r = rng(2)
    P, W, T = cfg.kda_proj_dim, cfg.short_conv_kernel_size, 9
    z, w = r.standard_normal((2, T, P)), r.standard_normal((P, W))
    want = np.stack([ref.short_conv(z[b], w) for b in range(2)])
    state = torch.zeros(2, P, W)
    got = torch.stack([BE.short_conv_step(t32(z[:, t]), state, t32(w)) for t in range(T)], 1)
    assert_close(got, want)
    out, cache = short_conv_prefill(t32(z[:, :5]), t32(w), None)
    assert_close(out, want[:, :5])
    want_cache = np.concatenate([np.zeros((2, W, P)), z[:, :5]], 1)[:, -W:].transpose(0, 2, 1)  # last W inputs
    assert_close(cache, want_cache)
    out2, _ = short_conv_prefill(t32(z[:, 5:]), t32(w), cache)  # continue from the cache
    assert_close(out2, want[:, 5:])


def test_kda_gate(cfg):
    r = rng(3)
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    f, a, dt = 2 * r.standard_normal((5, H, K)), np.log(r.uniform(1, 16, H)), r.standard_normal(H * K)
    b = 3 * r.standard_normal((5, H))
    g, beta = BE.kda_gates(t32(f), t32(b), t32(a), t32(dt), cfg.gate_lower_bound)
    assert_close(g, ref.kda_gate(f, a, dt, -5.0))
    assert_close(beta, ref.sigmoid(b))
    assert bool((g <= 0).all()) and bool((g >= -5).all())  # per-step decay exp(g) in [e^-5, 1]


def _kda_inputs(cfg, T, seed, B=2):
    r = rng(seed)
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    q = ref.l2norm(r.standard_normal((B, T, H, K)), 1e-6) * K**-0.5
    k = ref.l2norm(r.standard_normal((B, T, H, K)), 1e-6)
    v = r.standard_normal((B, T, H, K))
    g = ref.kda_gate(r.standard_normal((B, T, H, K)), np.log(r.uniform(1, 16, H)), r.standard_normal(H * K), -5.0)
    beta = ref.sigmoid(r.standard_normal((B, T, H)))
    S0 = r.standard_normal((B, H, K, K))
    return q, k, v, g, beta, S0


def test_kda_step_matches_reference(cfg):
    q, k, v, g, beta, S0 = _kda_inputs(cfg, 7, 4)
    state = t32(S0).clone()
    got = torch.stack(
        [BE.kda_step(t32(q[:, t]), t32(k[:, t]), t32(v[:, t]), t32(g[:, t]), t32(beta[:, t]), state) for t in range(7)],
        1,
    )
    for b in range(2):
        o, S = ref.kda_recurrent(q[b], k[b], v[b], g[b], beta[b], S0[b])
        assert_close(got[b], o, 1e-5)
        assert_close(state[b], S, 1e-5)


@pytest.mark.parametrize("T,chunk", [(37, 16), (20, 32), (64, 64)])
def test_kda_chunked_matches_reference(cfg, T, chunk):
    q, k, v, g, beta, S0 = _kda_inputs(cfg, T, T)
    o, S = kda_chunked(*(t32(a) for a in (q, k, v, g, beta)), t32(S0), chunk=chunk)
    for b in range(2):
        o_ref, S_ref = ref.kda_recurrent(q[b], k[b], v[b], g[b], beta[b], S0[b])
        assert_close(o[b], o_ref, 2e-5)
        assert_close(S[b], S_ref, 2e-5)


def test_kda_chunked_equals_recurrent_fp32(cfg):
    """Chunked prefill == token-by-token recurrent decode, rel err < 1e-4."""
    q, k, v, g, beta, _ = _kda_inputs(cfg, 50, 9)
    o, S = kda_chunked(*(t32(a) for a in (q, k, v, g, beta)), None)
    state = torch.zeros_like(S)
    rec = torch.stack(
        [
            BE.kda_step(t32(q[:, t]), t32(k[:, t]), t32(v[:, t]), t32(g[:, t]), t32(beta[:, t]), state)
            for t in range(50)
        ],
        1,
    )
    assert float((o - rec).norm() / rec.norm()) < 1e-4
    assert float((S - state).norm() / state.norm()) < 1e-4


@pytest.mark.parametrize("group", [1, 3, 4])
def test_kda_chunked_groups_agree_and_mark_the_whole_boundary(cfg, group):
    """Sub-chunks batched in groups of any size (the last group zero-padded) give the float64
    recurrence, and the boundary state is the recurrence's after the last whole sub-chunk."""
    T, chunk = 77, 16  # 4 whole sub-chunks and a partial one
    q, k, v, g, beta, S0 = _kda_inputs(cfg, T, 40 + group)
    o, S, S_whole = kda_chunked(*(t32(a) for a in (q, k, v, g, beta)), t32(S0), chunk=chunk, boundary=True, group=group)
    whole = T // chunk * chunk
    for b in range(2):
        o_ref, S_ref = ref.kda_recurrent(q[b], k[b], v[b], g[b], beta[b], S0[b])
        _, S_whole_ref = ref.kda_recurrent(
            q[b, :whole], k[b, :whole], v[b, :whole], g[b, :whole], beta[b, :whole], S0[b]
        )
        assert_close(o[b], o_ref, 2e-5)
        assert_close(S[b], S_ref, 2e-5)
        assert_close(S_whole[b], S_whole_ref, 2e-5)


def test_kda_chunked_is_differentiable(cfg):
    q, k, v, g, beta, S0 = (t32(a).requires_grad_() for a in _kda_inputs(cfg, 20, 11))
    o, S = kda_chunked(q, k, v, g, beta, S0, chunk=8)
    (o.square().sum() + S.sum()).backward()
    for t in (q, k, v, g, beta, S0):
        assert t.grad is not None and bool(torch.isfinite(t.grad).all()) and float(t.grad.abs().sum()) > 0


# ---- MLA and the indexer -------------------------------------------------------------------


@pytest.mark.parametrize("with_select", [False, True])
def test_mla_decode(cfg, with_select):
    r = rng(5)
    H, R, dr, n = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, 23
    ql, qr, c, kr = (
        r.standard_normal((H, R)),
        r.standard_normal((H, dr)),
        r.standard_normal((n, R)),
        r.standard_normal((n, dr)),
    )
    scale = (cfg.qk_nope_head_dim + dr) ** -0.5
    sel = [4, 17, 0, 9, 22] if with_select else list(range(n))
    got = BE.mla_decode(t32(ql), t32(qr), t32(c), t32(kr), scale, torch.tensor(sel) if with_select else None)
    want = np.zeros((H, R))
    for h in range(H):
        s = np.array([(ql[h] @ c[j] + qr[h] @ kr[j]) * scale for j in sel])
        p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        want[h] = p @ c[sel]
    assert_close(got, want, 2e-6)


def test_indexer_scores(cfg):
    r = rng(6)
    Hi, Di = (cfg.indexer.n_heads, cfg.indexer.head_dim) if cfg.indexer else (2, 16)
    q, w, keys = r.standard_normal((Hi, Di)), r.standard_normal(Hi), r.standard_normal((30, Di))
    assert_close(BE.indexer_scores(t32(q), t32(w), t32(keys)), ref.indexer_scores(q, w, keys), 2e-6)


def test_select_topk_random_with_ties():
    r = rng(8)
    for trial in range(200):
        n = int(r.integers(1, 60))
        s = r.integers(-4, 5, n).astype(np.float32)  # many ties, negatives
        k = int(r.integers(1, 70))
        assert select_topk(torch.tensor(s), k).tolist() == ref.select_topk(s.tolist(), k)


def test_select_topk_cases():
    s = torch.tensor([1.0, 5.0, 3.0, 3.0, 0.0, 3.0, 7.0])
    # above threshold 3: {1, 6} ascending; then the boundary group 3.0 from the lowest position
    assert select_topk(s, 4).tolist() == [1, 6, 2, 3]
    assert select_topk(s, 3).tolist() == [1, 6, 2]
    assert select_topk(s, 5).tolist() == [1, 6, 2, 3, 5]
    assert select_topk(torch.full((6,), 2.5), 3).tolist() == [0, 1, 2]  # all equal
    assert select_topk(s, 7).tolist() == [0, 1, 2, 3, 5, 6, 4]  # k == n: above 0.0 first, then the 0.0
    assert sorted(select_topk(s, 100).tolist()) == list(range(7))  # k > n
    neg = torch.tensor([-3.0, -1.0, -2.0, -1.0, -5.0])
    assert select_topk(neg, 2).tolist() == [1, 3]
    assert select_topk(neg, 3).tolist() == [1, 3, 2]
    assert select_topk(torch.tensor([-0.0, 0.0, -1.0]), 1).tolist() == [0]  # -0 == 0 ties
    assert select_topk(s, 0).tolist() == []


def test_topk_mask_equals_select_topk():
    r = rng(10)
    T, n, k = 12, 30, 6
    s = torch.tensor(r.integers(-3, 4, (T, n)).astype(np.float32))
    pos = torch.arange(n)
    counts = torch.arange(T) + 19
    s = s.masked_fill(pos[None] >= counts[:, None], float("-inf"))
    m = topk_mask(s, counts, k)
    for t in range(T):
        want = set(ref.select_topk(s[t, : counts[t]].tolist(), k))
        assert set(m[t].nonzero().flatten().tolist()) == want


# ---- MoE ---------------------------------------------------------------------------------


def test_router(cfg):
    r = rng(12)
    E, D, k = cfg.num_experts, cfg.hidden_size, cfg.experts_per_token
    x, w, b = r.standard_normal((9, D)), r.standard_normal((E, D)) / 8, 0.3 * r.standard_normal(E)
    ids, wts = BE.route(BE.linear(t32(x), t32(w)), t32(b), k, True, 1.0)
    rids, rw = ref.router(x, w, b, k, True, 1.0)
    assert ids.tolist() == rids.tolist()
    assert_close(wts, rw, 2e-6)
    ids2, wts2 = BE.route(BE.linear(t32(x), t32(w)), t32(b), k, False, 2.5)
    assert_close(wts2, ref.router(x, w, b, k, False, 2.5)[1], 2e-6)


def test_dequant_nvfp4_bit_exact():
    r = rng(13)
    out, inn = 16, 64
    packed = r.integers(0, 256, (out, inn // 2), dtype=np.uint8)
    byte_pool = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)  # every non-NaN E4M3
    scales = r.choice(byte_pool, (out, inn // 16)).astype(np.uint8)
    glob = r.uniform(0.01, 1.0, out).astype(np.float32)
    got = dequant_nvfp4(NVFP4Matrix(torch.tensor(packed), torch.tensor(scales), torch.tensor(glob)))
    want = ref.dequant_nvfp4(packed, scales, glob).astype(np.float32)
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))  # bit-exact, signed zeros too


def test_expert_ffn(cfg):
    gen = torch.Generator().manual_seed(14)
    I, Dl, k = cfg.moe_intermediate_size, cfg.routed_expert_hidden_size, cfg.experts_per_token
    experts = {
        e: ExpertWeights(random_nvfp4(I, Dl, gen), random_nvfp4(I, Dl, gen), random_nvfp4(Dl, I, gen)) for e in range(6)
    }
    r = rng(14)
    z = r.standard_normal((7, Dl))
    ids = np.stack([r.permutation(6)[:k] for _ in range(7)])
    w = r.uniform(0.05, 1, (7, k))
    got = BE.expert_ffn(t32(z), torch.tensor(ids), t32(w), experts, cfg.situ_beta, cfg.situ_linear_beta)
    deq = {
        e: tuple(
            ref.dequant_nvfp4(m.packed.numpy(), m.scales.numpy(), m.global_scale.numpy())
            for m in (ew.gate, ew.up, ew.down)
        )
        for e, ew in experts.items()
    }
    assert_close(got, ref.expert_ffn(z, ids, w, deq, 4.0, 25.0), 1e-5)


# ---- AttnRes -----------------------------------------------------------------------------


@pytest.mark.parametrize("nb", [1, 3])
def test_attnres_mix(cfg, nb):
    r = rng(15 + nb)
    D = cfg.hidden_size
    partial, blocks = 3 * r.standard_normal((5, D)), [r.standard_normal((5, D)) * (i + 1) for i in range(nb)]
    proj, norm = r.standard_normal((1, D)) / math.sqrt(D) * 4, 1 + 0.1 * r.standard_normal(D)
    got = BE.attnres_mix(t32(partial), [t32(b) for b in blocks], t32(norm), t32(proj[0]), cfg.rms_norm_eps)
    assert_close(got, ref.attnres(partial, blocks, proj, norm, cfg.rms_norm_eps), 2e-6)
