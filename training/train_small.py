"""Train the small K3.1 Pro-architecture default model. Developer command:

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
made-up cities and random tool results, `--tool-random-frac` real cities with random tool
results, so the model must copy) or a short batch (facts, plain text, and `--copy-frac` short
copy exercises, `--copy-numbers` of them repeating a number). `--answer-weight W` multiplies the
loss on the answer tokens after a tool result that quote its values (`--answer-scope values`:
temperature digits, condition, city; `message`: the whole answer message); `--show-mask` prints
that mask for one example (`check_answer_mask`). `--probe N` logs a teacher-forced copy check
(sparse, fake-quantised) before and after training. See training/NOTES.md for the runs that
produced the shipped model and their measured numbers.

Checkpoints (model + optimiser + step) go to DIR/ckpt.pt every `--ckpt-minutes`;
`--resume` continues from it. `--steps N` fixes the step count (otherwise the run is
bounded by `--minutes` of wall time, so the step count depends on the machine).
Runs on CPU by default (`--threads 2`); `--device cuda` works too.
"""

from __future__ import annotations

import argparse
import io
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
import corpus_chat  # noqa: E402

from streamrt.backends.torch_backend import TorchBackend  # noqa: E402
from streamrt.chat import encode_chat  # noqa: E402
from streamrt.config import load_config  # noqa: E402
from streamrt.fileio import atomic_write  # noqa: E402
from streamrt.model import KimiLinearForCausalLM  # noqa: E402
from streamrt.ops import topk_mask  # noqa: E402
from streamrt.loader import FP32_TENSORS  # noqa: E402
from streamrt.model.mla import KimiMLAAttention  # noqa: E402
from streamrt.tokenizer import ByteTokenizer  # noqa: E402

CONFIG = ROOT / "training" / "small-k3.1-pro.json"
ASSET_DIR = ROOT / "streamrt" / "assets" / "default_model"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


# ---- data ------------------------------------------------------------------------------


def encode_example(tok, conv, scope: str = "values") -> tuple[list[int], list[int], list[int]]:
    """(ids, mask, answer): mask[i] = 1 where ids[i] is an assistant token the model must produce;
    answer[i] = 1 on the subset `--answer-weight` boosts (see `answer_positions`).

    For each assistant message the prompt is exactly what the runtime renders before it
    (history + generation prompt); the target is the rest of that message."""
    if conv.meta.get("render"):
        return encode_formatted(tok, conv)
    full = encode_chat(tok, conv.messages, conv.tools, add_generation_prompt=False)
    mask = [0] * len(full)
    answer = [0] * len(full)
    for i, m in enumerate(conv.messages):
        if m["role"] != "assistant" or i < conv.meta.get("train_from", 0):
            continue
        prompt = encode_chat(tok, conv.messages[:i], conv.tools, add_generation_prompt=True)
        upto = encode_chat(tok, conv.messages[: i + 1], conv.tools, add_generation_prompt=False)
        assert upto[: len(prompt)] == prompt and full[: len(upto)] == upto, "render is not prefix-stable"
        for j in range(len(prompt), len(upto)):
            mask[j] = 1
        if i > 0 and conv.messages[i - 1]["role"] == "tool":
            for j in answer_positions(tok, conv.messages[i - 1], full, len(prompt), len(upto), scope):
                answer[j] = 1
    return full, mask, answer


def encode_formatted(tok, conv) -> tuple[list[int], list[int], list[int]]:
    """A one-answer conversation rendered with extra keywords (response_format): that system
    message follows the conversation, so the sequence is the generation prompt with it, then
    the final assistant message's tokens (the same ids as without it)."""
    kw = conv.meta["render"]
    *hist, last = conv.messages
    assert last["role"] == "assistant" and all(m["role"] != "assistant" for m in hist)
    plain = encode_chat(tok, hist, conv.tools, add_generation_prompt=True)
    target = encode_chat(tok, conv.messages, conv.tools, add_generation_prompt=False)[len(plain):]
    prompt = encode_chat(tok, hist, conv.tools, add_generation_prompt=True, **kw)
    return prompt + target, [0] * len(prompt) + [1] * len(target), [0] * (len(prompt) + len(target))


