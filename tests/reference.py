"""Float64 numpy references for the KimiLinear forward, written from the spec.

Sources: ../shared/spec/MODEL.md (§1 model loop, §2 KDA, §3 MLA, §4-5 MoE, §6 AttnRes,
§7 SiTU), ../shared/spec/K31_INDEXER.md (indexer, selection), INDEXER_FP4.md §B.4-B.5
(E4M3, NVFP4). Deliberately naive: token loops, explicit bit decoding, no torch. Nothing
here imports streamrt's model code.
"""

from __future__ import annotations

import math

import numpy as np

# ---- number formats --------------------------------------------------------------------


def e2m1(nibble: int) -> float:
    """E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    sign = -1.0 if nibble & 8 else 1.0
    e, m = (nibble >> 1) & 3, nibble & 1
    mag = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return sign * mag


def e4m3(byte: int) -> float:
    """OFP8 E4M3 (fn): bias 7; exponent 0 subnormal (m/8 * 2^-6); S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 15, byte & 7
    if e == 15 and m == 7:
        return math.nan
    mag = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return sign * mag


E2M1_TABLE = np.array([e2m1(i) for i in range(16)])
E4M3_TABLE = np.array([e4m3(i) for i in range(256)])


def dequant_nvfp4(packed: np.ndarray, scales: np.ndarray, global_scale: np.ndarray) -> np.ndarray:
    """packed uint8 [out, in/2] (low nibble = even element), scales uint8 [out, in/16], global [out]."""
    out, half = packed.shape
    w = np.empty((out, 2 * half))
    w[:, 0::2] = E2M1_TABLE[packed & 15]
    w[:, 1::2] = E2M1_TABLE[packed >> 4]
    for j in range(2 * half // 16):
        w[:, 16 * j : 16 * j + 16] *= E4M3_TABLE[scales[:, j]][:, None]
    return w * np.asarray(global_scale, dtype=np.float64)[:, None]


# ---- elementwise / norms ---------------------------------------------------------------


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def gated_rmsnorm(o, gate, w, eps):
    """FusedRMSNormGated(sigmoid): rmsnorm(o) * w * sigmoid(gate), per head over the last dim."""
    return rmsnorm(o, w, eps) * sigmoid(gate)


def layernorm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def l2norm(x, eps):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def situ_glu(gate, up, beta, linear_beta):
    g = beta * np.tanh(gate / beta) * sigmoid(gate)
    u = linear_beta * np.tanh(up / linear_beta) if linear_beta is not None else up
    return g * u


# ---- KDA -------------------------------------------------------------------------------


def short_conv(z, w, history=None):
    """z [T, P] conv inputs; w [P, W]; history [W-1, P] earlier inputs (zeros if None).
    out_t[c] = SiLU(sum_j w[c, j] * z_{t-(W-1)+j}[c])."""
    T, P = z.shape
    W = w.shape[1]
    hist = np.zeros((W - 1, P)) if history is None else history
    full = np.concatenate([hist, z], 0)
    out = np.zeros((T, P))
    for t in range(T):
        for j in range(W):
            out[t] += w[:, j] * full[t + j]
    return silu(out)


def kda_gate(f, a_log, dt_bias, lower_bound):
    """f [..., H, K]; a_log [H]; dt_bias [H*K] -> g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))."""
    H, K = f.shape[-2:]
    return lower_bound * sigmoid(np.exp(a_log)[:, None] * (f + dt_bias.reshape(H, K)))


def kda_recurrent(q, k, v, g, beta, S0=None):
    """Token loop. q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; S [H, K, V]. Returns (o [T, H, V], S)."""
    T, H, K = q.shape
    S = np.zeros((H, K, v.shape[-1])) if S0 is None else S0.copy()
    o = np.zeros((T, H, v.shape[-1]))
    for t in range(T):
        for h in range(H):
            S[h] = np.exp(g[t, h])[:, None] * S[h]
            S[h] = S[h] + beta[t, h] * np.outer(k[t, h], v[t, h] - S[h].T @ k[t, h])
            o[t, h] = S[h].T @ q[t, h]
    return o, S


def kda_layer(p, x, cfg):
    """Whole KDA sublayer, x [T, D] (post input_layernorm) -> [T, D]; p: tensors under self_attn."""
    T = x.shape[0]
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    conv = lambda name, proj: short_conv(x @ p[proj].T, p[name][:, 0, :])  # noqa: E731
    q = conv("q_conv1d.weight", "q_proj.weight").reshape(T, H, K)
    k = conv("k_conv1d.weight", "k_proj.weight").reshape(T, H, K)
    v = conv("v_conv1d.weight", "v_proj.weight").reshape(T, H, K)
    f = (x @ p["f_a_proj.weight"].T @ p["f_b_proj.weight"].T).reshape(T, H, K)
    g = kda_gate(f, p["A_log"][:H], p["dt_bias"], cfg.gate_lower_bound)
    beta = sigmoid(x @ p["b_proj.weight"].T)
    q = l2norm(q, 1e-6) * K**-0.5
    k = l2norm(k, 1e-6)
    o, _ = kda_recurrent(q, k, v, g, beta)
    gate = (x @ p["g_proj.weight"].T).reshape(T, H, K)
    y = gated_rmsnorm(o, gate, p["o_norm.weight"], cfg.rms_norm_eps)
    return y.reshape(T, H * K) @ p["o_proj.weight"].T


# ---- MLA + indexer ---------------------------------------------------------------------


def select_topk(scores, k):
    """Tie rule of K31_INDEXER.md, by a different road: rank (score desc, position asc),
    keep the first k, then emit strictly-above-threshold ascending, then the ties ascending."""
    n = len(scores)
    k = min(k, n)
    order = sorted(range(n), key=lambda s: (-scores[s], s))[:k]
    if k == 0:
        return []
    v = scores[order[-1]]
    return sorted(s for s in order if scores[s] > v) + sorted(s for s in order if scores[s] == v)


def indexer_scores(q, w, keys):
    """q [Hi, Di], w [Hi], keys [n, Di] -> I [n] = sum_h w[h] relu(q[h].k[s])."""
    return np.array(
        [sum(w[h] * max(0.0, float(q[h] @ keys[s])) for h in range(q.shape[0])) for s in range(keys.shape[0])]
    )


def indexer_qkw(p, x, cq, cfg):
    ic = cfg.indexer
    T = x.shape[0]
    q = (cq @ p["wq_b.weight"].T).reshape(T, ic.n_heads, ic.head_dim)
    k = layernorm(x @ p["wk.weight"].T, p["k_norm.weight"], p["k_norm.bias"], 1e-6)
    w = (x @ p["weights_proj.weight"].T) * ic.n_heads**-0.5 * ic.head_dim**-0.5
    return q, k, w


def mla_attention(q, k, v, scale, allowed):
    """q [T, H, dqk], k [n, H, dqk], v [n, H, dv], allowed bool [T, n] -> [T, H, dv]."""
    T, H, _ = q.shape
    out = np.zeros((T, H, v.shape[-1]))
    for t in range(T):
        idx = np.nonzero(allowed[t])[0]
        for h in range(H):
            s = np.array([q[t, h] @ k[j, h] for j in idx]) * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, h] = p @ v[idx, h]
    return out


