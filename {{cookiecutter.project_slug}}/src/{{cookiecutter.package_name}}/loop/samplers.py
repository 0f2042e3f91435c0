"""The training order: DistributedSampler that resumes mid-epoch on any world size, and the
chunk-by-chunk order for packed shards. An epoch's global order depends on the seed and the epoch
only; each rank takes its part of it. Evaluation's batches (EvalBatches) do not depend on the world
size either.

A run resumed mid-epoch on another world size (or per-device batch) continues with the samples
its epoch has not read yet: each layout the epoch ran on, [world size, samples each rank read],
removes what it read from the order, and the current world takes its parts of the rest. With
DistributedSampler's layout (rank r takes every W-th sample from r) what b batches of B on W ranks
read is exactly the first b·B·W samples of the order, whatever W was, so the resumed run's global
batches are the uninterrupted run's.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler


class ResumableSampler(DistributedSampler):
    """DistributedSampler (drop_last) that can start an epoch part-way, on any world size."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0  # samples of this rank's part already read on the current world size
        self.earlier: list[list[int]] = []  # this epoch's earlier layouts: [world size, samples each rank read]

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.resume_at([], 0)

    def resume_at(self, earlier: list[list[int]], skip: int) -> None:
        """Start the epoch after what `earlier` layouts read and the first `skip` samples of this rank's part."""
        self.earlier, self.skip = [list(layout) for layout in earlier], skip

    def global_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    @staticmethod
    def unread(order: list[int], world: int, read: int) -> list[int]:
        """`order` without what `world` ranks read, `read` each, in this layout: its first read·world."""
        return order[read * world :]

    def part(self, order: list[int]) -> list[int]:
        """This rank's samples of `order` on the current world size: every world-size-th, equal counts."""
        per_rank = len(order) // self.num_replicas
        return order[self.rank : per_rank * self.num_replicas : self.num_replicas]

    def remaining(self) -> list[int]:
        order = self.global_order()
        for world, read in self.earlier:
            order = self.unread(order, world, read)
        return order

    def __iter__(self):
        return iter(self.part(self.remaining())[self.skip :])

    def __len__(self) -> int:
        unread = len(self.dataset) - sum(world * read for world, read in self.earlier)
        return unread // self.num_replicas - self.skip


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

    @staticmethod
    def unread(order: list[int], world: int, read: int) -> list[int]:
        """`order` without the first `read` of each rank's consecutive part (the rest stays in order)."""
        per_rank = len(order) // world
        parts = [order[rank * per_rank + read : (rank + 1) * per_rank] for rank in range(world)]
        return [index for part in parts for index in part] + order[world * per_rank :]

    def part(self, order: list[int]) -> list[int]:
        per_rank = len(order) // self.num_replicas
        return order[self.rank * per_rank : (self.rank + 1) * per_rank]


class EvalBatches(Sampler[list[int]]):
    """Evaluation's batches, the same on any world size: the set cut into batches of
    `batch_size` consecutive samples (the last one shorter), dealt to the ranks in turn (rank r
    evaluates batches r, r + W, ...). A model whose output depends on its batch (images padded to
    the batch's largest, say) so evaluates alike on 1, 2 or 3 ranks and in tools.evaluate. Every
    rank runs as many batches as the others, since a sharded model gathers its parameters in each
    forward: a rank short of one repeats a batch, which `plan` marks as a repeat, not counted."""

    def __init__(self, size: int, batch_size: int, world_size: int, rank: int):
        self.size = size
        batches = [list(range(start, min(start + batch_size, size))) for start in range(0, size, batch_size)]
        mine = batches[rank::world_size]
        each = -(-len(batches) // world_size)
        self.plan = [(indices, False) for indices in mine]
        if len(mine) < each:  # repeats: run, not counted
            self.plan += [(mine[0] if mine else batches[0], True)] * (each - len(mine))

    def __iter__(self):
        return iter([indices for indices, _ in self.plan])

    def __len__(self) -> int:
        return len(self.plan)
