"""Optimizer and learning-rate schedule, scaled for the global batch and stepped per optimizer step.

    optim.name: adamw | sgd | adafactor | task    task: task.build_optimizer(cfg, param_groups, lr)
    schedule.name: cosine | linear | constant | wsd | step | task    task: task.build_scheduler(...)

Every named schedule is linear warmup from ~0 to the batch-scaled lr, then one of: cosine decay
to lr x min_lr_ratio; linear decay to it; constant; warmup-stable-decay (constant, then a linear
decay over the last decay_fraction of the steps); or steps down by gamma at each milestone (shares
of the planned steps). `lr_factor` is the one formula: the scheduler applies it (LambdaLR), so a
resumed run continues it exactly from the step it restores. The loop keeps what is the same for
any optimizer: norms and biases in a group without weight decay, clipping, loss scaling and
accumulation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from .. import task
from ..base import optimizers, schedules
from ..base.rules import ConfigError

if TYPE_CHECKING:
    from ..config import Config, ScheduleConfig

ADAM_FAMILY = ("adamw", "adafactor")  # adaptive steps: the square-root scaling rule


def scaling_rule(rule: str, optimizer: str) -> str:
    """The LR scaling rule optim.lr_scaling names; auto follows the optimizer: linear for SGD, the
    square root for the Adam family (a linear jump is too aggressive for adaptive steps), none for
    an optimizer the task builds (its own lr is taken as it is)."""
    if rule != "auto":
        return rule
    return "linear" if optimizer == "sgd" else "sqrt" if optimizer in ADAM_FAMILY else "none"


def scaled_lr(lr: float, global_batch: int, reference_batch: int, rule: str) -> float:
    """The learning rate for `global_batch`, given one tuned at `reference_batch`, by `rule`
    (linear | sqrt | none; scaling_rule resolves auto)."""
    ratio = global_batch / reference_batch
    return {"linear": lr * ratio, "sqrt": lr * math.sqrt(ratio), "none": lr}[rule]


def warmup_fraction(setting: float | str, global_batch: int, reference_batch: int) -> float:
    """auto: 1% of the steps at the reference batch, one point more per doubling, at most 5%."""
    if setting != "auto":
        return float(setting)
    doublings = math.log2(max(1.0, global_batch / reference_batch))
    return min(0.05, 0.01 * (1 + doublings))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters in two groups: matrices decayed, norms and biases (1-d) not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: Config, lr: float) -> torch.optim.Optimizer:
    """optim.name's optimizer over the parameter groups, at `lr` (already scaled)."""
    groups, settings = parameter_groups(model, cfg.optim.weight_decay), cfg.optim
    if settings.name == "task":
        return task.build_optimizer(cfg, groups, lr)
    # one fused kernel for all parameters where torch has one: on CPU about 6x faster than the
    # multi-tensor loop for AdamW (ResNet-18's 11M parameters: 6 ms a step instead of 40)
    fused = next(model.parameters()).device.type in ("cuda", "cpu")
    options = {"betas": tuple(settings.betas), "momentum": settings.momentum, "nesterov": settings.nesterov}
    return optimizers.BUILDERS[settings.name](groups, lr, fused, **options)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: Config, total_steps: int, warmup_share: float
) -> LRScheduler:
    """schedule.name's schedule, stepped once per optimizer step."""
    if cfg.schedule.name == "task":
        return task.build_scheduler(cfg, optimizer, total_steps)
    warmup = warmup_steps(total_steps, warmup_share)
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, warmup, cfg.schedule))


def warmup_steps(total_steps: int, warmup_share: float) -> int:
    """Steps of linear warmup: none for a share of 0, else at least one."""
    return 0 if warmup_share == 0 else max(1, round(total_steps * warmup_share))


def lr_factor(step: int, total_steps: int, warmup: int, schedule: ScheduleConfig) -> float:
    """The learning rate of optimizer step `step` + 1 as a share of the peak (the batch-scaled lr)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    done = (step - warmup) / max(1, total_steps - warmup)  # 0 -> 1 after warmup
    shape = schedules.Shape(schedule.min_lr_ratio, schedule.decay_fraction, schedule.milestones, schedule.gamma)
    return schedules.AFTER_WARMUP[schedule.name](step, total_steps, done, shape)


def check(cfg: Config) -> None:
    """Before any collective, on every rank: the optimizer and schedule named can be built here."""
    if cfg.optim.name == "adafactor" and not hasattr(torch.optim, "Adafactor"):
        raise ConfigError(
            f"optim.name: adafactor needs torch>=2.5 (this is {torch.__version__}); use adamw or sgd, or upgrade torch"
        )
    for setting, function in (("optim.name", "build_optimizer"), ("schedule.name", "build_scheduler")):
        chosen = cfg.optim.name if setting == "optim.name" else cfg.schedule.name
        if chosen == "task" and not hasattr(task, function):
            raise ConfigError(
                f"{setting}: task, but task.py has no {function}; define it (docs/your-model-and-data.md) or "
                f"name a built-in one"
            )
