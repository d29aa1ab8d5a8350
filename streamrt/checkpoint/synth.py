"""`streamrt synth`: a seeded random checkpoint in the real layout, at any geometry.

Weights have realistic scale and make a stable model: linear weights N(0, 0.02), norm gains
U(0.5, 2) (never exactly 1, so a norm whose gain is dropped changes the logits), AttnRes
projections of N(0, 2/sqrt(D)) (the depth softmax is far from uniform, so a wrong mix shows),
A_log = log U(1, 16) on the live heads and zero padding, small dt_bias, routed experts
drawn as floats (rows scaled over a few octaves, as trained weights are) and quantised to
MXFP4 so E8M0 exponents span a realistic range. Router `e_score_correction_bias` is skewed
(`--skew`) so expert popularity is uneven and caching behaves as on a real model.

The release layout is the real one (spec/REAL_RELEASE.md): `model-000NN-of-0000NN`
shards (96 at full geometry), an index with `metadata.total_size`, F32 where the release
stores F32, each layer's experts written in a seeded order that is not id order, the vision
tower and projector last, `tiktoken.model` and `tokenizer_config.json` beside them.

Every tensor (and every row chunk of a large one) draws from its own generator seeded by
(seed, name, chunk), so output is independent of threading and chunking: the same seed
gives the same bytes on a device kind. Generation and quantisation run on the GPU when
torch sees one. Output streams shard by shard, a bounded chunk at a time, so peak memory
stays well under 2 GiB at any geometry (the 2.3 GB embedding is written in row chunks).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from streamrt import fp4
from streamrt.checkpoint.names import (
    TensorSpec,
    dense_specs,
    expert_matrix_shapes,
    is_expert_tensor,
    strip_prefix,
    tensor_specs,
    vision_specs,
)
from streamrt.checkpoint.safetensors_io import build_header, order_for_alignment, write_stream
from streamrt.config import ModelConfig, load_config
from streamrt.errors import CheckpointError, StreamrtError

CHUNK_ELEMS = 16 << 20  # floats generated at once per worker (64 MiB fp32)
RELEASE_SHARDS = 96  # the release's shard count at full geometry
MIN_SHARD_BYTES = 4 << 30  # smaller geometries: fewer shards, none under this (but at least one)
NORM_GAIN = (0.5, 2.0)  # U(lo, hi) norm gains
WEIGHT_STD = 0.02
CONV_STD = 0.3  # depthwise conv over 4 taps: kaiming-like scale
ROW_OCTAVES_STD, ROW_OCTAVES_MAX = 0.7, 3.0  # expert rows scaled by 2^clip(N(0, .7), ±3)


def _tensor_seed(seed: int, name: str, chunk: int = 0) -> int:
    import hashlib

    h = hashlib.blake2b(f"{seed}\0{name}\0{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class Generator:
    """Tensor bytes for a config and seed, on `device` (cuda when available)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, skew: float = 1.0, device: str | None = None):
        self.cfg, self.seed, self.skew = cfg, seed, skew
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def _randn(self, shape, name: str, chunk: int = 0) -> torch.Tensor:
        g = torch.Generator(device=self.device)
        g.manual_seed(_tensor_seed(self.seed, name, chunk))
        return torch.randn(shape, generator=g, device=self.device, dtype=torch.float32)

    def _rand(self, shape, name: str) -> torch.Tensor:
        g = torch.Generator(device=self.device)
        g.manual_seed(_tensor_seed(self.seed, name, 1 << 40))
        return torch.rand(shape, generator=g, device=self.device, dtype=torch.float32)

    @staticmethod
    def _bytes(t: torch.Tensor, dtype: str) -> np.ndarray:
        tt = {"BF16": torch.bfloat16, "F32": torch.float32}[dtype]
        return t.to(tt).contiguous().view(torch.uint8).cpu().numpy().reshape(-1)

    # -- dense -----------------------------------------------------------------------

    def dense_chunks(self, spec: TensorSpec) -> Iterator[np.ndarray]:
        """The tensor's bytes in row chunks of at most CHUNK_ELEMS elements."""
        name, shape, dt = spec
        n = math.prod(shape)
        leaf = name.rsplit(".", 2)
        if name.endswith(".A_log"):
            h = self.cfg.kda_num_heads
            a = torch.zeros(shape, device=self.device)
            a[:h] = torch.log(1 + 15 * self._rand((h,), name))  # log U(1, 16); padding stays 0
            yield self._bytes(a, dt)
        elif name.endswith(".dt_bias"):
            yield self._bytes(0.1 * self._randn(shape, name), dt)
        elif name.endswith(".e_score_correction_bias"):
            # sigmoid scores vary by ~0.25 * 0.02 * sqrt(D) between experts; a bias of
            # that size times `skew` makes popularity clearly uneven without freezing it.
            spread = 0.25 * WEIGHT_STD * math.sqrt(self.cfg.hidden_size)
            yield self._bytes(self.skew * spread * self._randn(shape, name), dt)
        elif name.endswith("norm.weight") or "layernorm" in name or name.endswith(("norm0.weight", "norm1.weight")):
            lo, hi = NORM_GAIN
            yield self._bytes(lo + (hi - lo) * self._rand(shape, name), dt)
        elif name.endswith(".bias"):
            yield self._bytes(WEIGHT_STD * self._randn(shape, name), dt)
        else:
            std = CONV_STD if leaf[-2].endswith("_conv1d") else WEIGHT_STD
            if name.endswith("_res_proj.weight"):
                std = 2.0 / math.sqrt(self.cfg.hidden_size)  # depth logits of spread ~2 over the sources
            row = math.prod(shape[1:]) if len(shape) > 1 else n
            rows = shape[0] if len(shape) > 1 else 1
            per = max(1, CHUNK_ELEMS // max(row, 1))
            for c, r0 in enumerate(range(0, rows, per)):
                r1 = min(rows, r0 + per)
                sub = ((r1 - r0),) + tuple(shape[1:]) if len(shape) > 1 else shape
                yield self._bytes(std * self._randn(sub, name, c), dt)

    # -- experts ---------------------------------------------------------------------

    def expert_float(self, layer: int, expert: int, w: str) -> torch.Tensor:
        """Float weights [out, in] of one expert matrix (w1/w3/w2), rows over a few octaves."""
        out, inn = expert_matrix_shapes(self.cfg)[w]
        name = f"L{layer}.E{expert}.{w}"
        x = self._randn((out, inn), name)
        octaves = (ROW_OCTAVES_STD * self._randn((out, 1), name, 1)).clamp_(-ROW_OCTAVES_MAX, ROW_OCTAVES_MAX)
        return x.mul_(WEIGHT_STD * torch.exp2(octaves))

    def expert_mxfp4(self, layer: int, expert: int, w: str) -> tuple[np.ndarray, np.ndarray]:
        x = self.expert_float(layer, expert, w)
        if x.device.type == "cpu":
            return fp4.quantize_mxfp4(x.numpy())
        p, s = quantize_mxfp4_torch(x)
        return p.cpu().numpy(), s.cpu().numpy()


def quantize_mxfp4_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp4.quantize_mxfp4 on any torch device, same bytes (same rule, exact power-of-two division)."""
    n, k = x.shape
    b = x.float().reshape(n, k // 32, 32)
    amax = b.abs().amax(-1)
    m, e = torch.frexp(amax / 6.0)
    kexp = torch.where(m == 0.5, e - 1, e)
    s = torch.where(amax > 0, (kexp + 127).clamp(0, 254), torch.full_like(kexp, 127)).to(torch.int64)
    # 2^-(s-127) exactly, as a float64 built from its bits (no exp2 rounding to trust)
    f = ((1023 - (s - 127)) << 52).view(torch.float64)
    q = b.double() * f[..., None]
    a = q.abs()
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)
    code = (code | (torch.signbit(q).to(torch.uint8) << 3)).reshape(n, k)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), s.to(torch.uint8)


# ---- planning ------------------------------------------------------------------------


def release_order(cfg: ModelConfig, seed: int) -> list[TensorSpec]:
    """Every tensor in file order as the release has it: per layer its dense tensors, then its
    experts in a seeded order that is not id order (six tensors each, together), then the
    vision tower and projector."""
    specs = tensor_specs(cfg)
    out, i = [], 0
    per_expert = 2 * len(expert_matrix_shapes(cfg))
    while i < len(specs):
        s = specs[i]
        if not is_expert_tensor(s.name):
            out.append(s)
            i += 1
            continue
        layer = int(s.name.split(".layers.", 1)[1].split(".", 1)[0])
        block = specs[i : i + cfg.num_experts * per_expert]
        g = np.random.default_rng(_tensor_seed(seed, f"expert order {layer}"))
        for e in g.permutation(cfg.num_experts):
            out.extend(block[e * per_expert : (e + 1) * per_expert])
        i += len(block)
    return out + vision_specs(cfg)


def default_shard_count(total_bytes: int) -> int:
    return max(1, min(RELEASE_SHARDS, total_bytes // MIN_SHARD_BYTES))


def plan_shards(specs: list[TensorSpec], shards: int) -> list[list[TensorSpec]]:
    """`shards` shards of about equal bytes, in file order; an expert's six tensors never
    straddle a boundary (the release keeps them together). Fewer only if there are fewer
    places to cut."""
    sizes = [s.nbytes if s.dtype != "U8" else s.shape[0] * s.shape[1] for s in specs]  # fast path for ~500k U8s
    total = sum(sizes)
    out: list[list[TensorSpec]] = [[]]
    done = 0
    for s, b in zip(specs, sizes):
        boundary_ok = not is_expert_tensor(s.name) or s.name.endswith(".w1.weight_packed")
        if out[-1] and boundary_ok and len(out) < shards and done >= total * len(out) / shards:
            out.append([])
        out[-1].append(s)
        done += b
    return out


def shard_name(i: int, n: int) -> str:
    """The release's rule: five digits for the shard, six for the count."""
    return f"model-{i + 1:05d}-of-{n:06d}.safetensors"


def _shard_chunks(gen: Generator, specs: list[TensorSpec]) -> Iterator[np.ndarray]:
    pending: dict[str, np.ndarray] = {}
    for s in specs:
        if s.name in pending:
            yield pending.pop(s.name)
        elif is_expert_tensor(s.name):
            # "…layers.{l}.block_sparse_moe.experts.{e}.{w}.weight_packed|scale"
            head, w, kind = s.name.rsplit(".", 2)
            layer = int(s.name.split(".layers.", 1)[1].split(".", 1)[0])
            expert = int(head.rsplit(".", 1)[1])
            packed, scales = gen.expert_mxfp4(layer, expert, w)
            base = s.name.rsplit(".", 1)[0]
            if kind == "weight_packed":
                pending[base + ".weight_scale"] = scales
                yield packed
            else:
                pending[base + ".weight_packed"] = packed
                yield scales
        else:
            yield from gen.dense_chunks(s)


# ---- writers -------------------------------------------------------------------------


def _config_json(cfg: ModelConfig) -> bytes:
    return (json.dumps(cfg.raw, indent=2) + "\n").encode()


def synth_release(cfg: ModelConfig, out: Path, gen: Generator, *, shards: int, workers: int, bar) -> dict:
    from streamrt.fileio import write_bytes_atomic
    from streamrt.checkpoint.release import INDEX

    planned = plan_shards(release_order(cfg, gen.seed), shards)
    names = [shard_name(i, len(planned)) for i in range(len(planned))]
    lock = threading.Lock()

    def tick(n):
        with lock:
            bar.update(n)

    def one(i):
        specs = order_for_alignment(planned[i])
        write_stream(out / names[i], specs, _shard_chunks(gen, specs), metadata={"format": "pt"}, on_bytes=tick)

    _run_pool(one, range(len(planned)), workers)
    wm = {s.name: names[i] for i, sh in enumerate(planned) for s in sh}
    total = sum(s.nbytes for sh in planned for s in sh)
    write_bytes_atomic(out / "config.json", _config_json(cfg))
    write_bytes_atomic(out / "tiktoken.model", synthetic_bpe(cfg.vocab_size, gen.seed))
    write_bytes_atomic(out / "tokenizer_config.json", tokenizer_config_json())
    index = {"metadata": {"total_size": total}, "weight_map": wm}
    write_bytes_atomic(out / INDEX, json.dumps(index, indent=1).encode())
    return {"shards": len(planned), "tensors": len(wm), "bytes": total}


def synthetic_bpe(vocab_size: int, seed: int) -> bytes:
    """A `tiktoken.model` for the regular ids below the 256 specials: the 256 bytes at their
    own ranks (so short vocabularies encode as the byte tokenizer does), then seeded merges of
    two earlier tokens, each reachable by BPE because both halves rank below it."""
    import base64

    regular = vocab_size - 256
    tokens = [bytes((b,)) for b in range(min(256, regular))]
    seen = set(tokens)
    g = np.random.default_rng(_tensor_seed(seed, "bpe"))
    while len(tokens) < regular:
        a, b = g.integers(0, len(tokens), 2)
        t = tokens[a] + tokens[b]
        if len(t) <= 16 and t not in seen:
            seen.add(t)
            tokens.append(t)
    return b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(tokens))


