"""The placement plan (streamrt/plan/placement.py): what fits, what streams, and the refusal."""

from __future__ import annotations

import pytest

from streamrt.cli.main import main as cli_main
from streamrt.config import load_config
from streamrt.errors import StreamrtError
from streamrt.checkpoint.names import dense_layer_specs
from streamrt.plan.placement import (
    MIN_SLOT_LAYERS,
    ROUTER_SUFFIXES,
    format_plan,
    layer_dense_bytes,
    min_expert_slots,
    plan_placement,
    router_bytes,
)
from streamrt.plan.budget import expert_bytes_nvfp4

GIB = 1 << 30


@pytest.fixture(scope="module")
def k31():
    return load_config("kimi-k3.1-pro")


def _used(cfg, p) -> int:
    return (
        sum(p.fixed_bytes.values())
        + p.resident_dense_bytes
        + (p.expert_slots - min_expert_slots(cfg)) * expert_bytes_nvfp4(cfg)
    )


def test_dense_plane_is_the_106_gib_of_the_inventory(k31):
    p = plan_placement(k31, 1 << 50)
    # DESIGN.md: 106 GiB BF16 dense plane (73.5 resident set + 32.5 per-layer planes); layers plus
    # lm_head plus the embedding plus the routers, with the released F32 tensors a little larger
    total = (
        sum(p.layer_bytes) + p.fixed_bytes["lm_head and norms"] + p.fixed_bytes["embedding"] + p.fixed_bytes["routers"]
    )
    assert 105.5 * GIB < total < 106.5 * GIB


def test_a_card_that_holds_everything_streams_nothing(k31):
    p = plan_placement(k31, 192 * GIB)
    assert p.streamed_layers == () and len(p.resident_layers) == k31.num_layers
    assert "stream buffers" not in p.fixed_bytes and "embedding" in p.fixed_bytes  # the buffer's bytes went to slots
    assert p.streamed_bytes_per_token == 0
    assert _used(k31, p) <= 192 * GIB
    assert 192 * GIB - _used(k31, p) < expert_bytes_nvfp4(k31)  # every spare byte became slots


@pytest.mark.parametrize("gib", [24, 48, 80])
def test_smaller_cards_stream_the_layers_that_do_not_fit(k31, gib):
    p = plan_placement(k31, gib * GIB)
    assert p.streamed_layers and set(p.resident_layers) | set(p.streamed_layers) == set(range(k31.num_layers))
    assert p.resident_layers == tuple(range(len(p.resident_layers)))  # a contiguous run from layer 0
    assert "embedding" in p.host_bytes and p.host_bytes["streamed dense"] == p.streamed_bytes_per_token
    assert p.fixed_bytes["stream buffers"] == 2 * max(p.layer_bytes[i] for i in p.streamed_layers)
    assert _used(k31, p) <= gib * GIB
    # the next layer really did not fit (resident, it would also have shrunk the buffers)
    r = len(p.resident_layers)
    rest = p.layer_bytes[r + 1 :]
    base = sum(v for k, v in p.fixed_bytes.items() if k != "stream buffers")
    assert base + sum(p.layer_bytes[: r + 1]) + (2 * max(rest) if rest else 0) > gib * GIB
    assert p.expert_slots >= min_expert_slots(k31)


def test_more_memory_never_streams_more(k31):
    plans = [plan_placement(k31, g * GIB) for g in (24, 32, 48, 64, 80, 120, 141, 192)]
    for a, b in zip(plans, plans[1:]):
        assert b.streamed_bytes_per_token <= a.streamed_bytes_per_token
        assert b.link_bytes_per_token(k31) <= a.link_bytes_per_token(k31)


