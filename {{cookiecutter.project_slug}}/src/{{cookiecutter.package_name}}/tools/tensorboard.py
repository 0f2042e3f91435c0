"""TensorBoard event files, written on rank 0: `tensorboard --logdir runs` shows every run.

TensorBoard is optional (`pip install tensorboard`, or the project's `viz` extra).
run.tensorboard=auto writes event files when it is installed, true insists on them (a config
error without it), false never writes them. Each run writes to out_dir/name/tensorboard/; a
resumed run appends there, and its writer purges the events past the checkpoint's step, which
the interrupted run had logged and the resumed run logs again, so no step appears twice.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .. import records
from ..dist import DistInfo, print0
from ..rules import ConfigError

INSTALL = "pip install tensorboard (or the project's viz extra)"


def installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def check(setting: bool | str) -> None:
    """On every rank, before any collective: run.tensorboard=true needs the package."""
    if setting is True and not installed():
        raise ConfigError(f"run.tensorboard: true, but tensorboard is not installed; {INSTALL}, or set it to false")


def tags(record: dict) -> dict[str, float]:
    """The TensorBoard scalars of one metrics.jsonl record, by tag."""
    kind = records.kind_of(record)
    if kind == records.TRAIN:
        scalars = {f"train/{key}": record[key] for key in ("loss", "lr", "samples_per_s", "data_wait_share")}
        return scalars | {f"time/{key}": value for key, value in record.items() if key.endswith("_ms")}
    if kind == records.EVAL:  # whatever task.metrics returns
        metrics = {key: value for key, value in record.items() if key.startswith("eval_") and key != "eval_samples"}
        return {f"eval/{key.removeprefix('eval_')}": value for key, value in metrics.items()}
    return {}


class Board:
    """A SummaryWriter for one run; `write` turns metrics records into scalars at their step."""

    def __init__(self, log_dir: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter  # the optional dependency, imported only when used

        # purge_step hides what an earlier attempt logged after this run's starting step
        self.writer = SummaryWriter(str(log_dir), purge_step=first_step + 1, flush_secs=30)

    def write(self, record: dict, extra: dict[str, float] | None = None) -> None:
        for tag, value in (tags(record) | (extra or {})).items():
            self.writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        self.writer.close()


def open_board(setting: bool | str, run_dir: Path, first_step: int, info: DistInfo) -> Board | None:
    """Rank 0's writer when run.tensorboard asks for one (and can have it); None elsewhere."""
    if not info.is_main or setting is False:
        return None
    if not installed():  # only reached with auto: check() stopped `true` before the run began
        print0(info, f"note: run.tensorboard=auto, and tensorboard is not installed: no event files; {INSTALL}")
        return None
    return Board(Path(run_dir) / "tensorboard", first_step)
