"""runtime/expert_split.py against fake rates: the split is the best one, gives the CPU nothing
when that does not shorten a layer, follows a CPU that slows down (and speeds up) mid-run, and
SHARE mode's homes depend on the key and the share only."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from streamrt.runtime.expert_split import (
    RateMeter, Split, SplitPlanner, choose_split, cpu_home, key_rank, row_bucket,
)

SEED = int.from_bytes(os.urandom(4), "little")
EXPERT = 18_579_456  # bytes of a kimi-k3.1-pro routed expert


@pytest.fixture
def rng(request):
    seed = SEED + hash(request.node.name) % 1000
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def brute_force(missed, link_s, cpu_s):
    """The smallest critical path over every subset sent to the CPU."""
    best = len(missed) * link_s
    for n in range(1, len(missed) + 1):
        for cpu in itertools.combinations(missed, n):
            best = min(best, max(sum(cpu_s(r) for _, r in cpu), (len(missed) - n) * link_s))
    return best


@pytest.mark.parametrize("trial", range(8))
def test_split_is_optimal_against_every_subset(rng, trial):
    n = int(rng.integers(1, 10))
    missed = [(int(e), int(r)) for e, r in zip(rng.permutation(64)[:n], rng.integers(1, 17, n))]
    link_s = float(rng.uniform(0.2, 0.5))
    per_row = float(rng.uniform(0.05, 1.0))
    cpu_s = lambda rows: 0.1 + per_row * rows  # noqa: E731 (fake CPU: cost grows with rows)
    split = choose_split(missed, link_s, cpu_s)
    assert split.critical_s == pytest.approx(brute_force(missed, link_s, cpu_s))
    assert sorted(split.cpu + split.link) == sorted(e for e, _ in missed)
    assert split.cpu == tuple(sorted(split.cpu)) and split.link == tuple(sorted(split.link))


def test_a_slower_cpu_gets_nothing_and_a_faster_one_its_share():
    missed = [(e, 1) for e in range(8)]
    assert choose_split(missed, link_s=0.34, cpu_s=lambda r: 8 * 0.34).cpu == ()  # slower than the whole layer
    half = choose_split(missed, link_s=0.34, cpu_s=lambda r: 0.34)
    assert len(half.cpu) == 4 and half.critical_s == pytest.approx(4 * 0.34)
    fast = choose_split(missed, link_s=0.34, cpu_s=lambda r: 0.23)  # an H200 host's measured rates: ~2.5x
    floor = 8 / (1 / 0.23 + 1 / 0.34)  # the bytes divided between the two rates ideally
    assert len(fast.cpu) == 5 and floor <= fast.critical_s <= floor + 0.23  # whole experts: within one


def test_few_rows_go_to_the_cpu_crowded_ones_over_the_link():
    missed = [(0, 16), (1, 1), (2, 9), (3, 2), (4, 1), (5, 12)]
    split = choose_split(missed, link_s=0.34, cpu_s=lambda r: 0.2 + 0.05 * r)
    rows = dict(missed)
    assert split.cpu and max(rows[e] for e in split.cpu) <= min(rows[e] for e in split.link)


def test_the_split_does_not_depend_on_input_order_and_ties_go_by_id():
    missed = [(7, 1), (3, 1), (5, 1), (1, 1)]
    a = choose_split(missed, 0.34, lambda r: 0.34)
    b = choose_split(list(reversed(missed)), 0.34, lambda r: 0.34)
    assert a == b and a.cpu == (1, 3)


def test_margin_guards_the_cpu_estimate():
    missed = [(e, 1) for e in range(3)]  # link-only: 1.02 s
    assert choose_split(missed, 0.34, lambda r: 0.9, margin=1.0).cpu == (0,)  # max(0.9, 0.68) < 1.02
    assert choose_split(missed, 0.34, lambda r: 0.9, margin=1.25).cpu == ()  # 1.125 > 1.02: keep the link
    assert choose_split(missed[:2], 0.34, lambda r: 0.68).cpu == ()  # max(0.68, 0.34) = 0.68: no gain, nothing


def test_meter_smooths_and_estimates_unmeasured_row_counts():
    m = RateMeter(alpha=0.5)
    assert m.link_seconds(EXPERT) is None and m.cpu_seconds(EXPERT, 1) is None
    m.observe_link(55_000_000, 1e-3)  # 55 GB/s
    assert m.link_gbps() == pytest.approx(55.0)
    m.observe_link(45_000_000, 1e-3)
    assert m.link_gbps() == pytest.approx(1 / ((1 / 55 + 1 / 45) / 2))  # halfway in seconds per byte
    m.observe_cpu(80_000_000, 4, 1e-3)  # 80 GB/s at 3-4 rows
    assert m.cpu_gbps(3) == pytest.approx(80.0) and m.cpu_gbps(1) == pytest.approx(80.0)  # fewer rows: no dearer
    assert m.cpu_gbps(16) == pytest.approx(20.0)  # two buckets up: 4x the rows, 4x the time
    assert [row_bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    with pytest.raises(ValueError, match="alpha"):
        RateMeter(alpha=0)


def simulate(cpu_gbps_by_layer, link_gbps=55.0, missed_per_layer=16, rows=1, probe_every=8):
    """A run of layers: the planner splits, the fake roads take bytes / true rate, the meter
    sees what they took. Returns per-layer (hybrid seconds, link-only seconds, CPU experts)."""
    meter = RateMeter()
    planner = SplitPlanner(meter, EXPERT, probe_every=probe_every)
    out = []
    for layer, cpu_gbps in enumerate(cpu_gbps_by_layer):
        missed = [(e, rows) for e in range(missed_per_layer)]
        split = planner.split(missed)
        link_t = len(split.link) * EXPERT / (link_gbps * 1e9)
        cpu_t = len(split.cpu) * EXPERT * rows / (cpu_gbps * 1e9)
        if split.link:
            meter.observe_link(len(split.link) * EXPERT, link_t)
        for _ in split.cpu:
            meter.observe_cpu(EXPERT, rows, EXPERT * rows / (cpu_gbps * 1e9))
        out.append((max(link_t, cpu_t), missed_per_layer * EXPERT / (link_gbps * 1e9), len(split.cpu)))
    return out


def test_a_fast_cpu_takes_its_share_and_the_layer_nears_the_split_floor():
    run = simulate([80.0] * 40)
    floor = 16 * EXPERT / ((55 + 80) * 1e9)  # both roads at their rates, bytes divided ideally
    steady = run[10:]
    assert all(n >= 8 for *_, n in steady)
    assert sum(t for t, *_ in steady) <= 1.2 * floor * len(steady)  # margin + whole experts
    assert sum(t for t, *_ in steady) < 0.7 * sum(base for _, base, _ in steady)


def test_a_cpu_that_slows_down_mid_run_is_given_nothing_then_probed_and_taken_back():
    rates = [80.0] * 20 + [2.0] * 60 + [80.0] * 40  # throttled to ~one thread, then back
    run = simulate(rates, probe_every=8)
    slow = run[20:80]
    assert all(n <= 1 for *_, n in slow[3:])  # within a few layers: probes only
    assert sum(n for *_, n in slow[3:]) <= len(slow) // 8 + 1
    # a probe costs at most one expert at the slow rate; otherwise never worse than link-only
    worse = [t - base for t, base, _ in slow[3:] if t > base * 1.0001]
    assert all(w <= EXPERT / 2e9 for w in worse)
    assert sum(n for *_, n in run[-10:]) >= 10 * 8  # back to its share once a probe sees the rate


def test_nothing_to_split_until_the_link_is_measured():
    planner = SplitPlanner(RateMeter(), EXPERT)
    split = planner.split([(3, 1), (1, 2)])
    assert split == Split((), (1, 3), 0.0, 0.0)
    assert planner.split([]) == Split((), (), 0.0, 0.0)


def test_cpu_home_is_a_fixed_function_of_key_and_share():
    keys = [(layer, e) for layer in range(4) for e in range(896)]
    assert not any(cpu_home(*k, 0.0) for k in keys) and all(cpu_home(*k, 1.0) for k in keys)
    third = [k for k in keys if cpu_home(*k, 1 / 3)]
    assert abs(len(third) / len(keys) - 1 / 3) < 0.03
    assert all(cpu_home(*k, 0.5) for k in third)  # monotone in the share
    # fixed across processes and platforms: splitmix64's published finaliser of layer << 32 | expert
    assert all(key_rank(*k) == splitmix64_finaliser(k[0] << 32 | k[1]) / 2.0**64 for k in keys[::97])
    assert len({key_rank(*k) for k in keys}) == len(keys)


def splitmix64_finaliser(z):
    m = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return (z ^ (z >> 31)) & m
