"""The training entry point with one injected fault, for the fault drills in test_faults.py.

    FAULT=crash FAULT_RANK=1 FAULT_STEP=45 [FAULT_ONCE=path] torchrun ... tests/faulty_train.py --config ...
      crash: raise in rank FAULT_RANK's optimizer step number FAULT_STEP (with FAULT_ONCE,
             only if that file does not exist yet; it is created, so a restart runs clean)
      nan:   rank FAULT_RANK's loss becomes NaN from step FAULT_STEP
      data:  rank FAULT_RANK's dataset raises when it reads a sample in step FAULT_STEP
      stall: rank FAULT_RANK sleeps FAULT_SECONDS before step FAULT_STEP (a stuck rank)
      slow:  every rank sleeps FAULT_SECONDS after each step (time to send a signal)
      slow_publish: rank 0 sleeps FAULT_SECONDS before it publishes step FAULT_STEP's sharded
             checkpoint, every part of it on disk (time to kill a rank in the middle of a save)
      fetch: the model build downloads FAULT_CACHE/weights (FAULT_SECONDS long) unless the file
             is there, as torchvision's pretrained weights do; each download adds its rank to
             FAULT_CACHE/fetched
    Seam mistakes, on every rank (the preflight must stop them before training):
      wrong_output:    the model returns (B, C, 1) instead of (B, C) logits
      wrong_structure: the datasets yield {"sample": (...)} instead of the tuple the task unpacks
      bad_label:       the labels (last item of each sample) are shifted far out of range
    Not a fault: RECORD=PREFIX writes the training-set indices of each optimizer step's samples,
    one JSON line a step, to PREFIX-rank<RANK>.jsonl (the indices as the loop reads them: run it
    with data.num_workers=0).
The faults are injected from outside, through the task seam and the loop's own functions;
the project's code has no test hooks and nothing in torch is patched.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from {{ cookiecutter.package_name }} import task, train
from {{ cookiecutter.package_name }}.loop import sharded_checkpoint

FAULT = os.environ.get("FAULT", "")
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
FAULT_STEP = int(os.environ.get("FAULT_STEP", "3"))
FAULT_SECONDS = float(os.environ.get("FAULT_SECONDS", "0.05"))
RANK = int(os.environ.get("RANK", "0"))
RECORD = os.environ.get("RECORD")
original_step = train.train_step
steps_done = 0
read_since_last_step: list[int] = []


def should_fire() -> bool:
    once = os.environ.get("FAULT_ONCE")
    if once is None:
        return True
    if Path(once).exists():
        return False
    Path(once).touch()
    return True


def faulty_train_step(job, micro_batches, cfg, info):
    global steps_done
    steps_done = job.state.step + 1
    if RECORD:
        with open(f"{RECORD}-rank{RANK}.jsonl", "a") as record:
            record.write(json.dumps({"step": steps_done, "indices": read_since_last_step}) + "\n")
        read_since_last_step.clear()
    if FAULT == "crash" and RANK == FAULT_RANK and steps_done == FAULT_STEP and should_fire():
        raise RuntimeError(f"injected crash in step {steps_done}")
    if FAULT == "stall" and RANK == FAULT_RANK and steps_done == FAULT_STEP:
        time.sleep(FAULT_SECONDS)
    result = original_step(job, micro_batches, cfg, info)
    if FAULT == "slow":
        time.sleep(FAULT_SECONDS)
    return result


def slow_publish(partial, final, run_dir, keep_last, original=sharded_checkpoint.publish):
    if final == run_dir.checkpoint(FAULT_STEP, sharded=True):
        time.sleep(FAULT_SECONDS)
    original(partial, final, run_dir, keep_last)


def nan_loss_sum(model, batch, original=task.loss_sum):
    loss = original(model, batch)
    if RANK == FAULT_RANK and steps_done + 1 >= FAULT_STEP and loss.requires_grad:
        return loss * float("nan")
    return loss


class FailingReads:
    """Wraps a dataset; rank FAULT_RANK's reads fail from step FAULT_STEP on."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        if RANK == FAULT_RANK and steps_done + 1 >= FAULT_STEP:
            raise ValueError(f"injected data error reading sample {index}")
        return self.dataset[index]


def failing_datasets(cfg, original=task.build_datasets):
    train_set, eval_set = original(cfg)
    return FailingReads(train_set), eval_set


class Mapped:
    """A dataset whose samples (tuples) pass through `change`."""

    def __init__(self, dataset, change):
        self.dataset, self.change = dataset, change

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.change(*self.dataset[index])


class Recorded:
    """A training set that notes the indices the loop reads (in the loop's process: no workers)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        read_since_last_step.append(index)
        return self.dataset[index]


def recorded_datasets(cfg, original=task.build_datasets):
    train_set, eval_set = original(cfg)
    return Recorded(train_set), eval_set


def epoch_recorded(job, cfg, info, log, stop, original=train.train_one_epoch):
    read_since_last_step.clear()  # what the preflight read before training
    return original(job, cfg, info, log, stop)


def mistaken_datasets(cfg, original=task.build_datasets):
    if FAULT == "wrong_structure":
        change = lambda *sample: {"sample": sample}  # noqa: E731
    else:  # bad_label: the last item, the label, far out of range of any class or vocabulary
        change = lambda *sample: (*sample[:-1], sample[-1] + 10**6)  # noqa: E731
    return tuple(Mapped(dataset, change) for dataset in original(cfg))


def mistaken_model(cfg, original=task.build_model):
    return torch.nn.Sequential(original(cfg), torch.nn.Unflatten(1, (-1, 1)))


def fetching_model(cfg, original=task.build_model):
    cache = Path(os.environ["FAULT_CACHE"])
    if not (cache / "weights").exists():
        cache.mkdir(parents=True, exist_ok=True)
        with open(cache / "fetched", "a") as fetched:
            fetched.write(f"{RANK}\n")
        time.sleep(FAULT_SECONDS)
        partial = cache / f".weights-{RANK}"  # written beside, then renamed: never half a file
        partial.write_bytes(b"weights")
        partial.replace(cache / "weights")
    return original(cfg)


train.train_step = faulty_train_step
if FAULT == "wrong_output":
    task.build_model = mistaken_model
if FAULT in ("wrong_structure", "bad_label"):
    task.build_datasets = mistaken_datasets
if FAULT == "nan":
    task.loss_sum = nan_loss_sum
if FAULT == "data":
    task.build_datasets = failing_datasets
if FAULT == "fetch":
    task.build_model = fetching_model
if FAULT == "slow_publish":
    sharded_checkpoint.publish = slow_publish
if FAULT == "slow_publish":
    sharded_checkpoint.publish = slow_publish
if RECORD:
    task.build_datasets = recorded_datasets
    train.train_one_epoch = epoch_recorded

if __name__ == "__main__":
    sys.exit(train.main())
