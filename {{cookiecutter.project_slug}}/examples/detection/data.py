"""Detection data: scenes of coloured squares on noise, each with its boxes and labels, as
torchvision's detection datasets give them: (image, {"boxes": (n, 4) x0 y0 x1 y1, "labels": (n,)}).

Images hold different numbers of objects, so the default collate cannot stack their targets:
task.collate makes a batch of two lists. The training images are flipped at random, drawn per
read from (run.seed, epoch, index) by SeededSamples, so a sample reads the same every time (the
proofs read samples again; a resumed run reads what the uninterrupted one read).
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

COLOURS = torch.tensor([[0.9, 0.2, 0.2], [0.2, 0.9, 0.2], [0.2, 0.3, 0.9], [0.9, 0.9, 0.2]])  # one a class


@dataclass
class DatasetConfig:
    train_images: PositiveInt = 1024  # scenes in the training set
    eval_images: PositiveInt = 61  # scenes in the evaluation set (a prime: no world size splits it evenly)
    image_size: PositiveInt = 64  # side of a scene, in pixels
    classes: PositiveInt = 3  # kinds of square, each of its own colour (at most 4)
    max_objects: PositiveInt = 3  # squares in a scene: 1 to this many


class Scenes(Dataset):
    """Scene i: noise, and 1 to max_objects squares of 8 to side/3 pixels, each of its class's colour."""

    def __init__(self, cfg: Config, size: int, seed: int):
        self.dataset, self.size, self.seed = cfg.dataset, size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict]:
        d, draw = self.dataset, torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = 0.3 * torch.rand(3, d.image_size, d.image_size, generator=draw)
        boxes, labels = [], []
        for _ in range(1 + int(torch.randint(d.max_objects, (), generator=draw))):
            side = int(torch.randint(8, d.image_size // 3 + 1, (), generator=draw))
            x, y = (int(v) for v in torch.randint(0, d.image_size - side + 1, (2,), generator=draw))
            label = int(torch.randint(d.classes, (), generator=draw))
            image[:, y : y + side, x : x + side] = COLOURS[label, :, None, None]
            boxes.append([x, y, x + side, y + side])
            labels.append(label + 1)  # 0 is torchvision's background
        return image, {"boxes": torch.tensor(boxes, dtype=torch.float32), "labels": torch.tensor(labels)}


class Flipped(Dataset):
    """`scenes` mirrored left to right at random (torch's global generator: SeededSamples seeds it)."""

    def __init__(self, scenes: Dataset):
        self.scenes = scenes

    def __len__(self) -> int:
        return len(self.scenes)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict]:
        image, target = self.scenes[index]
        if torch.rand(()) < 0.5:
            x0, y0, x1, y1 = target["boxes"].unbind(dim=1)
            width = image.shape[2]
            image, target = image.flip(2), target | {"boxes": torch.stack([width - x1, y0, width - x0, y1], dim=1)}
        return image, target


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset]:
    d = cfg.dataset
    train = SeededSamples(Flipped(Scenes(cfg, d.train_images, seed=1)), cfg.run.seed)
    return train, Scenes(cfg, d.eval_images, seed=2)
