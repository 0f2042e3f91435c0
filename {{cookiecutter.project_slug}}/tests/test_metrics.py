"""Evaluation counts every sample exactly once; sums are reduced, not means."""

import pytest
import torch
from torch.utils.data import DistributedSampler

from {{ cookiecutter.package_name }}.dist import DistInfo
from {{ cookiecutter.package_name }}.metrics import Totals, real_sample_mask


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("size", [509, 512, 5])
def test_padding_mask_keeps_each_sample_once(world, size):
    seen = []
    for rank in range(world):
        info = DistInfo(rank, rank, world, world, torch.device("cpu"), "gloo")
        shard = list(DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=False))
        mask = real_sample_mask(0, len(shard), info, size, "cpu")
        seen += [index for index, real in zip(shard, mask.tolist(), strict=True) if real]
    assert sorted(seen) == list(range(size))


def test_totals_accumulate_in_float64():
    totals = Totals(torch.device("cpu"))
    for _ in range(1000):
        totals.add(loss=torch.tensor(0.1, dtype=torch.bfloat16), count=1)
    sums = totals.reduced()
    assert totals.sums.dtype == torch.float64 and sums["count"] == 1000
    assert totals.names == ["count", "loss"]  # sorted: every rank reduces the same vector
