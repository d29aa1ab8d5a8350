"""Evaluate the small default model through the real inference path.

    python training/eval_small.py [--model DIR]     (default: streamrt/assets/default_model)

Converted tree -> `streamrt.loader.load_model` (BF16 dense weights) + the tree's
NVFP4 experts (`DirectExpertProvider`) -> `streamrt.generate.generate` greedy with caches:
prefill per prompt, then recurrent KDA and absorbed MLA decode (indexer top-k on).

An answer counts when the generated ids equal the trained assistant message exactly (the
stop token included). Held-out: see training/corpus.py (new phrasing, same entities;
"unseen_city" cities never occur in training).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))

import corpus as C  # noqa: E402
import corpus_chat as CC  # noqa: E402

from streamrt.chat import ChatParser, Reply, encode_chat  # noqa: E402
from streamrt.checkpoint.reader import open_tree  # noqa: E402
from streamrt.generate import generate  # noqa: E402
from streamrt.loader import DirectExpertProvider, load_model  # noqa: E402
from streamrt.model.mla import KimiMLAAttention  # noqa: E402
from streamrt.tokenizer import load_tokenizer  # noqa: E402

DEFAULT_DIR = ROOT / "streamrt" / "assets" / "default_model"


@dataclass
class Case:
    """One assistant turn: the prompt ids and the trained answer ids (stop token last)."""

    name: str
    prompt: list[int]
    target: list[int]


class CachedProvider(DirectExpertProvider):
    """DirectExpertProvider that parses each expert file from the tree once (the NVFP4 bytes
    the runtime would stream; the small model's 128 experts fit in memory)."""

    def __init__(self, tree):
        super().__init__(tree)
        self.cache = {}

    def __call__(self, req):
        out = {}
        for e in req.unique_ids():
            key = (req.layer, e)
            if key not in self.cache:
                self.cache[key] = self.tree.load_expert(req.layer, e)
                self.loads += 1
            out[e] = self.cache[key]
        return out


class Runner:
    def __init__(self, model_dir: Path = DEFAULT_DIR):
        self.tree = open_tree(model_dir)
        self.cfg = self.tree.config
        self.tok = load_tokenizer(self.tree.root, self.cfg.vocab_size, self.cfg.eos_token_id)
        self.model = load_model(self.tree, "cpu")
        self.provider = CachedProvider(self.tree)
        # Fixed MLA cache capacity for every sequence: ModelCache.stack over caches of
        # different capacities can over-grow one of them (reserve doubles) and then fails.
        self.model.new_cache = self._new_cache

    def _new_cache(self, batch: int = 1, device=None, cap: int = 1024):
        from streamrt.model.cache import KDACache, MLACache, ModelCache

        cfg, dev = self.cfg, device or "cpu"
        layers = [MLACache.empty(cfg, batch, dev, cfg.has_indexer(i), cap=cap) if cfg.layer_kind(i) == "mla"
                  else KDACache.empty(cfg, batch, dev) for i in range(cfg.num_layers)]
        return ModelCache(layers, [0] * batch)

    def generate(self, prompts: list[list[int]], max_new_tokens: int):
        return generate(self.model, prompts, provider=self.provider, max_new_tokens=max_new_tokens,
                        stop_ids=sorted(self.tok.stop_ids))

    def reply(self, tokens: list[int]) -> Reply:
        parser = ChatParser.for_generation(self.tok)
        r = Reply()
        for e in parser.feed_many(tokens) + parser.finish():
            r.add(e)
        return r

    def prefill_logits(self, ids: list[int]) -> torch.Tensor:
        cache = self.model.new_cache()
        with torch.no_grad():
            out = self.model.forward_steps(torch.tensor(ids), cache, last_only=True)
            from streamrt.model import run_sync

            return run_sync(out, self.provider).reshape(-1)

    def set_sparse(self, sparse: bool) -> None:
        for m in self.model.modules():
            if isinstance(m, KimiMLAAttention) and m.indexer is not None:
                m.sparse = sparse


def turn_cases(tok, conv, name: str) -> list[Case]:
    """Every assistant turn of a conversation as (prompt, trained answer ids)."""
    out = []
    for i, m in enumerate(conv.messages):
        if m["role"] != "assistant":
            continue
        prompt = encode_chat(tok, conv.messages[:i], conv.tools, add_generation_prompt=True)
        upto = encode_chat(tok, conv.messages[: i + 1], conv.tools, add_generation_prompt=False)
        out.append(Case(f"{name}#{i}", prompt, upto[len(prompt):]))
    return out


def pick(convs, kinds: dict[str, int]) -> list:
    """A deterministic selection: the first n conversations of each kind (corpus order is seeded)."""
    out = []
    for kind, n in kinds.items():
        out += [c for c in convs if c.kind == kind][:n]
    return out


EVAL_TRAIN = {"fact": 20, "plain": 5, "weather": 8}  # eval_small's report
EVAL_HELDOUT = {"fact": 15, "weather": 8}
TEST_TRAIN = {"fact": 9, "plain": 3, "weather": 4}  # the CI test: 9 + 3 + 2 x 4 = 20 prompts
TEST_HELDOUT = {"fact": 6, "weather": 2}  # 6 + 2 x 2 = 10 prompts


def train_cases(tok, kinds: dict[str, int] = EVAL_TRAIN) -> list[Case]:
    corpus = C.build_corpus(0)
    convs = pick(C.split(corpus, "train"), kinds)
    cases = []
    for k, c in enumerate(convs):
        cases += turn_cases(tok, c, f"train{k}:{c.kind}:{c.messages[0]['content']}")
    return cases


def heldout_cases(tok, kinds: dict[str, int] = EVAL_HELDOUT) -> list[Case]:
    corpus = C.build_corpus(0)
    convs = pick(C.split(corpus, "heldout"), kinds)
    cases = []
    for k, c in enumerate(convs):
        cases += turn_cases(tok, c, f"heldout{k}:{c.kind}:{c.messages[0]['content']}")
    return cases


def unseen_city_cases(tok) -> list[Case]:
    cases = []
    for k, c in enumerate(C.split(C.build_corpus(0), "unseen_city")):
        cases += turn_cases(tok, c, f"unseen{k}:{c.meta['city']}")
    return cases


def run_cases(r: Runner, cases: list[Case], batch: int = 64) -> list[tuple[Case, list[int]]]:
    out = []
    for i in range(0, len(cases), batch):
        chunk = cases[i : i + batch]
        res = r.generate([c.prompt for c in chunk], max(len(c.target) for c in chunk) + 1)
        out += list(zip(chunk, res.tokens))
    return out


def exact(results) -> float:
    return sum(got == c.target for c, got in results) / max(1, len(results))


WEATHER_CITIES = ["Paris", "London", "Tokyo", "Cairo", "Sydney", "Toronto"]


def weather_roundtrip(r: Runner, cities: list[str], template: str = C.WEATHER_TRAIN[0], variant: int = 50):
    """Ask for the weather, parse the call, answer with a tool result, check the final answer.

    Returns [(city, call (name, args) or None, final content, expected final content)].
    variant 50: a tool result that never occurs in training."""
    tools = [C.WEATHER_TOOL]
    user = [[{"role": "user", "content": template.format(city=city)}] for city in cities]
    first = r.generate([encode_chat(r.tok, m, tools) for m in user], 200)
    rows, seconds = [], []
    for city, msgs, toks in zip(cities, user, first.tokens):
        rep = r.reply(toks)
        call = (rep.tool_calls[0].name, rep.tool_calls[0].arguments) if rep.tool_calls else None
        res = C.weather_result(city, variant)
        hist = msgs + [rep.to_message(), {"role": "tool", "name": "get_weather", "tool_call_id": "call_1",
                                          "content": C.tool_content(res)}]
        rows.append([city, call, None, C.final_answer(res)])
        seconds.append(encode_chat(r.tok, hist, tools))
    final = r.generate(seconds, 90)
    for row, toks in zip(rows, final.tokens):
        row[2] = r.reply(toks).content
    return rows


# ---- held-out chat categories (training/corpus_chat.py, split "heldout") ----------------

CHAT_KINDS = ("capital", "followup", "unknown", "tool_loop", "parallel", "greeting", "json")
CHAT_N = 12  # conversations per kind and system-prompt variant


def chat_turns(tok, conv) -> list[tuple[str, Case]]:
    """(category, case) for every assistant turn of a held-out chat conversation, the history
    teacher-forced as trained (what `streamrt run --chat` keeps). Categories: the kind, except
    tool conversations: "tool_call" for the messages that call, "tool_answer" for those after a
    result; a follow-up conversation's first answer counts as "capital"."""
    kw = conv.meta.get("render", {})
    out = []
    for i, m in enumerate(conv.messages):
        if m["role"] != "assistant":
            continue
        plain = encode_chat(tok, conv.messages[:i], conv.tools, add_generation_prompt=True)
        upto = encode_chat(tok, conv.messages[: i + 1], conv.tools, add_generation_prompt=False)
        prompt = encode_chat(tok, conv.messages[:i], conv.tools, add_generation_prompt=True, **kw) if kw else plain
        if conv.kind == "parallel":
            cat = "parallel"
        elif m.get("tool_calls"):
            cat = "tool_call"
        elif conv.messages[i - 1]["role"] == "tool":
            cat = "tool_answer"
        elif conv.kind == "followup" and i < 3 + (conv.messages[0]["role"] == "system"):
            cat = "capital"
        else:
            cat = conv.kind
        out.append((cat, Case(f"{conv.kind}:{m.get('content') or m['tool_calls'][0]['function']}", prompt,
                              upto[len(plain):])))
    return out


def chat_cases(tok, n: int = CHAT_N, seed: int = 1234, kinds=CHAT_KINDS) -> dict[str, list[Case]]:
    """{"<category>" / "<category>+system": cases}: n held-out conversations per kind without and
    with a held-out system prompt (seeded, so every run evaluates the same cases; a subset of
    kinds draws the same conversations for those kinds as the full set)."""
    rng = random.Random(seed)
    out: dict[str, list[Case]] = {}
    for kind in CHAT_KINDS:
        for sys_p, suffix in ((0.0, ""), (1.0, "+system")):
            for _ in range(n):
                conv = CC.sample_chat(rng, "heldout", kind, p_system=sys_p)
                if kind not in kinds:
                    continue
                for cat, case in chat_turns(tok, conv):
                    out.setdefault(cat + suffix, []).append(case)
    return out


def chat_table(r: Runner, n: int = CHAT_N, show_misses: int = 2, kinds=CHAT_KINDS) -> dict[str, tuple[int, int]]:
    """Exact answers per held-out chat category, printed as a table; {category: (ok, n)}."""
    cases = chat_cases(r.tok, n, kinds=kinds)
    table: dict[str, list] = {}
    print(f"{'held-out category':<14} {'no system':>12} {'with system':>12}", flush=True)
    for cat in sorted({k.split("+")[0] for k in cases}):  # one category at a time: similar lengths batch well
        for key in (cat, cat + "+system"):
            row = table.setdefault(key, [0, 0, []])
            for c, got in run_cases(r, cases.get(key, [])):
                row[0] += got == c.target
                row[1] += 1
                if got != c.target:
                    row[2].append((c.name, r.tok.decode(got)))
        print(f"{cat:<14} {fmt_share(table[cat]):>12} {fmt_share(table[cat + '+system']):>12}", flush=True)
    for cat, (_, _, misses) in sorted(table.items()):
        for name, got in misses[:show_misses]:
            print(f"   MISS {cat} {name[:60]}: got {got[-90:]!r}")
    return {k: (v[0], v[1]) for k, v in table.items()}


def fmt_share(row) -> str:
    return f"{row[0] / max(1, row[1]):.0%} ({row[0]}/{row[1]})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="evaluate the small default model")
    ap.add_argument("--model", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--chat-only", action="store_true", help="only the held-out chat categories")
    ap.add_argument("--chat-n", type=int, default=CHAT_N, help="conversations per chat kind and system variant")
    ap.add_argument("--chat-kinds", default=",".join(CHAT_KINDS), help="comma-separated subset of the chat kinds")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    r = Runner(args.model)
    kinds = args.chat_kinds.split(",")
    if not set(kinds) <= set(CHAT_KINDS):
        ap.error(f"--chat-kinds: unknown {sorted(set(kinds) - set(CHAT_KINDS))}; known: {', '.join(CHAT_KINDS)}")
    chat_table(r, args.chat_n, kinds=kinds)
    if args.chat_only:
        print(f"eval wall time {time.perf_counter() - t0:.1f} s")
        return 0
    for label, cases in (
        ("train", train_cases(r.tok)),
        ("heldout", heldout_cases(r.tok)),
        ("unseen_city", unseen_city_cases(r.tok)),
    ):
        res = run_cases(r, cases)
        print(f"{label}: {exact(res):.0%} exact ({sum(g == c.target for c, g in res)}/{len(res)})")
        for c, got in res:
            if got != c.target:
                print(f"   MISS {c.name}: got {r.tok.decode(got)!r}\n        want {r.tok.decode(c.target)!r}")
    rows = weather_roundtrip(r, WEATHER_CITIES)
    ok = 0
    for city, call, final, want in rows:
        good = call == ("get_weather", {"city": city}) and final == want
        ok += good
        print(f"weather {city}: call {call} final {final!r} {'OK' if good else 'WANT ' + repr(want)}")
    print(f"weather round trips: {ok}/{len(rows)}")
    rows = weather_roundtrip(r, C.UNSEEN_CITIES)
    ok = sum(call == ("get_weather", {"city": city}) and final == want for city, call, final, want in rows)
    print(f"unseen-city round trips: {ok}/{len(rows)}")
    print(f"eval wall time {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
