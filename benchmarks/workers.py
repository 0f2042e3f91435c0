"""Per-rank loader-worker sizing against a naive fixed worker count.

    python benchmarks/workers.py [--pairs 3] [--naive 8]

A dataset whose samples each cost CPU work (as decoding and augmenting images do) is read by
2 ranks launched with torchrun; each rank also runs a small training step per batch. Run A
uses the generated project's sizing (`workers_per_rank`: the rank's share of the CPUs minus
itself, capped), run B a fixed `--naive` workers per rank, interleaved A B A B. Prints the
samples/s of each and the ratio.
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

from overhead import bake, torchrun


class CostlySamples:
    """Samples that take CPU work to produce, like decoded and augmented images."""

    def __init__(self, size: int, work: int):
        self.size, self.work = size, work

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        import torch

        generator = torch.Generator().manual_seed(index)
        image = torch.rand(3, 48, 48, generator=generator)
        for _ in range(self.work):
            image = torch.nn.functional.avg_pool2d(image, 3, stride=1, padding=1) * 1.01
        return image.flatten()[:256], index % 10


def worker_main(num_workers: int, batches: int, out: str) -> None:
    """Runs inside torchrun: read `batches` batches through DDP and report samples/s."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dataset = CostlySamples(size=64 * batches * dist.get_world_size(), work=8)
    loader = DataLoader(
        dataset,
        batch_size=32,
        sampler=DistributedSampler(dataset, drop_last=True),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        drop_last=True,
    )
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start, seen = None, torch.zeros(1)
    for step, (inputs, targets) in enumerate(loader):
        if step == 2:  # workers started and warm
            start, seen = time.perf_counter(), torch.zeros(1)
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seen += len(targets)
    dist.all_reduce(seen)
    if dist.get_rank() == 0:
        Path(out).write_text(str(seen.item() / (time.perf_counter() - start)))
    dist.barrier()
    dist.destroy_process_group()


def run(project: Path, num_workers: int, batches: int, scratch: Path) -> float:
    out = scratch / f"rate-{time.monotonic_ns()}"
    command = torchrun(
        __file__,
        "--worker",
        str(num_workers),
        "--batches",
        str(batches),
        "--out",
        str(out),
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(project / "src"))
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, timeout=900)
    return float(out.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--naive", type=int, default=8, help="the fixed worker count per rank to compare with")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker_main(args.worker, args.batches, args.out)
        return 0

    with tempfile.TemporaryDirectory() as scratch:
        project = bake(Path(scratch))
        sys.path.insert(0, str(project / "src"))
        from ddp_trainer.dist import cpus_available
        from ddp_trainer.loaders import workers_per_rank

        sized = workers_per_rank(cpus_available(), 2, cap=8)
        rates = {"sized": [], "naive": []}
        for _ in range(args.pairs):
            rates["sized"].append(run(project, sized, args.batches, Path(scratch)))
            rates["naive"].append(run(project, args.naive, args.batches, Path(scratch)))
    ratios = [a / b for a, b in zip(rates["sized"], rates["naive"], strict=True)]
    print(f"{cpus_available()} CPUs, 2 ranks: sized = {sized} workers per rank, naive = {args.naive}")
    print("| loader | workers per rank | samples/s (median) |\n|---|---|---|")
    print(f"| sized | {sized} | {statistics.median(rates['sized']):.0f} |")
    print(f"| naive | {args.naive} | {statistics.median(rates['naive']):.0f} |")
    print(f"sized / naive samples/s: {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
