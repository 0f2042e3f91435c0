"""The task seam: everything that depends on what you train is here, in model.py and in data.py.

The training loop, the smoke check and the diagnostics never name a loss or a batch layout;
they call only these:

    build_model(cfg)          -> nn.Module                                 (model.py)
    build_datasets(cfg)       -> (train, eval) map-style datasets          (data.py)
    to_device(batch, device)  -> the batch on the device
    count_terms(batch)        -> how many loss terms the batch holds (samples, valid tokens, ...)
    TERMS_PER_SAMPLE          -> the terms every sample holds, or None when the count varies
    loss_sum(model, batch)    -> the SUM of the loss over those terms: a scalar tensor
    eval_sums(model, batch)   -> {name: tensor of shape (samples,)}: per-sample sums
    metrics(totals)           -> {name: value} from those sums over the whole eval set, plus
                                 totals["samples"], the number of eval samples
    MAIN_METRIC               -> (name, "max" or "min"): what the run summary ranks by
    throughput(cfg, model)    -> what a sample is worth in the log: units (tokens...) and FLOPs, for MFU

and, optionally, an optimizer or schedule of your own (optim.name=task, schedule.name=task):

    build_optimizer(cfg, param_groups, lr) -> torch.optim.Optimizer over the parameter groups
                                 (norms and biases already without weight decay; lr already scaled)
    build_scheduler(cfg, optimizer, total_steps) -> an LRScheduler, stepped once per optimizer step

and, optionally, for a model sharded over the ranks (parallel.strategy=fsdp) or recomputed in backward
(parallel.activation_checkpointing):

    shard_units(model)        -> the modules to shard and recompute one by one (a transformer's blocks);
                                 a module holding a tied weight stays out of them (the root keeps it);
                                 None or no function: the largest ModuleList's children, else the model's

and, optionally, for packed shards (the pack command, then data.shards; see packs.py):

    build_records(cfg)        -> (train, eval) sets of the raw records a pack stores (encoded images, ...);
                                 without it the pack stores build_datasets' samples as they are
    from_records(cfg, train, eval) -> (train, eval) datasets of samples over packed record sets
                                 (decode, augment); without it the records are the samples
    pack_facts(cfg)           -> {name: value}: what the task reads from its source data and must
                                 know without it (class names, a vocabulary size), kept in the pack

Why sums and counts: the loop divides the summed loss by the number of terms over every
rank and micro-batch of the optimizer step, so the gradient is that of one process on the
union of the batches even when ranks hold different numbers of terms (padding, masks);
a mean of per-rank means would weigh a rank with few terms as much as one with many.
Counting the terms of every rank costs one small all-reduce per step; a task whose samples
all hold the same number of terms sets TERMS_PER_SAMPLE and the loop skips it (and checks
the count it declares on every step).
Evaluation sums per sample so the loop can drop the samples DistributedSampler repeats.
`count_terms` is called on the batch as the loader yields it, before it moves to the device.

The model these functions get: only loss_sum and eval_sums call the model, so its forward takes
whatever they pass it (a state, keyword arguments, a dict), and everything else (the start-up
check, the smoke check, diagnose, the tests, the proofs) calls those two. They get the model as
the loop wrapped it: DDP around your module (around torch.compile's, with train.compile), the
module sharded in place under parallel.strategy=fsdp, your module in a world of one, and before
training, on the CPU, a wrapper that stands for them. Call the model itself to run it: the
wrapper's forward is what reduces gradients (DDP) and gathers shards (FSDP). Read your module's
attributes and call its other methods through `unwrap(model)` (from batching.py), the one way to
reach it under every wrapper: `unwrap(model).init_hidden(len(batch))`; make such a state on the
batch's device rather than from a parameter, which under fsdp is a shard. `throughput` and
`shard_units` get your module itself.
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
