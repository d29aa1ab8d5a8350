"""Host-side logic of the nvrtc backend's expert FFN, on the CPU: launches are recorded, not run.

What is checked here is what the GPU tests cannot isolate: which pointers reach the kernels when
an expert's checked pointers are reused across calls, and that a bad expert is still refused.
"""

from __future__ import annotations

import ctypes
import gc
import struct

import numpy as np
import pytest
import torch

from streamrt.backends import nvrtc as nvm
from streamrt.backends.expert_pointers import ExpertPointers, scales_aligned8, tables
from streamrt.backends.kernel_defines import MOE_MAXP_DT
from streamrt.backends.nvrtc_moe import most_groups
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix, ResidentExperts

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
        self.launches.append(
            (self.name, np.frombuffer(args[0], np.uint8) if "gateup" in self.name else [_int(a) for a in args[1:]])
        )


def _int(arg: bytes) -> int:
    """A pointer (8 bytes) or int32 (4 bytes) launch argument's value."""
    return struct.unpack("<Q" if len(arg) == 8 else "<i", arg)[0]


def _host_backend(capability=(9, 0), smem_optin=227 * 1024):
    """The backend's host side on the CPU, with an H200's properties (no CUDA device)."""
    nv = object.__new__(nvm.NvrtcBackend)
    nv._configure(nvm.DeviceProps(torch.device("cpu"), capability, smem_optin, 132), 64)
    return nv


def _backend(launches):
    nv = _host_backend()
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


def test_tables_put_each_pointer_where_the_kernel_structs_have_it():
    """GateUpTable (nvfp4_moe.cu): gate packed / scales / global, up packed / scales / global (64
    u64 each), then row and dst (64 int32 each); DownTable: down packed / scales / global, dst."""
    M = nvm.MOE_MAXP
    pe = ExpertPointers(*range(8, 80, 8), 384)
    g, d = tables([(5, 2, 7)], {7: pe})
    assert g[: 6 * M * 8].view(np.uint64).reshape(6, M)[:, 0].tolist() == [
        pe.gate_packed, pe.gate_scales, pe.gate_global, pe.up_packed, pe.up_scales, pe.up_global]
    assert g[6 * M * 8 :].view(np.int32).reshape(2, M)[:, 0].tolist() == [2, 5]
    assert d[: 3 * M * 8].view(np.uint64).reshape(3, M)[:, 0].tolist() == [
        pe.down_packed,
        pe.down_scales,
        pe.down_global,
    ]
    assert int(d[3 * M * 8 :].view(np.int32)[0]) == 5
    assert scales_aligned8([(0, 0, 7)], {7: pe})
    assert not scales_aligned8([(0, 0, 7)], {7: pe._replace(up_scales=pe.up_scales + 4)})


