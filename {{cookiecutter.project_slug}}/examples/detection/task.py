"""The task seam of a detector (torchvision's Faster R-CNN): list targets, the mode decides the
output, and mAP over the whole evaluation set.

- `collate`: images hold different numbers of boxes: a batch is (list of images, list of targets).
- `loss_sum` gets the model in train mode, where torchvision's detectors return their losses:
  means over the batch's sampled anchors and proposals, made a sum by the batch's images.
- `eval_outputs` gets it in eval mode, where they return detections: each image's, with its
  targets, kept on the host; `dataset_metrics` then scores all of them at once with torchmetrics'
  COCO mean average precision, on rank 0 (sync_on_compute=False: the loop gathered them already).
"""

from __future__ import annotations

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
    "collate",
    "count_terms",
    "dataset_metrics",
    "eval_outputs",
    "loss_sum",
    "throughput",
    "to_device",
]

MAIN_METRIC = ("map_50", "max")
TERMS_PER_SAMPLE = 1  # the loss of an image


def collate(samples: list) -> tuple[list, list]:
    images, targets = zip(*samples, strict=True)
    return list(images), list(targets)


def count_terms(batch) -> int:
    return len(batch[0])


def loss_sum(model: nn.Module, batch) -> torch.Tensor:
    images, targets = batch
    return sum(model(images, targets).values()) * len(images)


def eval_outputs(model: nn.Module, batch) -> list[dict]:
    images, targets = batch
    return [{"found": found, "truth": truth} for found, truth in zip(model(images), targets, strict=True)]


def dataset_metrics(cfg: Config, outputs: list[dict], reference) -> dict[str, float]:
    from torchmetrics.detection import MeanAveragePrecision

    scores = MeanAveragePrecision(iou_type="bbox", sync_on_compute=False)
    scores.update([o["found"] for o in outputs], [o["truth"] for o in outputs])
    return {name: float(scores.compute()[name]) for name in ("map", "map_50")}


def throughput(cfg: Config, model: nn.Module) -> Throughput:
    return Throughput("images", 1)
