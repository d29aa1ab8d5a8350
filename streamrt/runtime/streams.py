"""The device the runtime streams experts to: a copy stream, a compute stream, events.

`CudaDevice` wraps torch.cuda: a dedicated copy stream (non-blocking copies from page-locked
host memory), `torch.cuda.Event`s recorded on it (one per expert copy), the compute stream
(`torch.cuda.current_stream()`, where the model runs) waiting per event with `wait_event` —
a GPU-side wait, never a host synchronize. Host memory is page-locked in place with
`cudaHostRegister(..., cudaHostRegisterReadOnly)` so the DMA engine reads straight from the
page cache of a read-only file mapping.

`CpuDevice` is the same surface with synchronous copies and always-complete events, so CI runs
the scheduler's logic unchanged.

Every full synchronize goes through `synchronize()`, which counts it: the decode path must
never call it (`full_synchronizes == 0`); only the `--evict sync` failure mode does.

Nothing here is global: a device is constructed and passed in (scale-out keeps one per rank).
"""

from __future__ import annotations

import torch
from torch import Tensor

from streamrt.errors import StreamrtError

_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly / CU_MEMHOSTREGISTER_READ_ONLY


class DoneEvent:
    """The CPU twin's event: the work it marks already ran."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = DoneEvent()


class CpuDevice:
    kind = "cpu"
    copy_stream = None  # trace spans fall back to host time
    compute_stream = None

    def __init__(self) -> None:
        self.torch_device = torch.device("cpu")
        self.full_synchronizes = 0

    # events and ordering
    def record_copy_event(self) -> DoneEvent:
        return DONE

    def record_compute_event(self) -> DoneEvent:
        return DONE

    def compute_wait(self, event) -> None:
        pass

    def copy_wait(self, event) -> None:
        pass

    def synchronize(self) -> None:
        self.full_synchronizes += 1

    # memory
    def copy_h2d(self, dst: Tensor, src: Tensor, *, pinned: bool, transient: bool = False) -> None:
        dst.copy_(src)

    def alloc_slab(self, slots: int, slot_bytes: int) -> Tensor:
        return torch.empty((slots, slot_bytes), dtype=torch.uint8)

    def alloc_buffer(self, nbytes: int) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def alloc_host_arena(self, nbytes: int) -> tuple[Tensor, bool]:
        """The host pool's buffers, allocated once: page-aligned anonymous memory (so O_DIRECT
        reads land in it directly). Returns (uint8 tensor, page-locked?)."""
        return _anonymous_arena(nbytes), False

    def free_host_arena(self, t: Tensor, registered: bool) -> None:
        pass

    def host_register(self, t: Tensor) -> bool:
        return False

    def host_unregister(self, t: Tensor) -> None:
        pass

    def free_bytes(self) -> int | None:
        return None

    def thread_init(self) -> None:
        pass


class CudaDevice:
    kind = "cuda"

    def __init__(self, index: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise StreamrtError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
        self.index = torch.cuda.current_device() if index is None else index
        self.torch_device = torch.device("cuda", self.index)
        self.copy_stream = torch.cuda.Stream(device=self.torch_device)
        self.full_synchronizes = 0
        self._register = _host_register_fn()

    @property
    def compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.torch_device)

    # events and ordering
    def record_copy_event(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()  # no timing, non-blocking: 0.6 us to query
        ev.record(self.copy_stream)
        return ev

    def record_compute_event(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.compute_stream)
        return ev

    def compute_wait(self, event) -> None:
        """The compute stream waits (on the GPU) for `event`; the host does not block."""
        self.compute_stream.wait_event(event)

    def copy_wait(self, event) -> None:
        self.copy_stream.wait_event(event)

    def synchronize(self) -> None:
        self.full_synchronizes += 1
        torch.cuda.synchronize(self.torch_device)

    # memory
    def copy_h2d(self, dst: Tensor, src: Tensor, *, pinned: bool, transient: bool = False) -> None:
        """Queue dst <- src on the copy stream. From page-locked memory the copy is an async DMA;
        from pageable memory (`pinned=False`, the baseline) it is a blocking staged copy.
        A transient `dst` (allocated on the compute stream) is marked as used by the copy
        stream so the caching allocator cannot hand it out before the copy ran."""
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=pinned)
        if transient:
            dst.record_stream(self.copy_stream)

    def alloc_slab(self, slots: int, slot_bytes: int) -> Tensor:
        return torch.empty((slots, slot_bytes), dtype=torch.uint8, device=self.torch_device)

    def alloc_buffer(self, nbytes: int) -> Tensor:
        """On the compute stream: freed for reuse once the compute reading it is queued."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)

    def alloc_host_arena(self, nbytes: int) -> tuple[Tensor, bool]:
        """The host pool's buffers, allocated once: page-aligned anonymous memory page-locked
        with cudaHostRegister (torch's pinned allocator rounds up to a power of two, which would
        overshoot --host-mem by up to 2x). Copies from it are async DMA. Returns (tensor, locked)."""
        t = _anonymous_arena(nbytes)
        return t, self._register(t.data_ptr(), nbytes, 0)

    def free_host_arena(self, t: Tensor, registered: bool) -> None:
        if registered:
            _host_unregister(t.data_ptr())

    def host_register(self, t: Tensor) -> bool:
        """Page-lock a read-only host range in place. False when the driver refuses (the
        mapping then stays pageable and copies from it are staged by the driver)."""
        return self._register(t.data_ptr(), t.numel() * t.element_size(), _HOST_REGISTER_READ_ONLY)

    def host_unregister(self, t: Tensor) -> None:
        _host_unregister(t.data_ptr())

    def free_bytes(self) -> int | None:
        return torch.cuda.mem_get_info(self.torch_device)[0]

    def thread_init(self) -> None:
        """Worker threads register host memory: bind them to this device's primary context."""
        torch.cuda.set_device(self.torch_device)


def _anonymous_arena(nbytes: int) -> Tensor:
    """A writable uint8 tensor over a fresh anonymous mapping (page-aligned, zero-filled lazily)."""
    import mmap

    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mm, dtype=torch.uint8)  # holds the mapping alive


def make_device(name: str = "auto"):
    """`--device {auto,cpu,cuda}` -> CpuDevice | CudaDevice."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return CpuDevice()
    if name in ("cuda", "auto"):
        return CudaDevice()
    if name.startswith("cuda:") and name[5:].isdigit():
        return CudaDevice(int(name[5:]))
    raise StreamrtError(f"--device: expected auto, cpu, cuda or cuda:N, got {name!r}")


# ---- cudaHostRegister through cuda-python's runtime bindings (torch's cudart as fallback) ----


def _host_register_fn():
    try:
        from cuda.bindings import runtime as cudart

        def register(ptr: int, nbytes: int, flags: int) -> bool:
            (err,) = cudart.cudaHostRegister(ptr, nbytes, flags)
            if err != cudart.cudaError_t.cudaSuccess:
                cudart.cudaGetLastError()  # clear it: a stale error would surface in an unrelated call
                return False
            return True

        return register
    except ImportError:  # pragma: no cover - cuda-python is a dependency
        rt = torch.cuda.cudart()

        def register(ptr: int, nbytes: int, flags: int) -> bool:
            return int(rt.cudaHostRegister(ptr, nbytes, flags)) == 0

        return register


def _host_unregister(ptr: int) -> None:
    try:
        from cuda.bindings import runtime as cudart

        cudart.cudaHostUnregister(ptr)
    except ImportError:  # pragma: no cover
        torch.cuda.cudart().cudaHostUnregister(ptr)
