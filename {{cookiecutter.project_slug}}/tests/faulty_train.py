"""The training entry point with one injected fault, for the fault drills in test_faults.py.

    FAULT=crash FAULT_RANK=1 FAULT_STEP=45 [FAULT_ONCE=path] torchrun ... tests/faulty_train.py --config ...
      crash: raise in rank FAULT_RANK's optimizer step number FAULT_STEP (with FAULT_ONCE,
             only if that file does not exist yet; it is created, so a restart runs clean)
      nan:   rank FAULT_RANK's loss becomes NaN from step FAULT_STEP
      data:  rank FAULT_RANK's dataset raises when it reads a sample in step FAULT_STEP
      stall: rank FAULT_RANK sleeps FAULT_SECONDS before step FAULT_STEP (a stuck rank)
      slow:  every rank sleeps FAULT_SECONDS after each step (time to send a signal)
The faults are injected by patching from outside; the project's code has no test hooks.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from {{ cookiecutter.package_name }} import data, train

FAULT = os.environ.get("FAULT", "")
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
FAULT_STEP = int(os.environ.get("FAULT_STEP", "3"))
FAULT_SECONDS = float(os.environ.get("FAULT_SECONDS", "0.05"))
RANK = int(os.environ.get("RANK", "0"))
original_step = train.optimizer_step
steps_done = 0


def should_fire() -> bool:
    once = os.environ.get("FAULT_ONCE")
    if once is None:
        return True
    if Path(once).exists():
        return False
    Path(once).touch()
    return True


def faulty_optimizer_step(state, cfg):
    global steps_done
    steps_done = state.step + 1
    if FAULT == "crash" and RANK == FAULT_RANK and steps_done == FAULT_STEP and should_fire():
        raise RuntimeError(f"injected crash in step {steps_done}")
    if FAULT == "stall" and RANK == FAULT_RANK and steps_done == FAULT_STEP:
        time.sleep(FAULT_SECONDS)
    original_step(state, cfg)
    if FAULT == "slow":
        time.sleep(FAULT_SECONDS)


def faulty_cross_entropy(logits, targets, original=torch.nn.functional.cross_entropy, **kwargs):
    loss = original(logits, targets, **kwargs)
    if RANK == FAULT_RANK and steps_done + 1 >= FAULT_STEP and logits.requires_grad:
        return loss * float("nan")
    return loss


class FaultyDataset(data.SyntheticClassification):
    reads = 0

    def __getitem__(self, index):
        FaultyDataset.reads += 1
        if RANK == FAULT_RANK and steps_done + 1 >= FAULT_STEP:
            raise ValueError(f"injected data error reading sample {index}")
        return super().__getitem__(index)


train.optimizer_step = faulty_optimizer_step
if FAULT == "nan":
    train.F.cross_entropy = faulty_cross_entropy
if FAULT == "data":
    data.SyntheticClassification = FaultyDataset

if __name__ == "__main__":
    sys.exit(train.main())
