"""Operand alignment never changes a bit on the CPU path.

A BLAS may take one code path for 64-byte-aligned operands and another for the rest, and an
operand whose address modulo 64 depended on the process (a small numpy array, a bytes object, a
view at a header-dependent offset) would then change the logits in some runs only. Two things
keep that from happening, and each has a test: the products the torch backend runs give the same
bits at every operand offset (the probe, profiling/probe_alignment.py), and a whole forward does
too with every weight and expert moved off the 64-byte boundary; and in a real `streamrt run`
every floating-point operand lives on storage whose base is 64-byte aligned (torch's allocator,
or a page-aligned mapping), so its alignment is a fixed offset, the same in every process."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "profiling"))
from probe_alignment import RUN_ARGS, OperandRecorder, placed, probe  # noqa: E402

from streamrt.backends.torch_backend import TorchBackend  # noqa: E402
from streamrt.config import load_config  # noqa: E402
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix  # noqa: E402
from streamrt.loader import DictExpertProvider  # noqa: E402
from streamrt.model import KimiLinearForCausalLM, run_sync  # noqa: E402
from streamrt.model.synthetic import init_random_, random_experts  # noqa: E402


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def test_products_give_the_same_bits_at_every_operand_offset():
    for name, differ in probe(trials=2, seed=_seed()):
        assert not any(differ.values()), f"{name}: bits change with operand offset {differ}"


def test_placed_puts_the_operand_where_asked():
    t = torch.randn(5, 7)
    for off in (0, 4, 16, 48):
        p = placed(t, off)
        assert p.data_ptr() % 64 == off and torch.equal(p, t)


def _misplace_(model, offset: int) -> None:
    """Every parameter and buffer moved to an address `offset` bytes past a 64-byte boundary."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.data = placed(t.data.contiguous(), offset)


def _misplaced_experts(experts, offset: int):
    def mv(m: NVFP4Matrix) -> NVFP4Matrix:
        return NVFP4Matrix(placed(m.packed, offset), placed(m.scales, offset), placed(m.global_scale, offset))

    return {k: ExpertWeights(mv(e.gate), mv(e.up), mv(e.down)) for k, e in experts.items()}


def _logits(model, provider, ids: list[int], steps: list[int]) -> list[bytes]:
    """Bits of the prefill's last logits and of each teacher-forced decode step's."""
    cache = model.new_cache(1)
    out = [run_sync(model.forward_steps(torch.tensor([ids]), cache, last_only=True), provider)]
    for t in steps:
        out.append(run_sync(model.forward_steps(torch.tensor([[t]]), cache), provider))
    return [x[0, -1].float().numpy().tobytes() for x in out]


@pytest.mark.parametrize("offset", [16, 4])
def test_forward_bits_do_not_depend_on_weight_alignment(offset):
    cfg = load_config("tiny-k3.1-pro")
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=gen).tolist()
    steps = torch.randint(0, cfg.vocab_size, (3,), generator=gen).tolist()
    experts = random_experts(cfg, seed + 1)
    model = KimiLinearForCausalLM(cfg, backend=TorchBackend()).eval().requires_grad_(False)
    init_random_(model, seed)  # fp32 weights: `.float()` keeps them in place, so products read them there
    want = _logits(model, DictExpertProvider(experts), ids, steps)
    _misplace_(model, offset)
    assert all(p.data_ptr() % 64 == offset for p in model.parameters())
    got = _logits(model, DictExpertProvider(_misplaced_experts(experts, offset)), ids, steps)
    assert got == want, f"seed {seed}: logits changed with every weight {offset} bytes off a 64-byte boundary"


@pytest.fixture(scope="module")
def tiny_tree(tmp_path_factory):
    from streamrt.checkpoint.convert import convert
    from streamrt.checkpoint.synth import synth

    d = tmp_path_factory.mktemp("align")
    synth("tiny-k3.1-pro", d / "rel", seed=_seed() % 1000, workers=1, progress=False)  # a release, as users get
    convert(d / "rel", d / "conv", workers=1, progress=False)
    return d / "conv"


def test_every_float_operand_of_a_run_sits_on_64_byte_aligned_storage(tiny_tree, capsys):
    from streamrt.cli.main import main as cli

    rec = OperandRecorder()
    with rec:
        assert cli([RUN_ARGS[0], "--model", str(tiny_tree), *RUN_ARGS[1:]]) == 0
    assert '"logits_hash"' in capsys.readouterr().out
    assert len(rec.ops) > 1000 and threading.current_thread() is threading.main_thread()
    foreign = [(op, m) for op, mods in rec.ops for m in mods if m[1] % 64]
    assert not foreign, f"operands on storage not 64-byte aligned (alignment may vary by process): {foreign[:5]}"


def test_the_recorder_sees_an_operand_on_foreign_storage():
    raw = bytearray(4 * 64 + 64)
    base = (-torch.frombuffer(raw, dtype=torch.uint8).data_ptr()) % 64 + 16  # 16 bytes past a boundary
    x = torch.frombuffer(raw, dtype=torch.float32, count=64, offset=base)
    rec = OperandRecorder()
    with rec:
        torch.mv(torch.ones(3, 64), x)
    assert ("aten.mv", ((0, 0), (16, 16))) in rec.ops
