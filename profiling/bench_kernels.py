"""Kernel bandwidth benchmark for the nvrtc backend (one run, one GPU).

1. The HBM copy rate: a large device-to-device copy (bytes read + bytes written per second).
2. NVFP4 expert FFN at `slice` geometry (Dl=3584, I=3072, 16 experts of one layer, one token):
   effective bytes/s = expert bytes read (nibbles + E4M3 scales + global scales) / time; and a
   batch of T = 4, 16 rows through 16 of 24 experts (each distinct expert's bytes counted once).
3. BF16 GEMV at T=1 (7168x12288 and 12288x7168) and T=4, 8 (7168x12288): weight bytes / time
   (with --variants every stage depth and K split of the tensor-core kernel, and the CUDA-core one);
   deep-k3.1-pro's decode GEMV launches at T=1 and at T=16.
4. A few other decode ops, for the record.
Each timing replays a CUDA graph of `--reps` back-to-back calls (no Python in the loop),
median of `--trials`. Ratios are against the copy rate of the same run (target >= 0.8).

    python profiling/bench_kernels.py [--markdown out.md]
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamrt.backends.gemv_plan import GEMV_VARIANTS, gemv_plan  # noqa: E402
from streamrt.backends.nvrtc import NvrtcBackend  # noqa: E402
from streamrt.backends.nvrtc_moe import tc_smem  # noqa: E402
from streamrt.backends.torch_backend import TorchBackend  # noqa: E402
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix  # noqa: E402


def graph_time(fn, reps: int, trials: int) -> float:
    """Seconds per call of fn, replaying a CUDA graph of `reps` calls; median over trials."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(times)


def loop_time(fn, reps: int, trials: int) -> float:
    """Seconds per call, plain loop between two events (for code that syncs, e.g. the torch backend)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(trials):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(times)


def copy_rate(nbytes: int, trials: int) -> tuple[float, dict[str, float]]:
    """The best of three large D2D copies (bytes read + written per second): cudaMemcpy in a
    loop, the same in a CUDA graph, and an SM copy kernel (fp32 elementwise)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    af, bf = a.view(torch.float32), b.view(torch.float32)
    rates = {
        "memcpy": 2 * nbytes / loop_time(lambda: b.copy_(a), 5, trials),
        "memcpy (graph)": 2 * nbytes / graph_time(lambda: b.copy_(a), 5, trials),
        "kernel": 2 * nbytes / loop_time(lambda: torch.mul(af, 1.0, out=bf), 5, trials),
    }
    return max(rates.values()), rates


