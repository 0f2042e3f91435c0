"""Complete, atomic checkpoints in either format; the one lookup of the checkpoint to load; auto-resume.

Each checkpoint holds the state after an optimizer step, under the parameters' names, so it
resumes under ddp or fsdp on any world size (rundir.py names them):
- checkpoint.format=full (the default under ddp): one file, step_00000500.pt, the whole state
  gathered to rank 0 and written by it to a temporary file, fsynced, renamed;
- checkpoint.format=sharded (the default under fsdp): a directory, step_00000500/, of every
  rank's part, published by a rename once complete (sharded_checkpoint.py).
Either way a crash at any moment leaves the previous ones intact.
`newest_loadable` and `find` are how every command finds the checkpoint to load; `choose` and
`restore` are how training resumes.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..base import dist, packs
from ..base.batching import unwrap
from ..base.dist import DistInfo
from ..base.rules import ConfigError
from ..base.rundir import RunDir
from ..config import renamed_note, upgrade
from . import sharded_checkpoint
from .callbacks import gathered, joined, split_tensors
from .state import TrainState


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


def save(
    model: nn.Module,
    state: TrainState,
    run_dir: RunDir,
    config: dict,
    info: DistInfo,
    keep_last: int,
    final: bool = False,
    asked: dict | None = None,
) -> Path:
    """Write the weights and the state in the run's format (`format_of`); every rank must call this
    (it holds collectives). A sharded checkpoint with checkpoint.async_save is written in the
    background, except the run's `final` one, which exists when this returns. `asked`: the
    settings as given, where another world size split the global batch anew (`config` is what
    runs); kept beside it, so that a later resume tells a setting the user changed from the split.

    Weights holding NaN or inf are never written (the ranks find them and every rank raises), so
    the newest checkpoint is always one a run can continue from.
    """
    if format_of(config) == "sharded":
        return save_sharded(model, state, run_dir, config, info, keep_last, final, asked)
    weights, optimizer = full_state(model, state.optimizer)
    refuse_nonfinite(dist.broadcast_object(nonfinite(weights) if info.is_main else None), state.step)
    rng_per_rank = dist.all_gather_objects(rng_state())  # collective: outside the rank-0 branch
    callback_state = gathered(state.callbacks.state_dict())  # a DTensor's gather is a collective too
    path = run_dir.checkpoint(state.step)
    if info.is_main:
        payload = {"model": weights, "optimizer": optimizer, "callbacks": callback_state} | state.state_dict()
        payload |= {"rng": rng_per_rank, "config": config, "world_size": info.world_size} | as_given(config, asked)
        payload["launch_dir"] = str(Path.cwd())  # where the settings' relative paths (dataset.dir, ...) start
        atomic_save(_to_cpu(payload), path)
        sharded_checkpoint.prune(run_dir, keep_last)  # either format: the newest keep_last stay
    dist.barrier()  # nobody moves on (or exits) before the checkpoint exists
    return path


def save_sharded(
    model: nn.Module,
    state: TrainState,
    run_dir: RunDir,
    config: dict,
    info: DistInfo,
    keep_last: int,
    final: bool,
    asked: dict | None = None,
) -> Path:
    """Every rank writes its part (sharded_checkpoint.py); rank 0 adds the state besides the tensors."""
    sharded_checkpoint.WRITES.wait()  # the previous one first: one write in flight, and its failure seen here
    # each rank's BatchNorm statistics are its own last batch's (DDP sends rank 0's at the next
    # forward, FSDP never), and DCP writes one rank's copy of a replicated tensor: make it rank 0's
    dist.broadcast_buffers(model)
    tensors = sharded_checkpoint.local_state(model, state.optimizer)
    callback_tensors, callback_values = split_tensors(state.callbacks.state_dict())
    if callback_tensors:  # each rank's shard of a callback's DTensors, as the weights'
        tensors["callbacks"] = callback_tensors
    broken = nonfinite(sharded_checkpoint.local_tensors(tensors["model"]))
    refuse_nonfinite(sorted({name for names in dist.all_gather_objects(broken) for name in names}), state.step)
    rng_per_rank = dist.all_gather_objects(rng_state())
    partial = sharded_checkpoint.prepare(run_dir, state.step, info)
    if info.is_main:
        payload = state.state_dict() | {"rng": rng_per_rank, "config": config, "world_size": info.world_size}
        payload |= as_given(config, asked) | {"launch_dir": str(Path.cwd()), "callbacks": callback_values}
        atomic_save(_to_cpu(payload), partial / sharded_checkpoint.STATE_FILE)
    background, timeout = config["checkpoint"]["async_save"] and not final, config["dist"]["timeout_minutes"]
    return sharded_checkpoint.write(tensors, partial, run_dir, state.step, info, keep_last, background, timeout)


def as_given(config: dict, asked: dict | None) -> dict:
    """The checkpoint's "asked" entry: the settings as given, where they differ from `config`."""
    return {} if asked is None or asked == config else {"asked": asked}


def settings_given(payload: dict) -> dict:
    """The settings the checkpoint's run was given (before another world size split its global
    batch anew): what a resume compares the settings it is given with."""
    return payload.get("asked", payload["config"])


