"""What a run carries from step to step: the state a checkpoint saves besides the weights
(TrainState), and what the loop trains with (Job)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader

from .profiling import ProfileWindow, StepClock


@dataclass
class TrainState:
    """Everything besides the weights needed to continue a run exactly where it stopped."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch
    batch_in_epoch: int = 0  # micro-batches of this epoch each rank read on the current world size
    # this epoch's layouts before a resume on another world size or batch: [world size, samples each rank read]
    earlier_layouts: list = field(default_factory=list)
    tracked_run_id: str | None = None  # the W&B / MLflow run this training run continues (tracking.py)

    def state_dict(self) -> dict:
        """All but the optimizer's state, which full_state gathers under the parameters' names."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "earlier_layouts": self.earlier_layouts,
            "tracked_run_id": self.tracked_run_id,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.earlier_layouts = state.get("earlier_layouts", [])  # absent from checkpoints before it existed
        self.tracked_run_id = state["tracked_run_id"]

    def continue_epoch_on(self, saved: dict, world_size: int, batch_size: int) -> None:
        """A checkpoint written by `saved["world_size"]` ranks reading batches of
        `saved["config"]["data"]["batch_size"]` resumes on `world_size` ranks with `batch_size`: a
        change of either closes the epoch's layout at what each rank read (samplers.py)."""
        if not self.batch_in_epoch:
            return
        before = (saved["world_size"], saved["config"]["data"]["batch_size"])
        if before != (world_size, batch_size):
            self.earlier_layouts = [*self.earlier_layouts, [before[0], self.batch_in_epoch * before[1]]]
            self.batch_in_epoch = 0


@dataclass
class Job:
    """What the loop trains and with what; train.build makes it, train.fit runs it."""

    model: nn.Module  # the one handle: DDP(compiled(module)) or the sharded module; dist.bare() is the module
    state: TrainState  # optimizer, scheduler, scaler and the position in the run
    train_loader: DataLoader
    eval_loader: DataLoader
    total_steps: int  # optimizer steps of the whole run
    global_batch: int  # samples an optimizer step learns from, over every rank and micro-batch
    clock: StepClock  # where each step's time goes
    profiler: ProfileWindow | None  # run.profile_steps; None when off
    units: list[nn.Module]  # parallel.strategy=fsdp: the modules sharded one by one (task.shard_units)
    asked: dict | None = None  # the settings as given, before another world size split the global batch anew
    reference_loader: DataLoader | None = None  # task.reference_set's, for dataset_metrics; None without one