def test_refusal_names_the_shortfall(k31):
    with pytest.raises(StreamrtError) as ei:
        plan_placement(k31, 4 * GIB)
    msg = str(ei.value)
    assert "\n" not in msg and "4.0 GiB" in msg and "short" in msg and "KV cache" in msg
    with pytest.raises(StreamrtError, match="short"):
        plan_placement(k31, 24 * GIB, context=1_000_000)  # the cache of a long context alone
    plan_placement(k31, 24 * GIB, context=4096)


def test_projection_is_link_bytes_over_the_link(k31):
    p = plan_placement(k31, 80 * GIB)
    proj = p.projected_s_per_token(k31, 55.0, 3350.0)
    miss = k31.working_set_experts * expert_bytes_nvfp4(k31) * (1 - p.expert_slots / k31.expert_files)
    assert proj["link_s"] == pytest.approx((p.streamed_bytes_per_token + miss) / 55e9)
    assert proj["s_per_token"] == max(proj["link_s"], proj["compute_floor_s"])


def test_inspect_prints_a_row_per_card(capsys):
    assert cli_main(["inspect", "kimi-k3.1-pro", "--gpu-mem", "24G,80G,192G"]) == 0
    out = capsys.readouterr().out
    rows = [
        line
        for line in out.splitlines()
        if line.startswith("| 24") or line.startswith("| 80") or line.startswith("| 192")
    ]
    assert len(rows) == 3 and "93 of 93" in rows[2]
    assert cli_main(["inspect", "kimi-k3.1-pro", "--gpu-mem", "2G"]) == 2


# ---- every decision on a small geometry, byte for byte -----------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return load_config("tiny-k3.1-pro")


def _need(cfg, r, buffers=2):
    """What a plan with layers 0..r-1 resident needs: the fixed reserve (embedding not included),
    those layers, and `buffers` buffers of the largest streamed layer."""
    p = plan_placement(cfg, 1 << 40)
    base = sum(v for k, v in p.fixed_bytes.items() if k != "embedding")
    layers = layer_dense_bytes(cfg)
    return base + sum(layers[:r]) + (buffers * max(layers[r:]) if r < len(layers) else 0)


def test_routers_stay_resident_and_are_not_streamed(tiny):
    p = plan_placement(tiny, 1 << 40)
    for i in range(tiny.num_layers):
        specs = dense_layer_specs(tiny, i)
        assert p.layer_bytes[i] == sum(s.nbytes for s in specs if not s.name.endswith(ROUTER_SUFFIXES))
    assert p.fixed_bytes["routers"] == router_bytes(tiny) > 0


@pytest.mark.parametrize("buffers", [2, 3])
def test_the_longest_prefix_that_fits_is_resident(tiny, buffers):
    """For every budget of the form need(r) + spare: the longest run of layers from 0 that fits
    beside buffers of the largest streamed layer stays resident, the rest streams, and what is
    left becomes expert slots beyond the minimum."""
    layers = layer_dense_bytes(tiny)
    n = len(layers)
    for r in range(n + 1):
        for spare in (0, 1000):
            budget = _need(tiny, r, buffers) + spare
            p = plan_placement(tiny, budget, buffers=buffers)
            want = max(q for q in range(n + 1) if _need(tiny, q, buffers) <= budget)
            assert p.resident_layers == tuple(range(want)) and p.streamed_layers == tuple(range(want, n))
            assert p.buffers == buffers and p.streamed_bytes_per_token == sum(layers[want:])
            left = budget - _need(tiny, want, buffers)
            if want < n:
                assert p.fixed_bytes["stream buffers"] == buffers * max(layers[want:])
                assert "embedding" in p.host_bytes and p.host_bytes["streamed dense"] == sum(layers[want:])
                assert p.expert_slots == min_expert_slots(tiny) + left // expert_bytes_nvfp4(tiny)
            else:
                assert "stream buffers" not in p.fixed_bytes


