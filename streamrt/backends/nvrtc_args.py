"""Kernel arguments of the nvrtc backend: packing and the checks every op makes.

Packers (`ptr`, `i32`, `i64`, `f32`) return the argument's bytes as the kernel's C type holds
them (struct, little-endian); a struct passed by value (a pointer table) is its numpy array's
`tobytes()`. Checks: an activation is made fp32 and contiguous, a weight fp32
or bf16 and contiguous, a buffer updated in place must already have the kernel's dtype and
shape (a strided one goes through a contiguous copy the caller writes back).
"""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor


_U64, _I32, _I64, _F32 = (struct.Struct(f).pack for f in ("<Q", "<i", "<q", "<f"))


def ptr(t: Tensor | None) -> bytes:
    return _U64(0 if t is None else t.data_ptr())


def i32(v: int) -> bytes:
    try:
        return _I32(v)
    except struct.error:  # out of range, or not an int (a float is truncated, as int() does)
        if not -(2**31) <= int(v) < 2**31:
            raise ValueError(f"int argument {v} does not fit in int32") from None
        return _I32(int(v))


def i64(v: int) -> bytes:
    try:
        return _I64(v)
    except struct.error:
        return _I64(int(v))


def f32(v: float) -> bytes:
    try:
        return _F32(v)
    except OverflowError:  # beyond float32: its infinity, as a cast gives
        return _F32(math.copysign(math.inf, v))


def situ_args(beta: float, linear_beta: float | None) -> list[bytes]:
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


def as_rows(t: Tensor, name: str, device: torch.device) -> Tensor:
    """An fp32 activation whose last dim is dense, read in place with its other strides (a
    slice of a projection's output, such as q_nope of q); anything else as `as_act`."""
    if isinstance(t, Tensor) and t.device == device and t.dtype == torch.float32 and t.dim() and t.stride(-1) == 1:
        return t
    return as_act(t, name, device)


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
