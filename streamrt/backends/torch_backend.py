"""The reference Backend: plain torch, CPU or GPU, fp32 arithmetic.

Every op follows the docstring of `backends/base.py`. Axis legend: T rows (tokens or
sequences), D hidden, H heads, K/V head dims, R MLA latent rank, n cached positions,
k top-k, E experts, P = H*K.

Batch invariance. Decode ops are row-wise: a row's result depends only on that row. For
elementwise and last-dim reductions that holds by construction. For matrix products it
does not (a GEMM's blocking depends on the row count), so `linear` runs one GEMV per row
while T <= `rowwise_max`; bigger T (prefill) and anything autograd tracks (training) take
one GEMM, which is faster but only equal to the row-wise result within rounding. Prefill is therefore run per sequence
(see `streamrt.generate`), so a row never depends on its batch companions.

Chunk invariance (prefill). A prefill runs in chunks of C tokens (`--prefill-chunk`), and a
position's logits must not depend on C. The model asks for `for_prefill()`, a view of this
backend whose every product has a shape that C does not change: `linear` runs fixed tiles of
`row_tile` rows (the last one zero-padded; a fixed-shape GEMM gives a row the same bits
wherever it sits in the tile), and `mla_prefill` runs fixed query tiles against fixed key
blocks, in ascending block order, with an online softmax (a block a row cannot see leaves its
XX
CPU sigmoid / SiLU take a scalar path for a buffer's tail whose bits differ from the vector
path, so a position's value would depend on where the buffer ends.

All ops are differentiable (no in-place writes on inputs) except the two that update a
decode cache in place by contract: `short_conv_step` and `kda_step`.
"""

from __future__ import annotations

import copy
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from streamrt.expert_weights import ExpertWeights, NVFP4Matrix, RoutedExperts, as_routed
from streamrt.ops import kda_gate, route, select_topk, sigmoid, situ_glu, topk_mask

# E2M1 nibble -> value: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_LUT_CACHE: dict[torch.device, Tensor] = {}


def _e2m1_lut(device: torch.device) -> Tensor:
    lut = _LUT_CACHE.get(device)
    if lut is None:
        lut = _LUT_CACHE[device] = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return lut


