"""The nvrtc Backend: the decode path as NVRTC-compiled CUDA kernels, launched with cuda-python.

Kernels live in `streamrt/kernels/*.cu` (raw pointers, no torch); `cuda_compile.py` turns
them into cubins for the device's arch (cached on disk); this module loads the cubins with the
driver API into torch's primary context (cuDevicePrimaryCtxRetain + cuCtxSetCurrent) and
launches them on torch's current stream with `t.data_ptr()` pointers, so they order with
torch's own work and the caching allocator.

Each wrapper validates dtype / device / shape / alignment, allocates its output, launches and
returns. Strided activations are made contiguous (a copy); a strided tensor updated in place
(`conv_state`, `state`) is updated through a contiguous copy that is written back. Signatures and math: `backends/base.py`
(the torch backend is the reference the GPU tests hold these kernels to).

Prefill: `linear` with more than `rowwise_max` rows runs one cuBLAS GEMM through torch (fp32
math); up to `rowwise_max` rows it runs the GEMV kernel 8 rows at a time, so a row's result is
bit-identical alone or in a batch. `expert_ffn` at large T launches the decode kernels over
chunks of 64 (row, expert) pairs: correct, not tuned for prefill.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import weakref
from typing import Mapping

import numpy as np
import torch
from torch import Tensor

from streamrt.backends.cuda_compile import compile_cubin
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix

MOE_MAXP = 64  # SRT_MOE_MAXP in nvfp4_moe.cu: (row, expert) pairs per launch
KDA_MAXK = 128  # SRT_KDA_MAXK in kda.cu
ATTNRES_MAXS = 64  # SRT_ATTNRES_MAXS in norms.cu
MLA_CHUNK, MLA_HG = 64, 8
GEMV_WARPS = 4  # gemv.cu: warps per block of the CUDA-core kernels
# GEMV variants per (weight dtype, T bucket), best first; every variant of one family gives the
# same bits for a row. bf16 weights: "tc<S>", the tensor-core kernel with an S-stage cp.async
# ring per warp (sm_80+), then "r<R>", the CUDA-core kernel with R rows per warp (the fallback
# before sm_80; at T=1 the one whose grid wastes least of its last wave). H200, bench_kernels.py
# --variants, 7168x12288: tc2 0.90 / 0.89 / 0.83 of the copy rate at T=1 / 4 / 8, tc3 0.88 /
# 0.73 / 0.75 (its rings allow one block per SM where two are needed for one wave), r2 / r4
# 0.87 / 0.56 / 0.44 (x read through L1 per weight vector and token). Two stages always fit;
# more are cut where they would not. Override: STREAMRT_GEMV="bf16:1=tc3,f32:8=r2".
GEMV_TC_FAMILY = ("tc2", "tc3", "tc4")
GEMV_VARIANTS = {("bf16", 1): GEMV_TC_FAMILY + ("r2", "r1", "r4"), ("bf16", 2): GEMV_TC_FAMILY + ("r2", "r4"),
                 ("bf16", 4): GEMV_TC_FAMILY + ("r2", "r4"), ("bf16", 8): GEMV_TC_FAMILY + ("r4", "r2"),
                 ("f32", 1): ("r2",), ("f32", 2): ("r2",), ("f32", 4): ("r2",), ("f32", 8): ("r2",)}
GEMV_TC_ROWS = 32  # rows of W per block of the tensor-core kernel (gemv.cu GTC_ROWS)
MOE_WARPS = 8  # CUDA-core NVFP4 kernels
# Tensor-core NVFP4 kernels (nvfp4_moe.cu): warps per block (gate+up, down), cp.async stages per
# warp, 128-column blocks per stage; entry points exist for TC_PIPES. bench_kernels.py
# --variants, H200, slice layer (16 experts, T=1): (8, 7, 2, 2) 0.73-0.76 of the copy rate in
# sessions 4-5, (8, 8, 2, 2) the same or 0.01 lower, (6, 7, 3, 2) 0.71-0.73, (8, 8, 4, 1) 0.55-0.57;
# same bits. Seven down warps make 16 x 16 = 256 blocks, which fit the 264 two-per-SM slots in one
# wave (eight warps: 224 blocks, 92 SMs holding two and 40 holding one). Session 6, with the down
# blocks starting on their pair's count: (8, 7, 2, 2) 0.81, (8, 8, 2, 2) 0.81, (8, 4, 2, 2) 0.80,
# (6, 7, 3, 2) 0.77, (8, 7, 3, 2) 0.69; one block per SM (fewer warps in flight) 0.71-0.73.
TC_SHAPE = (8, 7, 2, 2)
TC_PIPES = ((2, 2), (3, 2), (4, 1))
TC_STAGE_SMEM = 32 * 64 + 32 * 8  # TC_WBYTES + TC_SBYTES: one 128-column block of one warp


def tc_smem(in_features: int, warps: int, stages: int, blocks: int) -> int:
    """Dynamic shared memory of a tensor-core NVFP4 block: the staged activation (fp16 hi + lo,
    padded: 5 bytes per input) and each warp's cp.async ring."""
    return in_features * 5 + warps * stages * blocks * TC_STAGE_SMEM


# "tc": tensor cores where the shape allows (in % 128 == 0), else CUDA cores; "cuda_core": always
NVFP4_IMPLS = ("tc", "cuda_core")
SMEM_DEFAULT = 48 * 1024


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the CUDA error."""


# ---- driver plumbing ---------------------------------------------------------------------------


@functools.cache
def _cu():
    """cuda.bindings.driver, imported once (an import statement per launch shows in profiles)."""
    from cuda.bindings import driver

    return driver


def _ck(res, what: str):
    cu = _cu()
    err = res[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        try:
            e2, name = cu.cuGetErrorName(err)
            name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:
            name = str(err)
        raise CudaError(f"{what} failed: {name} ({int(err)})")
    if len(res) == 1:
        return None
    return res[1] if len(res) == 2 else res[1:]


def _handle(obj) -> int:
    try:
        from cuda.bindings.utils import get_cuda_native_handle

        return int(get_cuda_native_handle(obj))
    except Exception:
        return int(obj)


@functools.cache
def _primary_context(device_index: int):
    cu = _cu()
    _ck(cu.cuInit(0), "cuInit")
    dev = _ck(cu.cuDeviceGet(device_index), "cuDeviceGet")
    return _ck(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")


_CURRENT = threading.local()  # the device whose primary context this thread made current


def _make_current(device_index: int) -> None:
    """Make torch's primary context current on this thread (checked once per thread: torch and
    we both use the primary context, so nothing switches it behind our back)."""
    if getattr(_CURRENT, "device", None) == device_index:
        return
    cu = _cu()
    ctx = _primary_context(device_index)
    cur = _ck(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if cur is None or _handle(cur) != _handle(ctx):
        _ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    _CURRENT.device = device_index


def _current_stream(device_index: int) -> int:
    """torch's current stream handle without building a torch.cuda.Stream object per launch."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return int(raw(device_index)) if raw is not None else torch.cuda.current_stream(device_index).cuda_stream


