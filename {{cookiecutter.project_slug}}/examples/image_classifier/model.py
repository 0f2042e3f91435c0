"""A small CNN with BatchNorm2d: (B, 1, H, W) images -> (B, classes) logits.

Swap: copy this file and data.py over src/<package>/; task.py stays as it is, since the model
still returns (B, C) logits for integer labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from .base.rules import PositiveInt

if TYPE_CHECKING:
    from .config import Config


@dataclass
class ModelConfig:
    channels: PositiveInt = 16  # channels of the first convolution; the second has twice as many


def build_model(cfg: Config) -> nn.Module:
    width = cfg.model.channels

    def block(inputs: int, outputs: int) -> list[nn.Module]:
        return [
            nn.Conv2d(inputs, outputs, 3, padding=1, bias=False),
            nn.BatchNorm2d(outputs),
            nn.ReLU(),
            nn.MaxPool2d(2),
        ]

    return nn.Sequential(
        *block(1, width),
        *block(width, 2 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, cfg.dataset.num_classes),
    )
