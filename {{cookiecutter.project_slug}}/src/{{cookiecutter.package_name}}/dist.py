"""The one source of distributed truth.

Only this module reads RANK / LOCAL_RANK / WORLD_SIZE. Without torchrun (a plain
`python -m ...`) the run is a world of one: no process group, and every collective helper
below is a no-op, so the rest of the code has a single path.
"""

from __future__ import annotations

import datetime
import os
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as torch_dist


@dataclass(frozen=True)
class DistInfo:
    rank: int  # global rank; 0 is the main process (never "local rank 0")
    local_rank: int  # index on this node; picks the device
    world_size: int
    local_world_size: int  # processes on this node; shares CPUs and GPUs
    device: torch.device
    backend: str  # nccl on CUDA, gloo on CPU; "none" for a world of one
    restart: int = 0  # how often torchrun has restarted the workers (--max-restarts)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> DistInfo:
        """What torchrun told this process; a world of one when it did not launch it."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available()
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            device=torch.device("cuda", local_rank) if cuda else torch.device("cpu"),
            # gloo on GPUs bounces every gradient through host memory: nccl or nothing there
            backend=("nccl" if cuda else "gloo") if world_size > 1 else "none",
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )


def init(info: DistInfo, timeout_minutes: float) -> None:
    """Join the process group and bind this process to its own device (P1-P4)."""
    if info.distributed:
        timeout = datetime.timedelta(minutes=timeout_minutes)
        store, _, _ = next(torch_dist.rendezvous("env://", timeout=timeout))
        # torchrun keeps its store across restarts; a fresh prefix per attempt stops restarted
        # workers from reading the addresses their dead predecessors published
        store = torch_dist.PrefixStore(f"attempt{info.restart}/", store)
        torch_dist.init_process_group(
            backend=info.backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout
        )
    if info.device.type == "cuda":
        # right after init: without it every rank allocates on GPU 0
        torch.cuda.set_device(info.device)


def teardown(info: DistInfo) -> None:
    if info.distributed and torch_dist.is_initialized():
        # without this barrier a fast rank can tear gloo down under a slow one
        torch_dist.barrier()
        torch_dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Same seed on every rank, so every replica starts from the same weights (P5)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def cpus_available() -> int:
    """CPUs this process may run on (respects taskset, cgroups cpusets and SLURM binding)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks in place; every rank must call it (never inside `if rank == 0`)."""
    if torch_dist.is_initialized():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    if torch_dist.is_initialized():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
    return tensor


def all_gather_objects(obj) -> list:
    if not torch_dist.is_initialized():
        return [obj]
    gathered = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if not torch_dist.is_initialized():
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if torch_dist.is_initialized():
        torch_dist.barrier()


def print0(info: DistInfo, *args, **kwargs) -> None:
    """print on global rank 0 only (P24)."""
    if info.is_main:
        print(*args, **kwargs, flush=True)


def report_failure(info: DistInfo, error: BaseException) -> None:
    """Any rank's exception reaches the user, with the rank that raised it."""
    print(f"[rank {info.rank}/{info.world_size}] {type(error).__name__}: {error}", file=sys.stderr, flush=True)
