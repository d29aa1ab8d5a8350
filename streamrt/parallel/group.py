"""The ranks: one process per GPU on torch.distributed (NCCL; gloo on CPU), and how they end.

    ranks = Ranks.from_env() or None       # launched by torchrun: RANK, WORLD_SIZE, LOCAL_RANK,
                                           # MASTER_ADDR, MASTER_PORT
    spawn(entry, world, args)              # else: `world` local processes, a free port;
                                           # entry(rank, world, addr, port, *args)
    group = init_group(ranks, timeout_s)   # the process group; every collective times out
    exit_one_line(fn)                      # a StreamrtError on a rank: one stderr line, exit 2

Every collective runs under the group's timeout: a rank that dies makes the others' next
collective fail (at once when its sockets close, else after the timeout), and each of them
exits with `streamrt: rank R: ...` and status 2 instead of hanging. `spawn` waits for every
rank (the others are not killed when one fails: their own line says what they saw), and
terminates one still running a grace period after the timeout.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from streamrt.errors import StreamrtError, clip

DEFAULT_TIMEOUT_S = 120.0  # a collective waits this long for the slowest rank (a cold expert read included)


@dataclass(frozen=True)
class Ranks:
    """This process's place: rank, world size, local rank (its GPU), the rendezvous address."""

    rank: int
    world: int
    local_rank: int
    addr: str
    port: int

    @classmethod
    def from_env(cls) -> "Ranks | None":
        """torchrun's environment, or None when it is not set."""
        env = os.environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        try:
            return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])),
                       env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")))
        except ValueError as exc:
            raise StreamrtError(f"torchrun environment: {clip(str(exc))}") from None

    def device(self) -> torch.device:
        """cuda:LOCAL_RANK where there are GPUs, else the CPU."""
        if torch.cuda.is_available():
            if self.local_rank >= torch.cuda.device_count():
                raise StreamrtError(
                    f"rank {self.rank}: local rank {self.local_rank} but {torch.cuda.device_count()} GPUs"
                )
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(ranks: Ranks, timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | None = None):
    """The default process group (NCCL for a CUDA device, else gloo), every collective under
    `timeout_s`; returns it."""
    device = device or ranks.device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, init_method=f"tcp://{ranks.addr}:{ranks.port}", rank=ranks.rank,
                                world_size=ranks.world, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as exc:  # DistStoreError: a rank never joined
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise StreamrtError(f"rank {ranks.rank}: the {ranks.world} ranks did not meet at {ranks.addr}:{ranks.port} "
                            f"within {timeout_s:g} s ({clip(first, 200)})") from None
    return dist.group.WORLD


def exit_one_line(fn: Callable[[], int | None], rank: int) -> None:
    """Run a rank's work; a StreamrtError ends the process with one line on stderr and its
    exit code, without the interpreter's teardown (a process group whose peer is gone may
    block there). Success destroys the group and returns."""
    try:
        fn()
    except StreamrtError as exc:
        msg = str(exc)
        line = f"streamrt: {msg if msg.startswith(f'rank {rank}') else f'rank {rank}: {msg}'}"
        print(line, file=sys.__stderr__, flush=True)  # a rank's sys.stderr may be silenced, not its errors
        sys.stdout.flush()
        os._exit(exc.exit_code)
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(entry: Callable, world: int, args: tuple = (), timeout_s: float = DEFAULT_TIMEOUT_S,
          grace_s: float = 30.0) -> list[int]:
    """`world` local processes running entry(rank, world, "127.0.0.1", port, *args); waits
    for all of them and returns their exit codes (rank order). A rank still running
    `timeout_s + grace_s` after another failed is terminated (its code is then negative)."""
    port = free_port()
    ctx = mp.start_processes(
        entry, args=(world, "127.0.0.1", port, *args), nprocs=world, join=False, start_method="spawn"
    )
    procs, failed_at = ctx.processes, None
    while any(p.is_alive() for p in procs):
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > timeout_s + grace_s:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            break
        time.sleep(0.05)
    for i, p in enumerate(procs):
        p.join()
        if p.exitcode == 1 and not ctx.error_queues[i].empty():  # an exception, not a StreamrtError: show it
            print(f"streamrt: rank {i} failed:\n{ctx.error_queues[i].get()}", file=sys.stderr, end="")
    return [p.exitcode for p in procs]
