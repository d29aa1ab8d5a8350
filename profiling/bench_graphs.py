"""Decode as CUDA graphs against op by op, every routed expert resident; streaming beside it.

    python profiling/bench_graphs.py --workdir /tmp/streamrt-bench --config deep-k3.1-pro --json $OUT/graphs_deep.json
    python profiling/bench_graphs.py --workdir /tmp/streamrt-bench --config slice-k3.1-pro --torch

One process, one NVRTC model (bf16 dense), the tree synthesised at --workdir if absent and read
once into the page cache (expert checksums off: setup, not what is measured). Rows, side by side:
  off      every expert in a device slot, --cuda-graphs off (op by op), B=1, --repeats times
  graphs   every expert resident, --cuda-graphs auto (replayed graphs), each B of --batches;
           B=1 --repeats times
  torch    (--torch) the torch backend, all resident, op by op (the slice target: NVRTC >= 15x)
  stream   (--stream-slots, default a third of the experts) B=1 with the experts in host RAM,
           op by op (--cuda-graphs resident) and as segment graphs (auto), --stream-repeats
           rows each, the modes interleaved, each row on a fresh runtime (same cold device
           slots): ms/token against that row's link floor (its H2D bytes per token over the
           rate measured from a page-locked file mapping, the runtime's source; staged guesses
           that were wrong count as bytes), the main thread's CPU time per token (the host's
           part), misses and staged guesses per token
Each row: prefill B prompts, --warmup decode steps, then --tokens timed steps (s/step from the
runtime's counters; tok/s = B / s per step). GPU busy per step: the union of the kernels'
intervals under torch.profiler for --profile-steps steps of the B=1 graphs row and of the off
row (a programmatically launched kernel starts while its predecessor runs: summed times would
count the overlap twice). Bit identity:
every timed step's logits, graphs against off, at each B (the off rows at B > 1 run for it),
and the first streaming row of each mode.
Prints a table, the targets, and a markdown block for profiling/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench_decode import ensure_warm_tree, git_commit, machine, measure_link
from profile_step import own_times
from streamrt.backends.nvrtc import NvrtcBackend
from streamrt.loader import load_model
from streamrt.model.cache import ModelCache
from streamrt.runtime.options import RuntimeOptions
from streamrt.runtime.scheduler import StreamingRuntime
from streamrt.runtime.streams import make_device


def decode_row(rt, model, prompts, steps, warmup: int, *, profile_steps: int = 0) -> dict:
    """Prefill each prompt into its own cache, stack them, decode `steps` [N, B] (the first
    `warmup` untimed). Returns s/step, the main thread's CPU s/step, the timed logits (CPU),
    and with profile_steps the GPU busy ms/step of that many more steps."""
    B = steps.shape[1]
    with torch.no_grad():
        caches = []
        for p in prompts[:B]:
            caches.append(model.new_cache())
            rt.run(model.forward_steps(p, caches[-1], last_only=True))
        cache = ModelCache.stack(caches)
        run = lambda t: rt.run(model.forward_steps(steps[t, :, None], cache), tokens=B)  # noqa: E731
        for t in range(warmup):
            run(t)
        rt.reset_stats()
        cpu0 = time.thread_time()
        logits = [run(t) for t in range(warmup, steps.shape[0] - profile_steps)]
        cpu = time.thread_time() - cpu0
        p = rt.payload()
        busy = None
        if profile_steps:
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            )
            with prof:
                for t in range(steps.shape[0] - profile_steps, steps.shape[0]):
                    run(t)
                torch.cuda.synchronize()
            kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = own_times(kern)[1] / 1e3 / profile_steps
    n = len(logits)
    return {
        "B": B,
        "s_per_step": p["s_per_token"] * B,
        "tok_s": 1.0 / p["s_per_token"] if p["s_per_token"] else 0.0,
        "host_cpu_s_per_step": cpu / n,
        "graph_steps": p["graph_steps"],
        "bytes_per_token": p["bytes_h2d"] / max(1, p["tokens"]),
        "gpu_busy_ms": busy,
        "misses_per_token": p["device_misses"] / max(1, p["tokens"]),
        "staged_per_token": p.get("staged", 0) / max(1, p["tokens"]),
        "predicted_recall": p["predicted_recall"],
        "logits": [lg.float().cpu() for lg in logits],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/streamrt-bench"))
    ap.add_argument("--config", default="deep-k3.1-pro")
    ap.add_argument("--tokens", type=int, default=12, help="decode steps timed per row")
    ap.add_argument("--warmup", type=int, default=3, help="decode steps before timing (the first captures)")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--batches", default="1,4,16", help="batch sizes of the graphs rows")
    ap.add_argument("--repeats", type=int, default=3, help="B=1 graphs and off rows, for the spread")
    ap.add_argument("--profile-steps", type=int, default=3, help="steps under torch.profiler for the GPU busy time")
    ap.add_argument(
        "--stream-slots", type=int, default=None, help="device slots of the streaming row (default: a third)"
    )
    ap.add_argument("--stream-repeats", type=int, default=2, help="rows of each streaming mode")
    ap.add_argument("--no-stream", action="store_true", help="skip the streaming rows")
    ap.add_argument("--torch", action="store_true", help="add a torch-backend all-resident row (B=1)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    device = make_device("cuda")
    tree = ensure_warm_tree(args.workdir, args.config)
    cfg = tree.config
    link = measure_link(device, tree)
    batches = [int(b) for b in args.batches.split(",")]
    Bmax = max(batches)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size - 256, (args.prompt_len + i,), generator=g) for i in range(Bmax)]
    N = args.warmup + args.tokens + args.profile_steps
    steps = torch.randint(0, cfg.vocab_size - 256, (N, Bmax), generator=g)
    backend = NvrtcBackend(device.torch_device)
    model = load_model(tree, device.torch_device, dtype=torch.bfloat16, backend=backend)
    rows: dict[str, dict] = {}

    def resident(graphs: str, m=None):
        rt = StreamingRuntime(
            tree,
            m or model,
            RuntimeOptions(device="cuda", gpu_experts=cfg.expert_files, cuda_graphs=graphs, verify_experts="off"),
            device=device,
        )
        t = time.perf_counter()
        rt.preload()
        print(f"  {graphs}: {len(rt.gpu)} experts preloaded in {time.perf_counter() - t:.1f} s", flush=True)
        return rt

    def record(name: str, r: dict) -> None:
        rows[name] = r
        busy = f", GPU busy {r['gpu_busy_ms']:.2f} ms/step" if r["gpu_busy_ms"] is not None else ""
        print(f"{name}: {r['s_per_step'] * 1e3:.2f} ms/step, {r['tok_s']:.1f} tok/s, host CPU "
              f"{r['host_cpu_s_per_step'] * 1e3:.2f} ms/step, {r['graph_steps']} graph steps{busy}", flush=True)

    T = args.warmup + args.tokens
    for graphs, label in (("off", "off"), ("auto", "graphs")):  # (--cuda-graphs, label)
        with resident(graphs) as rt:
            for i in range(args.repeats):
                record(f"{label} B=1 #{i + 1}", decode_row(rt, model, prompts, steps[:, :1], args.warmup,
                                                            profile_steps=args.profile_steps if i == 0 else 0))
            for B in batches[1:]:
                record(f"{label} B={B}", decode_row(rt, model, prompts, steps[:T, :B], args.warmup))
            if rt.graphs_line is not None:
                print(f"  {label}: {rt.graphs_line}", flush=True)
    if args.torch:
        tmodel = load_model(tree, device.torch_device, dtype=torch.bfloat16)
        with resident("off", tmodel) as rt:
            record("torch B=1", decode_row(rt, tmodel, prompts, steps[:T, :1], args.warmup))
        del tmodel
    if not args.no_stream:
        slots = args.stream_slots or cfg.expert_files // 3
        for i in range(args.stream_repeats):  # interleaved, each row from the same cold slots
            for graphs, label in (("resident", "stream"), ("auto", "stream graphs")):
                with StreamingRuntime(
                    tree,
                    model,
                    RuntimeOptions(device="cuda", gpu_experts=slots, verify_experts="off", cuda_graphs=graphs),
                    device=device,
                ) as rt:
                    rt.warm_host()
                    record(f"{label} #{i + 1}", decode_row(rt, model, prompts, steps[:T, :1], args.warmup))
                    if i == 0 and rt.graphs_line is not None:
                        print(f"  {label}: {rt.graphs_line}", flush=True)

    # ---- results -------------------------------------------------------------------------------
    def same(a: str, b: str) -> bool:
        return all(torch.equal(x, y) for x, y in zip(rows[a]["logits"], rows[b]["logits"]))

    identical = {f"B={B}": same(f"off B={B}" if B > 1 else "off B=1 #1", f"graphs B={B}" if B > 1 else "graphs B=1 #1")
                 for B in batches}
    identical["B=1 repeats"] = all(same("graphs B=1 #1", f"graphs B=1 #{i + 1}") for i in range(args.repeats))
    g1 = [rows[f"graphs B=1 #{i + 1}"]["s_per_step"] for i in range(args.repeats)]
    o1 = [rows[f"off B=1 #{i + 1}"]["s_per_step"] for i in range(args.repeats)]
    g_med, o_med = statistics.median(g1), statistics.median(o1)
    spread = (max(g1) - min(g1)) / g_med
    busy_g, busy_o = rows["graphs B=1 #1"]["gpu_busy_ms"], rows["off B=1 #1"]["gpu_busy_ms"]
    checks = {
        "graphs B=1: >= 10x op by op (same run)": (o_med / g_med, 10.0, "ge"),
        "graphs B=1: run-to-run spread < 10 %": (spread, 0.10, "le"),
    }
    if busy_g:  # --profile-steps 0: not measured
        checks["graphs B=1: s/token <= 1.3 x GPU busy (graph step)"] = (g_med * 1e3 / busy_g, 1.3, "le")
    if Bmax > 1:
        b1 = statistics.median(rows[f"graphs B=1 #{i + 1}"]["tok_s"] for i in range(args.repeats))
        checks[f"graphs B={Bmax}: tok/s >= 8x B=1"] = (rows[f"graphs B={Bmax}"]["tok_s"] / b1, 8.0, "ge")
    if "torch B=1" in rows:
        checks["graphs B=1 NVRTC vs torch >= 15x"] = (rows["torch B=1"]["s_per_step"] / g_med, 15.0, "ge")
    stream = {
        label: [r for n, r in rows.items() if n.startswith(label + " #")] for label in ("stream", "stream graphs")
    }
    stream = {label: rs for label, rs in stream.items() if rs}
    rate = link["registered"] or link["pinned"]  # the mapped tier copies from registered file mappings
    for rs in stream.values():
        for r in rs:  # each row against its own bytes: the guesses a row staged differ with its host's pace
            r["floor_s"] = r["bytes_per_token"] / (rate * 1e9) if rate else 0.0
            r["vs_floor"] = r["s_per_step"] / r["floor_s"] if r["floor_s"] else 0.0
    for label, rs in stream.items():
        checks[f"{label}: s/token <= 1.05 x its link floor (median row)"] = (
            statistics.median(r["vs_floor"] for r in rs),
            1.05,
            "le",
        )
    if len(stream) == 2:
        identical["stream graphs vs op by op"] = same("stream #1", "stream graphs #1")

    header = (
        f"machine: {machine()}    date: {datetime.date.today()}    commit: {git_commit()}\n"
        f"geometry: {cfg.name}    command: python profiling/bench_graphs.py "
        + " ".join(argv if argv is not None else sys.argv[1:])
    )
    lines = [
        header,
        f"link: H2D {link['registered']:.1f} GB/s from a registered mapping, {link['pinned']:.1f} from a pinned "
        "buffer; GPU busy per B=1 step (union of kernel intervals): graphs "
        + (f"{busy_g:.2f} ms, op by op {busy_o:.2f} ms" if busy_g else "not profiled (--profile-steps 0)"),
        f"graphs B=1 median {g_med * 1e3:.2f} ms/token (rows {', '.join(f'{x * 1e3:.2f}' for x in g1)}), op by op "
        f"median {o_med * 1e3:.2f} (rows {', '.join(f'{x * 1e3:.2f}' for x in o1)}): {o_med / g_med:.1f}x",
    ]
    for label, rs in stream.items():
        lines.append(
            f"{label}: rows "
            + ", ".join(f"{r['s_per_step'] * 1e3:.1f}" for r in rs)
            + " ms/token over "
            + ", ".join(f"{r['bytes_per_token'] / 1e9:.2f}" for r in rs)
            + " GB/token (floors "
            + ", ".join(f"{r['floor_s'] * 1e3:.1f}" for r in rs)
            + " ms: x"
            + ", ".join(f"{r['vs_floor']:.3f}" for r in rs)
            + "); host CPU "
            + ", ".join(f"{r['host_cpu_s_per_step'] * 1e3:.1f}" for r in rs)
            + " ms/token; misses "
            + ", ".join(f"{r['misses_per_token']:.0f}" for r in rs)
            + ", staged "
            + ", ".join(f"{r['staged_per_token']:.0f}" for r in rs)
            + " per token; recall "
            + ", ".join(f"{r['predicted_recall']:.2f}" for r in rs)
        )
    lines.append(
        "logits bit-identical graphs vs op by op: "
        + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in identical.items())
    )
    cols = ["row", "B", "ms/step", "tok/s", "host CPU ms/step", "graph steps", "GPU busy ms/step"]
    body = [
        [
            n,
            str(r["B"]),
            f"{r['s_per_step'] * 1e3:.2f}",
            f"{r['tok_s']:.1f}",
            f"{r['host_cpu_s_per_step'] * 1e3:.2f}",
            str(r["graph_steps"]),
            f"{r['gpu_busy_ms']:.2f}" if r["gpu_busy_ms"] is not None else "-",
        ]
        for n, r in rows.items()
    ]
    w = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    print("\n" + "\n".join(lines) + "\n")
    print("\n".join("  ".join(c.rjust(w[i]) for i, c in enumerate(r)) for r in [cols] + body))
    print("\ntargets:")
    md_t = []
    for k, (v, target, how) in checks.items():
        ok = v <= target if how == "le" else v >= target
        print(f"  {k}: {v:.2f} ({'PASS' if ok else 'FAIL'})")
        md_t.append(f"| {k} | {v:.2f} | {'yes' if ok else 'no'} |")
    md = ["```", *lines, "```", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(b) + " |" for b in body] + ["", "| target | measured | pass |", "|---|---|---|"] + md_t
    print("\n--- markdown for profiling/RESULTS.md ---\n" + "\n".join(md))
    if args.json:
        out = {n: {k: v for k, v in r.items() if k != "logits"} for n, r in rows.items()}
        args.json.write_text(json.dumps({"rows": out, "link": link, "identical": identical,
                                         "checks": {k: v[0] for k, v in checks.items()}}, indent=1))
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
