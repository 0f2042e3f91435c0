"""The model: part of the task seam (see task.py). Replace `build_model` and `ModelConfig`
with yours; the rest of the project only needs an `nn.Module` that task.py knows how to call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from torch import nn

from .base.rules import PositiveInt

if TYPE_CHECKING:
    from .config import Config


@dataclass
class ModelConfig:
    hidden: PositiveInt = 64  # width of the hidden layers
    depth: PositiveInt = 2  # number of hidden blocks (Linear -> norm -> ReLU)
    norm: Literal["batch", "layer"] = "batch"  # batch: BatchNorm (SyncBN-able); layer: LayerNorm (batch-size free)


def build_model(cfg: Config) -> nn.Module:
    """An MLP classifier; with model.norm=batch it has BatchNorm, so SyncBN is real."""
    width, layers = cfg.dataset.num_features, []
    batch_norm = cfg.model.norm == "batch"
    for _ in range(cfg.model.depth):
        norm = nn.BatchNorm1d(cfg.model.hidden) if batch_norm else nn.LayerNorm(cfg.model.hidden)
        # no bias before BatchNorm: it subtracts the batch mean, so the bias would get a zero
        # gradient that Adam turns into rounding-noise updates
        layers += [nn.Linear(width, cfg.model.hidden, bias=not batch_norm), norm, nn.ReLU()]
        width = cfg.model.hidden
    layers.append(nn.Linear(width, cfg.dataset.num_classes))
    return nn.Sequential(*layers)
