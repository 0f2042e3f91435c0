"""An MLP regressor that returns its own loss, Hugging Face style: `model(x, y)` gives
`{"prediction": ..., "loss": mean squared error}`."""

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
    hidden: PositiveInt = 64  # width of the hidden layer


class Regressor(nn.Module):
    def __init__(self, inputs: int, outputs: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, outputs))

    def forward(self, features: torch.Tensor, targets: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        prediction = self.net(features)
        loss = F.mse_loss(prediction.float(), targets) if targets is not None else None
        return {"prediction": prediction, "loss": loss}


def build_model(cfg: Config) -> nn.Module:
    return Regressor(cfg.dataset.num_features, cfg.dataset.num_targets, cfg.model.hidden)
