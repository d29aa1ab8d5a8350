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
partial sub-chunk with its new tokens, and the sub-chunks run in groups of one fixed shape
(`chunks_per_group`, the last group zero-padded), so each position's arithmetic has the same
shapes and order for every C. A decode step drops the anchor (the next prefill anchors at the
current state).
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
KDA_GROUP_BYTES = 512 << 20  # bound on the decay blocks of one group of sub-chunks


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


def chunks_per_group(H: int, K: int, chunk: int = KDA_CHUNK, device: str = "cuda") -> int:
    """How many sub-chunks `kda_chunked` batches into one group. On a GPU: a power of two up to
    16 keeping the group's two [H, G, C, C, K] fp32 decay blocks under `KDA_GROUP_BYTES` per
    sequence (fewer, larger launches; bench_kda_prefill.py). On a CPU, 4: larger groups fall out
    of cache and run slower. It depends only on the model's shape and the device type, so every
    prefill on one device has the same groups."""
    if device == "cpu":
        return 4
    per_chunk = 2 * H * chunk * chunk * K * 4
    g = 1
    while g < 16 and 2 * g * per_chunk <= KDA_GROUP_BYTES:
        g *= 2
    return g


def kda_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None, chunk: int = KDA_CHUNK,
    *, boundary: bool = False, group: int | None = None,
):
    """The delta rule over a sequence, chunk by chunk (WY form), fp32 and differentiable.

    q, k, g [B, T, H, K] (q, k normalised, q scaled; g log-decay); v [B, T, H, V];
    beta [B, T, H]; state [B, H, K, V] or None. Returns (o [B, T, H, V], final state), and
    with boundary=True also the state after the last whole chunk (the initial state if none).
    The sequence is zero-padded to whole groups of `group` chunks (default `chunks_per_group`; a token with
    k = v = g = beta = 0 changes nothing), so every group has one shape whatever T is.

    Inside a chunk, with G_t = sum_{s<=t} g_s (per channel) and u_t = v_t - (D_t S_{t-1})^T k_t:
        (I + M) U = V - (exp(G) * K) S0,   M[t,s] = beta_s sum_d k_t k_s exp(G_t - G_s), s < t
        O = (exp(G) * Q) S0 + P U,         P[t,s] = beta_s sum_d q_t k_s exp(G_t - G_s), s <= t
        S_C = exp(G_C) * S0 + sum_s (exp(G_C - G_s) * k_s) beta_s u_s^T
    Every exponent is <= 0, so nothing overflows. U is linear in S0: U = U' - W S0 with
    (I + M) [U' W] = [V exp(G) * K], so all of a group's chunks are solved at once and only
    S_next = A S + Bs (A = diag exp(G_C) - Tail^T W, Bs = Tail^T U') runs chunk after chunk.
    """
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    group = group or chunks_per_group(H, K, chunk, q.device.type)
    pad = -T % (group * chunk)
    if pad:
        q, k, v, g, beta = (torch.cat((t, t.new_zeros(B, pad, *t.shape[2:])), 1) for t in (q, k, v, g, beta))
    n_chunks = (T + pad) // chunk
    q, k, v, g = (t.float().transpose(1, 2).reshape(B, H, n_chunks, chunk, -1) for t in (q, k, v, g))  # [B, H, n, C, .]
    beta = beta.float().transpose(1, 2).reshape(B, H, n_chunks, chunk)
    ar = torch.arange(chunk, device=q.device)
    incl = (ar[:, None] >= ar[None, :])[..., None]  # [C, C, 1], s <= t
    strict = ~incl[..., 0] | torch.eye(chunk, dtype=torch.bool, device=q.device)  # not s < t
    S = q.new_zeros(B, H, K, Vd) if state is None else state.float()
    S_whole, last_whole, used = S, T // chunk, -(-T // chunk)
    outs = []
    for n0 in range(0, n_chunks, group):
        qc, kc, vc, gc, bc = (t[:, :, n0 : n0 + group] for t in (q, k, v, g, beta))  # [B, H, G, C, .]
        Gc = gc.cumsum(-2)
        # [.., C(t), C(s), K]
        decay = (Gc[..., :, None, :] - Gc[..., None, :, :]).masked_fill(~incl, float("-inf")).exp()
        kq = (decay * kc[..., None, :, :]) @ torch.stack((kc, qc), -1)  # [.., C(t), C(s), 2]: k_t and q_t against k_s
        kk, Pm = (kq[..., i] * bc[..., None, :] for i in (0, 1))  # [B, H, G, C, C], P zero above the diagonal
        eG = Gc.exp()
        # unitriangular: the solver takes the unit diagonal as given, so M's strict lower part is all it reads
        X = torch.linalg.solve_triangular(kk.masked_fill(strict, 0.0), torch.cat((vc, eG * kc), -1),
                                          upper=False, unitriangular=True)
        Up, W = X.split((Vd, K), -1)  # U = U' - W S0
        tail = ((Gc[..., -1:, :] - Gc).exp() * kc * bc[..., None]).transpose(-1, -2)  # [B, H, G, K, C]
        A = torch.diag_embed(eG[..., -1, :]) - tail @ W  # [B, H, G, K, K]
        Bs = tail @ Up  # [B, H, G, K, V]
        starts = []
        for j in range(min(group, used - n0)):  # the padding chunks would leave S as it is
            starts.append(S)
            S = A[:, :, j] @ S + Bs[:, :, j]
            if n0 + j + 1 == last_whole:
                S_whole = S
        starts += [S] * (group - len(starts))
        outs.append(Pm @ Up + (eG * qc - Pm @ W) @ torch.stack(starts, 2))  # [B, H, G, C, V]
    o = torch.cat(outs, dim=2).reshape(B, H, n_chunks * chunk, Vd).transpose(1, 2)[:, :T]  # [B, T, H, V]
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

    def forward(self, x: Tensor, step: Step, cache: KDACache | None, add: tuple[Tensor, ...] = ()) -> Tensor:
        """x [N, D] (post input_layernorm) -> [N, D], then + each of `add` (residuals, added by the
        output projection)."""
        be, B, T, H, K = step.be, step.batch, step.seqlen, self.H, self.K
        N = B * T
        # the projections of x at once (one GEMV launch on the nvrtc backend); at decode the output
        # gate's too (a prefill chunk would hold its [N, H*K] through the whole chunk)
        mats = [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj] + [self.g_proj] * step.decode
        zq, zk, zv, fa, zb, *gate = be.linears(x, [m.weight for m in mats])
        convs = (self.q_conv1d.weight[:, 0], self.k_conv1d.weight[:, 0], self.v_conv1d.weight[:, 0])  # [P, W]
        if step.decode:  # the convs and q's and k's norms: one op
            q, k, v = be.kda_conv_step(
                (zq, zk, zv), (cache.conv_q, cache.conv_k, cache.conv_v), convs, K, L2_EPS, K**-0.5
            )
        else:
            states = (None, None, None) if cache is None else (cache.conv_q, cache.conv_k, cache.conv_v)
            res = [
                short_conv_prefill(z.view(B, T, -1), w, None if cache is None else st)
                for z, w, st in zip((zq, zk, zv), convs, states)
            ]
            if cache is not None:  # in place: the cache keeps its addresses (a decode graph stays valid)
                for state, r in zip((cache.conv_q, cache.conv_k, cache.conv_v), res):
                    state.copy_(r[1].detach())
            q = be.l2norm(res[0][0].reshape(N, H, K), L2_EPS, K**-0.5)  # [N, H, K]
            k = be.l2norm(res[1][0].reshape(N, H, K), L2_EPS)
            v = res[2][0].reshape(N, H, K)  # V = K
        f = be.linear(fa, self.f_b_proj.weight).view(N, H, K)
        # g [N, H, K] log-decay in (lb, 0), beta [N, H]
        g, beta = be.kda_gates(f, zb, self.A_log[:H], self.dt_bias, self.lower_bound)
        if step.decode:
            o = be.kda_step(q, k, v, g, beta, cache.state)  # [B, H, V]
            cache.drop_anchor()
        elif cache is None:
            shape = lambda t: t.reshape(B, T, *t.shape[1:])  # noqa: E731
            o, _ = kda_chunked(shape(q), shape(k), shape(v), shape(g), shape(beta), None)
            o = o.reshape(N, H, K)
        else:
            o = self._prefill_anchored(q, k, v, g, beta, B, T, cache).reshape(N, H, K)
        gate = gate[0] if gate else be.linear(x, self.g_proj.weight)
        y = be.gated_rmsnorm(o, gate.view(N, H, K), self.o_norm.weight, self.eps)  # [N, H, V]
        return be.linear(y.reshape(N, H * K), self.o_proj.weight, add)  # [N, D]

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
        if S_whole.data_ptr() == cache.state.data_ptr():  # no boundary crossed: the anchor is the old state,
            S_whole = S_whole.clone()  # which the copy below (and every decode step) overwrites
        cache.state.copy_(S.detach())
        cache.set_anchor(S_whole.detach(), [t[:, whole:] for t in seq])
        return o[:, L:]
