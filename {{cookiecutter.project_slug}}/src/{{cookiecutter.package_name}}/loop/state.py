"""What a run carries from step to step: the state a checkpoint saves besides the weights
(TrainState), and what the loop trains with (Job)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from .callbacks import Callbacks, Run
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
    callbacks: Callbacks = field(default_factory=Callbacks)  # run.callbacks; their state is saved by checkpoint.py

    def state_dict(self) -> dict:
        """All but the optimizer's state, which full_state gathers under the parameters' names, and
        the callbacks' (tensors among it: checkpoint.py writes them with the weights' format)."""
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


@dataclass(kw_only=True)
class Job:
    """What the loop trains and with what; train.build makes it, train.fit runs it."""

    model: nn.Module  # the one handle: DDP(compiled(module)) or the sharded module; unwrap() is the module
    state: TrainState  # optimizer, scheduler, scaler, callbacks and the position in the run
    run: Run  # what the callbacks see of the run (loop/callbacks.py)
    train_loader: DataLoader
    eval_loader: DataLoader
    reference_loader: DataLoader | None = None  # task.reference_set's, for dataset_metrics; None without one
    total_steps: int  # optimizer steps of the whole run
    global_batch: int  # samples an optimizer step learns from, over every rank and micro-batch
    clock: StepClock  # where each step's time goes
    profiler: ProfileWindow | None = None  # run.profile_steps; None when off
    units: list[nn.Module] = field(default_factory=list)  # parallel.strategy=fsdp: the modules sharded one by one
    asked: dict | None = None  # the settings as given, before another world size split the global batch anew
    saved: tuple[int, Path] | None = None  # (step, path) of the last checkpoint on disk this attempt wrote
