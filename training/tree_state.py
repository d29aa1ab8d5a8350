"""A training state (fp32, float experts) rebuilt from a converted streamrt tree.

The shipped default model is a converted tree: BF16 dense tensors and NVFP4 routed experts.
A continuation run starts from exactly the weights inference uses: the dense tensors as
stored (BF16 values widened to fp32) and each expert's NVFP4 matrices decoded to fp32.
The result loads into `KimiLinearForCausalLM(cfg, float_experts=True)` (`train_small.py
--init-state TREE_DIR`)."""

from __future__ import annotations

from pathlib import Path

import torch

from streamrt.checkpoint.reader import open_tree
from streamrt.fp4 import nvfp4_dequant


def _decode(m) -> torch.Tensor:
    return torch.from_numpy(nvfp4_dequant(m.packed.numpy(), m.scales.numpy(), m.global_scale.numpy()).copy())


def state_from_tree(root: Path) -> dict[str, torch.Tensor]:
    """{name: fp32 tensor} for every parameter and buffer the float-expert model holds."""
    tree = open_tree(root)
    cfg = tree.config
    sd = {k: v.float().clone() for k, v in tree.dense_state_dict().items()}
    for layer in range(cfg.num_layers):
        if not cfg.is_moe(layer):
            continue
        for e in range(cfg.num_experts):
            ew = tree.load_expert(layer, e)
            pre = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
            sd[pre + "w1.weight"] = _decode(ew.gate)
            sd[pre + "w3.weight"] = _decode(ew.up)
            sd[pre + "w2.weight"] = _decode(ew.down)
    return sd
