"""cuda-python driver plumbing for the nvrtc backend: context, modules, kernels, launches.

Cubins (`cuda_compile.compile_cubin`) are loaded with the driver API into torch's primary context
(cuDevicePrimaryCtxRetain + cuCtxSetCurrent) and launched on torch's current stream, so they
order with torch's own work and the caching allocator. A `Kernel` checks its argument sizes
against the driver's parameter info and launches plainly or programmatically (PDL, sm_90+).
No torch tensors here: arguments are each value's bytes as the kernel's C type holds them (`nvrtc_args`).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from streamrt.backends.cuda_compile import compile_cubin

SMEM_DEFAULT = 48 * 1024  # dynamic shared memory a block may use without opting in


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the CUDA error."""


@functools.cache
def driver():
    """cuda.bindings.driver, imported once (an import statement per launch shows in profiles)."""
    from cuda.bindings import driver as cu

    return cu


def check(res, what: str):
    """The value(s) of a driver call's result tuple; CudaError naming `what` if it failed."""
    cu = driver()
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
    cu = driver()
    check(cu.cuInit(0), "cuInit")
    dev = check(cu.cuDeviceGet(device_index), "cuDeviceGet")
    return check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")


_CURRENT = threading.local()  # the device whose primary context this thread made current


def make_current(device_index: int) -> None:
    """Make torch's primary context current on this thread (checked once per thread: torch and
    we both use the primary context, so nothing switches it behind our back)."""
    if getattr(_CURRENT, "device", None) == device_index:
        return
    cu = driver()
    ctx = _primary_context(device_index)
    cur = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if cur is None or _handle(cur) != _handle(ctx):
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    _CURRENT.device = device_index


def current_stream(device_index: int) -> int:
    """torch's current stream handle without building a torch.cuda.Stream object per launch."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return int(raw(device_index)) if raw is not None else torch.cuda.current_stream(device_index).cuda_stream


def device_arch(device_index: int) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


_LOCK = threading.Lock()


@functools.cache
def load_module(program: str, device_index: int):
    make_current(device_index)
    cubin = compile_cubin(program, device_arch(device_index))
    return check(driver().cuModuleLoadData(cubin), f"cuModuleLoadData({program})")


class Kernel:
    """One loaded entry point: checks its argument sizes once against the driver's param info."""

    def __init__(self, program: str, name: str, device_index: int, module=None):
        """`module`: a module loaded elsewhere (e.g. a benchmark's own source) instead of `program`'s."""
        mod = module if module is not None else load_module(program, device_index)
        fn = check(driver().cuModuleGetFunction(mod, name.encode()), f"cuModuleGetFunction({name})")
        self._configure(name, device_index, fn, _param_sizes(fn))

    def _configure(self, name: str, device_index: int, fn, param_sizes: list[int] | None) -> None:
        """Every field from the loaded function and its parameter sizes (None: the driver cannot
        say); no driver call (a launch's host side runs on a stand-in driver so)."""
        self.name, self.device_index, self.fn = name, device_index, fn
        self.param_sizes = param_sizes
        self._layout = param_layout(param_sizes) if param_sizes is not None else None
        self.smem_limit = SMEM_DEFAULT
        self._configs = {}  # programmatic launches: CUlaunchConfig by (grid, block, smem, stream)

    def set_smem_limit(self, smem: int) -> None:
        """Allow `smem` bytes of dynamic shared memory per block (above the 48 KiB default; the
        occupancy query needs it set too)."""
        attr = driver().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(driver().cuFuncSetAttribute(self.fn, attr, smem), f"cuFuncSetAttribute({self.name}, smem={smem})")
        self.smem_limit = smem

    def blocks_per_sm(self, threads: int, smem: int = 0) -> int:
        """Resident blocks per SM at this block size (the driver's occupancy calculator)."""
        n = check(
            driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(self.fn, threads, smem), f"occupancy({self.name})"
        )
        return max(1, int(n))

    def __call__(self, grid, block, args: list[bytes], smem: int = 0, stream=None, pdl: bool = False) -> None:
        """Launch on `stream` (torch's current one by default). pdl: programmatic dependent launch,
        the kernel may start before the kernel before it in the stream ends (it must call
        pdl_wait() before reading that kernel's output)."""
        cu = driver()
        sizes = list(map(len, args))
        if self.param_sizes is not None and sizes != self.param_sizes:
            raise CudaError(f"{self.name}: argument sizes {sizes} != kernel params {self.param_sizes}")
        make_current(self.device_index)
        if smem > self.smem_limit:
            self.set_smem_limit(smem)
        if stream is None:
            stream = current_stream(self.device_index)
        params, values = pack_params(args, self._layout or param_layout(sizes))  # both alive through the call
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
            res = cu.cuLaunchKernelEx(cfg, self.fn, ctypes.addressof(params), 0)
            if res[0] != cu.CUresult.CUDA_SUCCESS:  # the message is built only when it is needed
                check(res, f"cuLaunchKernelEx({self.name}, grid={grid}, block={block}, smem={smem}, programmatic)")
            return
        res = cu.cuLaunchKernel(self.fn, gx, gy, gz, bx, by, bz, smem, cu.CUstream(stream), ctypes.addressof(params), 0)
        if res[0] != cu.CUresult.CUDA_SUCCESS:
            check(res, f"cuLaunchKernel({self.name}, grid={grid}, block={block}, smem={smem})")


def _param_sizes(fn) -> list[int] | None:
    """The byte size of each of a kernel's parameters, from the driver (None where it cannot say)."""
    cu = driver()
    if not hasattr(cu, "cuFuncGetParamInfo"):
        return None
    sizes = []
    for i in range(256):
        res = cu.cuFuncGetParamInfo(fn, i)
        if res[0] != cu.CUresult.CUDA_SUCCESS:
            break
        sizes.append(int(res[2]))
    return sizes or None


def param_layout(sizes: list[int]) -> tuple[list[bytes], list[int]]:
    """Where each kernel argument's bytes go in a launch's one value buffer: the zero padding after
    each (every value starts 8-byte aligned) and each value's offset."""
    pads = [b"\0" * (-n % 8) for n in sizes]
    offsets, at = [], 0
    for n, pad in zip(sizes, pads):
        offsets.append(at)
        at += n + len(pad)
    return pads, offsets


def pack_params(args: list[bytes], layout: tuple[list[bytes], list[int]]):
    """The driver's kernelParams for `args`: (an array of pointers, one to each value; the buffer
    holding the values), both to be kept alive through the launch call. The values go side by side
    into one buffer, so one address is taken per launch, not one per argument."""
    pads, offsets = layout
    values = b"".join([a + pad for a, pad in zip(args, pads)])
    base = ctypes.cast(ctypes.c_char_p(values), ctypes.c_void_p).value
    return (ctypes.c_uint64 * len(offsets))(*[base + o for o in offsets]), values


@functools.cache
def _pdl_attr():
    """The launch attribute that lets a kernel overlap the one before it (sm_90+)."""
    cu = driver()
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    return attr


@functools.cache
def kernel(program: str, name: str, device_index: int) -> Kernel:
    """The entry point `name` of `kernels/<program>.cu` on a device, loaded once per process."""
    with _LOCK:
        return Kernel(program, name, device_index)
