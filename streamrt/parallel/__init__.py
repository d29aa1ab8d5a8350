"""Expert parallelism: one process per GPU, routed experts sharded over the ranks.

    owners = ExpertOwners.for_config(cfg, world)          # ExpertKey -> rank (owners.py)
    model = KimiLinearForCausalLM(cfg, backend=ExpertParallelBackend(TorchBackend(), group, rank=r))
    logits = run_sync(shard(model.forward_steps(ids, cache), owners, r), provider)  # or rt.run(shard(...))

`shard` (shard.py) passes on only this rank's experts, so its provider or streaming runtime
moves only its shard; `ExpertParallelBackend` (backend.py) computes this rank's (row, slot)
pairs and sums them over the ranks in one all-reduce, bit-identical to one process for any
number of ranks. `group.py`: the process group (NCCL, gloo on CPU), torchrun or spawned
ranks, collective timeouts and the one-line exit. `launch.py`: `python -m streamrt.parallel`.
"""

from streamrt.parallel.backend import ExpertParallelBackend
from streamrt.parallel.owners import ExpertOwners
from streamrt.parallel.shard import Remote, ShardExperts, ShardPredictor, shard

__all__ = ["ExpertOwners", "ExpertParallelBackend", "Remote", "ShardExperts", "ShardPredictor", "shard"]
