"""The task seam for a regression whose model returns its own (mean) loss: MSE, no accuracy.

`loss_sum` and `eval_sums` get the model as the loop wrapped it (DDP, FSDP, torch.compile): they
call it, and would reach the module's own attributes through batching.unwrap(model) (docs/your-model-and-data.md).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from .base.batching import Throughput
from .base.batching import move_to as to_device
from .data import build_datasets
from .model import build_model

if TYPE_CHECKING:
    from .config import Config

__all__ = [
    "MAIN_METRIC",
    "TERMS_PER_SAMPLE",
    "build_datasets",
    "build_model",
    "count_terms",
    "eval_sums",
    "loss_sum",
    "metrics",
    "throughput",
    "to_device",
]

MAIN_METRIC = ("rmse", "min")
TERMS_PER_SAMPLE = None  # one per target value; the number of targets is a data setting


def count_terms(batch) -> int:
    _, targets = batch
    return targets.numel()  # one squared error per predicted value


def loss_sum(model: nn.Module, batch) -> torch.Tensor:
    features, targets = batch
    return model(features, targets)["loss"] * targets.numel()  # the model's mean, back to a sum


def eval_sums(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    features, targets = batch
    errors = (model(features)["prediction"].float() - targets) ** 2
    return {"squared_error": errors.sum(dim=1), "values": torch.full_like(errors[:, 0], targets.shape[1])}


def metrics(totals: dict[str, float]) -> dict[str, float]:
    mse = totals["squared_error"] / totals["values"]
    return {"mse": mse, "rmse": math.sqrt(mse)}


def throughput(cfg: Config, model: nn.Module) -> Throughput:
    return Throughput()  # samples; no FLOPs estimate, so no MFU
