"""Evaluation, exact on any world size: every sample counted once, in batches that do not depend
on the world size (samplers.EvalBatches).

The task gives either or both of
- per-sample sums (`eval_sums` -> `metrics`): summed on each rank in float64, then over ranks;
  constant memory, one all-reduce;
- dataset-level metrics (`eval_outputs` -> `dataset_metrics`): what the metric needs of each sample
  (detections, an embedding), moved to the host as each batch ends, gathered to rank 0 in dataset
  order, and the metric computed there once (mAP, AUC, corpus BLEU), with `reference`, the outputs
  of the task's reference set (training embeddings for a kNN accuracy), gathered the same way.
  A rank holds its share of the outputs, rank 0 all of them, on the host; the device, one batch.
The model runs in eval mode, without gradients; gather_from_ranks stands for one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import task
from ..base import dist, hardware, records, scalars
from ..base.across_ranks import as_one_process
from ..base.batching import move_to
from ..base.dist import DistInfo, all_reduce_sum
from .preflight import TaskError, check_outputs

if TYPE_CHECKING:
    from ..config import Config

HOST = torch.device("cpu")


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, cfg: Config, info: DistInfo, reference=None) -> dict:
    """The task's metrics over every sample of `loader` exactly once, whatever the world size, as
    metrics.jsonl records them (records.evaluation); `reference`: the loader of the task's reference
    set (loaders.reference_loader), or None. Leaves the model in train mode."""
    model = dist.without_ddp(model)  # no collective in a forward: DDP's would sync buffers
    # DDP sends rank 0's buffers at the start of each forward, so after a step every rank holds
    # BatchNorm statistics of its own batch: evaluate rank 0's, the model the checkpoint saves
    dist.broadcast_buffers(model)
    model.eval()
    try:
        with as_one_process(), scalars.paused(), hardware.autocast(cfg.train.precision, info.device):
            totals, outputs = run_over(model, loader, info)
            references = run_over(model, reference, info)[1] if reference is not None else None
    finally:
        model.train()
    results, samples = {}, None
    if totals is not None:
        reduced = totals.reduced() if info.distributed else totals.local()
        results, samples = task.metrics(reduced), int(reduced["samples"])
    if outputs is not None:
        gathered = in_dataset_order(outputs, len(loader.dataset), info)
        references = in_dataset_order(references, len(reference.dataset), info) if references is not None else None
        results |= dataset_metrics(cfg, gathered, references, info)
        samples = len(loader.dataset)
    if task.MAIN_METRIC[0] not in results:
        raise TaskError(
            f"task.MAIN_METRIC is {task.MAIN_METRIC!r}, but the evaluation gave {', '.join(results) or 'no metric'}; "
            "name one of them"
        )
    return records.evaluation(results, samples)


def dataset_metrics(cfg: Config, outputs, references, info: DistInfo) -> dict[str, float]:
    """task.dataset_metrics, computed once on rank 0, on every rank; a mistake in it is every rank's."""
    computed = None
    if info.is_main:
        try:
            computed = {name: float(value) for name, value in task.dataset_metrics(cfg, outputs, references).items()}
        except Exception as err:
            computed = f"task.dataset_metrics(cfg, outputs, reference) raised {type(err).__name__}: {err}"
    computed = dist.broadcast_object(computed) if info.distributed else computed
    if isinstance(computed, str):
        raise TaskError(f"{computed}; expected a dict of numbers")
    return computed


def run_over(model: nn.Module, loader: DataLoader, info: DistInfo) -> tuple[Totals | None, list | None]:
    """This rank's batches of `loader`: the sums of `eval_sums` and the batches' `eval_outputs`
    (their first sample's index, the outputs on the host), each None where the task has none."""
    totals = Totals(info.device) if hasattr(task, "eval_sums") else None
    outputs = [] if hasattr(task, "eval_outputs") else None
    for (indices, repeat), batch in zip(loader.batch_sampler.plan, loader, strict=True):
        batch = task.to_device(batch, info.device)
        if totals is not None:
            sums = task.eval_sums(model, batch)
            kept = 0 if repeat else 1  # a repeat adds zeros: every rank names every sum
            totals.add(samples=kept * len(indices), **{name: values.sum() * kept for name, values in sums.items()})
        if outputs is not None:
            batch_outputs = task.eval_outputs(model, batch)
            if not repeat:
                outputs.append((indices[0], move_to(check_outputs(batch_outputs, len(indices)), HOST)))
    return totals, outputs


def in_dataset_order(outputs: list, size: int, info: DistInfo):
    """Every rank's batch outputs on rank 0, joined in dataset order: a list of per-sample items, or
    a dict of tensors concatenated along dimension 0; None on the other ranks."""
    gathered = dist.gather_to_main(outputs) if info.distributed else [outputs]
    if gathered is None:
        return None
    batches = [batch for _, batch in sorted((item for rank in gathered for item in rank), key=lambda item: item[0])]
    if batches and isinstance(batches[0], dict):
        joined = {name: torch.cat([batch[name] for batch in batches]) for name in batches[0]}
        counted = len(next(iter(joined.values()), ()))
    else:
        joined = [item for batch in batches for item in batch]
        counted = len(joined)
    if counted != size:  # each sample once: a loop bug otherwise
        raise RuntimeError(f"evaluation gathered {counted} outputs for {size} samples")
    return joined


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
        row = [torch.as_tensor(values[name], dtype=torch.float64, device=self.device) for name in self.names]
        self.sums += torch.stack(row)

    def reduced(self) -> dict[str, float]:
        """Global sums; a collective, so every rank must call it."""
        total = all_reduce_sum(self.sums.clone())
        return dict(zip(self.names, total.tolist(), strict=True))

    def local(self) -> dict[str, float]:
        """This rank's sums: those of a world of one."""
        return dict(zip(self.names, self.sums.tolist(), strict=True))
