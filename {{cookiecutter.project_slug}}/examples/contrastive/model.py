"""An encoder: an MLP with BatchNorm, its output on the unit sphere (the embedding)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .base.rules import PositiveInt

if TYPE_CHECKING:
    from .config import Config


@dataclass
class ModelConfig:
    hidden: PositiveInt = 128  # width of the hidden layers
    embedding: PositiveInt = 32  # width of the embedding


class Encoder(nn.Module):
    def __init__(self, features: int, hidden: int, embedding: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(features, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, embedding)
        )

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.layers(points), dim=-1)


def build_model(cfg: Config) -> nn.Module:
    return Encoder(cfg.dataset.num_features, cfg.model.hidden, cfg.model.embedding)
