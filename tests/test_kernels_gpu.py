"""NVRTC kernels vs float64 references (written here from spec/MODEL.md) and vs the torch backend.

Every output and scratch buffer of the nvrtc backend is poisoned (NaN / -7) before the launch,
so a kernel that leaves any element unwritten fails. Inputs are fresh random draws each run
(seed printed in failures; set STREAMRT_TEST_SEED to replay), never zeros. Tolerances:
max|out - ref| / max|ref| < 1e-5 against the float64 reference of the same inputs, and
< 2e-5 against the torch backend (both fp32, each within 1e-5 of the reference); index outputs
(top-k, router ids) must be identical.

`STREAMRT_KERNEL_TEST_CPU=1` runs the references against the torch backend on the CPU (no
kernels): a dry run that checks this file's own references and shapes.
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch

from streamrt.backends import nvrtc_linear
from streamrt.backends.nvfp4_gemm import TORCH_FP16, grouped_expert_pairs
from streamrt.backends.torch_backend import TorchBackend
from streamrt.backends.expert_pointers import ExpertTable
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix, ResidentExperts, RoutedExperts

CPU_DRY = os.environ.get("STREAMRT_KERNEL_TEST_CPU") == "1"
HAS_CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA and not CPU_DRY, reason="needs a CUDA GPU (run with -m gpu on the device)"),
]
DEV = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
SEED = int(os.environ.get("STREAMRT_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
TOL = 1e-5

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]  # MODEL.md 9.1


def e4m3_value(b: int) -> float:
    """E4M3 (fn) byte -> value: sign, 4 exponent bits (bias 7), 3 mantissa bits; e = 0 subnormal."""
    s, e, m = (b >> 7) & 1, (b >> 3) & 15, b & 7
    v = m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


E4M3 = [e4m3_value(b) for b in range(256)]


def _make_backend(cuda_core: bool = False):
    """The backend with poisoned outputs; `cuda_core`: its expert FFN always on the CUDA-core
    kernels (which production runs for shapes the tensor-core ones do not take)."""
    if not HAS_CUDA:
        return None
    from dataclasses import replace

    from streamrt.backends.nvrtc import NvrtcBackend

    class PoisonedNvrtc(NvrtcBackend):
        def _empty(self, *shape, dtype=torch.float32):
            fill = float("nan") if dtype.is_floating_point else -7
            return torch.full(shape, fill, dtype=dtype, device=self.device)

    class CudaCoreNvrtc(PoisonedNvrtc):
        def _launch_pairs(self, call, tabs):
            super()._launch_pairs(replace(call, tc=False), tabs)

    return (CudaCoreNvrtc if cuda_core else PoisonedNvrtc)()


NV = _make_backend()
NV_IMPLS = {"tc": _make_backend(), "cuda_core": _make_backend(cuda_core=True)}
TB = TorchBackend()


@pytest.fixture
def gen(request):
    seed = (SEED + zlib.crc32(request.node.name.encode())) % 2**31
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    return g


def randn(g, *shape, scale=1.0, dtype=torch.float32):
    x = torch.randn(*shape, generator=g, device=DEV, dtype=torch.float32) * scale
    return x.to(dtype)


def rand(g, *shape, lo=0.0, hi=1.0):
    return torch.rand(*shape, generator=g, device=DEV) * (hi - lo) + lo


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def check(what: str, g, ref64: torch.Tensor, tb_out: torch.Tensor, nv_fn, tol: float = TOL):
    """ref64 float64; tb_out the torch backend's result; nv_fn() runs the nvrtc op (GPU only)."""
    info = f"{what} (seed {g.initial_seed()})"
    assert tb_out.shape == ref64.shape, f"{info}: torch backend shape {tuple(tb_out.shape)} != {tuple(ref64.shape)}"
    e_tb = rel(tb_out, ref64)
    assert e_tb < tol, f"{info}: torch backend vs float64 reference rel err {e_tb:.3g}"
    if NV is None:
        return None
    out = nv_fn()
    assert out.shape == ref64.shape, f"{info}: nvrtc shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    assert out.dtype == torch.float32, f"{info}: nvrtc dtype {out.dtype}"
    assert torch.isfinite(out).all(), f"{info}: nvrtc left {int((~torch.isfinite(out)).sum())} elements unwritten/NaN"
    e_ref, e_t = rel(out, ref64), rel(out, tb_out)
    assert e_ref < tol, f"{info}: nvrtc vs float64 reference rel err {e_ref:.3g}"
    # Two fp32 results each within tol of the reference can be 2 tol apart (seen: indexer
    # scores with n = 1, each 0.5e-5 off in opposite directions, 1.03e-5 apart).
    assert e_t < 2 * tol, f"{info}: nvrtc vs torch backend rel err {e_t:.3g}"
    return out


# ---- dense --------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("N,K", [(48, 64), (37, 1000), (300, 2048), (64, 100)])
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
def test_linear(gen, T, N, K, wdt):
    x = randn(gen, T, K)
    w = randn(gen, N, K, scale=K**-0.5, dtype=wdt)
    ref = x.double() @ w.double().T
    check(f"linear T={T} N={N} K={K} {wdt}", gen, ref, TB.linear(x, w), lambda: NV.linear(x, w))


@pytest.mark.parametrize("N,K", [(7168, 12288), (12288, 7168)])
def test_linear_big(gen, N, K):
    x = randn(gen, 1, K)
    w = randn(gen, N, K, scale=K**-0.5, dtype=torch.bfloat16)
    ref = x.double() @ w.double().T
    check(f"linear {N}x{K}", gen, ref, TB.linear(x, w), lambda: NV.linear(x, w))


def test_linear_bf16_activations_and_misaligned_weights(gen):
    x = randn(gen, 3, 256, dtype=torch.bfloat16)
    store = randn(gen, 40 * 256 + 1)
    w = store[1:].view(40, 256)  # contiguous, 4 bytes off 16-byte alignment -> scalar kernel
    ref = x.double() @ w.double().T
    check("linear bf16 x, misaligned w", gen, ref, TB.linear(x.float(), w), lambda: NV.linear(x, w))


def test_linear_prefill_path(gen):
    x = randn(gen, 70, 128)
    w = randn(gen, 96, 128, scale=0.1, dtype=torch.bfloat16)
    ref = x.double() @ w.double().T
    check("linear prefill T=70", gen, ref, TB.linear(x, w), lambda: NV.linear(x, w))


@pytest.mark.skipif(NV is None, reason="kernel property")
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
def test_linear_batch_invariant(gen, wdt):
    x = randn(gen, 8, 1536)
    w = randn(gen, 200, 1536, scale=0.03, dtype=wdt)
    full = NV.linear(x, w)
    for t in range(8):
        assert torch.equal(NV.linear(x[t : t + 1], w)[0], full[t]), f"row {t} differs alone vs in a batch of 8"
    assert torch.equal(NV.linear(x[:3], w), full[:3]), "rows differ between T=3 and T=8"
    assert torch.equal(NV.linear(x, w), full), "not deterministic run to run"
    # past 8 rows: the 8-row groups are blocks of one launch (the tensor-core kernel), each row
    # still its T = 1 bits; odd tails, fp32 and bf16 x, N not a multiple of 32
    for xdt in (torch.float32, torch.bfloat16):
        xl = randn(gen, 37, 1536, dtype=xdt)
        for T in (9, 16, 37):
            got = NV.linear(xl[:T], w)
            assert rel(got, xl[:T].double() @ w.double().T) < TOL, f"T={T} x {xdt}"
            for t in (0, 7, 8, T - 1):
                assert torch.equal(got[t], NV.linear(xl[t : t + 1], w)[0]), f"row {t} of T={T} (x {xdt}) differs alone"


@pytest.mark.parametrize("T", [1, 5, 13])
def test_linears_each_matrix_against_float64_and_batch_invariant(gen, T):
    """Several matrices of one x (one tensor-core launch, K split 2 for its 369 row blocks; an
    fp32 one on CUDA cores): each output against float64; each row's bits are those of that
    row alone (the split depends on the matrices, not on T)."""
    K = 2048
    x = randn(gen, T, K)
    ws = [randn(gen, n, K, scale=K**-0.5, dtype=dt) for n, dt in
          ((1024, torch.bfloat16), (3584, torch.bfloat16), (8, torch.bfloat16), (1000, torch.bfloat16),
           (6144, torch.bfloat16), (24, torch.float32))]
    tb = TB.linears(x, ws)
    got = NV.linears(x, ws) if NV is not None else None
    for i, w in enumerate(ws):
        ref = x.double() @ w.double().T
        check(f"linears T={T} matrix {i} {tuple(w.shape)}", gen, ref, tb[i], lambda: got[i])
    if got is not None:
        last = NV.linears(x[-1:], ws)
        for i in range(len(ws)):
            assert torch.equal(got[i][-1:], last[i]), f"matrix {i}: row {T - 1} alone gives other bits"