def mla_layer(p, x, cfg, indexer: bool):
    """Expanded NoPE gated MLA over a whole sequence (causal, + indexer top-k if present)."""
    T = x.shape[0]
    H, dn, dr, dv, R = (
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    )
    cq = rmsnorm(x @ p["q_a_proj.weight"].T, p["q_a_layernorm.weight"], 1e-6)
    q = (cq @ p["q_b_proj.weight"].T).reshape(T, H, dn + dr)
    kv = x @ p["kv_a_proj_with_mqa.weight"].T
    c = rmsnorm(kv[:, :R], p["kv_a_layernorm.weight"], 1e-6)
    kr = kv[:, R:]
    kvb = (c @ p["kv_b_proj.weight"].T).reshape(T, H, dn + dv)
    k = np.concatenate([kvb[..., :dn], np.repeat(kr[:, None, :], H, axis=1)], -1)  # shared un-rotated dims
    v = kvb[..., dn:]
    allowed = np.tril(np.ones((T, T), dtype=bool))
    if indexer:
        qi, ki, wi = indexer_qkw(
            {n[len("indexer.") :]: a for n, a in p.items() if n.startswith("indexer.")}, x, cq, cfg
        )
        for t in range(T):
            sel = select_topk(indexer_scores(qi[t], wi[t], ki[: t + 1]), cfg.indexer.topk)
            allowed[t] = False
            allowed[t, sel] = True
    o = mla_attention(q, k, v, (dn + dr) ** -0.5, allowed)
    o = o.reshape(T, H * dv) * sigmoid(x @ p["g_proj.weight"].T)
    return o @ p["o_proj.weight"].T


# ---- MoE -------------------------------------------------------------------------------


def router(x, w_gate, bias, k, renormalize, scale):
    """-> (ids [T, k] by descending biased score, weights [T, k] from the unbiased sigmoid)."""
    s = sigmoid(x @ w_gate.T)
    ids = np.zeros((x.shape[0], k), dtype=np.int64)
    wts = np.zeros((x.shape[0], k))
    for t in range(x.shape[0]):
        choice = s[t] + bias
        ids[t] = sorted(range(len(choice)), key=lambda e: (-choice[e], e))[:k]
        wts[t] = s[t, ids[t]]
        if renormalize and k > 1:
            wts[t] = wts[t] / (wts[t].sum() + 1e-20)
    return ids, wts * scale