def refuse_nonfinite(broken: list[str], step: int) -> None:
    """Raise on every rank (each holds the same `broken`) if any weight holds NaN or inf."""
    if broken:
        raise FloatingPointError(
            f"not writing the checkpoint of step {step}: {len(broken)} weights hold nan or inf "
            f"(e.g. {broken[0]}); the last checkpoint is kept: lower optim.lr or lengthen the warmup"
        )


def format_of(config: dict) -> str:
    """checkpoint.format, with auto resolved: sharded under fsdp (no rank can hold the whole
    state of the models fsdp is for), one gathered file under ddp."""
    chosen = config["checkpoint"]["format"]
    if chosen != "auto":
        return chosen
    return "sharded" if config["parallel"]["strategy"] == "fsdp" else "full"


def check(config: dict) -> None:
    """Before any collective, on every rank: the checkpoint settings fit together and can run here."""
    if format_of(config) == "sharded" and sharded_checkpoint.floor_problem():
        raise ConfigError(sharded_checkpoint.floor_problem())
    if config["checkpoint"]["async_save"] and format_of(config) != "sharded":
        raise ConfigError(
            "checkpoint.async_save: writes sharded checkpoints in the background; set checkpoint.format=sharded "
            "(the default under parallel.strategy=fsdp) or checkpoint.async_save=false"
        )


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(weights, optimizer state) of the whole model, keyed by the parameters' names: on rank 0's
    CPU under FSDP, where every rank takes part in gathering them and the others get empty dicts."""
    # imported here: torch.distributed.checkpoint is heavy, and only a save or a resume needs it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options) if dist.sharded(model) else unwrap(model).state_dict()
    return weights, get_optimizer_state_dict(model, optimizer, options=options)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, payload: dict) -> None:
    """The weights and optimizer state of a checkpoint into `model` and `optimizer`, whatever the
    strategy and world size that wrote it: every rank holds the file and keeps its own shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    if dist.sharded(model):
        set_model_state_dict(model, payload["model"], options=options)
    else:
        unwrap(model).load_state_dict(payload["model"])
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


def set_aside_later(run_dir: RunDir, step: int) -> list[str]:
    """Move the run's checkpoints of steps after `step`, the one this attempt starts from, into
    checkpoints/superseded/, with a note: an earlier attempt wrote them on a timeline this one
    abandons (a resume from an older checkpoint, or checkpoint.resume=never), and a crash of this
    attempt must not auto-resume onto it. Kept, not deleted; a name already there is an even older
    attempt's. Rank 0's work, before the first save."""
    later = [path for path in run_dir.saved_checkpoints() if step_of(path) > step]
    if not later:
        return []
    run_dir.superseded.mkdir(exist_ok=True)
    for path in later:
        target = run_dir.superseded / path.name
        if target.is_dir():  # no command reads this folder: no care for a removal cut short
            shutil.rmtree(target)
        target.unlink(missing_ok=True)
        os.replace(path, target)
    names = [path.name for path in later]
    print(
        f"note: {', '.join(names)}: written by an earlier attempt after step {step}, where this run starts; "
        f"moved to {run_dir.superseded} so that auto-resume never returns to them",
        flush=True,
    )
    return names


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_").removesuffix(".pt"))


def load_file(path: str | Path) -> dict:
    """Load a checkpoint on CPU; weights_only refuses pickled code from an untrusted file. Of a
    sharded checkpoint, its state.pt and the model's names and shapes: the weights stay on disk
    (`find` reads them whole for the commands, `restore` each rank's part)."""
    path = Path(path)
    if sharded_checkpoint.is_checkpoint(path):
        problem = sharded_checkpoint.read_problem(path)
        if problem:
            raise ValueError(problem)
        payload = _load(path / sharded_checkpoint.STATE_FILE)
        payload |= {"sharded": True, "model_shapes": sharded_checkpoint.model_shapes(path)}
    else:
        payload = _load(path)
    if "config" in payload:  # written before the settings' sections were regrouped: read in today's layout
        payload["config"], payload["renamed_settings"] = upgrade(payload["config"])
    if "asked" in payload:  # what a resume compares the settings it is given with: in the same layout
        payload["asked"] = upgrade(payload["asked"])[0]
    return payload


def _load(path: Path) -> dict:
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
    """Of a file's weights; a sharded checkpoint's were checked on every rank before it was written."""
    broken = nonfinite(payload["model"]) if "model" in payload else []
    if not broken:
        return None
    return f"{path}: {len(broken)} of its weights hold nan or inf (e.g. {broken[0]})"


def find(target: str | os.PathLike, weights: bool = True) -> tuple[Path, dict]:
    """The checkpoint `target` names, loaded: a run directory's newest loadable one, or the file
    (or sharded checkpoint directory) itself; a sharded one's whole weights read into "model"
    unless `weights` is False. A ConfigError naming the fix when there is none, or it is unusable."""
    path, payload = _found(Path(target))
    if weights and payload.get("sharded"):
        payload["model"] = sharded_checkpoint.full_weights(path)
    return path, payload


