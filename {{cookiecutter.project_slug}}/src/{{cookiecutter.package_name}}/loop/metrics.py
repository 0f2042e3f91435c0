"""The training log, exact across ranks (reduce sums and counts, never means): metrics.jsonl, the
console and the sinks (TensorBoard, the trackers) on rank 0. Evaluation's sums: evaluation.py."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from ..base import records, scalars
from ..base.batching import Throughput
from ..base.dist import DistInfo, all_gather_objects, all_reduce_sum

if TYPE_CHECKING:
    from .tensorboard import Board
    from .tracking import Trackers


def evaluation_line(record: dict) -> str:
    shown = " | ".join(f"{name} {value:.4f}" for name, value in records.eval_metrics(record).items())
    return f"eval step {record['step']} | epoch {record['epoch']} | {shown} | {record[records.EVAL_SAMPLES]} samples"


def named_text(values: dict[str, float]) -> str:
    """The named scalars (scalars.add) for a console line."""
    return "".join(f" | {name} {value:.4g}" for name, value in sorted(values.items()))


def summed_over_ranks(fields: dict, device: torch.device) -> dict:
    """Each of `fields` summed over ranks in one all-reduce, by name: a number (a float, a 0-d
    tensor) comes back a float, a list or a 1-d tensor a list of floats. The host's numbers go
    to the device in one copy."""
    on_device = {name: value for name, value in fields.items() if isinstance(value, torch.Tensor)}
    on_host = {name: value for name, value in fields.items() if name not in on_device}
    host = [float(x) for value in on_host.values() for x in (value if isinstance(value, list) else [value])]
    parts = [value.to(torch.float64).reshape(-1) for value in on_device.values()]
    flat = all_reduce_sum(torch.cat([*parts, torch.tensor(host, dtype=torch.float64).to(device)])).tolist()
    summed, at = {}, 0
    for name, value in [*on_device.items(), *on_host.items()]:
        size = value.numel() if isinstance(value, torch.Tensor) else len(value) if isinstance(value, list) else 1
        numbers, at = flat[at : at + size], at + size
        is_list = isinstance(value, list) or (isinstance(value, torch.Tensor) and value.dim() == 1)
        summed[name] = numbers if is_list else numbers[0]
    return summed


PROGRESS_EVERY_S = 10.0  # without a terminal: a step's line once the console has been quiet this long
ESTIMATE_AFTER = 3  # the attempt's steps before the first estimate (the first step carries the start-up)
ESTIMATE_OVER_S = 2.0  # the estimate line waits for this much time after the first step: fast steps vary


def duration_text(seconds: float) -> str:
    """A duration a person reads at a glance: 0.4 s, 42 s, 3 min 05 s, 2 h 07 min."""
    if seconds < 1:
        return f"{seconds:.2g} s"
    if seconds < 10:
        return f"{seconds:.1f} s"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class Progress:
    """Where rank 0's attempt stands: the steps done of the planned ones, the time a step takes
    after the first (which carries the start-up: compilation, the loader's workers, the first
    allocations) and so the time left. Reads the clock only; the caller makes it true on CUDA."""

    def __init__(self, first_step: int, total_steps: int):
        self.first_step, self.total_steps = first_step, total_steps
        self.step = first_step
        self.start = self.now = time.perf_counter()
        self.first_done: float | None = None  # when the attempt's first step ended
        self.estimated = False  # the estimate of the whole has been given

    def step_done(self) -> None:
        self.step += 1
        self.now = time.perf_counter()
        if self.first_done is None:
            self.first_done = self.now

    @property
    def done(self) -> int:
        """Steps this attempt has run."""
        return self.step - self.first_step

    def seconds_per_step(self) -> float | None:
        """The mean step after the attempt's first, once ESTIMATE_AFTER steps ran; else None."""
        if self.done < ESTIMATE_AFTER or self.first_done is None:
            return None
        return (self.now - self.first_done) / (self.done - 1)

    def seconds_left(self) -> float | None:
        per_step = self.seconds_per_step()
        return None if per_step is None else per_step * max(0, self.total_steps - self.step)

    def line(self, estimate: bool) -> str:
        """This step's line; with `estimate`, also the whole attempt's length as now foreseen."""
        where = f"step {self.step}/{self.total_steps}"
        per_step, left = self.seconds_per_step(), self.seconds_left()
        if per_step is None:
            return f"{where}: {duration_text(self.now - self.start)} so far (the first step includes the start-up)"
        line = f"{where}: {duration_text(per_step)} a step, about {duration_text(left)} left"
        if estimate:
            whole = self.now - self.start + left
            line += f"; the {self.total_steps - self.first_step} steps take about {duration_text(whole)}"
            line += " (evaluations and checkpoints come on top)"
        return line


