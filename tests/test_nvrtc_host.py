"""Host-side logic of the nvrtc backend's expert FFN, on the CPU: launches are recorded, not run.

What is checked here is what the GPU tests cannot isolate: which pointers reach the kernels when
an expert's checked pointers are reused across calls, and that a bad expert is still refused.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from streamrt.backends import nvrtc as nvm
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix

DL, I, K = 256, 384, 4


def _mat(rows, cols):
    return NVFP4Matrix(torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8),
                       torch.randint(0, 256, (rows, cols // 16), dtype=torch.uint8), torch.rand(rows))


def _expert():
    return ExpertWeights(_mat(I, DL), _mat(I, DL), _mat(DL, I))


class _Recorder:
    """Stands in for a loaded kernel: keeps each launch's kernel name and gate+up table."""

    def __init__(self, launches, name):
        self.launches, self.name = launches, name

    def __call__(self, grid, block, args, smem=0, stream=None, pdl=False):
        self.launches.append((self.name, args[0].copy() if "gateup" in self.name else [int(a.ravel()[0]) for a in args[1:]]))


def _backend(launches):
    nv = object.__new__(nvm.NvrtcBackend)  # no CUDA device: only the host side runs
    nv.device, nv._dev, nv.nvfp4_impl, nv.tc_shape = torch.device("cpu"), 0, "tc", nvm.TC_SHAPE
    nv.pdl, nv.pair_ready, nv._ready, nv._ptr_cache = True, True, None, {}
    nv._k = lambda program, name: _Recorder(launches, name)
    return nv


def _gate_ptrs(table):
    """The gate packed pointers of a recorded GateUpTable (the first 64 u64)."""
    return table.view(np.uint64)[: nvm.MOE_MAXP]


def test_expert_pointers_follow_the_views_across_calls():
    launches = []
    nv = _backend(launches)
    ids, w, z = torch.arange(K).view(1, K), torch.rand(1, K), torch.randn(1, DL)
    experts = {e: _expert() for e in range(K)}
    nv.expert_ffn(z, ids, w, experts, 4.0, 25.0)
    first = _gate_ptrs(launches[0][1])[:K].tolist()
    assert first == [experts[e].gate.packed.data_ptr() for e in range(K)]
    experts[2] = _expert()  # a slot now holds another expert: new views
    gc.collect()
    launches.clear()
    nv.expert_ffn(z, ids, w, experts, 4.0, 25.0)
    assert _gate_ptrs(launches[0][1])[:K].tolist() == [experts[e].gate.packed.data_ptr() for e in range(K)]
    assert [n for n, _ in launches] == ["srt_nvfp4_gateup_tc2x2", "srt_nvfp4_down_tc2x2", "srt_moe_combine"]


def test_bad_expert_is_refused_after_good_ones_were_seen():
    nv = _backend([])
    ids, w, z = torch.arange(K).view(1, K), torch.rand(1, K), torch.randn(1, DL)
    experts = {e: _expert() for e in range(K)}
    nv.expert_ffn(z, ids, w, experts, 4.0, 25.0)
    bad = ExpertWeights(_mat(I, DL), _mat(I, DL), NVFP4Matrix(torch.zeros(DL, I // 2, dtype=torch.int8),
                                                               torch.zeros(DL, I // 16, dtype=torch.uint8), torch.rand(DL)))
    experts[1] = bad
    with pytest.raises(ValueError, match=r"expert 1 down\.packed"):
        nv.expert_ffn(z, ids, w, experts, 4.0, 25.0)
    with pytest.raises(ValueError, match=r"expert 1 down\.packed"):  # and again: a refusal is not remembered as a pass
        nv.expert_ffn(z, ids, w, experts, 4.0, 25.0)


def test_counts_only_where_the_sum_can_zero_them():
    """The weighted sum zeroes the per-pair counts with its first T * k of T * Dl threads: with
    more experts per token than Dl, the down blocks wait for the whole gate+up grid instead."""
    def ready_ptrs(k, dl, i):
        launches = []
        nv = _backend(launches)
        experts = {e: ExpertWeights(_mat(i, dl), _mat(i, dl), _mat(dl, i)) for e in range(k)}
        nv.expert_ffn(torch.randn(1, dl), torch.arange(k).view(1, k), torch.rand(1, k), experts, 4.0, 25.0)
        return [args[4] for name, args in launches if "down" in name], [args[5] for name, args in launches if "combine" in name]

    down, combine = ready_ptrs(4, 128, 128)
    assert all(down) and all(combine)
    down, combine = ready_ptrs(129, 128, 128)  # 129 pairs: three launches of up to 64
    assert len(down) == 3 and not any(down) and not any(combine)


def test_counts_zeroed_when_a_launch_fails_midway():
    """A gate+up launch counted into the per-pair counts and the down launch after it failed:
    the sum that zeroes them will not run, so the call zeroes them before raising."""
    launches = []
    nv = _backend(launches)

    class Failing(_Recorder):
        def __call__(self, grid, block, args, smem=0, stream=None, pdl=False):
            if "gateup" in self.name:
                nv._ready[:K] += grid[0]  # what the blocks would count
            elif "down" in self.name:
                raise nvm.CudaError(f"{self.name}: launch failed")

    nv._k = lambda program, name: Failing(launches, name)
    experts = {e: _expert() for e in range(K)}
    with pytest.raises(nvm.CudaError, match="launch failed"):
        nv.expert_ffn(torch.randn(1, DL), torch.arange(K).view(1, K), torch.rand(1, K), experts, 4.0, 25.0)
    assert int(nv._ready.abs().sum()) == 0
