"""Where one decode step's time goes: host (Python) vs GPU, per op (one run, one GPU).

Runs the streaming runtime on a `slice` tree with every expert resident (no link traffic), so
the step time is compute plus host overhead only, and reports:
  * wall ms/step, GPU busy ms/step (sum of kernel times from the CUDA profiler), kernels/step;
  * the top GPU kernels by time and the top host functions by own time (cProfile).
If GPU busy is far below wall, the step is host-bound: the fix is fewer launches / less Python
per op, not faster kernels.

    python profiling/profile_step.py --workdir /tmp/streamrt-bench [--backend nvrtc] [--steps 6]

Prefill mode (`--prefill N`): one N-token prefill from an empty cache (chunks of --prefill-chunk,
default the model's `default_prefill_chunk`) instead of decode steps, every expert resident. Runs,
after a short warm-up prefill (--warmup tokens): (1) timed: wall s, and each model part's
exclusive host s; (2) unless --no-sync-run: a device synchronize at every part boundary, so each
part's s is its real elapsed time, serialized (the sum exceeds (1)'s wall by the overlap lost; on
CPU there is nothing to synchronize: a repeat of (1)); the two print as one table at once;
(3) unless --no-profiler, under torch.profiler: GPU busy s (sum of kernel times), kernels, and
per part its GPU s, kernels, launch calls, top-level torch ops (all ops: with the ops they call;
leaf ops: those doing the work, about the kernels on CUDA) and their host time, the top ops per
part and the top kernels (on CPU "CPU op time" stands in for GPU busy); (4) unless --no-cprofile,
the top host functions. Parts are record_function ranges monkeypatched around module forwards
and backend methods by `profiling/prefill_parts.py` (KDA / MLA / MoE experts / MoE
router+shared+latent / dense FFN / AttnRes / norms / lm_head / layer glue / outside = the
runtime's expert service), each with its details (e.g. kda/chunked, mla/index_select);
nothing in streamrt/ changes. --json PATH writes the per-part table.

    # the device run (H200). Synthesise deep once (~2 min; the script would do it too, inside its
    # own time limit), then profile. The per-part host / synced table prints after ~2 min (load,
    # warm-up, timed and synced prefills); the profiler run and the post-processing of its ~3M
    # events take a few minutes more (--no-cprofile saves one more prefill):
    PYTHONPATH=. python -m streamrt synth --config deep-k3.1-pro --format streamrt --out
    /tmp/streamrt-bench/deep-k3.1-pro
    python profiling/profile_step.py --workdir /tmp/streamrt-bench --config deep-k3.1-pro --backend nvrtc \
        --prefill 4096 --no-cprofile --json $OUT/prefill_parts.json 2>&1 | tee $OUT/profile_prefill.log
    # CPU smoke run (torch backend); --tiles cuda takes the CUDA tile sizes (q_tile 256, key_block
    # 2048), --emulate-nvrtc also the nvrtc backend's one-GEMM `linear`, so op counts match the GPU's:
    python profiling/profile_step.py --workdir /tmp/srt --config tiny-k3.1-pro --device cpu --backend torch \
        --prefill 256 --tiles cuda --emulate-nvrtc
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import ensure_tree  # noqa: E402
from prefill_parts import Parts, breakdown, group  # noqa: E402

from streamrt.loader import load_model  # noqa: E402
from streamrt.runtime.options import RuntimeOptions  # noqa: E402
from streamrt.runtime.scheduler import StreamingRuntime  # noqa: E402
from streamrt.runtime.streams import make_device  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/streamrt-bench"))
    ap.add_argument("--config", default="slice-k3.1-pro")
    ap.add_argument("--backend", default="nvrtc", choices=("nvrtc", "torch"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=1, help="decode: rows per step (one sequence each)")
    ap.add_argument("--gpu-experts", type=int, default=None, help="default: all (resident)")
    ap.add_argument("--cuda-graphs", default="auto", choices=("auto", "resident", "off"),
                    help="decode (nvrtc), as `run --cuda-graphs`: auto replays whole steps once every expert is "
                         "resident and the stretches between routers while experts stream (with --gpu-experts); "
                         "resident: only the former; off: op by op")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (torch backend)")
    ap.add_argument("--staged-shape", type=lambda v: tuple(int(t) for t in v.split(",")), default=None,
                    help="nvrtc: tc_staged_shape, gate+up warps,down warps,stages,blocks a stage")
    ap.add_argument(
        "--prefill", type=int, default=0, metavar="N", help="profile one N-token prefill instead of decode steps"
    )
    ap.add_argument("--prefill-chunk", type=int, default=None, help="tokens per prefill chunk (default: the model's)")
    ap.add_argument("--warmup", type=int, default=256, help="prefill: tokens of the warm-up prefill (0: none)")
    ap.add_argument("--tiles", choices=("device", "cuda"), default="device",
                    help="torch backend: cuda = the CUDA prefill tiles (q_tile 256, key_block 2048) on any device")
    ap.add_argument("--emulate-nvrtc", action="store_true",
                    help="CPU: torch backend with nvrtc's linear (one GEMM above 64 rows) and the CUDA tiles")
    ap.add_argument("--no-sync-run", action="store_true", help="prefill: skip the run synchronized at part boundaries")
    ap.add_argument("--no-cprofile", action="store_true", help="prefill: skip the cProfile run")
    ap.add_argument(
        "--no-profiler", action="store_true", help="prefill: skip the torch.profiler run (host / synced tables only)"
    )
    ap.add_argument("--json", type=Path, default=None, help="prefill: write the per-part table here")
    args = ap.parse_args(argv)
    if args.batch < 1:
        ap.error(f"--batch must be at least 1, got {args.batch}")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("profile_step: needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    device = make_device(args.device)
    tree = ensure_tree(args.workdir, args.config)
    cfg = tree.config
    backend = None
    if args.backend == "nvrtc" and cuda:
        from streamrt.backends.nvrtc import NvrtcBackend

        backend = NvrtcBackend(device.torch_device)
        if args.staged_shape is not None:
            backend.tc_staged_shape = args.staged_shape
    elif args.emulate_nvrtc:
        from prefill_parts import NvrtcLinearTwin

        backend = NvrtcLinearTwin()
    elif args.tiles == "cuda":
        from streamrt.backends.torch_backend import TorchBackend

        _, q_tile, key_block = TorchBackend.TILES["cuda"]
        backend = TorchBackend(q_tile=q_tile, key_block=key_block)
    model = load_model(tree, device.torch_device, dtype=torch.bfloat16 if cuda else None, backend=backend)
    slots = args.gpu_experts or cfg.expert_files
    rt = StreamingRuntime(
        tree, model, RuntimeOptions(device=args.device, gpu_experts=slots, cuda_graphs=args.cuda_graphs), device=device
    )
    if slots >= cfg.expert_files:
        rt.preload()
    if args.prefill:
        return prefill_main(args, model, rt, sync, slots)
    g = torch.Generator().manual_seed(0)
    B = args.batch
    toks = torch.randint(0, cfg.vocab_size - 256, (B, 4 + 3 + 3 * args.steps), generator=g)
    cache = model.new_cache(B)
    it = iter(range(4, toks.shape[1]))

    def step():
        i = next(it)
        return rt.run(model.forward_steps(toks[:, i:i + 1], cache), tokens=B)

    with torch.no_grad():
        rt.run(model.forward_steps(toks[:, :4], cache, last_only=True))
        for _ in range(3):
            step()
        sync()
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        wall = (time.perf_counter() - t) / args.steps
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                      + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
        with prof:
            for _ in range(args.steps):
                step()
            sync()
        cp = cProfile.Profile()
        cp.enable()
        for _ in range(args.steps):
            step()
        sync()
        cp.disable()
    rt.close()

    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kern) / 1e3 / args.steps  # ms
    print(f"profile_step: {args.config}, backend {args.backend}, {slots} device slots, batch {B}, {args.steps} steps, "
          f"{rt.stats.graph_steps} of them CUDA-graph replays")
    print(f"wall {wall * 1e3:.2f} ms/step (no profiler); GPU kernels {busy:.2f} ms/step busy; "
          f"{len(kern) / args.steps:.0f} kernels/step; GPU busy / wall = {busy / (wall * 1e3):.2f}")
    own, union = own_times(kern)
    print(f"GPU busy as a union of kernel intervals {union / 1e3 / args.steps:.2f} ms/step (programmatic overlap "
          f"counted once); GPU idle {wall * 1e3 - union / 1e3 / args.steps:.2f} ms/step")
    by = {}
    for e in kern:
        n, c, o = by.get(e.name, (0, 0.0, 0.0))
        by[e.name] = (n + 1, c + e.device_time, o + own[id(e)])
    print("\ntop GPU kernels (per step; own ms: time no earlier-started kernel still covers):  calls   ms   own ms")
    for name, (n, c, o) in sorted(by.items(), key=lambda kv: -kv[1][2])[:30]:
        print(f"  {name[:60]:60s} {n / args.steps:6.1f} {c / 1e3 / args.steps:7.3f} {o / 1e3 / args.steps:7.3f}")
    s = io.StringIO()
    pstats.Stats(cp, stream=s).sort_stats("tottime").print_stats(28)
    print("\nhost functions by own time (cProfile, all steps; cProfile slows Python ~1.5-2x):")
    print("\n".join(s.getvalue().splitlines()[4:40]))
    return 0



def own_times(kern) -> tuple[dict, float]:
    """Each kernel event's own us: its interval less what kernels that started before it still
    cover. A programmatically launched kernel starts while its predecessor runs and waits on it,
    so the shared time goes to the one doing the work; the owns sum to the intervals' union."""
    own, covered = {}, float("-inf")
    for e in sorted(kern, key=lambda e: e.time_range.start):
        own[id(e)] = max(0.0, e.time_range.end - max(e.time_range.start, covered))
        covered = max(covered, e.time_range.end)
    return own, sum(own.values())