def answer_positions(tok, tool_msg: dict, full: list[int], lo: int, hi: int, scope: str) -> list[int]:
    """Positions in full[lo:hi] (an assistant message right after a tool result) to boost.

    scope "message": the whole message (think + response + closing specials).
    scope "values": only the tokens that quote a value of the tool result, i.e. every
    occurrence inside the message's response text of str(v) for each value v of the tool's
    JSON object (weather: the temperature digits with any minus sign, the condition, the city)."""
    if scope == "message":
        return list(range(lo, hi))
    try:
        result = json.loads(tool_msg["content"])
    except (ValueError, TypeError):
        return []
    vals = result.values() if isinstance(result, dict) else []
    out: set[int] = set()
    seg = full[lo:hi]
    for v in vals:
        pat = tok.encode(str(v))
        n = len(pat)
        for s in range(len(seg) - n + 1):
            if n and seg[s : s + n] == pat:
                out.update(range(lo + s, lo + s + n))
    return sorted(out)


def check_answer_mask(tok, conv, scope: str = "values", show: bool = True) -> list[str]:
    """The boosted spans of one conversation, decoded (and printed with the loss mask).

    Asserts that boosted tokens are loss targets and (scope "values", weather) spell exactly the
    tool result's values as the final answer quotes them: [temperature, condition, city].
    Returns the decoded spans in order. CLI: `train_small.py --out X --show-mask`."""
    ids, mask, answer = encode_example(tok, conv, scope)
    assert all(m for m, a in zip(mask, answer) if a), "boosted token outside the loss mask"
    spans, cur = [], []
    for j, a in enumerate(answer):
        if a:
            cur.append(ids[j])
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    if cur:
        spans.append(tok.decode(cur))
    if scope == "values" and conv.kind == "weather":
        r = conv.meta["result"]
        assert spans == [str(r["temperature_c"]), r["condition"], r["city"]], spans
    if show:
        first = next((j for j, m in enumerate(mask) if m), 0)
        out, state = [], None  # state: the marker of the open group ("{": not a target, "[": boosted)
        for j in range(first, len(ids)):
            t = tok.special_name(ids[j]) if tok.is_special(ids[j]) else tok.decode([ids[j]])
            want = "[" if answer[j] else ("" if mask[j] else "{")
            if want != state:
                out.append({"[": "]", "{": "}", None: "", "": ""}[state] + want)
                state = want
            out.append(t)
        out.append({"[": "]", "{": "}", None: "", "": ""}[state])
        print(f"targets {sum(mask)} tokens, boosted {sum(answer)} tokens (scope {scope}): {spans}")
        print("from the first target on; {..} = not a target (prompt / tool text), [..] = boosted target:")
        print("".join(out))
    return spans


