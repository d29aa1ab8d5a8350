"""`streamrt inspect NAME|PATH [--json]`: read a model from its configuration."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from streamrt.config import BUNDLED, load_config
from streamrt.plan.placement import layer_ranges as _ranges
from streamrt.plan.budget import GIB, MIB, budget, link_floor_s_per_token


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="variant, layer schedule and derived budgets of a model",
        description="Print what a configuration implies: variant (K3 or K3.1 Pro), the 0-based layer "
        "schedule, cache-bearing layers, bytes per expert and per token, cache and state budgets. "
        f"NAME is a bundled config ({', '.join(BUNDLED)}); PATH a config.json or a checkpoint directory.",
    )
    p.add_argument("model", metavar="NAME|PATH")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--link-gbps", type=float, default=55.0, help="host->GPU link for the projection (default 55)")
    p.add_argument("--gpu-mem", default=None, metavar="BYTES[,BYTES...]",
                   help="print the placement plan for a card with this much free memory (e.g. 80G); several "
                   "sizes (24G,48G,80G) print one row each")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="with --gpu-mem: the expert-parallel placement on N such GPUs (dense replicated, experts "
                        "sharded): experts, slots and link bytes per rank, projected s/token")
    p.add_argument("--context", type=int, default=4096, metavar="TOKENS",
                   help="KV cache the plan reserves (default 4096)")
    p.add_argument("--dense-buffers", type=int, default=2, metavar="N",
                   help="device buffers streamed layers rotate through (default 2: double buffer; 3: triple)")
    p.add_argument("--hbm-gbps", type=float, default=3350.0,
                   help="GPU memory bandwidth for the compute floor of the projection (default 3350, an H100 SXM)")
    # the disk tier: the disk floor for a host RAM budget
    p.add_argument("--host-mem", default=None, metavar="BYTES",
                   help="host RAM for experts (e.g. 64G): print the disk floor, bytes per token from the drive "
                        "/ --disk-gbps")
    p.add_argument("--cpu-gbps", type=float, default=None,
                   help="with --gpu-mem: also project s/token with the host CPUs computing missed experts at this "
                        "rate of expert bytes (bench_cpu_experts.py measures it), split with the link at its floor")
    p.add_argument("--disk-gbps", type=float, default=2.0, help="drive read rate for the disk floor (default 2.0)")
    p.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                   help="prefill of an N-token prompt: expert bytes over the link chunk-major vs expert-stationary "
                        "(even router popularity, no expert resident) and the TTFT the link alone sets")
    p.add_argument("--prefill-chunk", type=int, default=4096, metavar="TOKENS",
                   help="with --prompt-tokens: tokens per chunk of the chunk-major order (default 4096)")
    p.set_defaults(func=run)


def _tensor_counts(cfg, path: Path) -> dict:
    """Tensors of the release: text (what streamrt runs) and vision (tower + projector), as the
    config implies them, or as a release tree's index lists them."""
    from streamrt.checkpoint.names import is_text_tensor, tensor_count, vision_specs

    index = path / "model.safetensors.index.json" if path.is_dir() else None
    if index is not None and index.is_file():
        from streamrt.checkpoint.release import read_index

        names = read_index(path)
        text = sum(1 for n in names if is_text_tensor(n))
        return {"tensor_count": len(names), "text_tensor_count": text, "vision_tensor_count": len(names) - text,
                "counted_from": "index"}
    text, vision = tensor_count(cfg), len(vision_specs(cfg))
    return {"tensor_count": text + vision, "text_tensor_count": text, "vision_tensor_count": vision,
            "counted_from": "config"}