GROUPS = ("kda", "mla", "moe_experts", "moe_rest", "dense_ffn", "attnres", "norms", "lm_head", "glue", "(outside)")



def print_cprofile(cp) -> None:
    if cp is not None:
        s = io.StringIO()
        pstats.Stats(cp, stream=s).sort_stats("tottime").print_stats(28)
        print("\nhost functions by own time (cProfile, one prefill; cProfile slows Python ~1.5-2x):")
        print("\n".join(s.getvalue().splitlines()[4:40]), flush=True)


def quick_table(host, synced, wall: float, per_layer: dict) -> None:
    """Per part (group and detail) from the runs without the profiler: exclusive host s (and
    synchronized s), printed at once."""
    parts = sorted(set(host.self_s) | set(synced.self_s if synced else ()),
                   key=lambda p: (GROUPS.index(group(p)) if group(p) in GROUPS else 99, p))
    inside = sum(host.self_s.values())
    print(f"\nby model part, no profiler (host s: exclusive host time in the timed run, {wall - inside:.3f} s of its "
          f"{wall:.3f} s outside every part = the runtime's expert service + waits"
          + ("; synced s: exclusive elapsed with a device sync at every part boundary" if synced else "") + "):")
    print(
        f"  {'part':22s} {'ranges':>7s} {'host s':>8s} {'%wall':>6s}"
        + (f" {'synced s':>9s} {'%sum':>6s} {'s/layer':>8s}" if synced else "")
    )
    ssum = sum(synced.self_s.values()) if synced else 0.0
    for level in ("group", "detail"):
        keys = list(dict.fromkeys(group(p) for p in parts)) if level == "group" else parts
        for k in keys:
            members = [p for p in parts if (group(p) if level == "group" else p) == k]
            hs = sum(host.self_s.get(p, 0.0) for p in members)
            line = (
                f"  {k:22s} {sum(host.calls.get(p, 0) for p in members):7d} {hs:8.3f} {100 * hs / max(wall, 1e-9):6.1f}"
            )
            if synced:
                ss = sum(synced.self_s.get(p, 0.0) for p in members)
                nl = per_layer.get(group(k))
                line += f" {ss:9.3f} {100 * ss / max(ssum, 1e-9):6.1f} " + (f"{ss / nl:8.4f}" if nl else f"{'':8s}")
            print(line)
        if level == "group":
            print(f"  {'(outside)':22s} {'':7s} {wall - inside:8.3f} {100 * (wall - inside) / max(wall, 1e-9):6.1f}")
            print("  " + "-" * 40)
    sys.stdout.flush()


