"""The task seam: everything that depends on what you train is here, in model.py and in data.py.

The loop, the smoke check, diagnose, the tests and the proofs call only these, and pass what they
get through untouched. docs/your-model-and-data.md is the contract: what each returns, the mode the
model is in, and how to reach your module under DDP, FSDP and torch.compile (`unwrap`).

    build_model(cfg), build_datasets(cfg)      your model; (train, eval) map-style datasets
    to_device(batch, device)                   the batch on the device
    count_terms(batch), TERMS_PER_SAMPLE       the loss terms a batch holds; per sample, or None
    loss_sum(model, batch)                     the SUM of the loss over those terms (train mode)
    eval_sums(model, batch), metrics(totals)   per-sample sums (eval mode), and metrics from their totals
    MAIN_METRIC                                (name, "max" or "min"): what the run summary ranks by
    throughput(cfg, model)                     what a sample is worth in the log, and its FLOPs for MFU

Optional: collate(samples) (batches of any structure), eval_outputs(model, batch) with
dataset_metrics(cfg, outputs, reference) and reference_set(cfg, train_set) (metrics over the whole
evaluation set: mAP, kNN accuracy), LOSS_SPANS_RANKS (a loss that gathers other ranks' samples),
build_optimizer, build_scheduler, shard_units, build_records, from_records, pack_facts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
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

MAIN_METRIC = ("accuracy", "max")
TERMS_PER_SAMPLE = 1  # one label per sample


def count_terms(batch) -> int:
    _, targets = batch
    return len(targets)


def loss_sum(model: nn.Module, batch) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets, reduction="sum")


def eval_sums(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    inputs, targets = batch
    logits = model(inputs).float()
    return {
        "loss": F.cross_entropy(logits, targets, reduction="none"),
        "correct": (logits.argmax(dim=1) == targets).float(),
    }


def metrics(totals: dict[str, float]) -> dict[str, float]:
    return {"loss": totals["loss"] / totals["samples"], "accuracy": totals["correct"] / totals["samples"]}


def throughput(cfg: Config, model: nn.Module) -> Throughput:
    return Throughput()  # samples; no FLOPs estimate, so no MFU: it depends on the architecture
