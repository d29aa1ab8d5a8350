"""The nvrtc Backend: the decode path as NVRTC-compiled CUDA kernels, launched with cuda-python.

Kernels live in the top-level `kernels/*.cu` (raw pointers, no torch; `cuda_compile.kernel_dir`
finds them in a checkout or an installed wheel); `cuda_compile.py` turns them into cubins for
the device's arch (cached on disk); `cuda_driver.py` loads them into torch's primary context and
launches them on torch's current stream with `t.data_ptr()` pointers, so they order with torch's
own work and the caching allocator. Launch geometry shared with the kernels: `kernel_defines.py`.

Each wrapper validates dtype / device / shape / alignment (`nvrtc_args.py`), allocates its
output, launches and returns. Strided activations are made contiguous (a copy); a strided tensor
updated in place (`conv_state`, `state`) is updated through a contiguous copy that is written
back. Signatures and math: `backends/base.py` (the torch backend is the reference the GPU tests
hold these kernels to).

The backend is its op groups over one `KernelHost` (`kernel_host.py`: device properties, kernel
lookup, allocation): the dense linears (`nvrtc_linear.py`), MLA, the indexer and top-k
(`nvrtc_attention.py`), the router and expert FFN (`nvrtc_moe.py`), and here the norms, the KDA
steps and AttnRes. The prefill view (`for_prefill`) runs the routed experts as grouped GEMMs
(`nvfp4_gemm.py`) once a chunk gives each expert enough rows, else the decode kernels.
"""

from __future__ import annotations

import copy
import math
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from streamrt.backends.cuda_driver import SMEM_DEFAULT, CudaError
from streamrt.backends.kernel_defines import ATTNRES_MAXS, ATTNRES_SLICE, KDA_MAXK, KDA_WARPS, MOE_MAXP
from streamrt.backends.kernel_host import DeviceProps
from streamrt.backends.nvrtc_args import (
    as_act,
    as_rows,
    as_weight,
    block_threads,
    f32,
    i32,
    i64,
    inplace_buf,
    ptr,
    situ_args,
)
from streamrt.backends.nvrtc_attention import AttentionOps
from streamrt.backends.nvrtc_linear import LinearOps
from streamrt.backends.nvrtc_moe import MoeOps

# what tests and benchmarks import from here (defined in the modules above)
__all__ = ["NvrtcBackend", "CudaError", "DeviceProps", "MOE_MAXP"]


