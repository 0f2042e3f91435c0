"""Complete, atomic, rank-0 checkpoints; the one lookup of the checkpoint to load; auto-resume.

Each checkpoint is one file in the run directory's checkpoints/ (rundir.py), step_00000500.pt
for the state after optimizer step 500: the whole state under the parameters' names, gathered to
rank 0 under either strategy, so it resumes under ddp or fsdp on any world size. It appears
only once it is complete (written to a temporary file, fsynced, renamed), so a crash at any
moment leaves the previous ones intact.
`newest_loadable` and `find` are how every command finds the checkpoint to load.
"""

from __future__ import annotations

import os
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from . import dist, shards
from .dist import DistInfo
from .rules import ConfigError
from .rundir import RunDir


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


def rng_state() -> dict:
    """This rank's random generators, in types that weights_only loading accepts."""
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": np_state["state"]["pos"],
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(_as_tuples(state["python"]))
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def save(model: nn.Module, state: TrainState, run_dir: RunDir, config: dict, info: DistInfo, keep_last: int) -> Path:
    """Write the weights and the state from rank 0; every rank must call this (it holds collectives).

    Weights holding NaN or inf are never written (rank 0 finds them and every rank raises), so
    the newest checkpoint is always one a run can continue from.
    """
    weights, optimizer = full_state(model, state.optimizer)
    broken = dist.broadcast_object(nonfinite(weights) if info.is_main else None)
    if broken:
        raise FloatingPointError(
            f"not writing the checkpoint of step {state.step}: {len(broken)} weights hold nan or inf "
            f"(e.g. {broken[0]}); the last checkpoint is kept: lower train.lr or lengthen the warmup"
        )
    rng_per_rank = dist.all_gather_objects(rng_state())  # collective: outside the rank-0 branch
    path = run_dir.checkpoint(state.step)
    if info.is_main:
        payload = {"model": weights, "optimizer": optimizer} | state.state_dict()
        payload |= {"rng": rng_per_rank, "config": config, "world_size": info.world_size}
        atomic_save(_to_cpu(payload), path)
        prune(run_dir, keep_last)
    dist.barrier()  # nobody moves on (or exits) before the checkpoint exists
    return path


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(weights, optimizer state) of the whole model, keyed by the parameters' names: on rank 0's
    CPU under FSDP, where every rank takes part in gathering them and the others get empty dicts."""
    # imported here: torch.distributed.checkpoint is heavy, and only a save or a resume needs it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options) if dist.sharded(model) else dist.bare(model).state_dict()
    return weights, get_optimizer_state_dict(model, optimizer, options=options)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, payload: dict) -> None:
    """The weights and optimizer state of a checkpoint into `model` and `optimizer`, whatever the
    strategy and world size that wrote it: every rank holds the file and keeps its own shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    if dist.sharded(model):
        set_model_state_dict(model, payload["model"], options=options)
    else:
        dist.bare(model).load_state_dict(payload["model"])
    saved = payload["optimizer"]
    if any(isinstance(key, int) for group in saved["param_groups"] for key in group["params"]):
        optimizer.load_state_dict(saved)  # written by optimizer.state_dict(): positions, not names
    else:
        set_optimizer_state_dict(model, optimizer, saved, options=options)


def atomic_save(payload: dict, path: Path) -> None:
    """torch.save to a temporary file beside `path`, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    _fsync_dir(path.parent)


def nonfinite(weights: dict) -> list[str]:
    """Names of the floating-point tensors in `weights` that hold NaN or inf (one host sync)."""
    floats = {name: t for name, t in weights.items() if t.is_floating_point() and t.numel()}
    if not floats:
        return []
    finite = torch.stack([torch.isfinite(t).all() for t in floats.values()]).tolist()
    return [name for name, ok in zip(floats, finite, strict=True) if not ok]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def prune(run_dir: RunDir, keep_last: int) -> None:
    for old in run_dir.saved_checkpoints()[:-keep_last]:
        old.unlink(missing_ok=True)


def load_file(path: str | Path) -> dict:
    """Load a checkpoint on CPU; weights_only refuses pickled code from an untrusted file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {path} does not exist") from None
    except Exception as err:
        raise ValueError(
            f"checkpoint {path} is unreadable ({type(err).__name__}: {err}); "
            "it may be truncated or not a checkpoint: pass another file or checkpoint.resume=auto"
        ) from err


def newest_loadable(run_dir: RunDir) -> tuple[Path | None, dict | None]:
    """The newest checkpoint of the run that loads and holds finite weights, loaded; unreadable
    ones (a disk that filled up, a file cut short by hand) and ones whose weights are not finite
    are skipped with a warning."""
    for path in reversed(run_dir.saved_checkpoints()):
        try:
            payload = load_file(path)
        except ValueError as err:
            cause = f"{type(err.__cause__).__name__}: {err.__cause__}"
            warnings.warn(f"skipping {path}, which is unreadable ({cause}); trying the one before it", stacklevel=2)
            continue
        problem = nonfinite_problem(path, payload)
        if problem is None:
            return path, payload
        warnings.warn(f"skipping {problem}; trying the one before it", stacklevel=2)
    return None, None


