"""Metrics that are exact across ranks: reduce sums and counts, never means (P26)."""

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
    does not when ranks hold different numbers of samples.
    """

    def __init__(self, names: tuple[str, ...], device: torch.device):
        self.names = names
        self.sums = torch.zeros(len(names), dtype=torch.float64, device=device)

    def add(self, **values) -> None:
        for name, value in values.items():
            self.sums[self.names.index(name)] += value

    def reduced(self) -> dict[str, float]:
        """Global sums; a collective, so every rank must call it."""
        total = all_reduce_sum(self.sums.clone())
        return dict(zip(self.names, total.tolist(), strict=True))

    def reset(self) -> None:
        self.sums.zero_()


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

    `record()` runs every micro-batch, so it costs one device add and no host sync.
    `flush()` is the loop's one regular collective: it also carries the stop request, so
    every rank learns of a preemption or a non-finite loss at the same step.
    """

    def __init__(self, info: DistInfo, jsonl_path, total_steps: int):
        self.info = info
        self.jsonl_path = Path(jsonl_path)
        if info.is_main:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        self.bar = tqdm(total=total_steps, disable=not (info.is_main and sys.stderr.isatty()), dynamic_ncols=True)
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.info.device)
        self.micro_batches, self.samples, self.data_wait = 0, 0, 0.0
        self.window_start = time.perf_counter()

    def record(self, loss: torch.Tensor, batch_size: int, data_wait: float) -> None:
        # micro-batches are equal-sized (drop_last), so the mean of their means is the sample mean
        self.loss_sum += loss.detach()
        self.micro_batches += 1
        self.samples += batch_size
        self.data_wait += data_wait

    def flush(self, step: int, epoch: int, lr: float, stop_requested: bool) -> dict:
        host = torch.tensor(
            [self.micro_batches, self.samples, self.data_wait, float(stop_requested)], dtype=torch.float64
        )
        sums = all_reduce_sum(torch.cat([self.loss_sum.view(1), host.to(self.info.device)])).tolist()
        loss_sum, micro_batches, samples, data_wait, stops = sums
        elapsed = time.perf_counter() - self.window_start
        record = {
            "step": step,
            "epoch": epoch,
            "loss": loss_sum / max(micro_batches, 1),
            "lr": lr,
            "samples_per_s": samples / elapsed,
            "data_wait_share": data_wait / (elapsed * self.info.world_size),
            "stop": stops > 0,
        }
        self.write(record)
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}")
        if self.bar.disable and self.info.is_main:
            print(
                f"step {step} | epoch {epoch} | loss {record['loss']:.4f} | lr {lr:.2e} | "
                f"{record['samples_per_s']:.0f} samples/s | data wait {record['data_wait_share']:.0%}",
                flush=True,
            )
        self.reset()
        return record

    def write(self, record: dict) -> None:
        """Append one JSON line on rank 0."""
        if self.info.is_main:
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps({k: v for k, v in record.items() if k != "stop"}) + "\n")

    def close(self) -> None:
        self.bar.close()
