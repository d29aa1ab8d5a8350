"""Greedy generation with experts sharded over ranks: `python -m streamrt.parallel --gpus N`.

    python -m streamrt.parallel --gpus 2 --model tiny-k3.1-pro --prompt "hello" --max-new-tokens 8
    torchrun --nproc-per-node 2 -m streamrt.parallel --model default --prompt "hello"

Each rank holds the whole dense model (replicated) and only its shard of the experts
(`ExpertOwners`), computes its (row, slot) pairs and meets the others in one all-reduce
per MoE layer (`ExpertParallelBackend`); rank 0 prints the token ids and each step's
logits hash (the same for any --gpus). `--model tiny-k3.1-pro` (or any bundled config
name) is random weights from `--seed`; `default` is the embedded default model's tree.

`generate_on(job, rank, world, group)` is the part a `streamrt run --gpus N` reuses.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

from streamrt.backends.torch_backend import TorchBackend
from streamrt.errors import StreamrtError
from streamrt.expert_weights import ExpertWeights, NVFP4Matrix
from streamrt.generate import GenerationResult, generate
from streamrt.loader import DictExpertProvider, DirectExpertProvider, load_model
from streamrt.model import KimiLinearForCausalLM, run_sync
from streamrt.parallel.group import DEFAULT_TIMEOUT_S, Ranks, exit_one_line, init_group, spawn
from streamrt.parallel.owners import ExpertOwners
from streamrt.parallel.rank import ExpertParallel
from streamrt.parallel.shard import shard


@dataclass(frozen=True)
class Job:
    """What every rank generates (picklable: it crosses the spawn)."""

    model: str = "tiny-k3.1-pro"  # a bundled config name (random weights) or "default"
    prompt: tuple[int, ...] | str = "hello"
    max_new_tokens: int = 8
    seed: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S


def rank_model(job: Job, rank: int, world: int, group, device: torch.device | str = "cpu"):
    """(model on an ExpertParallelBackend over the formed process `group`, this rank's expert
    provider, the owners, the prompt ids)."""
    ranks = Ranks(rank, world, rank, "", 0)
    device = torch.device(device)
    if job.model == "default":
        from streamrt.checkpoint.reader import open_tree
        from streamrt.default_model import default_model_dir
        from streamrt.tokenizer import load_tokenizer

        tree = open_tree(default_model_dir(notice=lambda line: print(line, file=sys.stderr) if rank == 0 else None))
        ep = ExpertParallel.join(ranks, tree.config, device, job.timeout_s, group)
        model = load_model(tree, device, dtype=None, backend=ep.wrap(TorchBackend()))
        tok = load_tokenizer(tree.root, tree.config.vocab_size, tree.config.eos_token_id)
        prompt = tok.encode(job.prompt) if isinstance(job.prompt, str) else list(job.prompt)
        return model, DirectExpertProvider(tree, device), ep.owners, prompt
    from streamrt.config import load_config
    from streamrt.model.synthetic import init_random_, random_experts

    cfg = load_config(job.model)
    ep = ExpertParallel.join(ranks, cfg, device, job.timeout_s, group)
    model = KimiLinearForCausalLM(cfg, backend=ep.wrap(TorchBackend())).eval().requires_grad_(False)
    init_random_(model, job.seed)
    model = model.to(device)
    mine = {
        key: _moved(ew, device)
        for key, ew in random_experts(cfg, job.seed + 1).items()
        if ep.owners.rank_of(*key) == rank
    }
    prompt = list(job.prompt.encode()) if isinstance(job.prompt, str) else list(job.prompt)  # byte ids
    return model, DictExpertProvider(mine, record=True), ep.owners, prompt


def _moved(ew: ExpertWeights, device) -> ExpertWeights:
    mv = lambda m: NVFP4Matrix(m.packed.to(device), m.scales.to(device), m.global_scale.to(device))  # noqa: E731
    return ExpertWeights(mv(ew.gate), mv(ew.up), mv(ew.down))


def generate_on(job: Job, rank: int, world: int, group, device: torch.device | str = "cpu",
                *, built=None) -> GenerationResult:
    """Greedy generation of `job` as rank `rank` of `world` over the formed process `group`."""
    model, provider, owners, prompt = built or rank_model(job, rank, world, group, device)
    runner = lambda gen: run_sync(shard(gen, owners, rank), provider)  # noqa: E731
    return generate(model, prompt, runner=runner, max_new_tokens=job.max_new_tokens, hash_steps=True)


def rank_main(rank: int, world: int, addr: str, port: int, job: Job, local_rank: int | None = None) -> None:
    """One rank's process: join the group, generate, rank 0 prints; one line on an error."""
    ranks = Ranks(rank, world, rank if local_rank is None else local_rank, addr, port)

    def work() -> None:
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
        device = ranks.device()
        group = init_group(ranks, job.timeout_s, device)
        res = generate_on(job, rank, world, group, device)
        if rank == 0:
            print(" ".join(str(t) for t in res.tokens[0]))
            print("logits hashes (prefill, steps): " + " ".join(res.prefill_hashes[:1] + res.step_hashes[0]))

    exit_one_line(work, rank)


