"""The placement plan (streamrt/placement.py): what fits, what streams, and the refusal."""

from __future__ import annotations

import pytest

from streamrt.cli import main as cli_main
from streamrt.config import load_config
from streamrt.errors import StreamrtError
from streamrt.placement import plan_placement
from streamrt.plan import expert_bytes_nvfp4

GIB = 1 << 30


@pytest.fixture(scope="module")
def k31():
    return load_config("kimi-k3.1-pro")


def _used(cfg, p) -> int:
    return sum(p.fixed_bytes.values()) + p.resident_dense_bytes + (p.expert_slots - 2 * cfg.experts_per_token) * expert_bytes_nvfp4(cfg)


def test_dense_plane_is_the_106_gib_of_the_inventory(k31):
    p = plan_placement(k31, 1 << 50)
    # DESIGN.md: 106 GiB BF16 dense plane (73.5 resident set + 32.5 per-layer planes); layers plus
    # lm_head plus the embedding, with the released F32 tensors a little larger
    total = sum(p.layer_bytes) + p.fixed_bytes["lm_head and norms"] + p.fixed_bytes["embedding"]
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
    assert p.fixed_bytes["stream buffers"] == 2 * max(p.layer_bytes)
    assert _used(k31, p) <= gib * GIB
    nxt = p.layer_bytes[p.streamed_layers[0]]
    assert gib * GIB - _used(k31, p) < nxt + expert_bytes_nvfp4(k31)  # the next layer really did not fit
    assert p.expert_slots >= 2 * k31.experts_per_token


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
    rows = [line for line in out.splitlines() if line.startswith("| 24") or line.startswith("| 80") or line.startswith("| 192")]
    assert len(rows) == 3 and "93 of 93" in rows[2]
    assert cli_main(["inspect", "kimi-k3.1-pro", "--gpu-mem", "2G"]) == 2
