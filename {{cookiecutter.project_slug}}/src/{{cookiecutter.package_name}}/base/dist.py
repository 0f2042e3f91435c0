"""The one source of distributed truth.

Only this module reads RANK / LOCAL_RANK / WORLD_SIZE. Without torchrun (a plain
`python -m ...`) the run is a world of one: no process group, and every collective helper
below is a no-op, so the rest of the code has a single path.
"""

from __future__ import annotations

import datetime
import gc
import os
import random
import secrets
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import preemption, rendezvous
from .rules import ConfigError, tell_user

Built = TypeVar("Built")


@dataclass(frozen=True)
class DistInfo:
    rank: int  # global rank; 0 is the main process (never "local rank 0")
    local_rank: int  # index on this node; picks the device
    world_size: int
    local_world_size: int  # processes on this node; shares CPUs and GPUs
    device: torch.device
    backend: str  # nccl on CUDA, gloo on CPU; "none" for a world of one

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
        )


def device_problem(info: DistInfo) -> str | None:
    """Why this rank has no GPU of its own, or None: more processes on the node than GPUs
    would put two ranks on one GPU (out of memory, or NCCL refusing a duplicate device)."""
    if info.device.type != "cuda":
        return None
    visible = torch.cuda.device_count()
    if info.local_world_size <= visible and info.local_rank < visible:
        return None
    return (
        f"{info.local_world_size} processes on this node (local rank {info.local_rank}) but {visible} GPU(s) "
        f"visible: start at most {visible} (NPROC_PER_NODE, --nproc-per-node) or make more GPUs visible"
    )


def bind_device(info: DistInfo) -> None:
    """Make this rank's GPU the current device; call it before anything touches CUDA:
    unbound, every rank opens a context (and allocates) on GPU 0. The one place that checks a
    rank has a GPU of its own (a ConfigError naming the fix); binding again is free."""
    if info.device.type == "cuda":
        problem = device_problem(info)
        if problem:
            raise ConfigError(problem)
        torch.cuda.set_device(info.device)


def run_in_group(info: DistInfo, timeout_minutes: float, work: Callable[[], int]) -> int:
    """Join the process group, run `work()`, leave the group; returns the exit code.

    Every way out ends the same way: `work()`'s code; 2 after the one-line message of a
    ConfigError; 1 after the traceback of any other exception. The exception is handled here,
    so the failed run's frames, and the DDP model in them that holds the process group, are gone
    before `teardown` frees the group. A group still alive when Python shuts down aborts the
    process (SIGABRT, exit 1 after a finished run): a gloo worker thread that drops the last
    reference to a finished collective's tensors needs the interpreter lock, which a thread
    cannot take once Python is finalizing, and the thread's forced exit inside a C++ destructor
    calls std::terminate.
    """
    init(info, timeout_minutes)
    code, returned = run_work(info, work)
    teardown(info, orderly=returned)  # after an exception a peer may be elsewhere: no barrier then
    return code


def run_work(info: DistInfo, work: Callable[[], int]) -> tuple[int, bool]:
    """Run `work()`: (its exit code, or the one an exception ends it with; whether it returned)."""
    try:
        return work(), True
    except ConfigError as err:
        return tell_user(err), False
    except SystemExit as stop:
        return (stop.code if isinstance(stop.code, int) else 1), False
    except BaseException as err:  # KeyboardInterrupt too: the group must still go before exit
        report_failure(info, err)
        traceback.print_exc()
        return (130 if isinstance(err, KeyboardInterrupt) else 1), False


def init(info: DistInfo, timeout_minutes: float) -> None:
    """Bind this process to its own device, then join the process group."""
    bind_device(info)  # first: the process group then knows its device instead of guessing one
    preemption.forget_earlier_preemption()
    if info.distributed:
        # torch._dynamo, on import, keeps references to the torch.distributed objects of that
        # moment; imported after the group exists (DDP imports it), it would keep the group and its
        # gloo threads alive past teardown, into interpreter shutdown (see run_in_group)
        import torch._dynamo  # noqa: F401

        timeout = datetime.timedelta(minutes=timeout_minutes)
        store, _, _ = next(torch_dist.rendezvous("env://", timeout=timeout))
        prefix = rendezvous.store_prefix(os.environ)  # keys no worker of an earlier attempt wrote
        torch_dist.init_process_group(
            backend=info.backend,
            store=torch_dist.PrefixStore(prefix, store) if prefix else store,
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
            device_id=info.device if info.device.type == "cuda" else None,  # NCCL: this GPU, no guess
        )


def teardown(info: DistInfo, orderly: bool = True) -> None:
    """Leave the process group and free it, joining its threads while Python still runs.

    `orderly`: every rank got here the same way, so they wait for each other first (a fast rank
    would otherwise tear gloo down under a slow one); after a failure a peer may never arrive.
    """
    if info.distributed and torch_dist.is_initialized():
        if orderly:
            torch_dist.barrier()
        _HOST_GROUP.clear()  # a reference would keep its gloo threads past teardown (torch 2.4)
        # a gloo worker thread drops a finished collective's tensors after its peers see it done, and
        # needs the interpreter lock for that; destroy_process_group holds the lock while it joins
        # those threads (torch 2.4): wait, without the lock, until they are idle
        time.sleep(0.2)
        torch_dist.destroy_process_group()
        gc.collect()  # module graphs hold cycles: the last reference to the group goes now, not at exit


