"""The task seam of a contrastive encoder (SimCLR's loss): each view's positive is the other view
of its sample, its negatives are the other views of every rank's batch.

- `loss_sum` gathers every rank's embeddings with gather_from_ranks (LOSS_SPANS_RANKS): the
  negatives of the whole global batch, with the gradients going back to the rank that made them.
- Evaluation scores the embeddings by a kNN accuracy: each evaluation point's k nearest training
  points (reference_set, no augmentation) vote for its class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .base.across_ranks import gather_from_ranks
from .base.batching import Throughput
from .base.batching import move_to as to_device
from .data import build_datasets
from .data import reference_points as reference_set
from .model import build_model

if TYPE_CHECKING:
    from .config import Config

__all__ = [
    "LOSS_SPANS_RANKS",
    "MAIN_METRIC",
    "TERMS_PER_SAMPLE",
    "build_datasets",
    "build_model",
    "count_terms",
    "dataset_metrics",
    "eval_outputs",
    "loss_sum",
    "reference_set",
    "throughput",
    "to_device",
]

MAIN_METRIC = ("knn_accuracy", "max")
TERMS_PER_SAMPLE = 2  # each of a sample's two views is an anchor
LOSS_SPANS_RANKS = True
TEMPERATURE = 0.2
NEIGHBOURS = 10


def count_terms(batch) -> int:
    return 2 * len(batch["label"])


def loss_sum(model: nn.Module, batch) -> torch.Tensor:
    views = batch["views"]
    embedded = model(views.flatten(0, 1)).view(len(views), 2, -1)  # one forward: BatchNorm sees both views
    first_views, first = gather_from_ranks(embedded[:, 0])
    second_views, _ = gather_from_ranks(embedded[:, 1])
    positives = first + torch.arange(len(views), device=views.device)
    loss = F.cross_entropy(embedded[:, 0] @ second_views.T / TEMPERATURE, positives, reduction="sum")
    return loss + F.cross_entropy(embedded[:, 1] @ first_views.T / TEMPERATURE, positives, reduction="sum")


def eval_outputs(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    return {"embedding": model(batch["point"]).float(), "label": batch["label"]}


def dataset_metrics(cfg: Config, outputs: dict, reference: dict) -> dict[str, float]:
    nearest = (outputs["embedding"] @ reference["embedding"].T).topk(NEIGHBOURS, dim=1).indices
    votes = F.one_hot(reference["label"][nearest], cfg.dataset.classes).sum(dim=1)
    return {"knn_accuracy": float((votes.argmax(dim=1) == outputs["label"]).double().mean())}


def throughput(cfg: Config, model: nn.Module) -> Throughput:
    return Throughput()
