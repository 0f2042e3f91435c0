"""Where the time goes: each step split into phases, and torch.profiler traces on demand.

The split (StepClock) runs every step at the cost of two clock reads per phase. What it can
separate depends on the device:
- data wait: the host waiting for the loader, on the host clock everywhere;
- forward + backward and optimizer: the host clock on CPU; on CUDA the host only queues
  kernels, so these are CUDA events recorded on the stream and read at the log step, after
  the log's reduction has synchronised anyway: no synchronisation is added to any step;
- communication: DDP all-reduces gradients while backward still runs, and backward returns
  only when the last bucket is reduced, so the exposed (not overlapped) all-reduce is inside
  forward + backward on every backend. `diagnose scaling` separates it: forward + backward
  on N processes minus on 1 process is the communication and contention the N processes add.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from ..base.dist import DistInfo, print0
from ..base.rundir import RunDir

PHASES = {"data_wait": "data wait", "fwd_bwd": "forward+backward", "optimizer": "optimizer"}  # timed per step
# a step's time as metrics.jsonl splits it: the phases, and the rest (logging, checkpoints, the loop)
SPLIT = {**{f"{phase}_ms": label for phase, label in PHASES.items()}, "other_ms": "other"}


class HostPhase:
    """`with phase:` adds the host time of the block to the clock's seconds."""

    __slots__ = ("name", "seconds", "start")

    def __init__(self, name: str, seconds: dict):
        self.name, self.seconds = name, seconds

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.seconds[self.name] += time.perf_counter() - self.start


class EventPhase:
    """`with phase:` records a pair of CUDA events around the block; read later, at the log step."""

    __slots__ = ("name", "clock", "start")

    def __init__(self, name: str, clock: StepClock):
        self.name, self.clock = name, clock

    def __enter__(self):
        self.start = self.clock.event()

    def __exit__(self, *exc):
        self.clock.pending.append((self.name, self.start, self.clock.event()))


class StepClock:
    """Seconds this rank spent in each phase since the last `read()`. Use `with clock.fwd_bwd:`."""

    def __init__(self, device: torch.device):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.spare: list[torch.cuda.Event] = []  # read events, recorded again instead of made anew
        self.data_wait = HostPhase("data_wait", self.seconds)
        on_gpu = device.type == "cuda"
        self.fwd_bwd = EventPhase("fwd_bwd", self) if on_gpu else HostPhase("fwd_bwd", self.seconds)
        self.optimizer = EventPhase("optimizer", self) if on_gpu else HostPhase("optimizer", self.seconds)

    def event(self) -> torch.cuda.Event:
        event = self.spare.pop() if self.spare else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def read(self) -> dict[str, float]:
        """The seconds per phase since the last read, and a fresh start."""
        if self.pending:
            self.pending[-1][2].synchronize()  # the stream's last event: every earlier one is done too
        for name, start, end in self.pending:
            self.seconds[name] += start.elapsed_time(end) / 1000  # milliseconds
            self.spare += (start, end)
        self.pending.clear()
        seconds = dict(self.seconds)
        self.seconds.update(dict.fromkeys(PHASES, 0.0))
        return seconds


class ProfileWindow:
    """A torch.profiler trace of the optimizer steps after step `start` up to step `stop`.

    `after_step(step)` runs after every optimizer step; outside the window it compares two
    integers. The trace is Chrome trace JSON: Perfetto (ui.perfetto.dev) and chrome://tracing
    open it, and its name ends in .pt.trace.json, which TensorBoard's profiler plugin lists.
    """

    def __init__(self, start: int, stop: int, path: Path, info: DistInfo, shown: str):
        self.start, self.stop, self.path, self.info = start, stop, path, info
        self.shown = shown  # what rank 0 prints: its own trace, or where every rank's are
        self.profiler, self.last = None, start

    def after_step(self, step: int) -> None:
        self.last = step
        if step == self.start:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.info.device.type == "cuda" else [])
            # with a schedule (here: record throughout) the profiler marks each step in the trace
            self.profiler = profile(activities=activities, record_shapes=True, schedule=lambda _: ProfilerAction.RECORD)
            self.profiler.step_num = step + 1  # so the trace's ProfilerStep#N is optimizer step N
            self.profiler.__enter__()
        elif step == self.stop:
            self.close()
        elif self.profiler is not None:
            self.profiler.step()  # ends ProfilerStep#step in the trace, begins the next

    def close(self) -> None:
        """Write the trace if the window is open (also when the run ends inside it)."""
        if self.profiler is None:
            return
        self.profiler.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.path))
        self.profiler = None
        print0(self.info, f"profiler trace of steps {self.start + 1}-{self.last}: {self.shown} (open it in Perfetto)")


def profile_window(steps: list | None, ranks: str, run_dir: RunDir, info: DistInfo) -> ProfileWindow | None:
    """The run's profiler window from run.profile_steps and run.profile_ranks; None when off."""
    if steps is None or (ranks == "main" and not info.is_main):
        return None
    folder = run_dir.profile
    shown = folder / ("rank0.pt.trace.json" if ranks == "main" else "rank*.pt.trace.json")
    return ProfileWindow(steps[0], steps[1], folder / f"rank{info.rank}.pt.trace.json", info, str(shown))
