"""Whole-model decode with the NVRTC backend vs the torch backend (both on CUDA, BF16 dense).

The `tiny` models (and the shipped default model) decode to the same greedy tokens
with either backend, and the NVRTC run's logits hashes are identical across 3 runs. GPU only.
"""

from __future__ import annotations

import pytest
import torch

from streamrt.checkpoint.reader import open_tree
from streamrt.checkpoint.synth import synth
from streamrt.default_model import packaged_model_dir
from streamrt.generate import generate
from streamrt.loader import load_model
from streamrt.loader import DirectExpertProvider

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _tree(which: str, tmp_path_factory):
    if which == "default":
        return open_tree(packaged_model_dir())
    root = tmp_path_factory.mktemp(which) / "tree"
    synth(which, root, fmt="streamrt", seed=0, progress=False)
    return open_tree(root)


@pytest.mark.parametrize("which", ["tiny-k3", "tiny-k3.1-pro", "default"])
def test_nvrtc_greedy_tokens_match_torch_and_hash_is_stable(which, tmp_path_factory):
    from streamrt.backends.nvrtc import NvrtcBackend

    tree = _tree(which, tmp_path_factory)
    g = torch.Generator().manual_seed(7)
    # 40 tokens: past tiny's index_topk (16), so the K3.1 Pro selection is active
    prompt = torch.randint(0, tree.config.vocab_size - 256, (40,), generator=g).tolist()
    prov = DirectExpertProvider(tree, "cuda")
    ref = generate(load_model(tree, "cuda", dtype=torch.bfloat16), prompt, provider=prov, max_new_tokens=12,
                   stop_ids=[], hash_steps=True)
    nv_model = load_model(tree, "cuda", dtype=torch.bfloat16, backend=NvrtcBackend())
    runs = [
        generate(nv_model, prompt, provider=prov, max_new_tokens=12, stop_ids=[], hash_steps=True) for _ in range(3)
    ]
    assert runs[0].tokens == ref.tokens, f"{which}: nvrtc greedy tokens {runs[0].tokens} != torch {ref.tokens}"
    for r in runs[1:]:
        assert r.prefill_hashes == runs[0].prefill_hashes and r.step_hashes == runs[0].step_hashes, \
            f"{which}: nvrtc logits_hash differs between runs"
    assert len(runs[0].step_hashes[0]) == 11  # 12 tokens: the prefill's plus 11 decode steps