@dataclass(frozen=True)
class Window:
    """A log window as every rank agrees on it, after one all-reduce: its record, and what the
    loop decides from it."""

    record: dict
    first_step: int  # the window's first optimizer step
    losses_finite: bool  # every loss of the window, on every rank, was finite
    stop_requested: bool  # a stop request (preemption.PreemptionFlag) reached at least one rank


class TrainingLog:
    """Loss, throughput and where the step time goes, over each log window, exact across ranks.

    `record()` runs every optimizer step and costs one device add and no host sync, except on rank 0
    for the first ESTIMATE_AFTER steps (their time makes the estimate). It moves the progress: a
    bar on a terminal; else a step's line whenever the console has been quiet PROGRESS_EVERY_S
    (every step of a slow run, from the first), and the estimate of the whole once ESTIMATE_AFTER
    steps and ESTIMATE_OVER_S have passed, when the run is not over by then. `flush()`
    ends the window: one all-reduce of its sums, the seconds of its phases (profiling.StepClock)
    and the ranks' stop requests (a collective: every rank calls it at the same step). It
    records and writes; what to do about the values (stop, a non-finite loss) the loop decides.
    Rank 0 appends every record to metrics.jsonl, writes it to TensorBoard when `board` is given,
    sends it to `trackers` (tracking.Trackers, rank 0's W&B/MLflow, or None), and prints the log,
    evaluation and summary lines. Use it as a context manager: leaving closes the bar and the
    board, and tells the trackers the run ended: finished (after `summary`), failed (an error) or
    preempted.
    """

    def __init__(
        self,
        info: DistInfo,
        jsonl_path,
        total_steps: int,
        first_step: int,
        board: Board | None = None,
        trackers: Trackers | None = None,
        throughput: Throughput | None = None,
        peak: tuple[float | None, str] = (None, "no peak figure given"),
    ):
        self.info = info
        self.throughput = throughput or Throughput()
        self.peak_flops, self.peak_source = peak  # one device's peak FLOP/s, and where it comes from
        self.jsonl_path = Path(jsonl_path)
        if info.is_main:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        self.board, self.trackers = board, trackers
        self.finished, self.final_checkpoint = False, None  # set by `summary`
        self.bar = tqdm(
            total=total_steps,
            initial=first_step,
            disable=not (info.is_main and sys.stderr.isatty()),
            dynamic_ncols=True,
        )
        self.progress = Progress(first_step, total_steps)
        self.last_line = time.perf_counter()  # when rank 0 last printed: a quiet console gets a step line
        self.evaluations: list[dict] = []
        self.first_step = first_step  # where this attempt began: 0, or a resumed checkpoint's step
        self.run_start, self.run_samples = time.perf_counter(), 0
        self.window_first_step = first_step + 1
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.info.device)
        self.grad_norm_sum = torch.zeros((), dtype=torch.float64, device=self.info.device)
        self.terms, self.samples, self.steps, self.norms = 0.0, 0, 0, 0
        self.named = scalars.Window(self.info.device, getattr(self, "named", None) and self.named.agreed)
        scalars.open_window(self.named)  # the task's and the callbacks' scalars.add go to this window
        self.window_start = time.perf_counter()

    def record(self, loss_sum: torch.Tensor, terms: float, samples: int, grad_norm: torch.Tensor | None = None) -> None:
        """One optimizer step of this rank: its summed loss (on the device), its loss terms, and the
        gradient norm clipping found (the same on every rank; None without clipping)."""
        self.loss_sum += loss_sum
        self.terms += terms
        self.samples += samples
        self.steps += 1
        if grad_norm is not None:
            self.grad_norm_sum += grad_norm
            self.norms += 1
        if self.info.is_main:
            self.step_progress()

    def step_progress(self) -> None:
        """Rank 0, after each step: the bar moves; without a terminal, a line when one is due."""
        progress = self.progress
        if self.info.device.type == "cuda" and progress.done < ESTIMATE_AFTER:
            torch.cuda.synchronize(self.info.device)  # the estimate's steps, timed as run, not as queued
        progress.step_done()
        self.bar.update(1)
        if not self.bar.disable:
            return  # the bar shows the steps, their rate and the time left
        left = progress.seconds_left()
        settled = left is not None and progress.now - progress.first_done >= ESTIMATE_OVER_S
        first_estimate = settled and not progress.estimated and left >= PROGRESS_EVERY_S
        quiet = time.perf_counter() - self.last_line >= PROGRESS_EVERY_S
        if first_estimate or quiet:
            self.print(progress.line(estimate=first_estimate))
            progress.estimated |= first_estimate

    def flush(self, step: int, epoch: int, lr: float, seconds: dict[str, float], stop_requested: bool) -> Window:
        """End the window at `step`: reduce it over ranks, write and print its record.
        `seconds`: this rank's time per phase in the window (StepClock.read())."""
        # each rank's own window: its phases fit in it, so their means over ranks fit in the mean window
        # (rank 0's alone is shorter than the others' by the time it spends writing the log)
        own_window = time.perf_counter() - self.window_start
        info, named = self.info, self.named
        fields = {
            "loss_sum": self.loss_sum,
            "grad_norm_sum": self.grad_norm_sum,
            "terms": self.terms,
            "samples": self.samples,
            "stops": float(stop_requested),
            "windows": own_window,
            "new_names": float(len(named.new_names())),
            "phases": list(seconds.values()),
            "peaks": self.peak_memory_slots(),
            "named": named.packed(named.agreed, info.rank, info.world_size),
        }
        total = summed_over_ranks(fields, info.device)
        scalar_values = scalars.unpacked(named.agreed, total["named"], info.world_size, total["terms"])
        if total["new_names"]:  # every rank sees the sum: all take this branch together
            scalar_values |= self.agree_on_new_names(total["terms"])
        phases = dict(zip(seconds, total["phases"], strict=True))  # seconds summed over ranks
        elapsed = total["windows"] / info.world_size  # the window's mean length over ranks
        samples = total["samples"]
        self.run_samples += int(samples)
        record = {
            "kind": records.TRAIN,
            "step": step,
            "epoch": epoch,
            "loss": total["loss_sum"] / max(total["terms"], 1.0),  # per loss term over every rank: exact
            "lr": lr,
            **({"grad_norm": total["grad_norm_sum"] / (self.norms * info.world_size)} if self.norms else {}),
            "samples_per_s": samples / elapsed,
            "data_wait_share": phases["data_wait"] / (elapsed * info.world_size),
            **self.split_ms(elapsed, phases),
            **dict(sorted(scalar_values.items())),
            "world_size": info.world_size,
            "start_step": self.first_step,  # a resumed attempt supersedes what was logged after it
            "elapsed_s": time.perf_counter() - self.run_start,  # since this attempt began
        }
        record |= self.speed(samples / elapsed)
        if total["peaks"]:
            record["peak_mem_gib"] = max(total["peaks"])
        self.write(record)
        self.progress.step = step  # the loop's count is the truth
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}", speed=self.speed_text(record))
        if self.bar.disable:
            norm = f" | grad norm {record['grad_norm']:.3g}" if "grad_norm" in record else ""
            self.print(
                f"step {step} | epoch {epoch} | loss {record['loss']:.4f}{norm} | lr {lr:.2e} | "
                f"{self.speed_text(record)} | data wait {record['data_wait_share']:.0%} | "
                f"{record['step_ms']:.1f} ms/step: fwd+bwd {record['fwd_bwd_ms']:.1f}, "
                f"optimizer {record['optimizer_ms']:.1f}, other {record['other_ms']:.1f}"
                f"{named_text(scalar_values)}{self.time_left()}"
            )
        # a sum is finite only if every term was: the window's losses on every rank are one number
        window = Window(record, self.window_first_step, math.isfinite(total["loss_sum"]), total["stops"] > 0)
        self.window_first_step = step + 1
        self.reset()
        return window

    def agree_on_new_names(self, terms: float) -> dict[str, float]:
        """The ranks' new scalar names, joined (one gather of the names, one sum of their values):
        from here on every rank packs them in every window. Returns their values in this window."""
        union: dict[str, str] = {}
        for names in all_gather_objects(self.named.new_names()):
            for name, kind in names.items():
                if union.setdefault(name, kind) != kind:
                    raise ValueError(
                        f"scalars.add({name!r}): the ranks add it with reduce={kind!r} and {union[name]!r}"
                    )
        info = self.info
        summed = all_reduce_sum(self.named.packed(union, info.rank, info.world_size)).tolist()
        self.named.agreed |= union
        return scalars.unpacked(union, summed, info.world_size, terms)

    def time_left(self) -> str:
        left = self.progress.seconds_left()
        return "" if left is None or left < PROGRESS_EVERY_S else f" | {duration_text(left)} left"

    def speed(self, samples_per_s: float) -> dict[str, float]:
        """Samples/s over every rank; the task's units/s; MFU: the model's FLOPs done per second
        as a share of the peak of every device, accumulation included (samples count them all)."""
        speed = {"samples_per_s": samples_per_s}
        unit, per_sample, flops = self.throughput.unit, self.throughput.per_sample, self.throughput.flops_per_unit
        if unit != "samples":
            speed[f"{unit}_per_s"] = samples_per_s * per_sample
        if flops is not None and self.peak_flops is not None:
            speed["mfu"] = samples_per_s * per_sample * flops / (self.peak_flops * self.info.world_size)
        return speed

    def mfu_note(self) -> str:
        """For the start-up report: what MFU is measured against, or why it is not."""
        if self.throughput.flops_per_unit is None:
            return "MFU n/a: task.throughput gives no FLOPs estimate"
        flops = f"{self.throughput.flops_per_unit:,.0f} training FLOPs per {self.throughput.unit.rstrip('s')}"
        if self.peak_flops is None:
            return f"{flops}; MFU n/a: {self.peak_source}"
        return f"{flops}; MFU against {self.peak_flops / 1e12:,.1f} TFLOPS per device ({self.peak_source})"

    def speed_text(self, record: dict, separator: str = " | ") -> str:
        unit = self.throughput.unit
        text = f"{record[f'{unit}_per_s']:,.0f} {unit}/s"
        return text + (f"{separator}mfu {record['mfu']:.1%}" if "mfu" in record else "")

    def split_ms(self, elapsed: float, phases: dict[str, float]) -> dict[str, float]:
        """Milliseconds per step, mean over ranks: the step, its phases, and the rest (logging,
        checkpoints, the loop itself). On CUDA the host's data wait can overlap device work, so
        the phases can add up to more than the step; the rest is then 0."""
        steps = max(self.steps, 1)
        split = {"step_ms": elapsed * 1000 / steps}
        split |= {f"{name}_ms": total * 1000 / (steps * self.info.world_size) for name, total in phases.items()}
        split["other_ms"] = max(0.0, split["step_ms"] - sum(split[f"{name}_ms"] for name in phases))
        return split

    def peak_memory_slots(self) -> list[float]:
        """On CUDA, this rank's peak memory (GiB) in its own slot of a world-sized vector: one sum
        over ranks gives every device's peak without another collective. Empty on CPU."""
        if self.info.device.type != "cuda":
            return []
        slots = [0.0] * self.info.world_size
        slots[self.info.rank] = torch.cuda.max_memory_allocated(self.info.device) / 2**30
        return slots

    def evaluation(self, step: int, epoch: int, results: dict) -> None:
        """Record and print one evaluation (`results`: records.evaluation's fields); rank 0 writes,
        every rank keeps the history."""
        self.evaluations.append({"kind": records.EVAL, "step": step, "epoch": epoch, **results})
        self.write(self.evaluations[-1])
        self.print(evaluation_line(self.evaluations[-1]))

    def summary(
        self,
        steps: int,
        main_metric: tuple[str, str],
        run_dir: Path,
        checkpoint: Path | None = None,
        stopped: str | None = None,
    ) -> str:
        """One line for the end of a run: steps, wall time, throughput, best and final evaluation,
        and why a callback stopped it (`stopped`). Also appended to metrics.jsonl as {"kind":
        "summary", "summary": {...}}. `checkpoint`: the final one, which the trackers upload if
        run.tracker_checkpoint asks."""
        self.finished, self.final_checkpoint = True, checkpoint
        wall = time.perf_counter() - self.run_start
        ran = steps - self.first_step  # a resumed attempt's wall time and speed are its own steps'
        summary = {"steps": steps, "attempt_steps": ran, "wall_s": wall, **self.speed(self.run_samples / wall)}
        timed = f" in {wall:.1f} s" if ran == steps else f", {ran} of them in this attempt's {wall:.1f} s"
        line = f"done: {steps} steps{timed} ({self.speed_text(summary, ', ')})"
        name, key = main_metric[0], records.EVAL_PREFIX + main_metric[0]
        scored = records.best_and_final(self.evaluations, main_metric)
        if scored:
            best, final = scored
            line += f"; eval {name}: best {best[key]:.4f} at step {best['step']}, final {final[key]:.4f}"
            summary |= {f"best_{key}": best[key], "best_step": best["step"], f"final_{key}": final[key]}
        if stopped:
            line, summary["stopped"] = f"{line}; stopped: {stopped}", stopped
        self.write({"kind": records.SUMMARY, "step": steps, "summary": summary})
        return f"{line}; outputs in {run_dir}"

    def write(self, record: dict) -> None:
        """On rank 0: append one JSON line, and the same record to TensorBoard and the trackers."""
        if self.info.is_main:
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if self.board is not None:
                self.board.write(record)
            if self.trackers is not None:
                self.trackers.write(record)

    def print(self, line: str) -> None:
        """A line on rank 0's console that does not break the progress bar."""
        if self.info.is_main:
            self.last_line = time.perf_counter()
            if self.bar.disable:
                print(line, flush=True)
            else:
                self.bar.write(line)

    def __enter__(self) -> TrainingLog:
        return self

    def __exit__(self, error_type, *_) -> None:
        self.close(failed=error_type is not None)

    def close(self, failed: bool = False) -> None:
        """Finish the progress bar and the TensorBoard file; end the tracked runs."""
        scalars.open_window(None)
        self.bar.close()
        if self.board is not None:
            self.board.close()
        if self.trackers is not None:
            status = "failed" if failed else "finished" if self.finished else "preempted"
            self.trackers.end(status, self.final_checkpoint)
