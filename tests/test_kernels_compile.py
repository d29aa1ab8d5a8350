"""Every kernel program compiles with NVRTC to an sm_90 cubin (CPU only: NVRTC needs no GPU),
from the checkout's top-level `kernels/` and from the installed package (`kernel_dir()`).

Cubins come from the on-disk cache when this exact source + headers + options + NVRTC version
compiled before (the cache key covers all of them), so a changed kernel is always recompiled.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from streamrt.backends import cuda_compile as cc
from streamrt.backends.kernel_defines import DEFINES, defines

REPO = Path(__file__).resolve().parent.parent
CHECKOUT = REPO / "kernels"  # the sources as committed, whichever streamrt is imported


def _nvrtc_or_skip():
    try:
        return cc.nvrtc_version()
    except cc.NvrtcUnavailable as e:
        pytest.skip(f"NVRTC unavailable here: {e}")


PROGRAMS = cc.programs(CHECKOUT)


def test_kernel_programs_present():
    assert {"norms", "gemv", "nvfp4_moe", "kda", "attention", "topk"} <= set(PROGRAMS)
    assert (CHECKOUT / "common.cuh").is_file()


@pytest.mark.parametrize("program", PROGRAMS)
def test_program_compiles_to_sm90_cubin(program):
    """From the checkout's kernels/ (the cache key covers the source bytes, so a hit is this source)."""
    _nvrtc_or_skip()
    cubin = cc.compile_cubin(program, "sm_90", kdir=CHECKOUT)
    assert cubin[:4] == b"\x7fELF", "NVRTC output is not an ELF cubin"
    names = cc.kernel_names(program, CHECKOUT)
    assert names, f"{program}.cu declares no extern \"C\" kernels"
    for name in names:
        assert name.encode() + b"\0" in cubin, f"entry point {name} missing from the {program} cubin"


def test_kernel_dir_holds_the_checkout_kernels():
    """The imported package's kernel_dir() (the checkout's kernels/, or streamrt/_kernels in an
    installed wheel) holds every kernel source and header of the checkout, byte for byte."""
    kdir = cc.kernel_dir()
    assert kdir in (CHECKOUT, Path(cc.__file__).resolve().parent.parent / "_kernels")
    assert _sources(kdir) == _sources(CHECKOUT)


def _sources(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix in (".cu", ".cuh")}


_INSTALLED_CHECK = """
import json, streamrt
from pathlib import Path
from streamrt.backends import cuda_compile as cc
kdir = cc.kernel_dir()
compiled = []
for p in cc.programs():
    cubin = cc.compile_cubin(p, "sm_90")
    assert all(n.encode() + b"\\0" in cubin for n in cc.kernel_names(p)), p
    compiled.append(p)
print(json.dumps({"package": str(Path(streamrt.__file__).resolve().parent), "kernel_dir": str(kdir),
                  "include": cc.include_dirs()[0], "compiled": compiled}))
"""


def test_installed_package_kernels_compile(tmp_path):
    """The installed streamrt (`pip install .`: site-packages/streamrt/_kernels; `pip install -e .`:
    the checkout's kernels/), imported from outside the checkout, finds every kernel through
    kernel_dir() and NVRTC compiles each one there (a fresh cache: nothing is reused)."""
    _nvrtc_or_skip()
    try:
        importlib.metadata.distribution("streamrt")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("streamrt is not installed here (a plain checkout)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["STREAMRT_CACHE"] = str(tmp_path / "cache")
    r = subprocess.run([sys.executable, "-P", "-c", _INSTALLED_CHECK], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    kdir, package = Path(got["kernel_dir"]), Path(got["package"])
    if package != REPO / "streamrt":  # a wheel install: the kernels are package data
        assert kdir == package / "_kernels"
    assert got["include"] == str(kdir)
    assert _sources(kdir) == _sources(CHECKOUT), f"the installed kernels ({kdir}) differ from the checkout's: reinstall"
    assert got["compiled"] == PROGRAMS


def test_wheel_ships_every_package_and_the_kernels():
    """pyproject lists the packages (so kernels/ can map to streamrt._kernels): every folder of
    streamrt/ with an __init__.py must be listed, and the kernels must ship as package data."""
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    tree = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "streamrt").rglob("__init__.py")}
    assert set(conf["packages"]) == tree | {"streamrt._kernels"}
    assert conf["package-dir"] == {"streamrt._kernels": "kernels"}
    assert set(conf["package-data"]["streamrt._kernels"]) == {"*.cu", "*.cuh"}