def make_batch(examples, pad_id: int, device):
    """examples [(ids, mask, answer)] -> (ids [B, T] long, mask [B, T] bool, answer [B, T] bool), padded."""
    T = max(len(ex[0]) for ex in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), T), dtype=torch.bool)
    ans = torch.zeros((len(examples), T), dtype=torch.bool)
    for b, (x, m, a) in enumerate(examples):
        ids[b, : len(x)] = torch.tensor(x)
        mask[b, : len(m)] = torch.tensor(m, dtype=torch.bool)
        ans[b, : len(a)] = torch.tensor(a, dtype=torch.bool)
    return ids.to(device), mask.to(device), ans.to(device)


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
        s = (
            torch.einsum("bthd,bshd->bhts", q[..., :dn], k_nope) + torch.einsum("bthd,bsd->bhts", q[..., dn:], kr)
        ) * mla.scale
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
    qi, ki, wi = ind.from_projections(be.linear(cq.detach(), ind.wq_b.weight), be.linear(x, ind.wk.weight),
                                      be.linear(x, ind.weights_proj.weight), be)
    wi = ind.head_weights(wi)
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
    from streamrt.checkpoint.synth import Generator, quantize_mxfp4_torch, synth_release
    from streamrt.model import dense_state_dict, export_float_experts

    dense = {k: v.detach().float().cpu() for k, v in dense_state_dict(model).items()}
    experts = export_float_experts(model)

    class Trained(Generator):
        def dense_chunks(self, spec):
            name = strip_prefix(spec.name)
            if name not in dense:  # the release's vision tower: not trained here, dropped by convert
                yield from super().dense_chunks(spec)
                return
            yield self._bytes(dense[name].reshape(spec.shape), spec.dtype)

        def expert_mxfp4(self, layer, expert, w):
            p, s = quantize_mxfp4_torch(experts[(layer, expert)][w])
            return p.numpy(), s.numpy()

    out.mkdir(parents=True)
    with tqdm(disable=True) as bar:
        synth_release(cfg, out, Trained(cfg, 0, 0.0, "cpu"), shards=1, workers=1, bar=bar)  # a few MB: one shard


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
    buf = io.BytesIO()  # a few MB: written whole through the one atomic writer
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed}, buf)
    atomic_write(path, buf.getvalue())