def seed_everything(seed: int) -> None:
    """Same seed on every rank, so every replica starts from the same weights."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def shared_dir_problem(info: DistInfo, directory: Path) -> str | None:
    """Why `directory` is not one directory for all ranks, or None; every rank must call it.

    Rank 0 writes checkpoints and every rank loads them to resume, so on several nodes the run
    directory must be on a filesystem all nodes share (NFS, Lustre, GPFS...), not a local disk.
    """
    if not torch_dist.is_initialized() or info.local_world_size == info.world_size:
        return None  # one node: its ranks see its disk
    token = broadcast_object(secrets.token_hex(8))
    probe = Path(directory) / f".shared-{token}"
    if info.is_main:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
    barrier()
    try:
        seen = probe.read_text() == token
    except OSError:
        seen = False
    missing = [rank for rank, ok in enumerate(all_gather_objects(seen)) if not ok]
    barrier()
    if info.is_main:
        probe.unlink(missing_ok=True)
    if not missing:
        return None
    return (
        f"run.out_dir: ranks {missing} cannot see {directory} that rank 0 wrote: on several nodes the run "
        "directory must be on a filesystem shared by all nodes (every rank loads the checkpoint to resume)"
    )


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


def gather_to_main(obj) -> list | None:
    """Every rank's `obj`, in rank order, on rank 0 (None on the others): pickled, through gloo on
    the host whatever the run's backend, so the other ranks never hold more than their own."""
    if not torch_dist.is_initialized():
        return [obj]
    gathered = [None] * torch_dist.get_world_size() if torch_dist.get_rank() == 0 else None
    torch_dist.gather_object(obj, gathered, dst=0, group=host_group())
    return gathered


_HOST_GROUP: dict = {}  # the gloo group beside an NCCL one, made once per process group


def host_group():
    """A gloo group of every rank, for objects on the host: the default group where it is gloo."""
    if torch_dist.get_backend() == "gloo":
        return None
    world = torch_dist.group.WORLD
    if world not in _HOST_GROUP:  # the first call in this process group
        _HOST_GROUP.clear()
        _HOST_GROUP[world] = torch_dist.new_group(backend="gloo")  # every rank calls it: a collective
    return _HOST_GROUP[world]


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if not torch_dist.is_initialized():
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


def local_main_first(info: DistInfo, build: Callable[[], Built]) -> Built:
    """`build()` on each node's local rank 0 first, then on the node's other ranks: what it
    downloads or writes into a cache (pretrained weights, a dataset's files) is fetched once a
    node instead of by every rank at the same moment, and the other ranks read it from the cache.

    The waiting ranks wait in a collective, so a build longer than dist.timeout_minutes times
    out. If a local rank 0's build fails, every rank stops at once: a config error is raised on
    every rank; another exception on that rank, with its traceback, and a one-line error naming
    it on the others (instead of a lost connection in the collective).
    """
    if not info.distributed or info.local_world_size == 1:
        return build()
    built, failure = None, None
    if info.local_rank == 0:
        try:
            built = build()
        except Exception as err:  # shared below, then raised: no rank is left waiting
            failure = err
    problems = [problem for problem in all_gather_objects(shareable(failure)) if problem is not None]
    if problems:  # every rank stops here: leave the group together, not each tearing gloo down under the others
        teardown(info)
    if failure is not None:
        raise failure
    if problems and isinstance(problems[0], ConfigError):
        raise problems[0]
    if problems:
        raise RuntimeError(f"a node's local rank 0 could not build the model and datasets: {problems[0]}")
    return built if info.local_rank == 0 else build()


def shareable(error: Exception | None) -> ConfigError | str | None:
    """`error` as another rank can receive it: a ConfigError as it is (it pickles), any other
    exception as its one-line summary."""
    if error is None or isinstance(error, ConfigError):
        return error
    return f"{type(error).__name__}: {error}"


def barrier() -> None:
    if torch_dist.is_initialized():
        torch_dist.barrier()


def without_ddp(model: nn.Module) -> nn.Module:
    """The module DDP wraps (compiled, if it was): calling it runs no collective. A sharded model
    (parallel.strategy=fsdp) is itself: its forward gathers parameters, so every rank must call it
    as often as the others (evaluation's padded sampler gives every rank the same batches)."""
    return model.module if isinstance(model, DDP) else model


def sharded(model: nn.Module) -> bool:
    """Whether `model` is sharded over the ranks (parallel.strategy=fsdp): its parameters are DTensor
    shards, and its whole state exists only gathered (checkpoint.full_state)."""
    return hasattr(model, "set_requires_gradient_sync")  # what every fully_shard'ed module has


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm statistics, say) on every rank; every rank must call it."""
    if torch_dist.is_initialized():
        for buffer in module.buffers():
            torch_dist.broadcast(buffer, src=0)


def print0(info: DistInfo, *args, **kwargs) -> None:
    """print on global rank 0 only."""
    if info.is_main:
        print(*args, **kwargs, flush=True)


def report_failure(info: DistInfo, error: BaseException) -> None:
    """Any rank's exception reaches the user, with the rank that raised it."""
    # one write with its newline, as in config.exit_on_user_error: the ranks' lines do not interleave
    notes = "".join(f"\n  {note}" for note in getattr(error, "__notes__", ()))  # the fix, where the loop knows it
    sys.stderr.write(f"[rank {info.rank}/{info.world_size}] {type(error).__name__}: {error}{notes}\n")
    sys.stderr.flush()
