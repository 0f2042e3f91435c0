"""Checkpoint formats side by side in one run: how long the loop is blocked per save, and the
bytes each rank writes.

    python benchmarks/checkpoints.py            # the language-model starter at 6 x 512 (19M parameters), 4 rounds
    python benchmarks/checkpoints.py --quick    # seconds: its test size (2 x 64), 1 round

Bakes the language-model starter and launches itself under torchrun on 2 CPU processes of 1
thread (gloo). One launch builds three setups with the loop's own train.build: checkpoint.format
full (gathered to rank 0, one file), sharded (every rank its part, DCP), sharded with
checkpoint.async_save. Round after round, each setup trains a few optimizer steps through the
loop's own step, then saves through the loop's own save_checkpoint, timed on the loop's thread:
the blocked time (for async: staging, the copy to CPU memory; the write overlaps the next
steps). Printed per setup: the median blocked time per save and its ratio to full's, the time
of the steps right after it (async: the write goes on behind them), what the write still needed
after those steps (the next save would wait for it), and the bytes of each rank's part.
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
    "full": ["checkpoint.format=full"],
    "sharded": ["checkpoint.format=sharded"],
    "sharded, async": ["checkpoint.format=sharded", "checkpoint.async_save=true"],
}
COMMON = ["train.precision=fp32", "data.num_workers=0", "checkpoint.resume=never", "checkpoint.keep_last=1"]
LARGER = ["model.layers=6", "model.width=512", "model.heads=8", "model.context=128"]  # 19M parameters


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few steps, to check the script runs")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # the baked project, under torchrun
    parser.add_argument("--rounds", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--larger", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return work(args.worker, args.rounds, LARGER if args.larger else [])
    from overhead import bake_task

    with tempfile.TemporaryDirectory(prefix="checkpoints-") as out:
        project = bake_task(Path(out), "language_model")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        command += [__file__, "--worker", str(project), "--rounds", str(1 if args.quick else args.rounds)]
        command += [] if args.quick else ["--larger"]
        return subprocess.run(command, cwd=project, env=dict(os.environ, OMP_NUM_THREADS="1")).returncode


def work(project: Path, rounds: int, model: list[str]) -> int:
    sys.path.insert(0, str(project / "src"))
    sys.path.insert(0, str(HERE))
    from ddp_trainer import config, train
    from ddp_trainer.base import dist
    from ddp_trainer.base.batching import unwrap
    from ddp_trainer.base.dist import DistInfo
    from ddp_trainer.loop import sharded_checkpoint
    from sharded import chunk

    info = DistInfo.from_env()
    steps = 2

    def measure() -> int:
        jobs = {}
        for index, (name, overrides) in enumerate(SETUPS.items()):
            settings = [*COMMON, *model, *overrides, f"run.out_dir={project}/runs", f"run.name=setup{index}"]
            cfg = config.load(project / "configs" / "smoke.yaml", settings)
            jobs[name] = (cfg, train.build(cfg, info))
        times = {name: {"blocked": [], "steps": [], "left": []} for name in SETUPS}
        for _ in range(rounds + 1):  # the first round warms up (DCP's imports, the async group)
            for name, (cfg, job) in jobs.items():
                chunk(job, cfg, info, 1)
                start = time.perf_counter()
                train.save_checkpoint(job, cfg, info)
                middle = time.perf_counter()
                step = chunk(job, cfg, info, steps)  # async: the write goes on behind these steps
                end = time.perf_counter()
                sharded_checkpoint.WRITES.wait()  # what the write still needed: the next save would wait for it
                measured = (middle - start, step, time.perf_counter() - end)
                for key, seconds in zip(("blocked", "steps", "left"), measured, strict=True):
                    times[name][key].append(seconds)
                job.state.step += 1  # the next save is another step's
        rows = [
            (name, *(statistics.median(times[name][key][1:]) for key in ("blocked", "steps", "left")), part_bytes(path))
            for name, (cfg, job) in jobs.items()
            for path in [cfg.run_dir.saved_checkpoints()[-1]]
        ]
        params = sum(p.numel() for p in unwrap(jobs["full"][1].model).parameters())
        dist.print0(info, table(rows, info.world_size, rounds, params, model))
        return 0

    return dist.run_in_group(info, 10, measure)


def part_bytes(path: Path) -> list[int]:
    """Bytes of each rank's part: a file's one part, or a sharded checkpoint's .distcp files."""
    if path.is_file():
        return [path.stat().st_size]
    return [part.stat().st_size for part in sorted(path.glob("*.distcp"))]


def table(rows, world_size: int, rounds: int, params: int, model: list[str]) -> str:
    size = " ".join(model) or "the test size"
    lines = [
        f"{params / 1e6:.1f}M parameters ({size}), {world_size} CPU ranks (gloo), median of {rounds} saves",
        f"{'format':<16} {'blocked/save':>13} {'vs full':>8} {'step after':>11} {'write left':>11} "
        f"{'MiB per rank':>16}",
    ]
    full = rows[0][1]
    for name, blocked, step, left, parts in rows:
        per_rank = " + ".join(f"{part / 2**20:.1f}" for part in parts)
        lines.append(
            f"{name:<16} {blocked * 1e3:>10.0f} ms {blocked / full:>7.2f}x {step * 1e3:>8.0f} ms {left * 1e3:>8.0f} ms "
            f"{per_rank:>16}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