def tokenizer_config_json() -> bytes:
    """`tokenizer_config.json` naming the 256 reserved ids from 163584, as the release's does."""
    from streamrt.tokenizer import K3_NAMED_SPECIALS, K3_SPECIAL_BASE, NUM_SPECIALS

    names = {v: k for k, v in K3_NAMED_SPECIALS.items()}
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    decoder = {
        str(i): {"content": names.get(i, f"<|reserved_token_{i - K3_SPECIAL_BASE}|>"), **entry}
        for i in range(K3_SPECIAL_BASE, K3_SPECIAL_BASE + NUM_SPECIALS)
    }
    cfg = {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
           "unk_token": "[UNK]", "tokenizer_class": "TikTokenTokenizer"}
    return (json.dumps(cfg, indent=2) + "\n").encode()


def synth_streamrt(cfg: ModelConfig, out: Path, gen: Generator, *, workers: int, bar,
                   allow_per_row: bool = False) -> dict:
    """Write a converted tree directly (no release on disk): dense files, expert files, manifest."""
    from streamrt.checkpoint.manifest import dense_files, write_manifest
    from streamrt.checkpoint.expert_file import ExpertLayout, write_expert_file
    from streamrt.checkpoint.names import expert_relpath

    lock = threading.Lock()
    files: dict[str, dict] = {}
    modes = {0: 0, 1: 0}

    def tick(n):
        with lock:
            bar.update(n)

    def record(rel, size, digest):
        with lock:
            files[rel] = {"size": size, "blake2b": digest}

    groups = dense_files(dense_specs(cfg))
    layout = ExpertLayout.for_config(cfg)

    def dense_task(rel):
        specs = groups[rel]
        renamed = [TensorSpec(strip_prefix(s.name), s.shape, s.dtype) for s in specs]
        size, d = write_stream(out / rel, renamed, _shard_chunks(gen, specs), on_bytes=tick)
        record(rel, size, d)

    def expert_task(key):
        layer, e = key
        mats, per_row = {}, False
        for m, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            packed, scales = gen.expert_mxfp4(layer, e, w)
            p, s, g, pr = fp4.repack_expert_matrix(
                packed, scales, allow_per_row=allow_per_row, name=f"L{layer}.E{e}.{w}"
            )
            mats[m], per_row = (p, s, g), per_row or pr
        rel = expert_relpath(layer, e)
        size, d = write_expert_file(
            out / rel, mats, layer=layer, expert=e, global_mode=int(per_row), layout=layout, on_bytes=tick
        )
        record(rel, size, d)
        with lock:
            modes[int(per_row)] += 1

    tasks = [(dense_task, rel) for rel in groups] + [
        (expert_task, (l, e)) for l in cfg.moe_layers for e in range(cfg.num_experts)
    ]
    _run_pool(lambda t: t[0](t[1]), tasks, workers)
    _write_top_files(cfg, out, gen, files)
    write_manifest(
        out, cfg, files, [s.name for s in tensor_specs(cfg)], source={"synth": True, "seed": gen.seed}, modes=modes
    )
    return {"files": len(files), "tensors": len(tensor_specs(cfg)), "bytes": sum(f["size"] for f in files.values())}


