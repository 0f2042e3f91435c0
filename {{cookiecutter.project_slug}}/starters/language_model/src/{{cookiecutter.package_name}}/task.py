"""The task seam of the language model: next-token cross-entropy on (inputs, targets) windows.

The loop, the smoke check and the diagnostics call only what `__all__` names (docs/your-model-and-data.md
says what each returns). The loss is a sum over target tokens: the loop
divides it by the tokens of every rank and micro-batch of the step, so the gradient is that of
one process on the whole global batch, and stays exact if windows come to differ in length
(padding, document boundaries). Evaluation returns sums per window, which the loop adds
over every window once. Loss and perplexity are per token, in nats.

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
from .data import build_datasets, build_records, from_records, pack_facts
from .model import build_model, training_flops_per_token

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

MAIN_METRIC = ("loss", "min")
# Every window holds model.context targets, a setting rather than a constant: the count is
# all-reduced (one scalar per step, microseconds on NCCL) and stays right for varying windows.
TERMS_PER_SAMPLE = None


def count_terms(batch) -> int:
    _, targets = batch
    return targets.numel()


def token_losses(model: nn.Module, batch) -> torch.Tensor:
    """(B, T) cross-entropy of each next token, in fp32 whatever the autocast precision."""
    inputs, targets = batch
    logits = model(inputs).float()
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")


def loss_sum(model: nn.Module, batch) -> torch.Tensor:
    return token_losses(model, batch).sum()


def eval_sums(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    losses = token_losses(model, batch)
    return {"loss": losses.sum(dim=1), "tokens": torch.full_like(losses[:, 0], losses.shape[1])}


def metrics(totals: dict[str, float]) -> dict[str, float]:
    loss = totals["loss"] / totals["tokens"]  # nats per token
    return {"loss": loss, "perplexity": math.exp(loss)}


def throughput(cfg: Config, model: nn.Module) -> Throughput:
    return Throughput("tokens", cfg.model.context, training_flops_per_token(model))


def shard_units(model: nn.Module) -> list[nn.Module]:
    """parallel.strategy=fsdp (and activation checkpointing): each transformer block is a unit; the
    embeddings, the final norm and the head, which shares the token embedding's weight, stay
    together in the root's group."""
    return list(model.blocks)