def device_arch(device_index: int) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


_LOCK = threading.Lock()


@functools.cache
def _module(program: str, device_index: int):
    _make_current(device_index)
    cubin = compile_cubin(program, device_arch(device_index))
    return _ck(_cu().cuModuleLoadData(cubin), f"cuModuleLoadData({program})")


class _Kernel:
    """One loaded entry point: checks its argument sizes once against the driver's param info."""

    def __init__(self, program: str, name: str, device_index: int, module=None):
        """`module`: a module loaded elsewhere (e.g. a benchmark's own source) instead of `program`'s."""
        self.name, self.device_index = name, device_index
        mod = module if module is not None else _module(program, device_index)
        self.fn = _ck(_cu().cuModuleGetFunction(mod, name.encode()), f"cuModuleGetFunction({name})")
        self.param_sizes = self._param_sizes()
        self.smem_limit = SMEM_DEFAULT
        self._configs = {}  # programmatic launches: CUlaunchConfig by (grid, block, smem, stream)

    def _param_sizes(self) -> list[int] | None:
        cu = _cu()
        if not hasattr(cu, "cuFuncGetParamInfo"):
            return None
        sizes = []
        for i in range(256):
            res = cu.cuFuncGetParamInfo(self.fn, i)
            if res[0] != cu.CUresult.CUDA_SUCCESS:
                break
            sizes.append(int(res[2]))
        return sizes or None

    def set_smem_limit(self, smem: int) -> None:
        """Allow `smem` bytes of dynamic shared memory per block (above the 48 KiB default; the
        occupancy query needs it set too)."""
        attr = _cu().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _ck(_cu().cuFuncSetAttribute(self.fn, attr, smem), f"cuFuncSetAttribute({self.name}, smem={smem})")
        self.smem_limit = smem

    def blocks_per_sm(self, threads: int, smem: int = 0) -> int:
        """Resident blocks per SM at this block size (the driver's occupancy calculator)."""
        n = _ck(_cu().cuOccupancyMaxActiveBlocksPerMultiprocessor(self.fn, threads, smem), f"occupancy({self.name})")
        return max(1, int(n))

    def __call__(self, grid, block, args: list[np.ndarray], smem: int = 0, stream=None, pdl: bool = False) -> None:
        """Launch on `stream` (torch's current one by default). pdl: programmatic dependent launch,
        the kernel may start before the kernel before it in the stream ends (it must call
        pdl_wait() before reading that kernel's output)."""
        cu = _cu()
        if self.param_sizes is not None and [a.nbytes for a in args] != self.param_sizes:
            raise CudaError(f"{self.name}: argument sizes {[a.nbytes for a in args]} != kernel params {self.param_sizes}")
        _make_current(self.device_index)
        if smem > self.smem_limit:
            self.set_smem_limit(smem)
        if stream is None:
            stream = _current_stream(self.device_index)
        params = np.array([a.ctypes.data for a in args], dtype=np.uint64)
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        if pdl:
            key = (gx, gy, gz, bx, by, bz, smem, stream)
            cfg = self._configs.get(key)
            if cfg is None:  # building one costs more Python time than the launch itself
                cfg = cu.CUlaunchConfig()
                cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = gx, gy, gz
                cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = bx, by, bz
                cfg.sharedMemBytes, cfg.hStream = smem, cu.CUstream(stream)
                cfg.attrs, cfg.numAttrs = [_pdl_attr()], 1
                if len(self._configs) >= 256:
                    self._configs.clear()
                self._configs[key] = cfg
            _ck(cu.cuLaunchKernelEx(cfg, self.fn, params.ctypes.data, 0),
                f"cuLaunchKernelEx({self.name}, grid={grid}, block={block}, smem={smem}, programmatic)")
            return
        _ck(
            cu.cuLaunchKernel(self.fn, gx, gy, gz, bx, by, bz, smem, cu.CUstream(stream), params.ctypes.data, 0),
            f"cuLaunchKernel({self.name}, grid={grid}, block={block}, smem={smem})",
        )


@functools.cache
def _pdl_attr():
    """The launch attribute that lets a kernel overlap the one before it (sm_90+)."""
    cu = _cu()
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    return attr


@functools.cache
def kernel(program: str, name: str, device_index: int) -> _Kernel:
    with _LOCK:
        return _Kernel(program, name, device_index)


# kernel argument helpers: each is a 1-element array of the exact C type
def _p(t: Tensor | None) -> np.ndarray:
    return np.array([0 if t is None else t.data_ptr()], dtype=np.uint64)


def _i32(v: int) -> np.ndarray:
    if not -(2**31) <= int(v) < 2**31:
        raise ValueError(f"int argument {v} does not fit in int32")
    return np.array([int(v)], dtype=np.int32)


def _i64(v: int) -> np.ndarray:
    return np.array([int(v)], dtype=np.int64)


def _f32(v: float) -> np.ndarray:
    return np.array([v], dtype=np.float32)


# ---- validation ----------------------------------------------------------------------------------