def _write_top_files(cfg: ModelConfig, out: Path, gen: Generator, files: dict[str, dict]) -> None:
    """The small files beside the tensors (config, tokenizer), recorded in `files` for the manifest."""
    from streamrt.fileio import write_bytes_atomic

    for name, data in (
        ("config.json", _config_json(cfg)),
        ("tiktoken.model", synthetic_bpe(cfg.vocab_size, gen.seed)),
        ("tokenizer_config.json", tokenizer_config_json()),
    ):
        size, d = write_bytes_atomic(out / name, data)
        files[name] = {"size": size, "blake2b": d}


def _run_pool(fn, items, workers: int) -> None:
    items = list(items)
    if workers <= 1:
        for it in items:
            fn(it)
        return
    with ThreadPoolExecutor(workers) as ex:
        for f in [ex.submit(fn, it) for it in items]:
            f.result()


def streamrt_bytes(cfg: ModelConfig) -> int:
    from streamrt.checkpoint.manifest import dense_files
    from streamrt.checkpoint.expert_file import ExpertLayout

    dense = 0
    for specs in dense_files(dense_specs(cfg)).values():
        hdr, offs = build_header([TensorSpec(strip_prefix(s.name), s.shape, s.dtype) for s in specs])
        dense += len(hdr) + (offs[-1][1] if offs else 0)
    return dense + cfg.expert_files * ExpertLayout.for_config(cfg).file_bytes


