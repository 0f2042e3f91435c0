"""The named optimizers: the one list of their names (optim.name takes these, or task), each built
over the loop's parameter groups at the batch-scaled lr (loop/optim.py), read by the tests too.
Each takes every optimizer's options and uses its own."""

from __future__ import annotations

import torch


def adamw(groups: list[dict], lr: float, fused: bool, betas: tuple, momentum: float, nesterov: bool):
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)


def sgd(groups: list[dict], lr: float, fused: bool, betas: tuple, momentum: float, nesterov: bool):
    # multi-tensor, not fused: fused SGD takes every momentum buffer at once and fails (TypeError)
    # once a parameter gets its first gradient after others had theirs, as a routed model's expert does
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov, foreach=True)


def adafactor(groups: list[dict], lr: float, fused: bool, betas: tuple, momentum: float, nesterov: bool):
    return torch.optim.Adafactor(groups, lr=lr, foreach=True)  # loop/optim.py's check: torch>=2.5 has it


BUILDERS = {"adamw": adamw, "sgd": sgd, "adafactor": adafactor}
