"""Metrics that are exact across ranks: reduce sums and counts, never means."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .dist import DistInfo, all_reduce_sum


class Totals:
    """Named running sums kept on the device in float64, reduced over ranks on demand.

    Summing per-rank sums and counts gives the exact global mean; averaging per-rank means
    does not when ranks hold different numbers of samples. The names are fixed by the first
    `add` and kept in sorted order, so every rank reduces the same vector.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.names: list[str] = []
        self.sums = torch.zeros(0, dtype=torch.float64, device=device)

    def add(self, **values) -> None:
        if not self.names:
            self.names = sorted(values)
            self.sums = torch.zeros(len(self.names), dtype=torch.float64, device=self.device)
        for name, value in values.items():
            self.sums[self.names.index(name)] += value

    def reduced(self) -> dict[str, float]:
        """Global sums; a collective, so every rank must call it."""
        total = all_reduce_sum(self.sums.clone())
        return dict(zip(self.names, total.tolist(), strict=True))


def real_sample_mask(first_position: int, batch_size: int, info: DistInfo, dataset_size: int, device) -> torch.Tensor:
    """True for the samples of this batch that are not DistributedSampler padding.

    DistributedSampler(drop_last=False) repeats samples until every rank has the same count
    and gives rank r the global positions r, r + world, r + 2*world, ...; positions past
    the end of the dataset are the repeats, so they are masked out and nothing counts twice.
    """
    positions = torch.arange(first_position, first_position + batch_size, device=device)
    return positions * info.world_size + info.rank < dataset_size


class TrainingLog:
    """Loss, throughput and data-wait share over each logging window, exact across ranks.

    `record()` runs every micro-batch and costs one device add and no host sync. `flush()` is
    the loop's one regular collective: it also carries the stop request, so every rank learns
    of a preemption or a non-finite loss at the same step. Rank 0 appends every record to
    metrics.jsonl and prints the log, evaluation and summary lines.
    """

    def __init__(self, info: DistInfo, jsonl_path, total_steps: int, first_step: int):
        self.info = info
        self.jsonl_path = Path(jsonl_path)
        if info.is_main:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        self.bar = tqdm(
            total=total_steps,
            initial=first_step,
            disable=not (info.is_main and sys.stderr.isatty()),
            dynamic_ncols=True,
        )
        self.evaluations: list[dict] = []
        self.run_start, self.run_samples = time.perf_counter(), 0
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.info.device)
        self.terms, self.samples, self.data_wait = 0.0, 0, 0.0
        self.window_start = time.perf_counter()

    def record(self, loss_sum: torch.Tensor, terms: float, samples: int, data_wait: float) -> None:
        """One optimizer step of this rank: its summed loss (on the device) and its loss terms."""
        self.loss_sum += loss_sum
        self.terms += terms
        self.samples += samples
        self.data_wait += data_wait

    def flush(self, step: int, epoch: int, lr: float, stop_requested: bool) -> dict:
        host = torch.tensor([self.terms, self.samples, self.data_wait, float(stop_requested)], dtype=torch.float64)
        sums = all_reduce_sum(torch.cat([self.loss_sum.view(1), host.to(self.info.device)])).tolist()
        loss_sum, terms, samples, data_wait, stops = sums
        elapsed = time.perf_counter() - self.window_start
        self.run_samples += int(samples)
        record = {
            "step": step,
            "epoch": epoch,
            "loss": loss_sum / max(terms, 1.0),  # per loss term over every rank: exact, not a mean of means
            "lr": lr,
            "samples_per_s": samples / elapsed,
            "data_wait_share": data_wait / (elapsed * self.info.world_size),
            "stop": stops > 0,
        }
        self.write(record)
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}", samples_s=f"{record['samples_per_s']:.0f}")
        if self.bar.disable:
            self.print(
                f"step {step} | epoch {epoch} | loss {record['loss']:.4f} | lr {lr:.2e} | "
                f"{record['samples_per_s']:.0f} samples/s | data wait {record['data_wait_share']:.0%}"
            )
        self.reset()
        return record

    def evaluation(self, step: int, epoch: int, results: dict) -> None:
        """Record and print one evaluation (rank 0 writes; every rank keeps the history)."""
        self.evaluations.append({"step": step, "epoch": epoch, **results})
        self.write(self.evaluations[-1])
        shown = " | ".join(f"{k.removeprefix('eval_')} {v:.4f}" for k, v in results.items() if k != "eval_samples")
        self.print(f"eval step {step} | epoch {epoch} | {shown} | {results['eval_samples']} samples")

    def summary(self, steps: int, main_metric: tuple[str, str], run_dir: Path) -> str:
        """One line for the end of a run: steps, wall time, throughput, best and final evaluation."""
        wall = time.perf_counter() - self.run_start
        line = f"done: {steps} steps in {wall:.1f} s ({self.run_samples / wall:,.0f} samples/s)"
        name, goal = main_metric
        key = f"eval_{name}"
        scored = [e for e in self.evaluations if key in e]
        if scored:
            best = (max if goal == "max" else min)(scored, key=lambda e: e[key])
            line += f"; eval {name}: best {best[key]:.4f} at step {best['step']}, final {scored[-1][key]:.4f}"
        return f"{line}; outputs in {run_dir}"

    def write(self, record: dict) -> None:
        """Append one JSON line on rank 0."""
        if self.info.is_main:
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps({k: v for k, v in record.items() if k != "stop"}) + "\n")

    def print(self, line: str) -> None:
        """A line on rank 0's console that does not break the progress bar."""
        if self.info.is_main:
            if self.bar.disable:
                print(line, flush=True)
            else:
                self.bar.write(line)

    def close(self) -> None:
        self.bar.close()