class NvrtcBackend(LinearOps, AttentionOps, MoeOps):
    """Backend ops on NVRTC kernels (CUDA tensors only). `rowwise_max`: the most rows a linear
    runs on the GEMV kernels (batch-invariant); more run one GEMM (`nvrtc_linear.py`)."""

    name = "nvrtc"
    captures_decode = True  # decode steps replay as CUDA graphs (runtime/graph_choice.py)
    prefill_rows_exact = False  # cuBLAS picks a prefill GEMM by its row count: resume on chunk boundaries only

    def __init__(self, device: torch.device | str | int | None = None, rowwise_max: int = 64):
        if not torch.cuda.is_available():
            raise RuntimeError("NvrtcBackend needs a CUDA device")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type != "cuda":
            raise ValueError(f"NvrtcBackend runs on CUDA devices, not {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        p = torch.cuda.get_device_properties(index)
        self._configure(DeviceProps(torch.device("cuda", index), (p.major, p.minor),
                                    getattr(p, "shared_memory_per_block_optin", SMEM_DEFAULT), p.multi_processor_count),
                        rowwise_max)

    def _configure(self, props: DeviceProps, rowwise_max: int = 64) -> None:
        """Every setting of the backend from the device's properties; no CUDA call (the host
        side alone runs on a CPU device given a GPU's properties)."""
        self._init_host(props)
        self._init_linear(rowwise_max)
        self._init_attention()
        self._init_moe()

    def for_prefill(self) -> "NvrtcBackend":
        """This backend for a prefill chunk: the routed experts as grouped GEMMs (one per expert
        and matrix, weights read once per chunk) instead of per-pair GEMVs. Decode stays on the
        per-pair kernels (batch-invariant)."""
        view = copy.copy(self)
        view.grouped_prefill = True
        return view

    # ---- norms and elementwise -----------------------------------------------------------------

    def _rows(self, name: str, x: Tensor, D: int) -> int:
        if x.shape[-1] != D:
            raise ValueError(f"{name}: last dim {x.shape[-1]} != {D}")
        return x.numel() // D if D else 0

    def rmsnorm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        """x [..., D], w [D] -> w * (x * rsqrt(mean(x^2) + eps)) [..., D] fp32. A 2-D x is read
        with its row stride (kv_a's latent columns: no copy)."""
        x = as_rows(x, "rmsnorm.x", self.device) if x.dim() == 2 else as_act(x, "rmsnorm.x", self.device)
        w, wb = as_weight(w, "rmsnorm.w", self.device)
        D = w.numel()
        rows = self._rows("rmsnorm", x, D)
        out = self._empty(*x.shape)
        if rows:
            x_rs = x.stride(0) if x.dim() == 2 else D
            self._k("norms", "srt_rmsnorm")(
                (rows,),
                (block_threads(D, 512),),
                [ptr(x), i64(x_rs), ptr(w), i32(wb), ptr(out), i32(D), f32(eps)],
                pdl=self.pdl,
            )
        return out

    def gated_rmsnorm(self, o: Tensor, gate: Tensor, w: Tensor, eps: float) -> Tensor:
        """o, gate [..., V], w [V] -> rmsnorm(o) * w * sigmoid(gate) per row of V."""
        o = as_act(o, "gated_rmsnorm.o", self.device)
        gate = as_act(gate, "gated_rmsnorm.gate", self.device)
        if gate.shape != o.shape:
            raise ValueError(f"gated_rmsnorm: gate {tuple(gate.shape)} != o {tuple(o.shape)}")
        w, wb = as_weight(w, "gated_rmsnorm.w", self.device)
        V = w.numel()
        rows = self._rows("gated_rmsnorm", o, V)
        out = self._empty(*o.shape)
        if rows:
            self._k("norms", "srt_gated_rmsnorm")(
                (rows,),
                (block_threads(V, 256),),
                [ptr(o), ptr(gate), ptr(w), i32(wb), ptr(out), i32(V), f32(eps)],
                pdl=self.pdl,
            )
        return out

    def layernorm(self, x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
        """x [..., D], w [D], b [D] -> (x - mean) * rsqrt(var + eps) * w + b."""
        x = as_act(x, "layernorm.x", self.device)
        w, wb = as_weight(w, "layernorm.w", self.device)
        b, bb = as_weight(b, "layernorm.b", self.device)
        if wb != bb:
            w, b, wb = w.float(), b.float(), 0
        D = w.numel()
        if b.numel() != D:
            raise ValueError(f"layernorm: w has {D} elements, b {b.numel()}")
        rows = self._rows("layernorm", x, D)
        out = self._empty(*x.shape)
        if rows:
            self._k("norms", "srt_layernorm")(
                (rows,),
                (block_threads(D, 512),),
                [ptr(x), ptr(w), ptr(b), i32(wb), ptr(out), i32(D), f32(eps)],
                pdl=self.pdl,
            )
        return out

    def l2norm(self, x: Tensor, eps: float, scale: float = 1.0) -> Tensor:
        """x [..., D] -> (x * rsqrt(sum(x^2) + eps)) * scale over the last dim."""
        x = as_act(x, "l2norm.x", self.device)
        D = x.shape[-1]
        rows = x.numel() // D if D else 0
        out = self._empty(*x.shape)
        if rows:
            self._k("norms", "srt_l2norm")(
                (rows,), (block_threads(D, 512),), [ptr(x), ptr(out), i32(D), f32(eps), f32(scale)], pdl=self.pdl
            )
        return out

    def sigmoid_mul(self, x: Tensor, gate: Tensor) -> Tensor:
        """x, gate [...] -> x * sigmoid(gate)."""
        return self._elementwise2("srt_sigmoid_mul", ("sigmoid_mul.x", x), ("sigmoid_mul.gate", gate))

    def situ_glu(self, gate: Tensor, up: Tensor, beta: float, linear_beta: float | None) -> Tensor:
        """gate, up [...] -> beta*tanh(gate/beta)*sigmoid(gate) * (linear_beta*tanh(up/linear_beta) or up)."""
        return self._elementwise2(
            "srt_situ_glu", ("situ_glu.gate", gate), ("situ_glu.up", up), situ_args(beta, linear_beta)
        )

    def _elementwise2(self, kernel: str, a: tuple[str, Tensor], b: tuple[str, Tensor], extra: list = ()) -> Tensor:
        """A grid-stride kernel of two (name, tensor) inputs of one shape: kernel(a, b, out, n, *extra)."""
        (an, a), (bn, b) = a, b
        a, b = as_act(a, an, self.device), as_act(b, bn, self.device)
        if a.shape != b.shape:
            raise ValueError(f"{an.split('.')[0]}: {an} {tuple(a.shape)} and {bn} {tuple(b.shape)} differ in shape")
        out = self._empty(*a.shape)
        n = a.numel()
        if n:
            self._k("norms", kernel)(
                (min(math.ceil(n / 256), 8192),), (256,), [ptr(a), ptr(b), ptr(out), i64(n), *extra], pdl=self.pdl
            )
        return out

    # ---- KDA -----------------------------------------------------------------------------------

    def short_conv_step(self, z: Tensor, conv_state: Tensor, w: Tensor) -> Tensor:
        """z [T, P]; conv_state [T, P, W] rolled left + z written last (in place); w [P, W] (or
        [P, 1, W]) -> SiLU(sum_j state * w) [T, P]."""
        z = as_act(z, "short_conv_step.z", self.device)
        T, P = z.shape
        W = conv_state.shape[-1]
        buf = inplace_buf(conv_state, "short_conv_step.conv_state", self.device, (T, P, W))
        w, wb = as_weight(w.reshape(P, W), "short_conv_step.w", self.device)
        out = self._empty(*z.shape)
        if T * P:
            self._k("norms", "srt_short_conv_step")(
                (math.ceil(T * P / 256),),
                (256,),
                [ptr(z), ptr(buf), ptr(w), i32(wb), ptr(out), i32(T), i32(P), i32(W)],
                pdl=self.pdl,
            )
            if buf is not conv_state:
                conv_state.copy_(buf)
        return out

    def kda_conv_step(self, zs: Sequence[Tensor], states: Sequence[Tensor], ws: Sequence[Tensor], K: int, eps: float,
                      q_scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """zs 3 x [T, H*K], states 3 x [T, H*K, W] (in place), ws 3 x [H*K, W] -> q, k (L2-normed per
        head, q * q_scale), v [T, H, K]: one launch."""
        dev = self.device
        if not len(zs) == len(states) == len(ws) == 3:
            raise ValueError("kda_conv_step: takes q, k and v (three of each)")
        zs = [as_act(z, f"kda_conv_step.z[{i}]", dev) for i, z in enumerate(zs)]
        T, P = zs[0].shape
        if P % K or any(z.shape != (T, P) for z in zs):
            raise ValueError(f"kda_conv_step: z {[tuple(z.shape) for z in zs]} must be 3 x [T, H*{K}]")
        W = states[0].shape[-1]
        bufs = [inplace_buf(st, f"kda_conv_step.state[{i}]", dev, (T, P, W)) for i, st in enumerate(states)]
        wts = [as_weight(w.reshape(P, W), f"kda_conv_step.w[{i}]", dev) for i, w in enumerate(ws)]
        outs = [self._empty(T, P // K, K) for _ in range(3)]
        table = np.zeros(14, dtype=np.uint64)  # KdaConvTab: z, state, w, out [3] u64, w_bf16 [3] int32 (padded)
        flags = table[12:].view(np.int32)
        for i in range(3):
            table[i], table[3 + i], table[6 + i], table[9 + i] = (
                zs[i].data_ptr(),
                bufs[i].data_ptr(),
                wts[i][0].data_ptr(),
                outs[i].data_ptr(),
            )
            flags[i] = wts[i][1]
        if T * P:
            self._k("norms", "srt_kda_conv_step")(
                (T * (P // K), 3),
                (block_threads(K, 512),),
                [table.tobytes(), i32(P // K), i32(K), i32(W), f32(eps), f32(q_scale)],
                pdl=self.pdl,
            )
            for buf, st in zip(bufs, states):
                if buf is not st:
                    st.copy_(buf)
        return outs[0], outs[1], outs[2]

    def kda_gates(
        self, f: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor, lower_bound: float
    ) -> tuple[Tensor, Tensor]:
        """f [N, H, K], b [N, H], a_log [H], dt_bias [H*K] -> (g [N, H, K], beta [N, H]), one launch."""
        dev = self.device
        f, b = as_act(f, "kda_gates.f", dev), as_act(b, "kda_gates.b", dev)
        N, H, K = f.shape
        if b.shape != (N, H):
            raise ValueError(f"kda_gates: b {tuple(b.shape)} does not match f {tuple(f.shape)} (want [N, H])")
        a_log, ab = as_weight(a_log.reshape(-1), "kda_gates.a_log", dev)
        dt_bias, db = as_weight(dt_bias.reshape(-1), "kda_gates.dt_bias", dev)
        if a_log.numel() != H or dt_bias.numel() != H * K:
            raise ValueError(
                f"kda_gates: a_log has {a_log.numel()} entries (want H={H}), "
                f"dt_bias {dt_bias.numel()} (want H*K={H * K})"
            )
        g, beta = self._empty(N, H, K), self._empty(N, H)
        if N * H * K:
            self._k("norms", "srt_kda_gates")(
                (math.ceil(N * H * K / 256),),
                (256,),
                [
                    ptr(f),
                    ptr(b),
                    ptr(a_log),
                    i32(ab),
                    ptr(dt_bias),
                    i32(db),
                    ptr(g),
                    ptr(beta),
                    i32(N),
                    i32(H),
                    i32(K),
                    f32(lower_bound),
                ],
                pdl=self.pdl,
            )
        return g, beta

    def kda_step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
        """q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; state [T, H, K, V] fp32 (in place) -> o [T, H, V]."""
        dev = self.device
        q, k, g = (as_act(t, f"kda_step.{n}", dev) for t, n in ((q, "q"), (k, "k"), (g, "g")))
        v, beta = as_act(v, "kda_step.v", dev), as_act(beta, "kda_step.beta", dev)
        T, H, K = q.shape
        V = v.shape[-1]
        if k.shape != q.shape or g.shape != q.shape or v.shape != (T, H, V) or beta.shape != (T, H):
            raise ValueError(
                f"kda_step: shapes q {tuple(q.shape)} k {tuple(k.shape)} g {tuple(g.shape)} v {tuple(v.shape)} "
                f"beta {tuple(beta.shape)} do not agree"
            )
        if K > KDA_MAXK:
            raise ValueError(f"kda_step: head dim K={K} > {KDA_MAXK} (the kernel keeps a state column in registers)")
        buf = inplace_buf(state, "kda_step.state", dev, (T, H, K, V))
        out = self._empty(T, H, V, dtype=torch.float32)
        if T * H * V:
            self._k("kda", "srt_kda_step")(
                (math.ceil(V / 32), H, T), (32 * KDA_WARPS,),
                [ptr(q), ptr(k), ptr(v), ptr(g), ptr(beta), ptr(buf), ptr(out), i32(H), i32(K), i32(V)], pdl=self.pdl
            )
            if buf is not state:
                state.copy_(buf)
        return out


    # ---- AttnRes -------------------------------------------------------------------------------

    def cache_append(self, dsts: Sequence[Tensor], srcs: Sequence[Tensor], lengths: Tensor) -> None:
        """dst [B, cap, W] fp32 (in place, contiguous), src [B, W], lengths int32 [B]: one launch."""
        dev = self.device
        if not 1 <= len(dsts) == len(srcs) <= 4:
            raise ValueError(f"cache_append: {len(dsts)} caches, {len(srcs)} rows (1..4 pairs)")
        B, cap = dsts[0].shape[:2]
        if lengths is None:
            raise ValueError("cache_append: lengths (int32 [B] on the device) is required")
        lengths = self._lengths(lengths, B, "cache_append")
        # rows read in place where they are fp32 with unit column stride (kr is a slice of kv)
        srcs = [v if v.dtype == torch.float32 and v.dim() == 2 and v.stride(1) == 1 and v.device == dev
                else as_act(v, "cache_append.src", dev) for v in srcs]
        table = np.zeros(12, dtype=np.uint64)  # CacheAppend: dst[4], src[4] u64, width[4], stride[4] int32
        width, stride = table[8:10].view(np.int32), table[10:].view(np.int32)
        for i, (d, v) in enumerate(zip(dsts, srcs)):
            if d.device != dev or d.dtype != torch.float32 or not d.is_contiguous() or d.shape[:2] != (B, cap) \
                    or v.shape != (B, d.shape[2]):
                raise ValueError(
                    f"cache_append: cache {i} {d.dtype} {tuple(d.shape)} (contiguous fp32 [B, cap, W] on {dev}) "
                    f"and row {tuple(v.shape)} do not fit"
                )
            table[i], table[4 + i], width[i], stride[i] = d.data_ptr(), v.data_ptr(), d.shape[2], v.stride(0)
        if B:
            self._k("norms", "srt_cache_append")(
                (B, len(dsts)), (256,), [table.tobytes(), ptr(lengths), i32(cap)], pdl=self.pdl
            )

    def attnres_mix(self, prefix: Tensor, blocks: Sequence[Tensor], norm_w: Tensor, proj_w: Tensor, eps: float,
                    out_w: Tensor | None = None, out_eps: float = 0.0) -> Tensor:
        """prefix [T, D], blocks nb x [T, D], norm_w, proj_w [D] -> sum_s softmax_s(rmsnorm(V_s) . wq) V_s
        [T, D] with sources V = (blocks..., prefix) read in place (a pointer table) and wq =
        norm_w * proj_w formed in the kernel; with out_w, then rmsnorm(., out_w, out_eps). Two
        kernels over ATTNRES_SLICE-wide slices of each row (kernels/norms.cu)."""
        dev = self.device
        srcs = [as_act(v, f"attnres_mix.{'prefix' if i == len(blocks) else f'blocks[{i}]'}", dev)
                for i, v in enumerate((*blocks, prefix))]
        T, D = srcs[-1].shape
        for i, v in enumerate(srcs[:-1]):
            if v.shape != (T, D):
                raise ValueError(f"attnres_mix: blocks[{i}] {tuple(v.shape)} vs prefix {(T, D)}")
        if len(srcs) > ATTNRES_MAXS:
            raise ValueError(f"attnres_mix: {len(srcs)} sources > {ATTNRES_MAXS}")
        norm_w, nb = as_weight(norm_w.reshape(-1), "attnres_mix.norm_w", dev)
        proj_w, pb = as_weight(proj_w.reshape(-1), "attnres_mix.proj_w", dev)
        if norm_w.numel() != D or proj_w.numel() != D:
            raise ValueError(f"attnres_mix: norm_w has {norm_w.numel()} entries, proj_w {proj_w.numel()}, want D={D}")
        ow = None if out_w is None else as_weight(out_w.reshape(-1), "attnres_mix.out_w", dev)[0]
        if ow is not None and ow.numel() != D:
            raise ValueError(f"attnres_mix: out_w has {ow.numel()} entries, want D={D}")
        table = b"".join([ptr(v) for v in srcs]).ljust(8 * ATTNRES_MAXS, b"\0")  # the sources' addresses, by value
        S, slices = len(srcs), math.ceil(D / ATTNRES_SLICE)
        out = self._empty(T, D, dtype=torch.float32)
        if T and D:
            stats = self._empty(T * S * slices * 2, dtype=torch.float32)
            grid = (T * slices,), (ATTNRES_SLICE,)
            self._k("norms", "srt_attnres_stats")(
                *grid, [table, i32(S), ptr(norm_w), i32(nb), ptr(proj_w), i32(pb), ptr(stats), i32(D)], pdl=self.pdl)
            self._k("norms", "srt_attnres_apply")(
                *grid, [table, i32(S), ptr(stats), ptr(out), i32(D), f32(eps)], pdl=self.pdl)
        return out if ow is None else self.rmsnorm(out, ow, out_eps)