def _act(t: Tensor, name: str, device: torch.device) -> Tensor:
    """An fp32 contiguous activation on `device` (bf16/fp16 are converted, strides copied)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")
    if t.dtype != torch.float32:
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name}: dtype {t.dtype}, expected float32")
        t = t.float()
    return t.contiguous()


def _wt(t: Tensor, name: str, device: torch.device) -> tuple[Tensor, int]:
    """A weight, fp32 or bf16, contiguous, on `device` -> (tensor, is_bf16 flag)."""
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")
    if t.dtype not in (torch.float32, torch.bfloat16):
        t = t.float()
    return t.contiguous(), int(t.dtype == torch.bfloat16)


def _inplace(t: Tensor, name: str, device: torch.device, shape: tuple[int, ...]) -> Tensor:
    """The buffer a kernel updates in place: `t` itself when contiguous, else a contiguous copy
    the caller writes back with `t.copy_(buf)` after the launch."""
    if t.device != device or t.dtype != torch.float32 or tuple(t.shape) != shape:
        raise ValueError(
            f"{name}: updated in place, so it must be a float32 tensor of shape {shape} on {device}; "
            f"got {t.dtype} {tuple(t.shape)} on {t.device}"
        )
    return t if t.is_contiguous() else t.contiguous()


def _aligned(t: Tensor, n: int) -> bool:
    return t.data_ptr() % n == 0


def _threads(n: int, cap: int = 1024) -> int:
    return max(32, min(cap, 1 << max(0, math.ceil(math.log2(max(1, n))))))


class NvrtcBackend:
    """Backend ops on NVRTC kernels (CUDA tensors only). `rowwise_max`: see the module doc."""

    name = "nvrtc"

    def __init__(self, device: torch.device | str | int | None = None, rowwise_max: int = 64, nvfp4_impl: str | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("NvrtcBackend needs a CUDA device")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type != "cuda":
            raise ValueError(f"NvrtcBackend runs on CUDA devices, not {device}")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.rowwise_max = rowwise_max
        self._dev = self.device.index
        # NVFP4 expert GEMVs: "tc" (tensor cores, default) or "cuda_core" (fp32 FMA); same math
        self.nvfp4_impl = nvfp4_impl or os.environ.get("STREAMRT_NVFP4", "tc")
        if self.nvfp4_impl not in NVFP4_IMPLS:
            raise ValueError(f"nvfp4_impl must be one of {NVFP4_IMPLS}, got {self.nvfp4_impl!r}")
        self.tc_shape = TC_SHAPE  # (warps gate+up, warps down, stages, blocks per stage)
        # Programmatic dependent launch of the expert FFN's kernels (sm_90+; STREAMRT_PDL=0: off):
        # the tensor-core gate+up kernel queues its first weight copies while the kernel before
        # it ends, the down kernel's blocks take the SM slots the gate+up grid's last wave leaves
        # free, and the weighted sum queues behind the down kernel.
        self.pdl = torch.cuda.get_device_capability(self.device)[0] >= 9 and os.environ.get("STREAMRT_PDL", "1") != "0"
        # The tensor-core down kernel's blocks start on a pair once its gate+up blocks are done
        # (per-pair counts), not once the whole gate+up grid is: the first experts' down work
        # runs while the last experts' gate+up does.
        self.pair_ready = True
        self._ready = None
        self._ptr_cache: dict[int, tuple] = {}  # id(ExpertWeights) -> (weak ref, Dl, pointers)
        self.gemv_plan = gemv_plan(os.environ.get("STREAMRT_GEMV", ""))
        self._gemv_choice: dict[tuple, str] = {}
        self.gemv_tc_ks: int | None = None  # K split of the tensor-core GEMV (None: gemv_tc_split; changes bits)
        self._cc = torch.cuda.get_device_capability(self.device)
        self._mma = self._cc >= (8, 0)  # bf16 mma.sync
        self._smem_optin = getattr(torch.cuda.get_device_properties(self.device), "shared_memory_per_block_optin", SMEM_DEFAULT)
        self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count

    def _k(self, program: str, name: str) -> _Kernel:
        return kernel(program, name, self._dev)

    def _checked_ptrs(self, ew: ExpertWeights, e: int, Dl: int) -> tuple[int, ...]:
        """An expert's 9 pointers and I, checked once per ExpertWeights object (frozen views: the
        same object has the same tensors). Checking 9 tensors was most of an expert-FFN call's
        host time, and a decode step on the NVRTC kernels is bound by host time."""
        hit = self._ptr_cache.get(id(ew))
        if hit is not None and hit[0]() is ew and hit[1] == Dl:
            return hit[2]
        ptrs = _expert_ptrs(ew, e, Dl, self.device)
        if len(self._ptr_cache) >= 8192:  # entries of views that are gone
            self._ptr_cache.clear()
        self._ptr_cache[id(ew)] = (weakref.ref(ew), Dl, ptrs)
        return ptrs

    def _ready_counts(self, n: int) -> Tensor:
        """Per pair of an expert-FFN call, how many gate+up blocks are done (the down kernel's
        blocks wait on their pair's count). Zero between calls: the weighted sum zeroes them.
        One set per backend: calls on one stream (the runtime's compute stream)."""
        if self._ready is None or self._ready.numel() < n:
            self._ready = torch.zeros(max(n, 1024), dtype=torch.int32, device=self.device)
        return self._ready

    def _empty(self, *shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """Every output and scratch buffer comes from here (tests poison it to prove full writes)."""
        return torch.empty(*shape, dtype=dtype, device=self.device)

    # ---- dense ---------------------------------------------------------------------------------

    def linear(self, x: Tensor, w: Tensor) -> Tensor:
        """x [..., in] fp32 (or bf16), w [out, in] bf16 or fp32 -> [..., out] fp32, fp32 accumulation.

        Up to `rowwise_max` rows: the GEMV kernel, 8 rows per launch (batch-invariant). More rows
        (prefill): one cuBLAS GEMM through torch in fp32, weights converted in row blocks.
        """
        dev = self.device
        if x.device != dev or w.device != dev:
            raise ValueError(f"linear: x on {x.device}, w on {w.device}, expected {dev}")
        if w.dim() != 2 or x.shape[-1] != w.shape[1]:
            raise ValueError(f"linear: x {tuple(x.shape)} and w {tuple(w.shape)} do not match (w is [out, in])")
        lead, K = x.shape[:-1], x.shape[-1]
        N = w.shape[0]
        x2 = x.reshape(-1, K)
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        x2 = x2.contiguous()
        T = x2.shape[0]
        if T > self.rowwise_max:
            return self._linear_gemm(x2.float(), w).view(*lead, N)
        w, w_bf16 = _wt(w, "linear.w", dev)
        out = self._empty(T, N, dtype=torch.float32)
        if T == 0 or N == 0:
            return out.view(*lead, N)
        x_bf16 = int(x2.dtype == torch.bfloat16)
        vec = K % 8 == 0 and _aligned(w, 16)
        if vec and not _aligned(x2, 16):
            x2 = x2.clone()
        for t0 in range(0, T, 8):
            xt, ot = x2[t0 : t0 + 8], out[t0 : t0 + 8]
            tn = xt.shape[0]
            if not vec:
                k = self._k("gemv", "srt_gemv_scalar")
                k((math.ceil(N / 8),), (256,), [_p(xt), _i32(x_bf16), _i32(tn), _p(w), _i32(w_bf16), _p(ot), _i32(N), _i32(K)])
                continue
            nt = 1 if tn == 1 else 2 if tn == 2 else 4 if tn <= 4 else 8
            dt = "bf16" if w_bf16 else "f32"
            v = self._gemv_variant(dt, nt, N)
            if v.startswith("tc"):
                self._gemv_tc(xt, x_bf16, w, ot, int(v[2:]))
            else:
                k = self._k("gemv", f"srt_gemv_{dt}_t{nt}_{v}")
                k((math.ceil(N / (GEMV_WARPS * int(v[1:]))),), (GEMV_WARPS * 32,),
                  [_p(xt), _i32(x_bf16), _i32(tn), _p(w), _p(ot), _i32(N), _i32(K)])
        return out.view(*lead, N)

    def _gemv_tc(self, x: Tensor, x_bf16: int, w: Tensor, out: Tensor, stages: int) -> None:
        """The tensor-core GEMV: a block per 32 rows of w, K split among its `gemv_tc_split(N, K)`
        warps (a function of the matrix only, so a row's bits do not depend on T)."""
        (T, K), N = x.shape, w.shape[0]
        ks = self.gemv_tc_ks or gemv_tc_split(N, K)
        # at most 8 warps, one stage each, and as many as fit shared memory with 2 stages of the
        # largest x (8 fp32 rows): a cap that does not depend on this call's T
        fit = (self._smem_optin + 8 * 32 * 4) // (2 * (GEMV_TC_ROWS * 128 * 2 + 8 * 128 * 4) + 8 * 32 * 4)
        ks = max(1, min(ks, 8, fit, math.ceil(K / 128)))
        stage = GEMV_TC_ROWS * 128 * 2 + T * 128 * (2 if x_bf16 else 4)
        # fewer stages where the rings would not fit a block's shared memory (same bits; 2 always fit)
        while stages > 2 and ks * stages * stage + (ks - 1) * 8 * 32 * 4 > self._smem_optin:
            stages -= 1
        smem = ks * stages * stage + (ks - 1) * 8 * 32 * 4
        k = self._k("gemv", f"srt_gemv_tc_x{'bf16' if x_bf16 else 'f32'}_s{stages}")
        k((math.ceil(N / GEMV_TC_ROWS),), (32 * ks,), [_p(x), _i32(T), _p(w), _p(out), _i32(N), _i32(K), _i32(ks)], smem=smem)

    def _gemv_variant(self, dt: str, nt: int, N: int) -> str:
        """The override if any; else for bf16 weights the tensor-core kernel where the device has
        bf16 mma (sm_80+); else at T=1 the CUDA-core variant with the fullest last wave (blocks /
        (waves * resident slots)), else the first."""
        forced = self.gemv_plan.get((dt, nt))
        key = (dt, nt, N, forced)
        if key not in self._gemv_choice:
            cands = [v for v in GEMV_VARIANTS[(dt, nt)] if self._mma or not v.startswith("tc")]
            if forced:
                if forced.startswith("tc") and not self._mma:
                    raise ValueError(f"STREAMRT_GEMV: {forced} needs bf16 mma (sm_80+), this GPU has sm_{self._cc[0]}{self._cc[1]}")
                best = forced
            elif cands[0].startswith("tc"):
                best = cands[0]
            else:

                def fill(v: str) -> float:
                    blocks = math.ceil(N / (GEMV_WARPS * int(v[1:])))
                    slots = self._sms * self._k("gemv", f"srt_gemv_{dt}_t{nt}_{v}").blocks_per_sm(GEMV_WARPS * 32)
                    return blocks / (math.ceil(blocks / slots) * slots)

                best = max(cands, key=fill) if nt == 1 and len(cands) > 1 else cands[0]
            self._gemv_choice[key] = best
        return self._gemv_choice[key]

    @staticmethod
    def _linear_gemm(x: Tensor, w: Tensor, block_elems: int = 1 << 24) -> Tensor:
        rows = max(1, block_elems // max(1, w.shape[1]))
        parts = [x @ w[r0 : r0 + rows].float().T for r0 in range(0, w.shape[0], rows)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def _rows(self, name: str, x: Tensor, D: int) -> int:
        if x.shape[-1] != D:
            raise ValueError(f"{name}: last dim {x.shape[-1]} != {D}")
        return x.numel() // D if D else 0

    def rmsnorm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        """x [..., D], w [D] -> w * (x * rsqrt(mean(x^2) + eps)) [..., D] fp32."""
        x = _act(x, "rmsnorm.x", self.device)
        w, wb = _wt(w, "rmsnorm.w", self.device)
        D = w.numel()
        rows = self._rows("rmsnorm", x, D)
        out = self._empty(*x.shape)
        if rows:
            self._k("norms", "srt_rmsnorm")((rows,), (_threads(D, 512),), [_p(x), _p(w), _i32(wb), _p(out), _i32(D), _f32(eps)])
        return out

    def gated_rmsnorm(self, o: Tensor, gate: Tensor, w: Tensor, eps: float) -> Tensor:
        """o, gate [..., V], w [V] -> rmsnorm(o) * w * sigmoid(gate) per row of V."""
        o = _act(o, "gated_rmsnorm.o", self.device)
        gate = _act(gate, "gated_rmsnorm.gate", self.device)
        if gate.shape != o.shape:
            raise ValueError(f"gated_rmsnorm: gate {tuple(gate.shape)} != o {tuple(o.shape)}")
        w, wb = _wt(w, "gated_rmsnorm.w", self.device)
        V = w.numel()
        rows = self._rows("gated_rmsnorm", o, V)
        out = self._empty(*o.shape)
        if rows:
            self._k("norms", "srt_gated_rmsnorm")(
                (rows,), (_threads(V, 256),), [_p(o), _p(gate), _p(w), _i32(wb), _p(out), _i32(V), _f32(eps)]
            )
        return out

    def layernorm(self, x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
        """x [..., D], w [D], b [D] -> (x - mean) * rsqrt(var + eps) * w + b."""
        x = _act(x, "layernorm.x", self.device)
        w, wb = _wt(w, "layernorm.w", self.device)
        b, bb = _wt(b, "layernorm.b", self.device)
        if wb != bb:
            w, b, wb = w.float(), b.float(), 0
        D = w.numel()
        if b.numel() != D:
            raise ValueError(f"layernorm: w has {D} elements, b {b.numel()}")
        rows = self._rows("layernorm", x, D)
        out = self._empty(*x.shape)
        if rows:
            self._k("norms", "srt_layernorm")(
                (rows,), (_threads(D, 512),), [_p(x), _p(w), _p(b), _i32(wb), _p(out), _i32(D), _f32(eps)]
            )
        return out

    def l2norm(self, x: Tensor, eps: float) -> Tensor:
        """x [..., D] -> x * rsqrt(sum(x^2) + eps) over the last dim."""
        x = _act(x, "l2norm.x", self.device)
        D = x.shape[-1]
        rows = x.numel() // D if D else 0
        out = self._empty(*x.shape)
        if rows:
            self._k("norms", "srt_l2norm")((rows,), (_threads(D, 512),), [_p(x), _p(out), _i32(D), _f32(eps)])
        return out

    def situ_glu(self, gate: Tensor, up: Tensor, beta: float, linear_beta: float | None) -> Tensor:
        """gate, up [...] -> beta*tanh(gate/beta)*sigmoid(gate) * (linear_beta*tanh(up/linear_beta) or up)."""
        gate = _act(gate, "situ_glu.gate", self.device)
        up = _act(up, "situ_glu.up", self.device)
        if gate.shape != up.shape:
            raise ValueError(f"situ_glu: gate {tuple(gate.shape)} != up {tuple(up.shape)}")
        out = self._empty(*gate.shape)
        n = gate.numel()
        if n:
            binf = int(math.isinf(beta))
            self._k("norms", "srt_situ_glu")(
                (min(math.ceil(n / 256), 8192),), (256,),
                [_p(gate), _p(up), _p(out), _i64(n), _f32(0.0 if binf else beta), _i32(binf),
                 _f32(1.0 if linear_beta is None else linear_beta), _i32(linear_beta is not None)],
            )
        return out

    # ---- KDA -----------------------------------------------------------------------------------

    def short_conv_step(self, z: Tensor, conv_state: Tensor, w: Tensor) -> Tensor:
        """z [T, P]; conv_state [T, P, W] rolled left + z written last (in place); w [P, W] (or
        [P, 1, W]) -> SiLU(sum_j state * w) [T, P]."""
        z = _act(z, "short_conv_step.z", self.device)
        T, P = z.shape
        W = conv_state.shape[-1]
        buf = _inplace(conv_state, "short_conv_step.conv_state", self.device, (T, P, W))
        w, wb = _wt(w.reshape(P, W), "short_conv_step.w", self.device)
        out = self._empty(*z.shape)
        if T * P:
            self._k("norms", "srt_short_conv_step")(
                (math.ceil(T * P / 256),), (256,), [_p(z), _p(buf), _p(w), _i32(wb), _p(out), _i32(T), _i32(P), _i32(W)]
            )
            if buf is not conv_state:
                conv_state.copy_(buf)
        return out

    def kda_step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
        """q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; state [T, H, K, V] fp32 (in place) -> o [T, H, V]."""
        dev = self.device
        q, k, g = (_act(t, f"kda_step.{n}", dev) for t, n in ((q, "q"), (k, "k"), (g, "g")))
        v, beta = _act(v, "kda_step.v", dev), _act(beta, "kda_step.beta", dev)
        T, H, K = q.shape
        V = v.shape[-1]
        if k.shape != q.shape or g.shape != q.shape or v.shape != (T, H, V) or beta.shape != (T, H):
            raise ValueError(
                f"kda_step: shapes q {tuple(q.shape)} k {tuple(k.shape)} g {tuple(g.shape)} v {tuple(v.shape)} "
                f"beta {tuple(beta.shape)} do not agree"
            )
        if K > KDA_MAXK:
            raise ValueError(f"kda_step: head dim K={K} > {KDA_MAXK} (the kernel keeps a state column in registers)")
        buf = _inplace(state, "kda_step.state", dev, (T, H, K, V))
        out = self._empty(T, H, V, dtype=torch.float32)
        if T * H * V:
            self._k("kda", "srt_kda_step")(
                (math.ceil(V / 32), H, T), (32,),
                [_p(q), _p(k), _p(v), _p(g), _p(beta), _p(buf), _p(out), _i32(H), _i32(K), _i32(V)],
            )
            if buf is not state:
                state.copy_(buf)
        return out

    # ---- MLA + indexer -------------------------------------------------------------------------

    def mla_decode(
        self, q_lat: Tensor, q_rot: Tensor, c_cache: Tensor, kr_cache: Tensor, scale: float, select: Tensor | None
    ) -> Tensor:
        """q_lat [H, R], q_rot [H, Dr], c_cache [n, R], kr_cache [n, Dr] (fp32 or bf16), select
        [m] positions or None -> softmax((q_lat.c + q_rot.kr) * scale) @ c  [H, R] fp32."""
        dev = self.device
        q_lat, q_rot = _act(q_lat, "mla_decode.q_lat", dev), _act(q_rot, "mla_decode.q_rot", dev)
        H, R = q_lat.shape
        Dr = q_rot.shape[1]
        if q_rot.shape[0] != H or c_cache.shape[-1] != R or kr_cache.shape[-1] != Dr or c_cache.shape[0] != kr_cache.shape[0]:
            raise ValueError(
                f"mla_decode: q_lat {tuple(q_lat.shape)} q_rot {tuple(q_rot.shape)} c {tuple(c_cache.shape)} "
                f"kr {tuple(kr_cache.shape)} do not agree"
            )
        if c_cache.dtype != kr_cache.dtype or c_cache.dtype not in (torch.float32, torch.bfloat16):
            c_cache, kr_cache = c_cache.float(), kr_cache.float()
        c_cache, kr_cache = c_cache.contiguous(), kr_cache.contiguous()
        cb = int(c_cache.dtype == torch.bfloat16)
        n = c_cache.shape[0]
        if select is not None:
            if select.device != dev:
                raise ValueError(f"mla_decode: select on {select.device}, expected {dev}")
            select = select.reshape(-1).to(torch.int64).contiguous()
            m = select.numel()
        else:
            m = n
        if m == 0:
            raise ValueError("mla_decode: no positions to attend to")
        S = math.ceil(m / MLA_CHUNK)
        part_acc = self._empty(S, H, R, dtype=torch.float32)
        part_ml = self._empty(S, H, 2, dtype=torch.float32)
        out = self._empty(H, R, dtype=torch.float32)
        smem = MLA_HG * (R + Dr) * 4
        self._k("attention", "srt_mla_partial")(
            (S, math.ceil(H / MLA_HG)), (256,),
            [_p(q_lat), _p(q_rot), _p(c_cache), _p(kr_cache), _i32(cb), _p(select), _i32(m), _i32(H), _i32(R), _i32(Dr),
             _f32(scale), _p(part_acc), _p(part_ml)],
            smem=smem,
        )
        self._k("attention", "srt_mla_combine")((H,), (_threads(R, 256),), [_p(part_acc), _p(part_ml), _p(out), _i32(S), _i32(H), _i32(R)])
        return out

    def indexer_scores(self, q: Tensor, w: Tensor, k_cache: Tensor) -> Tensor:
        """q [Hi, Di], w [Hi], k_cache [n, Di] (fp32 or bf16) -> I [n] = sum_h w[h] relu(q[h].k[s]) fp32."""
        dev = self.device
        q, w = _act(q, "indexer_scores.q", dev), _act(w, "indexer_scores.w", dev).reshape(-1)
        Hi, Di = q.shape
        if w.numel() != Hi or k_cache.shape[-1] != Di or k_cache.dim() != 2:
            raise ValueError(f"indexer_scores: q {tuple(q.shape)} w {tuple(w.shape)} k_cache {tuple(k_cache.shape)} do not agree")
        k_cache, kb = _wt(k_cache, "indexer_scores.k_cache", dev)
        n = k_cache.shape[0]
        out = self._empty(n, dtype=torch.float32)
        if n:
            smem = (Hi * (Di + 1) + 8 * Di) * 4
            self._k("attention", "srt_indexer_scores")(
                (math.ceil(n / 32),), (256,), [_p(q), _p(w), _p(k_cache), _i32(kb), _p(out), _i32(n), _i32(Hi), _i32(Di)], smem=smem
            )
        return out

    def select_topk(self, scores: Tensor, k: int) -> Tensor:
        """Exact top-k positions with the tie rule: scores [n] (or [rows, n]) -> LongTensor [min(k, n)]
        (or [rows, min(k, n)]): positions above the threshold ascending, then the boundary group
        from the lowest position up."""
        s = _act(scores, "select_topk.scores", self.device)
        one = s.dim() == 1
        if s.dim() not in (1, 2):
            raise ValueError(f"select_topk: scores must be 1-D or 2-D, got {tuple(s.shape)}")
        s2 = s.view(1, -1) if one else s
        rows, n = s2.shape
        kk = min(int(k), n)
        out = self._empty(rows, max(kk, 0), dtype=torch.int64)
        if kk > 0 and rows:
            self._k("topk", "srt_select_topk")((rows,), (1024,), [_p(s2), _p(out), _i32(n), _i32(kk)])
        return out[0] if one else out

    # ---- MoE -----------------------------------------------------------------------------------

    def router(
        self,
        x: Tensor,
        w_gate: Tensor,
        bias: Tensor,
        k: int,
        renormalize: bool,
        scale: float,
        n_group: int = 1,
        topk_group: int = 1,
    ) -> tuple[Tensor, Tensor]:
        """x [T, D], w_gate [E, D], bias [E] -> (ids [T, k] int64 by descending s + bias, ties to
        the lower id; weights [T, k] fp32 = sigmoid scores, renormalised (+1e-20), * scale)."""
        logits = self.linear(x, w_gate)  # [T, E] fp32
        T, E = logits.shape
        if n_group > 1 and topk_group < n_group:  # group-limited routing: torch ops on our logits
            s = torch.sigmoid(logits)
            choice = s + bias.float()
            grp = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(grp, dtype=torch.bool).scatter(1, grp.topk(topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
            ids = torch.topk(choice, k, dim=-1, sorted=True).indices
            w = s.gather(-1, ids)
            if renormalize and k > 1:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            return ids, w * scale
        if not 1 <= k <= min(E, 256):
            raise ValueError(f"router: k={k} must be in 1..min(E={E}, 256)")
        bias, bb = _wt(bias.reshape(-1), "router.bias", self.device)
        if bias.numel() != E:
            raise ValueError(f"router: bias has {bias.numel()} entries, w_gate {E} experts")
        ids = self._empty(T, k, dtype=torch.int64)
        wts = self._empty(T, k, dtype=torch.float32)
        if T:
            self._k("topk", "srt_router_topk")(
                (T,), (256,),
                [_p(logits), _p(bias), _i32(bb), _p(ids), _p(wts), _i32(E), _i32(k), _i32(bool(renormalize)), _f32(scale)],
                smem=E * 9,
            )
        return ids, wts

    def expert_ffn(
        self,
        z: Tensor,
        ids: Tensor,
        weights: Tensor,
        experts: Mapping[int, ExpertWeights],
        beta: float,
        linear_beta: float | None,
    ) -> Tensor:
        """Routed NVFP4 experts straight from their device slots: z [T, Dl] fp32, ids / weights
        [T, k] -> out[t] = sum_j (j ascending) weights[t, j] * down(situ_glu(gate z_t, up z_t)) [T, Dl].

        Per launch up to 64 (t, j) pairs (all of one token's experts at decode): gate+up+SiTU
        into h [T*k, I], down into y [T*k, Dl], then a fixed-order weighted sum. `ids` may live on
        the host (no sync; CUDA-graph capturable) or on the device (one sync for the ids).
        """
        dev = self.device
        z = _act(z, "expert_ffn.z", dev)
        if not _aligned(z, 16):
            z = z.clone()
        T, Dl = z.shape
        if ids.shape[0] != T or weights.shape != ids.shape:
            raise ValueError(f"expert_ffn: z {tuple(z.shape)}, ids {tuple(ids.shape)}, weights {tuple(weights.shape)} do not agree")
        k = ids.shape[1]
        w = _act(weights, "expert_ffn.weights", dev)
        id_rows = ids.tolist()
        uniq = sorted({e for row in id_rows for e in row})
        missing = [e for e in uniq if e not in experts]
        if missing:
            raise KeyError(f"expert_ffn: experts {missing} were routed to but not provided")
        # Experts whose copy is still in flight (a streamed layer) go last: the compute stream
        # waits for their events only after the resident ones are queued (overlap within the layer).
        pending = getattr(experts, "pending", None)
        late = {e for e in uniq if pending is not None and pending(e)}
        P = T * k
        out = self._empty(T, Dl, dtype=torch.float32)
        if P == 0:
            return out.zero_()
        pairs = [(p, t, e) for t, row in enumerate(id_rows) for p, e in enumerate(row, start=t * k)]
        groups = [[q for q in pairs if q[2] not in late], [q for q in pairs if q[2] in late]]
        ptrs, I = {}, None
        binf = int(math.isinf(beta))
        act = [_f32(0.0 if binf else beta), _i32(binf), _f32(1.0 if linear_beta is None else linear_beta), _i32(linear_beta is not None)]
        h = y = None
        # Per-pair gate+up counts for the tensor-core kernels; the sum zeroes them for the next
        # call with its first T * k threads of T * Dl (k <= Dl).
        ready = self._ready_counts(P) if self.pair_ready and k <= Dl else None
        try:
            for late_group, group in enumerate(groups):
                if not group:
                    continue
                for e in sorted({q[2] for q in group}):  # taking a late expert queues its event wait
                    ptrs[e] = self._checked_ptrs(experts[e], e, Dl)
                    if I is None:
                        I = ptrs[e][9]
                    elif ptrs[e][9] != I:
                        raise ValueError(f"expert_ffn: expert {e} has intermediate size {ptrs[e][9]}, another has {I}")
                if h is None:
                    h, y = self._empty(P, I, dtype=torch.float32), self._empty(P, Dl, dtype=torch.float32)
                for c0 in range(0, len(group), MOE_MAXP):
                    chunk = group[c0 : c0 + MOE_MAXP]
                    self._launch_experts(chunk, ptrs, z, h, y, I, Dl, act, ready, pdl_gateup=not late_group)
        except BaseException:
            if ready is not None:  # the sum that zeroes the counts will not run (queued after any launch made)
                ready.zero_()
            raise
        n = T * Dl
        self._k("nvfp4_moe", "srt_moe_combine")(
            (min(math.ceil(n / 256), 4096),), (256,),
            [_p(y), _p(w), _p(out), _i32(T), _i32(k), _i32(Dl), _p(ready)],
            pdl=self.pdl,  # only y is the kernel before's output: read after pdl_wait()
        )
        return out

    def _launch_experts(self, chunk, ptrs, z, h, y, I, Dl, act, ready, pdl_gateup) -> None:
        """gate+up+SiTU into h and down into y for up to 64 pairs (the tensor-core kernels count
        into `ready`; the CUDA-core ones leave it alone)."""
        gtab, dtab = _tables(chunk, ptrs)
        np_ = len(chunk)
        hp, yp = _p(h), _p(y)
        # (slot sections are 4096-byte aligned, so every chunk of a layer takes the same kernels)
        if self.nvfp4_impl == "tc" and Dl % 128 == 0 and I % 128 == 0 and _scales_aligned8(chunk, ptrs):
            tg, td, st, kbs = self.tc_shape  # 16 rows per warp (gate+up tiles), 32 rows per warp (down)
            if not (1 <= tg <= 16 and 1 <= td <= 16 and (st, kbs) in TC_PIPES):
                raise ValueError(f"tc_shape {self.tc_shape}: warps 1..16, (stages, blocks) one of {TC_PIPES}")
            gu_blocks = math.ceil(I / (16 * tg))
            self._k("nvfp4_moe", f"srt_nvfp4_gateup_tc{st}x{kbs}")(
                (gu_blocks, np_), (tg * 32,), [gtab, _p(z), hp, _i32(I), _i32(Dl), *act, _p(ready)],
                smem=tc_smem(Dl, tg, st, kbs),
                # programmatic: reads z after pdl_wait(); before it only weights, and only of
                # resident experts (a late expert's copy is waited for by an event before this)
                pdl=self.pdl and pdl_gateup)
            self._k("nvfp4_moe", f"srt_nvfp4_down_tc{st}x{kbs}")(
                (math.ceil(Dl / (32 * td)), np_), (td * 32,), [dtab, hp, yp, _i32(Dl), _i32(I), _p(ready), _i32(gu_blocks)],
                smem=tc_smem(I, td, st, kbs), pdl=self.pdl)
            return
        self._k("nvfp4_moe", "srt_nvfp4_gateup")(
            (math.ceil(I / (MOE_WARPS * 2)), np_), (MOE_WARPS * 32,),
            [gtab, _p(z), hp, _i32(I), _i32(Dl), *act], smem=Dl * 4)
        self._k("nvfp4_moe", "srt_nvfp4_down")(
            (math.ceil(Dl / (MOE_WARPS * 4)), np_), (MOE_WARPS * 32,), [dtab, hp, yp, _i32(Dl), _i32(I)], smem=I * 4)

    # ---- AttnRes -------------------------------------------------------------------------------

    def attnres_mix(self, prefix: Tensor, blocks: Tensor, wq: Tensor, eps: float) -> Tensor:
        """prefix [T, D], blocks [T, nb, D], wq [D] -> sum_s softmax_s(rmsnorm(V_s) . wq) V_s [T, D]
        with sources V = (blocks..., prefix)."""
        dev = self.device
        prefix, blocks = _act(prefix, "attnres_mix.prefix", dev), _act(blocks, "attnres_mix.blocks", dev)
        T, D = prefix.shape
        nb = blocks.shape[1]
        if blocks.shape != (T, nb, D):
            raise ValueError(f"attnres_mix: blocks {tuple(blocks.shape)} vs prefix {tuple(prefix.shape)}")
        if nb + 1 > ATTNRES_MAXS:
            raise ValueError(f"attnres_mix: {nb + 1} sources > {ATTNRES_MAXS}")
        wq, wb = _wt(wq.reshape(-1), "attnres_mix.wq", dev)
        out = self._empty(T, D, dtype=torch.float32)
        if T:
            self._k("norms", "srt_attnres_mix")(
                (T,), (_threads(D, 512),), [_p(prefix), _p(blocks), _p(wq), _i32(wb), _p(out), _i32(nb), _i32(D), _f32(eps)]
            )
        return out


# ---- NVFP4 pointer tables ------------------------------------------------------------------------


def _check_mat(m: NVFP4Matrix, what: str, rows: int, cols: int, dev: torch.device) -> tuple[int, int, int]:
    if cols % 32:
        raise ValueError(f"{what}: input dim {cols} must be a multiple of 32 for the NVFP4 kernel")
    for t, name, dt, shape in (
        (m.packed, "packed", torch.uint8, (rows, cols // 2)),
        (m.scales, "scales", torch.uint8, (rows, cols // 16)),
        (m.global_scale, "global_scale", torch.float32, (rows,)),
    ):
        if t.device != dev or t.dtype != dt or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(
                f"{what}.{name}: need a contiguous {dt} {shape} on {dev}, got {t.dtype} {tuple(t.shape)} "
                f"on {t.device} (contiguous={t.is_contiguous()})"
            )
    if not (_aligned(m.packed, 16) and _aligned(m.scales, 2) and _aligned(m.global_scale, 4)):
        raise ValueError(f"{what}: packed must be 16-byte aligned, scales 2-byte aligned")
    return m.packed.data_ptr(), m.scales.data_ptr(), m.global_scale.data_ptr()


def _scales_aligned8(chunk: list[tuple[int, int, int]], ptrs: dict[int, tuple[int, ...]]) -> bool:
    """The pipelined kernels copy scale rows 8 bytes at a time (cp.async)."""
    return all(ptrs[e][i] % 8 == 0 for _, _, e in chunk for i in (1, 4, 7))


def _expert_ptrs(ew: ExpertWeights, e: int, Dl: int, dev: torch.device) -> tuple[int, ...]:
    I = ew.gate.packed.shape[0]
    g = _check_mat(ew.gate, f"expert {e} gate", I, Dl, dev)
    u = _check_mat(ew.up, f"expert {e} up", I, Dl, dev)
    d = _check_mat(ew.down, f"expert {e} down", Dl, I, dev)
    return (*g, *u, *d, I)


def gemv_tc_split(N: int, K: int) -> int:
    """Warps sharing a 32-row block of the tensor-core GEMV, each a slice of K: enough warps in
    flight for a matrix of N rows (a warp alone issues too few bytes per cycle to keep up with
    HBM; H200, 7168x12288: 0.40 of the copy rate with 1, 0.76 with 2, 0.88-0.90 with 4); 1 for
    big N, where blocks are plenty. A function of the shape only: the split sets the order of
    the sum, so a row's bits must not depend on T (nor on the GPU)."""
    return 8 if N <= 2048 else 4 if N <= 8192 else 2 if N <= 32768 else 1


def gemv_plan(spec: str) -> dict[tuple[str, int], str]:
    """Forced GEMV variants from "bf16:8=tc3,f32:1=r2" (benchmarks, tests); empty = automatic."""
    plan = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        try:
            key, variant = item.split("=")
            dt, nt = key.split(":")
            k = (dt, int(nt))
        except ValueError:
            raise ValueError(f"STREAMRT_GEMV: cannot parse {item!r} (want e.g. bf16:8=tc3)") from None
        if variant not in GEMV_VARIANTS.get(k, ()):
            raise ValueError(f"STREAMRT_GEMV: {item!r}: variants for {k} are {GEMV_VARIANTS.get(k, ())}")
        plan[k] = variant
    return plan


def _tables(chunk: list[tuple[int, int, int]], ptrs: dict[int, tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """The by-value GateUpTable (6 x 64 u64 + 2 x 64 int32) and DownTable (3 x 64 u64 + 64
    int32) for pairs (pair index = h / y row, token row, expert)."""
    g = np.zeros(6 * MOE_MAXP * 8 + 2 * MOE_MAXP * 4, dtype=np.uint8)
    gp = g[: 6 * MOE_MAXP * 8].view(np.uint64).reshape(6, MOE_MAXP)
    gi = g[6 * MOE_MAXP * 8 :].view(np.int32).reshape(2, MOE_MAXP)
    d = np.zeros(3 * MOE_MAXP * 8 + MOE_MAXP * 4, dtype=np.uint8)
    dp = d[: 3 * MOE_MAXP * 8].view(np.uint64).reshape(3, MOE_MAXP)
    di = d[3 * MOE_MAXP * 8 :].view(np.int32)
    for i, (p, t, e) in enumerate(chunk):
        pe = ptrs[e]
        gp[:, i] = pe[0:6]
        gi[0, i], gi[1, i] = t, p
        dp[:, i] = pe[6:9]
        di[i] = p
    return g, d