def dequant_nvfp4(m: NVFP4Matrix) -> Tensor:
    """One NVFP4 matrix -> fp32 [out, in]: e2m1(nibble) * e4m3(scale) * global[row].

    The product e2m1 * e4m3 is exact in fp32; the global scale is the one rounding step.
    """
    out, half = m.packed.shape
    lut = _e2m1_lut(m.packed.device)
    p = m.packed.to(torch.int64)
    vals = torch.stack((lut[p & 15], lut[p >> 4]), dim=-1).view(out, half * 2 // 16, 16)  # [out, in/16, 16]
    s = m.scales.view(torch.float8_e4m3fn).float()  # [out, in/16]
    w = (vals * s[..., None]).view(out, half * 2)  # [out, in]
    return w * m.global_scale.float()[:, None]


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    """x [m, ...] with m <= rows -> [rows, ...], zero rows appended."""
    return x if x.shape[0] == rows else torch.cat((x, x.new_zeros(rows - x.shape[0], *x.shape[1:])))


SPARSE_ROWS = 16  # queries per gathered top-k attention product (mla_prefill): [16, topk, R] fp32 at a time
# mla_prefill: a query at position t gathers its top-k keys once t + 1 > SPARSE_FROM * topk; below,
# the masked block loop reads fewer bytes than a per-query gather of topk keys
SPARSE_FROM = 4


def _key_block(t: Tensor, p0: int, size: int) -> Tensor:
    """Rows p0 .. p0+size-1 of t [n, d], zero rows past the end: one fixed-size key block."""
    return _pad_rows(t[p0 : p0 + size], size)


class TorchBackend:
    """Reference ops. `rowwise_max`: up to this many rows, `linear` runs one GEMV per row.

    Prefill tiles (fixed per backend and device type, never derived from the chunk):
    `row_tile` rows per GEMM in `linear`, `q_tile` queries x `key_block` keys per step of
    `mla_prefill`. None: the device's default (`TILES`; bigger on CUDA, where a step is a
    few kernel launches and a 128k-token prompt must not take a million of them).
    """

    name = "torch"
    captures_decode = False  # reads routed ids on the host: no CUDA graph of a decode step
    prefill_rows_exact = True  # fixed-tile prefill products: a prompt resumes anywhere, bit for bit
    TILES = {"cpu": (64, 64, 256), "cuda": (64, 256, 2048)}  # (row_tile, q_tile, key_block)

    def __init__(self, rowwise_max: int = 64, block_elems: int = 1 << 24, row_tile: int | None = None,
                 q_tile: int | None = None, key_block: int | None = None):
        self.rowwise_max = rowwise_max
        self.block_elems = block_elems  # weights above this are converted to fp32 in row blocks
        self._tiles = (row_tile, q_tile, key_block)
        self.tiled = False  # True on the prefill view: every linear runs fixed row tiles

    def tiles(self, device: torch.device) -> tuple[int, int, int]:
        """(row_tile, q_tile, key_block) on this device type."""
        dflt = self.TILES.get(device.type, self.TILES["cpu"])
        return tuple(mine or d for mine, d in zip(self._tiles, dflt))

    def for_prefill(self) -> "TorchBackend":
        """This backend with fixed-tile GEMMs: what a prefill chunk runs on (chunk-invariant)."""
        view = copy.copy(self)
        view.tiled = True
        return view

    # ---- dense ---------------------------------------------------------------------

    def linear(self, x: Tensor, w: Tensor, add: Sequence[Tensor] = ()) -> Tensor:
        """x [T, in] fp32, w [out, in] -> [T, out] fp32 (fp32 accumulation), then + add[0] + add[1]."""
        y = self._product(x, w)
        for a in add:
            y = y + a
        return y

    def linears(self, x: Tensor, ws: Sequence[Tensor]) -> list[Tensor]:
        return [self._product(x, w) for w in ws]

    def _product(self, x: Tensor, w: Tensor) -> Tensor:
        x = x.float()
        T, out = x.shape[0], w.shape[0]
        rows = max(1, self.block_elems // max(1, w.shape[1]))  # depends on w only, never on T
        grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
        parts = []
        for r0 in range(0, out, rows):
            w32 = w[r0 : r0 + rows].float()  # [out_blk, in]
            if grad:
                parts.append(x @ w32.T)
            elif T == 0:
                parts.append(x.new_zeros(0, w32.shape[0]))
            elif T <= self.rowwise_max and not self.tiled:
                parts.append(torch.stack([torch.mv(w32, x[t]) for t in range(T)]))
            else:  # fixed [row_tile, in] GEMMs: a row's bits do not depend on T or its tile companions
                R = self.tiles(x.device)[0]
                tiles = [_pad_rows(x[t0 : t0 + R], R) @ w32.T for t0 in range(0, T, R)]
                parts.append(torch.cat(tiles)[:T])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def rmsnorm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        x = x.float()
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.float()

    def gated_rmsnorm(self, o: Tensor, gate: Tensor, w: Tensor, eps: float) -> Tensor:
        return self.rmsnorm(o, w, eps) * sigmoid(gate)

    def layernorm(self, x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
        x = x.float()
        mu = x.mean(-1, keepdim=True)
        xc = x - mu
        return xc * torch.rsqrt(xc.square().mean(-1, keepdim=True) + eps) * w.float() + b.float()

    def l2norm(self, x: Tensor, eps: float, scale: float = 1.0) -> Tensor:
        x = x.float()
        y = x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)
        return y if scale == 1.0 else y * scale

    def sigmoid_mul(self, x: Tensor, gate: Tensor) -> Tensor:
        return x.float() * sigmoid(gate)

    def situ_glu(self, gate: Tensor, up: Tensor, beta: float, linear_beta: float | None) -> Tensor:
        return situ_glu(gate, up, beta, linear_beta)

    # ---- KDA -----------------------------------------------------------------------

    def short_conv_step(self, z: Tensor, conv_state: Tensor, w: Tensor) -> Tensor:
        """z [T, P]; conv_state [T, P, W] updated in place; w [P, W] -> SiLU(conv) [T, P]."""
        conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
        conv_state[..., -1] = z
        return F.silu((conv_state * w.float()).sum(-1))

    def kda_conv_step(self, zs: Sequence[Tensor], states: Sequence[Tensor], ws: Sequence[Tensor], K: int, eps: float,
                      q_scale: float) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = (self.short_conv_step(z, st, w).view(z.shape[0], -1, K) for z, st, w in zip(zs, states, ws))
        return self.l2norm(q, eps, q_scale), self.l2norm(k, eps), v

    def kda_gates(
        self, f: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor, lower_bound: float
    ) -> tuple[Tensor, Tensor]:
        return kda_gate(f, a_log, dt_bias, lower_bound), sigmoid(b)

    def kda_step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
        """One delta-rule step, in place on state [T, H, K, V]; returns o = S^T q [T, H, V]."""
        state.mul_(torch.exp(g)[..., None])  # S <- diag(exp g) S
        pred = (state * k[..., None]).sum(-2)  # [T, H, V] = S^T k
        state.add_((beta[..., None, None] * k[..., None]) * (v - pred)[..., None, :])
        return (state * q[..., None]).sum(-2)  # [T, H, V], from the updated state

    # ---- MLA + indexer -------------------------------------------------------------

    def mla_decode(
        self, q_lat: Tensor, q_rot: Tensor, c_cache: Tensor, kr_cache: Tensor, scale: float, select: Tensor | None,
        length: Tensor | None = None,
    ) -> Tensor:
        """q_lat [H, R], q_rot [H, Dr], c_cache [n, R], kr_cache [n, Dr] -> sum_t p c_t [H, R];
        with a leading row dim B on each (length [B]), row by row."""
        if q_lat.dim() == 3:
            return torch.stack([
                self.mla_decode(q_lat[b], q_rot[b], c_cache[b], kr_cache[b], scale,
                                None if select is None else select[b],
                                None if length is None else length[b : b + 1])
                for b in range(q_lat.shape[0])
            ])
        if length is not None:  # the host reads it (this backend is not captured in CUDA graphs)
            n = int(length)
            c_cache, kr_cache = c_cache[:n], kr_cache[:n]
            select = None if select is None else select[:n]
        if select is not None:
            c_cache, kr_cache = c_cache[select], kr_cache[select]  # [m, R], [m, Dr]
        s = (q_lat @ c_cache.T + q_rot @ kr_cache.T) * scale  # [H, m]
        p = torch.softmax(s, dim=-1)
        return p @ c_cache  # [H, R]

    def mla_absorb(self, q_nope: Tensor, w_uk: Tensor) -> Tensor:
        """q_nope [B, H, dn], w_uk [H, dn, R] -> q_lat [B, H, R], one row at a time (batch-invariant)."""
        w = w_uk.float()
        return torch.stack([torch.bmm(q_nope[b][:, None, :], w)[:, 0] for b in range(q_nope.shape[0])])

    def mla_expand(self, o_lat: Tensor, w_uv: Tensor) -> Tensor:
        """o_lat [B, H, R], w_uv [H, dv, R] -> [B, H, dv], one row at a time."""
        w = w_uv.float()
        return torch.stack([torch.bmm(w, o_lat[b][:, :, None])[..., 0] for b in range(o_lat.shape[0])])

    def indexer_scores(
        self, q: Tensor, w: Tensor, k_cache: Tensor, length: Tensor | None = None, w_scale: float = 1.0
    ) -> Tensor:
        """q [Hi, Di], w [Hi], k_cache [n, Di] -> I [n] = sum_h (w[h] * w_scale) relu(q[h].k[s]); with a
        leading row dim B (length [B]), row by row."""
        if w_scale != 1.0:
            w = w * w_scale
        if q.dim() == 3:
            return torch.stack([
                self.indexer_scores(q[b], w[b], k_cache[b], None if length is None else length[b : b + 1])
                for b in range(q.shape[0])
            ])
        if length is not None:
            n = k_cache.shape[0]
            # [n]: rows stack
            return torch.cat((self.indexer_scores(q, w, k_cache[: int(length)]), q.new_zeros(n - int(length))))
        return (torch.relu(q @ k_cache.T) * w[:, None]).sum(0)

    def select_topk(self, scores: Tensor, k: int, length: Tensor | None = None) -> Tensor:
        if scores.dim() == 2 and length is not None:  # [rows, n], length [rows]: row by row, padded to min(k, n)
            kk = min(k, scores.shape[1])
            rows = [self.select_topk(scores[r], k, length[r : r + 1]) for r in range(scores.shape[0])]
            return torch.stack([torch.cat((t, t.new_zeros(kk - t.numel()))) for t in rows])
        if length is not None:
            n = int(length)
            if n <= k:
                return torch.arange(n, device=scores.device)
            scores = scores[..., :n]
        return select_topk(scores, k)

    def mla_prefill(
        self, q_nope: Tensor, q_rot: Tensor, w_uk: Tensor, w_uv: Tensor, c_cache: Tensor, kr_cache: Tensor,
        start: int, scale: float, index: tuple[Tensor, Tensor, Tensor, int] | None = None,
    ) -> Tensor:
        """Absorbed MLA over the cache for one sequence's chunk of T queries at positions
        start..start+T-1: q_nope [T, H, dn], q_rot [T, H, Dr]; w_uk [H, dn, R], w_uv [H, dv, R];
        c_cache [n, R], kr_cache [n, Dr] (n >= start + T, this chunk's keys already written).
        index: (qi [T, Hi, Di], wi [T, Hi], ki_cache [n, Di], topk) restricts query t to the
        Lightning Indexer's top-k of positions <= t, or None (causal dense). Returns [T, H, dv].

        Query tiles of `q_tile` rows, against key blocks of `key_block` positions from 0 up with
        an online softmax (running max, sum, accumulator over the R latent) under the indexer's
        mask: no buffer grows past q_tile x n. A query at t + 1 > SPARSE_FROM * topk instead
        gathers its topk selected positions (ascending) and runs one softmax over them,
        SPARSE_ROWS queries at a time, so its cost stays topk keys however long the context.
        Every product has a fixed shape and each query takes one of the two by its own
        position, so a row's bits are the same whatever T, start or its tile companions are.
        """
        T, H, _ = q_nope.shape
        R = c_cache.shape[-1]
        _, TQ, KB = self.tiles(q_nope.device)
        ar_q = torch.arange(TQ, device=q_nope.device)
        w_uk, w_uv_t = w_uk.float(), w_uv.float().transpose(1, 2)  # [H, dn, R], [H, R, dv]
        topk = index[3] if index is not None else None
        outs = []
        for t0 in range(0, T, TQ):
            m = min(TQ, T - t0)
            qpos = start + t0 + ar_q  # [TQ] (padded rows continue the positions; discarded)
            nb = (start + t0 + m - 1) // KB + 1  # key blocks up to the tile's last real query
            q_lat = torch.bmm(_pad_rows(q_nope[t0 : t0 + m].float(), TQ).transpose(0, 1), w_uk)  # [H, TQ, R]
            q_lat = q_lat.transpose(0, 1).reshape(TQ * H, R)
            q_r = _pad_rows(q_rot[t0 : t0 + m].float(), TQ).reshape(TQ * H, -1)  # [TQ*H, Dr]
            sel = None
            if index is not None:
                qi, wi, ki, _ = index
                sel = self._index_select(
                    _pad_rows(qi[t0 : t0 + m], TQ), _pad_rows(wi[t0 : t0 + m], TQ), ki, qpos, nb, topk
                )
            sparse = (qpos + 1 > SPARSE_FROM * topk) if topk is not None else torch.zeros_like(qpos, dtype=torch.bool)
            n_sparse = int(sparse[:m].sum())
            o_lat = None
            if n_sparse < m:
                o_lat = self._attend_blocks(q_lat, q_r, c_cache, kr_cache, qpos, nb, scale, sel).view(TQ, H, R)
            if n_sparse:
                o_sp = self._attend_selected(
                    q_lat.view(TQ, H, R), q_r.view(TQ, H, -1), c_cache, kr_cache, sel, topk, scale
                )
                o_lat = o_sp if o_lat is None else torch.where(sparse[:, None, None], o_sp, o_lat)
            o = torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)  # [TQ, H, dv]
            outs.append(o[:m])
        return torch.cat(outs)

    def _attend_blocks(self, q_lat: Tensor, q_r: Tensor, c_cache: Tensor, kr_cache: Tensor, qpos: Tensor, nb: int,
                       scale: float, sel: Tensor | None) -> Tensor:
        """Causal attention of a query tile (q_lat [TQ*H, R], q_r [TQ*H, Dr]) over key blocks 0..nb-1,
        ascending, online softmax, restricted to sel [TQ, nb*KB] if given -> [TQ*H, R]. A block a
        row cannot see leaves its bits as they are."""
        R = q_lat.shape[-1]
        TQ = qpos.shape[0]
        H = q_lat.shape[0] // TQ
        KB = self.tiles(q_lat.device)[2]
        ar_k = torch.arange(KB, device=q_lat.device)
        run_max = q_lat.new_full((TQ * H,), float("-inf"))
        run_sum = q_lat.new_zeros(TQ * H)
        acc = q_lat.new_zeros(TQ * H, R)
        for j in range(nb):  # ascending, whatever the chunking
            cb, krb = _key_block(c_cache, j * KB, KB).float(), _key_block(kr_cache, j * KB, KB).float()
            s = (q_lat @ cb.T + q_r @ krb.T) * scale  # [TQ*H, KB]
            allow = (j * KB + ar_k)[None, :] <= qpos[:, None]  # [TQ, KB] causal
            if sel is not None:
                allow = allow & sel[:, j * KB : (j + 1) * KB]
            s = s.view(TQ, H, KB).masked_fill(~allow[:, None], float("-inf")).view(TQ * H, KB)
            new_max = torch.maximum(run_max, s.amax(-1))
            safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            alpha = torch.exp(run_max - safe)  # 1 exactly when the block changed nothing
            p = torch.exp(s - safe[:, None])  # [TQ*H, KB], 0 where masked
            run_sum = run_sum * alpha + p.sum(-1)
            acc = acc * alpha[:, None] + p @ cb  # [TQ*H, R]
            run_max = new_max
        return acc / run_sum[:, None]

    @staticmethod
    def _attend_selected(q_lat: Tensor, q_r: Tensor, c_cache: Tensor, kr_cache: Tensor, sel: Tensor, topk: int,
                         scale: float) -> Tensor:
        """Each query of a tile (q_lat [TQ, H, R], q_r [TQ, H, Dr]) over its selected positions
        only (sel bool [TQ, >= n], at most topk per row), gathered in ascending order and padded
        to topk, SPARSE_ROWS rows per product -> [TQ, H, R]."""
        TQ = q_lat.shape[0]
        n = c_cache.shape[0]
        # selected positions first, ascending (the largest keys L - position), then padding
        L = sel.shape[-1]
        key = torch.where(sel, L - torch.arange(L, dtype=torch.int32, device=sel.device), 0)  # [TQ, L]
        order = key.topk(topk, dim=-1, sorted=True).indices  # [TQ, topk]
        valid = torch.arange(topk, device=sel.device)[None, :] < sel.sum(-1, keepdim=True)  # [TQ, topk]
        order = order.clamp(max=n - 1)  # padding entries read a real row, then are masked
        outs = []
        for r0 in range(0, TQ, SPARSE_ROWS):
            rows = slice(r0, r0 + SPARSE_ROWS)
            idx = _pad_rows(order[rows], SPARSE_ROWS)
            ok = _pad_rows(valid[rows], SPARSE_ROWS).clone()
            ok[:, 0] = True  # a padding row attends to one entry rather than to none (NaN); real rows have one
            cg, kg = c_cache[idx].float(), kr_cache[idx].float()  # [S, topk, R], [S, topk, Dr]
            s = (torch.bmm(_pad_rows(q_lat[rows], SPARSE_ROWS), cg.transpose(1, 2))
                 + torch.bmm(_pad_rows(q_r[rows], SPARSE_ROWS), kg.transpose(1, 2))) * scale  # [S, H, topk]
            p = torch.softmax(s.masked_fill(~ok[:, None, :], float("-inf")), dim=-1)
            outs.append(torch.bmm(p, cg)[: min(SPARSE_ROWS, TQ - r0)])  # [S, H, R]
        return torch.cat(outs)

    def _index_select(self, qi: Tensor, wi: Tensor, ki: Tensor, qpos: Tensor, nb: int, topk: int) -> Tensor:
        """The indexer's exact top-k for a query tile: qi [TQ, Hi, Di], wi [TQ, Hi], ki [n, Di],
        qpos [TQ] -> bool [TQ, nb * key_block]. Scores per fixed key block (as in mla_prefill);
        the tie rule of `select_topk`: above the threshold, then the boundary group lowest first."""
        TQ, Hi, Di = qi.shape
        KB = self.tiles(qi.device)[2]
        q2, w = qi.float().reshape(TQ * Hi, Di), wi.float()[:, :, None]
        scores = torch.cat([
            (torch.relu(q2 @ _key_block(ki, j * KB, KB).float().T).view(TQ, Hi, KB) * w).sum(1) for j in range(nb)
        ], dim=1)  # [TQ, nb*KB]
        causal = torch.arange(nb * KB, device=qi.device)[None, :] <= qpos[:, None]
        return topk_mask(scores.masked_fill(~causal, float("-inf")), qpos + 1, topk)

    # ---- MoE -----------------------------------------------------------------------

    def route(
        self,
        logits: Tensor,
        bias: Tensor,
        k: int,
        renormalize: bool,
        scale: float,
        n_group: int = 1,
        topk_group: int = 1,
    ) -> tuple[Tensor, Tensor]:
        """logits [T, E] -> (ids [T, k] by descending biased score, weights [T, k] fp32, unbiased)."""
        return route(sigmoid(logits.float()), bias, k, renormalize, scale, n_group, topk_group)

    def expert_ffn(
        self,
        z: Tensor,
        ids: Tensor,
        weights: Tensor,
        experts: RoutedExperts | Mapping[int, ExpertWeights],
        beta: float,
        linear_beta: float | None,
    ) -> Tensor:
        """z [T, Dl]; out[t] = sum_j (in order j = 0..k-1) weights[t, j] * E_ids[t,j](z_t) -> [T, Dl].

        Each expert used is dequantised once (one at a time: the bank never is). `experts`:
        RoutedExperts, or a plain {id: ExpertWeights}.
        """
        routed = as_routed(experts, ids)
        ids = routed.host_ids.to(z.device)
        T, k = ids.shape
        outs = z.new_zeros(T, k, z.shape[-1], dtype=torch.float32)  # [T, k, Dl]
        for e in routed.unique:
            rows, slots = (ids == e).nonzero(as_tuple=True)
            y = self.expert_rows(z[rows], routed.take(e), beta, linear_beta, routed.layer, e)  # [m, Dl]
            outs = outs.index_put((rows, slots), y)
        w = weights.float()
        acc = outs[:, 0] * w[:, 0:1]
        for j in range(1, k):
            acc = acc + outs[:, j] * w[:, j : j + 1]
        return acc

    def expert_rows(self, zr: Tensor, ew: ExpertWeights, beta: float, linear_beta: float | None, layer: int,
                    expert: int) -> Tensor:
        """One routed expert (`layer`, `expert`) on its rows zr [m, Dl] -> [m, Dl] fp32."""
        h = situ_glu(self.linear(zr, dequant_nvfp4(ew.gate)), self.linear(zr, dequant_nvfp4(ew.up)), beta, linear_beta)
        return self.linear(h, dequant_nvfp4(ew.down))

    # ---- AttnRes -------------------------------------------------------------------

    def cache_append(self, dsts: Sequence[Tensor], srcs: Sequence[Tensor], lengths: Tensor) -> None:
        for dst, src in zip(dsts, srcs):
            B, cap, W = dst.shape
            at = lengths.long() + torch.arange(B, device=dst.device) * cap  # [B] flat positions
            dst.view(B * cap, W).index_copy_(0, at, src.detach().reshape(B, W).to(dst.dtype))

    def attnres_mix(self, prefix: Tensor, blocks: Sequence[Tensor], norm_w: Tensor, proj_w: Tensor, eps: float,
                    out_w: Tensor | None = None, out_eps: float = 0.0) -> Tensor:
        """prefix [T, D], blocks nb x [T, D], norm_w, proj_w [D] -> softmax-weighted sum of raw sources [T, D]
        (then rmsnorm(., out_w, out_eps) with out_w)."""
        mix = self._attnres_mix(prefix, blocks, norm_w, proj_w, eps)
        return mix if out_w is None else self.rmsnorm(mix, out_w, out_eps)

    def _attnres_mix(
        self, prefix: Tensor, blocks: Sequence[Tensor], norm_w: Tensor, proj_w: Tensor, eps: float
    ) -> Tensor:
        v = torch.stack([*blocks, prefix], dim=1).float()  # [T, nb+1, D]
        wq = norm_w.float() * proj_w.float()  # [D]
        kn = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)  # weightless RMSNorm keys
        p = torch.softmax((kn * wq).sum(-1), dim=-1)  # [T, nb+1]
        return (p[..., None] * v).sum(1)  # [T, D]
