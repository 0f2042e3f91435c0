"""Test models for the diagnostics, a checkpoint of either format read whole, a resume in one call,
and a callback the launched runs name (tests/ is on their path)."""

import tempfile
from pathlib import Path

import torch
from torch import nn

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.base import scalars
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.base.rundir import RunDir
from {{ cookiecutter.package_name }}.loop import callbacks, checkpoint
from {{ cookiecutter.package_name }}.loop.callbacks import Callback
from {{ cookiecutter.package_name }}.loop.state import TrainState


class WithUnusedHead(nn.Module):
    """The project's model plus an auxiliary head that the forward pass never calls; to the task's
    functions it is the project's model: calls and attribute reads pass through to it."""

    def __init__(self, cfg):
        super().__init__()
        self.body = task.build_model(cfg)
        self.aux_head = nn.Linear(4, 3)

    def forward(self, *inputs, **options):  # whatever the task's functions call the model with
        return self.body(*inputs, **options)

    def __getattr__(self, name: str):  # and what they read of the module (a state's size, a config)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("body"), name)


def model_with_unused_head(cfg):
    return WithUnusedHead(cfg)


def whole_checkpoint(path: Path) -> dict:
    """Everything a checkpoint holds, in one dict, whichever its format: a sharded one's parts
    joined with DCP's own converter (weights, the optimizer's state by parameter name, and the
    callbacks' state, its tensors and the rest together)."""
    payload = checkpoint.load_file(path)
    if not payload.get("sharded"):
        return payload
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        joined = Path(scratch) / "whole.pt"
        dcp_to_torch_save(path, joined)
        tensors = torch.load(joined, weights_only=True)
    # the callbacks' tensors were written with the weights, the rest of their state in state.pt
    return (
        payload | tensors | {"callbacks": callbacks.joined(tensors.get("callbacks", {}), payload.get("callbacks", {}))}
    )


def resume(
    model: nn.Module, state: TrainState, run_dir: RunDir, setting: str, info: DistInfo, config: dict
) -> Path | None:
    """checkpoint.choose and checkpoint.restore in one, as train.run calls them: the checkpoint
    `setting` names into `model` and `state`; returns the file used, or None."""
    chosen, payload = checkpoint.choose(run_dir, setting, info)
    if chosen is not None:
        checkpoint.restore(model, state, chosen, payload, info, config)
    return chosen


class RankScalars(Callback):
    """Scalars that differ by rank: one only rank 1 adds, and each rank's number (the max is the last's)."""

    def after_step(self, run):
        if run.info.rank == 1:  # a name one rank adds and the others never do: no collective here
            scalars.add("rank_one_steps", 1.0, reduce="sum")
        scalars.add("highest_rank", float(run.info.rank), reduce="max")
        scalars.add("mean_rank", float(run.info.rank))
