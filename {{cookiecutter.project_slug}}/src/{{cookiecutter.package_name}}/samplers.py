"""The training order: DistributedSampler that resumes mid-epoch, and the chunk-by-chunk order for
packed shards. Both depend on the seed and the epoch only for the epoch's global order; each rank
takes its part of it.
"""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import Dataset, DistributedSampler


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
