"""KDA, Kimi Delta Attention (spec/MODEL.md §2), with K3's lower-bound gate.

Axis legend: B sequences, T tokens, N = B*T rows, D hidden, H heads, K = V head dim,
P = H*K, W conv width, C chunk length.

Per token and head (state S [K, V], fp32, zero at the start):
    S <- diag(exp g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t
Prefill runs the chunked form (`kda_chunked`, differentiable, no token loop inside a
chunk); decode runs the recurrent step (`Backend.kda_step`).

Chunked prefill on a cache: the WY sub-chunks of `KDA_CHUNK` tokens sit at fixed positions
(anchor + j * KDA_CHUNK, the anchor being where this run of prefills started), whatever the
prefill chunk C is. The cache keeps the state at the last sub-chunk boundary and the few
tokens since it (`KDACache.anchor_state`, `.pending`); the next prefill chunk recomputes that
partial sub-chunk with its new tokens, and every sub-chunk is zero-padded to KDA_CHUNK, so
each position's arithmetic has the same shapes and order for every C. A decode step drops
the anchor (the next prefill anchors at the current state).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from streamrt.errors import CheckpointError
from streamrt.model.cache import KDACache, Step
from streamrt.model.layers import RMSNorm
from streamrt.ops import sigmoid

L2_EPS = 1e-6  # inside the sqrt (FLA l2norm)
KDA_CHUNK = 32  # WY sub-chunk length of the prefill form


def short_conv_prefill(z: Tensor, w: Tensor, prefix: Tensor | None) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv + SiLU over a sequence.

    z [B, T, P]; w [P, W]; prefix [B, P, W] (the conv cache: last W inputs) or None (zeros).
    Returns (SiLU(conv) [B, T, P], new conv cache [B, P, W]).
    """
    B, T, P = z.shape
    W = w.shape[-1]
    zt = z.transpose(1, 2)  # [B, P, T]
    if prefix is None:
        prefix = zt.new_zeros(B, P, W)
    xp = torch.cat((prefix[..., 1:].to(zt.dtype), zt), dim=-1)  # [B, P, W-1+T]
    w = w.float()
    y = xp[..., 0:T] * w[:, 0:1]  # cross-correlation, taps in a fixed order (no T-dependent conv algorithm)
    for j in range(1, W):
        y = y + xp[..., j : j + T] * w[:, j : j + 1]  # [B, P, T]
    y = y.transpose(1, 2)  # [B, T, P]
    return y * sigmoid(y), torch.cat((prefix.to(zt.dtype), zt), dim=-1)[..., -W:].contiguous()


def kda_gate(f: Tensor, a_log: Tensor, dt_bias: Tensor, lower_bound: float) -> Tensor:
    """K3 log-decay g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)); f [N, H, K], a_log [H] -> [N, H, K]."""
    H, K = f.shape[-2:]
    u = f.float() + dt_bias.float().view(H, K)
    return lower_bound * sigmoid(torch.exp(a_log.float())[:, None] * u)