@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
def test_linear_addends_give_the_bits_of_separate_adds(gen, T, wdt):
    """The residual adds of `linear(x, w, add)`: ((x w^T) + a0) + a1, each sum rounded, in the
    tensor-core epilogue (bf16 w) or after the CUDA-core kernel (fp32 w)."""
    x, w = randn(gen, T, 1536), randn(gen, 300, 1536, scale=0.03, dtype=wdt)
    a0, a1 = randn(gen, T, 300, scale=3.0), randn(gen, T, 300, scale=30.0)
    ref = (x.double() @ w.double().T + a0.double()) + a1.double()
    out = check(
        f"linear + 2 addends T={T} {wdt}", gen, ref, TB.linear(x, w, (a0, a1)), lambda: NV.linear(x, w, (a0, a1))
    )
    if out is not None:
        assert torch.equal(out, (NV.linear(x, w) + a0) + a1)
        assert torch.equal(NV.linear(x, w, (a0,)), NV.linear(x, w) + a0)


@pytest.mark.parametrize("T", [1, 11])
def test_linear_launch_built_once_gives_the_checked_bits(gen, T):
    """A call of matrices seen before at an x shape seen before reuses the launches the first
    call built (GemvLaunch): the same bits as that first, checked call, for another x and
    other addends too, and each output against float64."""
    K = 1024
    ws = [
        randn(gen, n, K, scale=K**-0.5, dtype=torch.bfloat16) for n in (24, 2048, 700, 96, 64, 33, 512, 8, 300)
    ]  # 9: two launches
    xs = [randn(gen, T, K) for _ in range(2)]
    adds = [(randn(gen, T, 700), randn(gen, T, 700, scale=10.0)) for _ in range(2)]
    tb = [TB.linears(x, ws) for x in xs]
    if NV is None:
        for x, outs in zip(xs, tb):
            for w, o in zip(ws, outs):
                assert rel(o, x.double() @ w.double().T) < TOL
        return
    NV._gemv_launches.clear()
    first = [NV.linears(x, ws) for x in xs]  # the first builds, the second reuses
    again = [NV.linears(x, ws) for x in xs]  # both reuse
    for i, w in enumerate(ws):
        for j, x in enumerate(xs):
            check(f"linears reused T={T} matrix {i}", gen, x.double() @ w.double().T, tb[j][i], lambda: again[j][i])
            assert torch.equal(first[j][i], again[j][i]), f"matrix {i}, x {j}: reused launch gives other bits"
    NV._gemv_launches.clear()
    built = [NV.linear(x, ws[2], a) for x, a in zip(xs, adds)]  # built, then reused with other addends
    NV._gemv_launches.clear()
    assert torch.equal(built[1], NV.linear(xs[1], ws[2], adds[1])), "addends of a reused launch"


@pytest.mark.skipif(NV is None, reason="kernel property")
def test_linear_every_gemv_entry_point_same_bits(gen):
    """Every CUDA-core GEMV entry point (gemv_plan.GEMV_CUDA_CORE_KERNELS, run for fp32 weights
    and for bf16 before sm_80) agrees with the float64 reference and gives the same bits for a
    row as the first at T=1; the tensor-core GEMV (bf16 weights) likewise across T: batch
    invariance holds whichever entry point a T bucket uses."""
    from streamrt.backends.gemv_plan import GEMV_CUDA_CORE_KERNELS

    cc = _make_backend()
    cc._mma = False  # as before sm_80: bf16 weights on the CUDA-core kernels too
    x = randn(gen, 8, 1536)
    for wdt, dname in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
        w = randn(gen, 203, 1536, scale=0.03, dtype=wdt)
        ref = x.double() @ w.double().T
        base = None
        for (dt, nt), cands in sorted(GEMV_CUDA_CORE_KERNELS.items()):
            if dt != dname:
                continue
            for cand in cands:
                cc._gemv_cuda_core = lambda *_, c=cand: c
                out = cc.linear(x[:nt], w)
                assert rel(out, ref[:nt]) < TOL, f"GEMV {cand[0]}: rel err {rel(out, ref[:nt]):.3g}"
                base = out[0] if base is None else base
                assert torch.equal(out[0], base), f"GEMV {cand[0]}: row 0 bits differ from the first at T=1"
        if dname == "bf16":
            one = NV.linear(x[:1], w)[0]
            assert rel(one[None], ref[:1]) < TOL
            for nt in (2, 4, 8):
                assert torch.equal(NV.linear(x[:nt], w)[0], one), f"tensor-core GEMV T={nt}: row 0 bits differ"


@pytest.mark.skipif(NV is None, reason="kernel property")
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_linear_tensor_core_shapes_and_range(gen, xdt, monkeypatch):
    """The tensor-core GEMV: K not a multiple of its 128-column stage, N not a multiple of its
    32-row block, x over 40 binary orders of magnitude, every K split (1 to 8 warps per block,
    capped at the number of stages). With terms this uneven a sum can cancel, so each output is
    held to 1e-5 of its own sum of |terms| (the error bound of an fp32 dot product), not to
    max|ref|; then x * 1 must come back exactly (the split into three bf16 pieces loses no bit)."""
    for T, N, K in ((1, 1, 8), (8, 17, 136), (5, 203, 1000), (8, 4100, 2056)):
        scale = torch.exp2(torch.randint(-20, 20, (T, K), generator=gen, device=DEV).float())
        x = (randn(gen, T, K) * scale).to(xdt)
        w = randn(gen, N, K, scale=K**-0.5, dtype=torch.bfloat16)
        ref = x.double() @ w.double().T
        bound = x.double().abs() @ w.double().abs().T
        for ks in (None, 1, 2, 4, 8):
            NV._gemv_launches.clear()
            if ks is not None:  # a forced K split (the backend picks one per launch's matrices)
                monkeypatch.setattr(nvrtc_linear, "gemv_tc_split", lambda row_blocks, ks=ks: ks)
            try:
                out = NV.linear(x, w)
            finally:
                monkeypatch.undo()
                NV._gemv_launches.clear()
            err = float(((out.double() - ref).abs() / bound.clamp_min(1e-300)).max())
            assert err < TOL, (
                f"tc GEMV T={T} N={N} K={K} x {xdt} K split {ks} (seed {gen.initial_seed()}): "
                f"error {err:.3g} of the |terms| sum"
            )
    # one-hot rows: out[t, n] is the single product x[t, n] * 1, exact if the split is exact
    x = (randn(gen, 8, 1024) * torch.exp2(torch.randint(-30, 30, (8, 1024), generator=gen, device=DEV).float())).to(xdt)
    w = torch.eye(1000, 1024, device=DEV, dtype=torch.bfloat16)
    assert torch.equal(NV.linear(x, w), x[:, :1000].float()), "x * 1 is not exact: the bf16 pieces lose bits"


# ---- norms / activations ------------------------------------------------------------------------


def rms_ref(x, w, eps):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("rows,D", [(1, 64), (5, 7168), (3, 100)])
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
def test_rmsnorm(gen, rows, D, wdt):
    x = randn(gen, rows, D, scale=3.0)
    w = (1 + randn(gen, D, scale=0.2)).to(wdt)
    out = check(f"rmsnorm {rows}x{D}", gen, rms_ref(x, w, 1e-5), TB.rmsnorm(x, w, 1e-5), lambda: NV.rmsnorm(x, w, 1e-5))
    if out is not None:  # the leading columns of a wider row (kv_a's latent), read in place: the same bits
        wide = torch.cat((x, randn(gen, rows, 37)), 1)
        assert torch.equal(NV.rmsnorm(wide[:, :D], w, 1e-5), out), (
            f"rmsnorm of a strided view (seed {gen.initial_seed()})"
        )


@pytest.mark.parametrize("T,H,V", [(1, 96, 128), (3, 2, 16), (2, 5, 48)])
def test_gated_rmsnorm(gen, T, H, V):
    o, gate = randn(gen, T, H, V), randn(gen, T, H, V, scale=2.0)
    w = 1 + randn(gen, V, scale=0.2)
    ref = rms_ref(o, w, 1e-5) / (1 + torch.exp(-gate.double()))
    check(
        f"gated_rmsnorm {T},{H},{V}",
        gen,
        ref,
        TB.gated_rmsnorm(o, gate, w, 1e-5),
        lambda: NV.gated_rmsnorm(o, gate, w, 1e-5),
    )


@pytest.mark.parametrize("rows,D", [(1, 128), (4, 7168), (2, 33)])
def test_layernorm(gen, rows, D):
    x = randn(gen, rows, D, scale=2.0) + 0.5
    w, b = 1 + randn(gen, D, scale=0.2), randn(gen, D, scale=0.1)
    xd = x.double()
    mu = xd.mean(-1, keepdim=True)
    ref = (xd - mu) / torch.sqrt(((xd - mu) ** 2).mean(-1, keepdim=True) + 1e-6) * w.double() + b.double()
    check(f"layernorm {rows}x{D}", gen, ref, TB.layernorm(x, w, b, 1e-6), lambda: NV.layernorm(x, w, b, 1e-6))


