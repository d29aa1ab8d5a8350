"""Prefill at the real fan-out: expert-stationary (each MoE layer's routed experts fetched once
for the whole prompt) beside chunk-major (each chunk fetches its own again), in one run.

    python profiling/bench_stationary_prefill.py --config fanout-k3.1-pro --lengths 512,4096 --json $OUT/st.json
    python profiling/bench_stationary_prefill.py --config fanout-k3.1-pro --lengths 32768 --prefill-chunk 4096
    python profiling/bench_stationary_prefill.py --config deep-k3.1-pro --lengths 4096 --fractions 0.333
    python profiling/bench_stationary_prefill.py --cpu                  # tiny-k3.1-pro on the CPU (a dry run)

Experts in host RAM (every expert file mapped, page-locked on CUDA, before the timed prefill), a
fresh runtime per row with the given share of the bank as device slots (nothing resident at the
start), the prompt prefilled last-position-only. Per row: TTFT, routed-expert bytes over the link
and passes over the bank (the runtime's own prefill counters), and the floor: the bytes of the
experts the prompt routes, each once (counted from the routers' choices), over the link rate
measured in this run; "resident" is the same prefill with every expert preloaded into a slot
(when the bank fits the card). The issue's targets: bytes <= 1.1 x routed-once, TTFT <= 1.2 x
max(routed-once / link, resident). Each length's last-position logits are compared across the
orders and slot shares (torch.equal). A missing tree is synthesised under --workdir with even
router popularity (--skew 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode import git_commit, machine, pinned_rate  # noqa: E402
from streamrt.checkpoint.reader import open_tree  # noqa: E402
from streamrt.checkpoint.synth import synth  # noqa: E402
from streamrt.fileio import atomic_write  # noqa: E402
from streamrt.loader import load_model  # noqa: E402
from streamrt.runtime.options import RuntimeOptions  # noqa: E402
from streamrt.runtime.scheduler import StreamingRuntime  # noqa: E402
from streamrt.runtime.streams import make_device  # noqa: E402


def ensure_tree(workdir: Path, config: str, skew: float):
    workdir.mkdir(parents=True, exist_ok=True)
    root = workdir / f"{config}-skew{skew:g}"
    if not (root / "manifest.json").is_file():
        t = time.perf_counter()
        print(f"synthesising {config} (streamrt format, skew {skew:g}) into {root} ...", flush=True)
        synth(config, root, fmt="streamrt", seed=0, skew=skew, progress=sys.stderr.isatty())
        print(f"synthesised in {time.perf_counter() - t:.0f} s", flush=True)
    return open_tree(root)


def recorded(gen, seen: list):
    """The forward `gen`, passing each ExpertRequest through and keeping (layer, routed ids)."""
    answer = None
    try:
        while True:
            req = gen.send(answer)
            seen.append((req.layer, req.ids.reshape(-1).cpu()))
            answer = yield req
    except StopIteration as stop:
        return stop.value


def routed_once(seen: list) -> int:
    """Distinct (layer, expert) pairs the prompt's routers chose."""
    by_layer: dict[int, set] = {}
    for layer, ids in seen:
        by_layer.setdefault(layer, set()).update(ids.tolist())
    return sum(len(s) for s in by_layer.values())


def sync(device) -> None:
    if device.kind == "cuda":
        torch.cuda.synchronize(device.torch_device)


def prefill_row(tree, model, device, opts: RuntimeOptions, prompt: torch.Tensor, chunk: int, order: str,
                resident: bool) -> dict:
    """One prefill on a fresh runtime -> its row (and the last position's logits under "logits")."""
    rt = StreamingRuntime(tree, model, opts, device=device)
    try:
        if resident:
            rt.preload()
        else:
            rt.warm_host()
        rt.reset_stats()
        if device.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(device.torch_device)
        model.prefill_order, seen = order, []
        sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            gen = model.forward_steps(prompt[None].to(device.torch_device), model.new_cache(1), last_only=True,
                                      prefill_chunk=chunk)
            logits = rt.run(recorded(gen, seen)).reshape(-1).float().cpu()
        ttft = time.perf_counter() - t
        p = rt.payload()["prefill"]
    finally:
        rt.close()
        model.prefill_order = "layer"
        if device.kind == "cuda":
            torch.cuda.empty_cache()  # the slab and transient buffers go back: the next row (resident) sees them free
    peak = torch.cuda.max_memory_allocated(device.torch_device) if device.kind == "cuda" else 0
    return {"order": order, "ttft_s": ttft, "bytes_h2d": p["bytes_h2d"], "experts_loaded": p["experts_loaded"],
            "bank_passes": p["bank_passes"], "layer_requests": p["layer_requests"],
            "routed_once": routed_once(seen), "device_peak_bytes": peak, "logits": logits}


def fits_resident(tree, device) -> bool:
    bank = tree.config.expert_files * tree.layout.file_bytes
    if device.kind != "cuda":
        return True
    return torch.cuda.mem_get_info(device.torch_device)[0] > bank + (8 << 30)


