"""The task seam of a Hugging Face causal language model: next-token cross-entropy on the
language-model starter's (inputs, targets) windows, the model called as transformers models are
called, with keyword arguments.

The data is the starter's (data.py unchanged: token windows, `prepare`, a tokenizer.json). The
model returns an output object; its `.logits` give the summed loss (the model's own `labels=`
loss is a mean, which the loop's exact weighting over ranks cannot use). Under
parallel.strategy=fsdp each decoder layer is a unit: the classes the model names in
`_no_split_modules`, which transformers keeps whole when it spreads a model over devices.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .base.batching import Throughput
from .base.batching import move_to as to_device
from .data import build_datasets, build_records, from_records, pack_facts, tokenizer_file
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
    "tokenizer_file",
]

MAIN_METRIC = ("loss", "min")
TERMS_PER_SAMPLE = None  # model.context targets a window: a setting, counted every step


def count_terms(batch) -> int:
    _, targets = batch
    return targets.numel()


def token_losses(model: nn.Module, batch) -> torch.Tensor:
    """(B, T) cross-entropy of each next token, in fp32 whatever the autocast precision."""
    inputs, targets = batch
    # no key/value cache: training sees each window once
    logits = model(input_ids=inputs, use_cache=False).logits.float()
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
    return Throughput("tokens", cfg.model.context, training_flops_per_token(model, cfg.model.context))


def shard_units(model: nn.Module) -> list[nn.Module] | None:
    """The decoder layers: modules whose class the model names in `_no_split_modules` (a sharded
    module's class derives from its own). The embeddings, the final norm and the head, tied to the
    input embedding, stay together in the root's group."""
    whole = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if any(cls.__name__ in whole for cls in type(m).__mro__)]
    return units or None  # a model that names none: the loop's default units
