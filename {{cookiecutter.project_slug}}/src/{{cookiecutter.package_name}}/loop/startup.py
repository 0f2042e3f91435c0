"""The run's start-up report: what a reader of the log must know before the first step, on rank 0."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..base import dist, hardware
from ..base.batching import unwrap
from ..base.dist import DistInfo
from . import loaders, optim, parallel
from .metrics import TrainingLog
from .state import Job

if TYPE_CHECKING:
    from ..config import Config, OptimConfig, TrainConfig


def report(cfg: Config, info: DistInfo, job: Job, log: TrainingLog, resumed) -> None:
    """On rank 0: the world, the global batch, the lr and where it comes from, the optimizer and
    schedule, the planned steps, precision, the parameters and the memory they take, MFU, and
    whether the run resumed; then the notes on precision and the loader workers."""
    params = sum(p.numel() for p in job.model.parameters())
    lr = job.state.optimizer.param_groups[0]["initial_lr"]  # the schedule's peak: the batch-scaled lr
    warmup = optim.warmup_fraction(cfg.schedule.warmup_fraction, job.global_batch, cfg.optim.reference_batch_size)
    dist.print0(
        info,
        f"world size {info.world_size} ({info.local_world_size} per node), backend {info.backend}, "
        f"device {info.device}\n"
        f"global batch {job.global_batch} = {cfg.data.batch_size} per device x {info.world_size} ranks x "
        f"{cfg.train.grad_accum_steps} accumulation steps\n"
        f"{lr_line(cfg.optim, lr, job.global_batch)}\n"
        f"{optimizer_text(cfg.optim)}, {cfg.schedule.name} schedule, {warmup_text(warmup)}, "
        f"{planned_steps(cfg.train, job.total_steps)}\n"
        f"precision {cfg.train.precision}, compile {cfg.train.compile}, activation checkpointing "
        f"{cfg.parallel.activation_checkpointing}, loader workers per rank {loaders.describe_workers(job.train_loader)}"
        "\n"
        f"parameters {params:,}; {memory_line(cfg, info, job.model, job.units)}\n"
        f"{log.mfu_note()}\n" + (f"resumed from {resumed} at step {job.state.step}" if resumed else "starting fresh"),
    )
    workers_note = loaders.worker_start_note(cfg.data, job.train_loader)
    for note in (hardware.precision_note(cfg.train.precision, info.device), workers_note):
        if note:
            dist.print0(info, note)


def lr_line(settings: OptimConfig, lr: float, global_batch: int) -> str:
    """The peak lr and where it comes from: the rule that scaled it, and how to turn that off."""
    rule, tuned = optim.scaling_rule(settings.lr_scaling, settings.name), settings.lr
    reference = settings.reference_batch_size
    if rule == "none" or global_batch == reference:
        return f"lr {lr:.3g} (optim.lr, tuned at batch {reference}; global batch {global_batch}: not scaled)"
    why = f"optim.lr_scaling=auto for {settings.name}" if settings.lr_scaling == "auto" else "optim.lr_scaling"
    return (
        f"lr {lr:.3g}: optim.lr {tuned:g} tuned at batch {reference}, scaled {rule} ({why}) to the global batch "
        f"{global_batch}; optim.lr_scaling=none keeps {tuned:g}"
    )


def optimizer_text(settings: OptimConfig) -> str:
    """The optimizer and the settings of it that shape every step: SGD's momentum (0.9 here by
    default; torch's own default is 0) and Nesterov, AdamW's betas."""
    if settings.name == "sgd":
        return f"sgd optimizer (momentum {settings.momentum:g}{', Nesterov' if settings.nesterov else ''})"
    if settings.name == "adamw":
        return f"adamw optimizer (betas {settings.betas[0]:g}, {settings.betas[1]:g})"
    return f"{settings.name} optimizer"


def warmup_text(warmup: float) -> str:
    return f"warmup {warmup:.1%} of the steps" if warmup else "no warmup (schedule.warmup_fraction=0)"


def planned_steps(settings: TrainConfig, total_steps: int) -> str:
    """The run's length, naming the setting that ends it when train.max_steps is never reached."""
    epochs, max_steps = settings.epochs, settings.max_steps
    if max_steps and total_steps < max_steps:
        return f"{total_steps} steps (train.epochs={epochs} ends before train.max_steps={max_steps})"
    return f"{total_steps} steps"


def memory_line(cfg: Config, info: DistInfo, model: nn.Module, units: list[nn.Module]) -> str:
    """The static memory per device (weights, gradients, optimizer state) under the run's strategy,
    the model sharded in `units` under fsdp."""
    bare = unwrap(model)
    mib = parallel.static_memory_bytes(bare, units, cfg, info.world_size) / 2**20
    whole = f"static memory per device ~{mib:.1f} MiB (the whole model, gradients and optimizer state)"
    if cfg.parallel.strategy == "ddp":
        return f"strategy ddp: {whole}"
    if not info.distributed:
        return f"strategy fsdp in a world of one, nothing to shard: {whole}"
    return (
        f"strategy fsdp on {info.world_size} ranks, {len(units)} units: static memory per device ~{mib:.1f} MiB "
        f"(a 1/{info.world_size} share, {parallel.gathered(cfg.parallel, cfg.train.grad_accum_steps)})"
    )


def nothing_to_train(cfg: Config, step: int, total_steps: int) -> str:
    return (
        f"nothing to train: {cfg.run_dir} is at step {step}, and train.epochs / train.max_steps plan "
        f"{total_steps}; raise one of them to train on, or pass run.name=NEW for a new run "
        f"(results so far: {cfg.run_dir.metrics})"
    )
