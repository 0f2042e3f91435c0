"""Contrastive data: two augmented views of each sample, and the labels only to score the embeddings.

The samples are points near one of `classes` centres. A training sample is two views of its
point, each with a random mask and noise: augmentation drawn per read from (run.seed, epoch,
index) by SeededSamples, so a sample reads the same every time (the proofs read samples again; a
resumed run reads what the uninterrupted one read). Evaluation and the reference set (task.py's
kNN) read the points themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

from .base.batching import SeededSamples
from .base.rules import PositiveInt

if TYPE_CHECKING:
    from .config import Config


@dataclass
class DatasetConfig:
    train_samples: PositiveInt = 2048  # points in the training set
    eval_samples: PositiveInt = 509  # points in the evaluation set (a prime: no world size splits it evenly)
    num_features: PositiveInt = 32  # width of a point
    classes: PositiveInt = 8  # centres the points lie near
    spread: float = 1.2  # the points' distance from their centre, in units of the centres' own scale


class Points(Dataset):
    """{"point", "label"}: point i lies near centre i % classes; `seed` picks the set's points."""

    def __init__(self, cfg: Config, size: int, seed: int):
        d = cfg.dataset
        self.centres = torch.randn(d.classes, d.num_features, generator=torch.Generator().manual_seed(0))
        noise = torch.randn(size, d.num_features, generator=torch.Generator().manual_seed(seed))
        self.labels = torch.arange(size) % d.classes
        self.points = self.centres[self.labels] + d.spread * noise

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"point": self.points[index], "label": self.labels[index]}


class Views(Dataset):
    """{"views": (2, features), "label"}: two views of each point, a quarter of its features masked
    and noise added, from torch's global generator (SeededSamples seeds it per read)."""

    def __init__(self, points: Points):
        self.points = points

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int) -> dict:
        sample = self.points[index]
        point = sample["point"].expand(2, -1)
        kept = torch.rand(point.shape) > 0.25
        return {"views": point * kept + 0.3 * torch.randn(point.shape), "label": sample["label"]}


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset]:
    d = cfg.dataset
    train = SeededSamples(Views(Points(cfg, d.train_samples, seed=1)), cfg.run.seed)
    return train, Points(cfg, d.eval_samples, seed=2)


def reference_points(cfg: Config, train_set: Dataset) -> Dataset:
    """The training set's points themselves, without views: what kNN compares with."""
    return Points(cfg, len(train_set), seed=1)
