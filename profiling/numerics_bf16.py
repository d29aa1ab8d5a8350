"""fp32 vs bf16 at the two places streamrt deliberately keeps fp32 (docs/CONTRACTS.md, Numerics).

The reference ports (NeMo, llama.cpp) cast the AttnRes depth mix and the routed-expert sum back
to bf16; streamrt keeps both in fp32. This measures what that choice changes on a model: the
same prompts run with the torch backend as is, and with the output of `attnres_mix` and
`expert_ffn` rounded to bf16 (each alone, then both), side by side in one process.

    python profiling/numerics_bf16.py [--model DIR] [--new-tokens 24]
"""

from __future__ import annotations

import argparse

import torch

from streamrt.backends.torch_backend import TorchBackend
from streamrt.chat import encode_chat
from streamrt.checkpoint.reader import open_tree
from streamrt.default_model import default_model_dir
from streamrt.generate import generate
from streamrt.loader import DirectExpertProvider, load_model
from streamrt.tokenizer import load_tokenizer

PROMPTS = ("What is the capital of France?", "What is the capital of Egypt?", "What is the weather in Paris?")


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


class RoundedBackend(TorchBackend):
    """TorchBackend with the AttnRes mix and/or the expert sum rounded to bf16, as the ports do."""

    def __init__(self, mix: bool, experts: bool):
        super().__init__()
        self.round_mix, self.round_experts = mix, experts

    def attnres_mix(self, *a, **kw):
        out = super().attnres_mix(*a, **kw)
        return _bf16(out) if self.round_mix else out

    def expert_ffn(self, *a, **kw):
        out = super().expert_ffn(*a, **kw)
        return _bf16(out) if self.round_experts else out


def run(tree, backend, ids: list[int], new_tokens: int, stop: list[int]):
    model = load_model(tree, dtype=None, backend=backend)
    res = generate(model, [ids], provider=DirectExpertProvider(tree), max_new_tokens=new_tokens, stop_ids=stop)
    return res.prefill_logits[0], res.tokens[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="converted tree (default: the embedded model)")
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args()
    tree = open_tree(args.model or default_model_dir(lambda m: None))
    tok = load_tokenizer(tree.root, tree.config.vocab_size, tree.config.eos_token_id)
    stop = sorted(tok.stop_ids)
    variants = {"attnres mix bf16": (True, False), "expert sum bf16": (False, True), "both bf16": (True, True)}
    print(f"model {tree.root.name}: prefill logits (last prompt position) and greedy tokens, fp32 vs bf16 casts")
    print(f"{'prompt':<34} {'variant':<18} {'max |dlogit|':>12} {'rel':>9} {'top-1 same':>10} {'tokens same':>11}")
    for prompt in PROMPTS:
        ids = encode_chat(tok, [{"role": "user", "content": prompt}])
        ref_logits, ref_tokens = run(tree, TorchBackend(), ids, args.new_tokens, stop)
        for label, (mix, experts) in variants.items():
            logits, tokens = run(tree, RoundedBackend(mix, experts), ids, args.new_tokens, stop)
            d = (logits - ref_logits).abs().max().item()
            rel = d / ref_logits.abs().max().item()
            same_top = int(logits.argmax()) == int(ref_logits.argmax())
            n = min(len(tokens), len(ref_tokens))
            agree = next((i for i in range(n) if tokens[i] != ref_tokens[i]), n)
            print(f"{prompt:<34} {label:<18} {d:12.3e} {rel:9.2e} {str(same_top):>10} {agree:>4}/{len(ref_tokens):<6}")


if __name__ == "__main__":
    main()
