"""Every kernel program compiles with NVRTC to an sm_90 cubin (CPU only: NVRTC needs no GPU).

Cubins come from the on-disk cache when this exact source + headers + options + NVRTC version
compiled before (the cache key covers all of them), so a changed kernel is always recompiled.
"""

from __future__ import annotations

import pytest

from streamrt.backends import cuda_compile as cc


def _nvrtc_or_skip():
    try:
        return cc.nvrtc_version()
    except cc.NvrtcUnavailable as e:
        pytest.skip(f"NVRTC unavailable here: {e}")


PROGRAMS = cc.programs()


def test_kernel_programs_present():
    assert {"norms", "gemv", "nvfp4_moe", "kda", "attention", "topk"} <= set(PROGRAMS)


@pytest.mark.parametrize("program", PROGRAMS)
def test_program_compiles_to_sm90_cubin(program):
    _nvrtc_or_skip()
    cubin = cc.compile_cubin(program, "sm_90")
    assert cubin[:4] == b"\x7fELF", "NVRTC output is not an ELF cubin"
    names = cc.kernel_names(program)
    assert names, f"{program}.cu declares no extern \"C\" kernels"
    for name in names:
        assert name.encode() + b"\0" in cubin, f"entry point {name} missing from the {program} cubin"


def test_include_dirs_from_pathfinder():
    dirs = cc.include_dirs()
    assert dirs[0] == str(cc.KERNEL_DIR)
    pytest.importorskip("cuda.pathfinder")
    assert len(dirs) >= 2, "cuda.pathfinder found no CUDA header directory (cudart)"


def test_cache_key_tracks_arch_and_options():
    _nvrtc_or_skip()
    a = cc.cache_key("norms", "sm_90")
    assert a == cc.cache_key("norms", "sm_90")
    assert a != cc.cache_key("norms", "sm_89")
    assert a != cc.cache_key("norms", "sm_90", ("-lineinfo",))
    assert a != cc.cache_key("gemv", "sm_90")


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
    cubin = cc.nvrtc_compile(mod.SOURCE, "bench_access.cu", cc._options("sm_90", ()))
    for pb, rw in mod.PATTERNS:
        assert f"read_{pb}_{rw}".encode() + b"\0" in cubin
