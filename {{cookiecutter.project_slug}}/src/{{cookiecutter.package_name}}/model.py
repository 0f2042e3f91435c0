"""The example model. Replace `build_model` with yours; the rest of the project only needs
an `nn.Module` that maps a batch of inputs to logits."""

from __future__ import annotations

from torch import nn

from .config import Config


def build_model(cfg: Config) -> nn.Module:
    """An MLP classifier; with model.norm=batch it has BatchNorm, so SyncBN is real."""
    width, layers = cfg.data.num_features, []
    for _ in range(cfg.model.depth):
        norm = nn.BatchNorm1d(cfg.model.hidden) if cfg.model.norm == "batch" else nn.LayerNorm(cfg.model.hidden)
        layers += [nn.Linear(width, cfg.model.hidden), norm, nn.ReLU()]
        width = cfg.model.hidden
    layers.append(nn.Linear(width, cfg.data.num_classes))
    return nn.Sequential(*layers)
