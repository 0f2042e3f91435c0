"""Where a run's outputs live: one map of the run directory (run.out_dir/run.name) that every
module asks, so no file name is spelled in two places.

    config.yaml            the resolved settings of the latest start
    metrics.jsonl          one record a line: log windows, evaluations, summaries (records.py)
    checkpoints/           step_00000500.pt ... (checkpoint.py), or step_00000500/ (sharded_checkpoint.py)
      superseded/          an earlier attempt's checkpoints after the step a run started from
    tensorboard/           event files (run.tensorboard)
    profile/               torch.profiler traces (run.profile_steps)
    tracking/              the tracked-run id and what each tracker took (run.trackers)
    evaluations/           what `tools.evaluate` measured, a file per checkpoint
"""

from __future__ import annotations

import os
from pathlib import Path

CHECKPOINT_GLOB = "step_*"


class RunDir:
    """The paths of one run's outputs under `root`."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def __fspath__(self) -> str:
        return str(self.root)

    def __str__(self) -> str:
        return str(self.root)

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int, sharded: bool = False) -> Path:
        """Step `step`'s checkpoint: a file, or a directory of every rank's part (`sharded`)."""
        return self.checkpoints / (f"step_{step:08d}" if sharded else f"step_{step:08d}.pt")

    def partial_checkpoint(self, step: int) -> Path:
        """Where step `step`'s sharded checkpoint is written before it is complete."""
        return self.checkpoints / f".step_{step:08d}.partial"

    def saved_checkpoints(self) -> list[Path]:
        """The complete checkpoints on disk, files and sharded directories, oldest first."""
        found = [p for p in self.checkpoints.glob(CHECKPOINT_GLOB) if p.suffix == ".pt" or p.is_dir()]
        return sorted(found, key=lambda path: (path.name.removesuffix(".pt"), path.suffix))

    @property
    def superseded(self) -> Path:
        return self.checkpoints / "superseded"

    def partial_checkpoints(self) -> list[Path]:
        """Sharded checkpoints whose write (or removal) never finished: never loaded; the next save clears them."""
        return sorted(self.checkpoints.glob(".step_*.partial"))

    def holds(self, checkpoint: str | os.PathLike) -> bool:
        """Whether `checkpoint` is one of this run's own (not another run's, passed by path)."""
        return Path(checkpoint).resolve().parent == self.checkpoints.resolve()

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def profile(self) -> Path:
        return self.root / "profile"

    @property
    def tracking(self) -> Path:
        return self.root / "tracking"

    @property
    def evaluations(self) -> Path:
        return self.root / "evaluations"
