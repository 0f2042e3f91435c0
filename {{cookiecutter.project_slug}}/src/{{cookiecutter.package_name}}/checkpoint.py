"""Complete, atomic, rank-0 checkpoints; auto-resume.

Layout under the run directory:
    checkpoints/step_00000500.pt   full training state at optimizer step 500
    checkpoints/latest             name of the newest complete checkpoint
A checkpoint file appears only once it is complete (written to a temporary file, fsynced,
renamed), so a crash at any moment leaves the previous ones intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from . import dist
from .dist import DistInfo
from .rules import ConfigError


@dataclass
class TrainState:
    """Everything needed to continue a run exactly where it stopped."""

    model: nn.Module  # the unwrapped, uncompiled module: its keys have no module./_orig_mod.
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch
    batch_in_epoch: int = 0  # micro-batches of this epoch already consumed
    tracked_run_id: str | None = None  # the W&B / MLflow run this training run continues (tools/tracking.py)

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "tracked_run_id": self.tracked_run_id,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.tracked_run_id = state.get("tracked_run_id")  # absent from checkpoints of runs without trackers


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


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save(state: TrainState, run_dir: Path, config: dict, info: DistInfo, keep_last: int) -> Path:
    """Write the full state from rank 0; every rank must call this (it holds collectives).

    Weights holding NaN or inf are never written (every rank finds them: DDP keeps the replicas
    equal), so the newest checkpoint is always one a run can continue from.
    """
    broken = nonfinite(state.model.state_dict())
    if broken:
        raise FloatingPointError(
            f"not writing the checkpoint of step {state.step}: {len(broken)} weights hold nan or inf "
            f"(e.g. {broken[0]}); the last checkpoint is kept: lower train.lr or lengthen the warmup"
        )
    rng_per_rank = dist.all_gather_objects(rng_state())  # collective: outside the rank-0 branch
    path = checkpoint_dir(run_dir) / f"step_{state.step:08d}.pt"
    if info.is_main:
        payload = state.state_dict() | {"rng": rng_per_rank, "config": config, "world_size": info.world_size}
        atomic_save(_to_cpu(payload), path)
        _atomic_write_text(path.parent / "latest", path.name)
        prune(path.parent, keep_last)
    dist.barrier()  # nobody moves on (or exits) before the checkpoint exists
    return path


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


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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


def prune(directory: Path, keep_last: int) -> None:
    for old in sorted(directory.glob("step_*.pt"))[:-keep_last]:
        old.unlink(missing_ok=True)


def load_file(path: str | Path) -> dict:
    """Load a checkpoint on CPU; weights_only refuses pickled code from an untrusted file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {path} does not exist; check checkpoint.resume") from None
    except Exception as err:
        raise ValueError(
            f"checkpoint {path} is unreadable ({type(err).__name__}: {err}); "
            "it may be truncated or not a checkpoint: pass another file or checkpoint.resume=auto"
        ) from err


def newest_loadable(run_dir: Path) -> tuple[Path | None, dict | None]:
    """The newest checkpoint of the run that loads and holds finite weights; corrupt or partial
    ones, and ones written after a non-finite loss (by an earlier version), are skipped."""
    for path in sorted(checkpoint_dir(run_dir).glob("step_*.pt"), reverse=True):
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
    return f"{path}: {len(broken)} of its weights hold nan or inf (e.g. {broken[0]}), written after a non-finite loss"


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


def shards_resume_problem(payload: dict, info: DistInfo, config: dict) -> str | None:
    """Why a run on packed shards cannot resume in the middle of the epoch it was written in, or None.

    Each rank skips the records it has read this epoch in the epoch's order: one shuffle of the
    records (no shards, or data.shards_order=shuffle) or chunk by chunk through one pack. Each
    rank's part of it depends on the world size. Another world size, or another order, would
    read some records twice and others never.
    """
    if not payload["batch_in_epoch"]:
        return None
    before, now = order_of(payload.get("config", {})), order_of(config)
    if before != now:
        return (
            f"was written in the middle of an epoch reading {describe_order(before)}, and this run reads "
            f"{describe_order(now)}; finish the epoch as it was written, or pass checkpoint.resume=never"
        )
    saved = payload.get("world_size", info.world_size)
    if not config.get("data", {}).get("shards") or saved == info.world_size:
        return None
    return (
        f"was written by {saved} ranks in the middle of an epoch of data.shards, and this run has "
        f"{info.world_size}: the epoch's remaining records would not be read exactly once; resume on {saved} "
        "ranks, or pass checkpoint.resume=never to start afresh"
    )


def order_of(config: dict) -> str | None:
    """The pack a run reads chunk by chunk (data.shards_order=chunks), or None for one shuffle of the records."""
    data = config.get("data", {})
    return data.get("shards") if data.get("shards") and data.get("shards_order", "chunks") == "chunks" else None


def describe_order(pack: str | None) -> str:
    return f"{pack} chunk by chunk" if pack else "the records in one shuffle (no data.shards, or shards_order=shuffle)"


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


