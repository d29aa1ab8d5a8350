"""Build the host CPU expert kernel (`nvfp4_expert.c`) on first use and cache the library.

Why this toolchain: a C file compiled by the system compiler the first time it is needed and
loaded with ctypes. A pip user on Linux has `cc` (gcc or clang) wherever torch's own CPU
extensions would build, and nothing else is required: no build step at install (the wheel stays
pure Python, like the CUDA kernels, which NVRTC compiles at run time), no numba or LLVM
version to pin, no torch C++ extension (which needs torch's headers, ninja, and a rebuild per
torch version). Compiling on the host with `-march=native` picks AVX-512, AVX2 or NEON for the
machine the runtime runs on; if that build fails, a portable `-O3` build is tried, then one
without OpenMP (single-threaded).

Cache: `$STREAMRT_CACHE/cpu` (default `~/.cache/streamrt/cpu`), beside the cubins, one library
per hash of (source, compiler and its version, flags, the CPU's feature flags). Written under a
temporary name and renamed, so concurrent processes never load a partial library.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from streamrt.backends.cuda_compile import cache_dir as cubin_cache_dir
from streamrt.errors import StreamrtError

SOURCE = Path(__file__).with_name("nvfp4_expert.c")
COMMON = ("-O3", "-ffp-contract=off", "-shared", "-fPIC", "-std=gnu11")
# Tried in order: the host's own ISA, then any CPU of this architecture, then without OpenMP.
VARIANTS = (("native", ("-march=native", "-fopenmp")), ("portable", ("-fopenmp",)), ("serial", ()))


class CpuKernelUnavailable(StreamrtError):
    """No C compiler, or every build of the CPU expert kernel failed."""


def compiler() -> str:
    """The C compiler: $CC, else cc, gcc or clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise CpuKernelUnavailable(
        "streamrt: CPU experts need a C compiler (cc, gcc or clang on PATH, or $CC); none was found"
    )


@functools.cache
def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_features() -> str:
    """The CPU's feature flags (/proc/cpuinfo), else the machine name: part of the cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cache_key(cc: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (cc, _compiler_version(cc), " ".join(flags), cpu_features()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:24]


def cache_dir() -> Path:
    return cubin_cache_dir().parent / "cpu"


def compile_to(cc: str, flags: tuple[str, ...], dest: Path, source: Path = SOURCE) -> str:
    """Compile `source` (the kernel's) to `dest` atomically; returns '' on success, else the
    compiler's error tail."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=dest.stem, suffix=".so.tmp", dir=dest.parent)
        os.close(fd)
    except OSError as e:
        return f"cache folder {dest.parent}: {e}"
    try:
        res = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True,
                             timeout=300)
        if res.returncode != 0:
            return (res.stderr or res.stdout).strip()[-2000:] or f"exit status {res.returncode}"
        os.replace(tmp, dest)
        return ""
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load_library() -> tuple[ctypes.CDLL, str]:
    """The kernel library and the build variant it is ('native', 'portable' or 'serial'),
    from the cache or compiled now."""
    cc = compiler()
    errors = []
    for variant, extra in VARIANTS:
        flags = (*COMMON, *extra)
        path = cache_dir() / f"nvfp4_expert-{variant}-{cache_key(cc, flags)}.so"
        if not path.is_file():
            err = compile_to(cc, flags, path)
            if err:
                errors.append(f"{variant}: {err.splitlines()[-1] if err else ''}")
                continue
        try:
            return ctypes.CDLL(str(path)), variant
        except OSError as e:
            errors.append(f"{variant}: {e}")
    raise CpuKernelUnavailable(f"streamrt: could not build the CPU expert kernel with {cc}: {'; '.join(errors)}")
