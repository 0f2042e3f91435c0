"""Datasets, samplers and loaders.

Replace `build_datasets` with your own data; everything below it (samplers, worker sizing,
resumable order, the equal-length check) works for any map-style dataset.
"""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .config import Config
from .dist import DistInfo, all_reduce_max


class SyntheticClassification(Dataset):
    """A learnable toy task: the label is the argmax of a fixed random projection."""

    def __init__(self, num_samples: int, num_features: int, num_classes: int, sample_seed: int):
        # the teacher is shared by train and eval sets; the samples differ by sample_seed
        teacher = torch.randn(num_features, num_classes, generator=torch.Generator().manual_seed(0))
        self.inputs = torch.randn(num_samples, num_features, generator=torch.Generator().manual_seed(sample_seed))
        self.targets = (self.inputs @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        return self.inputs[index], self.targets[index]


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset]:
    """The seam for your data: return (train, eval) map-style datasets."""
    d = cfg.data
    train = SyntheticClassification(d.train_samples, d.num_features, d.num_classes, sample_seed=1)
    evaluation = SyntheticClassification(d.eval_samples, d.num_features, d.num_classes, sample_seed=2)
    return train, evaluation


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


def workers_per_rank(cpus: int, local_world_size: int, cap: int) -> int:
    """Loader workers for one rank: its share of the node's CPUs, minus the main process (P9)."""
    return max(0, min(cap, cpus // local_world_size - 1))


def threads_per_rank(cpus: int, local_world_size: int) -> int:
    """Intra-op threads for one rank, so ranks on a node do not oversubscribe its CPUs."""
    return max(1, cpus // local_world_size)


def build_loaders(cfg: Config, info: DistInfo, num_workers: int):
    """(train loader, eval loader); the train sampler is `train_loader.sampler`."""
    train_set, eval_set = build_datasets(cfg)
    train_sampler = ResumableSampler(
        train_set, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=cfg.run.seed, drop_last=True
    )
    # no shuffle and no drop: evaluation sees every sample; metrics.py masks the padding
    eval_sampler = DistributedSampler(eval_set, num_replicas=info.world_size, rank=info.rank, shuffle=False)
    common = dict(
        batch_size=cfg.data.batch_size,
        num_workers=num_workers,
        pin_memory=info.device.type == "cuda",
        persistent_workers=num_workers > 0,
        prefetch_factor=cfg.data.prefetch_factor if num_workers > 0 else None,
    )
    # drop_last on the loader too: every rank runs the same number of full-size steps (P8)
    train_loader = DataLoader(train_set, sampler=train_sampler, drop_last=True, **common)
    eval_loader = DataLoader(eval_set, sampler=eval_sampler, drop_last=False, **common)
    return train_loader, eval_loader


def check_equal_lengths(num_batches: int, info: DistInfo) -> None:
    """Fail on every rank, at start-up, if ranks would run different numbers of steps (P10).

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
            "the train loader is empty: data.train_samples is smaller than "
            "data.batch_size x world size; lower data.batch_size or add data"
        )
