"""The model behind the server: a tree loaded as `streamrt run` loads it, with the
StreamingRuntime sized for the whole decode batch (`batch=max_batch`: one layer request of
B rows needs up to B x top-k device slots).

One call per step boundary, awaited on the runtime's own loop (the server's loop):
  step(last, cache, prefills) -> (logits [B, V] fp32, one new token per running row, or None
                                  without rows; [logits [V] fp32 of each prefill's last position])
  prefills: (ids, 1-row cache) pairs, a whole prompt or its next chunk each.
The decode step and the prefills are the forwards `streamrt.generate.generate` runs, driven in
lockstep (`model/lockstep.py`) so each layer's experts are fetched once for all of them; each
keeps its own rows and arithmetic, so a row's greedy tokens equal `streamrt run`'s for the same
prompt whatever shares the step (decode ops are row-wise).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from streamrt.model import ModelCache
from streamrt.model.lockstep import lockstep


class ModelRunner:
    def __init__(self, model_dir: Path, args: argparse.Namespace, *, max_batch: int):
        from streamrt.chat import ChatProfile
        from streamrt.checkpoint.reader import open_tree
        from streamrt.loader import load_placed
        from streamrt.runtime.options import RuntimeOptions
        from streamrt.runtime.scheduler import StreamingRuntime
        from streamrt.runtime.streams import make_device
        from streamrt.tokenizer import load_tokenizer
        from streamrt.trace import make_tracer

        self.options = RuntimeOptions.from_args(args)
        tree = open_tree(model_dir)
        tree.check_side_files()
        self.name = tree.config.name
        self.chat = ChatProfile.from_tree(tree.root)  # the framing the model was trained with
        self.tokenizer = load_tokenizer(tree.root, tree.config.vocab_size, tree.config.eos_token_id)
        device = make_device(self.options.device)
        self.tracer = make_tracer(bool(self.options.trace))
        self.model, plan = load_placed(tree, device, gpu_mem=self.options.gpu_mem, batch=max_batch,
                                       backend=self.options.make_backend(device), tracer=self.tracer)
        self.options = self.options.with_plan(plan)
        self.runtime = StreamingRuntime(tree, self.model, self.options, device=device, tracer=self.tracer,
                                        batch=max_batch)
        self.max_context = tree.config.max_position_embeddings
        self._device = self.model.lm_head.weight.device
        self.prefix = self.options.make_prefix_cache()  # the engine's prefix cache (--prefix-cache-mem)

    @property
    def loop(self):
        return self.runtime.loop

    @property
    def stats(self):
        return self.runtime.stats

    @property
    def device(self):
        return self._device

    @property
    def prefill_stride(self) -> int:
        """Tokens per prefill chunk of a whole-prompt piece: the model's own chunking."""
        return self.model.prefill_chunk_tokens(None, self._device)

    @property
    def prefill_rows_exact(self) -> bool:
        """The backend computes a prefill row's bits whatever the rows beside it (prefix_cache.py)."""
        return getattr(self.model.backend, "prefill_rows_exact", True)

    def new_cache(self) -> ModelCache:
        return self.model.new_cache(1, self._device)

    async def step(self, last: list[int], cache: ModelCache | None, prefills: list[tuple[list[int], ModelCache]]):
        with torch.no_grad():
            gens = []
            if last:
                x = torch.tensor([[t] for t in last], device=self._device)  # [B, 1]
                gens.append(self.model.forward_steps(x, cache))
            for ids, row_cache in prefills:
                x = torch.tensor([ids], device=self._device)  # [1, T]
                gens.append(self.model.forward_steps(x, row_cache, last_only=True))
            out = await self.runtime.decode_step(lockstep(gens), tokens=len(last))
        decoded = out.pop(0)[:, 0].float() if last else None  # [B, V]
        return decoded, [logits[0, 0].float() for logits in out]

    def close(self) -> None:
        self.runtime.finish()