@pytest.mark.parametrize("scale", [1.0, 128**-0.5])
@pytest.mark.parametrize("shape", [(1, 96, 128), (3, 2, 16), (5, 1000)])
def test_l2norm(gen, shape, scale):
    x = randn(gen, *shape)
    xd = x.double()
    ref = xd / torch.sqrt((xd * xd).sum(-1, keepdim=True) + 1e-6) * scale
    out = check(f"l2norm {shape} scale {scale}", gen, ref, TB.l2norm(x, 1e-6, scale), lambda: NV.l2norm(x, 1e-6, scale))
    if out is not None and scale != 1.0:  # the scale is one more rounded product, as the model had it
        assert torch.equal(out, NV.l2norm(x, 1e-6) * scale)


@pytest.mark.parametrize("shape", [(1, 8, 128), (5, 3, 77), (2, 1000)])
def test_sigmoid_mul(gen, shape):
    x, gate = randn(gen, *shape, scale=3.0), randn(gen, *shape, scale=6.0)
    ref = x.double() / (1 + torch.exp(-gate.double()))
    check(f"sigmoid_mul {shape}", gen, ref, TB.sigmoid_mul(x, gate), lambda: NV.sigmoid_mul(x, gate))


@pytest.mark.parametrize("T,H,K", [(1, 8, 128), (3, 2, 64), (2, 3, 20)])
def test_kda_conv_step_gives_the_bits_of_its_three_ops(gen, T, H, K):
    """The fused decode conv of q, k, v (states rolled in place) and q's and k's per-head L2 norms:
    against float64, and bit for bit short_conv_step then l2norm (states included)."""
    P, W = H * K, 4
    zs = [randn(gen, T, P) for _ in range(3)]
    states = [randn(gen, T, P, W) for _ in range(3)]
    ws = [randn(gen, P, W, scale=0.5, dtype=dt) for dt in (torch.float32, torch.bfloat16, torch.float32)]
    silu = lambda y: y / (1 + torch.exp(-y))  # noqa: E731
    refs, ref_states = [], []
    for z, st, w in zip(zs, states, ws):
        s2 = torch.cat((st.double()[..., 1:], z.double()[..., None]), -1)
        ref_states.append(s2)
        refs.append(silu((s2 * w.double()).sum(-1)).view(T, H, K))
    l2 = lambda y: y / torch.sqrt((y * y).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    refs = [l2(refs[0]) * K**-0.5, l2(refs[1]), refs[2]]
    tb_states = [st.clone() for st in states]
    tb = TB.kda_conv_step(zs, tb_states, ws, K, 1e-6, K**-0.5)
    nv, nv_states = {}, [st.clone() for st in states]

    def run(i):
        if not nv:
            nv.update(enumerate(NV.kda_conv_step(zs, nv_states, ws, K, 1e-6, K**-0.5)))
        return nv[i]

    for i, name in enumerate("qkv"):
        check(f"kda_conv_step {name} T={T} H={H} K={K}", gen, refs[i], tb[i], lambda i=i: run(i))
        assert rel(tb_states[i], ref_states[i]) < TOL
    if NV is not None:
        sep_states = [st.clone() for st in states]
        q, k, v = (NV.short_conv_step(z, st, w).view(T, H, K) for z, st, w in zip(zs, sep_states, ws))
        assert torch.equal(nv[0], NV.l2norm(q, 1e-6, K**-0.5)) and torch.equal(nv[1], NV.l2norm(k, 1e-6))
        assert torch.equal(nv[2], v)
        for a, b in zip(nv_states, sep_states):
            assert torch.equal(a, b), "conv states differ from short_conv_step's"


@pytest.mark.parametrize("N,H,K", [(1, 8, 128), (5, 3, 64), (17, 2, 5)])
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
def test_kda_gates(gen, N, H, K, wdt):
    f, b = randn(gen, N, H, K, scale=2.0), randn(gen, N, H, scale=3.0)
    a_log = torch.log(rand(gen, H, lo=1.0, hi=16.0)).to(wdt)
    dt_bias = randn(gen, H * K, dtype=wdt)
    lb = -5.0
    sig = lambda x: 1 / (1 + torch.exp(-x))  # noqa: E731
    g_ref = lb * sig(torch.exp(a_log.double())[:, None] * (f.double() + dt_bias.double().view(H, K)))
    beta_ref = sig(b.double())
    tb, nv = TB.kda_gates(f, b, a_log, dt_bias, lb), {}

    def nv_g():
        nv["g"], nv["beta"] = NV.kda_gates(f, b, a_log, dt_bias, lb)
        return nv["g"]

    check(f"kda_gates g N={N} H={H} K={K}", gen, g_ref, tb[0], nv_g)
    check(f"kda_gates beta N={N} H={H} K={K}", gen, beta_ref, tb[1], lambda: nv["beta"])


@pytest.mark.parametrize("beta,lbeta", [(4.0, 25.0), (4.0, None), (math.inf, None)])
@pytest.mark.parametrize("shape", [(1, 3072), (5, 777)])
def test_situ_glu(gen, beta, lbeta, shape):
    gate, up = randn(gen, *shape, scale=6.0), randn(gen, *shape, scale=30.0)
    g, u = gate.double(), up.double()
    sig = 1 / (1 + torch.exp(-g))
    ga = g * sig if math.isinf(beta) else beta * torch.tanh(g / beta) * sig
    ua = u if lbeta is None else lbeta * torch.tanh(u / lbeta)
    check(
        f"situ_glu beta={beta} lbeta={lbeta}",
        gen,
        ga * ua,
        TB.situ_glu(gate, up, beta, lbeta),
        lambda: NV.situ_glu(gate, up, beta, lbeta),
    )


# ---- KDA ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,P,W", [(1, 12288, 4), (3, 100, 4), (2, 64, 3)])
def test_short_conv_step(gen, T, P, W):
    z, st0, w = randn(gen, T, P), randn(gen, T, P, W), randn(gen, P, W, scale=0.5)
    st_ref = torch.cat((st0[..., 1:], z[..., None]), dim=-1).double()
    acc = (st_ref * w.double()).sum(-1)
    ref = acc / (1 + torch.exp(-acc))
    st_tb = st0.clone()
    tb = TB.short_conv_step(z, st_tb, w)
    assert torch.equal(st_tb, st_ref.float())
    st_nv = st0.clone()
    check(f"short_conv_step {T},{P},{W}", gen, ref, tb, lambda: NV.short_conv_step(z, st_nv, w))
    if NV is not None:
        assert torch.equal(st_nv, st_ref.float()), "conv state not rolled + written exactly"


def test_inplace_ops_on_strided_state(gen):
    """A strided cache tensor is still updated in place (through a contiguous copy)."""
    T, P, W, H, K = 2, 96, 4, 3, 32
    z, w = randn(gen, T, P), randn(gen, P, W, scale=0.5)
    st0 = randn(gen, T, W, P).transpose(1, 2)  # [T, P, W], not contiguous
    st_ref = torch.cat((st0[..., 1:], z[..., None]), dim=-1)
    acc = (st_ref.double() * w.double()).sum(-1)
    st_tb = st0.clone()
    tb = TB.short_conv_step(z, st_tb, w)
    st_nv = randn(gen, T, W, P).transpose(1, 2)
    st_nv.copy_(st0)
    check(
        "short_conv_step strided state", gen, acc / (1 + torch.exp(-acc)), tb, lambda: NV.short_conv_step(z, st_nv, w)
    )
    if NV is not None:
        assert not st_nv.is_contiguous() and torch.equal(st_nv, st_ref)
    q, k, v, g, beta, S0 = kda_inputs(gen, T, H, K, K)
    o_ref, S_ref = kda_ref(q, k, v, g, beta, S0)
    S_nv = S0.transpose(2, 3).contiguous().transpose(2, 3)  # same values, strided
    check(
        "kda_step strided state",
        gen,
        o_ref,
        TB.kda_step(q, k, v, g, beta, S0.clone()),
        lambda: NV.kda_step(q, k, v, g, beta, S_nv),
    )
    if NV is not None:
        assert not S_nv.is_contiguous() and rel(S_nv, S_ref) < TOL


def kda_inputs(g, T, H, K, V):
    q = torch.nn.functional.normalize(randn(g, T, H, K), dim=-1) * K**-0.5
    k = torch.nn.functional.normalize(randn(g, T, H, K), dim=-1)
    v = randn(g, T, H, V)
    gg = rand(g, T, H, K, lo=-5.0, hi=-0.01)  # log decay in (lb, 0)
    beta = rand(g, T, H, lo=0.05, hi=0.95)
    S = randn(g, T, H, K, V, scale=0.3)
    return q, k, v, gg, beta, S


def kda_ref(q, k, v, g, beta, S):
    q, k, v, g, beta, S = (t.double() for t in (q, k, v, g, beta, S))
    S = S * torch.exp(g)[..., None]  # row k scaled by exp(g_k)
    pred = torch.einsum("thkv,thk->thv", S, k)
    S = S + beta[..., None, None] * k[..., :, None] * (v - pred)[..., None, :]
    return torch.einsum("thkv,thk->thv", S, q), S


@pytest.mark.parametrize(
    "T,H,K,V", [(1, 96, 128, 128), (1, 8, 128, 128), (2, 2, 16, 16), (3, 3, 64, 48), (2, 3, 30, 40)]
)
def test_kda_step(gen, T, H, K, V):
    q, k, v, g, beta, S0 = kda_inputs(gen, T, H, K, V)
    o_ref, S_ref = kda_ref(q, k, v, g, beta, S0)
    S_tb = S0.clone()
    tb = TB.kda_step(q, k, v, g, beta, S_tb)
    assert rel(S_tb, S_ref) < TOL
    S_nv = S0.clone()
    check(f"kda_step {T},{H},{K},{V}", gen, o_ref, tb, lambda: NV.kda_step(q, k, v, g, beta, S_nv))
    if NV is not None:
        assert rel(S_nv, S_ref) < TOL, f"state rel err {rel(S_nv, S_ref):.3g}"


# ---- MLA + indexer ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "H,R,Dr,n,m",
    [
        (96, 512, 64, 300, None),
        (96, 512, 64, 5000, 2048),
        (2, 32, 8, 1, None),
        (5, 48, 8, 130, 70),
        (9, 64, 16, 64, None),
    ],
)
def test_mla_decode(gen, H, R, Dr, n, m):
    q_lat, q_rot = randn(gen, H, R, scale=0.3), randn(gen, H, Dr, scale=0.3)
    c, kr = randn(gen, n, R), randn(gen, n, Dr)
    scale = (R // 4 + Dr) ** -0.5
    select = None if m is None else torch.randperm(n, generator=gen, device=DEV)[:m]
    cs, ks = (c, kr) if select is None else (c[select], kr[select])
    s = (q_lat.double() @ cs.double().T + q_rot.double() @ ks.double().T) * scale
    ref = torch.softmax(s, dim=-1) @ cs.double()
    check(f"mla_decode H={H} R={R} n={n} m={m}", gen, ref, TB.mla_decode(q_lat, q_rot, c, kr, scale, select),
          lambda: NV.mla_decode(q_lat, q_rot, c, kr, scale, select))


@pytest.mark.parametrize("Hi,Di,n", [(32, 128, 3000), (2, 16, 37), (40, 64, 65), (32, 128, 1)])
def test_indexer_scores(gen, Hi, Di, n):
    q, w, kc = randn(gen, Hi, Di), randn(gen, Hi, scale=0.1), randn(gen, n, Di)
    ref = (torch.relu(q.double() @ kc.double().T) * w.double()[:, None]).sum(0)
    check(f"indexer_scores {Hi},{Di},{n}", gen, ref, TB.indexer_scores(q, w, kc), lambda: NV.indexer_scores(q, w, kc))


@pytest.mark.parametrize(
    "B,H,R,Dr,cap,sparse", [(3, 8, 512, 64, 300, True), (5, 5, 48, 8, 130, False), (17, 2, 32, 8, 70, True)]
)
def test_mla_decode_rows_give_each_row_its_own_bits(gen, B, H, R, Dr, cap, sparse):
    """One launch over B rows, each with its own cache, length and selection: row b against
    float64, and bit for bit the one-row call on that row (the decode path's batch invariance)."""
    q_lat = randn(gen, B, H, R, scale=0.3)
    q_rot = randn(gen, B, H, 24 + Dr, scale=0.3)[..., 24:]  # a view of q [B, H, dn + Dr], as the model passes it
    c, kr = randn(gen, B, cap, R), randn(gen, B, cap, Dr)  # the model's caches are fp32
    lengths = torch.randint(1, cap + 1, (B,), generator=gen, device=DEV).int()
    m = min(40, cap)
    select = None
    if sparse:  # row b: m distinct positions below its length (fewer valid when length < m)
        select = torch.stack(
            [
                torch.cat(
                    (torch.randperm(int(n), generator=gen, device=DEV), torch.zeros(cap, dtype=torch.long, device=DEV))
                )[:m]
                for n in lengths
            ]
        )
    scale = (R // 4 + Dr) ** -0.5
    refs = []
    for b in range(B):
        n = int(lengths[b])
        pos = torch.arange(n, device=DEV) if select is None else select[b, : min(m, n)]
        cs, ks = c[b, pos].double(), kr[b, pos].double()
        refs.append(torch.softmax((q_lat[b].double() @ cs.T + q_rot[b].double() @ ks.T) * scale, dim=-1) @ cs)
    out = check(
        f"mla_decode rows B={B} H={H} R={R}",
        gen,
        torch.stack(refs),
        TB.mla_decode(q_lat, q_rot, c, kr, scale, select, lengths),
        lambda: NV.mla_decode(q_lat, q_rot, c, kr, scale, select, lengths),
    )
    if out is not None:
        for b in range(B):
            alone = NV.mla_decode(
                q_lat[b], q_rot[b], c[b], kr[b], scale, None if select is None else select[b], lengths[b : b + 1]
            )
            assert torch.equal(out[b], alone), (
                f"row {b} of {B}: bits differ from the one-row call (seed {gen.initial_seed()})"
            )
        dense = NV.mla_decode(q_lat, q_rot.contiguous(), c, kr, scale, select, lengths)
        assert torch.equal(out, dense), f"q_rot read in place against a dense copy (seed {gen.initial_seed()})"


@pytest.mark.parametrize("B,Hi,Di,cap", [(4, 32, 128, 500), (9, 3, 16, 37)])
def test_indexer_scores_and_topk_rows_give_each_row_its_own_bits(gen, B, Hi, Di, cap):
    q, w = randn(gen, B, Hi, Di), randn(gen, B, Hi, scale=0.1)
    kc = randn(gen, B, cap, Di)
    lengths = torch.randint(1, cap + 1, (B,), generator=gen, device=DEV).int()
    lengths[0] = cap
    k = 16
    tb = TB.indexer_scores(q, w, kc, lengths)
    got = NV.indexer_scores(q, w, kc, lengths) if NV is not None else None
    for b in range(B):
        n = int(lengths[b])
        ref = (torch.relu(q[b].double() @ kc[b, :n].double().T) * w[b].double()[:, None]).sum(0)
        assert rel(tb[b, :n], ref) < TOL, f"torch backend row {b} (seed {gen.initial_seed()})"
        if got is not None:
            assert rel(got[b, :n], ref) < TOL, f"nvrtc row {b} (seed {gen.initial_seed()})"
            assert torch.equal(got[b, :n], NV.indexer_scores(q[b], w[b], kc[b], lengths[b : b + 1])[:n]), (
                f"row {b}: one-row bits"
            )
    if got is not None:  # the head-weight scale in the kernel: the bits of torch's w * scale passed in
        s = Hi**-0.5 * Di**-0.5
        scaled = NV.indexer_scores(q, w, kc, lengths, s)
        for b in range(B):
            n = int(lengths[b])
            assert torch.equal(scaled[b, :n], NV.indexer_scores(q, w * s, kc, lengths)[b, :n]), f"row {b}: w_scale bits"
    scores = torch.randint(-3, 4, (B, cap), generator=gen, device=DEV).float()  # ties at the threshold
    for be in [TB] + ([NV] if NV is not None else []):
        sel = be.select_topk(scores, k, lengths)
        assert sel.shape == (B, min(k, cap))
        for b in range(B):
            n = int(lengths[b])
            want = topk_ref(scores[b, :n].tolist(), k) if n > k else list(range(n))
            assert sel[b, : min(k, n)].tolist() == want, f"{be.name} select_topk row {b}, length {n}"


@pytest.mark.parametrize("B,H,dn,dv,R", [(1, 8, 128, 128, 512), (17, 3, 24, 40, 96)])
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
def test_mla_absorb_and_expand_read_the_kv_b_view(gen, B, H, dn, dv, R, wdt):
    """The per-head projections on strided views of kv_b_proj [H * (dn + dv), R], as the model
    passes them; each row equal to its B = 1 call."""
    kv_b = randn(gen, H * (dn + dv), R, scale=R**-0.5, dtype=wdt)
    W = kv_b.view(H, dn + dv, R)
    w_uk, w_uv = W[:, :dn], W[:, dn:]
    q, o_lat = randn(gen, B, H, dn + 16)[..., :dn], randn(gen, B, H, R)  # q_nope: a view of q, as the model passes it
    ref_q = torch.einsum("bhd,hdr->bhr", q.double(), w_uk.double())
    ref_o = torch.einsum("hvr,bhr->bhv", w_uv.double(), o_lat.double())
    for what, ref, tb, nv, x, w in [
        ("mla_absorb", ref_q, TB.mla_absorb(q, w_uk), lambda: NV.mla_absorb(q, w_uk), q, w_uk),
        ("mla_expand", ref_o, TB.mla_expand(o_lat, w_uv), lambda: NV.mla_expand(o_lat, w_uv), o_lat, w_uv),
    ]:
        out = check(f"{what} B={B} H={H} {wdt}", gen, ref, tb, nv)
        if out is not None:
            op = getattr(NV, what)
            for b in (0, B - 1):
                assert torch.equal(out[b], op(x[b : b + 1], w)[0]), f"{what} row {b} of {B}: bits differ alone"
            assert torch.equal(out, op(x.contiguous(), w)), f"{what}: a strided view against a dense copy"


def topk_ref(scores: list[float], k: int) -> list[int]:
    """K31_INDEXER.md: threshold v = k-th largest; positions > v ascending, then == v from the lowest up."""
    k = min(k, len(scores))
    v = sorted(scores, reverse=True)[k - 1]
    above = [i for i, s in enumerate(scores) if s > v]
    equal = [i for i, s in enumerate(scores) if s == v]
    return above + equal[: k - len(above)]


@pytest.mark.parametrize("n,k", [(1, 16), (17, 16), (1000, 7), (5000, 2048), (70000, 2048), (300, 300)])
@pytest.mark.parametrize("kind", ["random", "ties", "signed_zeros"])
def test_select_topk(gen, n, k, kind):
    if kind == "random":
        s = randn(gen, n)
    elif kind == "ties":
        s = torch.randint(0, 7, (n,), generator=gen, device=DEV).float() - 3.0  # large boundary groups
    else:
        s = torch.randint(0, 3, (n,), generator=gen, device=DEV).float() - 1.0
        s = torch.where(s == 0, torch.where(torch.rand(n, generator=gen, device=DEV) < 0.5, -0.0, 0.0), s)
    want = topk_ref(s.tolist(), k)
    tb = TB.select_topk(s, k)
    assert tb.tolist() == want, f"torch backend disagrees with the tie rule (seed {gen.initial_seed()})"
    if NV is not None:
        got = NV.select_topk(s, k)
        assert got.dtype == torch.int64 and got.tolist() == want, (
            f"nvrtc select_topk n={n} k={k} {kind} (seed {gen.initial_seed()})"
        )


@pytest.mark.parametrize(
    "T,E,k,D", [(1, 256, 16, 7168), (8, 896, 16, 512), (2, 2080, 8, 256), (3, 32, 4, 64), (2, 64, 1, 128)]
)
@pytest.mark.parametrize("renorm,scale", [(True, 1.0), (False, 2.446)])
def test_router(gen, T, E, k, D, renorm, scale):
    x = randn(gen, T, D)
    w = randn(gen, E, D, scale=D**-0.5, dtype=torch.bfloat16)
    bias = randn(gen, E, scale=0.05)
    s = torch.sigmoid(x.double() @ w.double().T)
    choice = s + bias.double()
    ch = choice.cpu().tolist()
    ids_ref = torch.tensor([sorted(range(E), key=lambda i: (-ch[t][i], i))[:k] for t in range(T)], device=DEV)
    wr = s.gather(-1, ids_ref)
    if renorm and k > 1:
        wr = wr / (wr.sum(-1, keepdim=True) + 1e-20)
    wr = wr * scale
    ids_tb, w_tb = TB.route(TB.linear(x, w), bias, k, renorm, scale)
    assert torch.equal(ids_tb, ids_ref), f"torch backend router ids (seed {gen.initial_seed()})"
    out = check(
        f"router T={T} E={E} k={k}", gen, wr, w_tb, lambda: NV.route(NV.linear(x, w), bias, k, renorm, scale)[1]
    )
    if NV is not None:
        ids_nv, _ = NV.route(NV.linear(x, w), bias, k, renorm, scale)
        assert ids_nv.dtype == torch.int64 and torch.equal(ids_nv, ids_tb), (
            f"router ids differ (seed {gen.initial_seed()})"
        )
        assert out is not None


@pytest.mark.parametrize("T,E,k,groups", [(2, 896, 16, 112), (2, 896, 16, 1), (3, 24, 16, 3), (1, 40, 40, 5)])
def test_router_ties_go_to_the_lower_id(gen, T, E, k, groups):
    """Experts that share a gate row and a bias tie exactly (the same dot product, bit for bit):
    the kernel takes the lower id first, as the hand-written order (-choice, id) does (groups = 1:
    every expert ties, all of them candidates). A NaN bias still gives k distinct ids in range
    (torch.topk's order: NaN first)."""
    if NV is None:
        pytest.skip("no GPU: the NVRTC router")
    D = 256
    x = randn(gen, T, D)
    g = torch.randint(0, groups, (E,), generator=gen, device=DEV)
    w = randn(gen, groups, D, scale=D**-0.5, dtype=torch.bfloat16)[g]
    bias = randn(gen, groups, scale=0.05)[g]
    logits = NV.linear(x, w)
    ch = (torch.sigmoid(logits.double()).float() + bias).cpu().tolist()  # fp32 choice, as the kernel
    ids_nv, _ = NV.route(logits, bias, k, True, 1.0)
    want = [sorted(range(E), key=lambda i: (-ch[t][i], i))[:k] for t in range(T)]
    assert ids_nv.tolist() == want, f"router ties E={E} k={k} (seed {gen.initial_seed()})"
    bias[E // 2] = float("nan")
    ids_nan, _ = NV.route(logits, bias, k, True, 1.0)
    for t in range(T):
        row = ids_nan[t].tolist()
        assert len(set(row)) == k and all(0 <= i < E for i in row) and row[0] == E // 2, f"NaN bias: ids {row}"


# ---- NVFP4 experts ------------------------------------------------------------------------------


def rand_nvfp4(g, rows: int, cols: int) -> NVFP4Matrix:
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, device=DEV).to(torch.uint8)
    # E4M3 block scales: mostly normal around 1, some subnormal, a few negative; never NaN (0x7f/0xff)
    normal = torch.randint(0x28, 0x49, (rows, cols // 16), generator=g, device=DEV)
    sub = torch.randint(0x01, 0x08, (rows, cols // 16), generator=g, device=DEV)
    u = torch.rand(rows, cols // 16, generator=g, device=DEV)
    sc = torch.where(u < 0.1, sub, normal) | torch.where(u > 0.97, 0x80, 0)
    glob = rand(g, rows, lo=0.5, hi=1.5) * (0.6 / math.sqrt(cols))
    return NVFP4Matrix(packed.contiguous(), sc.to(torch.uint8).contiguous(), glob.contiguous())


def dequant64(m: NVFP4Matrix) -> torch.Tensor:
    lut = torch.tensor(E2M1, dtype=torch.float64, device=m.packed.device)
    e4 = torch.tensor(E4M3, dtype=torch.float64, device=m.packed.device)
    p = m.packed.long()
    vals = torch.stack((lut[p & 15], lut[p >> 4]), dim=-1).reshape(p.shape[0], -1)  # low nibble = even element
    sc = e4[m.scales.long()].repeat_interleave(16, dim=1)
    return vals * sc * m.global_scale.double()[:, None]


def ffn_case(gen, T, k, E, Dl, I):
    """E random NVFP4 experts, T rows routed to k distinct of them, normalised weights, z."""
    experts = {
        e: ExpertWeights(rand_nvfp4(gen, I, Dl), rand_nvfp4(gen, I, Dl), rand_nvfp4(gen, Dl, I)) for e in range(E)
    }
    ids = torch.stack([torch.randperm(E, generator=gen, device=DEV)[:k] for _ in range(T)])
    weights = rand(gen, T, k, lo=0.01, hi=1.0)
    weights = weights / weights.sum(-1, keepdim=True)
    z = randn(gen, T, Dl)
    return experts, ids, weights, z


def ffn_ref(z, ids, weights, experts, beta, lbeta):
    z64 = z.double()
    T, k = ids.shape
    outs = {}
    for e in sorted(set(ids.flatten().tolist())):
        ew = experts[e]
        gte, upe, dne = dequant64(ew.gate), dequant64(ew.up), dequant64(ew.down)
        gg, uu = z64 @ gte.T, z64 @ upe.T
        sig = 1 / (1 + torch.exp(-gg))
        ga = gg * sig if math.isinf(beta) else beta * torch.tanh(gg / beta) * sig
        ua = uu if lbeta is None else lbeta * torch.tanh(uu / lbeta)
        outs[e] = (ga * ua) @ dne.T  # [T, Dl]: expert e applied to every row
    rows = []
    for t in range(T):
        acc = torch.zeros(z.shape[1], dtype=torch.float64, device=z.device)
        for j in range(k):
            acc = acc + weights[t, j].double() * outs[int(ids[t, j])][t]
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize(
    "T,k,E,Dl,I",
    [(1, 16, 16, 3584, 3072), (1, 4, 32, 32, 64), (3, 4, 6, 64, 96), (5, 16, 20, 64, 96), (2, 8, 8, 256, 512),
     (5, 16, 20, 128, 384), (1, 2, 3, 640, 128),
     # more rows per expert than a tensor-core block takes (TC_TOKENS = 8): groups cut, chunks of 64
     (12, 4, 5, 128, 256), (24, 6, 8, 256, 128)],
)
@pytest.mark.parametrize("impl", ["tc", "cuda_core"])
def test_expert_ffn(gen, T, k, E, Dl, I, impl):
    nv = NV_IMPLS[impl]
    if CPU_DRY and Dl > 1000:
        pytest.skip("slice geometry: GPU only")
    experts, ids, weights, z = ffn_case(gen, T, k, E, Dl, I)
    ref = ffn_ref(z, ids, weights, experts, 4.0, 25.0)
    tb = TB.expert_ffn(z, ids, weights, experts, 4.0, 25.0)
    out = check(
        f"expert_ffn[{impl}] T={T} k={k} Dl={Dl} I={I}",
        gen,
        ref,
        tb,
        lambda: nv.expert_ffn(z, ids, weights, experts, 4.0, 25.0),
    )
    if out is not None:
        assert torch.equal(nv.expert_ffn(z, ids.cpu(), weights, experts, 4.0, 25.0), out), "host ids / rerun differ"
    if out is not None and T > 1:  # batch invariance: each row alone gives the same bits
        for t in range(T):
            alone = nv.expert_ffn(z[t : t + 1], ids[t : t + 1], weights[t : t + 1], experts, 4.0, 25.0)
            assert torch.equal(alone[0], out[t]), f"expert_ffn row {t} differs alone vs in the batch"


def _resident(experts, ids, E, Dl, device) -> ResidentExperts:
    """The CUDA-graph path's experts: every expert of layer 0 in a device pointer table."""
    table = ExpertTable([0], E, Dl, device)
    for e, ew in experts.items():
        table.place(0, e, ew)
    table.upload()
    return ResidentExperts(experts, table.layer(0), table.inter, ids.to(DEV), 0)


def _launched(nv, call) -> list[str]:
    """The kernels `call()` launches on backend nv, by name, in order."""
    launched = []
    real_k = nv._k
    nv._k = lambda program, name: launched.append(name) or real_k(program, name)
    try:
        call()
    finally:
        del nv._k
    return launched


@pytest.mark.parametrize("T,k", [(20, 8), (70, 16)])
@pytest.mark.parametrize("impl", ["tc", "cuda_core"])
def test_expert_ffn_device_table_gives_the_host_bits(gen, T, k, impl):
    """The CUDA-graph path (ResidentExperts: device ids and the layer's pointer table; up to
    MOE_MAXP_DT = 1024 pairs per launch, so up to TC_TOKENS rows of one expert from the whole
    batch share a block) against the host path (by-value tables of MOE_MAXP = 64 pairs): the
    same bits. T=20 x 8: one device table for three host ones; T=70 x 16: two device tables."""
    E, Dl, I = 24, 128, 256
    experts, ids, weights, z = ffn_case(gen, T, k, E, Dl, I)
    resident = _resident(experts, ids, E, Dl, z.device)
    ref = ffn_ref(z, ids, weights, experts, 4.0, 25.0)
    tb = TB.expert_ffn(z, ids, weights, experts, 4.0, 25.0)
    nv = NV_IMPLS[impl]
    out = check(f"expert_ffn[{impl}] device table T={T} k={k}", gen, ref, tb,
                lambda: nv.expert_ffn(z, resident.ids, weights, resident, 4.0, 25.0))
    if out is not None:
        assert torch.equal(out, nv.expert_ffn(z, ids.cpu(), weights, experts, 4.0, 25.0)), "device table vs host tables"


@pytest.mark.parametrize(
    "T,k,E,Dl,I",
    [(16, 16, 24, 3584, 3072),  # deep-k3.1-pro at B=16: ~11 rows an expert
     (9, 16, 16, 3584, 3072),  # 9 rows an expert: three sets
     (20, 6, 8, 256, 384),  # up to 20 rows an expert: groups of 16 and 4; partial last blocks
     (8, 4, 5, 640, 896),  # the fewest rows that take the staged blocks
     (40, 8, 10, 128, 256),  # more pairs than a by-value table (64): groups cut at chunks
     (70, 16, 24, 128, 256)],  # two device tables (1,120 pairs), each with its list of groups
)
def test_expert_ffn_staged_rows_give_the_8_row_bits(gen, T, k, E, Dl, I):
    """From 8 rows on, gate+up reads rows of z staged once per call (srt_moe_stage_rows), up to 16
    rows of one expert a block; down reads h's rows staged the same way over gate+up's groups:
    within the float64 reference, and every row's bits those of the row alone (the blocks that
    stage their own rows), on the host tables and on the device table, with and without
    programmatic launch."""
    if CPU_DRY and Dl > 1000:
        pytest.skip("slice geometry: GPU only")
    experts, ids, weights, z = ffn_case(gen, T, k, E, Dl, I)
    ref = ffn_ref(z, ids, weights, experts, 4.0, 25.0)
    tb = TB.expert_ffn(z, ids, weights, experts, 4.0, 25.0)
    nv = NV_IMPLS["tc"]
    out = check(f"expert_ffn staged T={T} k={k} Dl={Dl} I={I}", gen, ref, tb,
                lambda: nv.expert_ffn(z, ids, weights, experts, 4.0, 25.0))
    if out is None:
        return
    launched = _launched(nv, lambda: nv.expert_ffn(z, ids, weights, experts, 4.0, 25.0))
    assert launched[0] == "srt_moe_stage_rows" and "srt_nvfp4_gateup_st2x1" in launched, launched
    assert "srt_nvfp4_down_st2x1" in launched, launched
    for t in range(T):
        alone = nv.expert_ffn(z[t : t + 1], ids[t : t + 1], weights[t : t + 1], experts, 4.0, 25.0)
        assert torch.equal(alone[0], out[t]), f"staged row {t} differs from the row alone (8-row blocks)"
    resident = _resident(experts, ids, E, Dl, z.device)
    assert torch.equal(nv.expert_ffn(z, resident.ids, weights, resident, 4.0, 25.0), out), "device table"
    pdl = nv.pdl
    try:
        nv.pdl = not pdl
        assert torch.equal(nv.expert_ffn(z, ids, weights, experts, 4.0, 25.0), out), f"pdl={not pdl}"
    finally:
        nv.pdl = pdl


# The grouped prefill GEMMs' single fp16 row mode rounds each row once (2^-11 of each element,
# nvfp4_gemm.py): its outputs are held to this of the float64 reference (3e-4 .. 5.4e-4 seen on
# the CPU twin at Dl 64 and 256), and to GROUPED_TWIN of the twin's torch ops run on the same
# device (the same GEMMs; apart by fp32 SiTU ulps that move an fp16 rounding of h: an element of
# h then moves one fp16 step, 2^-11 of it at most, so the outputs stay within 2^-11 relatively.
# How many elements move is chance: 1e-4 failed once, at 2.1e-4, T=300).
GROUPED_FP16_TOL = 4 * 2.0**-11
GROUPED_TWIN = 2.0**-11


def _grouped_twin(z, ids, weights, experts, rows):
    """The grouped path in torch ops (TorchFp16) on z's device, summed over the k slots."""
    T, k = ids.shape
    y = grouped_expert_pairs(z, ids.cpu().tolist(), RoutedExperts(experts, ids.cpu()), 4.0, 25.0, rows=rows)
    return (weights[..., None] * y.view(T, k, -1)).sum(1)


@pytest.mark.parametrize("rows", ["fp16", "split"])
@pytest.mark.parametrize("T,k,E,Dl,I", [(40, 16, 24, 3584, 3072), (7, 4, 6, 64, 96), (300, 8, 12, 256, 512)])
def test_expert_ffn_grouped_prefill(gen, T, k, E, Dl, I, rows):
    """The prefill view's grouped GEMMs (nvfp4_gemm.py), both row modes: split within the
    tolerance of the float64 reference and of the decode kernels; single fp16 rows within theirs
    and close to the CPU twin's arithmetic, but not split-accurate; the same bits when rerun."""
    if CPU_DRY and Dl > 1000:
        pytest.skip("slice geometry: GPU only")
    experts, ids, weights, z = ffn_case(gen, T, k, E, Dl, I)
    ref = ffn_ref(z, ids, weights, experts, 4.0, 25.0)
    tb = TB.expert_ffn(z, ids, weights, experts, 4.0, 25.0)
    twin = _grouped_twin(z, ids, weights, experts, rows)
    tol = TOL if rows == "split" else GROUPED_FP16_TOL
    assert rel(twin, ref) < tol, (
        f"grouped twin [{rows}] vs float64 rel err {rel(twin, ref):.3g} (seed {gen.initial_seed()})"
    )
    assert rows == "split" or rel(twin, ref) > TOL, (
        f"grouped twin [fp16] as accurate as the split (seed {gen.initial_seed()})"
    )
    if NV is None:
        return
    pre = NV.for_prefill()
    pre.prefill_rows, pre.grouped_min_pairs = rows, 0  # grouped however few rows per expert
    assert pre.grouped_prefill and not NV.grouped_prefill and NV.prefill_rows == "fp16"
    what = f"grouped expert_ffn [{rows}] T={T} k={k} Dl={Dl} I={I}"
    out = check(what, gen, ref, tb, lambda: pre.expert_ffn(z, ids, weights, experts, 4.0, 25.0), tol=tol)
    assert rel(out, twin) < (2 * TOL if rows == "split" else GROUPED_TWIN), f"{what}: vs the twin {rel(out, twin):.3g}"
    if rows == "split":
        assert rel(out, NV.expert_ffn(z, ids, weights, experts, 4.0, 25.0)) < 2 * TOL
    else:
        assert rel(out, ref) > TOL, f"{what}: as accurate as the split (seed {gen.initial_seed()})"
    assert torch.equal(pre.expert_ffn(z, ids.cpu(), weights, experts, 4.0, 25.0), out)


@pytest.mark.skipif(NV is None, reason="kernel property")
def test_short_prefill_chunk_takes_the_decode_kernels(gen):
    """A prefill chunk with fewer (row, expert) pairs per routed expert than grouped_min_pairs
    runs the per-pair decode kernels (their bits); at the threshold it runs the grouped GEMMs."""
    T, k, E, Dl, I = 12, 4, 6, 256, 512  # 48 pairs over at most 6 experts: 8 or more per expert
    experts, ids, weights, z = ffn_case(gen, T, k, E, Dl, I)
    decode = NV.expert_ffn(z, ids, weights, experts, 4.0, 25.0)
    pre = NV.for_prefill()
    unique = len(set(ids.flatten().tolist()))
    pre.grouped_min_pairs = T * k // unique + 1
    assert torch.equal(pre.expert_ffn(z, ids, weights, experts, 4.0, 25.0), decode)
    pre.grouped_min_pairs = T * k // unique
    assert not torch.equal(pre.expert_ffn(z, ids, weights, experts, 4.0, 25.0), decode)


@pytest.mark.parametrize("split", [False, True])
def test_grouped_conversions_match_the_twin(gen, split):
    """Each conversion kernel of the grouped GEMMs (kernels/nvfp4_gemm.cu) against float64 and
    against TorchFp16 on the same inputs: the weight expansion (gate and up stacked) exact, the
    fp16 rows, the pairs' scatter bit-identical, SiTU's rows within one fp16 rounding."""
    m, Dl, I, P = 37, 256, 384, 100
    f = 1 + split
    convs = [TORCH_FP16] + ([NV] if NV is not None else [])
    gate, up, down = rand_nvfp4(gen, I, Dl), rand_nvfp4(gen, I, Dl), rand_nvfp4(gen, Dl, I)
    x = randn(gen, m, Dl) * torch.logspace(-8, 8, m, device=DEV)[:, None]
    x[5] = 0.0
    gu = randn(gen, f * m, 2 * I, scale=3.0)
    xscale = torch.exp2(torch.randint(-3, 4, (m,), generator=gen, device=DEV).float())
    d = randn(gen, f * m, Dl)
    pairs = torch.randperm(P, generator=gen, device=DEV)[:m]
    outs = []
    for conv in convs:
        gu16, dn16 = conv.fp16_weights(gate, up), conv.fp16_weights(down)
        glob = torch.cat((gate.global_scale, up.global_scale)).double()
        assert torch.equal(gu16.double() * glob[:, None], torch.cat((dequant64(gate), dequant64(up))))
        assert torch.equal(dn16.double() * down.global_scale.double()[:, None], dequant64(down))
        x16, s = conv.fp16_rows(x, split)
        back = (x16[:m].double() + (x16[m:].double() if split else 0)) * s.double()[:, None]
        bound = (2.0**-22 if split else 2.0**-11) * x.double().abs() + 2.0**-25 * s.double()[:, None]
        assert ((back - x.double()).abs() <= bound).all(), f"{type(conv).__name__}: fp16 rows beyond their bound"
        h16, hs = conv.situ_rows(gu, xscale, gate.global_scale, up.global_scale, 4.0, 25.0, split)
        g64 = (gu[:m].double() + (gu[m:].double() if split else 0)) * xscale.double()[:, None]
        g, u = g64[:, :I] * gate.global_scale.double(), g64[:, I:] * up.global_scale.double()
        h64 = 4.0 * torch.tanh(g / 4.0) / (1 + torch.exp(-g)) * 25.0 * torch.tanh(u / 25.0)
        hb = (h16[:m].double() + (h16[m:].double() if split else 0)) * hs.double()[:, None]
        hbound = ((2.0**-22 if split else 2.0**-11) + 4e-6) * hs.double()[:, None]
        assert ((hb - h64).abs() <= hbound).all(), f"{type(conv).__name__}: SiTU rows beyond their bound"
        y = torch.full((P, Dl), float("nan"), device=DEV)
        conv.scatter_rows(d, hs, down.global_scale, pairs, y, split)
        outs.append((gu16, dn16, x16, s, h16, hs, y))
    if NV is None:
        return
    (gu_t, dn_t, x16_t, s_t, h16_t, hs_t, y_t), (gu_k, dn_k, x16_k, s_k, h16_k, hs_k, y_k) = outs
    assert torch.equal(gu_k, gu_t) and torch.equal(dn_k, dn_t), "weight expansion differs from the twin"
    assert torch.equal(x16_k, x16_t) and torch.equal(s_k, s_t), "fp16 rows differ from the twin"
    hk = (h16_k[:m].float() + (h16_k[m:].float() if split else 0)) * hs_k[:, None]
    ht = (h16_t[:m].float() + (h16_t[m:].float() if split else 0)) * hs_t[:, None]
    assert ((hk - ht).abs() <= 2.0**-10 * hs_t[:, None]).all(), "SiTU rows beyond one rounding of the twin's"
    y_t = torch.full((P, Dl), float("nan"), device=DEV)  # the twin's scatter of the kernel's h scales
    TORCH_FP16.scatter_rows(d, hs_k, down.global_scale, pairs, y_t, split)
    assert torch.equal(torch.isnan(y_k), torch.isnan(y_t)) and torch.equal(y_k.nan_to_num(), y_t.nan_to_num()), \
        "scatter differs from the twin"


@pytest.mark.skipif(NV is None, reason="kernel property")
def test_expert_ffn_tc_without_pdl_same_bits(gen):
    """Programmatic launch of the tensor-core kernels changes timing only: same bits."""

    E, T, k, Dl, I = 8, 6, 4, 640, 896  # 5 and 7 column blocks: partial last stages; up to 6 rows per expert
    experts = {
        e: ExpertWeights(rand_nvfp4(gen, I, Dl), rand_nvfp4(gen, I, Dl), rand_nvfp4(gen, Dl, I)) for e in range(E)
    }
    ids = torch.stack([torch.randperm(E, generator=gen, device=DEV)[:k] for _ in range(T)])
    weights, z = rand(gen, T, k, lo=0.01, hi=1.0), randn(gen, T, Dl)
    nv = NV_IMPLS["tc"]
    base = nv.expert_ffn(z, ids, weights, experts, 4.0, 25.0)
    pdl0 = nv.pdl
    try:
        nv.pdl = not pdl0
        assert torch.equal(nv.expert_ffn(z, ids, weights, experts, 4.0, 25.0), base), f"pdl {not pdl0}"
    finally:
        nv.pdl = pdl0


@pytest.mark.skipif(NV is None, reason="kernel property")
@pytest.mark.parametrize("T", [1, 6])
def test_expert_ffn_back_to_back_same_bits(gen, T):
    """Calls queued back to back (programmatic launches overlapping the call before, down blocks
    starting on their pair's gate+up count, the sum zeroing the counts for the next call) give
    the same bits as one call alone (each call routes z to other experts: a down block reading h
    before its gate+up blocks wrote it would see the call before's)."""
    E, k, Dl, I = 6, 4, 256, 384  # a grid small enough for every block of a launch to be resident
    experts = {
        e: ExpertWeights(rand_nvfp4(gen, I, Dl), rand_nvfp4(gen, I, Dl), rand_nvfp4(gen, Dl, I)) for e in range(E)
    }
    nv = NV_IMPLS["tc"]
    ids = [torch.stack([torch.randperm(E, generator=gen, device=DEV)[:k] for _ in range(T)]).cpu() for _ in range(20)]
    weights = [rand(gen, T, k, lo=0.01, hi=1.0) for _ in range(20)]
    z0 = randn(gen, T, Dl)

    def chain(sync):
        outs = []
        for i in range(20):
            outs.append(nv.expert_ffn(z0, ids[i], weights[i], experts, 4.0, 25.0))
            if sync:
                torch.cuda.synchronize()
        return outs

    alone = chain(True)
    for _ in range(3):
        for i, (a, b) in enumerate(zip(alone, chain(False))):
            assert torch.equal(a, b), f"call {i} of a back-to-back chain differs from the same call alone"


@pytest.mark.skipif(NV is None, reason="kernel property")
def test_expert_ffn_error_after_launch_leaves_no_counts(gen):
    """An error raised once the resident experts' kernels are queued (a late expert of another
    intermediate size) leaves no gate+up counts behind for the next call to trust."""
    k, Dl, I = 4, 256, 384
    experts = {
        e: ExpertWeights(rand_nvfp4(gen, I, Dl), rand_nvfp4(gen, I, Dl), rand_nvfp4(gen, Dl, I)) for e in range(k)
    }
    bad = dict(experts)
    bad[3] = ExpertWeights(rand_nvfp4(gen, 512, Dl), rand_nvfp4(gen, 512, Dl), rand_nvfp4(gen, Dl, 512))
    nv = NV_IMPLS["tc"]
    ids, w = torch.arange(k).view(1, k), rand(gen, 1, k, lo=0.01, hi=1.0)
    z1, z2 = randn(gen, 1, Dl), randn(gen, 1, Dl)
    want = nv.expert_ffn(z2, ids, w, experts, 4.0, 25.0)
    with pytest.raises(ValueError, match="intermediate size"):
        nv.expert_ffn(z1, ids, w, _LateExperts(bad, {3}, ids), 4.0, 25.0)
    torch.cuda.synchronize()
    assert int(nv._ready.abs().sum()) == 0, "gate+up counts left behind by the failed call"
    assert torch.equal(nv.expert_ffn(z2, ids, w, experts, 4.0, 25.0), want)


class _LateExperts(RoutedExperts):
    """Like the runtime's StreamedExperts: some experts report a pending copy."""

    def __init__(self, experts, late, ids):
        super().__init__(experts, ids.cpu())
        self.late = set(late)

    def pending(self, e):
        return e in self.late


@pytest.mark.skipif(NV is None, reason="kernel property")
@pytest.mark.parametrize("impl", ["tc", "cuda_core"])
def test_expert_ffn_late_experts_same_bits(gen, impl):
    """Experts still in flight are launched after the resident ones (a second launch group);
    the result bits do not depend on that split."""
    nv = NV_IMPLS[impl]
    E, T, k, Dl, I = 12, 3, 4, 256, 384
    experts = {
        e: ExpertWeights(rand_nvfp4(gen, I, Dl), rand_nvfp4(gen, I, Dl), rand_nvfp4(gen, Dl, I)) for e in range(E)
    }
    ids = torch.stack([torch.randperm(E, generator=gen, device=DEV)[:k] for _ in range(T)])
    weights = rand(gen, T, k, lo=0.01, hi=1.0)
    z = randn(gen, T, Dl)
    base = nv.expert_ffn(z, ids, weights, experts, 4.0, 25.0)
    for late in ([int(ids[0, 0])], ids[:, 1].tolist(), list(range(E))):
        got = nv.expert_ffn(z, ids, weights, _LateExperts(experts, late, ids), 4.0, 25.0)
        assert torch.equal(got, base), f"late experts {late}: bits differ"


# ---- AttnRes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,nb,D", [(1, 8, 7168), (3, 0, 64), (2, 3, 100), (3, 19, 9000)])
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
def test_attnres_mix(gen, T, nb, D, wdt):
    """Sources read in place from separate tensors (one a strided view), wq formed from the norm
    gain and the projection row in the kernel; 9000 = 35 full slices and a part one, 20 sources
    more than a block's 8 warps; a row's bits do not depend on the rows beside it."""
    prefix = randn(gen, T, D, scale=2.0)
    wide = randn(gen, T, 2 * D)
    blocks = [randn(gen, T, D) * (i + 1) for i in range(nb)]
    if nb:
        blocks[0] = wide[:, D:]  # not contiguous
    norm_w, proj_w = (1 + randn(gen, D, scale=0.1)).to(wdt), randn(gen, D, scale=0.05).to(wdt)
    V = torch.stack([b.double() for b in (*blocks, prefix)], dim=1)
    kn = V / torch.sqrt((V * V).mean(-1, keepdim=True) + 1e-5)
    p = torch.softmax((kn * (norm_w.double() * proj_w.double())).sum(-1), dim=-1)
    ref = (p[..., None] * V).sum(1)
    mix = check(
        f"attnres_mix T={T} nb={nb} D={D} {wdt}",
        gen,
        ref,
        TB.attnres_mix(prefix, blocks, norm_w, proj_w, 1e-5),
        lambda: NV.attnres_mix(prefix, blocks, norm_w, proj_w, 1e-5),
    )
    # then the layer's RMSNorm (out_w): float64, and the bits of the two ops in turn
    out_w = (1 + randn(gen, D, scale=0.2)).to(wdt)
    ref_n = ref / torch.sqrt((ref * ref).mean(-1, keepdim=True) + 1e-6) * out_w.double()
    normed = check(f"attnres_mix + rmsnorm T={T} nb={nb} D={D} {wdt}", gen, ref_n,
                   TB.attnres_mix(prefix, blocks, norm_w, proj_w, 1e-5, out_w, 1e-6),
                   lambda: NV.attnres_mix(prefix, blocks, norm_w, proj_w, 1e-5, out_w, 1e-6))
    if normed is not None:
        assert torch.equal(normed, NV.rmsnorm(mix, out_w, 1e-6))
        last = NV.attnres_mix(prefix[-1:], [b[-1:] for b in blocks], norm_w, proj_w, 1e-5)
        assert torch.equal(last, mix[-1:]), "row T-1 alone: bits differ from the batch's"
        last_n = NV.attnres_mix(prefix[-1:], [b[-1:] for b in blocks], norm_w, proj_w, 1e-5, out_w, 1e-6)
        assert torch.equal(last_n, normed[-1:]), "normed row T-1 alone: bits differ from the batch's"
        assert torch.equal(NV.attnres_mix(prefix, blocks, norm_w, proj_w, 1e-5, out_w, 1e-6), normed), (
            "not deterministic"
        )


# ---- the decode's cache append -------------------------------------------------------------------


@pytest.mark.parametrize("B", [1, 3])
def test_cache_append_writes_each_row_at_its_length(gen, B):
    """Three caches, one source a strided slice (MLA's kr is a column slice of kv): row b lands at
    position lengths[b] of each cache and nothing else changes."""
    cap, widths = 11, (64, 8, 40)
    caches = [randn(gen, B, cap, w) for w in widths]
    wide = randn(gen, B, 72)
    rows = [randn(gen, B, 64), wide[:, 64:], randn(gen, B, 40)]  # rows[1]: not contiguous
    lengths = torch.randint(0, cap, (B,), generator=gen, device=DEV, dtype=torch.int32)
    want = [c.clone() for c in caches]
    for w, r in zip(want, rows):
        for b in range(B):
            w[b, int(lengths[b])] = r[b]
    for be in (TB, NV):
        if be is None:
            continue
        got = [c.clone() for c in caches]
        be.cache_append(got, rows, lengths)
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"{type(be).__name__}: cache {i} differs (B={B}, lengths {lengths.tolist()})"


# ---- determinism --------------------------------------------------------------------------------


@pytest.mark.skipif(NV is None, reason="kernel property")
def test_deterministic_run_to_run(gen):
    q_lat, q_rot = randn(gen, 16, 512), randn(gen, 16, 64)
    c, kr = randn(gen, 3000, 512), randn(gen, 3000, 64)
    a = NV.mla_decode(q_lat, q_rot, c, kr, 0.07, None)
    b = NV.mla_decode(q_lat, q_rot, c, kr, 0.07, None)
    assert torch.equal(a, b)
    s = randn(gen, 20000)
    assert torch.equal(NV.select_topk(s, 2048), NV.select_topk(s, 2048))


@pytest.mark.parametrize("T,N,K", [(65, 300, 2048), (513, 1000, 7168)])
def test_linear_prefill_bf16x3_is_fp32_accurate(gen, T, N, K):
    """More than 64 rows of bf16 weights: the three-term bf16 GEMM is as accurate as an fp32
    GEMM, within 3x the error of one (torch's, no TF32) on the same device and inputs, or
    TOL. At K = 7168 an fp32 dot product's rounding alone comes near TOL in the largest of
    513,000 outputs (seen: 1.03e-5 at seed 1640027230); a GEMM of bf16(x) alone is ~1e-3 off.
    The three-term GEMM's largest error there is 0.8-1.2e-5 over seeds (H100), so K = 7168
    gets twice TOL: still two orders below bf16(x) alone."""
    x = randn(gen, T, K)
    w = randn(gen, N, K, scale=K**-0.5, dtype=torch.bfloat16)
    ref = x.double() @ w.double().T
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        e32 = rel(x @ w.float().T, ref)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    check(f"linear prefill T={T} K={K} (fp32 GEMM error {e32:.3g})", gen, ref, TB.linear(x, w), lambda: NV.linear(x, w),
          tol=max(TOL * (2 if K >= 4096 else 1), 3 * e32))
