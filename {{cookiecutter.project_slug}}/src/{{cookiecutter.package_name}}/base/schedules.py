"""The named learning-rate schedules after warmup, each a share of the peak lr: the one list of
their names (schedule.name takes these, or task), which loop/optim.py applies and the tests read.

Each takes the optimizer step (from 0), the planned steps, the share of the steps after warmup
done (0 -> 1) and the schedule's shape.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Shape(NamedTuple):
    floor: float  # the share of the peak that cosine, linear and wsd decay to
    decay_fraction: float  # wsd: the share of the steps that decays, at the end
    milestones: list[float]  # step: shares of the planned steps where the lr drops
    gamma: float  # step: the factor of each drop


def cosine(step: int, total_steps: int, done: float, shape: Shape) -> float:
    return shape.floor + (1 - shape.floor) * (1 + math.cos(math.pi * done)) / 2


def linear(step: int, total_steps: int, done: float, shape: Shape) -> float:
    return 1 - (1 - shape.floor) * done


def constant(step: int, total_steps: int, done: float, shape: Shape) -> float:
    return 1.0


def wsd(step: int, total_steps: int, done: float, shape: Shape) -> float:
    """Warmup-stable-decay: constant, then linear to the floor over the last decay_fraction of the steps."""
    decay = max(1, round(total_steps * shape.decay_fraction))
    into_decay = (step - (total_steps - decay)) / decay
    return 1.0 if into_decay < 0 else 1 - (1 - shape.floor) * into_decay


def steps_down(step: int, total_steps: int, done: float, shape: Shape) -> float:
    passed = sum(step >= round(total_steps * share) for share in shape.milestones)
    return shape.gamma**passed


AFTER_WARMUP = {"cosine": cosine, "linear": linear, "constant": constant, "wsd": wsd, "step": steps_down}
