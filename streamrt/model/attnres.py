"""AttnRes, Block Attention Residuals (spec/MODEL.md §1, §6).

Sources: the embedding, every completed block sum (blocks start at layers
`cfg.attnres_block_starts`, 0-based, every `attn_res_block_size` layers) and the running
in-block partial sum, last. The pseudo-query is the learned proj weight folded with the
norm gain; keys are weightless-RMSNorm'd sources; values are the raw sources:
    p = softmax_i( RMSNorm(v_i) . (norm.weight * proj.weight) );  out = sum_i p_i v_i
Axis legend: N rows, D hidden, nb completed sources.
"""

from __future__ import annotations

from torch import Tensor, nn

from streamrt.model.layers import RMSNorm


def attn_res(
    partial: Tensor, blocks: list[Tensor], proj: nn.Linear, norm: RMSNorm, be, then: RMSNorm | None = None
) -> Tensor:
    """partial [N, D], blocks nb x [N, D] -> the depth mix [N, D] fp32, or `then`(mix) (the
    layer's next norm, in the same backend op)."""
    if then is None:
        return be.attnres_mix(partial, blocks, norm.weight, proj.weight[0], norm.eps)  # [N, D]
    return be.attnres_mix(partial, blocks, norm.weight, proj.weight[0], norm.eps, then.weight, then.eps)