def resume(state: TrainState, run_dir: Path, setting: str, info: DistInfo, config: dict | None = None) -> Path | None:
    """Restore `state` as `setting` says (auto | never | a path); returns the file used.

    Rank 0 chooses the file and every rank loads that same one, so ranks cannot disagree.
    Settings that differ from the checkpoint's `config` are listed in a note.
    """
    if setting == "never":
        return None
    if setting == "auto":
        chosen, payload = newest_loadable(run_dir) if info.is_main else (None, None)
        chosen = dist.broadcast_object(chosen)  # collective: all ranks, outside the branch
        if chosen is None:
            return None
        payload = payload or load_file(chosen)  # rank 0 loaded it while choosing
    else:
        chosen = Path(setting)
        payload = load_file(chosen)
        problem = nonfinite_problem(chosen, payload)
        if problem:
            raise ConfigError(f"checkpoint.resume: {problem}; pass an earlier checkpoint or checkpoint.resume=auto")
    mismatch = model_mismatch(state.model, payload["model"])
    if mismatch:
        raise ConfigError(
            f"checkpoint.resume: {chosen} holds another model ({mismatch}): the model settings changed since it "
            "was written; pass run.name=<a new name> to start a new run, or checkpoint.resume=never to start afresh"
        )
    problem = shards_resume_problem(payload, info, config or {})
    if problem:
        raise ConfigError(f"checkpoint.resume: {chosen.name} {problem}")
    state.load_state_dict(payload)
    changes = changed_settings(payload.get("config", {}), config or {})
    if changes:
        dist.print0(
            info,
            f"note: resuming {chosen.name} with settings changed since it was written: {', '.join(changes)}; "
            "the step, optimizer and learning-rate schedule continue from the checkpoint "
            "(a new run.name starts afresh)",
        )
    rngs = payload["rng"]
    set_rng_state(rngs[info.rank] if len(rngs) == info.world_size else rngs[0])
    return chosen


# how to load each export format for inference; neither needs this project's code
EXPORT_LOADERS = {
    "pt": "model.load_state_dict(torch.load(path, weights_only=True))",
    "safetensors": "model.load_state_dict(safetensors.torch.load_file(path))",
}


def export_weights(checkpoint: str | Path, output: str | Path, fmt: str | None = None) -> str:
    """Write only the model's weights, as a plain state_dict ("pt") or safetensors; returns the format.

    Without `fmt`, an output ending in .safetensors gets safetensors. Its metadata records the step,
    a digest of the training config and the torch version; safetensors holds no pickled objects.
    """
    payload = load_file(checkpoint)
    fmt = fmt or ("safetensors" if Path(output).suffix == ".safetensors" else "pt")
    if fmt == "safetensors":
        _save_safetensors(payload, output)
    else:
        torch.save(payload["model"], output)
    return fmt


def config_digest(config: dict) -> str:
    """sha256 of the config as sorted JSON: equal digests mean equal training settings."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def _save_safetensors(payload: dict, output: str | Path) -> None:
    try:
        from safetensors.torch import save_file  # optional: only this export needs it
    except ImportError:
        raise ImportError(
            "safetensors is not installed: pip install safetensors (the project's [export] extra), "
            "or export to a .pt file"
        ) from None
    metadata = {
        "format": "pt",  # what Hugging Face loaders check before reading a torch safetensors file
        "step": str(payload["step"]),
        "config_sha256": config_digest(payload["config"]),
        "torch_version": torch.__version__,  # of the export; the checkpoint does not record training's
    }
    save_file(_unshared(payload["model"]), str(output), metadata=metadata)


def _unshared(weights: dict) -> dict:
    """Contiguous tensors with a storage each: safetensors refuses tied weights (two names, one
    storage), so later names get a copy; load_state_dict fills the tied parameter from either."""
    seen, result = set(), {}
    for name, tensor in weights.items():
        storage = tensor.untyped_storage().data_ptr()
        result[name] = tensor.clone(memory_format=torch.contiguous_format) if storage in seen else tensor.contiguous()
        seen.add(storage)
    return result


def main(argv=None) -> int:
    """python -m {{ cookiecutter.package_name }}.checkpoint export CHECKPOINT OUTPUT [--format FORMAT]"""
    import argparse

    parser = argparse.ArgumentParser(description="Export a checkpoint's model weights for inference.")
    parser.add_argument("command", choices=["export"])
    parser.add_argument("checkpoint")
    parser.add_argument("output", help="a .safetensors name selects safetensors; any other a plain state_dict")
    parser.add_argument("--format", choices=sorted(EXPORT_LOADERS), help="overrides the choice by suffix")
    args = parser.parse_args(argv)
    try:
        fmt = export_weights(args.checkpoint, args.output, args.format)
    except ImportError as err:
        raise SystemExit(f"error: {err}") from None
    print(f"wrote {args.output}: load it with {EXPORT_LOADERS[fmt]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
