"""The run's datasets, samplers and loaders, with per-rank worker sizing, for any map-style datasets.

Nothing here knows the task: the datasets come from the seam (`build_datasets`, or a pack through
`from_records`), and the batches are what the task's `collate` makes of a list of samples (torch's
default_collate when it has none).
"""

from __future__ import annotations

import multiprocessing
import sys
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from .. import task
from ..base import packs
from ..base.dist import DistInfo, all_reduce_max
from ..base.preemption import quiet_loader_worker
from .samplers import ChunkOrderSampler, EvalBatches, ResumableSampler

if TYPE_CHECKING:
    from ..config import Config, DataConfig


def datasets(cfg: Config) -> tuple[Dataset, Dataset]:
    """The (train, eval) datasets of a run: the task's build_datasets(cfg), or the pack that
    data.shards names, its records turned into samples by the task's from_records; the eval set
    cut to its first eval.limit samples when set."""
    if cfg.data.shards is None:
        train_set, eval_set = task.build_datasets(cfg)
    else:
        from_records = partial(task.from_records, cfg) if hasattr(task, "from_records") else None
        train_set, eval_set = packs.datasets(cfg.data, from_records)
    if cfg.eval.limit is not None and cfg.eval.limit < len(eval_set):
        eval_set = Subset(eval_set, range(cfg.eval.limit))
    return train_set, eval_set


