"""Resuming on another world size (a lost node, a smaller or bigger allocation, torchrun's
elastic restarts): the run keeps the checkpoint's global batch, so its optimization goes on as
planned, by choosing the per-device batch and accumulation steps the new world needs.

Model, optimizer and schedule reshard on load (checkpoint.py); the data carries over exactly
(samplers.py). When no split keeps the global batch, or checkpoint.allow_new_global_batch says
so, the learning rate follows the new global batch by the run's scaling rule (optim.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..base.rules import ConfigError

if TYPE_CHECKING:
    from ..config import Config
    from .state import TrainState


def saved_global_batch(payload: dict) -> int:
    settings = payload["config"]
    return settings["data"]["batch_size"] * payload["world_size"] * settings["train"]["grad_accum_steps"]


def given_split(payload: dict) -> tuple[int, int]:
    """(data.batch_size, train.grad_accum_steps) as the checkpoint's run was given them: its
    "asked" settings where another world size split the global batch anew (checkpoint.save)."""
    settings = payload.get("asked", payload["config"])
    return settings["data"]["batch_size"], settings["train"]["grad_accum_steps"]


def split(global_batch: int, world_size: int, largest_batch: int) -> tuple[int, int] | None:
    """(per-device batch, accumulation steps) that make `global_batch` on `world_size` ranks with
    the largest per-device batch up to `largest_batch` (fewest micro-batches), or None."""
    if global_batch % world_size:
        return None
    per_rank = global_batch // world_size
    for steps in range(1, per_rank + 1):
        if per_rank % steps == 0 and per_rank // steps <= largest_batch:
            return per_rank // steps, steps
    return None


def keep_global_batch(cfg: Config, payload: dict, world_size: int) -> tuple[Config, str | None]:
    """`cfg` with the per-device batch and accumulation that keep the checkpoint's global batch on
    `world_size` ranks (at most data.batch_size per device), and the start-up line saying so. On the
    checkpoint's world size `cfg` is unchanged, unless an earlier world size split the checkpoint's
    global batch anew and data.batch_size and train.grad_accum_steps are as its run was given them
    (a restart after an elastic one): the split goes on. Every rank computes the same, before any
    collective."""
    saved_world = payload["world_size"]
    batch, steps = cfg.data.batch_size, cfg.train.grad_accum_steps
    if saved_world == world_size and (batch, steps) != given_split(payload):
        return cfg, None  # changed since the checkpoint: the settings rule (restore's note lists them)
    wanted = saved_global_batch(payload)
    resumed = f"resumed on {world_size} rank{'s' if world_size > 1 else ''} from a {saved_world}-rank checkpoint"
    if batch * world_size * steps == wanted:
        kept = f"{resumed}: batch {batch} x {world_size} x accum {steps} keeps the global batch {wanted}"
        return cfg, None if saved_world == world_size else kept
    if cfg.checkpoint.allow_new_global_batch:
        now = batch * world_size * steps
        return cfg, (
            f"{resumed}: the global batch goes from {wanted} to {now} = batch {batch} x {world_size} x accum "
            f"{steps} (checkpoint.allow_new_global_batch), the lr rescaled by optim.lr_scaling"
        )
    fit = split(wanted, world_size, batch)
    if fit is None:  # the world size does not divide the global batch: no per-device batch can help
        worlds = [w for w in range(1, wanted + 1) if split(wanted, w, batch)][:8]
        raise ConfigError(
            f"checkpoint.resume: the checkpoint's global batch {wanted} ({saved_world} ranks x batch "
            f"{payload['config']['data']['batch_size']} x accum {payload['config']['train']['grad_accum_steps']}) "
            f"does not split over {world_size} ranks: resume on {', '.join(map(str, worlds))} ranks, or pass "
            "checkpoint.allow_new_global_batch=true to train on with the global batch this world gives"
        )
    batch, steps = fit
    cfg = replace(cfg, data=replace(cfg.data, batch_size=batch), train=replace(cfg.train, grad_accum_steps=steps))
    return cfg, f"{resumed}: batch {batch} x {world_size} x accum {steps} keeps the global batch {wanted}"


def rescale_lr(state: TrainState, peak_lr: float) -> None:
    """Make `peak_lr` (what this run's global batch scales optim.lr to) the loaded schedule's peak:
    the checkpoint's optimizer and schedule carry the peak of the global batch that wrote them.
    A task's own schedule is rescaled too: a chain's schedules (SequentialLR, ChainedScheduler)
    each, and the peak and floor OneCycleLR keeps in the optimizer's groups."""
    loaded = state.optimizer.param_groups[0]["initial_lr"]
    if loaded == peak_lr:
        return
    factor = peak_lr / loaded
    for scheduler in (state.scheduler, *getattr(state.scheduler, "_schedulers", ())):
        if hasattr(scheduler, "base_lrs"):  # SequentialLR has none of its own
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    for group in state.optimizer.param_groups:
        for key in ("initial_lr", "lr", "max_lr", "min_lr"):
            if key in group:
                group[key] *= factor
