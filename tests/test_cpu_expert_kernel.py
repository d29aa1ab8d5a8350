"""The host CPU expert kernel (backends/cpu_expert) against a float64 reference written here from
the spec (INDEXER_FP4.md §B: E2M1 nibble x E4M3 block scale x global; MODEL.md §7: SiTU-GLU),
and against the torch path the runtime runs today.

Tolerance. The kernel sums in fp32 (one fused multiply-add per weight, 16 lanes each one chain
over the blocks, a fixed tree), so an output element's error is a few fp32 roundings per term of
its dot products: |y - ref| <= RTOL * S, S = the float64 sum of |down weight| * |h| for that
element (the magnitude the sum passed through), RTOL = 2^-14 (~6e-5; the kernel's and the torch
path's measured errors are both ~300x below it at the real expert shape).
The same bound holds between the kernel and the torch path.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform

import numpy as np
import pytest
import torch

from streamrt.backends.cpu_expert import build, kernel
from streamrt.backends.torch_backend import TorchBackend
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
RTOL = 2.0**-14
SHAPES = [(16, 16), (48, 80), (96, 48), (272, 112)]  # (Dl, I): 1..17 blocks, odd block counts
ROWS = [1, 3, 4, 9, 16]
ACTS = [(4.0, 25.0), (math.inf, None)]  # K3 SiTU-GLU; SiLU (Kimi Linear)


@pytest.fixture
def rng(request):
    seed = SEED + hash(request.node.name) % 1000
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("STREAMRT_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


# ---- references (float64), straight from the bit layouts -----------------------------


def ref_e2m1(code):
    code = np.asarray(code, dtype=np.int64)
    s = np.where(code & 8, -1.0, 1.0)
    e, m = (code >> 1) & 3, code & 1
    return s * np.where(e == 0, m * 0.5, (1 + m / 2.0) * 2.0 ** (e - 1))


def ref_e4m3(byte):
    b = np.asarray(byte, dtype=np.int64)
    s = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 15, b & 7
    return s * np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7.0))


def ref_matrix(m: NVFP4Matrix) -> np.ndarray:
    p = m.packed.numpy().astype(np.int64)
    codes = np.stack((p & 15, p >> 4), axis=-1).reshape(p.shape[0], -1)  # low nibble = even element
    scale = np.repeat(ref_e4m3(m.scales.numpy()), 16, axis=1)
    return ref_e2m1(codes) * scale * m.global_scale.numpy().astype(np.float64)[:, None]


def ref_expert(z, ew, beta, linear_beta):
    """(out [m, Dl], S [m, Dl] the magnitude each output's sum passed through) in float64."""
    z = z.numpy().astype(np.float64)
    g, u = z @ ref_matrix(ew.gate).T, z @ ref_matrix(ew.up).T
    sig = 1.0 / (1.0 + np.exp(-g))
    ga = g * sig if math.isinf(beta) else beta * np.tanh(g / beta) * sig
    ua = u if linear_beta is None else linear_beta * np.tanh(u / linear_beta)
    h = ga * ua
    wd = ref_matrix(ew.down)
    return h @ wd.T, np.abs(h) @ np.abs(wd).T


# ---- random experts --------------------------------------------------------------------


def random_matrix(rng, out, inp, per_row=True):
    packed = rng.integers(0, 256, (out, inp // 2), dtype=np.uint8)  # every code, -0 included
    scales = rng.integers(0x20, 0x50, (out, inp // 16), dtype=np.uint8)  # E4M3 2^-3 .. 2^2.9, signs +
    scales[rng.random(scales.shape) < 0.1] |= 0x80  # a few negative scales
    glob = 2.0 ** rng.uniform(-9, -5, out) if per_row else np.full(out, 2.0 ** rng.uniform(-9, -5))
    return NVFP4Matrix(torch.from_numpy(packed), torch.from_numpy(scales), torch.from_numpy(glob.astype(np.float32)))


def random_expert(rng, dl, inter):
    return ExpertWeights(random_matrix(rng, inter, dl), random_matrix(rng, inter, dl, per_row=False),
                         random_matrix(rng, dl, inter))


def rows(rng, m, dl):
    return torch.from_numpy(rng.standard_normal((m, dl)).astype(np.float32) * 4)


def assert_within(got, want, mag):
    err = np.abs(got.numpy().astype(np.float64) - want)
    worst = float((err / (RTOL * mag + 1e-30)).max())
    assert worst <= 1.0, f"error {worst:.3g}x the tolerance RTOL * S"


# ---- the kernel against the references -------------------------------------------------


@pytest.mark.parametrize("beta,linear_beta", ACTS)
@pytest.mark.parametrize("dl,inter", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_kernel_matches_float64_reference(rng, m, dl, inter, beta, linear_beta):
    ew = random_expert(rng, dl, inter)
    z = rows(rng, m, dl)
    got = kernel.expert_ffn_rows(z, ew, beta, linear_beta)
    assert_within(got, *ref_expert(z, ew, beta, linear_beta))


@pytest.mark.parametrize("m", [1, 4, 16])
def test_real_expert_shape_against_reference_and_torch_path(rng, m):
    """kimi-k3.1-pro's routed expert (Dl 3584, I 3072): float64 reference and the torch backend."""
    ew = random_expert(rng, 3584, 3072)
    z = rows(rng, m, 3584)
    got = kernel.expert_ffn_rows(z, ew, 4.0, 25.0)
    want, mag = ref_expert(z, ew, 4.0, 25.0)
    assert_within(got, want, mag)
    ids = torch.zeros(m, 1, dtype=torch.long)
    torch_path = TorchBackend().expert_ffn(z, ids, torch.ones(m, 1), {0: ew}, 4.0, 25.0)
    assert_within(got, torch_path.double().numpy(), mag)


@pytest.mark.parametrize("dl,inter", SHAPES[1:])
def test_kernel_matches_torch_path(rng, dl, inter):
    ew = random_expert(rng, dl, inter)
    z = rows(rng, 7, dl)
    got = kernel.expert_ffn_rows(z, ew, 4.0, 25.0)
    want = TorchBackend().expert_ffn(z, torch.zeros(7, 1, dtype=torch.long), torch.ones(7, 1), {0: ew}, 4.0, 25.0)
    assert_within(got, want.double().numpy(), ref_expert(z, ew, 4.0, 25.0)[1])


def test_a_row_has_the_same_bits_alone_in_any_batch_and_at_any_thread_count(rng):
    ew = random_expert(rng, 512, 384)  # 6.5M weight x row products: up to 6 threads (MIN_WORK 2^20 each)
    z = rows(rng, 11, 512)
    whole = kernel.expert_ffn_rows(z, ew, 4.0, 25.0, threads=1)
    for threads in (2, 3, 5):
        assert torch.equal(kernel.expert_ffn_rows(z, ew, 4.0, 25.0, threads=threads), whole)
    for r in (0, 5, 10):
        assert torch.equal(kernel.expert_ffn_rows(z[r : r + 1], ew, 4.0, 25.0)[0], whole[r])


def _variant_flags():
    out = [("portable", ("-fopenmp",))]
    if platform.machine() in ("x86_64", "AMD64"):
        out += [("avx2", ("-mavx2", "-mfma", "-fopenmp")), ("native", ("-march=native", "-fopenmp"))]
    return out


def test_every_simd_path_gives_the_same_bits(rng, tmp_path, monkeypatch):
    """AVX-512, AVX2 and the portable C sum in the same order, whatever tiles of weight rows x rows
    each takes (they differ per path and per row count): one answer per input, any CPU."""
    ew = random_expert(rng, 272, 112)
    zs = [rows(rng, m, 272) for m in (1, 2, 3, 9, 16)]
    answers = {}
    for name, extra in _variant_flags():
        lib_path = tmp_path / f"{name}.so"
        assert build.compile_to(build.compiler(), (*build.COMMON, *extra), lib_path) == ""
        fn = kernel.bind(ctypes.CDLL(str(lib_path)))
        monkeypatch.setattr(kernel, "_entry", lambda fn=fn: fn)
        answers[name] = [kernel.expert_ffn_rows(z, ew, 4.0, 25.0) for z in zs]
    first = next(iter(answers.values()))
    for k, z in enumerate(zs):
        assert all(torch.equal(a[k], first[k]) for a in answers.values()), (z.shape[0], list(answers))


def test_reads_an_expert_file_mapping_in_place(rng, tmp_path):
    """The views parse_expert makes of a mapped `.nvfp4` file go to the kernel as they are."""
    import mmap

    from streamrt.checkpoint.expert_file import GLOBAL_PER_ROW, ExpertLayout, parse_expert, write_expert_file

    ew = random_expert(rng, 96, 64)
    path = tmp_path / "e.nvfp4"
    write_expert_file(path, ew, layout=ExpertLayout.for_shape(96, 64), global_mode=GLOBAL_PER_ROW)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapped = parse_expert(mm, ExpertLayout.for_shape(96, 64))
    z = rows(rng, 4, 96)
    assert torch.equal(kernel.expert_ffn_rows(z, mapped, 4.0, 25.0), kernel.expert_ffn_rows(z, ew, 4.0, 25.0))


def test_bad_tensors_are_named(rng):
    ew = random_expert(rng, 48, 32)
    z = rows(rng, 2, 48)
    with pytest.raises(ValueError, match="z: expected CPU float32"):
        kernel.expert_ffn_rows(z.double(), ew, 4.0, 25.0)
    with pytest.raises(ValueError, match=r"z: expected CPU float32 \[m, 48\]"):
        kernel.expert_ffn_rows(rows(rng, 2, 32), ew, 4.0, 25.0)
    strided = NVFP4Matrix(ew.down.packed.t().contiguous().t(), ew.down.scales, ew.down.global_scale)
    with pytest.raises(ValueError, match=r"down\.packed: .*not contiguous"):
        kernel.expert_ffn_rows(z, ExpertWeights(ew.gate, ew.up, strided), 4.0, 25.0)
    wrong = NVFP4Matrix(ew.up.packed, ew.up.scales, ew.up.global_scale.double())
    with pytest.raises(ValueError, match=r"up\.global_scale"):
        kernel.expert_ffn_rows(z, ExpertWeights(ew.gate, wrong, ew.down), 4.0, 25.0)
    with pytest.raises(ValueError, match="linear_beta"):
        kernel.expert_ffn_rows(z, ew, 4.0, -1.0)
    assert kernel.expert_ffn_rows(z[:0], ew, 4.0, 25.0).shape == (0, 48)


def test_no_compiler_is_one_line(monkeypatch):
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(build.CpuKernelUnavailable, match="need a C compiler") as e:
        build.compiler()
    assert "\n" not in str(e.value)


def test_library_is_cached_per_source_flags_and_cpu():
    build.load_library.cache_clear()  # loaded once a process: an earlier test may have built it in its own cache
    lib, variant = build.load_library()
    assert variant in ("native", "portable", "serial")
    cached = list(build.cache_dir().glob(f"nvfp4_expert-{variant}-*.so"))
    assert len(cached) == 1
    flags = (*build.COMMON, "-march=native")
    assert build.cache_key("cc", flags) != build.cache_key("cc", (*build.COMMON,))
    assert kernel.simd_path().endswith(f"({variant} build)")


def test_a_batch_of_experts_gives_each_its_own_bits(rng):
    """experts_ffn_rows (one call per layer request) = expert_ffn_rows per expert, bit for bit,
    whatever the batch's order and rows (0 rows included)."""
    experts = [random_expert(rng, 96, 48) for _ in range(4)]
    zs = [rows(rng, m, 96) for m in (3, 1, 0, 9)]
    alone = [kernel.expert_ffn_rows(z, ew, 4.0, 25.0) for z, ew in zip(zs, experts)]
    batch = kernel.experts_ffn_rows(zs, experts, 4.0, 25.0, threads=2)
    assert all(torch.equal(a, b) for a, b in zip(alone, batch)) and batch[2].shape == (0, 96)
    backwards = kernel.experts_ffn_rows(zs[::-1], experts[::-1], 4.0, 25.0)
    assert all(torch.equal(a, b) for a, b in zip(alone, backwards[::-1]))
    with pytest.raises(ValueError, match="must share"):
        kernel.experts_ffn_rows(zs[:2], [experts[0], random_expert(rng, 48, 48)], 4.0, 25.0)
    with pytest.raises(ValueError, match="one entry per expert"):
        kernel.experts_ffn_rows(zs, experts[:2], 4.0, 25.0)