def ema_weights(path: Path, payload: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's weights with the EMA callback's average in place of each parameter (the
    buffers are the model's: loop/ema.py); a ConfigError if the run did not keep one."""
    if "ema" not in payload.get("callbacks", {}):
        raise ConfigError(f"{path} holds no EMA weights: the run did not have run.callbacks=[ema]")
    if payload.get("sharded"):
        shadow = sharded_checkpoint.full_weights(path, prefix="callbacks.ema.shadow.")
    else:
        shadow = payload["callbacks"]["ema"]["shadow"]
    return payload["model"] | shadow


def _found(target: Path) -> tuple[Path, dict]:
    if not target.exists():
        raise ConfigError(f"{target} does not exist: pass a run directory (runs/<name>) or a checkpoint")
    if target.is_dir() and not sharded_checkpoint.is_checkpoint(target):
        path, payload = newest_loadable(RunDir(target))
        if path is None:
            raise ConfigError(
                f"{target} holds no loadable checkpoint: pass a run directory (runs/<name>), a .pt file or a "
                "sharded checkpoint's directory"
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
    """How a checkpoint's weights (`saved`: names to tensors or shapes) differ from `model`'s in
    names and shapes, or None if they fit."""
    expected = {name: value.shape for name, value in model.state_dict().items()}
    saved = {name: getattr(value, "shape", value) for name, value in saved.items()}
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    reshaped = [k for k in expected if k in saved and tuple(expected[k]) != tuple(saved[k])]
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
        if info.is_main and run_dir.partial_checkpoints():
            unfinished = ", ".join(path.name for path in run_dir.partial_checkpoints())
            note = "an incomplete sharded checkpoint (a write or a removal cut short); not loaded"
            print(f"note: {unfinished}: {note}", flush=True)
        chosen = dist.broadcast_object(chosen)  # collective: all ranks, outside the branch
        if chosen is None:
            return None, None
        return chosen, payload or load_file(chosen)  # rank 0 loaded it while choosing
    try:
        return find(setting, weights=False)  # a sharded checkpoint: each rank reads its part in restore
    except ConfigError as err:
        raise ConfigError(f"checkpoint.resume: {err}") from None


def restore(
    model: nn.Module,
    state: TrainState,
    chosen: Path,
    payload: dict,
    info: DistInfo,
    config: dict,
    asked: dict | None = None,
) -> None:
    """The weights and `state` of the chosen checkpoint, whatever the strategy and world size that
    wrote it; the epoch goes on with the samples it has not read yet. `config` is the run's, `asked`
    the settings as given (default: `config`), before another world size split the global batch
    anew: those that differ from the settings the checkpoint's run was given are listed in a note."""
    mismatch = model_mismatch(unwrap(model), payload["model_shapes"] if payload.get("sharded") else payload["model"])
    if mismatch:
        raise ConfigError(
            f"checkpoint.resume: {chosen} holds another model ({mismatch}): the model settings changed since it "
            "was written; pass run.name=<a new name> to start a new run, or checkpoint.resume=never to start afresh"
        )
    problem = packs.resume_problem(payload, config)
    if problem:
        raise ConfigError(f"checkpoint.resume: {chosen.name} {problem}")
    saved_callbacks = payload.get("callbacks", {})  # absent from checkpoints before callbacks existed
    if payload.get("sharded"):
        # each rank reads its shard of the tensors of the callbacks the checkpoint holds a state for
        current = {name: part for name, part in state.callbacks.state_dict().items() if name in saved_callbacks}
        tensors = split_tensors(current)[0]
        sharded_checkpoint.load(model, state.optimizer, chosen, {"callbacks": tensors} if tensors else {})
        saved_callbacks = joined(tensors, saved_callbacks)
    else:
        load_full_state(model, state.optimizer, payload)
    state.load_state_dict(payload)
    fresh = state.callbacks.load_state_dict(saved_callbacks)
    if fresh:
        dist.print0(info, f"note: {chosen.name} holds no state of run.callbacks' {', '.join(fresh)}: they start afresh")
    state.continue_epoch_on(payload, info.world_size, config["data"]["batch_size"])
    renamed = renamed_note(payload.get("renamed_settings"), chosen.name, "its next checkpoint uses the new names")
    if renamed:
        dist.print0(info, renamed)
    changes = changed_settings(settings_given(payload), config if asked is None else asked)
    if changes:
        dist.print0(
            info,
            f"note: resuming {chosen.name} with settings changed since it was written: {', '.join(changes)}; "
            "the step and the optimizer's state continue from the checkpoint, the learning rate follows the "
            "schedule these settings plan from that step (a new run.name starts afresh)",
        )
    restore_generators(payload["rng"], info.rank, config["run"]["seed"])


def restore_generators(saved: list, rank: int, seed: int) -> None:
    """This rank's generators as the checkpoint's run left them (`saved`: one state for each rank
    of the world that wrote it); a rank that world did not have (a resume on more ranks) gets
    generators of its own, unlike any other rank's."""
    if rank < len(saved):
        set_rng_state(saved[rank])
    else:
        dist.seed_everything(seed + rank)
