"""Device-tier policies replayed on decode traces against Belady's MIN (profiling/cache_sim.py)."""

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from streamrt.errors import StreamrtError
from streamrt.store.keys import ExpertKey
from streamrt.store.policies import DEFAULT_POLICY, FrequencyMRU, LFUDecay, LRU, belady_hits, make_policy, replay

_spec = importlib.util.spec_from_file_location("cache_sim", Path(__file__).parents[1] / "profiling" / "cache_sim.py")
cache_sim = importlib.util.module_from_spec(_spec)
sys.modules["cache_sim"] = cache_sim
_spec.loader.exec_module(cache_sim)

# K3 per-layer geometry (896 experts, top-16), 12 MoE layers visited in order, 300 tokens;
# router popularity Zipf(1.2) over a random permutation per layer (see the report for alpha 1.0).
LAYERS, EXPERTS, K, TOKENS, ALPHA = 12, 896, 16, 300, 1.2
WORKING_SET = LAYERS * K


@pytest.fixture(scope="module")
def trace():
    return cache_sim.synthetic_trace(LAYERS, EXPERTS, K, TOKENS, alpha=ALPHA, seed=0)


@pytest.fixture(scope="module")
def rows(trace):
    return cache_sim.simulate(trace, WORKING_SET, policies=["lru", DEFAULT_POLICY])


def test_trace_is_a_cyclic_scan_with_skewed_popularity(trace):
    assert [g[0].layer for g in trace[: 2 * LAYERS]] == list(range(LAYERS)) * 2
    assert all(len(g) == K for g in trace)
    counts = {}
    for g in trace:
        for k in g:
            counts[k] = counts.get(k, 0) + 1
    top = sorted(counts.values(), reverse=True)
    assert top[0] > 20 * (sum(top) / (LAYERS * EXPERTS))  # hot experts far above the mean


def test_lru_below_the_working_set_hits_zero_on_the_cyclic_scan(rows):
    for r in rows:
        if r.capacity < WORKING_SET:
            assert r.rates["lru"] == 0.0


def test_default_policy_reaches_80_percent_of_belady_and_beats_lru(rows):
    assert [r.fraction for r in rows] == [0.25, 0.5, 1.0]
    for r in rows:
        assert r.rates[DEFAULT_POLICY] >= 0.8 * r.belady, (r.fraction, r.rates, r.belady)
        if r.capacity < WORKING_SET:
            assert r.rates[DEFAULT_POLICY] > r.rates["lru"]
    # hits grow with the slot count
    assert rows[0].rates[DEFAULT_POLICY] < rows[1].rates[DEFAULT_POLICY] < rows[2].rates[DEFAULT_POLICY]


def test_lfu_is_close_to_the_offline_frequency_oracle_on_a_flatter_router():
    # Zipf(1.0): Belady's lead is clairvoyance (when each expert returns), which no online policy
    # has; against the best static choice (offline frequency oracle) lfu loses only a little.
    t = cache_sim.synthetic_trace(8, 896, 16, 200, alpha=1.0, seed=1)
    m = 32
    lfu, refs = replay(make_policy("lfu", capacity=m), t, m)
    oracle, _ = replay(cache_sim.FrequencyOracle(t), t, m)
    assert lfu >= 0.93 * oracle


def test_belady_is_optimal_on_small_traces():
    """MIN against every eviction choice (exhaustive search) on tiny traces."""
    rng = random.Random(0)
    for _ in range(30):
        groups = [[ExpertKey(0, rng.randrange(4))] for _ in range(9)]
        cap = 2
        best = _exhaustive_best(groups, cap)
        assert belady_hits(groups, cap)[0] == best
        for pol in (LRU(), LFUDecay()):
            assert replay(pol, groups, cap)[0] <= best


def _exhaustive_best(groups, cap):
    flat = [g[0] for g in groups]

    def go(i, cache):
        if i == len(flat):
            return 0
        k = flat[i]
        if k in cache:
            return 1 + go(i + 1, cache)
        if len(cache) < cap:
            return go(i + 1, cache | {k})
        return max(go(i + 1, (cache - {v}) | {k}) for v in cache)

    return go(0, frozenset())


def test_belady_respects_pins_and_beats_online_policies(trace):
    sub = trace[: LAYERS * 60]
    for m in (K, 2 * K, 3 * K):
        b, _ = belady_hits(sub, m)
        for name in ("lru", "lfu"):
            assert replay(make_policy(name, capacity=m), sub, m)[0] <= b
    # capacity == one request: everything is pinned, nothing can stay
    assert belady_hits(sub, K)[0] == 0


def test_lfu_ages_out_a_stale_hot_set():
    old = [ExpertKey(0, e) for e in range(4)]
    new = [ExpertKey(0, e) for e in range(4, 8)]
    groups = [old] * 100 + [new] * 40  # popularity shifts: the old set was used 2.5x as often
    aging, flat = LFUDecay(halflife=50), LFUDecay(halflife=10**9)
    replay(aging, groups, 8)
    replay(flat, groups, 8)
    assert aging.victim() in old  # with aging the recent hot set outranks the stale one
    assert flat.victim() in new  # without aging raw counts keep the stale set


def test_policy_names_and_errors():
    assert DEFAULT_POLICY == "lfu"
    with pytest.raises(StreamrtError, match="--gpu-policy"):
        make_policy("fifo")
    with pytest.raises(StreamrtError, match="cache holds 2"):
        replay(LRU(), [[ExpertKey(0, 0), ExpertKey(0, 1), ExpertKey(0, 2)]], 2)


@pytest.mark.parametrize("name", ["lfu", "lfu-mru"])
def test_victims_follow_the_stated_rule_through_pins_and_unpins(name):
    """Each victim is the unpinned resident key that ranks lowest by the policy's stated rule,
    kept here by hand: lfu, the lowest sum of 2**(r / halflife) over the key's references r
    (r counts every reference), ties to the least recently referenced; lfu-mru, the fewest
    references, ties to the newest inserted. Pins come and go the way the device tier's do (a
    layer's experts and the next layers' staged ones), so entries of pinned keys are skipped,
    set aside, and must come back once unpinned; evicted keys keep their history."""
    rng = random.Random(7)
    halflife = 37
    policy = LFUDecay(halflife=halflife) if name == "lfu" else FrequencyMRU(reset_every=10**9)
    keys = [ExpertKey(layer, e) for layer in range(6) for e in range(12)]
    refs: dict = {}  # key -> reference numbers (1-based, over all references)
    inserted: dict = {}  # resident key -> insertion number
    tick = seq = victims = 0

    def rank(k):
        if name == "lfu":
            return (sum(2.0 ** (r / halflife) for r in refs[k]), refs[k][-1])
        return (len(refs[k]), -inserted[k])

    capacity = 20
    for _ in range(600):
        pinned = set(rng.sample(keys, rng.randint(0, 14)))
        if rng.random() < 0.3:  # some steps pin nothing: every key set aside must come back
            pinned = set()
        for k in rng.sample(keys, rng.randint(1, 6)):
            tick += 1
            refs.setdefault(k, []).append(tick)
            policy.access(k)
            if k in inserted:
                continue
            if len(inserted) >= capacity:
                candidates = [c for c in inserted if c not in pinned | {k}]
                expect = min(candidates, key=rank) if candidates else None
                got = policy.victim(pinned | {k})
                assert got == expect, (got, expect)
                if got is None:
                    continue
                victims += 1
                policy.remove(got)
                del inserted[got]
            seq += 1
            inserted[k] = seq
            policy.insert(k)
    assert victims > 500
