"""Compile streamrt's CUDA kernels with NVRTC (cuda.bindings) into cubins, with a disk cache.

Every `kernels/*.cu` (the repository's top-level `kernels/`, shipped in the wheel as
`streamrt/_kernels`; `kernel_dir()`) is one NVRTC program; `common.cuh` is shared through `-I`,
and the geometry the host launches with comes as `-D` defines (`kernel_defines.py`).
Compilation needs no GPU (CI compiles every kernel for sm_90 on a CPU machine, from the
checkout and from the installed package); loading and launching is `backends/cuda_driver.py`'s.

Headers: NVRTC searches no directory by default, and NVRTC 13.0 on the GPU machine ships no
bundled headers, so the include path comes from cuda.pathfinder (`cudart` and `cccl`
header directories; spec CUDA_PYTHON.md 2.5). The kernels themselves need no CUDA header.

Cache: `$STREAMRT_CACHE/cubin` (default `~/.cache/streamrt/cubin`), one file per
(program source + shared headers, arch, options and defines, NVRTC version) hash. Writes are atomic
(temp file + rename), so concurrent processes never see a partial cubin.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

from streamrt.backends.kernel_defines import defines
from streamrt.errors import CheckpointError, StreamrtError
from streamrt.fileio import atomic_write

BASE_OPTIONS = ("--std=c++17", "-default-device")


class KernelCompileError(StreamrtError):
    """NVRTC rejected a kernel source; the message carries the NVRTC log."""


class NvrtcUnavailable(StreamrtError):
    """NVRTC (cuda.bindings + the nvrtc library) cannot be loaded here."""


@functools.cache
def kernel_dir() -> Path:
    """Where the kernel sources are: `streamrt/_kernels` in an installed wheel (package data
    mapped from the top-level `kernels/`), else `kernels/` beside the package (an editable
    install or a source checkout)."""
    package = Path(__file__).resolve().parent.parent
    for d in (package / "_kernels", package.parent / "kernels"):
        if (d / "common.cuh").is_file():
            return d
    raise KernelCompileError(
        f"no kernel sources: neither {package / '_kernels'} nor {package.parent / 'kernels'} holds common.cuh"
    )


def programs(kdir: Path | None = None) -> list[str]:
    """Names of the kernel programs (`<name>.cu` in `kdir`, default `kernel_dir()`)."""
    return sorted(p.stem for p in (kdir or kernel_dir()).glob("*.cu"))


def kernel_names(program: str, kdir: Path | None = None) -> list[str]:
    """The `extern "C"` __global__ entry points declared in a program (by source scan)."""
    src = _source(program, kdir)
    pat = r'extern "C" __global__ void(?:[\s\\]+__launch_bounds__\([^)]*\))?[\s\\]+(\w+)\s*\('
    names = [n for n in re.findall(pat, src) if not n.isupper()]  # upper case: parameters of entry macros
    for args in re.findall(r"^SRT_\w+_ENTRY\(([^)]*)\)", src, flags=re.M):  # entry-macro uses
        names += [a.strip() for a in args.split(",") if a.strip().startswith("srt_")]
    return names


def _source(program: str, kdir: Path | None = None) -> str:
    path = (kdir or kernel_dir()) / f"{program}.cu"
    if not path.is_file():
        raise KernelCompileError(f"no kernel program {program!r} ({path} does not exist)")
    return path.read_text()


def _headers_digest(kdir: Path | None = None) -> bytes:
    h = hashlib.sha256()
    for p in sorted((kdir or kernel_dir()).glob("*.cuh")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.digest()


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except Exception as e:  # ImportError, or the library failing to load
        raise NvrtcUnavailable(f"cuda.bindings.nvrtc is not importable: {e}") from e
    return nvrtc


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as e:  # the shared library itself is missing
        raise NvrtcUnavailable(f"libnvrtc cannot be loaded: {e}") from e
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcUnavailable(f"nvrtcVersion failed: {err.name}")
    return int(major), int(minor)


def include_dirs(kdir: Path | None = None) -> tuple[str, ...]:
    """The kernel folder, then cuda.pathfinder's cudart and cccl header directories (those found)."""
    return (str(kdir or kernel_dir()), *_cuda_header_dirs())