def test_buffers_are_sized_by_the_largest_streamed_layer(k31):
    """Layer 0 (the dense FFN) is the largest; once it is resident the buffers shrink to the
    largest streamed layer, and those bytes went to more resident layers or slots."""
    layers = layer_dense_bytes(k31)
    assert layers[0] == max(layers) > 1.5 * max(layers[1:])
    p = plan_placement(k31, 24 * GIB)
    assert 0 in p.resident_layers
    assert p.fixed_bytes["stream buffers"] == 2 * max(layers[len(p.resident_layers):]) < 2 * layers[0]


def test_when_every_layer_fits_nothing_streams_and_the_embedding_moves_in(tiny):
    layers = layer_dense_bytes(tiny)
    embed = plan_placement(tiny, 1 << 40).fixed_bytes["embedding"]
    p = plan_placement(tiny, _need(tiny, len(layers)))  # every layer, no buffers, no room for the table
    assert p.streamed_layers == () and "stream buffers" not in p.fixed_bytes and "embedding" in p.host_bytes
    p = plan_placement(tiny, _need(tiny, len(layers)) + embed)
    assert p.fixed_bytes.get("embedding") == embed and p.expert_slots == min_expert_slots(tiny)


def test_a_third_buffer_costs_one_largest_streamed_layer(tiny):
    layers = layer_dense_bytes(tiny)
    budget = _need(tiny, 4, 2)
    two, three = plan_placement(tiny, budget, buffers=2), plan_placement(tiny, budget, buffers=3)
    assert len(three.resident_layers) < len(two.resident_layers) == 4
    assert three.fixed_bytes["stream buffers"] == 3 * max(layers[len(three.resident_layers):])
    with pytest.raises(StreamrtError, match="at least 2 device buffers"):
        plan_placement(tiny, budget, buffers=1)


def test_the_working_buffers_not_fitting_is_refused_in_one_line(tiny):
    n = len(layer_dense_bytes(tiny))
    need = min(_need(tiny, r) for r in range(n + 1))
    p = plan_placement(tiny, need)  # exactly the working buffers: minimum expert slots
    assert p.expert_slots == min_expert_slots(tiny) and p.streamed_layers
    with pytest.raises(StreamrtError) as ei:
        plan_placement(tiny, need - 1)
    msg = str(ei.value)
    assert "\n" not in msg and "even streaming every layer" in msg and "short" in msg
    assert "stream buffers" in msg and "minimum expert slots" in msg and "routers" in msg
    with pytest.raises(StreamrtError, match="must be > 0"):
        plan_placement(tiny, 0)


def test_the_plan_text_names_the_streamed_layers(tiny):
    p = plan_placement(tiny, _need(tiny, 2, 3), buffers=3)
    text = format_plan(tiny, p)
    assert text.splitlines()[0] == "tiny-k3.1-pro: placement"
    assert f"layers 2-{tiny.num_layers - 1}; 3 device buffers" in text and "s/token" in text


def test_minimum_slots_hold_four_layers_of_routed_experts_for_the_batch():
    """However small the card, the plan keeps the slots the pipeline needs (the computing layer,
    the next one's guesses, the previous one's still read, one spare): per batch row's experts."""
    k31 = load_config("kimi-k3.1-pro")
    assert MIN_SLOT_LAYERS == 4
    assert min_expert_slots(k31) == 4 * k31.experts_per_token
    assert min_expert_slots(k31, batch=8) == 4 * 8 * k31.experts_per_token
    assert min_expert_slots(k31, batch=1000) == 4 * k31.num_experts  # a layer has no more unique experts
    small = plan_placement(k31, 24 * GIB)
    assert small.expert_slots >= min_expert_slots(k31) and small.fixed_bytes["minimum expert slots"] > 0
    wide = plan_placement(k31, 48 * GIB, batch=4)
    assert wide.expert_slots >= min_expert_slots(k31, batch=4)
    assert (
        wide.fixed_bytes["minimum expert slots"]
        == 4 * plan_placement(k31, 48 * GIB).fixed_bytes["minimum expert slots"]
    )
