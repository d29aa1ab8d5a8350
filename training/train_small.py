"""Train the small K3.1 Pro-architecture default model (issue 9). Developer command:

    python training/train_small.py --out DIR [--minutes 30] [--seed 0] [--install]

What it does, in order:
1. Renders the corpus (training/corpus.py, split "train") with `streamrt.chat.encode_chat`;
   the loss is on assistant tokens only (each assistant message is cut at the exact
   generation prompt the runtime renders, so training and inference see the same ids).
2. Trains `KimiLinearForCausalLM(cfg, float_experts=True)` through the project's torch
   forward (chunked KDA, full-sequence MLA with the Lightning Indexer selection, latent MoE
   with float experts, AttnRes), seeded. Indexer as DeepSeek-V3.2 (spec/INDEXER_FP4.md §A):
   - dense warm-up (first `--warmup-frac` of the run): MLA attends to every causal key
     (`self_attn.sparse = False`); the indexer is fitted by KL to the detached main
     attention distribution summed over heads (and normalised), on detached inputs;
   - sparse training: selection on (top-`index_topk` per query); the LM loss trains the
     model through the sparse attention; the indexer keeps fitting the main attention
     (recomputed densely, detached) over all causal keys (`--kl-selected`: over the selected
     set only, as V3.2 does for a model whose attention is already trained).
   Each indexed MLA layer's input is captured with a forward hook and the main attention
   distribution is recomputed here from the module's weights (no model edits beyond the
   `sparse` switch). Routing is balanced without an aux loss (DeepSeek-V3 bias update of
   `e_score_correction_bias`).
3. Quantisation-aware tail (last `--qat-frac`): routed experts are fake-quantised to MXFP4
   and every other dense tensor to BF16 (what the release stores), straight-through.
4. Export: a release tree (the synth writer, with the trained tensors: BF16 dense, MXFP4
   experts) in DIR/release, converted with the real `streamrt convert` into DIR/converted;
   `--install` then replaces `streamrt/assets/default_model/` atomically (rename).

Data mix per step: a weather batch (share `--p-long`; `--synth-frac` of its conversations use
made-up cities and random tool results, so the model must copy) or a short batch (facts,
plain text, and `--copy-frac` short copy exercises). See training/NOTES.md for the run that
produced the shipped model and its measured numbers.

Checkpoints (model + optimiser + step) go to DIR/ckpt.pt every `--ckpt-minutes`;
`--resume` continues from it. `--steps N` fixes the step count (otherwise the run is
bounded by `--minutes` of wall time, so the step count depends on the machine).
Runs on CPU by default (`--threads 2`); `--device cuda` works too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))

import corpus as corpus_mod  # noqa: E402

from streamrt.backends.torch_backend import TorchBackend  # noqa: E402
from streamrt.chat import encode_chat  # noqa: E402
from streamrt.config import load_config  # noqa: E402
from streamrt.model import KimiLinearForCausalLM  # noqa: E402
from streamrt.model.indexer import topk_mask  # noqa: E402
from streamrt.model.loader import FP32_TENSORS  # noqa: E402
from streamrt.model.mla import KimiMLAAttention  # noqa: E402
from streamrt.tokenizer import ByteTokenizer  # noqa: E402

CONFIG = ROOT / "training" / "small-k3.1-pro.json"
ASSET_DIR = ROOT / "streamrt" / "assets" / "default_model"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


# ---- data ------------------------------------------------------------------------------


def encode_example(tok, conv) -> tuple[list[int], list[int]]:
    """(ids, mask): mask[i] = 1 where ids[i] is an assistant token the model must produce.

    For each assistant message the prompt is exactly what the runtime renders before it
    (history + generation prompt); the target is the rest of that message."""
    full = encode_chat(tok, conv.messages, conv.tools, add_generation_prompt=False)
    mask = [0] * len(full)
    for i, m in enumerate(conv.messages):
        if m["role"] != "assistant":
            continue
        prompt = encode_chat(tok, conv.messages[:i], conv.tools, add_generation_prompt=True)
        upto = encode_chat(tok, conv.messages[: i + 1], conv.tools, add_generation_prompt=False)
        assert upto[: len(prompt)] == prompt and full[: len(upto)] == upto, "render is not prefix-stable"
        for j in range(len(prompt), len(upto)):
            mask[j] = 1
    return full, mask


def make_batch(examples, pad_id: int, device):
    T = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), T), dtype=torch.bool)
    for b, (x, m) in enumerate(examples):
        ids[b, : len(x)] = torch.tensor(x)
        mask[b, : len(m)] = torch.tensor(m, dtype=torch.bool)
    return ids.to(device), mask.to(device)


# ---- backend that records routing (for the aux-loss-free balance) ------------------------


class TrainBackend(TorchBackend):
    def __init__(self):
        super().__init__()
        self.loads: dict[int, torch.Tensor] = {}  # id(gate weight) -> token count per expert
        self.record = False

    def router(self, x, w_gate, bias, k, renormalize, scale, **kw):
        ids, w = super().router(x, w_gate, bias, k, renormalize, scale, **kw)
        if self.record:
            cnt = torch.bincount(ids.reshape(-1), minlength=w_gate.shape[0]).float()
            key = id(w_gate)
            self.loads[key] = self.loads.get(key, 0) + cnt
        return ids, w


# ---- indexer KL (DeepSeek-V3.2 warm-up / sparse training) -------------------------------


def main_attention_target(mla: KimiMLAAttention, x, B, T, valid, be):
    """Recompute the main attention of an MLA layer from its weights: p summed over heads,
    normalised, [B, T, n] (detached). valid [B, T, n] bool: the keys attention may use."""
    with torch.no_grad():
        H, dn, dr, R = mla.H, mla.dn, mla.dr, mla.R
        N = x.shape[0]
        cq = mla.q_a_layernorm(be.linear(x, mla.q_a_proj.weight), be)
        q = be.linear(cq, mla.q_b_proj.weight).view(B, T, H, dn + dr)
        kv = be.linear(x, mla.kv_a_proj_with_mqa.weight)
        c = mla.kv_a_layernorm(kv[:, :R], be)
        kr = kv[:, R:].view(B, T, dr)
        k_nope = be.linear(c, mla.kv_b_proj.weight).view(B, T, H, dn + mla.dv)[..., :dn]
        s = (torch.einsum("bthd,bshd->bhts", q[..., :dn], k_nope) + torch.einsum("bthd,bsd->bhts", q[..., dn:], kr)) * mla.scale
        p = torch.softmax(s.masked_fill(~valid[:, None], float("-inf")), -1).sum(1)  # [B, T, n]
        return p / p.sum(-1, keepdim=True), cq.view(N, -1)


def indexer_kl(mla: KimiMLAAttention, x, B, T, token_mask, sparse: bool, be):
    """KL(target || softmax(I)) per query, averaged over real (non-pad) queries.

    sparse=False: over every causal key (the dense warm-up, and `--kl-full` in the sparse
    phase: the target is then the main attention recomputed densely). sparse=True: over the
    selected keys only (DeepSeek-V3.2's sparse stage)."""
    x = x.detach()
    ar = torch.arange(T, device=x.device)
    causal = (ar[None, :] <= ar[:, None]).expand(B, T, T)
    ind = mla.indexer
    with torch.no_grad():
        cq = mla.q_a_layernorm(be.linear(x, mla.q_a_proj.weight), be)
    qi, ki, wi = ind(x, cq.detach(), be)
    I = ind.prefill_scores(qi.view(B, T, *qi.shape[1:]), wi.view(B, T, -1), ki.view(B, T, -1), 0)  # [B, T, T], -inf s>t
    valid = causal
    if sparse:
        valid = causal & topk_mask(I.detach(), (ar + 1).expand(B, T), ind.topk)
    target, _ = main_attention_target(mla, x, B, T, valid, be)
    logq = torch.log_softmax(I.masked_fill(~valid, float("-inf")), -1)
    kl = (target * (torch.log(target.clamp_min(1e-30)) - logq)).masked_fill(~valid, 0.0).sum(-1)  # [B, T]
    w = token_mask.float()
    return (kl * w).sum() / w.sum().clamp_min(1.0)


# ---- fake quantisation (QAT tail) ---------------------------------------------------------


def mxfp4_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """The value the release stores for w: quantise to MXFP4 (synth's rule) and decode."""
    from streamrt.checkpoint.synth import quantize_mxfp4_torch

    packed, scales = quantize_mxfp4_torch(w.detach().float())
    lut = torch.tensor(E2M1, dtype=torch.float32, device=w.device)
    p = packed.to(torch.int64)
    vals = torch.stack((lut[p & 15], lut[p >> 4]), -1).view(w.shape[0], -1, 32)
    scale = torch.exp2(scales.to(torch.float32) - 127.0)
    return (vals * scale[..., None]).view_as(w)


def quant_targets(model):
    """[(param, kind)] for the QAT tail: 'fp4' routed experts, 'bf16' other dense tensors."""
    out = []
    for name, p in model.named_parameters():
        if ".block_sparse_moe.experts." in name:
            out.append((p, "fp4"))
        elif not any(name.endswith(s) for s in FP32_TENSORS):
            out.append((p, "bf16"))
    return out


class FakeQuant:
    """Straight-through: forward/backward see quantised weights, the update hits the masters."""

    def __init__(self, targets):
        self.targets = targets
        self.masters = None

    def __enter__(self):
        self.masters = []
        with torch.no_grad():
            for p, kind in self.targets:
                self.masters.append(p.data.clone())
                p.data.copy_(mxfp4_roundtrip(p.data) if kind == "fp4" else p.data.to(torch.bfloat16).float())
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for (p, _), m in zip(self.targets, self.masters):
                p.data.copy_(m)
        self.masters = None


# ---- model ------------------------------------------------------------------------------


def build_model(cfg, seed: int, device):
    torch.manual_seed(seed)
    be = TrainBackend()
    model = KimiLinearForCausalLM(cfg, float_experts=True, backend=be)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_(0, 1.0)
            elif name.endswith(".gate.weight"):
                p.normal_(0, cfg.hidden_size**-0.5)
            elif name.endswith(".A_log"):
                p.zero_()
            elif name.endswith(".dt_bias"):
                # channel time scales: decay exp(lb * sigmoid(dt)) from ~0.99 to ~0.2 per token
                p.copy_(torch.linspace(-6.0, 1.0, p.numel())[torch.randperm(p.numel())])
    return model.to(device), be


def set_sparse(model, sparse: bool) -> None:
    for m in model.modules():
        if isinstance(m, KimiMLAAttention) and m.indexer is not None:
            m.sparse = sparse


# ---- export -----------------------------------------------------------------------------


def export_release(model, cfg, out: Path) -> None:
    """Write a release tree with the trained tensors, through synth's release writer."""
    from tqdm import tqdm

    from streamrt.checkpoint.names import strip_prefix
    from streamrt.checkpoint.synth import DEFAULT_SHARD_BYTES, Generator, quantize_mxfp4_torch, synth_release
    from streamrt.model import dense_state_dict, export_float_experts

    dense = {k: v.detach().float().cpu() for k, v in dense_state_dict(model).items()}
    experts = export_float_experts(model)

    class Trained(Generator):
        def dense_chunks(self, spec):
            yield self._bytes(dense[strip_prefix(spec.name)].reshape(spec.shape), spec.dtype)

        def expert_mxfp4(self, layer, expert, w):
            p, s = quantize_mxfp4_torch(experts[(layer, expert)][w])
            return p.numpy(), s.numpy()

    out.mkdir(parents=True)
    with tqdm(disable=True) as bar:
        synth_release(cfg, out, Trained(cfg, 0, 0.0, "cpu"), shard_bytes=DEFAULT_SHARD_BYTES, workers=1, bar=bar)


def convert(release: Path, dst: Path) -> None:
    cmd = [sys.executable, "-m", "streamrt", "convert", str(release), str(dst), "--no-progress", "--workers", "2"]
    subprocess.run(cmd, check=True, cwd=ROOT)


def install(converted: Path, target: Path = ASSET_DIR) -> None:
    """Replace target with a copy of converted, atomically (copy beside it, then rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.new-{os.getpid()}"
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(converted, tmp, ignore=shutil.ignore_patterns(".convert"))
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def save_ckpt(path: Path, model, opt, step: int, elapsed: float, be) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed}, tmp)
    os.replace(tmp, path)


# ---- training ---------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--minutes", type=float, default=30.0, help="wall-time budget of the training loop")
    ap.add_argument("--steps", type=int, default=None, help="fixed step count (overrides --minutes for the schedule)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per batch")
    ap.add_argument("--synth-frac", type=float, default=0.3, help="share of weather examples with made-up cities")
    ap.add_argument("--p-long", type=float, default=0.5, help="share of steps on weather (long) batches")
    ap.add_argument("--copy-frac", type=float, default=0.3, help="share of short examples that are copy exercises")
    ap.add_argument("--kl-selected", dest="kl_full", action="store_false",
                    help="sparse phase: KL over the selected keys only, exactly as DeepSeek-V3.2 (default: the "
                    "indexer keeps fitting the main attention recomputed densely over all causal keys, so keys it "
                    "does not select yet stay learnable; this small model is trained from scratch, not warm)")
    ap.add_argument("--warmup-frac", type=float, default=0.5, help="dense indexer warm-up share of the run")
    ap.add_argument("--qat-frac", type=float, default=0.15, help="quantisation-aware share at the end")
    ap.add_argument("--ckpt-minutes", type=float, default=3.0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--install", action="store_true", help="install the converted tree as streamrt/assets/default_model")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--state-out", type=Path, default=None, help="also save the final model state (fp32) here")
    ap.add_argument("--no-export", action="store_true", help="stop after training (no release tree / convert)")
    ap.add_argument("--from-state", type=Path, default=None, help="skip training: export (and install) this model state")
    ap.add_argument("--init-state", type=Path, default=None, help="start from this model state (fresh optimiser)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    device = torch.device(args.device)
    cfg = load_config(args.config)
    tok = ByteTokenizer(cfg.vocab_size)
    pad = cfg.pad_token_id
    args.out.mkdir(parents=True, exist_ok=True)

    data = corpus_mod.split(corpus_mod.build_corpus(args.seed), "train")
    enc = [encode_example(tok, c) for c in data]
    long_ex = [e for e, c in zip(enc, data) if c.kind == "weather"]
    short_ex = [e for e, c in zip(enc, data) if c.kind != "weather"]
    n_tgt = sum(sum(m) for _, m in enc)
    log(f"corpus: {len(enc)} train conversations ({len(long_ex)} weather, {len(short_ex)} short), "
        f"{sum(len(i) for i, _ in enc)} tokens, {n_tgt} target tokens; max len {max(len(i) for i, _ in enc)}")
    # Share of steps on the long (weather) batches ~ their share of target tokens, at least half.
    long_tgt = sum(sum(m) for _, m in long_ex)
    p_long = args.p_long

    model, be = build_model(cfg, args.seed, device)
    if args.from_state is not None:
        st = torch.load(args.from_state, map_location="cpu")
        model.load_state_dict(st["model"])
        finish(model.cpu(), cfg, args.out, args.install, st.get("info", {}))
        return 0
    if args.init_state is not None:
        model.load_state_dict(torch.load(args.init_state, map_location="cpu")["model"])
        log(f"initialised from {args.init_state}")
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed_tokens" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    step, elapsed0 = 0, 0.0
    ckpt = args.out / "ckpt.pt"
    if args.resume and ckpt.exists():
        st = torch.load(ckpt, map_location=device)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed0 = st["step"], st["elapsed"]
        log(f"resumed at step {step}, {elapsed0 / 60:.1f} min")

    mlas = [m for m in model.modules() if isinstance(m, KimiMLAAttention) and m.indexer is not None]
    captured: dict[int, torch.Tensor] = {}
    for m in mlas:
        m.register_forward_hook(lambda mod, a, out: captured.__setitem__(id(mod), a[0]))
    gates = {id(l.block_sparse_moe.gate.weight): l.block_sparse_moe.gate for l in model.model.layers if hasattr(l, "block_sparse_moe")}
    qtargets = quant_targets(model)
    rng = random.Random(args.seed + 1)
    budget = args.minutes * 60
    t_start = time.perf_counter() - elapsed0
    last_ckpt = time.perf_counter()
    stats = {"loss": 0.0, "kl": 0.0, "acc": 0.0, "seq": 0.0, "n": 0, "tok": 0}
    phase = None
    while True:
        elapsed = time.perf_counter() - t_start
        progress = step / args.steps if args.steps else elapsed / budget
        if progress >= 1.0:
            break
        new_phase = "dense" if progress < args.warmup_frac else ("qat" if progress >= 1 - args.qat_frac else "sparse")
        if new_phase != phase:
            log(f"phase {new_phase} at step {step} ({elapsed / 60:.1f} min)")
            phase = new_phase
        sparse = phase != "dense"
        set_sparse(model, sparse)
        lr = args.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        pool = long_ex if rng.random() < p_long else short_ex
        maxlen = max(len(i) for i, _ in pool)
        bsz = max(1, min(len(pool), args.batch_tokens // maxlen))
        picked = rng.sample(pool, bsz)
        if pool is long_ex and args.synth_frac > 0:  # made-up cities: copying, not recall
            picked = [encode_example(tok, corpus_mod.synthetic_weather(rng)) if rng.random() < args.synth_frac else e
                      for e in picked]
        elif pool is short_ex and args.copy_frac > 0:  # short copy exercises (cheap copying signal)
            picked = [encode_example(tok, corpus_mod.copy_conversation(rng)) if rng.random() < args.copy_frac else e
                      for e in picked]
        ids, mask = make_batch(picked, pad, device)
        B, T = ids.shape
        tmask = ids != pad

        captured.clear()
        be.loads.clear()
        be.record = True
        ctx = FakeQuant(qtargets) if phase == "qat" else None
        if ctx:
            ctx.__enter__()
        try:
            logits = model(ids)  # [B, T, V]
            be.record = False
            tgt = mask[:, 1:]
            lp = logits[:, :-1]
            loss = F.cross_entropy(lp[tgt], ids[:, 1:][tgt])
            kl_sparse = sparse and not args.kl_full
            kl = sum(indexer_kl(m, captured[id(m)], B, T, tmask, kl_sparse, be) for m in mlas) / len(mlas)
            opt.zero_grad(set_to_none=True)
            (loss + kl).backward()
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # aux-loss-free balance: push bias toward under-used experts
            for key, cnt in be.loads.items():
                g = gates[key]
                g.e_score_correction_bias.add_(1e-3 * torch.sign(cnt.mean() - cnt))
            pred = lp.argmax(-1) == ids[:, 1:]
            stats["acc"] += float(pred[tgt].float().mean())
            stats["seq"] += float(((pred | ~tgt).all(-1)).float().mean())
        stats["loss"] += float(loss.detach())
        stats["kl"] += float(kl.detach())
        stats["n"] += 1
        stats["tok"] += B * T
        step += 1
        if step % args.log_every == 0:
            n = stats["n"]
            el = time.perf_counter() - t_start
            log(f"step {step} {phase} lr {lr:.2e} loss {stats['loss'] / n:.4f} kl {stats['kl'] / n:.4f} "
                f"tok_acc {stats['acc'] / n:.4f} seq_exact {stats['seq'] / n:.3f} "
                f"{stats['tok'] / max(1e-9, el - stats.get('t0', 0)):.0f} tok/s elapsed {el / 60:.1f} min")
            stats = {"loss": 0.0, "kl": 0.0, "acc": 0.0, "seq": 0.0, "n": 0, "tok": 0, "t0": el}
        if time.perf_counter() - last_ckpt > args.ckpt_minutes * 60:
            save_ckpt(ckpt, model, opt, step, time.perf_counter() - t_start, be)
            last_ckpt = time.perf_counter()

    train_s = time.perf_counter() - t_start
    save_ckpt(ckpt, model, opt, step, train_s, be)
    log(f"training done: {step} steps, {train_s / 60:.1f} min")
    set_sparse(model, True)
    model = model.cpu()
    info = {"steps": step, "train_minutes": round(train_s / 60, 2), "seed": args.seed, "device": str(device),
            "threads": args.threads, "argv": sys.argv[1:]}
    if args.state_out is not None:
        torch.save({"model": model.state_dict(), "info": info}, args.state_out)
    if not args.no_export:
        finish(model, cfg, args.out, args.install, info)
    return 0


def finish(model, cfg, out: Path, do_install: bool, info: dict) -> None:
    """Export (release tree -> streamrt convert) and optionally install."""
    work = out / f".export-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    export_release(model, cfg, work / "release")
    convert(work / "release", work / "converted")
    for name in ("release", "converted"):
        dst = out / name
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(work / name, dst)
    shutil.rmtree(work, ignore_errors=True)
    (out / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
    log(f"exported: {out / 'release'} -> {out / 'converted'}")
    if do_install:
        install(out / "converted")
        log(f"installed into {ASSET_DIR}")


if __name__ == "__main__":
    raise SystemExit(main())
