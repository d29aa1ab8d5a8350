"""Kernel arguments of the nvrtc backend: packing and the checks every op makes.

Packers (`ptr`, `i32`, `i64`, `f32`) return a 1-element numpy array of the exact C type (the
driver passes its address). Checks: an activation is made fp32 and contiguous, a weight fp32
or bf16 and contiguous, a buffer updated in place must already have the kernel's dtype and
shape (a strided one goes through a contiguous copy the caller writes back).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor


def ptr(t: Tensor | None) -> np.ndarray:
    return np.array([0 if t is None else t.data_ptr()], dtype=np.uint64)


def i32(v: int) -> np.ndarray:
    if not -(2**31) <= int(v) < 2**31:
        raise ValueError(f"int argument {v} does not fit in int32")
    return np.array([int(v)], dtype=np.int32)


def i64(v: int) -> np.ndarray:
    return np.array([int(v)], dtype=np.int64)


def f32(v: float) -> np.ndarray:
    return np.array([v], dtype=np.float32)


def situ_args(beta: float, linear_beta: float | None) -> list[np.ndarray]:
    """The SiTU-GLU constants every kernel that applies it takes: beta (0 and a flag when
    infinite, i.e. plain SiLU), then linear_beta (1 and a flag when None, i.e. no up clamp)."""
    binf = math.isinf(beta)
    return [f32(0.0 if binf else beta), i32(binf), f32(1.0 if linear_beta is None else linear_beta),
            i32(linear_beta is not None)]


def as_act(t: Tensor, name: str, device: torch.device) -> Tensor:
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


def as_weight(t: Tensor, name: str, device: torch.device) -> tuple[Tensor, int]:
    """A weight, fp32 or bf16, contiguous, on `device` -> (tensor, is_bf16 flag)."""
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")
    if t.dtype not in (torch.float32, torch.bfloat16):
        t = t.float()
    return t.contiguous(), int(t.dtype == torch.bfloat16)


def inplace_buf(t: Tensor, name: str, device: torch.device, shape: tuple[int, ...]) -> Tensor:
    """The buffer a kernel updates in place: `t` itself when contiguous, else a contiguous copy
    the caller writes back with `t.copy_(buf)` after the launch."""
    if t.device != device or t.dtype != torch.float32 or tuple(t.shape) != shape:
        raise ValueError(
            f"{name}: updated in place, so it must be a float32 tensor of shape {shape} on {device}; "
            f"got {t.dtype} {tuple(t.shape)} on {t.device}"
        )
    return t if t.is_contiguous() else t.contiguous()


def aligned(t: Tensor, n: int) -> bool:
    return t.data_ptr() % n == 0


def block_threads(n: int, cap: int = 1024) -> int:
    """Threads per block for rows of n elements: the power of two at or above n, in 32..cap."""
    return max(32, min(cap, 1 << max(0, math.ceil(math.log2(max(1, n))))))
