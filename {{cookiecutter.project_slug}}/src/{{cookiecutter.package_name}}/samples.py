"""Samples and batches as the loop sees them, and what a sample is worth in the log: the small,
stable part of the loop that the task seam (task.py) may use.

Nothing here knows the task: a batch is whatever the samples collate to (tensors, tuples, lists,
dicts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset


@dataclass(frozen=True)
class Throughput:
    """What one training sample is worth in the log: `per_sample` units called `unit` (tokens,
    say), and the training FLOPs (forward + backward) per unit, or None where not estimated."""

    unit: str = "samples"
    per_sample: float = 1
    flops_per_unit: float | None = None


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


def first_samples(dataset: Dataset, loader: DataLoader, count: int):
    """The first `count` samples of a dataset collated the way its loader does: a real batch
    without starting workers or touching the sampler."""
    return loader.collate_fn([dataset[i] for i in range(min(count, len(dataset)))])