@functools.cache
def _cuda_header_dirs() -> tuple[str, ...]:
    dirs: list[str] = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return tuple(dirs)
    for lib in ("cudart", "cccl"):
        try:
            d = find_nvidia_header_directory(lib)
        except Exception:
            d = None
        if d and d not in dirs:
            dirs.append(str(d))
    return tuple(dirs)


def cache_dir() -> Path:
    root = os.environ.get("STREAMRT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "streamrt")
    return Path(root) / "cubin"


def compile_options(program: str | None, arch: str = "sm_90", extra: tuple[str, ...] = (),
                    kdir: Path | None = None) -> list[str]:
    """NVRTC options: arch, the base options, `program`'s -D defines, `extra`, include paths
    (`kdir` first). profiling/sass_diff.py compiles with these too."""
    return [f"--gpu-architecture={arch}", *BASE_OPTIONS, *defines(program), *extra] + [
        f"-I{d}" for d in include_dirs(kdir)
    ]


def cache_key(program: str, arch: str, extra_options: tuple[str, ...] = (), kdir: Path | None = None) -> str:
    """Hash of the source, the shared headers, arch, options and defines (not include paths) and
    NVRTC version."""
    h = hashlib.sha256()
    h.update(_source(program, kdir).encode())
    h.update(_headers_digest(kdir))
    h.update(arch.encode())
    h.update("\0".join((*BASE_OPTIONS, *defines(program), *extra_options)).encode())
    h.update(("nvrtc-%d.%d" % nvrtc_version()).encode())
    return h.hexdigest()[:24]


def compile_cubin(
    program: str,
    arch: str = "sm_90",
    extra_options: tuple[str, ...] = (),
    use_cache: bool = True,
    kdir: Path | None = None,
) -> bytes:
    """The cubin of `<kdir>/<program>.cu` (default `kernel_dir()`) for `arch` (e.g. "sm_90"),
    from the cache or NVRTC."""
    if not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise KernelCompileError(f"arch must look like 'sm_90', got {arch!r}")
    key = cache_key(program, arch, extra_options, kdir)
    path = cache_dir() / f"{program}-{arch}-{key}.cubin"
    if use_cache and path.is_file():
        data = path.read_bytes()
        if data[:4] == b"\x7fELF":
            return data
    data = nvrtc_compile(_source(program, kdir), f"{program}.cu", compile_options(program, arch, extra_options, kdir))
    if use_cache:
        try:
            atomic_write(path, data)
        except CheckpointError:
            pass  # a read-only cache is not an error: we just compile again next time
    return data


def nvrtc_compile(source: str, name: str, options: list[str]) -> bytes:
    """Compile one source to a cubin; raise KernelCompileError with the NVRTC log on failure."""
    nvrtc = _nvrtc()
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS

    def ck(res, what):
        err = res[0]
        if err != ok:
            raise KernelCompileError(f"{what} failed for {name}: {err.name}")
        return res[1] if len(res) == 2 else res[1:]

    prog = ck(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = _log(nvrtc, prog)
        if err != ok:
            raise KernelCompileError(
                f"NVRTC could not compile {name} ({err.name}; options {' '.join(options)}):\n{log.strip()}"
            )
        size = ck(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        buf = b" " * size
        ck(nvrtc.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        return buf
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_log(program: str, arch: str = "sm_90", extra_options: tuple[str, ...] = ()) -> str:
    """Compile without the cache and return NVRTC's log (e.g. with --ptxas-options=-v)."""
    nvrtc = _nvrtc()
    opts = [o.encode() for o in compile_options(program, arch, extra_options)]
    err, prog = nvrtc.nvrtcCreateProgram(_source(program).encode(), f"{program}.cu".encode(), 0, [], [])
    try:
        nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        return _log(nvrtc, prog)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _log(nvrtc, prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\0").decode(errors="replace")