def rand_nvfp4(rows: int, cols: int) -> NVFP4Matrix:
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(0x28, 0x49, (rows, cols // 16), dtype=torch.uint8, device="cuda")
    glob = torch.rand(rows, device="cuda") * (0.6 / math.sqrt(cols)) + 1e-3
    return NVFP4Matrix(packed, scales, glob)


def nbytes(m: NVFP4Matrix) -> int:
    return sum(t.numel() * t.element_size() for t in (m.packed, m.scales, m.global_scale))


def kernel_times(nvb, z, ids, w, experts, calls: int = 20) -> dict[str, float]:
    """Each expert-FFN kernel's own device time (us per call), by torch.profiler (it sees
    driver-API launches)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        nvb.expert_ffn(z, ids, w, experts, 4.0, 25.0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            nvb.expert_ffn(z, ids, w, experts, 4.0, 25.0)
        torch.cuda.synchronize()
    return {ev.key: ev.device_time_total / max(1, ev.count) for ev in prof.key_averages()
            if "nvfp4" in ev.key or "combine" in ev.key}


def diagnose_expert_ffn(nv, experts, Dl, I, k, dev, bench, ex_bytes) -> None:
    """Where the expert FFN's time goes: resident blocks per SM of the default kernels, more
    pairs per launch through the same experts, and each kernel's own time as the distinct
    experts per launch grow (16, 32, 48): the slope is the kernel's streaming rate, the
    intercept its fixed cost (ramp, last wave, launch)."""
    tg, td, st, kbs = nv.tc_shape
    for name, threads, smem in ((f"srt_nvfp4_gateup_tc{st}x{kbs}", tg * 32, tc_smem(Dl, tg, st, kbs)),
                                (f"srt_nvfp4_down_tc{st}x{kbs}", td * 32, tc_smem(I, td, st, kbs))):
        print(
            f"diagnose: {name}: {threads} threads, {smem} B shared -> "
                f"{nv._k('nvfp4_moe', name).blocks_per_sm(threads, smem)} blocks/SM"
        )
    for T in (2, 4):
        ids = torch.arange(k).repeat(T, 1)  # each token through the same 16 experts: T x the bytes per launch
        w = torch.softmax(torch.randn(T, k, device=dev), -1)
        z = torch.randn(T, Dl, device=dev)
        bench(f"  diagnose: nvfp4 FFN with {T * k} pairs per launch (T={T}, bytes counted {T}x)", T * ex_bytes,
              lambda ids=ids, w=w, z=z: nv.expert_ffn(z, ids, w, experts, 4.0, 25.0))
    plain = NvrtcBackend()
    plain.pdl = False  # one kernel after another: each one's time is its own
    many = dict(experts)
    for e in range(k, 48):
        many[e] = ExpertWeights(rand_nvfp4(I, Dl), rand_nvfp4(I, Dl), rand_nvfp4(Dl, I))
    per_expert = ex_bytes / k
    z = torch.randn(1, Dl, device=dev)
    fits = {}
    for n in (16, 32, 48):
        ids = torch.arange(n).view(1, n)
        w = torch.softmax(torch.randn(1, n, device=dev), -1)
        bench(f"  diagnose: nvfp4 FFN, {n} distinct experts per launch, T=1", n * per_expert,
              lambda ids=ids, w=w: nv.expert_ffn(z, ids, w, many, 4.0, 25.0))
        for key, us in kernel_times(plain, z, ids, w, many).items():
            fits.setdefault(key, []).append((n, us))
    for key, pts in fits.items():
        (n0, t0), (n1, t1) = pts[0], pts[-1]
        slope = (t1 - t0) / (n1 - n0)  # us per expert
        part = 2 / 3 if "gateup" in key else 1 / 3 if "down" in key else 0.0
        rate = f" = {part * per_expert / slope / 1e3:.0f} GB/s streaming" if part and slope > 0 else ""
        print(f"diagnose: {key}: " + ", ".join(f"{n} experts {us:.1f} us" for n, us in pts)
              + f"; {slope:.2f} us per expert{rate}, fixed {t0 - slope * n0:.1f} us")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--copy-gib", type=float, default=4.0)
    ap.add_argument("--markdown", type=Path, default=None, help="also write the markdown table here")
    ap.add_argument("--torch", action="store_true", help="also time the torch backend for each op")
    ap.add_argument("--variants", action="store_true",
                    help="also time every GEMV variant (rows per warp) and NVFP4 block shape, to check the defaults")
    ap.add_argument(
        "--ffn-only", action="store_true", help="only the NVFP4 expert FFN rows (with --variants: its diagnosis)"
    )
    ap.add_argument(
        "--no-ffn", action="store_true", help="skip the NVFP4 expert FFN rows (GEMV and the other ops only)"
    )
    ap.add_argument("--gemv-groups-only", action="store_true",
                    help="only deep-k3.1-pro's decode GEMV launches (T=1 and T=16) against cuBLAS")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    nv, tb = NvrtcBackend(), TorchBackend()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    copy, copy_kinds = copy_rate(int(args.copy_gib * 2**30), args.trials)
    rows = []  # (name, bytes, seconds, torch seconds or None)

    def bench(name, nb, fn, tfn=None):
        if not rows:  # the first op timed in a process ran up to 12 % slow (seen with --no-ffn): warm it up once
            graph_time(fn, args.reps, args.trials)
        t = graph_time(fn, args.reps, args.trials)
        tt = loop_time(tfn, max(1, args.reps // 4), 3) if (args.torch and tfn is not None) else None
        rows.append((name, nb, t, tt))

    if args.gemv_groups_only:
        decode_gemv_groups(args, nv, dev, bench)
    else:
        if not args.no_ffn:
            expert_ffn_rows(args, nv, tb, dev, bench)
        if not args.ffn_only:
            other_ops(args, nv, tb, dev, bench)
    write_table(args, props, copy, copy_kinds, rows)
    return 0


def expert_ffn_rows(args, nv, tb, dev, bench) -> None:
    """NVFP4 expert FFN at slice geometry, 16 experts in one launch (with --variants every block shape)."""
    Dl, I, k = 3584, 3072, 16
    experts = {e: ExpertWeights(rand_nvfp4(I, Dl), rand_nvfp4(I, Dl), rand_nvfp4(Dl, I)) for e in range(k)}
    ids = torch.arange(k).view(1, k)  # host ids: the graph captures launches, not a sync
    w = torch.softmax(torch.randn(1, k, device=dev), -1)
    z = torch.randn(1, Dl, device=dev)
    ex_bytes = sum(nbytes(m) for ew in experts.values() for m in (ew.gate, ew.up, ew.down))
    bench("nvfp4 expert FFN slice (16 x 3584x3072 x3), T=1", ex_bytes,
          lambda: nv.expert_ffn(z, ids, w, experts, 4.0, 25.0),
          lambda: tb.expert_ffn(z, ids.to(dev), w, experts, 4.0, 25.0))

    if args.variants:  # block and pipeline shapes of the tensor-core kernels (same bits)
        for shape, pdl, pair in (((8, 7, 2, 2), False, False), ((8, 7, 2, 2), True, False), ((8, 7, 2, 2), False, True),
                                 ((8, 7, 2, 2), True, True), ((8, 8, 2, 2), True, True), ((8, 4, 2, 2), True, True),
                                 ((6, 7, 3, 2), True, True)):
            nvw = NvrtcBackend()
            nvw.tc_shape, nvw.pdl, nvw.pair_ready = shape, pdl and nv.pdl, pair
            bench(f"  variant: nvfp4 FFN tc, warps/block gate-up {shape[0]}, down {shape[1]}, stages {shape[2]} x "
                  f"{shape[3]} blocks, programmatic launch {'on' if nvw.pdl else 'off'}, down starts on "
                  f"{'its pair' if pair else 'the whole gate+up grid'}", ex_bytes,
                  lambda nvw=nvw: nvw.expert_ffn(z, ids, w, experts, 4.0, 25.0))
        diagnose_expert_ffn(nv, experts, Dl, I, k, dev, bench, ex_bytes)
    # a deep-k3.1-pro layer in a batch: T rows, each through 16 of 24 experts; bytes counted once
    # per distinct expert (the weights one launch must read at least)
    many = dict(experts)
    for e in range(k, 24):
        many[e] = ExpertWeights(rand_nvfp4(I, Dl), rand_nvfp4(I, Dl), rand_nvfp4(Dl, I))
    for T in (4, 16):
        ids_t = torch.stack([torch.randperm(24)[:k] for _ in range(T)])
        w_t = torch.softmax(torch.randn(T, k, device=dev), -1)
        z_t = torch.randn(T, Dl, device=dev)
        distinct = len(set(ids_t.flatten().tolist()))
        bench(
            f"nvfp4 expert FFN batch, T={T} x 16 of 24 experts ({distinct} distinct, each counted once)",
            distinct * ex_bytes // k,
            lambda ids_t=ids_t, w_t=w_t, z_t=z_t: nv.expert_ffn(z_t, ids_t, w_t, many, 4.0, 25.0),
        )
        if T > 8:  # the same call with 16-row blocks (one decode of an expert's weights per 16 rows)
            nv16 = NvrtcBackend()
            nv16.tc_rows = 16
            out8 = nv.expert_ffn(z_t, ids_t, w_t, many, 4.0, 25.0)
            same = torch.equal(out8, nv16.expert_ffn(z_t, ids_t, w_t, many, 4.0, 25.0))
            bench(
                f"nvfp4 expert FFN batch, T={T}, 16-row blocks (bits {'the same' if same else 'DIFFERENT'})",
                distinct * ex_bytes // k,
                lambda ids_t=ids_t, w_t=w_t, z_t=z_t: nv16.expert_ffn(z_t, ids_t, w_t, many, 4.0, 25.0),
            )
    nv_cc = NvrtcBackend(nvfp4_impl="cuda_core")
    bench(
        "nvfp4 expert FFN slice, CUDA-core kernels", ex_bytes, lambda: nv_cc.expert_ffn(z, ids, w, experts, 4.0, 25.0)
    )


def other_ops(args, nv, tb, dev, bench) -> None:
    """The BF16 GEMV rows (with --variants every variant) and the other decode ops."""

    def bench_gemv(W, x):
        """The default plan's GEMV (and the torch backend), then with --variants every variant of its T bucket."""
        (N, K), T = W.shape, x.shape[0]
        bench(f"bf16 GEMV {N}x{K}, T={T}", W.numel() * 2, lambda: nv.linear(x, W), lambda: tb.linear(x, W))
        for v in GEMV_VARIANTS[("bf16", T)] if args.variants else ():
            for ks in (None, 1, 2, 4, 8) if v.startswith("tc") else (None,):
                nvv = NvrtcBackend()
                nvv.gemv_plan, nvv.gemv_tc_ks = gemv_plan(f"bf16:{T}={v}"), ks
                bench(f"  variant: bf16 GEMV {N}x{K}, T={T}, {v}" + (f", K split {ks}" if ks else ""),
                      W.numel() * 2, lambda nvv=nvv: nvv.linear(x, W))

    for N, K in ((7168, 12288), (12288, 7168)):
        bench_gemv(torch.randn(N, K, device=dev).to(torch.bfloat16), torch.randn(1, K, device=dev))
    W = torch.randn(7168, 12288, device=dev).to(torch.bfloat16)
    for T in (4, 8):
        bench_gemv(W, torch.randn(T, 12288, device=dev))

    # other decode ops (bytes = main tensors read + written)
    K_, n = 128, 8192
    for H in (8, 96):  # deep-k3.1-pro's heads, the release's
        q = torch.nn.functional.normalize(torch.randn(1, H, K_, device=dev), dim=-1)
        kk = torch.nn.functional.normalize(torch.randn(1, H, K_, device=dev), dim=-1)
        v, g = torch.randn(1, H, K_, device=dev), -torch.rand(1, H, K_, device=dev)
        beta, S = torch.rand(1, H, device=dev), torch.randn(1, H, K_, K_, device=dev) * 0.1
        bench(f"kda_step H={H} K=V=128", 2 * S.numel() * 4,
              lambda q=q, kk=kk, v=v, g=g, beta=beta, S=S: nv.kda_step(q, kk, v, g, beta, S))
    ql, qr = torch.randn(96, 512, device=dev), torch.randn(96, 64, device=dev)
    c, kr = torch.randn(n, 512, device=dev), torch.randn(n, 64, device=dev)
    bench(f"mla_decode H=96 n={n}", (c.numel() + kr.numel()) * 4, lambda: nv.mla_decode(ql, qr, c, kr, 0.072, None),
          lambda: tb.mla_decode(ql, qr, c, kr, 0.072, None))
    sel = torch.randperm(n, device=dev)[:2048]
    bench(f"mla_decode H=96 n={n} select 2048", 2048 * 576 * 4, lambda: nv.mla_decode(ql, qr, c, kr, 0.072, sel))
    qi, wi, ki = torch.randn(32, 128, device=dev), torch.randn(32, device=dev), torch.randn(65536, 128, device=dev)
    bench("indexer_scores Hi=32 Di=128 n=65536", ki.numel() * 4, lambda: nv.indexer_scores(qi, wi, ki),
          lambda: tb.indexer_scores(qi, wi, ki))
    sc = torch.randn(65536, device=dev)
    bench("select_topk n=65536 k=2048", sc.numel() * 4, lambda: nv.select_topk(sc, 2048))
    xr, wn = torch.randn(1, 7168, device=dev), torch.rand(7168, device=dev)
    bench("rmsnorm D=7168", 2 * xr.numel() * 4, lambda: nv.rmsnorm(xr, wn, 1e-5))
    for E in (24, 896):  # deep-k3.1-pro's and the release's experts per layer
        lg, b = torch.randn(1, E, device=dev), 0.05 * torch.randn(E, device=dev)
        bench(
            f"route E={E} k=16 (sigmoid + bias, top-k, renormalize)",
            E * 4,
            lambda lg=lg, b=b: nv.route(lg, b, 16, True, 2.5),
        )
    for D, S in ((2048, 9), (7168, 9), (7168, 17)):  # a decode row's AttnRes sources: blocks so far + the partial
        srcs = [torch.randn(1, D, device=dev) for _ in range(S)]
        nw, pw = (1 + 0.1 * torch.randn(D, device=dev)).bfloat16(), (0.05 * torch.randn(D, device=dev)).bfloat16()
        ow = (1 + 0.1 * torch.randn(D, device=dev)).bfloat16()
        bench(f"attnres_mix + rmsnorm D={D}, {S} sources, T=1", (S + 1) * D * 4,
              lambda srcs=srcs, nw=nw, pw=pw, ow=ow: nv.attnres_mix(srcs[-1], srcs[:-1], nw, pw, 1e-5, ow, 1e-5))
    decode_gemv_groups(args, nv, dev, bench)


# deep-k3.1-pro's decode GEMV launches of one x (hidden 2048): (name, [(N, K), ...])
DEEP_GEMV_GROUPS = (
    ("MoE layer's x: router, latent down, shared gate, up", ((24, 2048), (3584, 2048), (6144, 2048), (6144, 2048))),
    ("shared expert down", ((2048, 6144),)),
    ("latent up", ((2048, 3584),)),
    ("KDA's x: q, k, v, g, f_a, b", ((1024, 2048),) * 4 + ((128, 2048), (8, 2048))),
    (
        "MLA's x: q_a, kv_a, gate, indexer wk, weights",
        ((768, 2048), (576, 2048), (1024, 2048), (128, 2048), (32, 2048)),
    ),
    ("MLA's cq: q_b, indexer wq_b", ((1536, 768), (4096, 768))),
    ("o_proj", ((2048, 1024),)),
    ("lm_head", ((163840, 2048),)),
)


def decode_gemv_groups(args, nv, dev, bench) -> None:
    """The deep-k3.1-pro decode GEMV launches at T=1, each call on the next of enough weight
    copies that none is in L2 (as in a step, where a layer's 128 MB go by once), against cuBLAS
    bf16 (torch, one matmul per matrix) on the same copies; with --variants every K split. Then
    T=16 (a B=16 step)."""
    for name, shapes in DEEP_GEMV_GROUPS:
        nb = sum(n * k * 2 for n, k in shapes)
        copies = max(1, min(64, (400 << 20) // nb))
        ws = [[torch.randn(n, k, device=dev).div_(k**0.5).bfloat16() for n, k in shapes] for _ in range(copies)]
        x = torch.randn(1, shapes[0][1], device=dev)
        xb = x.bfloat16()
        dims = "+".join(str(n) for n, _ in shapes) + f"x{shapes[0][1]}"
        for ks in (None, 1, 2, 4, 8) if args.variants else (None,):
            nvk = NvrtcBackend()
            nvk.gemv_tc_ks = ks
            bench(f"bf16 linears {dims} ({name}), T=1" + (f", K split {ks}" if ks else ""), nb,
                  rotating(lambda w, nvk=nvk: nvk.linears(x, w), ws))
        bench(f"  cuBLAS bf16: {dims}, T=1, a matmul per matrix", nb,
              rotating(lambda w: [torch.nn.functional.linear(xb, m) for m in w], ws))
        x16 = torch.randn(16, shapes[0][1], device=dev)
        bench(f"bf16 linears {dims} ({name}), T=16", nb, rotating(lambda w: nv.linears(x16, w), ws))
        x16b = x16.bfloat16()
        bench(f"  cuBLAS bf16: {dims}, T=16, a matmul per matrix", nb,
              rotating(lambda w: [torch.nn.functional.linear(x16b, m) for m in w], ws))


def rotating(fn, items):
    """fn on items[0], items[1], ... in turn, one per call (graph_time captures each call's own)."""
    it = iter(range(1 << 62))
    return lambda: fn(items[next(it) % len(items)])


def write_table(args, props, copy, copy_kinds, rows) -> None:
    date = datetime.date.today().isoformat()
    head = f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, {date}"
    lines = [f"# bench_kernels: {head}", "",
             "HBM copy rate (D2D, read+write, best of: "
             + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in copy_kinds.items()) + f" GB/s): {copy / 1e9:.0f} GB/s", "",
             "| op | bytes | time (us) | GB/s | / copy rate | torch (us) |", "|---|---:|---:|---:|---:|---:|"]
    for name, nb, t, tt in rows:
        lines.append(f"| {name} | {nb / 1e6:.1f} MB | {t * 1e6:.1f} | {nb / t / 1e9:.0f} | {nb / t / copy:.2f} | "
                     f"{'' if tt is None else f'{tt * 1e6:.1f}'} |")
    md = "\n".join(lines)
    print(md)
    if args.markdown:
        args.markdown.write_text(md + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