def run(args: argparse.Namespace) -> int:
    from streamrt.errors import StreamrtError

    import math

    rates = (("--link-gbps", args.link_gbps), ("--hbm-gbps", args.hbm_gbps), ("--cpu-gbps", args.cpu_gbps))
    for flag, value in ((f, v) for f, v in rates if v is not None):
        if not (math.isfinite(value) and value > 0):  # nan passed `<= 0` and printed nan s/token
            raise StreamrtError(f"{flag} must be a finite number > 0, got {value}")
    if not args.model:
        raise StreamrtError("NAME|PATH is empty; give a bundled config name, a config.json or a checkpoint directory")
    if args.gpus is not None and args.gpus < 1:
        raise StreamrtError(f"--gpus must be >= 1, got {args.gpus}")
    if args.gpus is not None and args.gpu_mem is None:
        raise StreamrtError("--gpus N plans N GPUs of one size: give --gpu-mem too (e.g. --gpus 8 --gpu-mem 141G)")
    if args.prompt_tokens is not None and (args.prompt_tokens < 1 or args.prefill_chunk < 1):
        raise StreamrtError(f"--prompt-tokens and --prefill-chunk must be >= 1, got {args.prompt_tokens} and "
                            f"{args.prefill_chunk}")
    cfg = load_config(args.model)
    if args.gpu_mem is not None:
        return _placement(cfg, args)
    b = budget(cfg)
    b.update(_tensor_counts(cfg, Path(args.model)))
    disk_row = _disk_floor(cfg, args, b)
    prefill_rows = _prefill_rows(cfg, args, b)
    if args.json:
        print(json.dumps(b, indent=2))
        return 0
    rows = _budget_rows(cfg, args, b)
    if disk_row is not None:
        rows.append(disk_row)
    rows += prefill_rows
    rows.append((
        "tensors (release)",
        f"{b['tensor_count']:,} = {b['text_tensor_count']:,} text + {b['vision_tensor_count']:,} "
        "vision tower and projector "
        f"(from the {b['counted_from']})",
    ))
    width = max(len(k) for k, _ in rows)
    print(f"{cfg.name}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    return 0


def _budget_rows(cfg, args: argparse.Namespace, b: dict) -> list[tuple[str, str]]:
    """The geometry and budget rows of `streamrt inspect NAME`."""
    return [
        ("variant", b["variant"]),
        ("layers", f"{b['num_layers']} ({len(b['kda_layers'])} KDA, {len(b['mla_layers'])} MLA)"),
        ("MLA layers (0-based)", _ranges(b["mla_layers"])),
        ("KDA layers (0-based)", _ranges(b["kda_layers"])),
        ("indexer layers", _ranges(b["indexer_layers"]) if b["indexer_layers"] else "none (K3)"),
        ("dense FFN layers", _ranges(b["dense_ffn_layers"])),
        ("MoE layers", f"{_ranges(b['moe_layers'])} ({len(b['moe_layers'])})"),
        ("AttnRes groups",
         f"{b['attnres_groups']} (starts {_ranges(b['attnres_block_starts'])}; embedding is one more source)"),
        ("experts", f"{b['experts_per_layer']} per layer, top-{b['experts_per_token']}"),
        ("working set", f"{b['working_set_experts']} experts per token"),
        ("expert (NVFP4)", f"{b['expert_bytes_nvfp4']:,} B = {b['expert_bytes_nvfp4'] / MIB:.2f} MiB"),
        ("expert (MXFP4)", f"{b['expert_bytes_mxfp4']:,} B = {b['expert_bytes_mxfp4'] / MIB:.2f} MiB"),
        ("expert bytes per token", f"{b['expert_bytes_per_token'] / GIB:.2f} GiB"),
        ("expert files", f"{b['expert_files']:,} ({b['routed_bytes_total_nvfp4'] / GIB:,.1f} GiB NVFP4)"),
        ("MLA latent / token (ideal)", f"{b['mla_latent_bytes_per_token_idealized']:,} B (512-latent, bf16)"),
        ("KV cache / token (this runtime)",
         f"{b['kv_cache_bytes_per_token']:,} B (latent + key dims + indexer keys, fp32)"),
        ("KDA state / sequence",
         f"{b['kda_state_bytes']['bf16'] / MIB:.0f} MiB bf16, {b['kda_state_bytes']['fp32'] / MIB:.0f} MiB fp32"),
        ("routed params / layer", f"{b['routed_params_per_layer'] / 1e9:.2f} B "
                                  f"({b['active_routed_params_per_token_per_layer'] / 1e6:.0f} M active per token)"),
        (f"link floor @ {args.link_gbps:g} GB/s",
         f"{link_floor_s_per_token(cfg, args.link_gbps):.3f} s/token if every expert misses"),
    ]


def _disk_floor(cfg, args: argparse.Namespace, b: dict):
    """Issue 21: with --host-mem, the bytes per token the drive must deliver when the host pool
    holds a stable subset of the experts under uniform routing (store/pool.py), and the floor
    they set at --disk-gbps. Adds the numbers to `b`; returns the table row (None without it)."""
    if getattr(args, "host_mem", None) is None:
        return None
    from streamrt.checkpoint.expert_file import ExpertLayout
    from streamrt.errors import StreamrtError
    from streamrt.runtime.options import parse_bytes
    from streamrt.store.pool import expected_disk_bytes_per_token

    if not (args.disk_gbps > 0 and args.disk_gbps != float("inf")):
        raise StreamrtError(f"--disk-gbps must be a finite number > 0, got {args.disk_gbps}")
    host_mem, fb = parse_bytes(args.host_mem, "--host-mem"), ExpertLayout.for_config(cfg).file_bytes
    per_token = expected_disk_bytes_per_token(cfg, fb, host_mem)
    floor = per_token / (args.disk_gbps * 1e9)
    tier = "mapped (every expert fits)" if cfg.expert_files * fb <= host_mem else "pool"
    b.update(host_mem=host_mem, host_tier=tier.split()[0], disk_bytes_per_token=per_token, disk_gbps=args.disk_gbps,
             disk_floor_s_per_token=floor)
    return (f"disk floor @ {args.disk_gbps:g} GB/s",
            f"{floor:.3f} s/token: {per_token / 1e9:.2f} GB/token from disk with --host-mem {host_mem / GIB:.1f} GiB "
            f"(host tier {tier}; uniform routing, skew reads less)")


def _prefill_rows(cfg, args: argparse.Namespace, b: dict) -> list[tuple[str, str]]:
    """`--prompt-tokens N`: the prefill's expert bytes over the link in both orders and the TTFT
    the link sets (plan/prefill_bytes.py). Adds the numbers to `b` under "prefill"."""
    if args.prompt_tokens is None:
        return []
    from streamrt.checkpoint.expert_file import ExpertLayout
    from streamrt.plan.prefill_bytes import prefill_projection

    fb = ExpertLayout.for_config(cfg).file_bytes
    p = b["prefill"] = prefill_projection(cfg, fb, args.prompt_tokens, args.prefill_chunk, args.link_gbps)
    head = f"prefill {args.prompt_tokens:,} tokens"
    rows = [(head, f"{p['unique_experts_per_layer']:.1f} of {cfg.num_experts} experts per MoE layer routed "
                   f"(even popularity), no expert resident, link {args.link_gbps:g} GB/s")]
    for key, label in (("chunk_major", f"chunk-major (chunk {args.prefill_chunk:,})"), ("stationary", "stationary")):
        q = p[key]
        rows.append((f"  {label}", f"{q['link_bytes'] / 1e9:,.1f} GB over the link = {q['banks']:.2f} banks; "
                                   f"TTFT >= {q['ttft_link_s']:.2f} s"))
    return rows


def _placement(cfg, args: argparse.Namespace) -> int:
    """`--gpu-mem`: the placement plan (plan/placement.py) for one card, or a row per card size."""
    from streamrt.errors import StreamrtError
    from streamrt.plan.placement import format_plan, plan_placement
    from streamrt.runtime.options import parse_bytes

    if args.hbm_gbps <= 0 or args.context < 1:
        raise StreamrtError(f"--hbm-gbps must be > 0 and --context >= 1, got {args.hbm_gbps} and {args.context}")
    cpu = getattr(args, "cpu_gbps", None)
    sizes = [parse_bytes(x, "--gpu-mem") for x in str(args.gpu_mem).split(",")]
    if getattr(args, "gpus", None) is not None:
        return _rank_placement(cfg, sizes, args)
    if len(sizes) == 1:
        p = plan_placement(cfg, sizes[0], context=args.context, buffers=args.dense_buffers)
        if args.json:
            proj = p.projected_s_per_token(cfg, args.link_gbps, args.hbm_gbps)
            if cpu is not None:
                proj |= {"cpu_gbps": cpu, **p.hybrid_s_per_token(cfg, args.link_gbps, cpu, args.hbm_gbps)}
            print(json.dumps({"resident_layers": list(p.resident_layers), "streamed_layers": list(p.streamed_layers),
                              "expert_slots": p.expert_slots, "buffers": p.buffers, "fixed_bytes": p.fixed_bytes,
                              "host_bytes": p.host_bytes,
                              "streamed_bytes_per_token": p.streamed_bytes_per_token,
                              "link_bytes_per_token": p.link_bytes_per_token(cfg), **proj}, indent=2))
            return 0
        print(format_plan(cfg, p, args.link_gbps, args.hbm_gbps))
        if cpu is not None:
            print(_hybrid_line(cfg, p, args, cpu))
        return 0
    print(f"{cfg.name}: placement per card (context {args.context:,}, link {args.link_gbps:g} GB/s, "
          f"HBM {args.hbm_gbps:g} GB/s, uniform expert hits)")
    extra = f" with CPU experts @ {cpu:g} GB/s |" if cpu is not None else ""
    print("| card | resident layers | streamed dense / token | expert slots | link bytes / token | projected s/token |"
          + extra)
    print("|---|---|---|---|---|---|" + ("---|" if cpu is not None else ""))
    for size in sizes:
        try:
            p = plan_placement(cfg, size, context=args.context, buffers=args.dense_buffers)
        except StreamrtError as e:
            print(f"| {size / GIB:g} GiB | does not fit: {str(e).split(': it needs ')[-1]} | | | | |")
            continue
        proj = p.projected_s_per_token(cfg, args.link_gbps, args.hbm_gbps)
        print(f"| {size / GIB:g} GiB | {len(p.resident_layers)} of {cfg.num_layers} "
              f"| {p.streamed_bytes_per_token / GIB:.1f} GiB | {p.expert_slots:,} "
              f"| {p.link_bytes_per_token(cfg) / GIB:.1f} GiB | {proj['s_per_token']:.2f} |"
              + (f" {p.hybrid_s_per_token(cfg, args.link_gbps, cpu, args.hbm_gbps)['hybrid_s_per_token']:.2f} |"
                 if cpu is not None else ""))
    return 0


def _rank_placement(cfg, sizes: list[int], args: argparse.Namespace) -> int:
    """`--gpus N --gpu-mem B`: the expert-parallel plan per rank (streamrt.plan.shards)."""
    from dataclasses import asdict

    from streamrt.errors import StreamrtError
    from streamrt.plan.shards import format_rank_plan, plan_ranks, projected_s_per_token

    if len(sizes) != 1 or args.gpus < 1:
        raise StreamrtError(f"--gpus N takes one --gpu-mem size and N >= 1, got {len(sizes)} sizes and N = {args.gpus}")
    if args.gpus > cfg.num_experts:
        raise StreamrtError(f"--gpus {args.gpus}: more ranks than the {cfg.num_experts} experts of a layer")
    if args.json:
        p, ranks = plan_ranks(cfg, sizes[0], args.gpus, context=args.context, buffers=args.dense_buffers)
        print(json.dumps({"gpus": args.gpus, "resident_layers": list(p.resident_layers),
                          "streamed_layers": list(p.streamed_layers), "ranks": [asdict(r) for r in ranks],
                          **projected_s_per_token(cfg, ranks, args.link_gbps, args.hbm_gbps)}, indent=2))
        return 0
    print(format_rank_plan(cfg, sizes[0], args.gpus, args.link_gbps, args.hbm_gbps, context=args.context,
                           buffers=args.dense_buffers))
    return 0


def _hybrid_line(cfg, p, args, cpu: float) -> str:
    h = p.hybrid_s_per_token(cfg, args.link_gbps, cpu, args.hbm_gbps)
    return (f"  with CPU experts @ {cpu:g} GB/s  {h['hybrid_s_per_token']:.3f} s/token at the split floor "
            f"({h['cpu_bytes_per_token'] / GIB:.2f} GiB/token of missed experts on the CPU: link "
            f"{h['hybrid_link_s']:.3f} s, CPU {h['hybrid_cpu_s']:.3f} s)")
