"""Losses whose terms see other ranks' samples: contrastive negatives from the whole global batch,
CLIP's image-text pairs over every rank.

    from .base.across_ranks import gather_from_ranks

    def loss_sum(model, batch):
        z = model(batch["views"])                      # this rank's embeddings, (B, D)
        everyone, first = gather_from_ranks(z)         # every rank's, (sum of the B's, D), rank by rank;
        positives = first + torch.arange(len(z))       # this rank's rows start at row `first`
        ...                                            # the loss of this rank's anchors against all of them

and `LOSS_SPANS_RANKS = True` in task.py, so that the proofs compare the loop with one process on every
rank's batches (tests/dist_proofs.py). The gather is differentiable: the gradient of each rank's rows
comes back to that rank, summed over the ranks whose loss used them, so the loop's usual scaling
(world size / the terms of every rank, then DDP's or FSDP's mean) gives the gradient of one process
on the union. Ranks may hold different numbers of rows (a padded gather, then trimmed).

Where a call stands for one process (the start-up check on the CPU, evaluation, diagnose, the
proofs' references), `as_one_process()` makes the gather return this rank's rows alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as torch_dist

Gathered = tuple[torch.Tensor, int]  # every rank's rows, and the row where this rank's start

# what gather_from_ranks does instead of a collective, when set: this rank's rows alone under
# as_one_process, or the proofs' stand-in for the other ranks
_instead: list[Callable[[torch.Tensor], Gathered]] = []


def gather_from_ranks(tensor: torch.Tensor) -> Gathered:
    """(every rank's `tensor` concatenated along dimension 0 in rank order, differentiably; the row
    where this rank's rows start). This rank's own, from row 0, under as_one_process() or in a
    world of one. Every rank must call it, as often as the others."""
    if _instead:
        return _instead[-1](tensor)
    if not torch_dist.is_initialized() or torch_dist.get_world_size() == 1:
        return tensor, 0
    world, rank = torch_dist.get_world_size(), torch_dist.get_rank()
    sizes = [torch.zeros(1, dtype=torch.long, device=tensor.device) for _ in range(world)]
    torch_dist.all_gather(sizes, torch.tensor([len(tensor)], device=tensor.device))
    sizes = [int(size) for size in sizes]
    return _Gather.apply(tensor, sizes, rank), sum(sizes[:rank])


@contextmanager
def gathers_replaced(instead: Callable[[torch.Tensor], Gathered]) -> Iterator[None]:
    """Within it, gather_from_ranks(tensor) returns instead(tensor) and runs no collective."""
    _instead.append(instead)
    try:
        yield
    finally:
        _instead.pop()


def as_one_process():
    """Within it, gather_from_ranks returns this rank's rows: the loss one process computes on them."""
    return gathers_replaced(lambda tensor: (tensor, 0))


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
        padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))  # all_gather needs equal sizes
        padded[: len(tensor)] = tensor
        parts = [torch.empty_like(padded) for _ in sizes]
        torch_dist.all_gather(parts, padded)
        ctx.rows = sum(sizes[:rank]), len(tensor)
        return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # each rank's loss sent a gradient to every rank's rows: sum them, keep this rank's
        grad = grad.contiguous()
        torch_dist.all_reduce(grad)
        start, count = ctx.rows
        return grad[start : start + count], None, None
