"""Samplers, loaders and per-rank worker sizing for any map-style datasets.

Nothing here knows the task: the datasets come from `build_datasets` (data.py) and the
batches are whatever their samples collate to (tensors, tuples, lists, dicts).
"""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .config import Config
from .dist import DistInfo, all_reduce_max
from .preemption import quiet_loader_worker


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way, for exact mid-epoch resume."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0  # samples of this rank's shard already consumed this epoch

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return super().__len__() - self.skip


class ChunkOrderSampler(ResumableSampler):
    """ResumableSampler for packed shards (data.shards_order=chunks): each epoch shuffles the order
    of the chunks and the records within each chunk, then gives each rank a consecutive part of
    that order, so a rank's loader workers read chunk after chunk (each opened, or fetched from
    object storage, once an epoch) instead of one record from anywhere. The order depends on the
    seed and the epoch only, not on the world size; like DistributedSampler(drop_last=True), the
    last len % world records rest. `chunks` lists the dataset indices each chunk holds."""

    def __init__(self, dataset: Dataset, chunks: list, **kwargs):
        super().__init__(dataset, drop_last=True, **kwargs)
        self.chunks = [torch.as_tensor(chunk) for chunk in chunks]

    def global_order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        chunks = [self.chunks[c] for c in torch.randperm(len(self.chunks), generator=generator).tolist()]
        return torch.cat([chunk[torch.randperm(len(chunk), generator=generator)] for chunk in chunks]).tolist()

    def __iter__(self):
        first = self.rank * self.num_samples
        return iter(self.global_order()[first + self.skip : first + self.num_samples])


def workers_per_rank(cpus: int, local_world_size: int, cap: int) -> int:
    """Loader workers for one rank: its share of the node's CPUs, minus the main process."""
    return max(0, min(cap, cpus // local_world_size - 1))


def resolve_workers(cfg: Config, cpus: int, local_world_size: int) -> int:
    """data.num_workers, with auto sized from the CPUs this rank shares with its node."""
    if cfg.data.num_workers == "auto":
        return workers_per_rank(cpus, local_world_size, cfg.data.max_workers)
    return cfg.data.num_workers


def train_sampler(train_set: Dataset, cfg: Config, world_size: int, rank: int, chunks: list | None = None):
    """The training order: shuffled anew each epoch, or chunk by chunk when `chunks` (the indices
    each chunk of a pack holds) are given."""
    ranks = dict(num_replicas=world_size, rank=rank, seed=cfg.run.seed)
    if chunks is None:
        return ResumableSampler(train_set, shuffle=True, drop_last=True, **ranks)
    return ChunkOrderSampler(train_set, chunks, **ranks)


def build_loaders(
    train_set: Dataset, eval_set: Dataset, cfg: Config, info: DistInfo, num_workers: int, chunks: list | None = None
):
    """(train loader, eval loader); the train sampler is `train_loader.sampler`."""
    sampler = train_sampler(train_set, cfg, info.world_size, info.rank, chunks)
    # no shuffle and no drop: evaluation sees every sample; metrics.py masks the padding
    eval_sampler = DistributedSampler(eval_set, num_replicas=info.world_size, rank=info.rank, shuffle=False)
    common = dict(
        batch_size=cfg.data.batch_size,
        num_workers=num_workers,
        pin_memory=info.device.type == "cuda",
        persistent_workers=num_workers > 0,
        worker_init_fn=quiet_loader_worker,  # SLURM signals every process of the step; the rank handles it
        prefetch_factor=cfg.data.prefetch_factor if num_workers > 0 else None,
    )
    # drop_last on the loader too: every rank runs the same number of full-size steps
    train_loader = DataLoader(train_set, sampler=sampler, drop_last=True, generator=own_rng(cfg, info), **common)
    eval_loader = DataLoader(eval_set, sampler=eval_sampler, drop_last=False, generator=own_rng(cfg, info), **common)
    return train_loader, eval_loader


def own_rng(cfg: Config, info: DistInfo) -> torch.Generator:
    """A loader's own generator. Without one, every `iter(loader)` draws its workers' base seed
    from torch's global generator, so a resumed run's first `iter` would shift the random
    numbers after it (dropout masks) away from those of the run it continues."""
    return torch.Generator().manual_seed(cfg.run.seed + info.rank)


def first_samples(dataset: Dataset, loader: DataLoader, count: int):
    """The first `count` samples of a dataset collated the way its loader does: a real batch
    without starting workers or touching the sampler."""
    return loader.collate_fn([dataset[i] for i in range(min(count, len(dataset)))])


def move_to(batch, device: torch.device):
    """The batch on `device`: tensors inside tuples, lists and dicts, copied asynchronously
    when the loader pinned them."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: move_to(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(value, device) for value in batch)
    return batch


def num_samples(batch) -> int:
    """Samples in a batch: the leading size of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if not isinstance(batch, (dict, list, tuple)):
        return 0
    for value in batch.values() if isinstance(batch, dict) else batch:
        size = num_samples(value)
        if size:
            return size
    return 0


def describe(value) -> str:
    """Types and shapes of a nested structure, for error messages: (Tensor[16, 8] float32, ...)."""
    if isinstance(value, torch.Tensor):
        return f"Tensor[{', '.join(map(str, value.shape))}] {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {describe(v)}" for key, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    return type(value).__name__


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
