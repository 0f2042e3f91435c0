"""TensorBoard event files, written on rank 0: `tensorboard --logdir runs` shows every run.

TensorBoard is optional (the project's viz extra). run.tensorboard=auto writes event files when it
is installed, true insists on them (a config error without it), false never writes them. Each run
writes to its run directory's tensorboard/; a resumed run appends there, and its writer purges
the events past the checkpoint's step, which the interrupted run had logged and the resumed run
logs again, so no step appears twice. The scalars are the ones every sink shows (records.scalars).
"""

from __future__ import annotations

from ..base import extras, records
from ..base.dist import DistInfo, print0
from ..base.rundir import RunDir


def check(setting: bool | str) -> None:
    """On every rank, before any collective: run.tensorboard=true needs the package."""
    if setting is True and not extras.installed("tensorboard"):
        raise extras.missing("tensorboard", "run.tensorboard=true")


class Board:
    """A SummaryWriter for one run; `write` turns metrics records into scalars at their step."""

    def __init__(self, run_dir: RunDir, first_step: int):
        from torch.utils.tensorboard import SummaryWriter  # the optional dependency, imported only when used

        # purge_step hides what an earlier attempt logged after this run's starting step
        self.writer = SummaryWriter(str(run_dir.tensorboard), purge_step=first_step + 1, flush_secs=30)

    def write(self, record: dict) -> None:
        for tag, value in records.scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        self.writer.close()


def open_board(setting: bool | str, run_dir: RunDir, first_step: int, info: DistInfo) -> Board | None:
    """Rank 0's writer when run.tensorboard asks for one (and can have it); None elsewhere."""
    if not info.is_main or setting is False:
        return None
    if not extras.installed("tensorboard"):  # only reached with auto: check() stopped `true` before the run began
        print0(
            info,
            f"note: run.tensorboard=auto, and tensorboard is not installed: no event files; "
            f"{extras.install_line('tensorboard')}",
        )
        return None
    return Board(run_dir, first_step)
