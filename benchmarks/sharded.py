"""parallel.strategy=fsdp against ddp, and activation checkpointing's cost, side by side in one run.

    python benchmarks/sharded.py                 # the language-model starter at 4 x 256, 10 steps a chunk, 4 rounds
    python benchmarks/sharded.py --quick         # seconds: its test size (2 x 64), 3 steps a chunk, 1 round

Bakes the language-model starter and launches itself under torchrun on 2 CPU processes of 1
thread (gloo). One launch builds the four setups (ddp and fsdp, each without and with
parallel.activation_checkpointing=full) with the loop's own train.build, then runs chunks of
optimizer steps through the loop's own step (train_step), setup after
setup, round after round, so drifts in machine load hit all alike. Printed per setup: the median
step time and its ratio to ddp's; each rank's bytes of weights, gradients and optimizer state
(what FSDP shards) and the bytes autograd saved for backward in one step (what checkpointing
trades for recompute; no CUDA allocator here to ask, so counted as the tensors are saved).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETUPS = {
    "ddp": ["parallel.strategy=ddp"],
    "ddp + checkpointing": ["parallel.strategy=ddp", "parallel.activation_checkpointing=full"],
    "fsdp": ["parallel.strategy=fsdp"],
    "fsdp + checkpointing": ["parallel.strategy=fsdp", "parallel.activation_checkpointing=full"],
}
COMMON = ["train.precision=fp32", "data.num_workers=0", "checkpoint.resume=never", "run.tensorboard=false"]
LARGER = ["model.layers=4", "model.width=256", "model.heads=4", "model.context=128"]  # 3.3M parameters


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few steps, to check the script runs")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # the baked project, under torchrun
    parser.add_argument("--steps", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--larger", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return work(args.worker, args.steps, args.rounds, LARGER if args.larger else [])
    from overhead import bake_task

    steps, rounds = (3, 1) if args.quick else (args.steps, args.rounds)
    with tempfile.TemporaryDirectory(prefix="sharded-") as out:
        project = bake_task(Path(out), "language_model")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        command += [__file__, "--worker", str(project), "--steps", str(steps), "--rounds", str(rounds)]
        command += [] if args.quick else ["--larger"]
        return subprocess.run(command, cwd=project, env=dict(os.environ, OMP_NUM_THREADS="1")).returncode


def work(project: Path, steps: int, rounds: int, model: list[str]) -> int:
    sys.path.insert(0, str(project / "src"))
    from ddp_trainer import config, train
    from ddp_trainer.base import dist
    from ddp_trainer.base.batching import unwrap
    from ddp_trainer.base.dist import DistInfo
    from ddp_trainer.loop import parallel

    info = DistInfo.from_env()

    def measure() -> int:
        jobs = {}
        for name, overrides in SETUPS.items():
            settings = [*COMMON, *model, *overrides, f"run.out_dir={project}/runs"]
            cfg = config.load(project / "configs" / "smoke.yaml", settings)
            jobs[name] = (cfg, train.build(cfg, info))
        times = {name: [] for name in SETUPS}
        for _ in range(rounds):
            for name, (cfg, job) in jobs.items():
                times[name].append(chunk(job, cfg, info, steps))
        rows = []
        for name, (cfg, job) in jobs.items():
            step = statistics.median(times[name])
            rows.append((name, step, held_bytes(job, parallel), saved_bytes(job, cfg, info)))
        params = sum(p.numel() for p in unwrap(jobs["ddp"][1].model).parameters())
        dist.print0(info, table(rows, info.world_size, steps, rounds, params, model))
        return 0

    return dist.run_in_group(info, 10, measure)


def batches(job, accum: int):
    """Endless micro-batches from the job's own loader, epoch after epoch."""
    while True:
        yield from job.train_loader


def chunk(job, cfg, info, steps: int) -> float:
    """Seconds per optimizer step over `steps` steps of the loop's own step."""
    from ddp_trainer import train

    source = getattr(job, "_source", None) or batches(job, cfg.train.grad_accum_steps)
    job._source = source
    job.model.train()
    start = time.perf_counter()
    for _ in range(steps):
        micro_batches = [next(source) for _ in range(cfg.train.grad_accum_steps)]
        train.train_step(job, micro_batches, cfg, info)
    return (time.perf_counter() - start) / steps


def held_bytes(job, parallel) -> int:
    """This rank's bytes of weights, gradients (as many as the weights) and optimizer state."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in job.model.parameters()]
    weights = sum(t.numel() * t.element_size() for t in local)
    states = [v for state in job.state.optimizer.state.values() for v in state.values()]
    optimizer = sum(
        (v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size()
        for v in states
        if hasattr(v, "dim") and v.dim() > 0
    )
    return 2 * weights + optimizer


def saved_bytes(job, cfg, info) -> int:
    """Bytes of the tensors autograd saves for backward in one micro-batch's forward (recomputed
    units save only their inputs)."""
    import torch
    from ddp_trainer import task, train

    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    batch = task.to_device(next(iter(job.train_loader)), info.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), train.autocast(cfg, info):
        loss = task.loss_sum(job.model, batch)
    loss.backward()
    job.model.zero_grad(set_to_none=True)
    return sum(saved)


def table(rows: list, world_size: int, steps: int, rounds: int, params: int, model: list[str]) -> str:
    ddp_step, ddp_held, ddp_saved = rows[0][1], rows[0][2], rows[0][3]
    lines = [
        f"language-model starter, configs/smoke.yaml {' '.join(model)} ({params / 1e6:.1f}M parameters), fp32, "
        f"{world_size} CPU ranks, median of {rounds} chunks of {steps} steps",
        "| setup | ms/step | vs ddp | state bytes a rank | vs ddp | saved for backward | vs ddp |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, step, held, saved in rows:
        lines.append(
            f"| {name} | {step * 1e3:.1f} | {step / ddp_step:.2f} | {held / 2**20:.2f} MiB | {held / ddp_held:.2f} "
            f"| {saved / 2**20:.2f} MiB | {saved / ddp_saved:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
