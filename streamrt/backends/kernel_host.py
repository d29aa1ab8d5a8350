"""What every op group of the nvrtc backend launches with: the device's properties, kernel
lookup and output allocation.

The backend is assembled from op groups (`nvrtc_linear.LinearOps`, `nvrtc_attention.AttentionOps`,
`nvrtc_moe.MoeOps`, the norms in `nvrtc.py`); each is a `KernelHost` and uses only what this
class sets and defines, plus its own state, which its `_init_*` method sets:

- `device`, `props` (`DeviceProps`): where the launches go and what sizes them;
- `pdl`: programmatic dependent launch (sm_90+). Each decode kernel lets the next one start at
  once and waits for the one before (pdl_begin, common.cuh), so a launch's ramp hides behind its
  predecessor; the tensor-core GEMV and gate+up kernels pull their first weight stages while
  they wait. False gives plain launches and the same bits;
- `_k(program, name)`: an entry point of `kernels/<program>.cu`, loaded on this device;
- `_empty(*shape, dtype)`: every output and scratch buffer (tests poison it to prove full writes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from streamrt.backends.cuda_driver import Kernel, kernel


@dataclass(frozen=True)
class DeviceProps:
    """The device properties the host side sizes launches with. No CUDA call reads them here:
    the host side alone runs on a CPU device given a GPU's properties."""

    device: torch.device
    capability: tuple[int, int]
    smem_optin: int  # shared memory a block may opt in to, bytes
    sms: int


class KernelHost:
    """The launch plumbing shared by the nvrtc backend's op groups (see the module doc)."""

    device: torch.device
    props: DeviceProps
    pdl: bool

    def _init_host(self, props: DeviceProps) -> None:
        self.props = props
        self.device = props.device
        self._dev = props.device.index or 0
        self.pdl = props.capability[0] >= 9

    def _k(self, program: str, name: str) -> Kernel:
        return kernel(program, name, self._dev)

    def _empty(self, *shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.empty(*shape, dtype=dtype, device=self.device)
