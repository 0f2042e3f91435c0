"""The best k checkpoints by a metric (run.callbacks=[best_checkpoints], the `best_checkpoints`
section), kept in checkpoints/best/ beside the newest checkpoint.keep_last ones.

An evaluation that ranks among the best best_checkpoints.keep asks for a checkpoint of its step
(written once, with the step's regular one if both are due); once it is on disk it is hard-linked
(copied where links cannot be made) into checkpoints/best/, and the one it pushed out of the
best is removed from there. The keep-last rule never touches best/, and auto-resume never reads
it: a run continues from its newest checkpoint. The ranking is in every checkpoint: a resume
from an older one moves what best/ got after it to checkpoints/superseded/best/.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .callbacks import Callback, Run, metric_goal, metric_value

SECTION = "best_checkpoints"


class BestCheckpoints(Callback):
    section = SECTION

    def __init__(self, metric: str, mode: str, keep: int):
        (self.metric, self.goal), self.keep = metric_goal(SECTION, metric, mode), keep
        self.ranked: list[list] = []  # [step, value], best first
        self.pending: int | None = None  # the step whose checkpoint this asked for, linked once written

    def on_start(self, run: Run) -> None:
        if not run.info.is_main:
            return
        set_aside_unranked(best_dir(run), {step for step, _ in self.ranked}, run)
        for step, _ in self.ranked:  # ranked, but the attempt that ranked it ended before linking it
            written = [run.run_dir.checkpoint(step, sharded) for sharded in (False, True)]
            for path in written:
                if path.exists() and not (best_dir(run) / path.name).exists():
                    linked(path, best_dir(run) / path.name)

    def after_evaluation(self, run: Run, metrics: dict[str, float]) -> None:
        value = metric_value(SECTION, self.metric, metrics)
        step = run.state.step
        ranked = sorted([*self.ranked, [step, value]], key=lambda entry: entry[1], reverse=self.goal == "max")
        if [step, value] not in ranked[: self.keep]:
            return
        self.ranked, self.pending = ranked[: self.keep], step
        run.request_checkpoint()

    def after_checkpoint(self, run: Run, path: Path) -> None:
        if self.pending != run.state.step:
            return
        self.pending = None
        if run.info.is_main:
            linked(path, best_dir(run) / path.name)
            set_aside_unranked(best_dir(run), {step for step, _ in self.ranked}, run, removed=True)

    def state_dict(self) -> dict:
        return {"ranked": [list(entry) for entry in self.ranked], "metric": self.metric}

    def load_state_dict(self, state: dict) -> None:
        if state["metric"] == self.metric:  # another metric ranks afresh
            self.ranked = [list(entry) for entry in state["ranked"]]


def best_dir(run: Run) -> Path:
    return run.run_dir.checkpoints / "best"


def set_aside_unranked(directory: Path, ranked: set[int], run: Run, removed: bool = False) -> None:
    """Rank 0: the entries of best/ outside `ranked` go: removed (pushed out of the best: their
    checkpoint was kept there only for its rank), or (`removed` False: an earlier attempt's, on a
    timeline this one left) moved to checkpoints/superseded/best/."""
    for path in sorted(directory.glob("step_*")):
        if int(path.name.removeprefix("step_").removesuffix(".pt")) in ranked:
            continue
        if removed:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            continue
        target = run.run_dir.superseded / "best" / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
        os.replace(path, target)
        print(f"note: {path.name} was among the best after the step this run resumed from: moved to {target}")


def linked(source: Path, target: Path) -> None:
    """`target` the same file or directory tree as `source`, by hard links (a copy where they
    cannot be made: another file system), whole or not at all: built under a .partial name."""
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True) if partial.is_dir() else partial.unlink(missing_ok=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, partial, copy_function=link_or_copy)
    else:
        link_or_copy(source, partial)
    if target.is_dir():
        shutil.rmtree(target)
    os.replace(partial, target)


def link_or_copy(source, target) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
