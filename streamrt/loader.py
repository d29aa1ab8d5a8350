"""Loading a converted tree into the torch model, and expert providers.

The composition room: a tree (checkpoint/), the model (model/) and a backend (backends/;
the torch reference unless the caller passes another). gpt-fast `_load_model`: build on the meta
device, then `load_state_dict(assign=True)` with the tree's (mmap'd) tensors, so nothing is
materialised twice. The names must match exactly; the K3 / K3.1 Pro mismatch in either direction
gets its own message.

With a placement plan (plan/placement.py) whose streamed layers are not empty, those layers' dense
weights go to page-locked host memory and stream through device buffers
(runtime/dense_stream.py); the embedding table stays on the host too. Same arithmetic, same bits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor

from streamrt.backends.torch_backend import TorchBackend
from streamrt.checkpoint.names import RELEASED_F32
from streamrt.errors import CheckpointError
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix, RoutedExperts, unique_ids
from streamrt.model.model import KimiLinearForCausalLM
from streamrt.model.moe import ExpertRequest
from streamrt.plan.placement import Placement, plan_placement

# The tensors the release stores as F32 stay fp32 whatever `dtype` asks: the reference ports
# run them in fp32 modules.
FP32_TENSORS = RELEASED_F32


def check_state_dict(model: KimiLinearForCausalLM, sd: Mapping[str, Tensor], source: str = "checkpoint") -> None:
    """Names and shapes of sd must equal the model's; CheckpointError naming what differs."""
    cfg = model.config
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(want) - set(sd))
    extra = sorted(set(sd) - set(want))
    idx_missing = [k for k in missing if ".self_attn.indexer." in k]
    idx_extra = [k for k in extra if ".self_attn.indexer." in k]
    if idx_missing:
        raise CheckpointError(
            f"{source}: config is {cfg.variant} but {len(idx_missing)} Lightning Indexer tensors are missing "
            f"(e.g. {idx_missing[0]}): these look like K3 weights, which cannot run as K3.1 Pro"
        )
    if idx_extra:
        raise CheckpointError(
            f"{source}: config is {cfg.variant} but the weights carry {len(idx_extra)} Lightning Indexer tensors "
            f"(e.g. {idx_extra[0]}): a K3.1 Pro checkpoint cannot run as K3"
        )
    if missing:
        raise CheckpointError(f"{source}: {len(missing)} tensors missing, e.g. {', '.join(missing[:3])}")
    if extra:
        raise CheckpointError(f"{source}: {len(extra)} unexpected tensors, e.g. {', '.join(extra[:3])}")
    for k, shape in want.items():
        if tuple(sd[k].shape) != shape:
            raise CheckpointError(f"{source}: tensor {k} has shape {list(sd[k].shape)}, expected {list(shape)}")


def load_weights(
    model: KimiLinearForCausalLM, sd: Mapping[str, Tensor], *, dtype: torch.dtype | None = None,
    source: str = "checkpoint",
) -> KimiLinearForCausalLM:
    """Check and assign a dense state dict (tree names minus `language_model.`).

    dtype: cast floating tensors (not FP32_TENSORS, which stay fp32); None keeps them.
    """
    if model.config.tie_word_embeddings and "model.embed_tokens.weight" in sd:  # the tree stores the table once
        sd = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]}
    check_state_dict(model, sd, source)
    cast = {}
    for k, v in sd.items():
        if v.is_floating_point():
            keep32 = any(k.endswith(s) for s in FP32_TENSORS)
            v = v.float() if keep32 else (v.to(dtype) if dtype is not None else v)
        cast[k] = v
    model.load_state_dict(cast, strict=True, assign=True)  # A_log padding checked by a post-hook
    if model.config.tie_word_embeddings:  # assign=True gave each name its own parameter: one again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'auto' (or None) -> cuda when available, else cpu."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(
    tree_or_path, device: str | torch.device = "cpu", dtype: torch.dtype | None = torch.bfloat16, backend=None, *,
    placement: Placement | None = None, runtime_device=None, tracer=None,
) -> KimiLinearForCausalLM:
    """A ready-to-run model from a converted tree (an opened tree or its path).

    device may be 'auto'. Dense tensors as loaded, cast to `dtype` (None: keep); experts stay in the tree
    (pair the model with `DirectExpertProvider(tree)` or the store). `placement`: the plan's streamed
    layers stream (`model.layer_weights` is their `DenseStream`) on the copy stream of `runtime_device`
    (the runtime's streams.Device, so dense and expert copies share one queue; default: a new one).
    """
    tree = tree_or_path
    if isinstance(tree_or_path, (str, Path)):
        from streamrt.checkpoint.reader import open_tree

        tree = open_tree(tree_or_path)
    with torch.device("meta"):
        model = KimiLinearForCausalLM(tree.config, backend=backend or TorchBackend())
    load_weights(model, tree.dense_state_dict(), dtype=dtype, source=str(getattr(tree, "root", "tree")))
    target = resolve_device(device)
    if placement is not None and placement.streamed_layers:
        stream_dense(model, placement, runtime_device or _runtime_device(target), tracer=tracer)
        embed = model.model.embed_tokens  # stays on the host: one row per token is gathered there
        model.model.embed_tokens = None
        model = model.to(target)  # (a tied lm_head moves the shared table with it)
        model.model.embed_tokens = embed
    else:
        model = model.to(target)
    return model.eval().requires_grad_(False)


