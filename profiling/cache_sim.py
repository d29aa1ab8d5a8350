"""Device-tier trace replay: each policy's hit rate against Belady's MIN at M = 25/50/100 % of
the per-token working set.

A trace is a list of reference groups, one per MoE-layer request (the unique experts the layer
needs; the device tier pins them together). It is either synthesised with a realistic shape —
layers visited in order every token (the cyclic scan), a skewed Zipf-like router popularity per
layer over a random permutation of experts, top-k distinct experts per token, slow drift in
popularity — or loaded from a JSON trace the runtime recorded (`--trace FILE`: a list of
[layer, [expert, ...]] pairs).

    python profiling/cache_sim.py --config tiny-k3.1-pro --tokens 2000
    python profiling/cache_sim.py --config kimi-k3.1-pro --tokens 200 --markdown
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamrt.config import load_config
from streamrt.store.keys import ExpertKey
from streamrt.store.policies import POLICIES, belady_hits, make_policy, replay

FRACTIONS = (0.25, 0.5, 1.0)


def synthetic_trace(
    layers: int,
    num_experts: int,
    k: int,
    tokens: int,
    *,
    alpha: float = 1.0,
    drift: float = 0.0,
    batch: int = 1,
    seed: int = 0,
    layer_ids: tuple[int, ...] | None = None,
) -> list[list[ExpertKey]]:
    """A decode trace: `tokens` steps, each visiting every layer in order; per layer, each of the
    `batch` sequences draws k distinct experts from a Zipf(alpha) popularity over a per-layer
    random permutation (Gumbel top-k, i.e. sampling without replacement). `drift` in [0, 1] is
    the per-token probability that two adjacent popularity ranks of a layer swap."""
    rng = np.random.default_rng(seed)
    layer_ids = layer_ids or tuple(range(layers))
    logp = -alpha * np.log(np.arange(1, num_experts + 1, dtype=np.float64))
    perms = [rng.permutation(num_experts) for _ in layer_ids]
    groups: list[list[ExpertKey]] = []
    for _ in range(tokens):
        for li, layer in enumerate(layer_ids):
            perm = perms[li]
            if drift and rng.random() < drift:
                r = int(rng.integers(0, num_experts - 1))
                perm[r], perm[r + 1] = perm[r + 1], perm[r]
            chosen: dict[int, None] = {}
            for _b in range(batch):
                g = logp + rng.gumbel(size=num_experts)
                for rank in np.argpartition(-g, k)[:k]:
                    chosen[int(perm[rank])] = None
            groups.append([ExpertKey(layer, e) for e in sorted(chosen)])
    return groups


def load_trace(path: str | Path) -> list[list[ExpertKey]]:
    data = json.loads(Path(path).read_text())
    return [[ExpertKey(int(layer), int(e)) for e in ids] for layer, ids in data]


class FrequencyOracle:
    """Offline reference for online policies: evicts the resident key referenced least often over
    the whole trace (A0, the best static choice under independent references). Belady beats it
    by knowing *when* each key comes back; no online policy knows that, so the distance from an
    online policy to this oracle is the policy's own loss, the rest is clairvoyance."""

    name = "oracle-freq"

    def __init__(self, groups) -> None:
        self.count: dict = {}
        for g in groups:
            for k in g:
                self.count[k] = self.count.get(k, 0) + 1
        self.resident: set = set()

    def access(self, key) -> None:
        pass

    def insert(self, key) -> None:
        self.resident.add(key)

    def remove(self, key) -> None:
        self.resident.discard(key)

    def victim(self, pinned=()):
        cands = [k for k in self.resident if k not in pinned]
        return min(cands, key=lambda k: self.count[k]) if cands else None


@dataclass
class Row:
    fraction: float
    capacity: int
    belady: float
    rates: dict[str, float]


def simulate(
    groups: list[list[ExpertKey]], working_set: int, fractions=FRACTIONS, policies=None, *, oracle: bool = False
) -> list[Row]:
    policies = list(policies or POLICIES)
    rows = []
    for f in fractions:
        m = max(1, int(round(f * working_set)))
        m = max(m, max(len(g) for g in groups))
        bh, refs = belady_hits(groups, m)
        rates = {}
        for name in policies:
            h, _ = replay(make_policy(name, capacity=m), groups, m)
            rates[name] = h / refs
        if oracle:
            h, _ = replay(FrequencyOracle(groups), groups, m)
            rates[FrequencyOracle.name] = h / refs
        rows.append(Row(f, m, bh / refs, rates))
    return rows


def format_table(rows: list[Row], markdown: bool = False) -> str:
    names = list(rows[0].rates)
    head = ["M / working set", "slots", "Belady"] + [f"{n}" for n in names] + [f"{n}/Belady" for n in names]
    lines = []
    body = []
    for r in rows:
        body.append(
            [f"{r.fraction:.0%}", str(r.capacity), f"{r.belady:.3f}"]
            + [f"{r.rates[n]:.3f}" for n in names]
            + [f"{r.rates[n] / r.belady:.2f}" if r.belady else "-" for n in names]
        )
    if markdown:
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        lines += ["| " + " | ".join(b) + " |" for b in body]
    else:
        w = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
        lines.append("  ".join(h.rjust(w[i]) for i, h in enumerate(head)))
        lines += ["  ".join(c.rjust(w[i]) for i, c in enumerate(b)) for b in body]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny-k3.1-pro")
    ap.add_argument("--trace", help="recorded trace JSON (list of [layer, [experts]])")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--drift", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--oracle", action="store_true", help="also replay the offline frequency oracle (slow)")
    ap.add_argument("--layers", type=int, help="override the number of MoE layers (keeps per-layer geometry)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    if args.trace:
        groups = load_trace(args.trace)
    else:
        layers = args.layers or len(cfg.moe_layers)
        groups = synthetic_trace(
            layers, cfg.num_experts, cfg.experts_per_token, args.tokens,
            alpha=args.alpha, drift=args.drift, batch=args.batch, seed=args.seed,
            layer_ids=None if args.layers else cfg.moe_layers,
        )
    working_set = len({g[0].layer for g in groups}) * cfg.experts_per_token * args.batch
    rows = simulate(groups, working_set, oracle=args.oracle)
    print(f"{args.config}: {len(groups)} requests, {sum(map(len, groups))} references, "
          f"working set {working_set}, alpha {args.alpha}, drift {args.drift}")
    print(format_table(rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
