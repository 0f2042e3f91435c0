"""Sharded checkpoints (checkpoint.format=sharded, the default under fsdp): every rank writes
its own part with torch.distributed.checkpoint (DCP), so no rank ever holds the whole state, and
any world size, under either strategy, reads it back resharded.

    checkpoints/step_00000500/             complete: each rank's part (__<rank>_0.distcp), DCP's
                                           .metadata, and state.pt (step, schedule, RNGs, config)
    checkpoints/.step_00000500.partial/    being written: rank 0 renames it to the above once every
                                           rank's part and the metadata are on disk

No command loads a .partial directory; the next save removes it. With checkpoint.async_save the
loop waits only while the state is copied to CPU memory; the write goes on in a thread, over a
gloo process group of its own, and the next save (or the run's end) waits for it first.
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from ..base import dist
from ..base.rundir import RunDir

STATE_FILE = "state.pt"  # rank 0's part besides the tensors: what TrainState and the run need
FLOOR = (2, 8)  # DCP reads a whole checkpoint in one process of a group (no_dist) from here; fsdp's floor too
_FLOOR_NAME = ".".join(map(str, FLOOR))


def floor_problem(version: str = torch.__version__) -> str | None:
    """Why torch `version` cannot write sharded checkpoints here, or None."""
    if _at_floor(version):
        return None
    return (
        f"checkpoint.format: sharded needs torch>={_FLOOR_NAME} (this is {version}): pip install "
        f"'torch>={_FLOOR_NAME}', or use checkpoint.format=full"
    )


def read_problem(path: Path, version: str = torch.__version__) -> str | None:
    """Why torch `version` cannot read the sharded checkpoint `path` (an export or an evaluation
    on another machine than the run's), or None."""
    if _at_floor(version):
        return None
    return (
        f"{path} is a sharded checkpoint, which torch>={_FLOOR_NAME} reads (this is {version}): "
        f"pip install 'torch>={_FLOOR_NAME}'"
    )


def _at_floor(version: str) -> bool:
    return tuple(int(part) for part in version.split(".")[:2]) >= FLOOR


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is a complete sharded checkpoint (a run directory is not one)."""
    return (path / STATE_FILE).is_file() and (path / ".metadata").is_file()


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"model": ..., "optimizer": ...} as this rank holds them, keyed by the parameters' names:
    its shards under fsdp (DTensors), the whole replica under ddp (DCP writes each tensor once)."""
    # imported here: torch.distributed.checkpoint is heavy, and only a save or a resume needs it
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optimizer_state = get_state_dict(model, optimizer)
    return {"model": weights, "optimizer": optimizer_state}


def local_tensors(weights: dict) -> dict:
    """This rank's part of each tensor of `weights` (a DTensor's local shard)."""
    return {name: t.to_local() if hasattr(t, "to_local") else t for name, t in weights.items()}


def prepare(run_dir: RunDir, step: int, info: dist.DistInfo) -> Path:
    """The .partial directory step `step` is written into, made empty by rank 0, which first
    removes what a killed write left; every rank must call it (a barrier follows in `write`)."""
    partial = run_dir.partial_checkpoint(step)
    if info.is_main:
        for stale in run_dir.partial_checkpoints():
            shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir(parents=True)
    return partial


def write(
    state: dict, partial: Path, run_dir: RunDir, step: int, info, keep_last: int, background: bool, timeout: float
) -> Path:
    """Every rank writes its part of `state` into `partial` (rank 0 has written state.pt there);
    rank 0 publishes it as step `step`'s checkpoint once every part is on disk. In the background
    (`background`) this returns after the copy to CPU memory, the write's collectives bounded by
    `timeout` minutes; otherwise once the checkpoint exists."""
    import torch.distributed.checkpoint as dcp

    dist.barrier()  # rank 0 made the directory
    final = run_dir.checkpoint(step, sharded=True)

    def finish() -> None:
        if info.is_main:
            publish(partial, final, run_dir, keep_last)

    if not background:
        with quiet_alone():
            dcp.save(state, checkpoint_id=partial)  # alone (no group): DCP writes as one process
        finish()
        dist.barrier()  # nobody moves on (or exits) before the checkpoint exists
        return final
    with quiet_alone():
        group = WRITES.group(timeout)
        response = dcp.async_save(state, checkpoint_id=partial, process_group=group)
    WRITES.start(getattr(response, "upload_completion", response), finish, final)
    return final


def publish(partial: Path, final: Path, run_dir: RunDir, keep_last: int) -> None:
    """Rank 0, once every part is on disk: the checkpoint under its name, then the oldest go. A
    checkpoint of the same step (a run resumed from an earlier one got here again) is replaced."""
    _fsync_dir(partial)  # its entries on disk before its name: a power cut must not publish a part
    if final.exists():
        removed(final)
    os.replace(partial, final)  # atomic: auto-resume sees the whole checkpoint or none of it
    _fsync_dir(final.parent)
    prune(run_dir, keep_last)


class BackgroundWrite:
    """The one write in flight (checkpoint.async_save), its own process group, and how it ended."""

    def __init__(self):
        self._group = None
        self._done = threading.Event()
        self._done.set()
        self._error: BaseException | None = None
        self._path: Path | None = None

    def group(self, timeout_minutes: float):
        """A gloo group for the writes' collectives, apart from the loop's and with its timeout (a
        peer that died fails the write instead of holding this rank); made by every rank at the
        first background save (a collective: all ranks reach it together)."""
        if self._group is None and torch.distributed.is_initialized():
            timeout = timedelta(minutes=timeout_minutes)
            self._group = torch.distributed.new_group(backend="gloo", timeout=timeout)
        return self._group

    def start(self, future, finish, path: Path) -> None:
        self._done.clear()
        self._error, self._path = None, path

        def finished(done) -> None:  # in the writer's thread; rank 0 renames once every part is written
            try:
                done.result()
                finish()
            except BaseException as err:  # reported by wait(), on the loop's thread
                self._error = err
            finally:
                self._done.set()

        future.add_done_callback(finished)

    def close(self, timeout_minutes: float) -> None:
        """At the run's end, however it ended: a write still in flight (the run failed during
        it) finishes, or fails within the collective timeout, before the loop's group goes; then
        the writers' group is freed, so no gloo thread of it lives into interpreter shutdown. No
        collective: after a failure the peers may be anywhere."""
        self._done.wait(timeout=timeout_minutes * 60 + 30)
        if self._group is not None and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group(self._group)
        self._group, self._error, self._path = None, None, None

    def wait(self) -> None:
        """Wait for the write in flight; every rank raises if it failed on any rank (a collective:
        every rank calls it at the same point, before a save and at the run's end)."""
        self._done.wait()
        error, path, self._error, self._path = self._error, self._path, None, None
        summary = error and cause(error)
        failed = [problem for problem in dist.all_gather_objects(summary) if problem]
        if failed:
            raise RuntimeError(
                f"the background write of checkpoint {path.name if path else ''} failed ({failed[0]}); it was not "
                "published, and auto-resume picks the checkpoint before it: check the disk (space, permissions)"
            )


WRITES = BackgroundWrite()


def cause(error: BaseException) -> str:
    """A failed write in one line: DCP's CheckpointException holds each failing rank's exception
    with its traceback, of which the first rank's exception says what happened (a full disk, a
    peer gone)."""
    failures = getattr(error, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if failures:
        rank = min(failures)
        exception = failures[rank][0]
        return f"on rank {rank}: {type(exception).__name__}: {exception}"
    return f"{type(error).__name__}: {error}"


def load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, more: dict | None = None) -> None:
    """A sharded checkpoint's weights and optimizer state into `model` and `optimizer`, each rank
    reading the parts it needs, whatever the world size and strategy that wrote them; `more`: other
    tensors it holds beside them (the callbacks'), read in place into the tensors given."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = local_state(model, optimizer) | (more or {})
    with quiet_alone():
        dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def model_shapes(directory: Path) -> dict[str, torch.Size]:
    """The names and shapes of the model's parameters and buffers in a sharded checkpoint, from
    its metadata (nothing else is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(directory).read_metadata().state_dict_metadata
    return {key.removeprefix("model."): item.size for key, item in metadata.items() if key.startswith("model.")}


def full_weights(directory: Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The whole model's weights of a sharded checkpoint in this process (the optimizer's state
    is not read): for evaluate, export, sample and the tests, on any world size or alone. Another
    `prefix`: the tensors under it (callbacks.ema.shadow.: the EMA weights)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(directory).read_metadata().state_dict_metadata
    weights = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.items()
        if key.startswith(prefix) and hasattr(item, "size")
    }
    with quiet_alone():
        dcp.load(weights, checkpoint_id=directory, no_dist=True)
    return {key.removeprefix(prefix): tensor for key, tensor in weights.items()}


@contextmanager
def quiet_alone():
    """Without DCP's warning that a process without a group saves or loads alone: that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def prune(run_dir: RunDir, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints of either format."""
    for old in run_dir.saved_checkpoints()[:-keep_last]:
        if old.is_dir():
            removed(old)
        else:
            old.unlink(missing_ok=True)


def removed(directory: Path) -> None:
    """Delete a sharded checkpoint: first renamed to a .partial name (not its own: a new write
    of the same step may be there), so that a removal cut short leaves a directory no command
    loads and the next save clears, never a checkpoint with parts missing."""
    doomed = directory.with_name(f".{directory.name}.old.partial")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(directory, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
