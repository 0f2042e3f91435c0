"""The task seam for a causal language model: dict batches, (B, T, V) logits, labels -100 on
padding, the loss averaged over valid tokens across every rank, perplexity for evaluation.

`loss_sum` and `eval_sums` get the model as the loop wrapped it (DDP, FSDP, torch.compile): they
call it, and would reach the module's own attributes through batching.unwrap(model) (docs/your-model-and-data.md).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .base.batching import Throughput
from .base.batching import move_to as to_device
from .data import IGNORE, build_datasets
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

MAIN_METRIC = ("perplexity", "min")
TERMS_PER_SAMPLE = None  # valid tokens vary with padding


def count_terms(batch) -> int:
    return int((batch["labels"] != IGNORE).sum())


def token_losses(model: nn.Module, batch) -> torch.Tensor:
    """(B, T) cross-entropy of each next token; 0 where the label is padding."""
    logits = model(batch["input_ids"]).float()
    return F.cross_entropy(logits.transpose(1, 2), batch["labels"], ignore_index=IGNORE, reduction="none")


def loss_sum(model: nn.Module, batch) -> torch.Tensor:
    return token_losses(model, batch).sum()


def eval_sums(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    return {"loss": token_losses(model, batch).sum(dim=1), "tokens": (batch["labels"] != IGNORE).sum(dim=1).float()}


def metrics(totals: dict[str, float]) -> dict[str, float]:
    loss = totals["loss"] / totals["tokens"]
    return {"loss": loss, "perplexity": math.exp(loss)}


def throughput(cfg: Config, model: nn.Module) -> Throughput:
    return Throughput("tokens", cfg.dataset.context)  # window positions, padding included; no MFU
