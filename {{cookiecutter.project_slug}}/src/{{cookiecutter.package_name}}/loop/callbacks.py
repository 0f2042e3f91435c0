"""Callbacks: code of yours that runs at named moments of the loop, on every rank, enabled by
name in run.callbacks (docs/extending.md walks through writing one).

    run.callbacks: [ema, best_checkpoints, early_stopping, weight_norm:WeightNorm]

A built-in by its name (loop/ema.py, loop/best_checkpoints.py, loop/early_stopping.py, each with
its own config section), or MODULE:CLASS for one of yours: MODULE in your room's callbacks/ folder
(src/<package>/callbacks/MODULE.py), else any importable module by its full name.

The moments, in a run's order. Every rank calls each at the same point of the run, so a
collective (an all-reduce, a DTensor's full_tensor) is allowed where it is called on every rank;
never inside `if run.info.is_main`, where it waits for ranks that never come (until
dist.timeout_minutes ends the job).

    from_config(cfg)              build it from the whole Config (by default: its `section`'s values
                                  as keywords, or no arguments)
    setup(run)                    the model wrapped, the optimizer built, before a resume: make your state
    load_state_dict(state)        on a resume: what state_dict gave when that checkpoint was written
    on_start(run)                 after a resume (run.state.step is where it continues), before a step
    after_step(run)               after each optimizer step, counted in run.state.step; it runs every step:
                                  keep it cheap (no host sync, no collective unless it must)
    models_to_evaluate(run)       at each evaluation, after the model's own: yield (prefix, model) pairs;
                                  each is evaluated like the model and its metrics named prefix/metric
    after_evaluation(run, metrics)  every metric of the evaluation by name (accuracy, ema/accuracy), the
                                  same numbers on every rank: decide from them without a collective
    after_checkpoint(run, path)   a checkpoint of run.state.step is on disk at `path` (one the loop
                                  writes in the background, checkpoint.async_save, does not come here)
    on_end(run, outcome)          the attempt's end (outcome: why it ended), after its last checkpoint
    state_dict()                  at each checkpoint: tensors (DTensors under fsdp stay sharded in a
                                  sharded checkpoint, are gathered in a full one) and plain values
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..base.rules import ConfigError

if TYPE_CHECKING:
    from ..base.dist import DistInfo
    from ..base.rundir import RunDir
    from ..config import Config

PACKAGE = __package__.rpartition(".")[0]  # the project's package: a user's MODULE is looked up in its callbacks/
BUILT_IN = {  # name in run.callbacks -> module:class under loop/
    "ema": "ema:EMA",
    "best_checkpoints": "best_checkpoints:BestCheckpoints",
    "early_stopping": "early_stopping:EarlyStopping",
}


@dataclass
class Run:
    """What a callback sees of the run: the same objects the loop trains with."""

    model: nn.Module  # the wrapped model (DDP, FSDP, compiled); unwrap(run.model) is your module
    state: Any  # the run's TrainState (loop/state.py, which builds on this file): optimizer, scheduler, step, epoch
    info: DistInfo  # rank, world size, device
    run_dir: RunDir  # the run's outputs (checkpoints/, metrics.jsonl)
    total_steps: int  # the optimizer steps planned
    stop_reason: str | None = None  # set by stop(): the loop ends after the moment that asked
    checkpoint_requested: bool = False  # set by request_checkpoint(), cleared once it is written

    def request_checkpoint(self) -> None:
        """Write a checkpoint of this step once every callback's after_evaluation ran (so that it
        holds their state as they left it), on disk before the next step; after_checkpoint tells
        where. Ask on every rank (a checkpoint is written by all)."""
        self.checkpoint_requested = True

    def stop(self, reason: str) -> None:
        """End the run after this moment, with `reason` in its summary; call it on every rank (the
        loop ends on each, so decide from what every rank sees, such as an evaluation's metrics)."""
        self.stop_reason = reason


class Callback:
    """A callback does nothing at every moment until it says otherwise; override what you need.
    `section`: the config section its constructor takes as keywords (the built-ins'), or None."""

    section: str | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> Callback:
        return cls(**vars(getattr(cfg, cls.section))) if cls.section else cls()

    def setup(self, run: Run) -> None:
        pass

    def on_start(self, run: Run) -> None:
        pass

    def after_step(self, run: Run) -> None:
        pass

    def models_to_evaluate(self, run: Run) -> Iterator[tuple[str, nn.Module]]:
        return iter(())

    def after_evaluation(self, run: Run, metrics: dict[str, float]) -> None:
        pass

    def after_checkpoint(self, run: Run, path: Path) -> None:
        pass

    def on_end(self, run: Run, outcome: str) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Callbacks:
    """The run's callbacks by their names in run.callbacks, called in that order."""

    def __init__(self, named: dict[str, Callback] | None = None):
        self.named = dict(named or {})

    @classmethod
    def from_config(cls, cfg: Config) -> Callbacks:
        return cls({name: resolve(name).from_config(cfg) for name in cfg.run.callbacks})

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.named.values())

    def __bool__(self) -> bool:
        return bool(self.named)

    def state_dict(self) -> dict:
        return {name: callback.state_dict() for name, callback in self.named.items()}

    def load_state_dict(self, saved: dict) -> list[str]:
        """Each callback's saved state back; returns the names the checkpoint had no state for
        (enabled since it was written: they start afresh)."""
        for name, callback in self.named.items():
            if name in saved:
                callback.load_state_dict(saved[name])
        return [name for name in self.named if name not in saved]

    def models_to_evaluate(self, run: Run) -> Iterator[tuple[str, nn.Module]]:
        """Every callback's (prefix, model) pairs; each callback's own clean-up (a restore of the
        weights it swapped in) runs when its pairs are done, or the evaluation failed."""
        for callback in self:
            pairs = iter(callback.models_to_evaluate(run))
            try:
                yield from pairs
            finally:
                getattr(pairs, "close", lambda: None)()


