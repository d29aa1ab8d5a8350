"""One routed expert in NVFP4, as the model consumes it.

The tensors are views: of a CPU file mapping, of a pinned host buffer, or of a GPU slot.
Nothing here copies or dequantises.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class NVFP4Matrix:
    packed: Tensor  # uint8 [out, in/2]; low nibble = even element (E2M1)
    scales: Tensor  # uint8 [out, in/16]; E4M3 bits, one per 16 elements
    global_scale: Tensor  # float32 [out]

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2


@dataclass(frozen=True)
class ExpertWeights:
    gate: NVFP4Matrix  # w1 [I, Dl]
    up: NVFP4Matrix  # w3 [I, Dl]
    down: NVFP4Matrix  # w2 [Dl, I]
