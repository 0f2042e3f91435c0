"""The training entry point with a NaN put into one rank's shard of the weights just before the
checkpoint of step NAN_STEP, under parallel.strategy=fsdp: only that rank holds it, so every rank
refuses the checkpoint only if the ranks share what each found (test_sharded_checkpoints.py).

    NAN_RANK=1 NAN_STEP=2 torchrun --standalone --nproc_per_node=2 tests/nan_shard_train.py --config ...
"""

from __future__ import annotations

import os
import sys

import torch

from {{ cookiecutter.package_name }} import train

NAN_RANK = int(os.environ.get("NAN_RANK", "1"))
NAN_STEP = int(os.environ.get("NAN_STEP", "2"))
RANK = int(os.environ.get("RANK", "0"))
original_save = train.save_checkpoint


def save_with_a_nan_in_one_shard(job, cfg, info, final=False):
    if RANK == NAN_RANK and job.state.step == NAN_STEP:
        with torch.no_grad():  # the first weight this rank holds a part of
            shard = next(local for p in job.model.parameters() if (local := p.to_local()).numel())
            shard.view(-1)[0] = float("nan")
    return original_save(job, cfg, info, final)


train.save_checkpoint = save_with_a_nan_in_one_shard

if __name__ == "__main__":
    sys.exit(train.main())