def prefill_main(args, model, rt, sync, slots) -> int:
    """--prefill N: one N-token prefill, by model part (module doc)."""
    from streamrt.model.model import default_prefill_chunk

    cfg, cuda = model.config, args.device == "cuda"
    dev = model.lm_head.weight.device
    N = args.prefill
    chunk = args.prefill_chunk or default_prefill_chunk(cfg, dev)
    model.prefill_chunk = chunk
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (N,), generator=g)

    def prefill(n: int = N) -> float:
        cache = model.new_cache(1)
        x = ids[:n].to(dev)
        sync()
        t0 = time.perf_counter()
        logits = rt.run(model.forward_steps(x, cache, last_only=True))
        int(logits.reshape(-1).argmax())  # the first token on the host
        sync()
        return time.perf_counter() - t0

    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    per_layer = {"kda": kinds.count("kda"), "mla": kinds.count("mla"), "moe_experts": len(cfg.moe_layers),
                 "moe_rest": len(cfg.moe_layers), "dense_ffn": cfg.num_layers - len(cfg.moe_layers)}
    be = model.backend.for_prefill() if hasattr(model.backend, "for_prefill") else model.backend
    tiles = be.tiles(dev) if hasattr(be, "tiles") else None
    with torch.no_grad():
        if args.warmup:
            t = prefill(min(N, args.warmup))
            print(f"warm-up prefill of {min(N, args.warmup)} tokens: {t:.2f} s", flush=True)
        with Parts(model) as host:  # (1) timed; the ranges cost ~2 us each, a few thousand per prefill
            wall = prefill()
        print(f"timed prefill: {wall:.2f} s", flush=True)
        synced = None
        if not args.no_sync_run:  # (2), before the profiler: its answer survives a time-out there (CPU: no sync)
            with Parts(model, sync=sync) as synced:
                wall_sync = prefill()
            print(f"prefill synchronized at part boundaries: {wall_sync:.2f} s", flush=True)
        quick_table(host, synced, wall, per_layer)
        prof = None
        if not args.no_profiler:  # (3)
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            prof = torch.profiler.profile(activities=acts)
            with Parts(model), prof:
                wall_prof = prefill()
            print(f"profiled prefill: {wall_prof:.2f} s", flush=True)
        cp = None
        if not args.no_cprofile:  # (4)
            cp = cProfile.Profile()
            cp.enable()
            wall_cp = prefill()
            cp.disable()
            print(f"prefill under cProfile: {wall_cp:.2f} s", flush=True)
            print_cprofile(cp)
    rt.close()

    if prof is None:
        return 0
    print("post-processing the profiler's events ...", flush=True)
    t_an = time.perf_counter()
    events = prof.events()
    bd = breakdown(events)
    total = bd.pop("_total")
    parts = sorted(set(bd) | set(host.self_s), key=lambda p: (GROUPS.index(group(p)) if group(p) in GROUPS else 99, p))
    ops = sum(st["ops"] for st in bd.values())
    op_s = sum(st["op_us"] for st in bd.values()) / 1e6
    kern = sum(st["kernels"] for st in bd.values())
    gpu = sum(st["gpu_us"] for st in bd.values()) / 1e6
    print(
        f"\nprofile_step --prefill: {args.config}, backend {getattr(be, 'name', args.backend)}, {N} tokens, chunk "
            f"{chunk} "
        f"({-(-N // chunk)} chunks), {slots} device slots, tiles (row, q, key) {tiles}; layers: "
        f"{per_layer['kda']} KDA, {per_layer['mla']} MLA, {per_layer['moe_experts']} MoE, {per_layer['dense_ffn']} "
            f"dense"
    )
    line = f"wall {wall:.3f} s (part ranges on, no profiler; {wall_prof:.2f} s profiled)"
    if cuda:
        line += (
            f"; GPU busy {total['gpu_us'] / 1e6:.3f} s (sum of kernel times; {gpu:.3f} s attributed to a part); "
            f"{total['kernels']} kernels ({kern} attributed); GPU busy / wall = {total['gpu_us'] / 1e6 / wall:.2f}"
        )
    else:
        line += f"; CPU op time {op_s:.3f} s (top-level torch ops, profiled run); no GPU"
    print(line + f"; {ops} top-level torch ops ({ops / max(wall, 1e-9) / 1e3:.1f} k/s of wall)")
    print(f"(post-processing {len(events)} profiler events: {time.perf_counter() - t_an:.1f} s)")

    def row(name, st, hs, ss, calls, layers):
        cols = [f"{name:22s}", f"{calls:7d}", f"{hs:8.3f}", f"{100 * hs / max(wall, 1e-9):5.1f}"]
        if synced is not None:
            cols.append(f"{ss:8.3f}")
        if cuda:
            cols += [f"{st['gpu_us'] / 1e6:8.3f}", f"{100 * st['gpu_us'] / max(total['gpu_us'], 1e-9):5.1f}",
                     f"{st['kernels']:8d}", f"{st['launches']:8d}"]
        cols += [f"{st['ops']:8d}", f"{st['all_ops']:8d}", f"{st['leaf_ops']:8d}", f"{st['op_us'] / 1e6:8.3f}"]
        cols.append(f"{st['ops'] / layers:9.0f}" if layers else f"{'':9s}")
        print(" ".join(cols))

    head = [f"{'part':22s}", f"{'ranges':>7s}", f"{'host s':>8s}", f"{'%wall':>5s}"]
    if synced is not None:
        head.append(f"{'synced s':>8s}")
    if cuda:
        head += [f"{'GPU s':>8s}", f"{'%GPU':>5s}", f"{'kernels':>8s}", f"{'launches':>8s}"]
    head += [f"{'ops':>8s}", f"{'all ops':>8s}", f"{'leaf ops':>8s}", f"{'op s':>8s}", f"{'ops/layer':>9s}"]
    z = {
        "gpu_us": 0.0,
        "kernels": 0,
        "launches": 0,
        "ops": 0,
        "all_ops": 0,
        "leaf_ops": 0,
        "op_us": 0.0,
        "ranges": 0,
        "op_names": {},
        "kernel_names": {},
    }
    table = {}
    for level in ("group", "detail"):
        print(
            f"\nby model part ({level}; host s = exclusive host time in the timed run"
            + ("; synced s = exclusive elapsed with a device sync at every part boundary" if synced is not None else "")
            + "; ops = top-level torch ops in the profiled run, all ops = with the ops they call, leaf ops = those "
              "doing the work, ~ kernels on CUDA; op s = their host time):"
        )
        print(" ".join(head))
        keys = list(dict.fromkeys(group(p) for p in parts)) if level == "group" else parts
        for k in keys:
            members = [p for p in parts if (group(p) if level == "group" else p) == k]
            st = dict(z)
            for p in members:
                for f in ("gpu_us", "kernels", "launches", "ops", "all_ops", "leaf_ops", "op_us"):
                    st[f] += bd.get(p, z)[f]
            hs = sum(host.self_s.get(p, 0.0) for p in members)
            ss = sum(synced.self_s.get(p, 0.0) for p in members) if synced is not None else 0.0
            if k == "(outside)":  # the prefill's time in no part: the runtime's service, the driver loop
                hs = wall - sum(host.self_s.values())
                ss = wall_sync - sum(synced.self_s.values()) if synced is not None else 0.0
            calls = sum(host.calls.get(p, 0) for p in members)
            layers = per_layer.get(k if level == "group" else group(k))
            row(k, st, hs, ss, calls, layers)
            if level == "detail":
                table[k] = {
                    "ranges": calls,
                    "host_s": hs,
                    "synced_s": ss,
                    "gpu_s": st["gpu_us"] / 1e6,
                    "kernels": st["kernels"],
                    "launches": st["launches"],
                    "ops": st["ops"],
                    "all_ops": st["all_ops"],
                    "leaf_ops": st["leaf_ops"],
                    "op_s": st["op_us"] / 1e6,
                    "top_ops": sorted(
                        ((n, c, u / 1e6) for n, (c, u) in bd.get(k, z)["op_names"].items()), key=lambda r: -r[1]
                    )[:12],
                }
    print("\ntop ops by count in the parts issuing >= 2% of all ops (count, host s):")
    for k in parts:
        st = bd.get(k)
        if not st or st["ops"] < 0.02 * max(ops, 1):
            continue
        top = sorted(st["op_names"].items(), key=lambda kv: -kv[1][0])[:8]
        print(f"  {k:20s} " + ", ".join(f"{n.replace('aten::', '')} {c} ({u / 1e6:.2f})" for n, (c, u) in top))
    if cuda:
        by = defaultdict(lambda: [0, 0.0, set()])
        for p, st in bd.items():
            for n, (c, u) in st["kernel_names"].items():
                by[n][0] += c
                by[n][1] += u
                by[n][2].add(group(p))
        print("\ntop GPU kernels (whole prefill):  calls      s  parts")
        for name, (n, u, ps) in sorted(by.items(), key=lambda kv: -kv[1][1])[:30]:
            print(f"  {name[:60]:60s} {n:7d} {u / 1e6:7.3f}  {','.join(sorted(ps))}")
    if args.json:
        import json

        args.json.write_text(
            json.dumps(
                {
                    "config": args.config,
                    "backend": getattr(be, "name", args.backend),
                    "tokens": N,
                    "chunk": chunk,
                    "tiles": tiles,
                    "wall_s": wall,
                    "wall_profiled_s": wall_prof,
                    "gpu_busy_s": total["gpu_us"] / 1e6,
                    "kernels": total["kernels"],
                    "ops": ops,
                    "layers": per_layer,
                    "parts": table,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