def test_bad_expert_is_refused_after_good_ones_were_seen():
    nv = _backend([])
    ids, w, z = torch.arange(K).view(1, K), torch.rand(1, K), torch.randn(1, DL)
    experts = {e: _expert() for e in range(K)}
    nv.expert_ffn(z, ids, w, experts, 4.0, 25.0)
    bad = ExpertWeights(
        _mat(I, DL),
        _mat(I, DL),
        NVFP4Matrix(
            torch.zeros(DL, I // 2, dtype=torch.int8), torch.zeros(DL, I // 16, dtype=torch.uint8), torch.rand(DL)
        ),
    )
    experts[1] = bad
    with pytest.raises(ValueError, match=r"expert 1 down\.packed"):
        nv.expert_ffn(z, ids, w, experts, 4.0, 25.0)
    with pytest.raises(ValueError, match=r"expert 1 down\.packed"):  # and again: a refusal is not remembered as a pass
        nv.expert_ffn(z, ids, w, experts, 4.0, 25.0)


def test_router_launch_shared_memory_and_its_limit():
    """The router kernel's shared memory: per expert its score, key and candidate slot (12
    bytes), per 32 experts a chunk maximum; past 48 KiB (E > 4053) a clear refusal, not a
    failed launch."""
    launches = []
    nv = _backend(launches)
    smems = []
    nv._k = lambda program, name: (
        lambda grid, block, args, smem=0, stream=None, pdl=False: smems.append((name, grid, smem))
    )
    for E in (24, 896, 4053):
        ids, wts = nv.route(torch.randn(3, E), torch.randn(E), 16, True, 2.5)
        assert ids.shape == wts.shape == (3, 16)
    assert smems == [("srt_router_topk", (3,), E * 12 + -(-E // 32) * 4) for E in (24, 896, 4053)]
    with pytest.raises(ValueError, match="E=4054"):
        nv.route(torch.randn(1, 4054), torch.randn(4054), 16, True, 2.5)


def test_counts_only_where_the_sum_can_zero_them():
    """The weighted sum zeroes the per-pair counts with its first T * k of T * Dl threads: with
    more experts per token than Dl, the down blocks wait for the whole gate+up grid instead."""
    def ready_ptrs(k, dl, i):
        launches = []
        nv = _backend(launches)
        experts = {e: ExpertWeights(_mat(i, dl), _mat(i, dl), _mat(dl, i)) for e in range(k)}
        nv.expert_ffn(torch.randn(1, dl), torch.arange(k).view(1, k), torch.rand(1, k), experts, 4.0, 25.0)
        return [args[4] for name, args in launches if "down" in name], [
            args[5] for name, args in launches if "combine" in name
        ]

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


def _ffn_launches(nv, T, k, E, dl, i):
    """(name, grid, block, smem, 4-byte args read as int32: the tests read the int tail, past the
    SiTU floats) of each launch of one expert-FFN call."""
    launches = []

    def rec(program, name):
        def launch(grid, block, args, smem=0, stream=None, pdl=False):
            ints = [struct.unpack("<i", a)[0] for a in args if len(a) == 4]
            launches.append((name, tuple(grid), tuple(block), smem, ints))
        return launch

    nv._k = rec
    g = torch.Generator().manual_seed(T)
    experts = {e: ExpertWeights(_mat(i, dl), _mat(i, dl), _mat(dl, i)) for e in range(E)}
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    nv.expert_ffn(torch.randn(T, dl), ids, torch.rand(T, k), experts, 4.0, 25.0)
    return launches


def test_tensor_core_blocks_below_eight_rows():
    """Up to 7 rows a tensor-core block takes up to min(8, T) rows of an expert, stages their
    activation itself and runs 8 warps of gate+up and 7 of down, each with a ring of two
    two-block stages (the 2x2 kernels). deep-k3.1-pro's expert shape: gate+up over 3584
    columns, down over 3072; a staged row is 2 x 2,256 words (2,240 and a pad of 16), a stage
    32 x 64 bytes of weights and 32 x 8 of scales."""
    nv = _backend([])
    ring = 2 * 2 * (32 * 64 + 32 * 8)
    for T in (1, 4, 7):
        cap = min(8, T)
        (gu, gu_grid, gu_block, gu_smem, gu_ints), (dn, dn_grid, dn_block, dn_smem, dn_ints), _ = \
            _ffn_launches(nv, T, 4, 6, 3584, 3072)
        assert (gu, dn) == ("srt_nvfp4_gateup_tc2x2", "srt_nvfp4_down_tc2x2")
        assert gu_block == (8 * 32,) and dn_block == (7 * 32,)
        assert gu_grid == (-(-3072 // (16 * 8)), T * 4) and dn_grid == (-(-3584 // (32 * 7)), T * 4)
        assert gu_smem == cap * 8 * 2256 + 8 * ring
        assert dn_smem == cap * 8 * (96 * 20 + 16) + 7 * ring
        assert gu_smem + 32 * 8 * 4 <= 227 * 1024 and dn_smem + 32 * 8 * 4 <= 227 * 1024
        assert gu_ints[-1] == cap  # the most rows of one expert a block takes
        assert dn_ints[-3:] == [gu_grid[0], cap, cap]  # a down block waits for its group's gate+up blocks


def test_staged_rows_from_eight_rows():
    """From 8 rows on (TC_STAGED_SHAPE (12, 4, 2, 1)): z's rows staged once per call
    (srt_moe_stage_rows: a block a row and one for the zero row T), gate+up over them in blocks of
    12 warps of 16 rows with a ring of two one-block stages and nothing else in shared memory,
    groups of up to 16 pairs; then h's rows (all P) staged the same way and down over them in
    blocks of 4 warps of 32 rows, gate+up's groups. Up to 7 rows: no staging."""
    nv = _backend([])
    stage = 32 * 64 + 32 * 8
    for T in (8, 16):
        P = T * 4
        launches = _ffn_launches(nv, T, 4, 6, 3584, 3072)
        assert [n for n, *_ in launches] == ["srt_moe_stage_rows", "srt_nvfp4_gateup_st2x1", "srt_moe_stage_rows",
                                             "srt_nvfp4_down_st2x1", "srt_moe_combine"]
        (_, z_grid, z_block, _, z_ints), (_, gu_grid, gu_block, gu_smem, gu_ints), (_, h_grid, _, _, h_ints), \
            (_, dn_grid, dn_block, dn_smem, dn_ints), _ = launches
        assert z_grid == (T + 1,) and z_block == (256,) and z_ints == [T, 3584]
        assert h_grid == (P + 1,) and h_ints == [P, 3072]
        assert gu_grid == (3072 // (16 * 12), P) and gu_block == (12 * 32,) and gu_smem == 12 * 2 * stage
        assert gu_ints[:3] == [T, 3072, 3584] and gu_ints[-1] == 16  # the zero row, I, Dl ... the group cap
        assert dn_grid == (3584 // (32 * 4), P) and dn_block == (4 * 32,) and dn_smem == 4 * 2 * stage
        assert dn_ints == [P, 3584, 3072, 16]  # the zero row of h, Dl, I, the group cap
    assert [n for n, *_ in _ffn_launches(nv, 7, 4, 6, 3584, 3072)][:2] == [
        "srt_nvfp4_gateup_tc2x2",
        "srt_nvfp4_down_tc2x2",
    ]


def _table_launches(nv, T, k, E, dl, i):
    """expert_ffn's launches (as _ffn_launches) on the device-table path: every expert resident,
    the router's ids on the device (a CUDA graph's step)."""
    launches = []

    def rec(program, name):
        def launch(grid, block, args, smem=0, stream=None, pdl=False):
            ints = [struct.unpack("<i", a)[0] for a in args if len(a) == 4]
            launches.append((name, tuple(grid), tuple(block), smem, ints, len(args)))
        return launch

    nv._k = rec
    g = torch.Generator().manual_seed(T + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    experts = ResidentExperts({}, torch.zeros(E, 9, dtype=torch.int64), i, ids)
    nv.expert_ffn(torch.randn(T, dl), experts.ids, torch.rand(T, k), experts, 4.0, 25.0)
    return launches


def test_device_tables_list_the_staged_groups():
    """On the device-table path (a CUDA graph's step) from 8 rows on, srt_moe_tables also lists
    the groups of up to 16 pairs (one block of MOE_MAXP_DT threads), and the staged gate+up and
    down grids hold a block row per group there can be (most_groups), not one per pair, the
    list their last argument. Fewer rows: no list, a block row per pair, a block of threads for
    the pairs. deep-k3.1-pro's shape: 16 of 24 experts, 3584 x 3072."""
    nv = _host_backend()
    launches = _table_launches(nv, 16, 16, 24, 3584, 3072)
    assert [n for n, *_ in launches] == ["srt_moe_stage_rows", "srt_moe_tables", "srt_nvfp4_gateup_st2x1_dt",
                                         "srt_moe_stage_rows", "srt_nvfp4_down_st2x1_dt", "srt_moe_combine"]
    _, tab_grid, tab_block, _, tab_ints, _ = launches[1]
    assert tab_grid == (1,) and tab_block == (MOE_MAXP_DT,) and tab_ints == [256, 16, 16]  # P, k, the cap
    (_, gu_grid, _, _, _, gu_args), (_, dn_grid, _, _, _, dn_args) = launches[2], launches[4]
    assert gu_grid == (3072 // (16 * 12), 24 + (256 - 24) // 16) and dn_grid == (3584 // (32 * 4), 38)
    assert (gu_args, dn_args) == (14, 9)  # the list follows the group cap
    launches = _table_launches(nv, 4, 16, 24, 3584, 3072)
    assert [n for n, *_ in launches][:3] == ["srt_moe_tables", "srt_nvfp4_gateup_tc2x2_dt", "srt_nvfp4_down_tc2x2_dt"]
    assert launches[0][1:3] == ((1,), (64,)) and launches[1][1][1] == 64


def test_most_groups_bounds_every_routing():
    """most_groups(P, E, cap) is at least the groups any P pairs over E experts make (each
    expert's run cut every cap pairs; counted by hand), and some routing makes exactly that many."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        E, cap = int(rng.integers(1, 40)), int(rng.integers(1, 20))
        P = int(rng.integers(1, 400))
        skew = rng.random() < 0.5
        p = rng.dirichlet(np.full(E, 0.2 if skew else 5.0))
        counts = np.bincount(rng.choice(E, size=P, p=p), minlength=E)
        made = sum(-(-int(n) // cap) for n in counts)
        assert made <= most_groups(P, E, cap), (P, E, cap, counts)
    for P, E, cap in ((256, 24, 16), (5, 24, 16), (1000, 3, 7)):
        worst = [1] * (min(E, P) - 1) + [P - min(E, P) + 1]  # all but one expert a single pair
        assert sum(-(-n // cap) for n in worst) == most_groups(P, E, cap)


# ---- dense GEMV: which kernel, grid, K split and shared memory a call gets -------------------


def _gemv_mats(table: np.ndarray) -> list[tuple[int, int, int, int, int, int]]:
    """The GemvMats table of a tensor-core GEMV launch (kernels/gemv.cu), written out by hand:
    per matrix (w, out, add0, add1) addresses, then n[8], block0[9], m as int32."""
    addr = table[:32].reshape(4, 8)
    ints = table[32:].view(np.int32)
    m = int(ints[17])
    return [(*(int(a) for a in addr[:, i]), int(ints[i]), int(ints[8 + i])) for i in range(m)] + [int(ints[8 + m])]


class _GemvRecorder:
    """Stands in for a GEMV kernel: keeps (name, grid, block, smem, int args, matrix table).
    Weights are torch.empty: only shapes and pointers reach the host logic. A tensor-core
    launch's int args read T, then each matrix's N from its table, then K and the K split."""

    def __init__(self, launches, name):
        self.launches, self.name = launches, name

    def __call__(self, grid, block, args, smem=0, stream=None, pdl=False):
        ints = [struct.unpack("<i", a)[0] for a in args if len(a) == 4]  # a GEMV takes no float
        mats = _gemv_mats(np.frombuffer(args[0], np.uint64)) if len(args[0]) == 41 * 8 else None
        if mats is not None:
            ints = ints[:1] + [m[4] for m in mats[:-1]] + ints[1:]
        self.launches.append((self.name, tuple(grid), tuple(block), smem, ints, mats))

    def blocks_per_sm(self, threads, smem=0):
        return 16


def _gemv_backend(launches, mma=True, smem_optin=227 * 1024):
    nv = _host_backend((9, 0) if mma else (7, 5), smem_optin)
    nv.pdl = True
    nv._k = lambda program, name: _GemvRecorder(launches, name)
    return nv


def test_gemv_tensor_core_launch_shape():
    launches = []
    nv = _gemv_backend(launches)
    w = torch.empty(7168, 12288, dtype=torch.bfloat16)
    nv.linear(torch.randn(8, 12288), w)
    (name, grid, block, smem, ints, _), = launches
    assert name == "srt_gemv_tc_xf32_s2" and grid == (224,) and block == (128,)
    assert ints == [8, 7168, 12288, 4]  # T, N, K, K split (N <= 8192: 4 warps per 32 rows)
    assert smem == 4 * 2 * (32 * 128 * 2 + 8 * 128 * 4) + 3 * 8 * 32 * 4
    launches.clear()
    nv.linear(torch.empty(1, 12288, dtype=torch.bfloat16), w)
    assert (
        launches[0][0] == "srt_gemv_tc_xbf16_s2" and launches[0][3] == 4 * 2 * (32 * 128 * 2 + 128 * 2) + 3 * 8 * 32 * 4
    )


def test_gemv_launches_are_built_once_per_matrices_and_x_shape():
    """A call of matrices seen before, at an x shape seen before, reuses the launches the first
    call checked and built: the same kernels, grids, K splits and weight rows, with this call's
    x, outputs and addends filled in; another T or other matrices build anew."""
    launches = []
    nv = _gemv_backend(launches)
    ws = [
        torch.empty(n, 512, dtype=torch.bfloat16) for n in (24, 700, 64, 300, 32, 96, 128, 40, 256)
    ]  # 9: two launches
    built = []
    real = nv._gemv_tc_launch
    nv._gemv_tc_launch = lambda *a, **kw: built.append(a[0]) or real(*a, **kw)

    def call(T, mats, adds=False):
        launches.clear()
        x = torch.randn(T, 512)
        add = [(torch.randn(T, w.shape[0]), torch.randn(T, w.shape[0])) for w in mats] if adds else []
        outs = [nv.linear(x, w, add=a) for w, a in zip(mats, add)] if adds else nv.linears(x, mats)
        return list(launches), outs, [tuple(t.data_ptr() for t in a) for a in add]

    for T, mats, adds in ((3, ws, False), (1, ws[:4], False), (2, ws[1:3], True)):
        built.clear()
        first, _, _ = call(T, mats, adds)
        assert built  # the first call builds its launches
        built.clear()
        again, outs, add_ptrs = call(T, mats, adds)
        assert not built, "the second call rebuilt its launches"
        assert len(again) == len(first)
        for (n1, g1, b1, s1, i1, m1), (n2, g2, b2, s2, i2, m2) in zip(first, again):
            assert (n1, g1, b1, s1, i1) == (n2, g2, b2, s2, i2) and m1[-1] == m2[
                -1
            ]  # kernel, grid, T/N/K/split, blocks
            for a, b in zip(m1[:-1], m2[:-1]):
                assert a[0] == b[0] and a[4:] == b[4:]  # weight address, rows, first row block
        # this call's outputs and addends, each once, in the tables
        assert sorted(b[1] for *_, m in again for b in m[:-1]) == sorted(o.data_ptr() for o in outs)
        if adds:  # a launch per linear call: its addends in order, (acc + add0) + add1
            assert [tuple(m[0][2:4]) for *_, m in again] == add_ptrs
        else:
            assert all(b[2] == b[3] == 0 for *_, m in again for b in m[:-1])
    built.clear()
    call(5, ws[:4])  # another T
    assert built


def test_gemv_k_split_depends_on_the_matrix_not_on_t():
    """The K split sets the order of a row's sum: it must be the same for every T (batch
    invariance), also for a longer batch (its 8-row groups are blocks of one launch)."""
    launches = []
    nv = _gemv_backend(launches)
    for N, K, ks in (
        (2048, 4096, 8),
        (7168, 12288, 4),
        (12288, 7168, 2),
        (163840, 7168, 1),
        (4096, 256, 2),
        (64, 8, 1),
    ):
        w = torch.empty(N, K, dtype=torch.bfloat16)
        for T in (1, 3, 8, 11):
            launches.clear()
            nv.linear(torch.randn(T, K), w)
            (_, grid, _, _, ints, _), = launches
            assert ints == [T, N, K, ks], (N, K, T)
            assert grid == (-(-N // 32) * -(-T // 8),)  # a block per 32 rows of w and 8 rows of x


def test_gemv_split_fits_shared_memory():
    """A K split capped by what fits two stages of 8 fp32 x rows, whatever this call's T (the
    cap must not change a row's bits)."""
    launches = []
    nv = _gemv_backend(launches, smem_optin=80 * 1024)
    w = torch.empty(203, 1536, dtype=torch.bfloat16)
    for T in (8, 1):
        nv.linear(torch.randn(T, 1536), w)  # K split 8 wanted; 3 fit
    (n8, _, b8, s8, i8, _), (n1, _, b1, s1, i1, _) = launches
    assert i8[-1] == i1[-1] == 3 and b8 == b1 == (96,)
    assert n8 == n1 == "srt_gemv_tc_xf32_s2" and s8 <= 80 * 1024 and s1 <= 80 * 1024
    assert s8 == 3 * 2 * (32 * 128 * 2 + 8 * 128 * 4) + 2 * 8 * 32 * 4


def test_gemv_unaligned_k_launches_the_scalar_kernel_per_8_rows():
    """K % 8 != 0: the scalar fallback, one launch per 8-row group (T = 11: rows 8 and 3)."""
    launches = []
    nv = _gemv_backend(launches)
    nv.linear(torch.randn(11, 20), torch.empty(300, 20, dtype=torch.bfloat16))
    assert [(L[0], L[1], L[4]) for L in launches] == [
        ("srt_gemv_scalar", (38,), [0, 8, 1, 300, 20]), ("srt_gemv_scalar", (38,), [0, 3, 1, 300, 20])]


def test_gemv_without_bf16_mma_uses_cuda_cores():
    launches = []
    nv = _gemv_backend(launches, mma=False)
    w = torch.empty(300, 2048, dtype=torch.bfloat16)
    nv.linear(torch.randn(8, 2048), w)
    assert launches[0][0] == "srt_gemv_bf16_t8_r4"
    launches.clear()
    for T, name in ((2, "srt_gemv_bf16_t2_r2"), (3, "srt_gemv_bf16_t4_r2")):
        nv.linear(torch.randn(T, 2048), w)
        assert launches[-1][0] == name and launches[-1][1] == (-(-300 // 8),)  # 4 warps of 2 rows a block
    nv.linear(torch.randn(1, 2048), w)  # T=1: the fullest last wave, 75 of 132 x 16 slots at one row a warp
    assert launches[-1][0] == "srt_gemv_bf16_t1_r1"
    nv.linear(torch.randn(5, 2048), w.float())
    assert launches[-1][0] == "srt_gemv_f32_t8_r2"


def test_linears_share_one_tensor_core_launch_split_by_its_rows():
    """Matrices sharing x are blocks of one tensor-core launch (each matrix's 32-row blocks after
    the one's before), up to GEMV_TC_MATS a launch; the K split follows the launch's row blocks
    (the fewest warps, a power of two up to 8, for 512 in flight), whatever T."""
    launches = []
    nv = _gemv_backend(launches)
    K = 2048
    ns = (1024, 3584, 8, 1000, 6144)
    ws = [torch.empty(n, K, dtype=torch.bfloat16) for n in ns]
    for T in (3, 11):
        launches.clear()
        outs = nv.linears(torch.randn(T, K), ws)
        assert [tuple(o.shape) for o in outs] == [(T, n) for n in ns]
        (_, grid, block, _, ints, mats), = launches
        assert ints == [T, *ns, K, 2] and block == (64,)  # 32 + 112 + 1 + 32 + 192 = 369 blocks: 2 warps each
        assert grid == (369 * -(-T // 8),)
        assert [m[0] for m in mats[:-1]] == [w.data_ptr() for w in ws]
        assert [m[1] for m in mats[:-1]] == [o.data_ptr() for o in outs]
        assert [m[5] for m in mats[:-1]] == [0, 32, 144, 145, 177] and mats[-1] == 369  # first blocks, then the total
    # few rows: more warps per block; nine matrices: a second launch, split by its own rows
    launches.clear()
    nv.linears(
        torch.randn(1, K),
        [torch.empty(1024, K, dtype=torch.bfloat16)] * 4 + [torch.empty(128, K, dtype=torch.bfloat16)],
    )
    assert launches[0][4][-1] == 4  # 4 * 32 + 4 = 132 blocks: 4 warps make 528
    launches.clear()
    nv.linears(torch.randn(1, K), [torch.empty(2048, K, dtype=torch.bfloat16)] * 9)
    assert [(L[4][-1], L[1]) for L in launches] == [(1, (512,)), (8, (64,))]


def test_linear_addends_ride_in_the_table_or_are_added_after():
    """`add` reaches the tensor-core epilogue as pointers (in order, the rest 0); on a CUDA-core
    kernel the sums are added after it, in order."""
    launches = []
    nv = _gemv_backend(launches)
    w = torch.empty(300, 256, dtype=torch.bfloat16)
    a0, a1 = torch.randn(2, 300), torch.randn(2, 300)
    nv.linear(torch.randn(2, 256), w, (a0, a1))
    nv.linear(torch.randn(2, 256), w, (a0,))
    (_, _, _, _, _, m2), (_, _, _, _, _, m1) = launches
    assert m2[0][2:4] == (a0.data_ptr(), a1.data_ptr()) and m1[0][2:4] == (a0.data_ptr(), 0)
    with pytest.raises(ValueError, match="add"):
        nv.linear(torch.randn(2, 256), w, (torch.randn(2, 299),))
    launches.clear()
    nv32 = _gemv_backend(launches)
    nv32._empty = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype)  # the kernel's product: 0
    out = nv32.linear(torch.randn(2, 256), torch.empty(300, 256), (a0, a1))  # fp32 w: CUDA cores
    assert [L[0] for L in launches] == ["srt_gemv_f32_t2_r2"]
    assert torch.equal(out, (torch.zeros(2, 300) + a0) + a1)


def test_elementwise_ops_pass_their_inputs_output_and_constants():
    """sigmoid_mul and situ_glu share one launcher: their kernels get (a, b, out, n, *constants)."""
    calls = []

    class Rec:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args, smem=0, stream=None, pdl=False):
            calls.append((self.name, grid, block, args))

    nv = _gemv_backend([])
    nv._k = lambda program, name: Rec(name)
    a, b = torch.randn(3, 700), torch.randn(3, 700)
    out = nv.sigmoid_mul(a, b)
    name, grid, block, args = calls[-1]
    assert name == "srt_sigmoid_mul" and grid == (9,) and block == (256,) and len(args) == 4
    assert [_int(x) for x in args] == [a.data_ptr(), b.data_ptr(), out.data_ptr(), 2100]
    out = nv.situ_glu(a, b, 4.0, 25.0)
    name, _, _, args = calls[-1]
    assert name == "srt_situ_glu" and [_int(x) for x in args[:4]] == [a.data_ptr(), b.data_ptr(), out.data_ptr(), 2100]
    assert struct.unpack("<fifi", b"".join(args[4:])) == (4.0, 0, 25.0, 1)  # beta, beta is inf, linear beta, has one
    with pytest.raises(ValueError, match="situ_glu.gate .* and situ_glu.up .* differ"):
        nv.situ_glu(a, b[:, :5], 4.0, None)


def _read_as_kernel(base: torch.Tensor, addr: int, rs: int, hs: int, shape) -> torch.Tensor:
    """What a kernel reads at x[b * rs + h * hs + d] from `addr` inside fp32 `base`'s storage."""
    off = (addr - base.data_ptr()) // 4
    b, h, d = (torch.arange(n) for n in shape)
    return base.reshape(-1)[off + b[:, None, None] * rs + h[None, :, None] * hs + d[None, None, :]]


def test_query_views_reach_the_kernels_in_place():
    """q_nope and q_rot are slices of q_b_proj's output and kv_a's latent columns a slice of its
    projection: the kernels get the view's address and strides, not a copy (one launch fewer
    each), and what those strides address is the view's values. A view whose last dim is not
    dense is still copied first."""
    calls = []

    class Rec:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args, smem=0, stream=None, pdl=False):
            calls.append((self.name, args))

    nv = _gemv_backend([])
    nv._k = lambda program, name: Rec(name)
    B, H, dn, dr, R = 3, 4, 24, 8, 32
    q = torch.randn(B, H * (dn + dr)).view(B, H, dn + dr)
    q_nope, q_rot = q[..., :dn], q[..., dn:]
    w = torch.randn(H * (dn + 16), R).view(H, dn + 16, R)
    nv.mla_absorb(q_nope, w[:, :dn])
    name, args = calls[-1]
    assert name == "srt_mla_absorb" and _int(args[0]) == q_nope.data_ptr()
    rs, hs = _int(args[1]), _int(args[2])
    assert torch.equal(_read_as_kernel(q, _int(args[0]), rs, hs, (B, H, dn)), q_nope)

    c, kr = torch.randn(B, 40, R), torch.randn(B, 40, dr)
    nv.mla_decode(torch.randn(B, H, R), q_rot, c, kr, 0.3, None, torch.full((B,), 40, dtype=torch.int32))
    name, args = next(x for x in reversed(calls) if x[0] == "srt_mla_partial")
    assert _int(args[1]) == q_rot.data_ptr()
    rs, hs = _int(args[12]), _int(args[13])  # after q_lat, q_rot, c, kr, n, cache_bf16, select, m, m_dev, H, R, Dr
    assert torch.equal(_read_as_kernel(q, _int(args[1]), rs, hs, (B, H, dr)), q_rot)
    nv.mla_decode(torch.randn(H, R), q_rot[1], c[1], kr[1], 0.3, None, torch.full((1,), 40, dtype=torch.int32))
    name, args = next(x for x in reversed(calls) if x[0] == "srt_mla_partial")
    assert _int(args[1]) == q_rot[1].data_ptr()
    assert torch.equal(_read_as_kernel(q, _int(args[1]), _int(args[12]), _int(args[13]), (1, H, dr))[0], q_rot[1])

    kv = torch.randn(B, R + dr)
    nv.rmsnorm(kv[:, :R], torch.rand(R) + 0.5, 1e-6)
    name, args = calls[-1]
    assert name == "srt_rmsnorm" and _int(args[0]) == kv.data_ptr() and _int(args[1]) == R + dr

    q_t = torch.randn(B, dn, H).transpose(1, 2)  # last dim strided: copied, then read densely
    nv.mla_absorb(q_t, w[:, :dn])
    _, args = calls[-1]
    assert _int(args[0]) != q_t.data_ptr() and (_int(args[1]), _int(args[2])) == (H * dn, dn)
    nv.rmsnorm(torch.randn(R, B).T, torch.rand(R) + 0.5, 1e-6)
    assert _int(calls[-1][1][1]) == R


def test_indexer_scores_pass_the_head_weight_scale():
    """The indexer's head-weight scale rides in the score launch (no multiply launched before it)
    as an fp32 constant: the value `w * scale` rounds with in torch."""
    calls = []
    nv = _gemv_backend([])
    nv._k = lambda program, name: (lambda grid, block, args, smem=0, stream=None, pdl=False: calls.append((name, args)))
    B, Hi, Di, n = 2, 4, 16, 33
    w_scale = 64**-0.5 * 128**-0.5
    nv.indexer_scores(
        torch.randn(B, Hi, Di),
        torch.randn(B, Hi),
        torch.randn(B, n, Di),
        torch.full((B,), n, dtype=torch.int32),
        w_scale,
    )
    assert [name for name, _ in calls] == ["srt_indexer_scores"]
    assert calls[0][1][-1] == struct.pack("<f", w_scale) and struct.unpack("<f", calls[0][1][-1])[0] != w_scale
    w = torch.randn(1000)
    assert torch.equal(
        w * w_scale, w * torch.tensor(struct.unpack("<f", calls[0][1][-1])[0])
    )  # torch's rounding of the scalar
    nv.indexer_scores(torch.randn(Hi, Di), torch.randn(Hi), torch.randn(n, Di))
    assert struct.unpack("<f", calls[-1][1][-1]) == (1.0,)


# The decode ops of the model, each run by the torch twin for its values and then by the nvrtc
# backend's host side (kernels recorded) for what that host side does besides launching.
DECODE_OPS = ("linear", "linears", "rmsnorm", "gated_rmsnorm", "layernorm", "l2norm", "sigmoid_mul", "situ_glu",
              "kda_conv_step", "kda_gates", "kda_step", "cache_append", "attnres_mix", "route", "expert_ffn",
              "mla_absorb", "mla_decode", "mla_expand", "indexer_scores", "select_topk")
# what a host path may do without a launch of its own: views, allocations, and the few it needs
NO_LAUNCH = {
    "aten.empty.memory_format",
    "aten.view.default",
    "aten.slice.Tensor",
    "aten.select.int",
    "aten.detach.default",
    "aten.unsqueeze.default",
    "aten.alias.default",
    "aten.view.dtype",
    "aten.expand.default",
    "aten.t.default",
    "aten.transpose.int",
    "aten.as_strided.default",
    "aten._reshape_alias.default",
}


def test_a_decode_step_launches_nothing_but_its_kernels(tmp_path):
    """On the decode path the nvrtc backend's Python is a lookup and a launch. A whole
    decode step of tiny-k3.1-pro (MLA with the indexer, KDA, MoE, AttnRes) through the host
    side: no copy, cast or arithmetic of torch's own (each a launch on the GPU), such as a
    contiguous copy of q_nope or q_rot, which are views of q. The one exception is the addends
    after a scalar GEMV, which the CPU's unaligned weights take."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from streamrt.checkpoint.reader import open_tree
    from streamrt.checkpoint.synth import synth
    from streamrt.loader import DirectExpertProvider, load_model
    from streamrt.model.model import run_sync

    synth("tiny-k3.1-pro", tmp_path / "tree", fmt="streamrt", seed=5, progress=False)
    tree = open_tree(tmp_path / "tree")
    model = load_model(tree, "cpu")
    twin, kernels, ops, depth, counting = model.backend, [], [], [0], [False]  # counting: inside a host call
    nv = _host_backend()
    nv.pdl = True
    nv._k = lambda program, name: (lambda *a, **k: kernels.append(name))

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if counting[0] and str(func) not in NO_LAUNCH:
                ops.append(str(func))
            return func(*args, **(kwargs or {}))

    def both(name):
        values, host = getattr(twin, name), getattr(nv, name)

        def call(*a, **k):
            depth[0] += 1
            try:
                out = values(*a, **k)
            finally:
                depth[0] -= 1
            if depth[0] == 0:  # the model's call, not one the twin makes inside
                counting[0] = True
                try:
                    host(*a, **k)
                finally:
                    counting[0] = False
            return out
        return call

    provider, cache = DirectExpertProvider(tree, "cpu"), model.new_cache(2)
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    run_sync(model.forward_steps(ids, cache, last_only=True), provider)  # prefill on the twin alone
    for name in DECODE_OPS:
        setattr(twin, name, both(name))
    run_sync(model.forward_steps(ids[:, :1], cache, last_only=True), provider)  # the first step allocates scratch once
    kernels.clear()
    with Count():
        run_sync(model.forward_steps(ids[:, 1:2], cache, last_only=True), provider)
    for k in (
        "srt_mla_absorb",
        "srt_mla_partial",
        "srt_indexer_scores",
        "srt_kda_step",
        "srt_attnres_apply",
        "srt_router_topk",
        "srt_moe_combine",
        "srt_rmsnorm",
        "srt_cache_append",
    ):
        assert k in kernels, f"{k} not launched: the step did not take the path this test is about"
    assert [o for o in ops if o != "aten.add_.Tensor"] == [], sorted(set(ops))
    assert ops.count("aten.add_.Tensor") <= kernels.count("srt_gemv_scalar")


# ---- the launch: what reaches the driver --------------------------------------------------------


class _Driver:
    """Stands in for cuda.bindings.driver at a launch: reads the kernelParams it is given (an
    array of pointers, one per argument) while the call lasts, as the real driver does."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUlaunchConfig:
        pass

    def __init__(self, fail=0):
        self.fail, self.launches = fail, []

    @staticmethod
    def CUstream(s):
        return s

    def _read(self, params, sizes):
        ptrs = (ctypes.c_uint64 * len(sizes)).from_address(params)
        return [(int(p), (ctypes.c_char * n).from_address(p).raw) for p, n in zip(ptrs, sizes)]

    def cuLaunchKernelEx(self, cfg, fn, params, extra):
        self.launches.append(("ex", cfg.gridDimX, self._read(params, self.sizes)))
        return (self.fail,)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.launches.append(("plain", gx, self._read(params, self.sizes)))
        return (self.fail,)

    def cuGetErrorName(self, err):
        return 0, b"CUDA_ERROR_LAUNCH_FAILED"


def _kernel(monkeypatch, drv, sizes):
    from streamrt.backends import cuda_driver as cd

    monkeypatch.setattr(cd, "driver", lambda: drv)
    monkeypatch.setattr(cd, "make_current", lambda index: None)
    monkeypatch.setattr(cd, "current_stream", lambda index: 7)
    monkeypatch.setattr(cd, "_pdl_attr", lambda: None)
    k = object.__new__(cd.Kernel)  # no module to load: only the launch's host side runs
    k._configure("srt_probe", 0, object(), sizes)
    drv.sizes = [n for n in (sizes or [])]
    return k


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("known_sizes", [True, False])
def test_launch_passes_a_pointer_to_each_arguments_bytes(monkeypatch, pdl, known_sizes):
    """Every argument's bytes reach the driver whole, each 8-byte aligned, through the pointer
    array of kernelParams, for a table, pointers, int32 and float32 arguments mixed; a size that
    differs from the kernel's parameter is refused before any launch."""
    from streamrt.backends.nvrtc_args import f32, i32, i64, ptr

    rng = np.random.default_rng()
    table = rng.integers(0, 2**63, 41, dtype=np.uint64).tobytes()
    t = torch.randn(5)
    args = [
        table,
        ptr(t),
        i32(int(rng.integers(-(2**31), 2**31))),
        f32(float(rng.standard_normal())),
        i64(int(rng.integers(0, 2**62))),
        i32(3),
        ptr(None),
    ]
    sizes = [len(a) for a in args]
    drv = _Driver()
    k = _kernel(monkeypatch, drv, sizes if known_sizes else None)
    drv.sizes = sizes
    k((5, 2), (64,), args, pdl=pdl)
    (kind, gx, got), = drv.launches
    assert kind == ("ex" if pdl else "plain") and gx == 5
    assert [raw for _, raw in got] == args
    assert all(p % 8 == 0 for p, _ in got)
    assert struct.unpack("<Q", got[1][1])[0] == t.data_ptr() and got[6][1] == bytes(8)
    if known_sizes:
        with pytest.raises(nvm.CudaError, match=r"srt_probe: argument sizes .* != kernel params"):
            k((1,), (32,), args[:-1] + [i32(0)])
        assert len(drv.launches) == 1


def test_a_failed_launch_names_the_kernel_and_its_shape(monkeypatch):
    drv = _Driver(fail=719)
    k = _kernel(monkeypatch, drv, [4])
    with pytest.raises(
        nvm.CudaError,
        match=r"cuLaunchKernelEx\(srt_probe, grid=\(3,\), block=\(32,\), smem=0, programmatic\) "
        r"failed: CUDA_ERROR_LAUNCH_FAILED \(719\)",
    ):
        k((3,), (32,), [struct.pack("<i", 1)], pdl=True)
