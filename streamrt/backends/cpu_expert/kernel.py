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

import numpy as np
import torch
from torch import Tensor

from streamrt.backends.cpu_expert.build import load_library
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_F = ctypes.c_float


class _Job(ctypes.Structure):
    """srt_expert_job: one expert's weights, rows, scratch and output."""

    _fields_ = [("packed", _P * 3), ("scales", _P * 3), ("global_", _P * 3), ("z", _P), ("zl", _P), ("h", _P),
                ("out", _P), ("m", _I64)]


def bind(lib: ctypes.CDLL):
    """The library's `srt_cpu_experts_ffn` with its C signature."""
    fn = lib.srt_cpu_experts_ffn
    fn.argtypes = [_P, _I64, _I64, _I64, _F, _F, ctypes.c_int]  # the address of n _Job rows
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
    want = (("packed", (out, inp // 2), torch.uint8), ("scales", (out, inp // 16), torch.uint8),
            ("global_scale", (out,), torch.float32))
    for part, shape, dtype in want:
        t = getattr(m, part)
        if not (t.is_cpu and t.dtype is dtype and t.shape == shape and t.is_contiguous()):
            raise ValueError(
                f"{name}.{part}: expected a contiguous CPU {dtype} tensor of shape {shape}, got "
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
    return experts_ffn_rows([z], [expert], beta, linear_beta, threads, None if out is None else [out])[0]


def experts_ffn_rows(zs: list[Tensor], experts: list[ExpertWeights], beta: float, linear_beta: float | None,
                     threads: int = 0, outs: list[Tensor] | None = None) -> list[Tensor]:
    """Several experts of one layer in one call (one team of threads, one barrier): zs[k] [m_k, Dl]
    fp32 -> [m_k, Dl] fp32 each. A row's bits are those of `expert_ffn_rows` alone."""
    if len(zs) != len(experts) or (outs is not None and len(outs) != len(zs)):
        raise ValueError(f"zs, experts and outs must have one entry per expert, got {len(zs)}, {len(experts)}"
                         f"{'' if outs is None else f', {len(outs)}'}")
    if not (beta > 0) or (linear_beta is not None and not (0 < linear_beta < math.inf)):
        raise ValueError(f"beta must be > 0 and linear_beta None or finite > 0, got {beta}, {linear_beta}")
    shapes = [check_expert(ew) for ew in experts]
    if len(set(shapes)) > 1:
        raise ValueError(f"experts of one call must share (Dl, I), got {sorted(set(shapes))}")
    if not experts:
        return []
    dl, inter = shapes[0]
    results = [_rows_out(z, dl, None if outs is None else outs[k]) for k, z in enumerate(zs)]
    zcs = [z.contiguous() for z in zs]
    rows = sum(z.shape[0] for z in zcs)
    if rows:
        # one scratch tensor each for z in lane order and the GLU's output, shared by the experts
        zl, h = torch.empty(rows, dl, dtype=torch.float32), torch.empty(rows, inter, dtype=torch.float32)
        jobs = _job_table(zcs, experts, results, zl.data_ptr(), h.data_ptr(), dl, inter)
        _entry()(jobs.ctypes.data, len(jobs), dl, inter, beta, linear_beta or 0.0,
                 int(threads))
    return results


def _job_table(zs, experts, outs, zl: int, h: int, dl: int, inter: int) -> np.ndarray:
    """srt_expert_job rows (13 pointers and m, as _Job lays them out: 8 bytes each) for the experts
    with rows."""
    table = np.empty((len(zs), ctypes.sizeof(_Job) // 8), dtype=np.int64)
    n = 0
    for z, ew, out in zip(zs, experts, outs):
        m = z.shape[0]
        if m:
            mats = (ew.gate, ew.up, ew.down)
            table[n] = [*(w.packed.data_ptr() for w in mats), *(w.scales.data_ptr() for w in mats),
                        *(w.global_scale.data_ptr() for w in mats), z.data_ptr(), zl, h, out.data_ptr(), m]
            zl, h, n = zl + 4 * m * dl, h + 4 * m * inter, n + 1
    return table[:n]


def _rows_out(z: Tensor, dl: int, out: Tensor | None) -> Tensor:
    if z.dtype != torch.float32 or z.device.type != "cpu" or z.dim() != 2 or z.shape[1] != dl:
        raise ValueError(f"z: expected CPU float32 [m, {dl}], got {z.dtype} {tuple(z.shape)} on {z.device}")
    m = z.shape[0]
    if out is None:
        return torch.empty(m, dl, dtype=torch.float32)
    if out.dtype != torch.float32 or tuple(out.shape) != (m, dl) or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous float32 [{m}, {dl}], got {out.dtype} {tuple(out.shape)}")
    return out
