"""The ops the KimiLinear forward is written against.

`backends/torch_backend.py` is the reference (CPU and GPU); `backends/nvrtc.py` runs the
same signatures through NVRTC-compiled kernels. Axis legend: T tokens (rows), D hidden,
H heads, K/V head dims, R MLA latent rank, n cached positions, E experts, k top-k.
Activations are float32; weights are float32 or bfloat16. Every decode op is
batch-invariant: row t of the output depends only on row t of the inputs.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

from torch import Tensor

from streamrt.expert_weights import ExpertWeights, RoutedExperts


class Backend(Protocol):
    name: str
    captures_decode: bool  # a decode step's ops can be captured as CUDA graphs (runtime/graph_choice.py)
    prefill_rows_exact: bool  # a prefill row's bits do not depend on the other rows of its chunk (prefix_cache.py)

    def for_prefill(self) -> "Backend":
        """Optional: the backend a prefill chunk runs on (the torch one: fixed-tile GEMMs, so a
        row's bits do not depend on the chunk length). Without it the model uses the backend as is."""

    def linear(self, x: Tensor, w: Tensor, add: Sequence[Tensor] = ()) -> Tensor:
        """x [T, in] fp32, w [out, in] -> [T, out] fp32 (fp32 accumulation), then each of `add`
        (up to two [T, out] tensors, a residual) added in order, each sum rounded.
        Up to `rowwise_max` rows the result is row-wise (batch-invariant); beyond, a GEMM."""

    def linears(self, x: Tensor, ws: Sequence[Tensor]) -> list[Tensor]:
        """[linear(x, w) for w in ws], the same bits (one launch where the backend can)."""

    def rmsnorm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        """KimiRMSNorm: w * (x * rsqrt(mean(x^2) + eps)); x [T, D], w [D]."""

    def gated_rmsnorm(self, o: Tensor, gate: Tensor, w: Tensor, eps: float) -> Tensor:
        """KDA output norm: rmsnorm(o) * w * sigmoid(gate) per head; o, gate [T, H, V], w [V]."""

    def layernorm(self, x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
        """LayerNorm with weight and bias over the last dim."""

    def l2norm(self, x: Tensor, eps: float, scale: float = 1.0) -> Tensor:
        """(x / sqrt(sum(x^2) + eps)) * scale over the last dim (the product rounded once more)."""

    def sigmoid_mul(self, x: Tensor, gate: Tensor) -> Tensor:
        """x * sigmoid(gate) elementwise (ops.sigmoid), fp32; x and gate of one shape."""

    def kda_gates(
        self, f: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor, lower_bound: float
    ) -> tuple[Tensor, Tensor]:
        """KDA's decay and write gates: f [N, H, K], b [N, H], a_log [H], dt_bias [H*K] ->
        (ops.kda_gate(f, a_log, dt_bias, lower_bound) [N, H, K], sigmoid(b) [N, H]), fp32."""

    def situ_glu(self, gate: Tensor, up: Tensor, beta: float, linear_beta: float | None) -> Tensor:
        """beta*tanh(gate/beta)*sigmoid(gate) * (linear_beta*tanh(up/linear_beta) or up)."""

    def short_conv_step(self, z: Tensor, conv_state: Tensor, w: Tensor) -> Tensor:
        """Depthwise causal conv, one token: roll conv_state [T, P, W] left, write z [T, P]
        into the last slot (in place), return SiLU(sum(state * w)) [T, P]; w [P, W]."""

    def kda_conv_step(self, zs: Sequence[Tensor], states: Sequence[Tensor], ws: Sequence[Tensor], K: int, eps: float,
                      q_scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """KDA's decode conv of (q, k, v): short_conv_step of each z [T, H*K] on its state, then
        (l2norm(q, eps, q_scale), l2norm(k, eps), v), each [T, H, K] (norms per head)."""

    def kda_step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
        """One recurrent KDA step, in place on state [T, H, K, V] fp32.
        q, k (already L2-normalised, q scaled), g (log-decay) [T, H, K]; v [T, H, V]; beta [T, H].
        S <- diag(exp(g)) S; S <- S + beta k (v - S^T k)^T; returns o = S^T q [T, H, V]."""

    def mla_decode(
        self, q_lat: Tensor, q_rot: Tensor, c_cache: Tensor, kr_cache: Tensor, scale: float, select: Tensor | None,
        length: Tensor | None = None,
    ) -> Tensor:
        """Absorbed MLA attention for query rows b < B, each over its own cache: q_lat [B, H, R],
        q_rot [B, H, Dr], c_cache [B, n, R], kr_cache [B, n, Dr], select LongTensor [B, m] of
        positions or None (all); one row may drop the leading B everywhere.
        softmax over positions of (q_lat.c + q_rot.kr) * scale; returns sum p c  [B, H, R].
        The model passes select in select_topk's emitted order, and None while n <= index_topk.
        length: int32 [B] on the cache's device (the decode path; a CUDA graph cannot take a
        host length): row b's first length[b] positions are valid, c_cache / kr_cache may be
        longer (their capacity), and only select[b, :length[b]] is read."""

    def mla_absorb(self, q_nope: Tensor, w_uk: Tensor) -> Tensor:
        """q_lat[b, h] = q_nope[b, h] @ w_uk[h]: q_nope [B, H, dn], w_uk [H, dn, R] (a view of
        kv_b_proj: heads may be strided) -> [B, H, R] fp32."""

    def mla_expand(self, o_lat: Tensor, w_uv: Tensor) -> Tensor:
        """o[b, h] = w_uv[h] @ o_lat[b, h]: o_lat [B, H, R], w_uv [H, dv, R] (a view of kv_b_proj)
        -> [B, H, dv] fp32."""

    def mla_prefill(
        self, q_nope: Tensor, q_rot: Tensor, w_uk: Tensor, w_uv: Tensor, c_cache: Tensor, kr_cache: Tensor,
        start: int, scale: float, index: tuple[Tensor, Tensor, Tensor, int] | None = None,
    ) -> Tensor:
        """Absorbed MLA for one sequence's prefill chunk over its cache: q_nope [T, H, dn],
        q_rot [T, H, Dr] at positions start..start+T-1; w_uk [H, dn, R], w_uv [H, dv, R];
        c_cache [n, R], kr_cache [n, Dr] (the chunk's own keys written). index = (qi [T, Hi, Di],
        wi [T, Hi], ki_cache [n, Di], topk): query t sees only the indexer's exact top-k of
        positions <= t (all of them while t + 1 <= topk), else causal dense. Returns [T, H, dv].
        Memory O(tile x n), never T x n per head; a row's bits must not depend on T or start."""

    def indexer_scores(
        self, q: Tensor, w: Tensor, k_cache: Tensor, length: Tensor | None = None, w_scale: float = 1.0
    ) -> Tensor:
        """Lightning Indexer scores of query rows b < B: q [B, Hi, Di], w [B, Hi], k_cache [B, n, Di]
        -> [B, n] fp32, I[b, s] = sum_h (w[b, h] * w_scale) * relu(q[b, h] . k[b, s]), the product
        w * w_scale rounded to fp32 first (as `w * w_scale` in torch); one row may drop the
        leading B. length (as mla_decode's): only s < length[b] are scored (the rest of the
        row is not defined)."""

    def select_topk(self, scores: Tensor, k: int, length: Tensor | None = None) -> Tensor:
        """Exact top-k positions with the tie rule (K31_INDEXER.md): strictly-above-threshold
        positions ascending, then the boundary group from the lowest position up. scores [n] or
        [rows, n] -> [min(k, n)] or [rows, min(k, n)]. length int32 [rows] (as mla_decode's): row
        r is the top-k of scores[r, :length[r]] in its first min(k, length[r]) entries; if
        length[r] <= k, every position ascending (0, 1, ...: the unselected attention's order)."""

    def route(
        self, logits: Tensor, bias: Tensor, k: int, renormalize: bool, scale: float,
        n_group: int = 1, topk_group: int = 1,
    ) -> tuple[Tensor, Tensor]:
        """fp32 sigmoid router on its logits [T, E] (x . w_gate, one of the layer's `linears`),
        bias [E] (selection only) -> (ids LongTensor [T, k] by descending biased score, weights
        fp32 [T, k] from the unbiased sigmoid, renormalised (+1e-20) then * scale).
        n_group / topk_group: the group-limited top-k (a no-op at 1 / 1, K3); the model passes
        them only when n_group > 1."""

    def expert_ffn(
        self,
        z: Tensor,
        ids: Tensor,
        weights: Tensor,
        experts: RoutedExperts | Mapping[int, ExpertWeights],
        beta: float,
        linear_beta: float | None,
    ) -> Tensor:
        """Routed NVFP4 experts: z [T, Dl] fp32; for each row t, sum over j in order of
        weights[t, j] * down(situ_glu(gate z_t, up z_t)) in fp32 -> [T, Dl]. `experts`: the
        model's RoutedExperts (expert_weights.py), or a plain {id: ExpertWeights} for `ids`."""

    def cache_append(self, dsts: Sequence[Tensor], srcs: Sequence[Tensor], lengths: Tensor) -> None:
        """In place, for each pair (up to 4): dst [B, cap, W] fp32, src [B, W] ->
        dst[b, lengths[b]] = src[b]; lengths int32 [B] on the device (the decode's one new position per row)."""

    def attnres_mix(self, prefix: Tensor, blocks: Sequence[Tensor], norm_w: Tensor, proj_w: Tensor, eps: float,
                    out_w: Tensor | None = None, out_eps: float = 0.0) -> Tensor:
        """AttnRes: sources V = (blocks..., prefix), each [T, D]; wq = norm_w * proj_w [D] (fp32);
        p = softmax over sources of (V * rsqrt(mean(V^2) + eps)) . wq; returns sum p V [T, D] (fp32),
        or with out_w rmsnorm(sum p V, out_w, out_eps) (the norm that follows it in a layer)."""