def save_state(path: Path, model, info: dict) -> None:
    buf = io.BytesIO()
    torch.save({"model": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "info": info}, buf)
    atomic_write(path, buf.getvalue())


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
    ap.add_argument("--copy-numbers", type=float, default=0.0,
                    help="share of the copy exercises that repeat a number instead of a word (digit copying)")
    ap.add_argument("--tool-random-frac", type=float, default=0.0,
                    help="share of weather examples about a real city (training cities and the capitals) whose tool "
                    "result is drawn at random (condition, temperature -5..35), so the final answer can only be "
                    "copied; drawn after --synth-frac (their sum must be <= 1)")
    ap.add_argument("--answer-weight", type=float, default=1.0,
                    help="loss weight of the boosted tokens of an assistant answer that follows a tool result "
                    "(see --answer-scope); the loss stays normalised by the number of target tokens, so 1.0 is the "
                    "plain mean cross-entropy")
    ap.add_argument("--answer-scope", choices=("values", "message"), default="values",
                    help="values: only the answer tokens quoting a tool-result value (temperature digits, condition, "
                    "city); message: the whole assistant message after the tool result")
    ap.add_argument("--chat-frac", type=float, default=0.0,
                    help="share of steps on chat-corpus batches (system prompts, follow-ups, tool loops, parallel "
                    "calls, unknown countries, greetings, JSON answers: training/corpus_chat.py), drawn fresh")
    ap.add_argument("--client-view", type=float, default=0.3,
                    help="share of multi-turn chat conversations whose earlier assistant turns carry no reasoning "
                    "(as API clients send history back); only the turns after the last user message are learnt")
    ap.add_argument("--p-system", type=float, default=0.6, help="share of chat conversations with a system prompt")
    ap.add_argument("--probe", type=int, default=24,
                    help="teacher-forced copy probe before and after training: the 6 test cities with the test's "
                    "unseen tool result (variant 50) plus N random results (0: off)")
    ap.add_argument("--show-mask", action="store_true",
                    help="print the loss mask / boosted tokens of one random-result weather example and exit")
    ap.add_argument("--kl-selected", dest="kl_full", action="store_false",
                    help="sparse phase: KL over the selected keys only, exactly as DeepSeek-V3.2 (default: the "
                    "indexer keeps fitting the main attention recomputed densely over all causal keys, so keys it "
                    "does not select yet stay learnable; this small model is trained from scratch, not warm)")
    ap.add_argument("--warmup-frac", type=float, default=0.5, help="dense indexer warm-up share of the run")
    ap.add_argument("--qat-frac", type=float, default=0.15, help="quantisation-aware share at the end")
    ap.add_argument("--ckpt-minutes", type=float, default=3.0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument(
        "--install", action="store_true", help="install the converted tree as streamrt/assets/default_model"
    )
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--state-out", type=Path, default=None, help="also save the final model state (fp32) here")
    ap.add_argument("--no-export", action="store_true", help="stop after training (no release tree / convert)")
    ap.add_argument(
        "--from-state", type=Path, default=None, help="skip training: export (and install) this model state"
    )
    ap.add_argument("--init-state", type=Path, default=None,
                    help="start from this model state (fresh optimiser): a --state-out file or a converted tree")
    args = ap.parse_args(argv)
    assert args.synth_frac + args.tool_random_frac <= 1.0 + 1e-9, "--synth-frac + --tool-random-frac must be <= 1"

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    device = torch.device(args.device)
    cfg = load_config(args.config)
    tok = ByteTokenizer(cfg.vocab_size)
    pad = cfg.pad_token_id
    if args.show_mask:
        conv = random_tool_weather(random.Random(args.seed))
        check_answer_mask(tok, conv, args.answer_scope)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)

    data = corpus_mod.split(corpus_mod.build_corpus(args.seed), "train")
    scope = args.answer_scope
    enc = [encode_example(tok, c, scope) for c in data]
    long_ex = [e for e, c in zip(enc, data) if c.kind == "weather"]
    short_ex = [e for e, c in zip(enc, data) if c.kind != "weather"]
    n_tgt = sum(sum(e[1]) for e in enc)
    log(f"corpus: {len(enc)} train conversations ({len(long_ex)} weather, {len(short_ex)} short), "
        f"{sum(len(e[0]) for e in enc)} tokens, {n_tgt} target tokens ({sum(sum(e[2]) for e in enc)} boosted, "
        f"scope {scope}, weight {args.answer_weight:g}); max len {max(len(e[0]) for e in enc)}")
    p_long = args.p_long

    model, be = build_model(cfg, args.seed, device)
    if args.from_state is not None:
        st = torch.load(args.from_state, map_location="cpu")
        model.load_state_dict(st["model"])
        finish(model.cpu(), cfg, args.out, args.install, st.get("info", {}))
        return 0
    if args.init_state is not None:
        if args.init_state.is_dir():  # a converted tree (e.g. the shipped default model)
            from tree_state import state_from_tree

            model.load_state_dict(state_from_tree(args.init_state))
        else:
            model.load_state_dict(torch.load(args.init_state, map_location="cpu")["model"])
        log(f"initialised from {args.init_state}")
    probes = {}
    if args.probe > 0:
        probes["before"] = copy_probe(model, tok, pad, device, args.probe, args.seed)
        log(f"copy probe before: {fmt_probe(probes['before'])}")
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
    gates = {
        id(l.block_sparse_moe.gate.weight): l.block_sparse_moe.gate
        for l in model.model.layers
        if hasattr(l, "block_sparse_moe")
    }
    qtargets = quant_targets(model)
    rng = random.Random(args.seed + 1)
    budget = args.minutes * 60
    t_start = time.perf_counter() - elapsed0
    last_ckpt = time.perf_counter()
    stats = new_stats()
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
        pool = None
        if args.chat_frac > 0 and rng.random() < args.chat_frac:  # the chat corpus (training/corpus_chat.py)
            picked = chat_batch(rng, tok, args.batch_tokens, scope, args.client_view, args.p_system)
        else:
            pool = long_ex if rng.random() < p_long else short_ex
            maxlen = max(len(e[0]) for e in pool)
            bsz = max(1, min(len(pool), args.batch_tokens // maxlen))
            picked = rng.sample(pool, bsz)
        if pool is None:
            pass
        elif pool is long_ex and args.synth_frac + args.tool_random_frac > 0:
            # made-up cities (synth) or real cities with a random tool result: copying, not recall
            out = []
            for e in picked:
                u = rng.random()
                if u < args.synth_frac:
                    e = encode_example(tok, corpus_mod.synthetic_weather(rng), scope)
                elif u < args.synth_frac + args.tool_random_frac:
                    e = encode_example(tok, random_tool_weather(rng), scope)
                out.append(e)
            picked = out
        elif pool is short_ex and args.copy_frac > 0:  # short copy exercises (cheap copying signal)
            picked = [encode_example(tok, (corpus_mod.number_copy_conversation(rng)
                                           if args.copy_numbers > 0 and rng.random() < args.copy_numbers
                                           else corpus_mod.copy_conversation(rng)), scope)
                      if rng.random() < args.copy_frac else e for e in picked]
        ids, mask, ans = make_batch(picked, pad, device)
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
            ce = F.cross_entropy(lp[tgt], ids[:, 1:][tgt], reduction="none")
            boost = ans[:, 1:][tgt]
            loss = ce.mean()  # logged: the plain mean cross-entropy
            wloss = (
                loss if args.answer_weight == 1.0 else (ce * (1.0 + (args.answer_weight - 1.0) * boost.float())).mean()
            )
            kl_sparse = sparse and not args.kl_full
            kl = sum(indexer_kl(m, captured[id(m)], B, T, tmask, kl_sparse, be) for m in mlas) / len(mlas)
            opt.zero_grad(set_to_none=True)
            (wloss + kl).backward()
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
            a = ans[:, 1:]
            has = a.any(-1)
            if bool(has.any()):  # answers quoting the tool result, teacher-forced: token acc / all right
                stats["ans_tok"] += float(pred[a].float().sum())
                stats["ans_n"] += int(a.sum())
                stats["ans_ok"] += int(((pred | ~a).all(-1) & has).sum())
                stats["ans_ex"] += int(has.sum())
        stats["loss"] += float(loss.detach())
        stats["kl"] += float(kl.detach())
        stats["n"] += 1
        stats["tok"] += B * T
        step += 1
        if step % args.log_every == 0:
            n = stats["n"]
            el = time.perf_counter() - t_start
            ans_txt = (f"ans_tok {stats['ans_tok'] / stats['ans_n']:.3f} ans_exact {stats['ans_ok']}/{stats['ans_ex']} "
                       if stats["ans_n"] else "")
            log(f"step {step} {phase} lr {lr:.2e} loss {stats['loss'] / n:.4f} kl {stats['kl'] / n:.4f} "
                f"tok_acc {stats['acc'] / n:.4f} seq_exact {stats['seq'] / n:.3f} {ans_txt}"
                f"{stats['tok'] / max(1e-9, el - stats.get('t0', 0)):.0f} tok/s elapsed {el / 60:.1f} min")
            stats = new_stats(el)
        if time.perf_counter() - last_ckpt > args.ckpt_minutes * 60:
            save_ckpt(ckpt, model, opt, step, time.perf_counter() - t_start, be)
            if args.state_out is not None:  # the model alone, so a run cut short still leaves a state
                save_state(args.state_out, model, {"steps": step, "partial": True, "argv": sys.argv[1:]})
            last_ckpt = time.perf_counter()

    train_s = time.perf_counter() - t_start
    save_ckpt(ckpt, model, opt, step, train_s, be)
    log(f"training done: {step} steps, {train_s / 60:.1f} min")
    set_sparse(model, True)
    if args.probe > 0:
        probes["after"] = copy_probe(model, tok, pad, device, args.probe, args.seed)
        log(f"copy probe after: {fmt_probe(probes['after'])}")
    model = model.cpu()
    info = {"steps": step, "train_minutes": round(train_s / 60, 2), "seed": args.seed, "device": str(device),
            "threads": args.threads, "argv": sys.argv[1:], "copy_probe": probes}
    if args.state_out is not None:
        save_state(args.state_out, model, info)
        log(f"saved model state: {args.state_out}")
    if not args.no_export:
        finish(model, cfg, args.out, args.install, info)
    else:
        (args.out / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0


def chat_batch(rng: random.Random, tok, batch_tokens: int, scope: str, client_frac: float, p_system: float):
    """Fresh chat-corpus conversations (split train) until the padded batch would pass
    batch_tokens; `client_frac` of them in the client view (history without reasoning)."""
    out, longest = [], 0
    while True:
        conv = corpus_chat.sample_chat(rng, "train", p_system=p_system)
        if rng.random() < client_frac and sum(m["role"] == "user" for m in conv.messages) > 1:
            conv = corpus_chat.client_view(conv)
        ex = encode_example(tok, conv, scope)
        if out and max(longest, len(ex[0])) * (len(out) + 1) > batch_tokens:
            return out
        out.append(ex)
        longest = max(longest, len(ex[0]))


def new_stats(t0: float = 0.0) -> dict:
    return {"loss": 0.0, "kl": 0.0, "acc": 0.0, "seq": 0.0, "n": 0, "tok": 0, "t0": t0,
            "ans_tok": 0.0, "ans_n": 0, "ans_ok": 0, "ans_ex": 0}


REAL_WEATHER_CITIES = sorted(set(corpus_mod.CITIES) | set(corpus_mod.CAPITALS.values()))
assert not set(REAL_WEATHER_CITIES) & set(corpus_mod.UNSEEN_CITIES)


def random_tool_weather(rng: random.Random, city: str | None = None):
    """A weather exchange about a real city (training city or capital; never an unseen_city one),
    trained phrasing, with a tool result drawn at random: the answer must be copied."""
    city = city or rng.choice(REAL_WEATHER_CITIES)
    r = {"city": city, "condition": rng.choice(corpus_mod.CONDITIONS), "temperature_c": rng.randint(-5, 35)}
    return corpus_mod.weather_conversation(city, rng.choice(corpus_mod.WEATHER_TRAIN), "synthetic", result=r)


PROBE_CITIES = ["Paris", "London", "Tokyo", "Cairo", "Sydney", "Toronto"]  # tests/test_default_model.py


def copy_probe(model, tok, pad: int, device, n_random: int, seed: int) -> dict:
    """Teacher-forced check of the final answer after the tool result, sparse selection on and the
    weights as the release stores them (MXFP4 experts, BF16 dense: FakeQuant), no update.

    Sets: "test": the six test cities, first trained phrasing, tool result `weather_result(city, 50)`
    (the result the default-model tests use, never in training); "random": n random results about
    real and made-up cities. Per set: exact = answers whose every boosted (values) token is the
    argmax, digits = share of temperature-digit tokens right."""
    rng = random.Random(10_000 + seed)
    sets = {
        "test": [
            corpus_mod.weather_conversation(
                c, corpus_mod.WEATHER_TRAIN[0], "probe", result=corpus_mod.weather_result(c, 50)
            )
            for c in PROBE_CITIES
        ],
        "random": [
            random_tool_weather(rng) if k % 2 == 0 else corpus_mod.synthetic_weather(rng) for k in range(n_random)
        ],
    }
    was_training = model.training
    model.eval()
    set_sparse(model, True)
    out = {}
    with torch.no_grad(), FakeQuant(quant_targets(model)):
        for name, convs in sets.items():
            if not convs:
                continue
            exs = [encode_example(tok, c, "values") for c in convs]
            ok = dig_ok = dig_n = 0
            for i in range(0, len(exs), 8):
                ids, _mask, ans = make_batch(exs[i : i + 8], pad, device)
                pred = model(ids)[:, :-1].argmax(-1) == ids[:, 1:]
                a = ans[:, 1:]
                ok += int(((pred | ~a).all(-1)).sum())
                digit = a & (ids[:, 1:] >= 48) & (ids[:, 1:] <= 57)
                dig_ok += int(pred[digit].sum())
                dig_n += int(digit.sum())
            out[name] = {"exact": ok, "n": len(exs), "digits": round(dig_ok / max(1, dig_n), 3)}
    model.train(was_training)
    return out


def fmt_probe(p: dict) -> str:
    return ", ".join(f"{k} {v['exact']}/{v['n']} answers exact (digits {v['digits']:.0%})" for k, v in p.items())


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