def kda_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None, chunk: int = KDA_CHUNK,
    *, boundary: bool = False,
):
    """The delta rule over a sequence, chunk by chunk (WY form), fp32 and differentiable.

    q, k, g [B, T, H, K] (q, k normalised, q scaled; g log-decay); v [B, T, H, V];
    beta [B, T, H]; state [B, H, K, V] or None. Returns (o [B, T, H, V], final state), and
    with boundary=True also the state after the last whole chunk (the initial state if none).
    A last partial chunk is zero-padded to `chunk` (a token with k = v = g = beta = 0 changes
    nothing), so every chunk has one shape.

    Inside a chunk, with G_t = sum_{s<=t} g_s (per channel) and u_t = v_t - (D_t S_{t-1})^T k_t:
        (I + M) U = V - (exp(G) * K) S0,   M[t,s] = beta_s sum_d k_t k_s exp(G_t - G_s), s < t
        O = (exp(G) * Q) S0 + P U,         P[t,s] = beta_s sum_d q_t k_s exp(G_t - G_s), s <= t
        S_C = exp(G_C) * S0 + sum_s (exp(G_C - G_s) * k_s) beta_s u_s^T
    Every exponent is <= 0, so nothing overflows.
    """
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    pad = -T % chunk
    if pad:
        q, k, v, g, beta = (torch.cat((t, t.new_zeros(B, pad, *t.shape[2:])), 1) for t in (q, k, v, g, beta))
    q, k, v, g, beta = (t.float().transpose(1, 2) for t in (q, k, v, g, beta))  # [B, H, T, .]
    S = q.new_zeros(B, H, K, Vd) if state is None else state.float()
    S_whole = S
    outs = []
    for c0 in range(0, T + pad, chunk):
        qc, kc, vc, gc, bc = (t[:, :, c0 : c0 + chunk] for t in (q, k, v, g, beta))
        C = qc.shape[2]
        G = gc.cumsum(2)  # [B, H, C, K]
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # [B, H, C(t), C(s), K]
        ar = torch.arange(C, device=q.device)
        incl = (ar[:, None] >= ar[None, :])[..., None]  # [C, C, 1], s <= t
        decay = diff.masked_fill(~incl, float("-inf")).exp()  # exp(G_t - G_s), 0 above the diagonal
        kk = torch.einsum("bhtd,bhsd,bhtsd->bhts", kc, kc, decay) * bc[:, :, None, :]  # [B, H, C, C]
        M = kk.masked_fill(~incl[..., 0] | torch.eye(C, dtype=torch.bool, device=q.device), 0.0)  # strictly lower
        eG = G.exp()  # [B, H, C, K]
        rhs = vc - (eG * kc) @ S  # [B, H, C, V]
        eye = torch.eye(C, device=q.device).expand_as(M)
        U = torch.linalg.solve_triangular(eye + M, rhs, upper=False, unitriangular=True)  # [B, H, C, V]
        Pm = torch.einsum("bhtd,bhsd,bhtsd->bhts", qc, kc, decay) * bc[:, :, None, :]  # [B, H, C, C], s <= t
        outs.append((eG * qc) @ S + Pm @ U)  # [B, H, C, V]
        tail = (G[:, :, -1:, :] - G).exp() * kc * bc[..., None]  # [B, H, C, K]
        S = G[:, :, -1, :, None].exp() * S + tail.transpose(-1, -2) @ U  # [B, H, K, V]
        if c0 + chunk <= T:
            S_whole = S
    o = torch.cat(outs, dim=2).transpose(1, 2)[:, :T]  # [B, T, H, V]
    return (o, S, S_whole) if boundary else (o, S)