def resolve(name: str) -> type[Callback]:
    """The class run.callbacks' `name` names; a ConfigError saying what to fix otherwise."""
    spec = f"{__package__}.{BUILT_IN[name]}" if name in BUILT_IN else name
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise ConfigError(
            f"run.callbacks: {name!r} is neither a built-in ({', '.join(BUILT_IN)}) nor MODULE:CLASS; "
            f"e.g. weight_norm:WeightNorm for the class WeightNorm in src/{PACKAGE}/callbacks/weight_norm.py"
        )
    module = import_callback_module(name, module_name)
    found = getattr(module, class_name, None)
    if not (isinstance(found, type) and issubclass(found, Callback)):
        raise ConfigError(
            f"run.callbacks: {name!r}: {module.__name__} has no Callback subclass {class_name!r} "
            f"(subclass {__package__}.callbacks.Callback)"
        )
    return found


def import_callback_module(name: str, module_name: str):
    """MODULE from the project's callbacks/ folder first, else by its full name."""
    candidates = [module_name] if module_name.startswith(PACKAGE + ".") else [f"{PACKAGE}.callbacks.{module_name}"]
    candidates += [module_name] if module_name not in candidates else []
    for candidate in candidates:
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as err:
            if err.name is None or not candidate.startswith(err.name):
                raise  # the module exists, and an import inside it failed: that error is the one to see
    raise ConfigError(
        f"run.callbacks: {name!r}: no module {' or '.join(candidates)}; put the class in "
        f"src/{PACKAGE}/callbacks/{module_name}.py"
    )


def metric_goal(section: str, metric: str, mode: str) -> tuple[str, str]:
    """(metric, "min" or "max") for a section's `metric` and `mode` settings: main is the task's
    MAIN_METRIC; mode auto takes MAIN_METRIC's goal for it (also under a prefix: ema/accuracy),
    min for a name ending in loss, and asks otherwise."""
    from .. import task  # the loop's view of your room

    main_name, main_goal = task.MAIN_METRIC
    metric = main_name if metric == "main" else metric
    if mode != "auto":
        return metric, mode
    if metric.rpartition("/")[2] == main_name:
        return metric, main_goal
    if metric.endswith("loss"):
        return metric, "min"
    raise ConfigError(f"{section}.mode: auto cannot tell whether more {metric} is better; set min or max")


def metric_value(section: str, metric: str, metrics: dict[str, float]) -> float:
    """`metrics`' value of the section's metric; a ConfigError naming the evaluation's metrics if absent."""
    if metric not in metrics:
        raise ConfigError(
            f"{section}.metric: the evaluation has no metric {metric!r}; it gives {', '.join(sorted(metrics))}"
        )
    return metrics[metric]


def check(names: list[str]) -> None:
    """Every name in run.callbacks resolves (its module imports), before any collective."""
    for name in names:
        resolve(name)


def gathered(state):
    """`state` with every DTensor gathered whole (a collective: every rank calls it), for a full
    checkpoint; plain tensors and values as they are."""
    if isinstance(state, dict):
        return {key: gathered(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(gathered(value) for value in state)
    return state.full_tensor() if hasattr(state, "full_tensor") else state


def split_tensors(state: dict) -> tuple[dict, dict]:
    """(the tensors of `state`, the rest), each nested like `state`: a sharded checkpoint writes
    the tensors with the weights (each rank its shard) and the rest with rank 0's state.pt."""
    tensors, plain = {}, {}
    for key, value in state.items():
        if isinstance(value, dict):
            tensors[key], plain[key] = split_tensors(value)
            if not tensors[key]:
                del tensors[key]
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            plain[key] = value
    return tensors, plain


def joined(tensors: dict, plain: dict) -> dict:
    """`split_tensors` undone."""
    both = dict(plain)
    for key, value in tensors.items():
        both[key] = joined(value, plain.get(key, {})) if isinstance(value, dict) else value
    return both


def into_layout(saved: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A saved tensor in the layout of `like`: a whole one split into `like`'s shards when `like`
    is a DTensor (a full checkpoint resumed under fsdp; a collective), else on `like`'s device."""
    if hasattr(like, "device_mesh") and not hasattr(saved, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(saved.to(like.device, like.dtype), like.device_mesh, like.placements)
    return saved.to(like.device, like.dtype)