def stream_dense(model: KimiLinearForCausalLM, placement: Placement, device, *, tracer=None):
    """Stream the plan's layers of a loaded model (weights still on the host) through
    `placement.buffers` buffers on `device` (a streams.Device): the model's `layer_weights`."""
    from streamrt.runtime.dense_stream import DenseStream

    model.layer_weights = DenseStream(
        model, placement.streamed_layers, device, buffers=placement.buffers, tracer=tracer
    )
    return model.layer_weights


def _runtime_device(target: torch.device):
    from streamrt.runtime.streams import CpuDevice, CudaDevice

    return CudaDevice(target.index) if target.type == "cuda" else CpuDevice()


def load_placed(
    tree, device, *, gpu_mem: int | None = None, buffers: int = 2, batch: int = 1, context: int = 4096,
    dtype: torch.dtype | None = torch.bfloat16, backend=None, tracer=None,
) -> tuple[KimiLinearForCausalLM, Placement | None]:
    """A model placed on `device` (the runtime's streams.Device) by the plan `dense_placement`
    makes: (model, plan); plan None when everything is resident without one. Give the runtime the
    plan's `expert_slots` and this same `device`, so dense and expert copies share one queue."""
    plan = dense_placement(tree.config, gpu_mem, device, context=context, buffers=buffers, batch=batch)
    model = load_model(tree, device.torch_device, dtype=dtype, backend=backend, placement=plan, runtime_device=device,
                       tracer=tracer)
    return model, plan


def dense_placement(
    cfg, gpu_mem: int | None, device, *, context: int = 4096, buffers: int = 2, batch: int = 1,
) -> Placement | None:
    """The placement plan for a run: from `gpu_mem` (`--gpu-mem`, the card's budget) when given;
    else, on a CUDA device (a streams.Device), from its free memory, and only when some layers must
    stream there (None: everything resident, as without a plan). StreamrtError, one line naming
    the shortfall, when even the working buffers do not fit."""
    if gpu_mem is None:
        free = device.free_bytes() if device.kind == "cuda" else None
        if free is None:
            return None
        p = plan_placement(cfg, free, context=context, buffers=buffers, batch=batch)
        return p if p.streamed_layers else None
    return plan_placement(cfg, gpu_mem, context=context, buffers=buffers, batch=batch)


def _to(ew: ExpertWeights, device) -> ExpertWeights:
    mv = lambda m: NVFP4Matrix(m.packed.to(device), m.scales.to(device), m.global_scale.to(device))  # noqa: E731
    return ExpertWeights(mv(ew.gate), mv(ew.up), mv(ew.down))


class DirectExpertProvider:
    """Reads each requested expert straight from the tree (`tree.load_expert`), no store.

    The simplest correct provider: CI, tests, and the reference for the store's answers.
    """

    def __init__(self, tree, device: str | torch.device | None = None):
        self.tree, self.device = tree, None if device is None else resolve_device(device)
        self.loads = 0

    def __call__(self, req: ExpertRequest) -> RoutedExperts:
        return _answer(req, self._load)

    def _load(self, layer: int, e: int) -> ExpertWeights:
        ew = self.tree.load_expert(layer, e)
        self.loads += 1
        return _to(ew, self.device) if self.device is not None else ew


class DictExpertProvider:
    """Experts from an in-memory mapping {(layer, expert): ExpertWeights} (tests, synthetic models)."""

    def __init__(self, experts: Mapping[tuple[int, int], ExpertWeights], record: bool = False):
        self.experts, self.record = experts, record
        self.requests: list[ExpertRequest] = []  # filled when record is True

    def __call__(self, req: ExpertRequest) -> RoutedExperts:
        if self.record:
            self.requests.append(req)
        return _answer(req, lambda layer, e: self.experts[(layer, e)])


def _answer(req: ExpertRequest, weights_of) -> RoutedExperts:
    """The answer to req: each routed expert once, `weights_of(layer, e)`; the ids come to the
    host here, once."""
    host = req.ids.cpu()
    unique = unique_ids(host)
    return RoutedExperts({e: weights_of(req.layer, e) for e in unique}, host, unique, req.layer)
