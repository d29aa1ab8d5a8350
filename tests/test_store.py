"""HostTier (retention window, lazy mappings, retirement) and DeviceTier (slots, pins, views),
on small fake expert files and the CPU twin."""

import argparse
from types import SimpleNamespace

import pytest
import torch

from streamrt.errors import CheckpointError, StreamrtError
from streamrt.runtime.options import RuntimeOptions, add_runtime_flags, parse_bytes
from streamrt.runtime.stats import PAYLOAD_KEYS, RuntimeStats
from streamrt.runtime.streams import CpuDevice
from streamrt.store.device_tier import DeviceTier, relocate_views
from streamrt.store.host_tier import HostTier
from streamrt.store.keys import ExpertKey
from streamrt.store.policies import LRU
from streamrt.store.retire import RetireQueue

FILE_BYTES = 8192
LAYERS, EXPERTS, K = 4, 8, 2


@pytest.fixture
def files(tmp_path):
    for l in range(LAYERS):
        for e in range(EXPERTS):
            (tmp_path / f"{l}_{e}.bin").write_bytes(bytes([l * 16 + e]) * FILE_BYTES)
    return lambda key: tmp_path / f"{key.layer}_{key.expert}.bin"


def host_tier(path_of, window, **kw):
    stats, retire, dev = RuntimeStats(), RetireQueue(), CpuDevice()
    return HostTier(path_of, FILE_BYTES, window, device=dev, retire=retire, stats=stats, **kw), stats, retire, dev


def cyclic_trace(tokens=6):
    """Layers in order every token, each picking K experts (a different pair each token)."""
    return [ExpertKey(l, (t + j * 3) % EXPERTS) for t in range(tokens) for l in range(LAYERS) for j in range(K)]


def test_window_below_working_set_is_a_cyclic_scan_with_zero_hits(files):
    trace = [ExpertKey(l, j) for _ in range(5) for l in range(LAYERS) for j in range(K)]  # same experts every token
    host, st, retire, _ = host_tier(files, window=2)
    for key in trace:
        host.get(key)
    assert st.host_hits == 0 and st.host_misses == len(trace)
    # the same trace with the window at the working set hits everything after the first token
    host, st, _, _ = host_tier(files, window=LAYERS * K)
    for key in trace:
        host.get(key)
    assert st.host_misses == LAYERS * K and st.host_hits == len(trace) - LAYERS * K


def test_window_at_expert_count_gives_compulsory_misses_only(files):
    trace = cyclic_trace()
    host, st, retire, _ = host_tier(files, window=LAYERS * EXPERTS)
    for key in trace:
        host.get(key)
    assert st.host_misses == len(set(trace)) and st.host_hits == len(trace) - len(set(trace))
    assert st.evictions == 0 and retire.retired == 0


def test_mapping_is_lazy_zero_copy_and_retired_on_eviction(files):
    host, st, retire, _ = host_tier(files, window=2)
    assert len(host) == 0  # nothing mapped at construction
    m = host.get(ExpertKey(1, 3))
    assert m.data.dtype == torch.uint8 and m.data.numel() == FILE_BYTES and int(m.data[0]) == 16 + 3
    assert st.bytes_disk == FILE_BYTES
    host.get(ExpertKey(1, 4))
    host.get(ExpertKey(1, 5))  # evicts (1, 3)
    assert ExpertKey(1, 3) not in host and st.evictions == 1
    assert retire.retired == 1 and retire.pending == 1 and m.data is not None  # retired, not unmapped
    retire.release()  # CPU events are complete at once
    assert retire.released == 1 and m.data is None


def test_evict_sync_counts_full_synchronizes(files):
    host, st, retire, dev = host_tier(files, window=1, evict="sync")
    for e in range(4):
        host.get(ExpertKey(0, e))
    assert dev.full_synchronizes == 3 and st.evictions == 3 and retire.retired == 0 and st.released_sync == 3


def test_bad_files_name_the_file(files, tmp_path):
    host, *_ = host_tier(lambda k: tmp_path / "nope.bin", window=2)
    with pytest.raises(CheckpointError, match="nope.bin"):
        host.get(ExpertKey(0, 0))
    (tmp_path / "short.bin").write_bytes(b"x" * 100)
    host, *_ = host_tier(lambda k: tmp_path / "short.bin", window=2)
    with pytest.raises(CheckpointError, match=r"short.bin: 100 bytes, expected 8192"):
        host.get(ExpertKey(0, 0))


def test_window_zero_is_a_one_line_error_naming_the_flag():
    with pytest.raises(StreamrtError, match="--window must be >= 1"):
        RuntimeOptions(window=0)
    p = add_runtime_flags(argparse.ArgumentParser())
    with pytest.raises(StreamrtError, match="--window"):
        RuntimeOptions.from_args(p.parse_args(["--window", "0"]))


