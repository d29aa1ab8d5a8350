"""The host CPU expert kernel's Python face: check the tensors, allocate `out`, call the C.

`expert_ffn_rows(z, expert, beta, linear_beta)` runs one routed expert on the CPU for the m rows
routed to it, straight from the expert's NVFP4 bytes (a file mapping or a pool buffer; nothing
is dequantised or copied). Axis legend: m rows, Dl routed width, I expert intermediate.

Numerics (nvfp4_expert.c): fp32 with one fixed order of fused multiply-adds per output element,
the same bits on the AVX-512, AVX2 and portable paths and at any thread count. They differ from
the torch path's (which dequantises with the global scale folded into every weight and sums in
torch's order) by rounding only: tests/test_cpu_expert_kernel.py states the tolerance.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch
from torch import Tensor

from streamrt.backends.cpu_expert.build import load_library
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_F = ctypes.c_float


def bind(lib: ctypes.CDLL):
    """The library's `srt_cpu_expert_ffn` with its C signature."""
    fn = lib.srt_cpu_expert_ffn
    fn.argtypes = [_P, _I64, _I64, _I64, *([_P] * 9), _F, _F, _P, _P, _P, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _entry():
    return bind(load_library()[0])


def simd_path() -> str:
    """'avx512', 'avx2' or 'portable': the path the built library takes, and its build variant."""
    lib, variant = load_library()
    lib.srt_cpu_expert_path.restype = ctypes.c_char_p
    return f"{lib.srt_cpu_expert_path().decode()} ({variant} build)"


def _check_matrix(m: NVFP4Matrix, name: str, out: int, inp: int) -> None:
    want = {"packed": (out, inp // 2), "scales": (out, inp // 16), "global_scale": (out,)}
    dtypes = {"packed": torch.uint8, "scales": torch.uint8, "global_scale": torch.float32}
    for part, shape in want.items():
        t = getattr(m, part)
        if t.device.type != "cpu" or t.dtype != dtypes[part] or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(
                f"{name}.{part}: expected a contiguous CPU {dtypes[part]} tensor of shape {shape}, got "
                f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}"
            )


def check_expert(expert: ExpertWeights) -> tuple[int, int]:
    """(Dl, I) of an expert the kernel can read as it lies; ValueError naming the bad tensor."""
    inter, dl = expert.gate.shape
    if dl % 16 or inter % 16 or dl <= 0 or inter <= 0:
        raise ValueError(f"expert widths must be positive multiples of 16, got Dl={dl}, I={inter}")
    _check_matrix(expert.gate, "gate", inter, dl)
    _check_matrix(expert.up, "up", inter, dl)
    _check_matrix(expert.down, "down", dl, inter)
    return dl, inter


def expert_ffn_rows(z: Tensor, expert: ExpertWeights, beta: float, linear_beta: float | None,
                    threads: int = 0, out: Tensor | None = None) -> Tensor:
    """z [m, Dl] fp32 -> down(SiTU-GLU(gate z, up z)) [m, Dl] fp32 (into `out` if given).

    beta = inf is SiLU; linear_beta None: no clamp on up. threads 0: OpenMP's default."""
    dl, inter = check_expert(expert)
    if z.dtype != torch.float32 or z.device.type != "cpu" or z.dim() != 2 or z.shape[1] != dl:
        raise ValueError(f"z: expected CPU float32 [m, {dl}], got {z.dtype} {tuple(z.shape)} on {z.device}")
    if not (beta > 0) or (linear_beta is not None and not (0 < linear_beta < math.inf)):
        raise ValueError(f"beta must be > 0 and linear_beta None or finite > 0, got {beta}, {linear_beta}")
    z = z.contiguous()
    m = z.shape[0]
    if out is None:
        out = torch.empty(m, dl, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (m, dl) or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous float32 [{m}, {dl}], got {out.dtype} {tuple(out.shape)}")
    if m == 0:
        return out
    zl = torch.empty(m, dl, dtype=torch.float32)  # [m, Dl] z in the kernel's lane order
    h = torch.empty(m, inter, dtype=torch.float32)  # [m, I] the GLU's output, lane order
    mats = [t.data_ptr() for w in (expert.gate, expert.up, expert.down)
            for t in (w.packed, w.scales, w.global_scale)]
    _entry()(z.data_ptr(), m, dl, inter, *mats, beta, linear_beta or 0.0, zl.data_ptr(), h.data_ptr(), out.data_ptr(),
             int(threads))
    return out
