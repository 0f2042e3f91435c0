"""Steady-state speed of the generated loop and the bare loop, alternating in the same processes.

Run by overhead.py under torchrun. Both loops are built once; then chunks of optimizer steps
alternate (ours, bare, bare, ours, ...), each timed between barriers, so drifts in machine
load hit both alike. Rank 0 writes the chunk times (wall, CPU) to $BENCH_TIMINGS.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as torch_dist
from bare_loop import BareLoop
from ddp_trainer import config, train
from ddp_trainer.base import dist, preemption
from ddp_trainer.base.dist import DistInfo


def timed(run) -> tuple[float, float]:
    """(wall seconds, CPU seconds summed over ranks) of one chunk.

    CPU time is what a loop's own overhead costs; unlike wall time it barely moves when a
    busy machine takes the processor away from a rank for a while.
    """
    torch_dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    cpu = torch.tensor([time.process_time() - cpu])
    torch_dist.barrier()
    wall = time.perf_counter() - wall
    torch_dist.all_reduce(cpu)
    return wall, cpu.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--chunk-steps", type=int, default=40)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = config.load(args.config, args.overrides)
    info = DistInfo.from_env()
    return dist.run_in_group(info, cfg.dist.timeout_minutes, lambda: alternate(args, cfg, info))


def alternate(args: argparse.Namespace, cfg: config.Config, info: DistInfo) -> int:
    job = train.build(cfg, info)  # sets the threads per rank (1 here) as a real run does
    bare = BareLoop(cfg)
    log = train.training_log(job, cfg, info)
    never_preempted = preemption.PreemptionFlag(signals=())

    def ours():
        job.total_steps = job.state.step + args.chunk_steps  # the chunk ends like a run at its last step
        train.train_one_epoch(job, cfg, info, log, never_preempted)

    def baseline():
        bare.run(args.chunk_steps)

    ours(), baseline()  # warm-up: first-call costs are start-up, not steady state
    times = {"ours": [], "bare": []}
    for chunk in range(args.chunks):
        order = (("ours", ours), ("bare", baseline)) if chunk % 2 == 0 else (("bare", baseline), ("ours", ours))
        for name, run in order:
            times[name].append(timed(run))
    if info.is_main:
        with open(os.environ["BENCH_TIMINGS"], "w") as f:
            json.dump({"chunk_steps": args.chunk_steps, **times}, f)
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
