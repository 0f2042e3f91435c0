"""A smooth synthetic regression: targets = sin(features @ W) plus a little noise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset, TensorDataset

from .base.rules import PositiveInt

if TYPE_CHECKING:
    from .config import Config


@dataclass
class DatasetConfig:
    train_samples: PositiveInt = 4096  # samples in the training set
    eval_samples: PositiveInt = 509  # samples in the evaluation set
    num_features: PositiveInt = 8  # input width
    num_targets: PositiveInt = 2  # values to predict per sample


def make_split(cfg: Config, samples: int, seed: int) -> Dataset:
    weights = torch.randn(cfg.dataset.num_features, cfg.dataset.num_targets, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(samples, cfg.dataset.num_features, generator=generator)
    targets = torch.sin(features @ weights / 2) + 0.05 * torch.randn(
        samples, cfg.dataset.num_targets, generator=generator
    )
    return TensorDataset(features, targets)


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset]:
    return make_split(cfg, cfg.dataset.train_samples, seed=1), make_split(cfg, cfg.dataset.eval_samples, seed=2)