class KimiDeltaAttention(nn.Module):
    """K3 KDA: q/k/v projections + short convs, low-rank decay gate, beta, full-rank output gate."""

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        D, H, K, W = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
        P = H * K
        self.layer_idx, self.H, self.K = layer_idx, H, K
        self.lower_bound, self.eps = cfg.gate_lower_bound, cfg.rms_norm_eps
        self.q_proj = nn.Linear(D, P, bias=False)
        self.k_proj = nn.Linear(D, P, bias=False)
        self.v_proj = nn.Linear(D, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, W, groups=P, padding=W - 1, bias=False)  # weight [P, 1, W]
        self.k_conv1d = nn.Conv1d(P, P, W, groups=P, padding=W - 1, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, W, groups=P, padding=W - 1, bias=False)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.A_log = nn.Parameter(torch.zeros(cfg.a_log_stored_len))  # per head, zero-padded (MODEL.md §2.5)
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_proj = nn.Linear(D, P, bias=False)
        self.o_norm = RMSNorm(K, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(P, D, bias=False)
        self.register_load_state_dict_post_hook(lambda m, _keys: m.check_a_log())

    def check_a_log(self, name: str | None = None) -> None:
        """The stored A_log is padded to a multiple of head_dim; the padding must be zero."""
        if self.A_log.is_meta:
            return
        pad = self.A_log.detach()[self.H :]
        if pad.numel() and bool((pad != 0).any()):
            name = name or f"model.layers.{self.layer_idx}.self_attn.A_log"
            bad = int((pad != 0).nonzero()[0]) + self.H
            raise CheckpointError(
                f"{name}: entries {self.H}..{self.A_log.numel() - 1} are padding and must be zero "
                f"(entry {bad} is {float(pad[bad - self.H])}); only the first {self.H} (one per head) are used"
            )

    def forward(self, x: Tensor, step: Step, cache: KDACache | None) -> Tensor:
        """x [N, D] (post input_layernorm) -> [N, D]."""
        be, B, T, H, K = step.be, step.batch, step.seqlen, self.H, self.K
        N = B * T
        zq, zk, zv = (be.linear(x, m.weight) for m in (self.q_proj, self.k_proj, self.v_proj))  # [N, P]
        convs = (self.q_conv1d.weight[:, 0], self.k_conv1d.weight[:, 0], self.v_conv1d.weight[:, 0])  # [P, W]
        if step.decode:
            q, k, v = (be.short_conv_step(z, st, w) for z, st, w in zip((zq, zk, zv), (cache.conv_q, cache.conv_k, cache.conv_v), convs))
        else:
            res = [
                short_conv_prefill(z.view(B, T, -1), w, None if cache is None else st)
                for z, w, st in zip((zq, zk, zv), convs, (None, None, None) if cache is None else (cache.conv_q, cache.conv_k, cache.conv_v))
            ]
            q, k, v = (r[0].reshape(N, -1) for r in res)
            if cache is not None:
                cache.conv_q, cache.conv_k, cache.conv_v = (r[1].detach() for r in res)
        f = be.linear(be.linear(x, self.f_a_proj.weight), self.f_b_proj.weight).view(N, H, K)
        g = kda_gate(f, self.A_log[:H], self.dt_bias, self.lower_bound)  # [N, H, K], log-decay in (lb, 0)
        beta = sigmoid(be.linear(x, self.b_proj.weight))  # [N, H]
        q = be.l2norm(q.view(N, H, K), L2_EPS) * K**-0.5  # [N, H, K]
        k = be.l2norm(k.view(N, H, K), L2_EPS)
        v = v.view(N, H, K)  # V = K
        if step.decode:
            o = be.kda_step(q, k, v, g, beta, cache.state)  # [B, H, V]
            cache.drop_anchor()
        elif cache is None:
            shape = lambda t: t.reshape(B, T, *t.shape[1:])  # noqa: E731
            o, _ = kda_chunked(shape(q), shape(k), shape(v), shape(g), shape(beta), None)
            o = o.reshape(N, H, K)
        else:
            o = self._prefill_anchored(q, k, v, g, beta, B, T, cache).reshape(N, H, K)
        gate = be.linear(x, self.g_proj.weight).view(N, H, K)
        y = be.gated_rmsnorm(o, gate, self.o_norm.weight, self.eps)  # [N, H, V]
        return be.linear(y.reshape(N, H * K), self.o_proj.weight)  # [N, D]

    @staticmethod
    def _prefill_anchored(q, k, v, g, beta, B: int, T: int, cache: KDACache) -> Tensor:
        """One prefill chunk on a cache, sub-chunks fixed relative to the anchor (module doc).
        q, k, v, g [B*T, H, K], beta [B*T, H] -> o [B, T, H, V]; updates the cache."""
        new = [t.reshape(B, T, *t.shape[1:]).detach() for t in (q, k, v, g, beta)]
        S0, pending = cache.anchor()
        L = 0 if pending is None else pending[0].shape[1]
        seq = new if pending is None else [torch.cat((p, t), 1) for p, t in zip(pending, new)]  # [B, L+T, ...]
        o, S, S_whole = kda_chunked(*seq, S0, KDA_CHUNK, boundary=True)
        whole = (L + T) // KDA_CHUNK * KDA_CHUNK
        cache.state = S.detach()
        cache.set_anchor(S_whole.detach(), [t[:, whole:] for t in seq])
        return o[:, L:]
