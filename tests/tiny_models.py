"""Random tiny models for the tests that run the forward directly: a bundled geometry with
seeded random weights on the torch backend and a dict of seeded random experts, built once a
process per (name, seeds)."""

from __future__ import annotations

import torch

from streamrt.backends.torch_backend import TorchBackend
from streamrt.config import load_config
from streamrt.loader import DictExpertProvider
from streamrt.model import KimiLinearForCausalLM
from streamrt.model.synthetic import init_random_, random_experts

_BUILT: dict = {}


def random_model(name: str, weights_seed: int, experts_seed: int):
    """(config, model in eval mode, expert provider) of bundled config `name`."""
    key = (name, weights_seed, experts_seed)
    if key not in _BUILT:
        cfg = load_config(name)
        model = KimiLinearForCausalLM(cfg, backend=TorchBackend()).eval()
        init_random_(model, weights_seed)
        _BUILT[key] = (cfg, model, DictExpertProvider(random_experts(cfg, experts_seed)))
    return _BUILT[key]


def random_ids(cfg, n: int, seed: int) -> torch.Tensor:
    """n token ids drawn uniformly from the vocabulary. [n]"""
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


class RowDependentBackend(TorchBackend):
    """The torch backend declaring its prefill bits row-dependent, as nvrtc's cuBLAS GEMMs are:
    the prefix cache then keeps and resumes snapshots at multiples of the prefill chunk only."""

    prefill_rows_exact = False


def row_dependent(cfg, model) -> KimiLinearForCausalLM:
    """`model`'s weights on a RowDependentBackend."""
    rd = KimiLinearForCausalLM(cfg, backend=RowDependentBackend()).eval()
    rd.load_state_dict(model.state_dict())
    return rd