@pytest.mark.parametrize("program", sorted(DEFINES))
def test_host_defines_are_required(program):
    """Each constant the host launches with reaches the kernel as -D: the source guards it with
    #ifndef / #error (no default to drift from), and leaving any one out stops the compile."""
    _nvrtc_or_skip()
    src = (CHECKOUT / f"{program}.cu").read_text()
    guarded = re.findall(r"^#ifndef (\w+)[^\n]*\n#error", src, flags=re.M)
    assert sorted(guarded) == sorted(DEFINES[program])
    assert not re.findall(r"^#define (" + "|".join(DEFINES[program]) + r")\b", src, flags=re.M)
    opts = cc.compile_options(program, "sm_90", (), CHECKOUT)
    for d in defines(program):
        name = d[2:].split("=")[0]
        with pytest.raises(cc.KernelCompileError, match=rf"#error directive: \"{name} is passed by the host"):
            cc.nvrtc_compile(src, f"{program}.cu", [o for o in opts if o != d])


def test_include_dirs_from_pathfinder():
    dirs = cc.include_dirs()
    assert dirs[0] == str(cc.kernel_dir())
    assert cc.include_dirs(CHECKOUT)[0] == str(CHECKOUT)
    pytest.importorskip("cuda.pathfinder")
    assert len(dirs) >= 2, "cuda.pathfinder found no CUDA header directory (cudart)"


def test_cache_key_tracks_arch_and_options():
    _nvrtc_or_skip()
    a = cc.cache_key("norms", "sm_90")
    assert a == cc.cache_key("norms", "sm_90")
    assert a != cc.cache_key("norms", "sm_89")
    assert a != cc.cache_key("norms", "sm_90", ("-lineinfo",))
    assert a != cc.cache_key("gemv", "sm_90")
    assert cc.cache_key("norms", "sm_90", ("-DATTNRES_MAXS=32",)) != a  # defines are options too


def test_cache_roundtrip(tmp_path, monkeypatch):
    _nvrtc_or_skip()
    monkeypatch.setenv("STREAMRT_CACHE", str(tmp_path))
    first = cc.compile_cubin("topk", "sm_90")
    files = list((tmp_path / "cubin").glob("topk-sm_90-*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == first
    assert cc.compile_cubin("topk", "sm_90") == first


def test_compile_error_carries_nvrtc_log():
    _nvrtc_or_skip()
    bad = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_symbol_xyz; }\n'
    with pytest.raises(cc.KernelCompileError, match="undefined_symbol_xyz"):
        cc.nvrtc_compile(bad, "broken.cu", ["--gpu-architecture=sm_90"])


def test_hot_kernels_do_not_spill():
    """The streaming kernels keep their working set in registers (no local-memory spills)."""
    _nvrtc_or_skip()
    log = cc.compile_log("nvfp4_moe", "sm_90", ("--ptxas-options=-v",))
    assert "Compiling entry function 'srt_nvfp4_gateup'" in log
    spills = [ln for ln in log.splitlines() if "spill" in ln and "0 bytes spill stores, 0 bytes spill loads" not in ln]
    assert not spills, "\n".join(spills)


def test_access_benchmark_source_compiles():
    """profiling/bench_access.py builds its read kernels from a source string: it compiles too."""
    _nvrtc_or_skip()
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "profiling" / "bench_access.py"
    spec = importlib.util.spec_from_file_location("bench_access", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cubin = cc.nvrtc_compile(mod.SOURCE, "bench_access.cu", cc.compile_options(None, "sm_90"))
    for pb, rw in mod.PATTERNS:
        assert f"read_{pb}_{rw}".encode() + b"\0" in cubin
