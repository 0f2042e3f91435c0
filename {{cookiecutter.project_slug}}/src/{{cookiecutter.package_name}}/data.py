"""The data: part of the task seam (see task.py). Replace `build_datasets` and `DatasetConfig`
with your own map-style datasets; samplers, loaders and worker sizing (loaders.py) work for
any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import torch
from torch.utils.data import Dataset

from .base.rules import PositiveInt, at_least

if TYPE_CHECKING:
    from .config import Config


@dataclass
class DatasetConfig:
    # Defaults small enough for the smoke check and the tests (509 eval samples, a prime: no
    # world size splits them evenly); configs/default.yaml sets the sizes of a real run.
    train_samples: PositiveInt = 2048  # size of the synthetic training set
    eval_samples: PositiveInt = 509  # size of the synthetic evaluation set
    num_features: PositiveInt = 16  # input width of the synthetic data
    num_classes: Annotated[int, at_least(2)] = 10  # classes of the synthetic data


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
    """(train, eval) map-style datasets."""
    d = cfg.dataset
    train = SyntheticClassification(d.train_samples, d.num_features, d.num_classes, sample_seed=1)
    evaluation = SyntheticClassification(d.eval_samples, d.num_features, d.num_classes, sample_seed=2)
    return train, evaluation
