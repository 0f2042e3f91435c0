"""The task seam of the image classifier: cross-entropy on (images, labels), top-1 and top-5.

The loop, the smoke check and the diagnostics call only what `__all__` names (docs/your-model-and-data.md
says what each returns). The loss is a sum over images: the loop divides it
by the images of every rank and micro-batch of the step. Evaluation returns per-image sums,
which the loop adds over every image once: the accuracies are exact whatever the world size.

`loss_sum` and `eval_sums` get the model as the loop wrapped it (DDP, FSDP, torch.compile): they
call it, and would reach the module's own attributes through batching.unwrap(model) (docs/your-model-and-data.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .base.batching import Throughput
from .data import build_datasets, build_records, class_names, from_records, pack_facts
from .model import build_model, image_layout, training_flops_per_image

if TYPE_CHECKING:
    from .config import Config

__all__ = [
    "MAIN_METRIC",
    "TERMS_PER_SAMPLE",
    "build_datasets",
    "build_model",
    "build_records",
    "count_terms",
    "eval_sums",
    "from_records",
    "loss_sum",
    "metrics",
    "pack_facts",
    "shard_units",
    "throughput",
    "to_device",
]

MAIN_METRIC = ("top1", "max")
TERMS_PER_SAMPLE = 1  # one label per image
TOP_K = 5


def to_device(batch, device: torch.device):
    images, labels = batch
    images = images.to(device, non_blocking=True, memory_format=image_layout(device))
    return images, labels.to(device, non_blocking=True)


def count_terms(batch) -> int:
    _, labels = batch
    return len(labels)


def loss_sum(model: nn.Module, batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels, reduction="sum")


def eval_sums(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    images, labels = batch
    logits = model(images).float()
    ranked = logits.topk(min(TOP_K, logits.shape[1]), dim=1).indices
    hits = ranked == labels[:, None]
    return {
        "loss": F.cross_entropy(logits, labels, reduction="none"),
        "top1": hits[:, 0].float(),
        "top5": hits.any(dim=1).float(),
    }


def metrics(totals: dict[str, float]) -> dict[str, float]:
    return {name: totals[name] / totals["samples"] for name in ("loss", "top1", "top5")}


def throughput(cfg: Config, model: nn.Module) -> Throughput:
    return Throughput("images", 1, training_flops_per_image(cfg, len(class_names(cfg))))


def shard_units(model: nn.Module) -> list[nn.Module] | None:
    """parallel.strategy=fsdp (and activation checkpointing): a ResNet's four stages are the units;
    for another architecture None, the loop's default (the largest ModuleList's children, else
    the model's children)."""
    stages = [getattr(model, f"layer{i}", None) for i in range(1, 5)]
    return stages if all(stage is not None for stage in stages) else None