def launch(job: Job, gpus: int) -> int:
    """Under torchrun: this process is one rank. Else `gpus` local processes. Exit status 0 or
    the first failing rank's (2 for a StreamrtError)."""
    ranks = Ranks.from_env()
    if ranks is not None:
        rank_main(ranks.rank, ranks.world, ranks.addr, ranks.port, job, ranks.local_rank)
        return 0
    if job.model != "default":  # refused before any process starts
        from streamrt.config import load_config

        ExpertOwners.for_config(load_config(job.model), gpus)
    codes = spawn(rank_main, gpus, (job,), timeout_s=job.timeout_s)
    return next((c if c > 0 else 2 for c in codes if c != 0), 0)


def check_gpus(text) -> int:
    """--gpus N: an integer >= 1, not more than the GPUs here (without GPUs the ranks are CPU
    processes: not more than max(8, cores))."""
    try:
        n = int(str(text).strip())
    except ValueError:
        raise StreamrtError(f"--gpus: expected a process count, got {str(text)[:40]!r}") from None
    if n < 1:
        raise StreamrtError(f"--gpus must be >= 1, got {n}")
    if torch.cuda.is_available() and n > torch.cuda.device_count():
        raise StreamrtError(f"--gpus {n}: this machine has {torch.cuda.device_count()} GPUs")
    cores = os.cpu_count() or 1
    if not torch.cuda.is_available() and n > max(8, cores):
        raise StreamrtError(f"--gpus {n}: no GPU here, so each rank is a CPU process: at most {max(8, cores)} "
                            f"(this machine has {cores} cores)")
    return n


def run_ranks(command, args, gpus: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """`streamrt run --gpus N` outside torchrun: N local ranks, each running command(args) with
    torchrun's environment set (so the command finds its rank the one way); rank 0's stdout is
    the output, the others' goes nowhere. The exit status is 0 or the first failing rank's."""
    codes = spawn(_command_rank, gpus, (command, args), timeout_s=timeout_s)
    return next((c if c > 0 else 2 for c in codes if c != 0), 0)


def _command_rank(rank: int, world: int, addr: str, port: int, command, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR=addr,
                      MASTER_PORT=str(port))
    if rank:  # rank 0 speaks for all; the others' errors still reach the terminal (exit_one_line)
        sys.stdout = sys.stderr = open(os.devnull, "w")
    code = [0]

    def work() -> None:
        code[0] = command(args) or 0

    exit_one_line(work, rank)
    sys.stdout.flush()
    os._exit(code[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streamrt.parallel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="2", help="ranks to spawn (ignored under torchrun)")
    ap.add_argument("--model", default="tiny-k3.1-pro", help="bundled config name (random weights) or 'default'")
    ap.add_argument("--prompt", default="hello")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds a collective waits")
    args = ap.parse_args(argv)
    job = Job(args.model, args.prompt, args.max_new_tokens, args.seed, args.timeout)
    try:
        return launch(job, check_gpus(args.gpus))
    except StreamrtError as exc:
        print(f"streamrt: {exc}", file=sys.stderr)
        return exc.exit_code