def workers_per_rank(cpus: int, local_world_size: int, cap: int) -> int:
    """Loader workers for one rank: its share of the node's CPUs, minus the main process."""
    return max(0, min(cap, cpus // local_world_size - 1))


def resolve_workers(data: DataConfig, cpus: int, local_world_size: int) -> int:
    """data.num_workers, with auto sized from the CPUs this rank shares with its node."""
    if data.num_workers == "auto":
        return workers_per_rank(cpus, local_world_size, data.max_workers)
    return data.num_workers


def train_sampler(train_set: Dataset, seed: int, world_size: int, rank: int):
    """The training order: shuffled anew each epoch, or chunk by chunk for a pack read in its
    chunks (data.shards_order=chunks), whose training set carries the chunk layout."""
    ranks = dict(num_replicas=world_size, rank=rank, seed=seed)
    if isinstance(train_set, packs.InChunks):
        return ChunkOrderSampler(train_set, train_set.chunks, **ranks)
    return ResumableSampler(train_set, shuffle=True, drop_last=True, **ranks)


# Releases that fixed CPython gh-112275: before them, a forked child can wait forever for the lock
# of the interpreter's thread list when another thread held it at the fork. The process group's
# threads take it when they release a finished collective's tensors (seen with gloo), so a loader
# worker forked just after a collective (the eval loader's, at the first evaluation) can hang, and
# its rank with it.
FORK_HANG_FIXED_IN = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}  # 3.12 never had it


def fork_can_hang(version=sys.version_info) -> bool:
    fixed = FORK_HANG_FIXED_IN.get(tuple(version[:2]))
    return fixed is not None and version[2] < fixed


def worker_start(data: DataConfig) -> str | None:
    """How loader workers start (data.worker_start); None: the platform's default, fork on Linux,
    which shares the dataset with the workers instead of pickling it to each."""
    if data.worker_start != "auto":
        return data.worker_start
    return "forkserver" if sys.platform == "linux" and fork_can_hang() else None


def worker_context(start: str | None):
    if start is None:
        return None
    context = multiprocessing.get_context(start)
    if start == "forkserver":  # the server imports torch and the project once; each worker forks from it
        context.set_forkserver_preload([__name__])
    return context


def build_loaders(train_set: Dataset, eval_set: Dataset, cfg: Config, info: DistInfo, num_workers: int):
    """(train loader, eval loader); the train sampler is `train_loader.sampler`."""
    sampler = train_sampler(train_set, cfg.run.seed, info.world_size, info.rank)
    # drop_last on the loader too: every rank runs the same number of full-size steps
    shared = common(cfg.data, cfg.run.seed, info, num_workers)
    train_loader = DataLoader(train_set, sampler=sampler, batch_size=cfg.data.batch_size, drop_last=True, **shared)
    return train_loader, evaluation_loader(eval_set, cfg, info, num_workers)


def evaluation_loader(dataset: Dataset, cfg: Config, info: DistInfo, num_workers: int) -> DataLoader:
    """Every sample once, in batches that do not depend on the world size (samplers.EvalBatches,
    its `plan` says which batches a rank repeats)."""
    batches = EvalBatches(len(dataset), cfg.data.batch_size, info.world_size, info.rank)
    return DataLoader(dataset, batch_sampler=batches, **common(cfg.data, cfg.run.seed, info, num_workers))


def reference_loader(train_set: Dataset, cfg: Config, info: DistInfo, num_workers: int) -> DataLoader | None:
    """The evaluation loader of the task's reference set (task.reference_set: the training
    embeddings a kNN accuracy compares with, say), or None when the task has none."""
    if not hasattr(task, "reference_set"):
        return None
    return evaluation_loader(task.reference_set(cfg, train_set), cfg, info, num_workers)


def common(data: DataConfig, seed: int, info: DistInfo, num_workers: int) -> dict:
    """What every loader of the run shares: the task's collate, the workers and how they start."""
    return dict(
        collate_fn=getattr(task, "collate", default_collate),
        num_workers=num_workers,
        pin_memory=info.device.type == "cuda",
        persistent_workers=num_workers > 0,
        worker_init_fn=quiet_loader_worker,  # SLURM signals every process of the step; the rank handles it
        prefetch_factor=data.prefetch_factor if num_workers > 0 else None,
        multiprocessing_context=worker_context(worker_start(data)) if num_workers > 0 else None,
        generator=own_rng(seed, info.rank),
    )


def describe_workers(loader: DataLoader) -> str:
    """The start-up line's count of a loader's workers, and how they start when not by fork."""
    context = loader.multiprocessing_context
    started = context.get_start_method() if loader.num_workers and context is not None else None
    return f"{loader.num_workers}" + (f", started by {started}" if started else "")


def worker_start_note(data: DataConfig, loader: DataLoader) -> str | None:
    """Why data.worker_start=auto chose a forkserver, when it did."""
    if data.worker_start != "auto" or not loader.num_workers or loader.multiprocessing_context is None:
        return None
    major, minor, micro = sys.version_info[:3]
    fixed = FORK_HANG_FIXED_IN.get((major, minor))
    safe = f"Python {major}.{minor}.{fixed} or 3.12" if fixed else "Python 3.12"
    return (
        f"note: loader workers start from a forkserver, which pickles the datasets to each worker: Python "
        f"{major}.{minor}.{micro} can hang a worker forked while a communication thread holds an interpreter lock "
        f"(CPython gh-112275); {safe} forks them safely, and data.worker_start=fork forks them here anyway"
    )


def own_rng(seed: int, rank: int) -> torch.Generator:
    """A loader's own generator, seeded by the run's seed and the rank: each rank's workers draw
    their own random numbers. Without one, every `iter(loader)` draws its workers' base seed
    from torch's global generator, so a resumed run's first `iter` would shift the random
    numbers after it (dropout masks) away from those of the run it continues."""
    return torch.Generator().manual_seed(seed + rank)


def check_equal_lengths(num_batches: int, info: DistInfo) -> None:
    """Fail on every rank, at start-up, if ranks would run different numbers of steps.

    A rank that runs out of batches early stops calling all-reduce and the others hang.
    """
    spread = all_reduce_max(torch.tensor([num_batches, -num_batches], device=info.device))
    longest, shortest = int(spread[0]), -int(spread[1])
    if longest != shortest:
        raise RuntimeError(
            f"train loader length differs across ranks ({shortest}..{longest} batches; this rank "
            f"{num_batches}): use DistributedSampler(drop_last=True) and DataLoader(drop_last=True)"
        )
    if num_batches == 0:
        raise RuntimeError(
            "the train loader is empty: the training set is smaller than "
            "data.batch_size x world size; lower data.batch_size or add data"
        )
