"""Samples and batches as the loop sees them, what a sample is worth in the log, and the model
the task's functions are given: the small, stable part of the loop that the task seam (task.py)
may use.

Nothing here knows the task: a batch is whatever the samples collate to (tensors, tuples, lists,
dicts).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset


@dataclass(frozen=True)
class Throughput:
    """What one training sample is worth in the log: `per_sample` units called `unit` (tokens,
    say), and the training FLOPs (forward + backward) per unit, or None where not estimated."""

    unit: str = "samples"
    per_sample: float = 1
    flops_per_unit: float | None = None


def unwrap(model: nn.Module) -> nn.Module:
    """Your own module under the wrappers the loop puts around it: DDP (its `.module`) and
    torch.compile (its `_orig_mod`); FSDP shards the module in place, so it is the module already.
    `loss_sum` and `eval_sums` are given the wrapped model: call the model itself to run it (the
    wrappers' forward is what synchronises gradients and gathers shards), and read your module's
    attributes and call its other methods through `unwrap(model)` (a state's size, a config)."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    return getattr(model, "_orig_mod", model)


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


def elements(sample) -> int:
    """The values a sample holds: the elements of its tensors and arrays, 1 for anything else."""
    if isinstance(sample, torch.Tensor):
        return sample.numel()
    if isinstance(sample, dict):
        return sum(elements(value) for value in sample.values())
    if isinstance(sample, (list, tuple)):
        return sum(elements(value) for value in sample)
    return sample.size if isinstance(sample, np.ndarray) else 1


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


class SeededSamples(Dataset):
    """`dataset` whose every read of sample i in epoch e draws its random numbers (torch's, numpy's
    and Python's generators: torchvision's transforms, albumentations, your own) from a seed of
    (seed, epoch, i), and leaves the process's own generators as they were. A sample then reads the
    same every time, in any worker or process, which the proofs (they read samples again) and an
    exact resume need; and each epoch draws anew. The loop calls `set_epoch` at every epoch; the
    epoch sits in shared memory, where it reaches persistent loader workers however they start
    (fork, forkserver, spawn)."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        with drawn_from(hash((self.seed, int(self.epoch), index)) % 2**32):
            return self.dataset[index]


@contextmanager
def drawn_from(seed: int):
    """Within it torch's, numpy's and Python's generators start from `seed`; after it they are
    where they were."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)
