"""Dense streaming against the link, one process: the same forced decode with every
dense weight resident, then with the placement plan streaming at least half of the dense plane.

    python profiling/bench_dense_stream.py --config slice-k3.1-pro --workdir /tmp/streamrt-bench
    python profiling/bench_dense_stream.py --config deep-k3.1-pro --workdir /tmp/streamrt-bench
    python profiling/bench_dense_stream.py --config tiny-k3.1-pro --device cpu --tokens 3   # logic only

Self-contained (bench_decode.py's helpers): the tree is synthesised in streamrt format at
--workdir if absent, every expert file is read once (experts in host RAM) and mapped into each
run's host window before its timed steps. `--gpu-mem` (default: the largest budget at which at
least half of the dense plane streams) sizes the plan; both runs get the plan's expert slots, so
their expert traffic is the same. Measured in this one run:

  link      pinned H2D GB/s: expert-sized copies and dense-layer-sized copies (the faster counts)
  resident  every dense weight on the GPU: decode s/token, the reference logits
  streamed  the plan: decode s/token, dense and expert bytes over the link per token

Target: streamed s/token <= 1.10 x (dense + expert bytes per token / link rate); logits of every
decode step bit-identical to the resident run. Prints a markdown row for profiling/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_decode import decode_run, ensure_warm_tree, git_commit, machine, measure_link, pinned_rate  # noqa: E402

from streamrt.loader import load_model  # noqa: E402
from streamrt.plan.placement import format_plan, layer_dense_bytes, plan_placement  # noqa: E402
from streamrt.plan.budget import GIB  # noqa: E402
from streamrt.runtime.options import RuntimeOptions  # noqa: E402
from streamrt.runtime.streams import make_device  # noqa: E402

TARGET = 1.10


def half_streaming_budget(cfg, buffers: int, context: int) -> int:
    """The largest --gpu-mem whose plan streams at least half of the dense plane: with layers
    0..r-1 resident a plan needs need(r) = fixed reserve + those layers + `buffers` x the largest
    streamed layer, and keeps the largest r that fits; so the budget is one byte below the
    cheapest plan with more resident layers (the bytes above need(r) become expert slots)."""
    layers = layer_dense_bytes(cfg)
    probe = plan_placement(cfg, 1 << 50, context=context, buffers=buffers)
    base = sum(v for k, v in probe.fixed_bytes.items() if k != "embedding")
    n = len(layers)
    need = [base + sum(layers[:r]) + buffers * max(layers[r:]) for r in range(n)] + [base + sum(layers)]
    r = max(q for q in range(n) if sum(layers[q:]) >= sum(layers) / 2)
    for q in range(r, -1, -1):
        hi = min(need[q + 1 :]) - 1
        if hi >= need[q]:
            return hi
    raise SystemExit(f"{cfg.name}: no --gpu-mem streams half of the dense plane")


def decode(tree, model, device, opts, prompt, cont, warmup) -> dict:
    """bench_decode's forced decode, with the dense stream's counters reset with the runtime's:
    payload (plus dense bytes and late copies), every decode step's logits (CPU)."""
    dense = getattr(model.layer_weights, "stats", None)
    run = decode_run(
        tree, model, device, opts, prompt, cont, warmup, on_reset=dense.reset if dense is not None else None
    )
    run["payload"]["dense_bytes"] = dense.bytes_h2d if dense is not None else 0
    run["payload"]["dense_late"] = dense.late if dense is not None else 0
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/streamrt-bench"))
    ap.add_argument("--config", default="slice-k3.1-pro")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--gpu-mem", default=None, metavar="BYTES",
                    help="the card budget of the plan (default: the largest at which half the dense plane streams)")
    ap.add_argument("--buffers", type=int, default=2, help="device buffers of the dense ring (2 or 3)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8, help="decode steps timed per run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--backend", choices=("auto", "nvrtc", "torch"), default="auto",
                    help="ops backend (default: nvrtc on CUDA; the torch backend is host-bound at the real depth)")
    ap.add_argument("--gpu-policy", default="lfu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    device = make_device(args.device)
    tree = ensure_warm_tree(args.workdir, args.config)
    cfg = tree.config

    from streamrt.runtime.options import parse_bytes

    budget = (
        parse_bytes(args.gpu_mem, "--gpu-mem")
        if args.gpu_mem
        else half_streaming_budget(cfg, args.buffers, args.context)
    )
    plan = plan_placement(cfg, budget, context=args.context, buffers=args.buffers)
    print(f"--gpu-mem {budget / GIB:.2f}G\n{format_plan(cfg, plan)}", flush=True)
    share = plan.streamed_bytes_per_token / sum(plan.layer_bytes)
    if share < 0.5:
        print(f"warning: only {share:.0%} of the dense plane streams at this --gpu-mem", flush=True)

    link = measure_link(device, tree)
    dense_rate = pinned_rate(device, min(max(plan.layer_bytes), 1 << 30))
    rate = max(link["pinned"], dense_rate)
    print(
        f"link: pinned H2D {link['pinned']:.1f} GB/s (expert-sized), {dense_rate:.1f} GB/s (dense-layer-sized)",
        flush=True,
    )

    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg.vocab_size - 256, (args.prompt_len,), generator=g).tolist()
    cont = torch.randint(0, cfg.vocab_size - 256, (args.warmup + args.tokens,), generator=g).tolist()
    backend = args.backend if args.backend != "auto" else ("nvrtc" if device.kind == "cuda" else "torch")
    opts = RuntimeOptions(
        device=args.device,
        backend=backend,
        gpu_experts=plan.expert_slots,
        gpu_policy=args.gpu_policy,
        verify_experts="off",
    )
    dtype = torch.bfloat16 if device.kind == "cuda" else None

    runs = {}
    for name in ("resident", "streamed"):
        t = time.perf_counter()
        model = load_model(tree, device.torch_device, dtype=dtype, backend=opts.make_backend(device),
                           placement=plan if name == "streamed" else None, runtime_device=device)
        if name == "streamed":
            print(f"  {model.layer_weights.line()}", flush=True)
        runs[name] = decode(tree, model, device, opts, prompt, cont, args.warmup)
        del model
        gc.collect()
        if device.kind == "cuda":
            torch.cuda.empty_cache()
        print(
            f"{name}: {runs[name]['payload']['s_per_token'] * 1e3:.2f} ms/token ({time.perf_counter() - t:.1f} s)",
            flush=True,
        )

    ref, got = runs["resident"]["logits"], runs["streamed"]["logits"]
    identical = len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))
    p = runs["streamed"]["payload"]
    n = max(1, p["tokens"])
    dense_b, expert_b = p["dense_bytes"] / n, p["decode_bytes_h2d"] / n
    floor = (dense_b + expert_b) / (rate * 1e9) if rate else 0.0
    ratio = p["s_per_token"] / floor if floor else 0.0
    resident_s = runs["resident"]["payload"]["s_per_token"]
    header = (f"machine: {machine()}    date: {datetime.date.today()}    commit: {git_commit()}\n"
              f"geometry: {cfg.name}    command: python profiling/bench_dense_stream.py "
              + " ".join(argv if argv is not None else sys.argv[1:]))
    lines = [
        header,
        f"backend: {backend}    plan: --gpu-mem {budget / GIB:.2f} GiB, {len(plan.resident_layers)} layers resident, "
            f"{len(plan.streamed_layers)} "
        f"streamed ({share:.0%} of the dense plane) through {plan.buffers} buffers, {plan.expert_slots} expert slots",
        f"link {rate:.1f} GB/s; streamed: dense {dense_b / 1e9:.2f} GB + experts {expert_b / 1e9:.2f} GB per token -> "
        f"floor {floor * 1e3:.2f} ms/token; late dense copies {p['dense_late']}",
        f"logits bit-identical to the all-resident run: {'yes' if identical else 'NO'}",
    ]
    print("\n" + "\n".join(lines))
    print(f"target s/token <= {TARGET:.2f} x floor: {ratio:.2f} ({'PASS' if ratio and ratio <= TARGET else 'FAIL'})")
    cols = ["geometry", "--gpu-mem", "streamed dense", "buffers", "resident ms/token", "streamed ms/token",
            "dense GB/token", "expert GB/token", "link GB/s", "floor ms/token", "s/token / floor", "logits identical"]
    row = [cfg.name, f"{budget / GIB:.1f} GiB", f"{len(plan.streamed_layers)}/{cfg.num_layers} layers ({share:.0%})",
           str(plan.buffers), f"{resident_s * 1e3:.1f}", f"{p['s_per_token'] * 1e3:.1f}", f"{dense_b / 1e9:.2f}",
           f"{expert_b / 1e9:.2f}", f"{rate:.1f}", f"{floor * 1e3:.1f}", f"{ratio:.2f}", "yes" if identical else "NO"]
    md = [
        "```",
        *lines,
        "```",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
        "| " + " | ".join(row) + " |",
    ]
    print("\n--- markdown for profiling/RESULTS.md ---\n" + "\n".join(md))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
