"""The checkpoint pipeline: names, expert files, synth -> convert -> verify, bad input."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrt import fp4
from streamrt.checkpoint import convert as convert_mod
from streamrt import fileio
from streamrt.checkpoint.convert import convert
from streamrt.checkpoint.expert_file import ExpertLayout, parse_expert, write_expert_file
from streamrt.checkpoint.names import dense_specs, strip_prefix, tensor_specs
from streamrt.checkpoint.reader import open_tree
from streamrt.checkpoint.release import open_release
from streamrt.checkpoint.synth import Generator, quantize_mxfp4_torch, synth
from streamrt.checkpoint.verify import verify_tree
from streamrt.cli.main import main as cli_main
from streamrt.config import expected_indexer_tensors, load_config
from streamrt.errors import CheckpointError, ConfigError, StreamrtError

# ---- reference decoders (float64, from the spec; independent of streamrt.fp4) -----------


def ref_e2m1(c):
    c = np.asarray(c, np.int64)
    e, m = (c >> 1) & 3, c & 1
    return np.where(c & 8, -1.0, 1.0) * np.where(e == 0, m * 0.5, (1 + m / 2) * 2.0 ** (e - 1.0))


def ref_e4m3(b):
    b = np.asarray(b, np.int64)
    e, m = (b >> 3) & 0xF, b & 7
    return np.where(b & 0x80, -1.0, 1.0) * np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7.0))


def ref_codes(p):
    p = np.asarray(p, np.int64)
    out = np.empty((p.shape[0], p.shape[1] * 2), np.int64)
    out[:, 0::2], out[:, 1::2] = p & 15, p >> 4
    return out


def ref_mx(packed, scales):
    return ref_e2m1(ref_codes(packed)) * np.repeat(np.ldexp(1.0, scales.astype(np.int64) - 127), 32, axis=1)


def ref_nv(packed, scales, glob):
    return ref_e2m1(ref_codes(packed)) * np.repeat(ref_e4m3(scales), 16, axis=1) * np.asarray(glob, np.float64)[:, None]


def f32bits(x):
    return np.asarray(x, np.float32).view(np.int32)


# ---- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("rel")
    out = {}
    for name in ("tiny-k3.1-pro", "tiny-k3"):
        # small shards so the index really spans several files
        synth(name, root / name, seed=7, shards=4, progress=False)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def converted(releases, tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    out = {}
    for name, src in releases.items():
        convert(src, root / name, workers=2, progress=False)
        out[name] = root / name
    return out


@pytest.fixture
def rel_copy(releases, tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(releases["tiny-k3.1-pro"], dst)
    return dst


def tree_digest(data: bytes, chunk: int = 64 << 20) -> str:
    """The manifest checksum rule, written from its definition (docs/CONTRACTS.md)."""
    parts = [data[i : i + chunk] for i in range(0, len(data), chunk)] or [b""]
    inner = b"".join(hashlib.blake2b(c, digest_size=8).digest() for c in parts)
    return hashlib.blake2b(inner, digest_size=8).hexdigest()


def one_line_error(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert str(n) in msg, (n, msg)
    return msg


# ---- names ------------------------------------------------------------------------------


def test_tensor_specs_full_geometry_delta_is_the_indexer():
    k3, k31 = load_config("kimi-k3"), load_config("kimi-k3.1-pro")
    t0 = time.perf_counter()
    a, b = tensor_specs(k3), tensor_specs(k31)
    assert time.perf_counter() - t0 < 30.0  # a gross-regression guard only (< 2 s each on an idle core)
    assert len(b) - len(a) == 120
    extra = {s.name for s in b} - {s.name for s in a}
    assert extra == set(expected_indexer_tensors(k31)) and len(extra) == 120
    assert len({s.name for s in b}) == len(b)
    byname = {s.name: s for s in b}
    p = "language_model.model.layers."
    assert byname[p + "3.self_attn.indexer.wq_b.weight"] == (
        p + "3.self_attn.indexer.wq_b.weight",
        (4096, 1536),
        "BF16",
    )
    assert byname[p + "0.self_attn.A_log"].shape == (128,) and byname[p + "0.self_attn.A_log"].dtype == "F32"
    assert byname[p + "0.self_attn.dt_bias"].dtype == "F32"
    assert byname[p + "5.block_sparse_moe.experts.895.w1.weight_packed"][1:] == ((3072, 1792), "U8")
    assert byname[p + "5.block_sparse_moe.experts.895.w1.weight_scale"].shape == (3072, 112)
    assert byname[p + "5.block_sparse_moe.experts.0.w2.weight_scale"].shape == (3584, 96)
    assert not any("g_a_proj" in n or "g_b_proj" in n for n in byname)
    assert all(n.startswith("language_model.") for n in byname)
    experts = [s for s in b if ".experts." in s.name]
    assert len(experts) == 92 * 896 * 6
    assert sum(s.nbytes for s in experts) == 92 * 896 * 3 * (3072 * 3584 // 2 + 3072 * 3584 // 32)


# ---- expert file ------------------------------------------------------------------------


def test_expert_layout_matches_contract_at_k3_geometry():
    lay = ExpertLayout.for_config(load_config("kimi-k3"))
    offs = [o for o, _ in lay.sections]
    assert all(o % 4096 == 0 for o in offs) and offs == sorted(offs) and offs[0] == 4096
    sizes = [n for _, n in lay.sections]
    assert sizes == [3072 * 1792, 3072 * 224, 3072 * 4] * 2 + [3584 * 1536, 3584 * 192, 3584 * 4]
    for (o, n), (o2, _) in zip(lay.sections, lay.sections[1:]):
        assert o2 == -(-(o + n) // 4096) * 4096
    assert lay.file_bytes == -(-(offs[-1] + sizes[-1]) // 4096) * 4096 == 18_624_512


def _random_expert(rng, hidden, inter, per_row=False):
    mats = {}
    for m, (o, i) in {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}.items():
        g = np.ldexp(np.float32(1), rng.integers(-20, 0, size=o if per_row else 1)).astype(np.float32)
        mats[m] = (
            rng.integers(0, 256, (o, i // 2), dtype=np.uint8),
            rng.integers(0, 0x7F, (o, i // 16), dtype=np.uint8),
            np.broadcast_to(g, (o,)).copy(),
        )
    return mats


def test_expert_file_roundtrip_header_and_zero_copy(tmp_path):
    rng = np.random.default_rng()
    lay = ExpertLayout.for_shape(64, 96)
    mats = _random_expert(rng, 64, 96, per_row=True)
    path = tmp_path / "E.nvfp4"
    size, digest = write_expert_file(path, mats, layer=5, expert=17, global_mode=1, layout=lay)
    raw = path.read_bytes()
    assert size == len(raw) == lay.file_bytes
    assert digest == tree_digest(raw)  # one chunk: blake2b-64 of the chunk's blake2b-64
    # header fields exactly as docs/CONTRACTS.md, decoded here independently
    magic, ver, layer, expert, hidden, inter, mode = struct.unpack_from("<8s6I", raw, 0)
    assert (magic, ver, layer, expert, hidden, inter, mode) == (b"SRTNVFP4", 1, 5, 17, 64, 96, 1)
    recs = [struct.unpack_from("<QQ", raw, 32 + 16 * i) for i in range(9)]
    assert tuple(recs) == lay.sections and not any(raw[32 + 144 : 4096])
    buf = bytearray(raw)
    ew = parse_expert(buf, lay, name="E.nvfp4", expect=(5, 17))
    for m in ("gate", "up", "down"):
        mm = getattr(ew, m)
        p, s, g = mats[m]
        assert np.array_equal(mm.packed.numpy(), p) and np.array_equal(mm.scales.numpy(), s)
        assert np.array_equal(mm.global_scale.numpy(), g) and mm.global_scale.dtype == torch.float32
    buf[lay.sections[0][0]] ^= 0xFF  # views, not copies
    assert ew.gate.packed[0, 0].item() == mats["gate"][0][0, 0] ^ 0xFF
    # a uint8 tensor works too
    ew2 = parse_expert(torch.frombuffer(bytearray(raw), dtype=torch.uint8), lay)
    assert torch.equal(ew2.down.scales, torch.from_numpy(mats["down"][1]))
    with pytest.raises(CheckpointError) as ei:
        parse_expert(raw, lay, name="E.nvfp4", expect=(5, 18))
    one_line_error(ei, "E.nvfp4", "expert 17")
    for mutate, needle in (
        (lambda b: b.__setitem__(slice(0, 8), b"XXXXXXXX"), "magic"),
        (lambda b: b.__setitem__(slice(8, 12), struct.pack("<I", 2)), "version 2"),
        (lambda b: b.__setitem__(slice(20, 24), struct.pack("<I", 128)), "geometry"),
        (lambda b: b.__setitem__(slice(28, 32), struct.pack("<I", 7)), "global_mode"),
        (lambda b: b.__setitem__(slice(48, 56), struct.pack("<Q", 12345)), "gate.scales"),
        (lambda b: b.__setitem__(4000, 1), "reserved"),
    ):
        b = bytearray(raw)
        mutate(b)
        with pytest.raises(CheckpointError) as ei:
            parse_expert(b, lay, name="E.nvfp4")
        one_line_error(ei, "E.nvfp4", needle)
    with pytest.raises(CheckpointError, match="bytes, expected"):
        parse_expert(raw[:-4096], lay, name="E.nvfp4")


@pytest.mark.parametrize("background", [False, True])
def test_atomic_writer_hash_modes_and_abort(tmp_path, background):
    data = os.urandom(3 << 20)
    path = tmp_path / "f.bin"
    with fileio.AtomicWriter(path, background_hash=background) as w:
        for i in range(0, len(data), 1 << 20):
            w.write(data[i : i + (1 << 20)])
    assert path.read_bytes() == data and w.digest == tree_digest(data)
    with pytest.raises(RuntimeError):
        with fileio.AtomicWriter(tmp_path / "g.bin", background_hash=background) as w:
            w.write(data[:1000])
            raise RuntimeError("killed mid-file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]  # no partial final file, no temp


def test_quantize_mxfp4_torch_matches_numpy():
    x = torch.randn(64, 256) * 0.02 * torch.exp2(torch.randn(64, 1))
    x[0, :32] = 0
    x[1, 5] = -0.0
    p, s = quantize_mxfp4_torch(x)
    p2, s2 = fp4.quantize_mxfp4(x.numpy())
    assert np.array_equal(p.numpy(), p2) and np.array_equal(s.numpy(), s2)


# ---- synth ------------------------------------------------------------------------------


def test_synth_is_deterministic_and_realistic(releases, tmp_path):
    src = releases["tiny-k3.1-pro"]
    again = tmp_path / "again"
    synth("tiny-k3.1-pro", again, seed=7, shards=4, progress=False)
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(shards) > 1 and shards == sorted(p.name for p in again.glob("*.safetensors"))
    for n in shards:
        assert (src / n).read_bytes() == (again / n).read_bytes(), n
    other = tmp_path / "other"
    synth("tiny-k3.1-pro", other, seed=8, shards=4, progress=False)
    assert (src / shards[0]).read_bytes() != (other / shards[0]).read_bytes()

    rt = open_release(src)  # the synthetic tree passes full validation
    cfg = rt.config
    bf16 = lambda n: torch.frombuffer(bytearray(rt.raw(n)), dtype=torch.bfloat16).float()  # noqa: E731
    f32 = lambda n: np.frombuffer(bytes(rt.raw(n)), np.float32)  # noqa: E731
    a_log = f32("language_model.model.layers.0.self_attn.A_log")
    H = cfg.kda_num_heads
    assert a_log.shape == (cfg.a_log_stored_len,) and (a_log[H:] == 0).all()
    assert (a_log[:H] >= 0).all() and (a_log[:H] <= np.log(16)).all() and a_log[:H].std() > 0
    g = bf16("language_model.model.norm.weight")  # random gains: a dropped gain must show
    assert 0.5 <= g.min() and g.max() <= 2.0 and g.std() > 0.2 and not (g == 1).any()
    p = bf16("language_model.model.layers.1.self_attention_res_proj.weight")  # depth logits spread ~2
    assert 1.0 < p.std().item() * cfg.hidden_size**0.5 < 3.0
    w = bf16("language_model.model.layers.1.self_attn.q_proj.weight")
    assert 0.015 < w.std().item() < 0.025
    # experts: E8M0 exponents over several octaves, all repackable with one scale
    spans = []
    for e in range(cfg.num_experts):
        for w_, (packed, scales) in rt.expert_mxfp4(1, e).items():
            live = scales[fp4.nonzero_halves(packed)[:, ::2]]
            spans.append(int(live.max()) - int(live.min()))
            assert 100 < live.min() and live.max() < 135
    assert 3 <= max(spans) <= fp4.MAX_SPAN
    b = f32("language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias")
    assert b.std() > 0.01
    rt.close()


def test_synth_skew_zero_gives_flat_router_bias():
    cfg = load_config("tiny-k3")
    spec = next(s for s in dense_specs(cfg) if s.name.endswith("e_score_correction_bias"))
    flat = np.concatenate(list(Generator(cfg, 0, skew=0.0, device="cpu").dense_chunks(spec)))
    one = np.concatenate(list(Generator(cfg, 0, skew=1.0, device="cpu").dense_chunks(spec)))
    two = np.concatenate(list(Generator(cfg, 0, skew=2.0, device="cpu").dense_chunks(spec)))
    as_f = lambda a: torch.frombuffer(bytearray(a.tobytes()), dtype=torch.float32)  # noqa: E731  (F32 as released)
    assert as_f(flat).abs().max() == 0
    assert torch.allclose(as_f(two), 2 * as_f(one), rtol=1e-2)


def test_synth_dry_run_full_geometry(tmp_path, capsys):
    assert cli_main(["synth", "--config", "kimi-k3.1-pro", "--dry-run"]) == 0
    out = capsys.readouterr().out
    # 497,172 text tensors + 165 vision tower + 3 projector (the seed's 497,340); bytes: the text
    # plane with the released F32 tensors (1,560,322,659,328) + the stand-in vision tower (941,589,504)
    assert "497,340 tensors" in out and "(497,172 text)" in out and "1,561,264,248,832 bytes" in out
    assert "in 96 shards" in out
    assert not any(tmp_path.iterdir())


# ---- convert + verify round trip -----------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-k3.1-pro", "tiny-k3"])
def test_round_trip(name, releases, converted):
    src, dst = releases[name], converted[name]
    bad, n = verify_tree(dst, full=True, progress=False)
    assert bad == [] and n > 0
    tree = open_tree(dst)
    rt = open_release(src)
    cfg = tree.config
    assert cfg.variant == ("kimi-k3.1-pro" if "3.1" in name else "kimi-k3")
    sd = tree.dense_state_dict()
    assert set(sd) == {strip_prefix(s.name) for s in dense_specs(cfg)}
    for s in dense_specs(cfg):  # dense bytes copied verbatim, indexer included (16-bit)
        t = sd[strip_prefix(s.name)]
        assert tuple(t.shape) == s.shape
        assert t.contiguous().view(torch.uint8).numpy().tobytes() == bytes(rt.raw(s.name)), s.name
    idx = [k for k in sd if ".indexer." in k]
    assert len(idx) == (5 * len(cfg.indexer_layers)) and all(sd[k].dtype == torch.bfloat16 for k in idx)
    m = tree.manifest
    assert (
        m["format_version"] == 2
        and m["checksum"] == "blake2b64-tree-64MiB"
        and m["geometry"]["expert_file_bytes"] == tree.layout.file_bytes
    )
    assert set(m["tensor_names"]) == {s.name for s in tensor_specs(cfg)}
    assert m["expert_global_modes"] == {"per_matrix": cfg.expert_files, "per_row": 0}
    rng = np.random.default_rng()
    for layer, e in [(cfg.moe_layers[0], 0), (cfg.moe_layers[-1], cfg.num_experts - 1)] + [
        (int(rng.choice(cfg.moe_layers)), int(rng.integers(cfg.num_experts))) for _ in range(3)
    ]:
        ew = tree.load_expert(layer, e)
        mx = rt.expert_mxfp4(layer, e)
        for mname, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            mm = getattr(ew, mname)
            got = ref_nv(mm.packed.numpy(), mm.scales.numpy(), mm.global_scale.numpy())
            assert np.array_equal(f32bits(got), f32bits(ref_mx(*mx[w]))), (layer, e, w)
    rt.close()


def test_synth_streamrt_format_equals_converted(converted, tmp_path):
    direct = tmp_path / "direct"
    synth("tiny-k3.1-pro", direct, seed=7, fmt="streamrt", progress=False)
    a = json.loads((direct / "manifest.json").read_text())["files"]
    b = json.loads((converted["tiny-k3.1-pro"] / "manifest.json").read_text())["files"]
    assert a == b  # same bytes, file for file (sizes and checksums)
    assert verify_tree(direct, full=True, progress=False)[0] == []


def test_expert_path_is_pure_io(releases, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("float (de)quantisation on the convert path")

    for f in ("mxfp4_dequant", "nvfp4_dequant", "quantize_mxfp4", "quantize_nvfp4", "e2m1_encode", "e4m3_encode"):
        monkeypatch.setattr(fp4, f, boom)
    monkeypatch.setattr(fp4, "E2M1_VALUES", None)  # any table decode would fail too
    monkeypatch.setattr(fp4, "E4M3_VALUES", None)
    s = convert(releases["tiny-k3"], tmp_path / "out", workers=2, progress=False)
    assert s["written"] == s["files"] > 0


def test_resume_skips_complete_and_redoes_corrupt(releases, tmp_path):
    dst = tmp_path / "out"
    first = convert(releases["tiny-k3"], dst, workers=2, progress=False)
    again = convert(releases["tiny-k3"], dst, workers=2, progress=False)
    assert again["written"] == 0 and again["skipped"] == first["files"]
    victim = dst / "experts/L002/E0003.nvfp4"
    data = bytearray(victim.read_bytes())
    data[5000] ^= 1
    victim.write_bytes(data)
    (dst / "experts/L004/E0000.nvfp4").unlink()
    third = convert(releases["tiny-k3"], dst, workers=2, progress=False)
    assert third["written"] == 2
    assert verify_tree(dst, full=True, progress=False)[0] == []


# ---- verify ---------------------------------------------------------------------------


def test_verify_names_the_flipped_file(converted, tmp_path, capsys):
    dst = tmp_path / "t"
    shutil.copytree(converted["tiny-k3.1-pro"], dst)
    victim = "experts/L005/E0011.nvfp4"
    data = bytearray((dst / victim).read_bytes())
    data[len(data) // 2] ^= 0x10
    (dst / victim).write_bytes(data)
    assert verify_tree(dst, full=False, progress=False)[0] == []  # fast mode: sizes + headers only
    bad, _ = verify_tree(dst, full=True, progress=False)
    assert [b[0] for b in bad] == [victim] and "checksum" in bad[0][1]
    assert cli_main(["verify", str(dst), "--full", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert victim in err and err.count("BAD") == 1
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        open_tree(dst).check_expert(5, 11)


def test_verify_fast_catches_size_header_and_missing(converted, tmp_path):
    dst = tmp_path / "t"
    shutil.copytree(converted["tiny-k3"], dst)
    a, b = dst / "experts/L001/E0001.nvfp4", dst / "experts/L001/E0002.nvfp4"
    tmp = a.read_bytes()
    a.write_bytes(b.read_bytes())  # swapped files: header ids disagree with the path
    b.write_bytes(tmp)
    (dst / "experts/L003/E0000.nvfp4").write_bytes(tmp[:-4096])
    (dst / "experts/L003/E0001.nvfp4").unlink()
    with open(dst / "dense/plane.L002.safetensors", "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    bad = dict(verify_tree(dst, full=False, progress=False)[0])
    assert set(bad) == {
        "experts/L001/E0001.nvfp4",
        "experts/L001/E0002.nvfp4",
        "experts/L003/E0000.nvfp4",
        "experts/L003/E0001.nvfp4",
        "dense/plane.L002.safetensors",
    }
    assert "layer 1 expert 2" in bad["experts/L001/E0001.nvfp4"] and bad["experts/L003/E0001.nvfp4"] == "missing"
    assert "size" in bad["experts/L003/E0000.nvfp4"]


def test_load_expert_is_a_view_of_the_mapping(converted):
    tree = open_tree(converted["tiny-k3"])
    ew = tree.load_expert(1, 3)
    assert ew.gate.packed.untyped_storage().nbytes() == tree.layout.file_bytes
    with pytest.raises(CheckpointError):
        tree.expert_path(0, 0)  # layer 0 is dense


# ---- bad input ------------------------------------------------------------------------


def _shard_of(src: Path, tensor: str) -> Path:
    wm = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    return src / wm[tensor]


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8 : 8 + n])
    edit(hdr)
    new = json.dumps(hdr, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


T_EXP = "language_model.model.layers.2.block_sparse_moe.experts.5.w1.weight_scale"
T_DENSE = "language_model.model.layers.1.self_attn.q_proj.weight"


def test_truncated_shard(rel_copy, tmp_path):
    shard = _shard_of(rel_copy, T_EXP)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(CheckpointError) as ei:
        convert(rel_copy, tmp_path / "out", progress=False)
    one_line_error(ei, shard.name, "truncated", "tensor language_model.")
    assert not (tmp_path / "out").exists()
    with open(shard, "r+b") as f:
        f.truncate(5)
    with pytest.raises(CheckpointError) as ei:
        open_release(rel_copy)
    one_line_error(ei, shard.name, "truncated")


def test_header_offsets_overlap(rel_copy):
    shard = _shard_of(rel_copy, T_DENSE)

    def overlap(h):
        names = [k for k in h if k != "__metadata__"]
        a, b = h[names[0]], h[names[1]]
        size = b["data_offsets"][1] - b["data_offsets"][0]
        b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + size]  # b now starts inside a

    _rewrite_header(shard, overlap)
    with pytest.raises(CheckpointError) as ei:
        open_release(rel_copy)
    one_line_error(ei, shard.name, "overlaps", "tensor language_model.")


def test_header_offsets_run_past_the_file(rel_copy):
    shard = _shard_of(rel_copy, T_EXP)

    def past(h):
        e = h[T_EXP]
        e["data_offsets"] = [e["data_offsets"][0] + 10**9, e["data_offsets"][1] + 10**9]

    _rewrite_header(shard, past)
    with pytest.raises(CheckpointError) as ei:
        open_release(rel_copy)
    one_line_error(ei, shard.name, T_EXP, "ends at data byte")


@pytest.mark.parametrize("what", ["dtype", "shape"])
def test_dtype_or_shape_disagrees_with_config(rel_copy, what):
    shard = _shard_of(rel_copy, T_DENSE)

    def edit(h):
        if what == "dtype":
            h[T_DENSE]["dtype"] = "F16"  # same size: only the config check can see it
        else:
            h[T_DENSE]["shape"] = h[T_DENSE]["shape"][::-1]

    _rewrite_header(shard, edit)
    with pytest.raises(CheckpointError) as ei:
        open_release(rel_copy)
    one_line_error(ei, shard.name, T_DENSE, what, *(("F16, expected BF16",) if what == "dtype" else ("config",)))


def test_missing_tensor(rel_copy):
    idx = rel_copy / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    shard = data["weight_map"].pop(T_EXP)
    idx.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as ei:
        open_release(rel_copy)
    one_line_error(ei, T_EXP, shard, "in the shard but not in model.safetensors.index.json")
    # gone from the shard too: the config implies it
    original = (rel_copy / shard).read_bytes()
    _rewrite_header(rel_copy / shard, lambda h: h.pop(T_EXP))
    with pytest.raises(CheckpointError) as ei:
        open_release(rel_copy)
    one_line_error(ei, T_EXP, "missing from the release")
    (rel_copy / shard).write_bytes(original)
    # listed in the index, but the shard it names does not hold it
    data["weight_map"][T_EXP] = next(v for v in data["weight_map"].values() if v != shard)
    idx.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as ei:
        open_release(rel_copy)
    one_line_error(ei, T_EXP, "missing from the shard", data["weight_map"][T_EXP])


def test_nan_e8m0_scale(rel_copy, tmp_path):
    rt = open_release(rel_copy)
    shard, e = rt.entry(T_EXP)
    rt.close()
    with open(rel_copy / shard, "r+b") as f:
        f.seek(e.begin + 3)
        f.write(b"\xff")
    with pytest.raises(CheckpointError) as ei:
        convert(rel_copy, tmp_path / "out", workers=1, progress=False)
    one_line_error(
        ei, shard, T_EXP, "NaN", f"the files converted so far stay in {tmp_path / 'out'}: once the source is fixed"
    )
    assert not (tmp_path / "out/experts/L002/E0005.nvfp4").exists()  # the expert was never written


def test_inconsistent_gating_refused(rel_copy, tmp_path):
    idx = rel_copy / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    data["weight_map"] = {k: v for k, v in data["weight_map"].items() if ".indexer." not in k}
    idx.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as ei:
        convert(rel_copy, tmp_path / "out", progress=False)
    one_line_error(ei, "indexer tensors")


def test_dst_inside_src_and_foreign_dst(rel_copy, releases, tmp_path):
    with pytest.raises(CheckpointError) as ei:
        convert(rel_copy, rel_copy / "converted", progress=False)
    one_line_error(ei, "inside SRC")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError) as ei:
        convert(rel_copy, foreign, progress=False)
    one_line_error(ei, "not empty")
    assert (foreign / "notes.txt").read_text() == "mine"
    # a partial conversion of a *different* source is refused too
    other = tmp_path / "other"
    convert(releases["tiny-k3"], other, workers=2, progress=False)
    with pytest.raises(CheckpointError, match="not a previous partial conversion"):
        convert(rel_copy, other, progress=False)


def test_disk_full_leaves_nothing_half_written(releases, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    real_write = os.write
    calls = {"n": 0}

    def full_write(fd, data):
        calls["n"] += 1
        if calls["n"] > 40:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(fileio.os, "write", full_write)
    with pytest.raises(CheckpointError) as ei:
        convert(releases["tiny-k3"], dst, workers=2, progress=False)
    one_line_error(ei, "disk full", str(dst))
    monkeypatch.setattr(fileio.os, "write", real_write)
    assert not [p for p in dst.rglob("*") if fileio.is_tmp(p.name)]
    lay = ExpertLayout.for_config(load_config("tiny-k3"))
    experts = list(dst.rglob("*.nvfp4"))
    assert all(p.stat().st_size == lay.file_bytes for p in experts)
    assert not (dst / "manifest.json").exists()
    s = convert(releases["tiny-k3"], dst, workers=2, progress=False)  # resumes
    assert s["skipped"] >= 1 and verify_tree(dst, full=True, progress=False)[0] == []


def test_not_enough_space_upfront(releases, tmp_path, monkeypatch):
    monkeypatch.setattr(convert_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 10, 10))
    with pytest.raises(CheckpointError) as ei:
        convert(releases["tiny-k3"], tmp_path / "out", progress=False)
    one_line_error(ei, "not enough space", "MiB")


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert cli_main(["convert", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamrt: ") and err.count("\n") == 1
    assert cli_main(["verify", str(tmp_path)]) == 2
    assert "manifest.json" in capsys.readouterr().err
    with pytest.raises(StreamrtError):
        synth("tiny-k3", tmp_path / "x", skew=-1)