def synth(
    config: str,
    out: Path | None,
    *,
    seed: int = 0,
    skew: float = 1.0,
    fmt: str = "release",
    dry_run: bool = False,
    shards: int | None = None,
    workers: int | None = None,
    device: str | None = None,
    progress: bool | None = None,
    allow_per_row: bool = False,
) -> dict:
    cfg = load_config(config)
    if fmt not in ("release", "streamrt"):
        raise StreamrtError(f"--format must be 'release' or 'streamrt', got {fmt!r}")
    if skew < 0 or not math.isfinite(skew):
        raise StreamrtError(f"--skew must be a finite number >= 0, got {skew}")
    if shards is not None and shards < 1:
        raise StreamrtError(f"--shards must be >= 1, got {shards}")
    specs = tensor_specs(cfg) + (vision_specs(cfg) if fmt == "release" else [])
    nbytes = (
        sum(s.nbytes if s.dtype != "U8" else s.shape[0] * s.shape[1] for s in specs)
        if fmt == "release"
        else streamrt_bytes(cfg)
    )
    summary = {"config": cfg.name, "variant": cfg.variant, "format": fmt, "tensors": len(specs), "bytes": nbytes}
    if fmt == "release":
        shards = shards or default_shard_count(nbytes)
        summary["shards"] = len(plan_shards(release_order(cfg, seed), shards))
        summary["text_tensors"] = len(tensor_specs(cfg))
    else:
        summary["expert_files"] = cfg.expert_files
    if dry_run:
        return summary
    out = _make_out(out, nbytes)
    gen = Generator(cfg, seed, skew, device)
    if workers is None:
        workers = (
            min(6, os.cpu_count() or 1) if gen.device.type == "cuda" else max(1, min(4, (os.cpu_count() or 2) // 2))
        )
    from tqdm import tqdm

    t0 = time.perf_counter()
    with tqdm(total=nbytes, unit="B", unit_scale=True, desc=f"synth {cfg.name}", disable=_disable(progress)) as bar:
        if fmt == "release":
            summary.update(synth_release(cfg, out, gen, shards=shards, workers=workers, bar=bar))
        else:
            summary.update(synth_streamrt(cfg, out, gen, workers=workers, bar=bar, allow_per_row=allow_per_row))
    summary.update(seconds=time.perf_counter() - t0, device=str(gen.device), out=str(out))
    return summary


def _make_out(out: Path | None, nbytes: int) -> Path:
    """Check --out (absent or an empty directory, its parent there, room for `nbytes`) and create it."""
    if out is None:
        raise StreamrtError("--out is required unless --dry-run")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: --out exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: output directory exists and is not empty")
    if not out.parent.exists():  # a typo must not build a tree of directories
        raise CheckpointError(f"{out}: directory {out.parent} does not exist; create it first")
    _check_space(out, nbytes)  # before any directory is made: a refusal leaves nothing behind
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where a directory belongs, no permission, a name too long
        raise CheckpointError(f"{out}: cannot create --out: {e.strerror or e}") from None
    return out


def _disable(progress: bool | None) -> bool | None:
    return None if progress is None else not progress  # None: tqdm decides (off when not a tty)


def _check_space(out: Path, need: int) -> None:
    from streamrt.output_paths import space_error

    why = space_error(out, need)  # out and its parents may not exist yet
    if why:
        raise CheckpointError(f"{out}: {why}")
