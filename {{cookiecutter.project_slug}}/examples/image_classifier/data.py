"""Synthetic grey-scale images: a bright square in one of four corners (the class) on noise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

from .base.rules import PositiveInt

if TYPE_CHECKING:
    from .config import Config


@dataclass
class DatasetConfig:
    train_samples: PositiveInt = 4096  # images in the training set
    eval_samples: PositiveInt = 509  # images in the evaluation set
    image_size: PositiveInt = 16  # height and width in pixels
    num_classes: PositiveInt = 4  # one class per corner


class CornerImages(Dataset):
    def __init__(self, samples: int, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (samples,), generator=generator)
        self.images = 0.5 * torch.randn(samples, 1, size, size, generator=generator)
        half = size // 2
        for index, label in enumerate(self.labels.tolist()):
            top, left = (label // 2) * half, (label % 2) * half
            self.images[index, 0, top : top + half, left : left + half] += 1.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset]:
    d = cfg.dataset
    return CornerImages(d.train_samples, d.image_size, seed=1), CornerImages(d.eval_samples, d.image_size, seed=2)
