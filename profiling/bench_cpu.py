"""Tokens/s of the torch reference forward at tiny geometry on CPU.

Random fp32 weights and random NVFP4 experts held in memory (no store, no I/O), so this
measures the reference arithmetic and its Python overhead only. Prints one markdown table
row per (variant, batch): prefill tokens/s (one prompt) and decode tokens/s (B rows, one
token each per step), plus the last logits_hash as a determinism witness.

    python profiling/bench_cpu.py --threads 2 --prompt 64 --decode 32 --batch 1 4
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
from datetime import date

import torch

from streamrt.backends.torch_backend import TorchBackend
from streamrt.config import load_config
from streamrt.model import KimiLinearForCausalLM, ModelCache, logits_hash
from streamrt.loader import DictExpertProvider
from streamrt.model.synthetic import init_random_, random_experts


def bench(name: str, prompt_len: int, decode: int, batch: int, seed: int = 0) -> dict:
    cfg = load_config(name)
    model = KimiLinearForCausalLM(cfg, backend=TorchBackend()).eval()
    init_random_(model, seed)
    prov = DictExpertProvider(random_experts(cfg, seed + 1))
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen)
    with torch.no_grad():
        model(prompts[0, :8][None], model.new_cache(1), prov)  # warm-up
        caches = []
        t0 = time.perf_counter()
        for b in range(batch):  # per-sequence prefill, as generate() does
            c = model.new_cache(1)
            model(prompts[b][None], c, prov, last_only=True)
            caches.append(c)
        t1 = time.perf_counter()
        cache = ModelCache.stack(caches)
        ids = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
        for _ in range(decode):
            logits = model(ids, cache, prov)
            ids = logits[:, -1].argmax(-1, keepdim=True)
        t2 = time.perf_counter()
    return {
        "variant": name,
        "batch": batch,
        "prefill_tok_s": batch * prompt_len / (t1 - t0),
        "decode_tok_s": batch * decode / (t2 - t1),
        "ms_per_step": 1e3 * (t2 - t1) / decode,
        "hash": logits_hash(logits[0]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence (> tiny index_topk 16)")
    p.add_argument("--decode", type=int, default=32, help="decode steps")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--variants", nargs="+", default=["tiny-k3", "tiny-k3.1-pro"])
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{a.threads} threads, load average {os.getloadavg()[0]:.1f}    date: {date.today()}    commit: {commit}")
    print(f"geometry: tiny    command: python profiling/bench_cpu.py --threads {a.threads} --prompt {a.prompt} "
          f"--decode {a.decode} --batch {' '.join(map(str, a.batch))}")
    print()
    print("| variant | B | prefill tok/s | decode tok/s | ms / decode step | logits_hash |")
    print("|---|---|---|---|---|---|")
    for name in a.variants:
        for b in a.batch:
            r = bench(name, a.prompt, a.decode, b)
            print(f"| {r['variant']} | {r['batch']} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | "
                  f"{r['ms_per_step']:.1f} | {r['hash']} |", flush=True)


if __name__ == "__main__":
    main()