def test_runtime_flags_parse_and_resolve():
    p = add_runtime_flags(argparse.ArgumentParser())
    args = p.parse_args(["--window", "10", "--host-mem", "64K", "--gpu-experts", "8", "--gpu-policy", "lru",
                         "--staging", "off", "--preparse", "--prefetch", "discard", "--evict", "sync",
                         "--stats-json", "s.json", "--device", "cpu"])
    o = RuntimeOptions.from_args(args)
    assert (o.window, o.host_mem, o.gpu_experts, o.gpu_policy, o.staging, o.preparse, o.prefetch, o.evict) == (
        10, 65536, 8, "lru", False, True, "discard", "sync")
    cfg = SimpleNamespace(working_set_experts=32, expert_files=256, num_experts=32, experts_per_token=4)
    r = o.resolve(cfg, FILE_BYTES, CpuDevice())
    assert (r.window, r.gpu_experts) == (8, 8)  # the window is capped by --host-mem: 64 KiB / 8 KiB
    d = RuntimeOptions().resolve(cfg, FILE_BYTES, CpuDevice())
    assert d.window == 256 and d.gpu_experts == 256  # default window >= 2 x working set (capped at the files)
    with pytest.raises(StreamrtError, match="--gpu-experts 2: one layer request needs up to 4"):
        RuntimeOptions(gpu_experts=2).resolve(cfg, FILE_BYTES, CpuDevice())
    with pytest.raises(StreamrtError, match="--host-mem"):
        parse_bytes("lots", "--host-mem")
    assert parse_bytes("1.5GiB", "--gpu-mem") == 3 << 29


def test_device_tier_pins_victims_and_copies():
    st = RuntimeStats()
    tier = DeviceTier(3, 16, device=CpuDevice(), policy=LRU(), stats=st)
    src = {e: torch.full((16,), e, dtype=torch.uint8) for e in range(6)}
    keys = [ExpertKey(1, e) for e in range(6)]
    for k in keys[:3]:
        assert tier.lookup(k) is None
        tier.fill(tier.admit(k), src[k.expert], pinned=False)
    assert tier.lookup(keys[0]) is not None  # keys[0] is now most recent; keys[1] is LRU
    tier.pin([keys[1]])
    slot = tier.admit(keys[3])  # LRU would take keys[1], but it is pinned: keys[2] goes
    assert keys[1] in tier and keys[2] not in tier and tier.evictions == 1
    tier.fill(slot, src[3], pinned=False)
    assert torch.equal(tier.slab[tier.slot_of(keys[3])], src[3])
    tier.pin([keys[0], keys[3]])
    with pytest.raises(StreamrtError, match="--gpu-experts 3"):
        tier.admit(keys[4])
    assert tier.admit(keys[4], required=False) is None
    tier.unpin([keys[1]])
    assert tier.admit(keys[4]) is not None and keys[1] not in tier
    assert (st.device_hits, st.device_misses, st.bytes_h2d) == (1, 3, 4 * 16)


def test_relocated_views_match_the_parsed_layout():
    import pathlib
    import tempfile

    from streamrt.checkpoint.expert_file import ExpertLayout, parse_expert, write_expert_file
    from streamrt.expert_weights import ExpertWeights
    from streamrt.model.synthetic import random_nvfp4

    layout = ExpertLayout.for_shape(32, 64)
    g = torch.Generator().manual_seed(0)
    ew = ExpertWeights(random_nvfp4(64, 32, g), random_nvfp4(64, 32, g), random_nvfp4(32, 64, g))
    with tempfile.TemporaryDirectory() as d:
        p = pathlib.Path(d) / "e.nvfp4"
        write_expert_file(p, ew, layer=1, expert=2, layout=layout)
        base = torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8)
    slot = base.clone()
    moved = relocate_views(parse_expert(base, layout), base, slot)
    for name in ("gate", "up", "down"):
        a, b = getattr(parse_expert(base, layout), name), getattr(moved, name)
        for f in ("packed", "scales", "global_scale"):
            assert torch.equal(getattr(a, f), getattr(b, f))
            t = getattr(b, f)
            assert slot.data_ptr() <= t.data_ptr() < slot.data_ptr() + slot.numel()


def test_stats_payload_has_exactly_the_documented_keys():
    p = RuntimeStats(tokens=2, decode_s=1.0, bytes_h2d=5e9, decode_bytes_h2d=4e9).payload(
        retire=RetireQueue(), device=CpuDevice()
    )
    assert tuple(p) == PAYLOAD_KEYS == (
        "tokens", "s_per_token", "host_hits", "host_misses", "device_hits", "device_misses", "bytes_h2d",
        "bytes_disk", "evictions", "retired", "released", "full_synchronizes", "stall_s", "predicted_recall",
        "effective_gbps")
    assert p["s_per_token"] == 0.5 and p["effective_gbps"] == 4.0


def test_release_never_unmaps_under_a_live_view(files):
    # torch.frombuffer holds no buffer export, so an explicit mmap.close() would unmap memory a
    # CPU view still reads (a segfault); release drops references and the view keeps it alive
    host, st, retire, _ = host_tier(files, window=1)
    view = host.get(ExpertKey(2, 5)).data[:16]
    host.get(ExpertKey(2, 6))  # evict + retire
    retire.release()
    assert retire.released == 1
    assert view.tolist() == [2 * 16 + 5] * 16
