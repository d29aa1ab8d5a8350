"""`ExpertParallelBackend`: the routed-expert sum over ranks, bit-identical to one process.

Every op is the inner backend's except `expert_ffn`. There, with `experts` a `ShardExperts`
(parallel/shard.py), each rank computes the (row, slot) pairs whose expert it owns and the
ranks' pairs meet in one all-reduce. Axis legend: T rows, k slots, Dl routed width, P the
pairs this rank owns.

    pairs (t, j) with ids[t, j] owned, row-major      # every expert's rows ascending, as alone
    y = inner.expert_ffn(z[t], ids[t, j][:, None], 1)  # [P, Dl]  k = 1, weight 1: y = E(z) exactly
    c = -0.0  [T, k, Dl];  c[t, j] = y * w[t, j]      # the inner combine's own products
    all_reduce(c, SUM)                                # one owner per pair, -0.0 elsewhere
    out = c[:, 0] + c[:, 1] + ... + c[:, k-1]         # j ascending, the inner combine's order

Why it is exact: each expert sees the same rows in the same order as in the single-process
call (its buffers have the same shapes, so even a vector path's tail falls where it fell);
a product and a sum of IEEE floats are correctly rounded wherever they run; and -0.0 is the
exact identity of IEEE addition (-0 + x = x for every x, -0 and +0 included), so the
all-reduce returns each pair's value bit for bit whatever the reduction order or algorithm
(gloo's, NCCL's ring or tree). The combine is that of `TorchBackend.expert_ffn` and the
NVRTC `srt_moe_combine` kernel (`__fmul_rn`, then `__fadd_rn` with j ascending, no FMA).
The traffic is T * k * Dl * 4 bytes per MoE layer (k times a reduced [T, Dl]): 8 slots of
K3.1 Pro's latent width at decode is a few tens of KB.

Every call all-reduces (the ranks meet once per MoE layer, whatever their shard holds). The
same all-reduce sums how many pairs each rank computed, one float more; the next call checks
that the ranks computed every pair exactly once (a forward not driven through `shard` would be
summed N times), so the check costs no device synchronize.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from streamrt.errors import StreamrtError, clip
from streamrt.expert_weights import RoutedExperts, as_routed


class ExpertParallelBackend:
    def __init__(self, inner, group=None, *, rank: int = 0, timeout: timedelta | None = None) -> None:
        self.inner, self.group, self.rank, self.timeout = inner, group, rank, timeout
        self.name = f"{getattr(inner, 'name', 'backend')}+ep"
        self._pairs = [0]  # (row, slot) pairs this rank computed, prefill view included (its load)
        self._prefill: ExpertParallelBackend | None = None
        self._count: tuple | None = None  # (pairs summed over ranks [1], expected, layer) of the last call

    def __getattr__(self, name: str):  # every other op is the inner backend's
        return getattr(self.inner, name)

    @property
    def pairs(self) -> int:
        return self._pairs[0]

    def for_prefill(self) -> "ExpertParallelBackend":
        """The inner backend's prefill view, wrapped the same way (made once)."""
        if not hasattr(self.inner, "for_prefill"):
            return self
        if self._prefill is None:
            self._prefill = ExpertParallelBackend(
                self.inner.for_prefill(), self.group, rank=self.rank, timeout=self.timeout
            )
            self._prefill._pairs = self._pairs
        return self._prefill

    def expert_ffn(self, z: Tensor, ids: Tensor, weights: Tensor, experts: RoutedExperts, beta: float,
                   linear_beta: float | None) -> Tensor:
        self._check_count()
        experts = as_routed(experts, ids)  # the model passes the shard's answer and its host ids: no transfer
        host = experts.host_ids
        T, k = host.shape
        Dl = z.shape[-1]
        mask = torch.tensor([[experts.is_local(e) for e in row] for row in host.tolist()], dtype=torch.bool).reshape(
            T, k
        )
        t, j = mask.nonzero(as_tuple=True)  # [P] each, row-major
        buf = torch.full((T * k * Dl + 1,), -0.0, dtype=torch.float32, device=z.device)
        c = buf[:-1].view(T, k, Dl)  # [T, k, Dl]; buf[-1]: how many pairs this rank computed
        if t.numel():
            pid = host[t, j][:, None]  # [P, 1]
            one = torch.ones(pid.shape, dtype=torch.float32, device=z.device)
            y = self.inner.expert_ffn(z[t.to(z.device)], pid, one, experts.with_ids(pid), beta, linear_beta)  # [P, Dl]
            td, jd = t.to(z.device), j.to(z.device)
            c[td, jd] = y * weights.float()[td, jd][:, None]
            buf[-1] = float(t.numel())
            self._pairs[0] += t.numel()
        layer = experts.layer
        self._all_reduce(buf, layer)
        self._count = (buf[-1:], T * k, layer)  # checked at the next call: reading it now would sync the device
        acc = c[:, 0]
        for s in range(1, k):
            acc = acc + c[:, s]
        return acc  # [T, Dl]

    def _check_count(self) -> None:
        """Every (row, slot) pair of the previous layer was computed by exactly one rank (a
        forward not driven through `shard` would be summed once per rank)."""
        if self._count is None:
            return
        got, want, layer = self._count
        self._count = None
        if int(got.item()) != want:
            raise StreamrtError(f"rank {self.rank}: layer {layer}: the ranks computed {int(got.item())} expert pairs "
                                f"of {want}; drive the forward through streamrt.parallel.shard on every rank")

    def _all_reduce(self, c: Tensor, layer: int) -> None:
        try:
            dist.all_reduce(c, op=dist.ReduceOp.SUM, group=self.group)
        except RuntimeError as exc:  # DistBackendError, a peer gone, or the collective timed out
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            limit = (
                f" (collectives time out after {self.timeout.total_seconds():g} s)" if self.timeout is not None else ""
            )
            raise StreamrtError(
                f"rank {self.rank}: expert all-reduce of layer {layer} failed{limit}: another rank died "
                f"or stopped answering: {clip(first, 200)}"
            ) from None