def expert_ffn(z, ids, weights, experts, beta, linear_beta):
    """experts: {e: (w1 [I, Dl], w3 [I, Dl], w2 [Dl, I])} float64."""
    out = np.zeros_like(z)
    for t in range(z.shape[0]):
        for j in range(ids.shape[1]):
            w1, w3, w2 = experts[int(ids[t, j])]
            out[t] += weights[t, j] * (w2 @ situ_glu(w1 @ z[t], w3 @ z[t], beta, linear_beta))
    return out


def glu_mlp(p, x, beta, linear_beta):
    return situ_glu(x @ p["gate_proj.weight"].T, x @ p["up_proj.weight"].T, beta, linear_beta) @ p["down_proj.weight"].T


def moe_layer(p, x, cfg, experts, beta, linear_beta):
    ids, w = router(
        x,
        p["gate.weight"],
        p["gate.e_score_correction_bias"],
        cfg.experts_per_token,
        cfg.moe_renormalize,
        cfg.routed_scaling_factor,
    )
    z = x @ p["routed_expert_down_proj.weight"].T
    u = expert_ffn(z, ids, w, experts, beta, linear_beta)
    u = rmsnorm(u, p["routed_expert_norm.weight"], cfg.rms_norm_eps)
    y = u @ p["routed_expert_up_proj.weight"].T
    if cfg.num_shared_experts:
        y = y + glu_mlp(
            {n[len("shared_experts.") :]: a for n, a in p.items() if n.startswith("shared_experts.")},
            x,
            beta,
            linear_beta,
        )
    return y


# ---- AttnRes and the model -------------------------------------------------------------


def attnres(partial, blocks, proj_w, norm_w, eps):
    """MODEL.md §6: candidates = blocks..., partial last; keys weightless-RMSNorm'd; query =
    norm gain * proj; softmax over candidates; mix the raw candidates."""
    V = np.stack(list(blocks) + [partial], axis=1)  # [T, nb+1, D]
    keys = V / np.sqrt(np.mean(V * V, axis=-1, keepdims=True) + eps)
    logits = keys @ (norm_w * proj_w.reshape(-1))  # [T, nb+1]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("tc,tcd->td", p, V)


def model_forward(cfg, params: dict, experts: dict, ids) -> np.ndarray:
    """Full forward over one sequence. params: state-dict names -> float64 arrays;
    experts: {(layer, e): (w1, w3, w2)} float64. Returns logits [T, vocab]."""
    eps = cfg.rms_norm_eps
    beta, lbeta = cfg.situ_beta, cfg.situ_linear_beta
    P = lambda prefix: {n[len(prefix) :]: a for n, a in params.items() if n.startswith(prefix)}  # noqa: E731
    h = params["model.embed_tokens.weight"][np.asarray(ids)]
    partial, blocks = h, []
    for i in range(cfg.num_layers):
        L = P(f"model.layers.{i}.")
        x = (
            attnres(partial, blocks, L["self_attention_res_proj.weight"], L["self_attention_res_norm.weight"], eps)
            if blocks
            else partial
        )
        if i % cfg.attn_res_block_size == 0:
            blocks = blocks + [partial]
            partial = None
        xin = rmsnorm(x, L["input_layernorm.weight"], eps)
        sa = {n[len("self_attn.") :]: a for n, a in L.items() if n.startswith("self_attn.")}
        if cfg.layer_kind(i) == "mla":
            a = mla_layer(sa, xin, cfg, indexer=cfg.indexer is not None and i in cfg.indexer.layers)
        else:
            a = kda_layer(sa, xin, cfg)
        partial = a if partial is None else partial + a
        y = attnres(partial, blocks, L["mlp_res_proj.weight"], L["mlp_res_norm.weight"], eps)
        hn = rmsnorm(y, L["post_attention_layernorm.weight"], eps)
        if i < cfg.first_k_dense_replace:
            m = glu_mlp({n[len("mlp.") :]: a for n, a in L.items() if n.startswith("mlp.")}, hn, beta, lbeta)
        else:
            mp = {n[len("block_sparse_moe.") :]: a for n, a in L.items() if n.startswith("block_sparse_moe.")}
            m = moe_layer(mp, hn, cfg, {e: experts[(l, e)] for (l, e) in experts if l == i}, beta, lbeta)
        partial = partial + m
    h = attnres(
        partial, blocks, params["model.output_attn_res_proj.weight"], params["model.output_attn_res_norm.weight"], eps
    )
    h = rmsnorm(h, params["model.norm.weight"], eps)
    return h @ params["lm_head.weight"].T