def run_length(tree, model, device, args, length: int, link: float) -> list[dict]:
    """Every row of one prompt length: per slot share, stationary then chunk-major; then resident."""
    cfg, fb = tree.config, tree.layout.file_bytes
    g = torch.Generator().manual_seed(args.seed + length)
    prompt = torch.randint(0, cfg.vocab_size - 256, (length,), generator=g)
    base = dict(device=args.device, verify_experts="off", backend=args.backend)
    plan = [(f, order) for f in args.fractions for order in ("layer", "chunk")]
    rows = []
    for frac, order in plan:
        slots = max(cfg.experts_per_token, round(frac * cfg.expert_files))
        opts = RuntimeOptions(**base, gpu_experts=slots)
        r = prefill_row(tree, model, device, opts, prompt, args.prefill_chunk, order, resident=False)
        rows.append({"slots": slots, "fraction": frac, **r})
        print(line(cfg, length, args.prefill_chunk, rows[-1], fb, link), flush=True)
    if args.resident and fits_resident(tree, device):
        opts = RuntimeOptions(**base, gpu_experts=cfg.expert_files)
        r = prefill_row(tree, model, device, opts, prompt, args.prefill_chunk, "layer", resident=True)
        rows.append({"slots": cfg.expert_files, "fraction": 1.0, **r, "order": "resident"})
        print(line(cfg, length, args.prefill_chunk, rows[-1], fb, link), flush=True)
    elif args.resident:
        print(f"{cfg.name} {length}: resident row skipped (the bank does not fit the card)", flush=True)
    resident = next((r["ttft_s"] for r in rows if r["order"] == "resident"), 0.0)
    same = all(torch.equal(r["logits"], rows[0]["logits"]) for r in rows)
    for r in rows:
        r.pop("logits")
        once = r["routed_once"] * fb
        floor = max(once / (link * 1e9) if link else 0.0, resident)
        r.update(length=length, chunk=args.prefill_chunk, routed_once_bytes=once,
                 bytes_over_routed=r["bytes_h2d"] / once if once else 0.0, floor_s=floor,
                 ttft_over_floor=r["ttft_s"] / floor if floor else 0.0, logits_identical=same)
    print(f"{cfg.name} {length}: last-position logits bit-identical across orders and slots: "
          f"{'yes' if same else 'NO'}", flush=True)
    return rows


def line(cfg, length: int, chunk: int, r: dict, fb: int, link: float) -> str:
    once = r["routed_once"] * fb
    return (f"{cfg.name} {length:>6} tok chunk {chunk:>5} {r['order']:>8} slots {r['slots']:>5} "
            f"({r['fraction']:.3g}): TTFT {r['ttft_s']:8.2f} s  link {r['bytes_h2d'] / 1e9:8.4g} GB "
            f"= {r['bank_passes']:5.2f} banks  routed once {once / 1e9:6.4g} GB "
            f"(x{r['bytes_h2d'] / once if once else 0:.2f})  link floor {once / (link * 1e9) if link else 0:.2f} s")


def table(rows: list[dict]) -> str:
    out = ["| length | chunk | slots | order | TTFT s | link GB | banks | bytes / routed-once | floor s | "
           "TTFT / floor | device peak GiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['length']:,} | {r['chunk']:,} | {r['slots']:,} ({r['fraction']:.3g}) | {r['order']} "
                   f"| {r['ttft_s']:.2f} | {r['bytes_h2d'] / 1e9:.4g} | {r['bank_passes']:.2f} "
                   f"| {r['bytes_over_routed']:.2f} | {r['floor_s']:.2f} | {r['ttft_over_floor']:.2f} "
                   f"| {r['device_peak_bytes'] / 2**30:.1f} |")
    return "\n".join(out)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="fanout-k3.1-pro")
    ap.add_argument("--tree", type=Path, default=None, help="an existing streamrt tree (else synthesised)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/streamrt-bench"))
    ap.add_argument("--skew", type=float, default=0.0, help="router skew of a synthesised tree (0: even)")
    ap.add_argument("--lengths", default="512,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="tokens per chunk (both orders)")
    ap.add_argument("--fractions", default="0.333,0.1", help="device slots as shares of the bank")
    ap.add_argument("--no-resident", dest="resident", action="store_false", help="skip the all-resident row")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--backend", default="torch", choices=("torch", "nvrtc"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="dry run: tiny-k3.1-pro on the CPU, short prompts")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    if args.cpu:
        args.config, args.device, args.backend = "tiny-k3.1-pro", "cpu", "torch"
        torch.set_num_threads(1)  # a shared CPU: one thread times steadier
        if args.lengths == "512,4096":
            args.lengths, args.prefill_chunk = "64,160", 32
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.fractions = [float(x) for x in args.fractions.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = make_device(args.device)
    tree = open_tree(args.tree) if args.tree else ensure_tree(args.workdir, args.config, args.skew)
    backend = RuntimeOptions(backend=args.backend).make_backend(device)
    dtype = torch.bfloat16 if device.kind == "cuda" else None
    model = load_model(tree, device.torch_device, dtype=dtype, backend=backend)
    link = pinned_rate(device, 1 << 30)
    cfg = tree.config
    print(f"{machine()}; commit {git_commit()}; {cfg.name}: {cfg.num_experts} experts x {len(cfg.moe_layers)} MoE "
          f"layers, bank {cfg.expert_files * tree.layout.file_bytes / 1e9:.1f} GB; pinned H2D {link:.1f} GB/s; "
          f"backend {args.backend}", flush=True)
    rows = [r for length in args.lengths for r in run_length(tree, model, device, args, length, link)]
    print(table(rows))
    if args.json:
        atomic_write(args.json, json.dumps({"machine": machine(), "commit": git_commit(), "config": cfg.name,
                                            "link_gbps": link, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