def nonfinite_problem(path: Path, payload: dict) -> str | None:
    broken = nonfinite(payload["model"])
    if not broken:
        return None
    return f"{path}: {len(broken)} of its weights hold nan or inf (e.g. {broken[0]})"


def find(target: str | os.PathLike) -> tuple[Path, dict]:
    """The checkpoint `target` names, loaded: a run directory's newest loadable one, or the file
    itself. A ConfigError naming the fix when there is none, or the file is unusable."""
    target = Path(target)
    if not target.exists():
        raise ConfigError(f"{target} does not exist: pass a run directory (runs/<name>) or a checkpoint file")
    if target.is_dir():
        path, payload = newest_loadable(RunDir(target))
        if path is None:
            raise ConfigError(
                f"{target} holds no loadable checkpoint: pass a run directory (runs/<name>) or a .pt file"
            )
        return path, payload
    try:
        payload = load_file(target)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(str(err)) from None
    problem = nonfinite_problem(target, payload)
    if problem:
        raise ConfigError(f"{problem}; pass an earlier checkpoint, or the run directory for its newest loadable one")
    return target, payload


def model_mismatch(model: nn.Module, saved: dict) -> str | None:
    """How a checkpoint's weights differ from `model`'s in names and shapes, or None if they fit."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    reshaped = [k for k in expected if k in saved and expected[k].shape != saved[k].shape]
    if not (missing or unexpected or reshaped):
        return None
    counts = {"missing": missing, "unexpected": unexpected, "of another shape": reshaped}
    found = ", ".join(f"{len(keys)} {what}, e.g. {keys[0]}" for what, keys in counts.items() if keys)
    return f"parameters and buffers: {found}"


def changed_settings(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """`section.key old -> new` for each setting of `current` whose value differs from `saved`'s."""
    changes = []
    for key, value in current.items():
        name, before = f"{prefix}{key}", saved.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            changes += changed_settings(before, value, f"{name}.")
        elif key in saved and value != before and name != "checkpoint.resume":  # resume names this very file
            changes.append(f"{name} {before} -> {value}")
    return changes


def choose(run_dir: RunDir, setting: str, info: DistInfo) -> tuple[Path | None, dict | None]:
    """The checkpoint `setting` names (auto | never | a path) and its content, on every rank, or
    (None, None) to start afresh. Rank 0 chooses the file and every rank loads that same one, so
    ranks cannot disagree."""
    if setting == "never":
        return None, None
    if setting == "auto":
        chosen, payload = newest_loadable(run_dir) if info.is_main else (None, None)
        chosen = dist.broadcast_object(chosen)  # collective: all ranks, outside the branch
        if chosen is None:
            return None, None
        return chosen, payload or load_file(chosen)  # rank 0 loaded it while choosing
    try:
        return find(setting)
    except ConfigError as err:
        raise ConfigError(f"checkpoint.resume: {err}") from None


def restore(model: nn.Module, state: TrainState, chosen: Path, payload: dict, info: DistInfo, config: dict) -> None:
    """The weights and `state` of the chosen checkpoint, whatever the strategy and world size that
    wrote it; the epoch goes on with the samples it has not read yet. Settings that differ from the
    checkpoint's `config` are listed in a note."""
    mismatch = model_mismatch(dist.bare(model), payload["model"])
    if mismatch:
        raise ConfigError(
            f"checkpoint.resume: {chosen} holds another model ({mismatch}): the model settings changed since it "
            "was written; pass run.name=<a new name> to start a new run, or checkpoint.resume=never to start afresh"
        )
    problem = shards.resume_problem(payload, config)
    if problem:
        raise ConfigError(f"checkpoint.resume: {chosen.name} {problem}")
    load_full_state(model, state.optimizer, payload)
    state.load_state_dict(payload)
    state.continue_epoch_on(payload, info.world_size, config["data"]["batch_size"])
    changes = changed_settings(payload["config"], config)
    if changes:
        dist.print0(
            info,
            f"note: resuming {chosen.name} with settings changed since it was written: {', '.join(changes)}; "
            "the step and the optimizer's state continue from the checkpoint, the learning rate follows the "
            "schedule these settings plan from that step (a new run.name starts afresh)",
        )
    rngs = payload["rng"]
    if info.rank < len(rngs):
        set_rng_state(rngs[info.rank])
    else:  # a rank the writing world did not have: generators of its own, unlike any other rank's
        dist.seed_everything(config["run"]["seed"] + info.rank)


def resume(
    model: nn.Module, state: TrainState, run_dir: RunDir, setting: str, info: DistInfo, config: dict
) -> Path | None:
    """`choose` and `restore` in one: the checkpoint `setting` names into `model` and `state`;
    returns the file used, or None."""
    chosen, payload = choose(run_dir, setting, info)
    if chosen is not None:
        restore(model, state, chosen, payload, info, config)
    return chosen
